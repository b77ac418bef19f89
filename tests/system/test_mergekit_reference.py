"""The workbench against mergekit 0.1.5 (tests/fixtures/mergekit): every deterministic case of the committed set is
bit-identical to mergekit-yaml's output, every random one (DARE, DELLA) too under the same --random-seed (mergekit's
one stream, rng='mergekit', which wb.merge_config uses), the merged models' logits in transformers equal those of mergekit's, and
`workbench merge` runs a config end to end (dry-run, refusal, run, verify)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mergekit_reference import (
    FIXTURE,
    builtin_template_case,
    deterministic_cases,
    differences,
    inputs_folder,
    maker,
    manifest,
    merge_case,
    token_differences,
    union_case,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("case", deterministic_cases())
def test_every_deterministic_case_is_bit_identical_to_mergekit(case: str, tmp_path: Path) -> None:
    merge_case(case, tmp_path / "out")
    assert differences(case, tmp_path / "out") == []


@pytest.mark.parametrize("case", ["slerp-gradient-bf16", "ties-fp32", "passthrough-slices-fp32", "slerp-slices-bf16",
                                  "model_stock-bf16", "multislerp-fp32", "linear-tokenizer-base",
                                  "notebook-ties", "linear-tokenizer-base-cut", "slerp-tokenizer-pad-cut",
                                  "linear-tokenizer-base-strip"])
def test_logits_equal_mergekits(case: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM

    merge_case(case, tmp_path / "out")
    want = manifest()["cases"][case]["logits"]
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([want["input_ids"]])).logits[0]
    torch.testing.assert_close(logits, torch.tensor(maker.logits_values(manifest()["cases"][case])), rtol=1e-6, atol=1e-6)


RANDOM = sorted(k for k, v in manifest()["cases"].items() if v["random"])


@pytest.mark.parametrize("case", RANDOM)
def test_every_random_case_is_bit_identical_under_the_same_seed(case: str, tmp_path: Path) -> None:
    merge_case(case, tmp_path / "out")
    assert differences(case, tmp_path / "out") == []


@pytest.mark.parametrize("case", ["dare_ties-fp32", "della-bf16"])
def test_a_stream_per_tensor_keeps_what_mergekit_keeps(case: str, tmp_path: Path) -> None:
    """With rng='tensor' (M.presets.merge's default: each tensor's own stream) DARE and DELLA draw other masks than
    mergekit's one stream, so the bytes differ; what is kept must not: the fraction of elements that differ from the base
    model and the mean absolute difference, over the whole model, match mergekit's."""
    import workbench as wb
    from workbench.mapper.merge.models import MergeModels

    ck, mapper = wb.merge_config(FIXTURE / manifest()["cases"][case]["config"], root=inputs_folder(), seed=manifest()["seed"])
    assert isinstance(mapper, MergeModels) and mapper.rng == "mergekit"
    per_tensor = MergeModels(**{**mapper.arguments(), "rng": "tensor"})
    wb.convert(ck, tmp_path / "out", per_tensor, quiet=True)
    assert differences(case, tmp_path / "out") != []
    want = manifest()["cases"][case]["statistics"]
    got = maker.delta_statistics(tmp_path / "out", inputs_folder() / manifest_config(case)["base_model"])
    assert got["changed_fraction"] == pytest.approx(want["changed_fraction"], abs=0.02)
    assert got["mean_abs_delta"] == pytest.approx(want["mean_abs_delta"], rel=0.05)


def manifest_config(case: str) -> dict:
    import yaml

    return yaml.safe_load((FIXTURE / manifest()["cases"][case]["config"]).read_text())


