"""Measured memory of conversion processes before they hold any tensor (bytes): what `planning.rss` adds to
the plan's tensor peak. Written by `python scripts/calibrate_rss.py --write` (see it for how each number is
measured: peak RSS of real `workbench convert` runs on tiny checkpoints, median of 3); re-run it after a
Python, numpy or torch upgrade, or on a new platform.

Measured 2026-11-28 on Linux x86_64 (kernel 6.18), CPython 3.11.7, numpy 2.4.6, torch 2.13.0+cpu, entered from the
script's printed table (0.1 MiB steps) — except torch, whose figures are the 2026-11-24 ones: a torch just installed
(a clean clone's `make test`, CI) costs 275.6 MiB with its files in the large page-cache state, 77.5 MiB more than
in a long-used venv (198.7 MiB, where the spread measured 0.4 MiB); the plan predicts the larger state and the
tests allow the spread below it.
"""

INTERPRETER = 11042816  # python -c pass
WORKBENCH = {"cli": 21600000, "worker": 15520000}  # the entry point's modules and run state
LIBRARY = {"numpy": 13100000, "torch": 289009664}  # added by importing and using each (the larger page-cache state)
LIBRARY_SPREAD = {"numpy": 90112, "torch": 81240064}  # how much less each costs when its files were paged in by faults
PER_TENSOR = 1036  # catalog and plan, per source tensor
MEASURED_WITH = {'python': '3.11.7', 'numpy': '2.4.6', 'torch': '2.13.0+cpu'}  # planning.rss.calibration_mismatch compares these with what is installed
