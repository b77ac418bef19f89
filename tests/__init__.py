"""The test suite: `tests/<package>/test_<module>.py` mirrors `workbench/`, slow end-to-end suites are in
`system/`, browser tests in `browser/` (see scripts/place_test.py).

Test modules import as `tests.<package>.test_<module>`; the support modules beside this file
(`remote_servers`, `peft_fixtures`, `gguf_support`, `hostile`) by their plain names, as the benchmarks do,
so this folder goes on the end of `sys.path` (last: its `core`, `system`, ... folders shadow nothing).
"""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.append(_HERE)
