"""Kernels of the task-arithmetic family: task_arithmetic, ties, dare_linear, dare_ties, breadcrumbs,
breadcrumbs_ties, della, della_linear — one kernel, varied by a sparsification and a sign consensus.

Each model's task vector (`model - base`) is sparsified (`magnitude`: keep the `density` largest; `random`:
keep each entry with probability `density` (DARE); `magnitude_outliers`: drop the `gamma` largest then keep
`density` (breadcrumbs); `della_magprune`: keep with a probability rising with magnitude rank (DELLA)),
rescaled to its L1 norm when `rescale` (mergekit restores each tensor's sum of absolute values, not
1/density), weighted, optionally sign-elected (`sum`: the sign of the summed vectors, TIES), summed,
normalised by the weights that voted, scaled by `lambda`, and added to the base. The operations and their
order are mergekit 0.1.5's, in the inputs' dtype; ties in the magnitude ranking fall in `torch.argsort`'s
order, as in mergekit. The random sparsifications draw from the generator the op gives: one seeded per output
tensor (`Merge.generator_seed`, rng='tensor'), or mergekit's one stream at this tensor's offset (`Merge.draws`,
rng='mergekit', see `stream`: then the masks, and the bytes, are mergekit's under the same seed); either way a
merge is reproducible whatever the ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...mapped_inputs import give_back

CHUNK = 1 << 20  # elements per slice of the sign vote and the sum


def _rescaled(tensor: Any, mask: Any, rescale: bool) -> Any:
    """`tensor · mask`, scaled back to `tensor`'s L1 norm when `rescale` (unless either norm is below 1e-7)."""
    kept = tensor * mask
    if not rescale:
        return kept
    before = tensor.abs().sum()
    after = kept.abs().sum()
    if before < 1e-7 or after < 1e-7:
        return kept
    return kept * (before / after)


def _sort_keys(delta: Any) -> Any:
    """The magnitudes mergekit sorts, in a dtype whose every comparison gives the same answer: |delta| as float32
    (mergekit's cast on CPU) for float32 and float64 inputs, |delta| in bfloat16 / float16 themselves (their cast to
    float32 is exact, so the sort swaps the same elements: measured identical, tests/mapper/test_merge_methods.py)."""
    import torch

    keys = delta.abs().reshape(-1)
    return keys if keys.dtype in (torch.bfloat16, torch.float16, torch.float32) else keys.float()


def release_freed_heap() -> None:
    """Give the C heap's freed pages back to the system before the sort's peak (glibc's `malloc_trim`; a no-op
    elsewhere): the slices of the earlier groups' work leave freed pages the process would otherwise keep."""
    global _TRIM
    if _TRIM is None:
        import ctypes
        import ctypes.util

        try:
            _TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM: Any = None


def rank_mask(tensor: Any, base: Any, start: int, stop: int, descending: bool) -> Any:
    """Boolean mask of the elements of |tensor - base| whose position in torch's (unstable) sort of all of them lies in
    [start, stop) (flat): mergekit's top-k (descending) or its window above the smallest (breadcrumbs). Ties fall in the
    sort's order, as in mergekit; the sort runs in place on the magnitudes (no second copy of them), so the peak
    is the magnitudes and the int64 indices, the mask (one byte an element) coming after the keys are gone."""
    import torch

    release_freed_heap()
    keys = _sort_keys(tensor - base)
    give_back((tensor, base))  # mapped inputs leave the process for the sort; read again afterwards from the page cache
    count = keys.numel()
    order = torch.empty(count, dtype=torch.int64, device=keys.device)
    torch.sort(keys, descending=descending, out=(keys, order))
    del keys
    mask = torch.zeros(count, dtype=torch.bool, device=order.device)
    mask[order[start:stop]] = True
    del order
    return mask


BITS = (1, 2, 4, 8, 16, 32, 64, 128)


def pack_bits(mask: Any) -> Any:
    """A flat boolean mask as one bit an element (uint8, little-endian bit order), packed in slices of CHUNK: the
    masks of the models sorted first wait in an eighth of a byte an element while the next model sorts."""
    import torch

    count = mask.numel()
    out = torch.zeros((count + 7) // 8, dtype=torch.uint8, device=mask.device)
    weights = torch.tensor(BITS, dtype=torch.uint8, device=mask.device)
    for start in range(0, count, CHUNK):  # CHUNK is a multiple of 8: slices start on a byte
        part = mask[start:start + CHUNK]
        if part.numel() % 8:
            part = torch.cat([part, part.new_zeros(8 - part.numel() % 8)])
        out[start // 8:start // 8 + part.numel() // 8] = (part.view(-1, 8).to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8)
    return out


def unpack_bits(packed: Any, count: int, shape: Any) -> Any:
    """The boolean mask `pack_bits` packed, in `shape`."""
    import torch

    weights = torch.tensor(BITS, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) & weights) != 0).reshape(-1)[:count].reshape(shape)


def _window(count: int, density: float, sparsify: str, gamma: float) -> tuple[int, int, bool] | None:
    """(start, stop, descending) of the kept positions in the magnitude sort, as mergekit's `magnitude` (the
    `density` largest, at least one) and `magnitude_outliers` (the `gamma` largest dropped, then the smallest);
    None when mergekit keeps the whole tensor."""
    if density >= 1:
        return None
    if sparsify == "magnitude":
        return 0, max(1, int(density * count)), True
    keep, top = int(density * count), int(gamma * count)
    bottom = max(0, count - keep - top)
    return bottom, bottom + keep, False


