"""mergekit's reference merges (tests/fixtures/mergekit/, made by scripts/make_mergekit_fixtures.py) for the tests.

The committed fixture holds the configs and digests only; `inputs_folder()` regenerates the tiny input models once
per process (a second) and checks them against the recorded digests first, so a change of the inputs fails as
"inputs changed", not as a merge mismatch. `merge_case(name, out)` runs one case through `wb.merge_config` and
`wb.convert`; `differences(name, out)` lists the tensors whose dtype, shape or bytes differ from mergekit's.
"""

from __future__ import annotations

import atexit
import json
import shutil
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
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # one folder per test process, gone when it ends
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


def union_case(name: str) -> bool:
    """True when the case builds a union vocabulary (mergekit orders the new tokens differently from run to run)."""
    cfg = config(name)
    return "union" in (cfg.get("tokenizer_source"), (cfg.get("tokenizer") or {}).get("source"))


def builtin_template_case(name: str) -> bool:
    """True when the case names one of mergekit's built-in chat templates (read from an installed mergekit)."""
    value = config(name).get("chat_template")
    return isinstance(value, str) and value != "auto" and "{" not in value


def deterministic_cases() -> list[str]:
    """Cases whose method draws no random numbers, whose vocabulary has one order (not a union: those compare row by
    token, `token_differences`) and that need no mergekit installed (no built-in chat template name)."""
    return sorted(k for k, v in manifest()["cases"].items()
                  if not v["random"] and not union_case(k) and not builtin_template_case(k))


def token_differences(name: str, out: Path) -> list[str]:
    """What differs from mergekit's output when the rows are matched by token string: tensors outside the vocabulary
    by their bytes, vocabulary tensors row by row (`tensor[token]`), the token set, the ids of the base's tokens
    (the new tokens' ids may differ: mergekit orders them by hash-map iteration), the added tokens' settings and the
    chat template."""
    ref = manifest()["cases"][name]
    record = maker.tokenizer_record(out)
    want = ref["tokenizer"]
    mine, digests = maker.tensor_digests(out), ref["tensors"]
    found = sorted(k for k in set(mine) | set(digests) if k not in want["rows"] and mine.get(k) != digests.get(k))
    same_order = record["vocab"] == want["vocab"]
    for tensor, rows in want["rows"].items():
        # padding rows (#id) are means over all rows: their last bits follow the order of the new tokens
        found += [f"{tensor}[{tok}]" for tok in rows if record["rows"].get(tensor, {}).get(tok) != rows[tok]
                  and (same_order or not tok.startswith("#"))]
        found += [f"{tensor}[{tok}] (extra)" for tok in record["rows"].get(tensor, {}) if tok not in rows]
    if set(record["vocab"]) != set(want["vocab"]):
        found.append(f"vocabulary: {sorted(set(record['vocab']) ^ set(want['vocab']))}")
    kept = want["vocab"]
    if union_case(name):  # the base's tokens keep their ids; the new ones follow in an order of their own
        base = json.loads((inputs_folder() / config(name)["base_model"] / "tokenizer.json").read_text())
        kept = {t: i for t, i in want["vocab"].items() if t in base["model"]["vocab"]}
    found += [f"id of {t!r}" for t, i in kept.items() if record["vocab"].get(t) != i]
    settings = {a["content"]: {k: v for k, v in a.items() if k != "id"} for a in want["added_tokens"]}
    found += [f"added token {a['content']!r}" for a in record["added_tokens"]
              if settings.get(a["content"]) != {k: v for k, v in a.items() if k != "id"}]
    if record["chat_template"] != want["chat_template"]:
        found.append("chat_template")
    return found
