"""Measured memory of conversion processes before they hold any tensor (bytes): what `planning.rss` adds to
the plan's tensor peak. Written by `python scripts/calibrate_rss.py --write` (see it for how each number is
measured: peak RSS of real `workbench convert` runs on tiny checkpoints, median of 3, the libraries' shared
objects in the page-cache state that maps the most of them, whatever the state of the venv it ran in); re-run it
after a Python, numpy, torch or transformers upgrade, or on a new platform.

Measured 2026-11-28 on Linux x86_64 (kernel 6.18.44-fc-v669), CPython 3.11.7, numpy 2.4.6, torch 2.13.0+cpu.
"""

INTERPRETER = 11165696  # python -c pass
WORKBENCH = {"cli": 21900712, "worker": 15875496}  # the entry point's modules and run state
LIBRARY = {"numpy": 20488192, "torch": 304832512}  # added by importing and using each (the large page-cache state)
LIBRARY_SPREAD = {"numpy": 7692288, "torch": 96841728}  # how much less each costs when its files were paged in by faults
PER_TENSOR = 1027  # catalog and plan, per source tensor
REMOTE_LIBRARIES = {"http": 25489408, "hf": 33710080, "s3": 37068800}  # a remote source's transport (fsspec, aiohttp; huggingface_hub; s3fs, botocore), imported and set up
TRANSFORMERS_BYTES = 136409088  # transformers and its conversion modules, left resident by M.presets.from_transformers
ML_DTYPES_BYTES = 4857856  # ml_dtypes imported and used (an FP8 and an FP4 decode) on top of numpy
MEASURED_WITH = {'python': '3.11.7', 'numpy': '2.4.6', 'torch': '2.13.0+cpu'}  # planning.rss.calibration_mismatch compares these with what is installed
