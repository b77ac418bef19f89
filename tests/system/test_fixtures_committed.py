"""The committed tool-made fixtures (tests/fixtures/<tool>/) are what their manifest says, and what the real tools make.

Always: every committed file has the digest MANIFEST.json records (a partial or edited copy fails here, not as a
puzzling mismatch in a format test). With `WB_FIXTURES_REBUILT=1` (`make fixtures` sets it after rebuilding the runs
with DeepSpeed and megatron-core in their own venvs): the rebuild holds the same tensors, file for file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from fixture_manifest import digests, read_manifest  # noqa: E402

TOOLS = {"deepspeed": "make_deepspeed_fixtures.py", "megatron": "make_megatron_fixtures.py"}


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_committed_fixtures_match_their_manifest(tool: str) -> None:
    folder = REPO / "tests" / "fixtures" / tool
    manifest = read_manifest(folder)
    assert manifest["tools"] and manifest["made_by"].startswith(f"scripts/{TOOLS[tool]}")
    assert digests(folder, manifest["runs"]) == manifest["files"]
    versions = dict(line.split(" ", 1) for line in (folder / "done").read_text().splitlines() if line.strip())
    assert versions == manifest["tools"]


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_rebuilt_fixtures_hold_the_committed_tensors(tool: str) -> None:
    if os.environ.get("WB_FIXTURES_REBUILT") != "1":
        pytest.skip("opt-in: `make fixtures` rebuilds the fixtures with the real tools and runs this with WB_FIXTURES_REBUILT=1")
    script = REPO / "scripts" / TOOLS[tool]
    built = Path(subprocess.run([sys.executable, str(script), "--print-built-root"], capture_output=True, text=True,
                                check=True).stdout.strip())
    assert (built / "done").exists(), f"no rebuild at {built}; run `make fixtures`"
    failed = sorted(p.parent.name for p in built.glob("*/failed"))
    assert not failed, f"runs the tools could not build: {failed}"
    committed = read_manifest(REPO / "tests" / "fixtures" / tool)
    assert (built / "done").read_text().split() == (REPO / "tests" / "fixtures" / tool / "done").read_text().split(), \
        "the tool versions differ from the committed fixtures'; pin them (WB_DEEPSPEED_VERSION / WB_MEGATRON_VERSION)"
    rebuilt = digests(built, committed["runs"])
    differ = sorted(name for name in set(rebuilt) | set(committed["files"]) if rebuilt.get(name) != committed["files"].get(name))
    assert not differ, f"the rebuild differs from the committed fixtures in: {differ}"


def test_mergekit_references_match_their_configs_and_a_rebuild() -> None:
    """The committed mergekit fixture (configs + digests, no weights) names the configs the script makes, records the
    tool versions, and (with `WB_FIXTURES_REBUILT=1`, after `make fixtures`) equals the rebuild, case for case."""
    import json

    import make_mergekit_fixtures as maker
    import yaml

    folder = REPO / "tests" / "fixtures" / "mergekit"
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    assert manifest["made_by"].startswith("scripts/make_mergekit_fixtures.py") and manifest["tools"]["mergekit"]
    assert set(manifest["cases"]) | set(manifest["failed"]) == set(maker.cases())
    for name, config in maker.cases().items():
        assert yaml.safe_load((folder / "configs" / f"{name}.yml").read_text()) == config, name
    versions = dict(line.split(" ", 1) for line in (folder / "done").read_text().splitlines() if line.strip())
    assert versions == manifest["tools"]
    if os.environ.get("WB_FIXTURES_REBUILT") != "1":
        return
    built = maker.fixture_root() / "manifest.json"
    assert built.exists(), f"no rebuild at {built.parent}; run `make fixtures`"
    rebuilt = json.loads(built.read_text())
    assert rebuilt["tools"] == manifest["tools"], "the tool versions differ from the committed fixture's"
    assert rebuilt["inputs"] == manifest["inputs"], "inputs changed: the input models differ from the committed digests"
    differ = sorted(k for k in set(rebuilt["cases"]) | set(manifest["cases"])
                    if maker.comparable(rebuilt["cases"].get(k, {})) != maker.comparable(manifest["cases"].get(k, {})))
    assert not differ, f"mergekit's rebuilt outputs differ from the committed digests in: {differ}"


def test_llama_cpp_references_are_what_the_converter_wrote() -> None:
    """Every committed llama.cpp output (digest, and the stored file when small) is what the converter wrote in the
    last `make fixtures` run (its record), input for input."""
    import json

    sys.path.insert(0, str(REPO / "tests"))
    from gguf_support.reference import COMMITTED, _sha256, committed_manifest

    manifest = committed_manifest()
    assert manifest["tools"] and manifest["made_by"] == "scripts/make_gguf_references.py"
    for key, entry in manifest["outputs"].items():
        if entry["stored"]:
            for name, want in entry["files"].items():
                assert _sha256(COMMITTED / key / name) == want["sha256"], f"{key}/{name}"
    if os.environ.get("WB_FIXTURES_REBUILT") != "1":
        return
    from make_gguf_references import RECORD

    rebuilt = {p.name: json.loads((p / "entry.json").read_text())["files"] for p in RECORD.iterdir() if (p / "entry.json").is_file()}
    committed = {key: entry["files"] for key, entry in manifest["outputs"].items()}
    assert rebuilt, f"no record of the converter's outputs in {RECORD}; run `make fixtures`"
    differ = sorted(k for k in rebuilt if committed.get(k) != rebuilt[k])  # committed ones no test asked for are stale only
    assert not differ, f"the converter's outputs differ from (or are missing in) the committed ones: {differ}"


def test_llama_cpp_references_know_the_current_models() -> None:
    """The committed manifest has an output for every model and outtype the GGUF tests (and their pre-build) ask the
    converter for. Its keys name the input folder, whose name holds a digest of gguf_support/models.py (families.py):
    any edit there, an import line included, makes new models, and a fresh clone would then run llama.cpp's converter
    for each (minutes of `make test`). Fix: `python scripts/make_gguf_references.py --from-cache` after a GGUF test
    run with WB_LLAMA_CPP=real, then `--commit`."""
    sys.path.insert(0, str(REPO / "tests"))
    from gguf_support import families
    from gguf_support.prebuild import FAMILY_CASES
    from gguf_support.reference import CASES, committed_manifest, folder_name

    known = {(entry["input"], key.split("-", 1)[1]) for key, entry in committed_manifest()["outputs"].items()}
    wanted = {(folder_name(family, tokenizer), outtype) for family, outtype, tokenizer in CASES if "-" not in family}
    wanted |= {(families.model_folder(family).name, outtype) for family, outtype in FAMILY_CASES}
    from gguf_support import gpt2

    wanted |= {(gpt2.model_folder().name, outtype) for outtype in gpt2.CASES}
    assert not wanted - known, f"no committed llama.cpp output for {sorted(wanted - known)}"