def _cli(*args: str) -> subprocess.CompletedProcess:
    # The suite's bytecode setting passes through: a child writing .pyc files into the venv would change the memory
    # later processes map (tests/system/test_rss_cases.py's GGUF case measured 24 % under its prediction after it).
    keep = {k: v for k, v in os.environ.items() if k == "PYTHONDONTWRITEBYTECODE"}
    return subprocess.run([sys.executable, "-m", "workbench", *args], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", **keep})


def test_workbench_merge_runs_a_config_end_to_end(tmp_path: Path) -> None:
    config = inputs_folder() / "ties-gradient-bf16.yml"  # beside the models: paths resolve against the config's folder
    shutil.copy(FIXTURE / "configs" / "ties-gradient-bf16.yml", config)
    dry = _cli("merge", str(config), str(tmp_path / "out"), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "peak" in dry.stdout.lower() and not (tmp_path / "out").exists()
    done = _cli("merge", str(config), str(tmp_path / "out"), "--quiet", "--verify")
    assert done.returncode == 0, done.stderr
    assert differences("ties-gradient-bf16", tmp_path / "out") == []
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_hidden_layers"] == 4


def test_workbench_merge_refuses_an_unknown_key_before_reading(tmp_path: Path) -> None:
    config = inputs_folder() / "typo.yml"
    config.write_text((FIXTURE / "configs" / "linear-fp32.yml").read_text() + "merge_methd: ties\n")
    done = _cli("merge", str(config), str(tmp_path / "out"))
    assert done.returncode == 2
    assert "'merge_methd'" in done.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", sorted(k for k in manifest()["cases"] if "tokenizer" in manifest()["cases"][k]
                                        and not builtin_template_case(k)))
def test_tokenizer_cases_equal_mergekits_row_by_token(case: str, tmp_path: Path) -> None:
    """Every tokenizer case (union, a model as source, chat templates): the tensors outside the vocabulary bit for
    bit, each token's embedding and lm_head row bit for bit, the vocabulary, the added tokens and the chat template."""
    merge_case(case, tmp_path / "out")
    assert token_differences(case, tmp_path / "out") == []
    got = json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"]
    assert got == manifest()["cases"][case]["output_config"]["vocab_size"]


@pytest.mark.parametrize("case", ["linear-tokenizer-base-strip", "linear-tokenizer-union-added", "linear-tokenizer-tokens"])
def test_transformers_loads_the_tokenizer_mergekit_wrote(case: str, tmp_path: Path) -> None:
    """The output's tokenizer files are the sources' files edited, not transformers' re-serialisation: loaded by
    transformers they give mergekit's tokens (and ids, but for a union's new tokens), added tokens and template."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    merge_case(case, tmp_path / "out")
    want = manifest()["cases"][case]["tokenizer"]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    vocab = tokenizer.get_vocab()
    assert set(vocab) == set(want["vocab"])
    assert union_case(case) or vocab == want["vocab"]
    added = {t.content: t.special for t in tokenizer.added_tokens_decoder.values()}
    assert added == {t["content"]: t["special"] for t in want["added_tokens"]}
    assert tokenizer.chat_template == want["chat_template"]


@pytest.mark.parametrize("case", ["linear-tokenizer-union-added", "ties-tokenizer-model"])
def test_logits_of_a_new_vocabulary_equal_mergekits_by_token(case: str, tmp_path: Path) -> None:
    """The merged model's logits in transformers, each vocabulary column matched by token string."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM

    merge_case(case, tmp_path / "out")
    entry = manifest()["cases"][case]
    ref_vocab, mine = entry["tokenizer"]["vocab"], maker.tokenizer_record(tmp_path / "out")["vocab"]
    ids = [mine[tok] for tok in sorted(ref_vocab, key=ref_vocab.get)]  # my column of each of mergekit's tokens
    inputs = [mine[next(t for t, i in ref_vocab.items() if i == j)] for j in entry["logits"]["input_ids"]]
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([inputs])).logits[0]
    torch.testing.assert_close(logits[:, ids], torch.tensor(maker.logits_values(entry)), rtol=1e-6, atol=1e-6)


def test_workbench_merge_dry_run_shows_the_new_vocabulary_before_reading(tmp_path: Path) -> None:
    config = inputs_folder() / "linear-tokenizer-tokens.yml"  # union, per-token settings, padding
    shutil.copy(FIXTURE / "configs" / "linear-tokenizer-tokens.yml", config)
    dry = _cli("merge", str(config), str(tmp_path / "out"), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "extra generated: tokenizer.json" in dry.stdout and "vocab_size 64 -> 96" in dry.stdout
    assert not (tmp_path / "out").exists()
    done = _cli("merge", str(config), str(tmp_path / "out"), "--quiet", "--verify")
    assert done.returncode == 0, done.stderr
    assert token_differences("linear-tokenizer-tokens", tmp_path / "out") == []
