"""What a merge holds besides its inputs and its output: the method's scratch, for the plan's memory prediction.

The planner counts a group's inputs and outputs; a merge also allocates work tensors whose size follows from
the method's operations (see the kernel modules): `linear` one float32 accumulator, `slerp` a few slices of
2^20 float32 elements, the task-arithmetic family its stacked task vectors plus the sparsification (TIES and
breadcrumbs: an in-place sort of the magnitudes with int64 indices, before any task vector is stacked, the masks
kept as bits) or the sign vote's masks of one 2^20-element slice, and so on. The figures are the peak of live
work tensors in each kernel, counted from its code, in the compute dtype; a cast of the inputs into `dtype`
adds one copy of each input it changes. TIES and breadcrumbs make their output last, and give their inputs' pages
back for the sorts when the engine mapped them from their files (`mapped_inputs`): their sorts' phase then holds
only the magnitudes, the indices and the masks, which is what makes a 3-model TIES peak at a fifth of mergekit's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...dtypes import dtype_bits

CHUNK = 1 << 20  # elements per slice of slerp's passes


def _bytes(dtype: str) -> int:
    return max(1, dtype_bits(dtype) // 8)


def scratch_bytes(method: str, dtypes: Sequence[str], numel: int, compute: str, non_base: int, options: Any = None,
                  unmade: int = 0, given_back: int = 0) -> int:
    """Peak bytes of work tensors of `method` merging len(dtypes) inputs of `numel` elements in dtype `compute`
    (`non_base` of them besides the base), beyond the inputs and the output the plan counts throughout. A kernel
    whose first phases come before its output is made passes the output's bytes as `unmade`, and the inputs' bytes
    as `given_back` when it gives their pages back for its sorts (`mapped_inputs`): those phases may then need less
    than the inputs and the output (the figure is negative when they are the whole peak)."""
    n, c, count = numel, _bytes(compute), len(dtypes)
    casts = sum(n * c for dtype in dtypes if dtype != compute)
    wide = 8 if compute == "F64" else 4
    options = options or {}
    if method == "linear":
        work = n * wide
    elif method == "passthrough":
        work = 0
    elif method == "nearswap":
        work = 4 * n * c
    elif method == "slerp":
        work = 4 * min(n, CHUNK) * wide
    elif method == "nuslerp":
        work = 6 * n * c
    elif method == "multislerp":
        work = 4 * non_base * n * c
    elif method == "karcher":
        work = (count + 4) * n * c
    elif method == "model_stock":
        work = (non_base + 4) * n * c
    elif method == "sce":
        work = 5 * non_base * n * c
    else:  # the task-arithmetic family: stacked task vectors, then one sparsification at a time, then the vote
        sparsify, consensus = options.get("sparsify"), options.get("consensus")
        vote = ((3 * non_base + 3) if consensus else 2) * min(n, CHUNK) * c  # per slice of CHUNK elements
        if sparsify in ("magnitude", "magnitude_outliers"):
            # every sort first, before any task vector is stacked: the masks of the models sorted before (a bit an
            # element), the magnitudes in the sort's dtype (the compute dtype; float32 for float64), torch.sort's int64
            # indices and, as it starts, its int64 arange that fills them (measured); then the stacked vectors, the
            # masks, a task vector, its unpacked mask (two bytes an element) and its masked copy (and |.| to rescale)
            key = c if compute in ("BF16", "F16", "F32") else 4
            bits = (n + 7) // 8
            sort = casts + (non_base - 1) * bits + max(n * key + 16 * n, 2 * n * c + n * key) - unmade - given_back
            vectors = non_base * bits + non_base * n * c + 3 * n * c + 2 * n - unmade
            return max(sort, casts + max(vectors, non_base * n * c + vote))
        else:
            per_vector = {None: n * c, "random": 2 * n * c + 3 * n * 4, "della_magprune": 2 * n * c + 28 * n}[sparsify]
            work = non_base * n * c + max(per_vector, vote)
    return casts + work
