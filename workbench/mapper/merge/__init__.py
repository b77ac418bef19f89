"""Model merging as mapper operations: every mergekit 0.1.5 method, bit-identical where it is deterministic.

- `Merge` (op.py): one output tensor from the same-named tensors of several models, by one method, with
  parameters already resolved for that tensor. An op like every other: templates, export, workers, the plan.
- `MergeModels` / `merge` (models.py): a whole-checkpoint merge named before any source is opened; bound, it
  becomes one `Merge` per tensor, parameters resolved in mergekit's forms (`parameters.resolve`).
- `methods`: the methods (parameters, base model, input counts); kernels by family in `linear`, `spherical`,
  `task_arithmetic` and `stock`.

Each output tensor is one group of N inputs, so a merge holds one tensor per model at a time (see
docs/merging.md for the memory the plan predicts).
"""

from __future__ import annotations

from .methods import METHODS
from .models import MergeModels, merge
from .op import Merge
from .parameters import resolve

__all__ = ["METHODS", "Merge", "MergeModels", "merge", "resolve"]
