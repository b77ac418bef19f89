"""Measured memory of conversion processes before they hold any tensor (bytes): what `planning.rss` adds to
the plan's tensor peak. Written by `python scripts/calibrate_rss.py --write` (see it for how each number is
measured: peak RSS of real `workbench convert` runs on tiny checkpoints, median of 3); re-run it after a
Python, numpy or torch upgrade, or on a new platform.

Measured 2026-11-24 on Linux x86_64, CPython 3.11.7, numpy 2.4.6, torch 2.13.0+cpu.
"""

INTERPRETER = 11091968  # python -c pass
WORKBENCH = {"cli": 20755160, "worker": 16110296}  # the entry point's modules and run state
LIBRARY = {"numpy": 12754944, "torch": 206876672}  # added by importing and using each
PER_TENSOR = 2413  # catalog and plan, per source tensor
MEASURED_WITH = {'python': '3.11.7', 'numpy': '2.4.6', 'torch': '2.13.0+cpu'}  # planning.rss.calibration_mismatch compares these with what is installed
