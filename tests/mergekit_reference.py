"""mergekit's reference merges (tests/fixtures/mergekit/, made by scripts/make_mergekit_fixtures.py) for the tests.

The committed fixture holds the configs and digests only; `inputs_folder()` regenerates the tiny input models once
per process (a second) and checks them against the recorded digests first, so a change of the inputs fails as
"inputs changed", not as a merge mismatch. `merge_case(name, out)` runs one case through `wb.merge_config` and
`wb.convert`; `differences(name, out)` lists the tensors whose dtype, shape or bytes differ from mergekit's.
"""

from __future__ import annotations

import json
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "mergekit"
sys.path.insert(0, str(REPO / "scripts"))

import make_mergekit_fixtures as maker  # noqa: E402


@lru_cache(maxsize=1)
def manifest() -> dict[str, Any]:
    """The committed MANIFEST.json."""
    return json.loads((FIXTURE / "MANIFEST.json").read_text())


@lru_cache(maxsize=1)
def inputs_folder() -> Path:
    """The input models, regenerated in a temporary folder and checked against the manifest's digests."""
    folder = Path(tempfile.mkdtemp(prefix="wb-mergekit-inputs-"))
    maker.build_inputs(folder)
    got, want = maker.input_digests(folder), manifest()["inputs"]
    changed = sorted(f"{m}:{t}" for m in want for t in want[m] if got.get(m, {}).get(t) != want[m][t])
    assert not changed, (f"inputs changed: the regenerated input models differ from the ones mergekit merged ({changed[:5]}); "
                         "rebuild the fixtures (python scripts/make_mergekit_fixtures.py --commit) or restore the generator")
    return folder


def config(name: str) -> dict:
    """A case's mergekit config (model paths relative to the inputs folder)."""
    import yaml

    return yaml.safe_load((FIXTURE / manifest()["cases"][name]["config"]).read_text())


def merge_case(name: str, out: Path, **convert: Any) -> Any:
    """Merge one case with the workbench into `out`; returns the conversion report."""
    import workbench as wb

    ck, mapper = wb.merge_config(FIXTURE / manifest()["cases"][name]["config"], root=inputs_folder(),
                                 seed=manifest()["seed"])
    return wb.convert(ck, out, mapper, quiet=True, **convert)


def differences(name: str, out: Path) -> list[str]:
    """Tensors of `out` whose dtype, shape or bytes differ from mergekit's output (or that only one side has)."""
    mine, ref = maker.tensor_digests(out), manifest()["cases"][name]["tensors"]
    return sorted(k for k in set(mine) | set(ref) if mine.get(k) != ref.get(k))


def deterministic_cases() -> list[str]:
    """Cases whose method draws no random numbers and whose tokenizer setting the workbench carries out (not union
    over different vocabularies, which it refuses)."""
    return sorted(k for k, v in manifest()["cases"].items() if not v["random"] and "tokenizer-union" not in k)
