"""Input tensors mapped from their source files, whose resident pages a kernel may give back mid-computation.

A merge that sorts (TIES, breadcrumbs) reaches its peak inside the sort, when it needs none of its inputs: only
the magnitudes it computed from them. When the engine maps such a group's inputs from the page cache instead of
reading them into private memory, the kernel calls `give_back` before the sort: the inputs' pages leave the
process (`madvise(MADV_DONTNEED)`) and fault back in from the page cache, unchanged, when the kernel reads them
again. Tensors that were not mapped here (a user's own tensors, bytes from a reader) are left alone, so kernels
call `give_back` unconditionally.

The mapping is private and writable (copy-on-write): a kernel that wrote into an input would get its own pages,
never touching the file, and must then not give that input back (its writes would be dropped).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterable
from typing import Any

MAPPED_INPUT_BYTES = 1 << 20  # inputs smaller than this are read as usual: their pages are not worth a mapping

_MAPPED: dict[int, mmap.mmap] = {}  # data_ptr of a mapped tensor -> its mapping (entries leave with `unmap`)


def maps_inputs(op: Any, inputs: Iterable[Any], located: Callable[[Any], bool]) -> bool:
    """True when a group's inputs are mapped rather than read: its op gives them back (`gives_back_inputs`) and every
    input (a TensorInfo) lies raw on disk (`located`) and is at least MAPPED_INPUT_BYTES. Asked by the plan, to
    count the op's peak without them, and by the engine, to map them: one answer for both."""
    return getattr(op, "gives_back_inputs", False) is True and all(
        info.nbytes >= MAPPED_INPUT_BYTES and located(info) for info in inputs)


def map_tensor(fd: int, begin: int, nbytes: int, dtype: Any, shape: tuple[int, ...]) -> Any | None:
    """A torch tensor of `dtype` and `shape` over bytes [begin, begin + nbytes) of the open file `fd`, mapped
    privately; None when the bytes cannot be viewed as `dtype` in place (not aligned to its size), are empty or lie
    past the file's end."""
    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    lead = begin % mmap.ALLOCATIONGRANULARITY
    if nbytes <= 0 or lead % itemsize or os.fstat(fd).st_size < begin + nbytes:
        return None  # a short file is left to the reader's error (a mapping past its end would fault)
    mapping = mmap.mmap(fd, lead + nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                        offset=begin - lead)
    tensor = torch.frombuffer(mapping, dtype=dtype, offset=lead, count=nbytes // itemsize).reshape(shape)
    _MAPPED[tensor.data_ptr()] = mapping
    return tensor


def unmap(tensors: Iterable[Any]) -> None:
    """Forget the mappings of `tensors` (the mapping itself goes when the last tensor viewing it does)."""
    for tensor in tensors:
        _MAPPED.pop(tensor.data_ptr(), None)


def give_back(tensors: Iterable[Any]) -> int:
    """Drop the resident pages of those `tensors` that `map_tensor` made (others are ignored); returns the bytes of
    the mappings given back. The tensors stay valid: their next read faults the file's bytes in again."""
    released = 0
    for tensor in tensors:
        mapping = _MAPPED.get(tensor.data_ptr())
        if mapping is not None:
            mapping.madvise(mmap.MADV_DONTNEED)
            released += len(mapping)
    return released
