"""Device meshes from a ``--mesh`` spec string: ``"data=2,model=4"``.

The mesh always has both axes, ``data`` (batch rows: pure data parallelism, parameters
replicated) and ``model`` (tensor parallelism: weights and their deltas split), in that order;
an axis the spec leaves out has size 1. Axes are `AxisType.Auto`: the model code carries no
sharding annotations of its own, and XLA's SPMD partitioner propagates the parameter shardings.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)
# How a linear layer is split over ``model`` (`rules` decides, `ops` runs it): its output
# columns, its input rows, or not at all.
COLUMN, ROW, REPLICATED = "column", "row", "replicated"


def parse_mesh_spec(spec: str | None) -> dict[str, int]:
  """``"data=2,model=4"`` → ``{"data": 2, "model": 4}``; missing axes are 1. ``None``/``""``
  means all devices on ``model``, which the caller resolves (`make_mesh`)."""
  sizes = {DATA: 1, MODEL: 1}
  if not spec:
    return sizes
  seen = set()
  for part in spec.split(","):
    name, sep, value = part.strip().partition("=")
    name = name.strip()
    if not sep or name not in AXES:
      raise ValueError(f"bad mesh spec {spec!r}: expected 'data=D,model=M' (axes {AXES})")
    if name in seen:
      raise ValueError(f"bad mesh spec {spec!r}: axis {name!r} given twice")
    seen.add(name)
    try:
      sizes[name] = int(value)
    except ValueError:
      raise ValueError(f"bad mesh spec {spec!r}: {name}={value!r} is not an integer") from None
    if sizes[name] < 1:
      raise ValueError(f"bad mesh spec {spec!r}: {name} must be >= 1")
  return sizes


def make_mesh(spec: str | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ``(data, model)`` mesh over ``devices`` (default: all devices of all processes).

  ``spec`` None or empty puts every device on ``model``. The product of the sizes must equal
  the number of devices. Devices are laid out by `jax.make_mesh` (``model`` innermost, so a
  tensor-parallel group stays within a host / NVLink domain when it can).
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = parse_mesh_spec(spec)
  if not spec:
    sizes[MODEL] = len(devices)
  shape = (sizes[DATA], sizes[MODEL])
  if math.prod(shape) != len(devices):
    raise ValueError(
      f"mesh {DATA}={shape[0]},{MODEL}={shape[1]} needs {math.prod(shape)} devices, "
      f"{len(devices)} are available"
    )
  try:
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 2, devices=devices)
  except (ValueError, NotImplementedError):  # device kinds make_mesh cannot lay out
    return Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=(AxisType.Auto,) * 2)


def mesh_spec(mesh: Mesh) -> str:
  return ",".join(f"{a}={mesh.shape[a]}" for a in AXES)
