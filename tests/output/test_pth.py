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
from workbench.mapper.presets import hf_to_meta
from workbench.mapper.presets.output_presets import hf_to_meta_mp


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


def test_nproc_mp_writes_meta_model_parallel_files_that_reassemble_to_the_one_way_output(llama_sample: Path, tmp_path: Path) -> None:
    wb.convert(llama_sample, tmp_path / "one", to="pth", quiet=True)
    whole = torch.load(tmp_path / "one" / "consolidated.00.pth", weights_only=True)
    report = wb.convert(llama_sample, tmp_path / "mp", to="pth", nproc_mp=2, quiet=True, verify=True)
    assert report.verified and report.files == ["consolidated.00.pth", "consolidated.01.pth", "params.json"]
    parts = [torch.load(tmp_path / "mp" / f"consolidated.0{r}.pth", weights_only=True) for r in range(2)]
    # Meta's fairscale layers: column-parallel rows, row-parallel columns, Llama 2's ParallelEmbedding columns.
    dims = {"tok_embeddings.weight": 1, "attention.wo.weight": 1, "feed_forward.w2.weight": 1}
    for name, tensor in whole.items():
        if name.endswith("norm.weight"):
            assert torch.equal(parts[0][name], tensor) and torch.equal(parts[1][name], tensor), name
            continue
        dim = next((d for suffix, d in dims.items() if name.endswith(suffix)), 0)
        assert parts[0][name].shape[dim] * 2 == tensor.shape[dim], name
        assert torch.equal(torch.cat([parts[0][name], parts[1][name]], dim=dim), tensor), name
    assert (tmp_path / "mp" / "params.json").read_bytes() == (tmp_path / "one" / "params.json").read_bytes()
    # The same split as the explicit mapper, and from the CLI.
    config = json.loads((llama_sample / "config.json").read_text())
    wb.convert(llama_sample, tmp_path / "mapper", hf_to_meta_mp(config, 2), to="pth", quiet=True)
    from workbench.cli.commands import main as cli_main

    assert cli_main(["convert", str(llama_sample), str(tmp_path / "cli"), "--to", "pth", "--nproc-mp", "2"]) == 0
    for name in ("consolidated.00.pth", "consolidated.01.pth"):
        assert (tmp_path / "mp" / name).read_bytes() == (tmp_path / "mapper" / name).read_bytes() == (tmp_path / "cli" / name).read_bytes()


def test_a_llama3_size_vocabulary_splits_the_embedding_by_rows() -> None:
    from workbench.mapper.presets.output_presets import embedding_split_dim

    assert embedding_split_dim({"vocab_size": 128256}) == 0  # Llama 3: VocabParallelEmbedding
    assert embedding_split_dim({"vocab_size": 32000}) == 1  # Llama 2: ParallelEmbedding


def test_nproc_mp_that_does_not_divide_the_heads_or_another_format_is_refused(llama_sample: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for path in llama_sample.iterdir():
        if path.name != "config.json":
            (bare / path.name).write_bytes(path.read_bytes())
    with pytest.raises(wb.PlanError, match="no config.json"):
        wb.plan(bare, to="pth", nproc_mp=2)
    with pytest.raises(wb.PlanError, match=r"num_key_value_heads \(2\) is not a multiple of 4"):
        wb.plan(llama_sample, to="pth", nproc_mp=4)
    with pytest.raises(wb.PlanError, match="nproc_mp=2 for safetensors output.*to='pth'"):
        wb.plan(llama_sample, nproc_mp=2)
    with pytest.raises(wb.PlanError, match="nproc_mp=0"):
        wb.plan(llama_sample, to="pth", nproc_mp=0)


# (dim, intermediate_size) -> Meta's params.json values for released models.
META_FFN = {
    (4096, 11008): (256, None),  # Llama 2 7B
    (5120, 13824): (256, None),  # Llama 2 13B
    (8192, 28672): (4096, 1.3),  # Llama 2 70B, Llama 3 70B
    (4096, 14336): (1024, 1.3),  # Llama 3 8B (and Mistral 7B's width)
    (16384, 53248): (4096, 1.2),  # Llama 3.1 405B
}


def _meta_feed_forward_width(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    # Meta's FeedForward.__init__ (llama/model.py), called with hidden_dim=4 * dim.
    hidden_dim = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden_dim = int(ffn_dim_multiplier * hidden_dim)
    return multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)


@pytest.mark.parametrize(("dim", "width"), [*META_FFN, (2048, 8192), (3072, 8192), (896, 4864), (3584, 18944), (64, 96),
                                            (64, 100), (64, 7), (5120, 27648), (4096, 12288)])
def test_params_json_ffn_arguments_give_the_intermediate_size_in_metas_formula(dim: int, width: int) -> None:
    from workbench.output.pth import meta_params

    config = {"hidden_size": dim, "intermediate_size": width, "num_hidden_layers": 2, "num_attention_heads": 8,
              "num_key_value_heads": 2, "vocab_size": 32000, "rms_norm_eps": 1e-5}
    params = meta_params(config)
    assert _meta_feed_forward_width(dim, params["multiple_of"], params.get("ffn_dim_multiplier")) == width
    if (dim, width) in META_FFN:
        assert (params["multiple_of"], params.get("ffn_dim_multiplier")) == META_FFN[(dim, width)]
    assert "hidden_dim" not in params and "rope_theta" not in params  # Llama 2's ModelArgs refuses unknown keys


def test_params_json_has_metas_keys_for_a_llama3_config() -> None:
    from workbench.output.pth import meta_params

    config = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-5,
              "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0}}
    # Llama 3.1 8B's params.json as Meta ships it.
    assert meta_params(config) == {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "vocab_size": 128256,
                                   "multiple_of": 1024, "ffn_dim_multiplier": 1.3, "norm_eps": 1e-5, "rope_theta": 500000.0,
                                   "use_scaled_rope": True}
