"""`mapped_inputs`: tensors mapped privately from a file, whose pages `give_back` returns to the system and which read
the file's bytes again afterwards; writes stay private; what cannot be mapped in place is refused (None)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from workbench.mapped_inputs import give_back, map_tensor, unmap

MIB = 1 << 20


def _rss_file_kib() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("RssFile:"):
                return int(line.split()[1])
    raise AssertionError("no RssFile in /proc/self/status")


def _file(tmp_path: Path, values: torch.Tensor, lead: int) -> Path:
    path = tmp_path / "data.bin"
    path.write_bytes(b"\x07" * lead + values.reshape(-1).view(torch.uint8).numpy().tobytes())
    return path


def test_a_mapped_tensor_gives_its_pages_back_and_reads_the_same_values_again(tmp_path: Path) -> None:
    values = torch.arange(4 * MIB, dtype=torch.float32).reshape(1024, -1)  # 16 MiB
    lead = 4096 + 24  # not on a page: the mapping starts on the page below
    fd = os.open(_file(tmp_path, values, lead), os.O_RDONLY)
    try:
        tensor = map_tensor(fd, lead, values.numel() * 4, torch.float32, tuple(values.shape))
        assert tensor is not None and torch.equal(tensor, values)  # every page read: resident
        before = _rss_file_kib()
        assert give_back([tensor, values]) >= 16 * MIB  # the plain tensor is ignored
        assert before - _rss_file_kib() >= 15 * 1024  # KiB: the pages left the process
        assert torch.equal(tensor, values)  # faulted in again from the file
        unmap([tensor])
        assert give_back([tensor]) == 0  # forgotten: nothing to give back
    finally:
        os.close(fd)


def test_writes_stay_private_and_what_cannot_be_mapped_in_place_is_refused(tmp_path: Path) -> None:
    values = torch.ones(MIB // 2, dtype=torch.bfloat16)
    path = _file(tmp_path, values, 8)
    original = path.read_bytes()
    fd = os.open(path, os.O_RDONLY)
    try:
        tensor = map_tensor(fd, 8, MIB, torch.bfloat16, (MIB // 2,))
        assert tensor is not None
        tensor.mul_(3)  # copy-on-write: the process's own pages
        assert float(tensor[0]) == 3.0 and path.read_bytes() == original
        unmap([tensor])
        assert map_tensor(fd, 9, MIB - 2, torch.bfloat16, ((MIB - 2) // 2,)) is None  # not aligned to bf16's 2 bytes
        assert map_tensor(fd, 8, MIB + 2, torch.bfloat16, (MIB // 2 + 1,)) is None  # past the file's end
        assert map_tensor(fd, 8, 0, torch.bfloat16, (0,)) is None
    finally:
        os.close(fd)
