"""One rank's share of a plan: read, transform, write, with progress and a measured report.

Importing it does not import torch or pandas; torch is loaded only when a step computes on tensors.
`wb.convert` (the orchestrator) lives in `workbench.conversion` and the N-rank launchers in
`workbench.launch`.
"""

from __future__ import annotations

from .report import RankResult, RunReport
from .status import Cancelled

__all__ = ["Cancelled", "RankResult", "RunReport"]
