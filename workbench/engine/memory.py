"""What the engine measures about memory: its own tensor-buffer accounting and the process RSS.

`HeldBytes` is the engine's ledger of the tensor bytes it holds (buffers read, tensors computed);
its peak is what the plan predicts. RSS comes from /proc (VmHWM, VmRSS), with the high-water mark
reset at the start of a run when the kernel allows it, and getrusage as the fallback.
"""

from __future__ import annotations

import resource


class HeldBytes:
    """Running total and peak of tensor bytes the engine holds."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0

    def hold(self, n: int) -> None:
        """Count `n` more bytes as held."""
        self.current += n
        if self.current > self.peak:
            self.peak = self.current

    def release(self, n: int) -> None:
        """Count `n` bytes as released."""
        self.current -= n


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_bytes() -> int:
    """The process's current resident set size in bytes (0 when unknown)."""
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else 0


def reset_rss_peak() -> bool:
    """Reset the kernel's RSS high-water mark for this process; False when not possible."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def rss_peak_bytes() -> int:
    """The process's RSS high-water mark in bytes (since the last reset, when reset worked)."""
    kib = _status_kib("VmHWM")
    if kib is None:
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024
