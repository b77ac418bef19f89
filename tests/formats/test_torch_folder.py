"""Sharded torch.save folders (`pytorch_model.bin.index.json`), as transformers saved them before safetensors:
read without executing a pickle, equal to what transformers itself loads from the same folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb
from tests.conftest import load_checked
from workbench.errors import CheckpointError

transformers = pytest.importorskip("transformers")


def _write_bin_shards(folder: Path, model: torch.nn.Module, n_shards: int = 3) -> dict[str, torch.Tensor]:
    """The model's state dict in `n_shards` torch.save files with HF's index, plus its config."""
    folder.mkdir(parents=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    names = list(state)
    weight_map = {}
    for k in range(n_shards):
        shard = f"pytorch_model-{k + 1:05d}-of-{n_shards:05d}.bin"
        part = names[k::n_shards]
        torch.save({n: state[n] for n in part}, folder / shard)
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    model.config.to_json_file(folder / "config.json")
    return state


@pytest.fixture(scope="module")
def bin_folder(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    folder = tmp_path_factory.mktemp("bin") / "llama"
    return folder, _write_bin_shards(folder, model)


def test_opens_from_pickles_and_reads_every_tensor(bin_folder):
    folder, state = bin_folder
    ck = wb.open_checkpoint(folder)
    assert ck.format == "torch-sharded" and ck.catalog.metadata["weights_only"] == "yes"
    assert set(ck.catalog.tensors) == set(state)
    assert {t.file for t in ck.catalog.tensors.values()} == {f"pytorch_model-0000{k}-of-00003.bin" for k in (1, 2, 3)}
    assert ck.catalog.extras == ["config.json"]
    for name, tensor in state.items():
        assert torch.equal(load_checked(ck.catalog, name), tensor), name


def test_converts_to_what_transformers_loads_from_the_same_folder(bin_folder, tmp_path):
    folder, _ = bin_folder
    report = wb.convert(folder, tmp_path / "out", quiet=True, verify=True)
    assert report.files_match_plan
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder)  # reads the .bin shards itself
    converted = load_file(tmp_path / "out" / "model.safetensors")
    expected = reference.state_dict()
    assert set(converted) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(converted[name], tensor), name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)


def _edited(bin_folder, tmp_path: Path, edit) -> Path:
    folder = tmp_path / "edited"
    shutil.copytree(bin_folder[0], folder)
    index_path = folder / "pytorch_model.bin.index.json"
    index = json.loads(index_path.read_text())
    edit(folder, index["weight_map"])
    index_path.write_text(json.dumps(index))
    return folder


def test_index_paths_never_leave_the_folder(bin_folder, tmp_path):
    def escape(folder, weight_map):
        weight_map["lm_head.weight"] = "../outside.bin"

    with pytest.raises(CheckpointError, match=r"'\.\./outside\.bin' points outside the checkpoint folder"):
        wb.open_checkpoint(_edited(bin_folder, tmp_path, escape))


def test_missing_shard_and_wrong_claims_name_the_file_and_tensor(bin_folder, tmp_path):
    def drop(folder, weight_map):
        (folder / "pytorch_model-00002-of-00003.bin").unlink()

    with pytest.raises(CheckpointError, match=r"\(tensor '[^']+'\): shard pytorch_model-00002-of-00003\.bin named by pytorch_model\.bin\.index\.json is missing \(it should hold \d+ tensors\)\. Download"):
        wb.open_checkpoint(_edited(bin_folder, tmp_path, drop))

    def misplace(folder, weight_map):
        name = next(n for n, r in weight_map.items() if r.startswith("pytorch_model-00001"))
        weight_map[name] = "pytorch_model-00003-of-00003.bin"

    with pytest.raises(CheckpointError, match=r"says tensor '[^']+' is in pytorch_model-00003-of-00003\.bin, but it is in pytorch_model-00001"):
        wb.open_checkpoint(_edited(bin_folder, tmp_path / "2", misplace))
