"""Measured memory of conversion processes before they hold any tensor (bytes): what `planning.rss` adds to
the plan's tensor peak. Written by `python scripts/calibrate_rss.py --write` (see it for how each number is
measured: peak RSS of real `workbench convert` runs on tiny checkpoints, median of 3); re-run it after a
Python, numpy or torch upgrade, or on a new platform.

Measured 2026-11-28 on Linux x86_64 (kernel 6.18), CPython 3.11.7, numpy 2.4.6, torch 2.13.0+cpu (the 2026-11-24
figures said torch 275.6 MiB with a 77.5 MiB page-cache spread; on this kernel torch's files map the same either
way now, spread 0.4 MiB, and torch costs 198.7 MiB: the old figure over-predicted torch workloads by ~77 MiB).
Entered from the script's printed table (0.1 MiB steps).
"""

INTERPRETER = 11042816  # python -c pass
WORKBENCH = {"cli": 21600000, "worker": 15520000}  # the entry point's modules and run state
LIBRARY = {"numpy": 13100000, "torch": 208350000}  # added by importing and using each (the larger page-cache state)
LIBRARY_SPREAD = {"numpy": 0, "torch": 420000}  # how much less each costs when its files were paged in by faults
PER_TENSOR = 1036  # catalog and plan, per source tensor
MEASURED_WITH = {'python': '3.11.7', 'numpy': '2.4.6', 'torch': '2.13.0+cpu'}  # planning.rss.calibration_mismatch compares these with what is installed
