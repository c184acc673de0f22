"""Model merging on parameter trees (dicts of arrays) and HF checkpoints.

Tree functions take a base tree and fine-tuned trees of the same structure and return a merged
tree; each has a jit-able per-tensor form (``*_tensor``) that the streaming CLI
(`bitdelta_jax.merge.cli`) uses. Method notes and differences from mergekit: docs/MERGING.md.
"""

from bitdelta_jax.merge.baselines import (
  dare_linear,
  dare_ties,
  linear,
  linear_tensor,
  sign_mask,
  task_arithmetic,
  task_arithmetic_family_tensor,
  tensor_key,
  ties,
)
from bitdelta_jax.merge.monosoup import (
  entropy_effective_rank,
  monosoup,
  monosoup_tensor,
  split_rank,
)
from bitdelta_jax.merge.opcm import (
  OPCMState,
  opcm,
  opcm_init,
  opcm_merged,
  opcm_update,
  project_task_vector,
)
from bitdelta_jax.merge.soups import SvdSoupHook, svd_soup, svd_soup_tensor, truncate_rank
from bitdelta_jax.merge.sparsify import (
  magnitude_mask,
  random_mask,
  rescale_l1,
  sparsify_magnitude,
  sparsify_random,
)

__all__ = [
  "OPCMState",
  "SvdSoupHook",
  "dare_linear",
  "dare_ties",
  "entropy_effective_rank",
  "linear",
  "linear_tensor",
  "magnitude_mask",
  "monosoup",
  "monosoup_tensor",
  "opcm",
  "opcm_init",
  "opcm_merged",
  "opcm_update",
  "project_task_vector",
  "random_mask",
  "rescale_l1",
  "sign_mask",
  "sparsify_magnitude",
  "sparsify_random",
  "split_rank",
  "svd_soup",
  "svd_soup_tensor",
  "task_arithmetic",
  "task_arithmetic_family_tensor",
  "tensor_key",
  "ties",
  "truncate_rank",
]
