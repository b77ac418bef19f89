"""The conversion engine: executes a `Plan` exactly (reads, transforms, streaming writes), on one
process or many, with progress and a measured report.

Importing it does not import torch or pandas; torch is loaded only when a step computes on tensors.
"""

from .conversion import convert, execute, run_local
from .launcher import Launch, launch
from .report import RankResult, RunReport
from .status import Cancelled

__all__ = ["Cancelled", "Launch", "RankResult", "RunReport", "convert", "execute", "launch", "run_local"]
