"""bench/common/report.py: the JSON carries the machine, the markdown and the figure go beside it."""

from __future__ import annotations

import json

from bench.common import report


def test_results_carry_the_machine(tmp_path):
  md = report.write(tmp_path / "area" / "x", {"rows": [1]}, ["# x", "", "| a |"])
  res = json.loads((tmp_path / "area" / "x.json").read_text())
  assert res["rows"] == [1] and res["machine"]["cpu"]
  assert md == tmp_path / "area" / "x.md" and md.read_text() == "# x\n\n| a |\n"


def test_a_given_machine_is_kept_and_numpy_scalars_are_plain(tmp_path):
  import numpy as np

  report.write(tmp_path / "y", {"machine": {"cpu": "c"}, "v": np.float32(0.5)}, None)
  assert json.loads((tmp_path / "y.json").read_text()) == {"machine": {"cpu": "c"}, "v": 0.5}
  assert not (tmp_path / "y.md").exists()