def _random(tensor: Any, density: float, rescale: bool, generator: Any) -> Any:
    import torch

    if density >= 1:
        return tensor
    work = tensor.dtype if tensor.dtype == torch.bfloat16 else torch.float32
    mask = torch.bernoulli(torch.full_like(tensor, density, dtype=work), generator=generator)
    return _rescaled(tensor.to(work), mask, rescale).to(tensor.dtype)


def _della(tensor: Any, density: float, rescale: bool, epsilon: float, generator: Any) -> Any:
    import torch

    from ...errors import MapperError

    if density >= 1:
        return tensor
    if density <= 0:
        return torch.zeros_like(tensor)
    if density + epsilon >= 1 or density - epsilon <= 0:
        raise MapperError(f"Cannot merge by DELLA with density {density} and epsilon {epsilon}: density ± epsilon must lie "
                          "strictly between 0 and 1. Lower epsilon.")
    shape = tensor.shape
    work = tensor.dtype if tensor.dtype == torch.bfloat16 else torch.float32
    rows = tensor.unsqueeze(0) if tensor.dim() < 2 else tensor
    ranks = torch.argsort(rows.abs(), dim=1, descending=False).argsort(dim=1).to(work) + 1
    low = ranks.min(dim=1, keepdim=True).values
    high = ranks.max(dim=1, keepdim=True).values
    spread = ((ranks - low) / (high - low)).clamp(0, 1)
    mask = torch.bernoulli((density - epsilon) + spread * 2 * epsilon, generator=generator).to(work)
    return _rescaled(rows.to(work), mask, rescale).to(rows.dtype).reshape(shape)


def sign_mask(deltas: Any, mask_dtype: Any) -> Any:
    """Where each stacked delta agrees with the elected sign (the sign of their sum; + for a zero sum)."""
    sign = deltas.sign().to(mask_dtype)
    elected = (deltas.sum(dim=0) >= 0).to(mask_dtype) * 2 - 1
    return sign == elected


def merge_task_vectors(tensors: Sequence[Any], models: Sequence[str], base: str | None, params: dict[str, Any], *,
                       consensus: str | None, sparsify: str | None, generator: Any = None) -> Any:
    """The family's kernel (see the module docstring); `consensus` 'sum' or None, `sparsify` the method or None."""
    import torch

    base_tensor = tensors[models.index(base)]  # type: ignore[arg-type]
    others = [(m, t) for m, t in zip(models, tensors, strict=True) if m != base]
    if not others:
        return base_tensor
    masks: list[Any] = []
    if sparsify in ("magnitude", "magnitude_outliers"):  # every sort first, while no task vector is held
        for model, tensor in others:
            density = params["density"][model]
            window = _window(tensor.numel(), density, sparsify, params.get("gamma", {}).get(model, 0.0))
            if window is None or (sparsify == "magnitude" and (density <= 0 or tensor.numel() == 0)):
                masks.append(None)
            else:
                masks.append(pack_bits(rank_mask(tensor, base_tensor, *window)))
    deltas = base_tensor.new_empty((len(others), *base_tensor.shape))
    for index, (model, tensor) in enumerate(others):
        delta = tensor - base_tensor
        density = params["density"][model]
        if sparsify == "magnitude" and (density <= 0 or tensor.numel() == 0):
            delta = torch.zeros_like(delta)
        elif masks and masks[index] is not None:
            mask = unpack_bits(masks[index], delta.numel(), delta.shape)
            delta = _rescaled(delta, mask, params["rescale"])  # · True/False: the bits of · 1/0 in the dtype
            del mask
            masks[index] = None
        elif sparsify == "random":
            delta = _random(delta, density, params["rescale"], generator)
        elif sparsify == "della_magprune":
            delta = _della(delta, density, params["rescale"], params["epsilon"][model], generator)
        deltas[index] = delta
        del delta
    del masks
    weights = torch.tensor([params["weight"][m] for m, _ in others], dtype=deltas.dtype, device=deltas.device)
    while deltas.dim() > weights.dim():
        weights.unsqueeze_(-1)
    deltas.mul_(weights)
    # Every step below is per element (sums run over the models), so it runs on slices of CHUNK elements: the vote's
    # masks and products then take a slice's memory, not the tensor's, with the same bits.
    out = torch.empty_like(base_tensor)
    flat_deltas = deltas.view(len(others), -1)
    flat_base, flat_out = base_tensor.reshape(-1), out.view(-1)
    column = weights.reshape(len(others), 1)
    mask_dtype = torch.int8 if params["int8_mask"] else base_tensor.dtype
    for start in range(0, max(flat_base.numel(), 1), CHUNK):
        part = flat_deltas[:, start:start + CHUNK]
        if consensus:
            mask = sign_mask(part, mask_dtype)
            mixed = (part * mask).sum(dim=0)
            divisor = (column * mask).sum(dim=0)
            divisor[divisor == 0] = 1
        else:
            mixed = part.sum(dim=0)
            divisor = column.sum(dim=0)
            divisor[divisor.abs() < 1e-8] = 1
        if params["normalize"]:
            mixed /= divisor
        if params["lambda"] != 1:
            mixed *= params["lambda"]
        flat_out[start:start + CHUNK] = (flat_base[start:start + CHUNK] + mixed).to(base_tensor.dtype)
    return out
