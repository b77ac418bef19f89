"""Meta folders (`params.json` + `consolidated.NN.pth`, `formats/meta_pth.py`): the workbench's own `to="pth"`
outputs open, verify and diff; model-parallel ranks merge by `meta_mp_merge`; converting back to HF builds
config.json's values from params.json, writes that config.json into the output (a generated extra), and gives the
original tensors bit for bit and, loaded by transformers, the original logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import workbench as wb
from workbench.cli.commands import main as cli_main
from workbench.errors import CheckpointError
from workbench.mapper.presets.meta_config import hf_config_from_meta

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def meta(llama_sample: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("meta-in")
    wb.convert(llama_sample, root / "one", to="pth", quiet=True)
    wb.convert(llama_sample, root / "two", to="pth", nproc_mp=2, quiet=True)
    return {"one": root / "one", "two": root / "two", "root": root}


def _same_tensors(a: Path, b: Path) -> None:
    x, y = wb.open_checkpoint(a), wb.open_checkpoint(b)
    assert sorted(x.catalog) == sorted(y.catalog)
    for name in x.catalog:
        assert torch.equal(x.load(name), y.load(name)), name


def test_own_pth_output_opens_verifies_and_diffs(meta: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    ck = wb.open_checkpoint(meta["one"])
    assert ck.format == "meta-pth" and "layers.0.attention.wq.weight" in ck
    assert json.loads(ck.catalog.metadata["params.dim"]) == 64 and ck.catalog.extras == ["params.json"]
    assert cli_main(["inspect", str(meta["one"])]) == 0 and "layers.0.attention.wq.weight" in capsys.readouterr().out
    assert cli_main(["verify", str(meta["one"])]) == 0 and "OK - meta-pth" in capsys.readouterr().out
    assert cli_main(["diff", str(meta["one"]), str(meta["one"])]) == 0


def test_model_parallel_ranks_are_listed_per_rank_and_merge_by_default(meta: dict[str, Path], tmp_path: Path) -> None:
    ck = wb.open_checkpoint(meta["two"])
    assert ck.catalog.default_preset == "meta_mp_merge" and "model-parallel" in ck.catalog.warnings[0]
    assert {n.split("/", 1)[0] for n in ck.catalog} == {"mp0", "mp1"}
    assert ck.suggest()["preset"].tolist() == ["meta_mp_merge"]
    wb.convert(meta["two"], tmp_path / "merged", quiet=True)  # no mapper: the format's default merge
    _same_tensors(meta["one"], tmp_path / "merged")


def test_convert_back_to_hf_builds_the_config_from_params_json(meta: dict[str, Path], llama_sample: Path, tmp_path: Path) -> None:
    assert cli_main(["convert", str(meta["one"]), str(tmp_path / "back"), "--preset", "meta_to_hf", "--quiet"]) == 0
    _same_tensors(llama_sample, tmp_path / "back")
    assert cli_main(["convert", str(meta["two"]), str(tmp_path / "back2"), "--preset", "meta_mp_merge,meta_to_hf", "--quiet"]) == 0
    _same_tensors(llama_sample, tmp_path / "back2")
    built = json.loads((tmp_path / "back2" / "config.json").read_text())  # model-parallel parts summed
    assert (built["vocab_size"], built["intermediate_size"], built["num_key_value_heads"]) == (256, 128, 2)


def test_hf_output_of_a_meta_folder_gets_a_config_and_loads_in_transformers(
        meta: dict[str, Path], llama_sample: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    assert cli_main(["plan", str(meta["one"]), "--dest", str(out), "--preset", "meta_to_hf"]) == 0
    assert "extra generated: config.json (from params.json)" in capsys.readouterr().out
    assert cli_main(["convert", str(meta["one"]), str(out), "--preset", "meta_to_hf", "--quiet"]) == 0
    assert not (out / "generation_config.json").exists()
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    ids = torch.tensor([[1, 5, 9, 33, 70, 2, 255]])
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(llama_sample)(ids).logits
        got = AutoModelForCausalLM.from_pretrained(out)(ids).logits
    assert torch.equal(got, expected)
    plan = wb.plan(meta["one"], dest=tmp_path / "same")  # Meta's names kept: no HF config is made for them
    assert plan.ok and "config.json" not in plan.extras and "params.json" in plan.extras


def test_config_from_params_of_a_llama3_and_a_llama2_folder() -> None:
    shapes = {"layers.0.feed_forward.w1.weight": (14336, 4096), "output.weight": (128256, 4096), "tok_embeddings.weight": (128256, 4096)}
    tensors = {n: SimpleNamespace(shape=s, dtype="BF16") for n, s in shapes.items()}
    params = {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "vocab_size": 128256, "multiple_of": 1024,
              "ffn_dim_multiplier": 1.3, "norm_eps": 1e-05, "rope_theta": 500000.0, "use_scaled_rope": True}
    config = hf_config_from_meta(params, tensors)
    assert {k: config[k] for k in ("hidden_size", "intermediate_size", "num_key_value_heads", "vocab_size", "head_dim",
                                   "max_position_embeddings", "torch_dtype")} == \
        {"hidden_size": 4096, "intermediate_size": 14336, "num_key_value_heads": 8, "vocab_size": 128256, "head_dim": 128,
         "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}
    assert config["rope_scaling"]["rope_type"] == "llama3"
    llama2 = {"dim": 4096, "multiple_of": 256, "n_heads": 32, "n_layers": 32, "norm_eps": 1e-05, "vocab_size": -1}
    parts = {f"mp{r}/{n}": SimpleNamespace(shape=(s[0] // 2, s[1]), dtype="F16") for r in range(2)
             for n, s in {"layers.0.feed_forward.w1.weight": (11008, 4096), "output.weight": (32000, 4096)}.items()}
    config = hf_config_from_meta(llama2, parts)  # model-parallel parts summed; Llama 2's vocab_size -1 ignored
    assert (config["vocab_size"], config["intermediate_size"], config["num_key_value_heads"], config["rope_theta"]) == (32000, 11008, 32, 10000.0)
    assert "rope_scaling" not in config and config["max_position_embeddings"] == 4096


def test_a_missing_rank_or_a_broken_params_json_is_refused(meta: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "gap"
    shutil.copytree(meta["two"], folder)
    (folder / "consolidated.01.pth").rename(folder / "consolidated.02.pth")
    with pytest.raises(CheckpointError, match="not ranks 00 to 01 without a gap"):
        wb.open_checkpoint(folder)
    (folder / "consolidated.02.pth").rename(folder / "consolidated.01.pth")
    (folder / "params.json").write_text("[1, 2")
    with pytest.raises(CheckpointError, match="params.json is not valid JSON"):
        wb.open_checkpoint(folder)
