"""Meta `consolidated.NN.pth` + `params.json` (`to="pth"`): torch.load(weights_only=True) reads what the
Meta preset's safetensors output holds; a 2-way model-parallel split reassembles to the same tensors."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb
from workbench.mapper.output_presets import hf_to_meta_mp
from workbench.mapper.presets import hf_to_meta


@pytest.fixture(scope="module")
def meta_reference(llama_sample: Path, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("meta") / "st"
    config = json.loads((llama_sample / "config.json").read_text())
    wb.convert(llama_sample, out, hf_to_meta(config), shard_size="100GB", quiet=True)
    return load_file(out / "model.safetensors")


def test_consolidated_pth_loads_weights_only_into_the_meta_preset_tensors(llama_sample: Path, meta_reference: dict, tmp_path: Path) -> None:
    report = wb.convert(llama_sample, tmp_path / "out", to="pth", quiet=True, verify=True)
    assert report.verified and report.files == ["consolidated.00.pth", "params.json"]
    got = torch.load(tmp_path / "out" / "consolidated.00.pth", weights_only=True)
    assert sorted(got) == sorted(meta_reference)
    for name, tensor in meta_reference.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    params = json.loads((tmp_path / "out" / "params.json").read_text())
    assert params["dim"] == 64 and params["n_layers"] == 4 and params["n_kv_heads"] == 2
    with zipfile.ZipFile(tmp_path / "out" / "consolidated.00.pth") as archive:
        assert archive.testzip() is None


def test_dtype_policy_and_a_two_way_model_parallel_split(llama_sample: Path, meta_reference: dict, tmp_path: Path) -> None:
    config = json.loads((llama_sample / "config.json").read_text())
    report = wb.convert(llama_sample, tmp_path / "mp", hf_to_meta_mp(config, 2), to="pth", dtype="bf16", quiet=True, verify=True)
    assert report.verified and report.files == ["consolidated.00.pth", "consolidated.01.pth", "params.json"]
    parts = [torch.load(tmp_path / "mp" / f"consolidated.0{r}.pth", weights_only=True) for r in range(2)]
    assert sorted(parts[0]) == sorted(parts[1]) == sorted(meta_reference)
    dims = {"tok_embeddings.weight": 1, "attention.wo.weight": 1, "feed_forward.w2.weight": 1}
    for name, tensor in meta_reference.items():
        if name.endswith("norm.weight"):
            assert torch.equal(parts[0][name], parts[1][name])
            whole = parts[0][name]
        else:
            dim = next((d for suffix, d in dims.items() if name.endswith(suffix)), 0)
            whole = torch.cat([parts[0][name], parts[1][name]], dim=dim)
        assert whole.dtype == torch.bfloat16 and torch.equal(whole, tensor.to(torch.bfloat16)), name


def test_a_flipped_data_byte_fails_verify(llama_sample: Path, tmp_path: Path) -> None:
    plan = wb.plan(llama_sample, to="pth", dest=tmp_path / "out")
    wb.convert(llama_sample, tmp_path / "out", to="pth", quiet=True)
    path = tmp_path / "out" / "consolidated.00.pth"
    slot = plan.output_file_list[0].layout.tensors[3]
    data = bytearray(path.read_bytes())
    data[slot.begin] ^= 0x01
    path.write_bytes(bytes(data))
    from workbench.engine.output_check import check_outputs

    check = check_outputs(plan)
    assert not check.ok


def test_worker_ranks_write_whole_files_and_the_bytes_do_not_change(llama_sample: Path, tmp_path: Path) -> None:
    # Each MP group (one source tensor -> its slice in every file) spans both files, so one rank owns both.
    config = json.loads((llama_sample / "config.json").read_text())
    mapper = hf_to_meta_mp(config, 2)
    wb.convert(llama_sample, tmp_path / "one", mapper, to="pth", quiet=True)
    plan = wb.plan(llama_sample, mapper, to="pth", nproc=2, dest=tmp_path / "two")
    assert plan.ok and len({f.rank for f in plan.output_file_list}) == 1
    wb.convert(llama_sample, tmp_path / "two", mapper, to="pth", nproc=2, launcher="local", quiet=True)
    for name in ("consolidated.00.pth", "consolidated.01.pth", "params.json"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
