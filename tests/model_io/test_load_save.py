"""wb.load_into / wb.save_from / M.from_module on one process: values, bytes, key checks, ties, layouts."""

from __future__ import annotations

import filecmp
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

import workbench as wb
from tests.conftest import load_safetensors_folder
from workbench import mapper as M
from workbench.errors import MapperError, PlanError
from workbench.iostats import IO
from workbench.mapper import presets
from workbench.model_io import ModuleMismatchError
from workbench.model_io.comm import stage_of
from workbench.model_io.holdings import merge
from workbench.model_io.local_part import LocalPart

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROTARY = ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]


@pytest.fixture(scope="module")
def reference(llama_sample: Path):
    """The sample loaded by transformers itself."""
    return transformers.LlamaForCausalLM.from_pretrained(llama_sample).eval()


def meta_llama(config):
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def assert_same_state(model, reference) -> None:
    ours, theirs = model.state_dict(), reference.state_dict()
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


def test_load_into_meta_llama_equals_from_pretrained(llama_sample: Path, reference) -> None:
    model = meta_llama(reference.config)
    events: list[tuple[int, int, int]] = []
    report = wb.load_into(model, llama_sample, on_progress=lambda *e: events.append(e))
    assert not any(t.is_meta for t in model.state_dict().values())
    assert_same_state(model, reference)
    assert report.uninitialized == []  # not in any checkpoint: recomputed as from_pretrained does
    assert report.recomputed == dict.fromkeys(ROTARY, "LlamaModel._init_weights(model.rotary_emb)")
    tokens = torch.arange(12)[None]
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, reference(tokens).logits)
    total = wb.open_checkpoint(llama_sample).catalog.total_bytes
    assert report.ok and len(report.loaded) == 39 and report.bytes_loaded == total
    assert report.bytes_read == report.predicted_bytes_read == total and report.files_match_plan
    assert report.peak_tensor_bytes == 0  # read straight into the parameters' memory
    assert events[-1] == (0, total, total)
    assert "Loaded 39 keys" in str(report)


def test_tensors_that_already_have_values_survive_materialising(llama_sample: Path, reference) -> None:
    model = meta_llama(reference.config)
    rotary = model.model.rotary_emb  # the HF way: parameters on meta, buffers computed for real
    for name in ("inv_freq", "original_inv_freq"):
        rotary.register_buffer(name, getattr(reference.model.rotary_emb, name).clone(), persistent=False)
    report = wb.load_into(model, llama_sample)
    assert report.uninitialized == [] and report.recomputed == {}
    tokens = torch.arange(12)[None]
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, reference(tokens).logits)


def test_load_fused_checkpoint_through_the_inverse_of_the_fused_preset(llama_sample: Path, reference, tmp_path: Path) -> None:
    fused = presets.hf_to_fused(llama_sample / "config.json")
    wb.convert(llama_sample, tmp_path / "fused", fused, shard_size="200KB", quiet=True)
    back = fused.inverse(wb.open_checkpoint(llama_sample))
    check = M.check_module(meta_llama(reference.config), tmp_path / "fused")  # names as they are: no fit
    assert not check.ok and "model.layers.0.self_attn.qkv_proj.weight" in check.unexpected
    assert "model.layers.0.self_attn.q_proj.weight" in check.missing
    model = meta_llama(reference.config)
    report = wb.load_into(model, tmp_path / "fused", back)
    assert_same_state(model, reference)
    assert report.files_match_plan and report.peak_tensor_bytes == 0


def test_only_the_files_a_module_needs_are_opened(llama_sample: Path, reference) -> None:
    layer = reference.model.layers[3]
    scoped = M.PrefixScope(M.Sequential(), "model.layers.3.", "")  # the checkpoint's layer 3 as the layer's own names
    module = type(layer)(reference.config, 3)
    report = wb.load_into(module, llama_sample, scoped, strict=False)
    assert not report.ok and len(report.check.unexpected) == 39 - 9 and len(report.loaded) == 9
    index = wb.open_checkpoint(llama_sample).catalog
    needed = {os.path.abspath(llama_sample / index[f"model.layers.3.{k}"].file) for k in module.state_dict()}
    assert set(report.files_opened) == needed and len(needed) < 3
    for key, value in layer.state_dict().items():
        assert torch.equal(module.state_dict()[key], value)


def mismatched_checkpoint(llama_sample: Path, tiny_checkpoint) -> Path:
    tensors = load_safetensors_folder(llama_sample)
    del tensors["model.norm.weight"]
    tensors["model.extra.bias"] = torch.ones(4)
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(64, 64)
    tensors["lm_head.weight"] = tensors["lm_head.weight"].to(torch.bfloat16)
    return tiny_checkpoint(tensors, name="mismatched", shards=2)


EXPECTED_ERRORS = {
    "unexpected": "Unexpected 'model.extra.bias': the source (after the mapper) has it (F32 [4]) but the module has no "
                  "parameter or buffer of that name. Drop or rename it in the mapper, or pass strict=False to skip it.",
    "shape": "Shape mismatch for 'model.layers.0.mlp.up_proj.weight': the module expects [128, 64] but the source gives "
             "[64, 64]. Fix the mapper (Reshape, Split, Concat) or build the module with the checkpoint's config.",
    "missing": "Missing 'model.norm.weight': the module expects F32 [64] but the source (after the mapper) has no such "
               "tensor. Map it from a source tensor, or pass strict=False to leave it unloaded.",
}
EXPECTED_CAST = "'lm_head.weight' is stored as BF16 and is cast to the module's F32 while loading."


def test_strict_report_names_every_mismatch_before_reading_anything(llama_sample: Path, reference, tiny_checkpoint) -> None:
    source = wb.open_checkpoint(mismatched_checkpoint(llama_sample, tiny_checkpoint))
    model = meta_llama(reference.config)
    IO.reset()
    with pytest.raises(ModuleMismatchError) as raised:
        wb.load_into(model, source)
    assert isinstance(raised.value, MapperError)
    message = str(raised.value)
    assert message.startswith(f"Cannot load {source.catalog.root} into LlamaForCausalLM: 3 problem(s) with its keys. (1) ")
    assert message.endswith("pass strict=False to load only the keys that fit (report.frame lists them).")
    for text in EXPECTED_ERRORS.values():
        assert text in message
    assert EXPECTED_CAST not in message  # a cast is not an error
    assert IO.snapshot()["bytes_read"] == 0 and IO.snapshot()["files_opened"] == []
    assert all(t.is_meta for t in model.parameters())  # refused before materialising

    frame = raised.value.check.frame
    rows = {row.kind: row for row in frame.itertuples()}
    assert set(frame.kind) == {"unexpected", "shape", "missing", "dtype"}
    for kind, text in EXPECTED_ERRORS.items():
        assert rows[kind].message == text and rows[kind].severity == "error"
    assert (rows["shape"].expected, rows["shape"].found) == ("F32 [128, 64]", "F32 [64, 64]")
    assert rows["missing"].expected == "F32 [64]" and not isinstance(rows["missing"].found, str)
    assert (rows["dtype"].message, rows["dtype"].severity) == (EXPECTED_CAST, "warning")

    report = wb.load_into(model, source, strict=False)  # loads what fits, reports the rest
    assert not report.ok and report.check.missing == ["model.norm.weight"]
    assert report.check.unexpected == ["model.extra.bias"] and report.check.mismatched == ["model.layers.0.mlp.up_proj.weight"]
    assert report.uninitialized == ["model.norm.weight", "model.layers.0.mlp.up_proj.weight"]
    assert list(report.recomputed) == ROTARY
    assert len(report.loaded) == 37 and "model.layers.0.mlp.up_proj.weight" not in report.loaded
    expected_head = reference.lm_head.weight.to(torch.bfloat16).to(torch.float32)
    assert torch.equal(model.lm_head.weight, expected_head)
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, reference.model.layers[1].mlp.up_proj.weight)


def test_computed_groups_and_casts_load_this_ranks_values(llama_sample: Path, reference, tmp_path: Path) -> None:
    wb.convert(llama_sample, tmp_path / "bf16", dtype="bf16", quiet=True)
    cast = M.Cast("model.layers.{i}.mlp.down_proj.weight", "F32")  # a computed (non byte-level) group per layer
    model = meta_llama(reference.config)
    report = wb.load_into(model, tmp_path / "bf16", cast)
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value.to(torch.bfloat16).float()), key
    casts = report.frame[report.frame.kind == "dtype"]
    assert len(casts) == 39 - 4 and report.ok
    largest = max(t.nbytes for t in wb.open_checkpoint(tmp_path / "bf16").catalog.values())
    assert 0 < report.peak_tensor_bytes <= report.largest_group_bytes <= 3 * largest


def test_save_from_lays_out_files_like_a_conversion_and_reloads(llama_sample: Path, reference, tmp_path: Path) -> None:
    fused = presets.hf_to_fused(llama_sample / "config.json")
    saved = wb.save_from(reference, tmp_path / "saved", fused, shard_size="50MB")
    wb.convert(llama_sample, tmp_path / "converted", fused, shard_size="50MB", extras=False, quiet=True)
    assert filecmp.cmp(tmp_path / "saved" / "model.safetensors", tmp_path / "converted" / "model.safetensors", shallow=False)
    assert saved.ok and not saved.index_written and saved.files == ["model.safetensors"]

    report = wb.save_from(reference, tmp_path / "sharded", shard_size="200KB")
    assert report.index_written and report.bytes_written == report.predicted_bytes_written
    assert report.peak_tensor_bytes == report.predicted_peak_bytes == 0  # plain tensors are written from their memory
    assert "Saved into" in str(report)
    from safetensors.torch import load_file, save_file

    for name in os.listdir(tmp_path / "sharded"):
        if name.endswith(".safetensors"):
            save_file(load_file(tmp_path / "sharded" / name), tmp_path / "ref.safetensors", metadata={"format": "pt"})
            assert filecmp.cmp(tmp_path / "ref.safetensors", tmp_path / "sharded" / name, shallow=False)
    shutil.copyfile(llama_sample / "config.json", tmp_path / "sharded" / "config.json")
    assert_same_state(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "sharded"), reference)

    with pytest.raises(PlanError, match="destination not empty"):
        wb.save_from(reference, tmp_path / "sharded")
    with pytest.raises(PlanError, match="on the meta device"):
        wb.save_from(meta_llama(reference.config), tmp_path / "meta")


def test_tied_weights_are_saved_once_and_refilled_through_the_tie(llama_sample: Path, tmp_path: Path) -> None:
    config = transformers.LlamaConfig.from_pretrained(llama_sample, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    wb.save_from(model, tmp_path / "tied")
    saved = wb.open_checkpoint(tmp_path / "tied").catalog
    assert "lm_head.weight" not in saved and "model.embed_tokens.weight" in saved
    fresh = meta_llama(config)
    report = wb.load_into(fresh, tmp_path / "tied")
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight  # to_empty untied them; the load re-ties
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight) and report.ok
    tied = report.frame[report.frame.kind == "tied"]
    assert list(tied.key) == ["lm_head.weight"] and list(tied.severity) == ["info"]


def test_from_module_is_an_identity_mapper_over_the_state_keys(llama_sample: Path, reference) -> None:
    mapper = M.from_module(reference)
    assert [leaf.name for leaf in mapper.leaves()] == list(reference.state_dict())
    namespace: dict = {}
    exec(mapper.to_code(), namespace)
    assert namespace["mapper"] == mapper
    binding = mapper.bind(wb.open_checkpoint(llama_sample), rest="error")
    assert binding.ok and list(binding.outputs) == list(wb.open_checkpoint(llama_sample).catalog)
    check = M.check_module(reference, llama_sample, mapper)
    assert check.ok and len(check.matched) == 39 and check.frame.empty
    renamed = M.Sequential(mapper, M.Rename("lm_head.weight", "output.weight"))
    check = M.check_module(reference, llama_sample, renamed)
    assert check.missing == ["lm_head.weight"] and check.unexpected == ["output.weight"]


def test_stage_comes_from_the_pipeline_coordinate_wherever_the_dim_is() -> None:
    grid = torch.arange(4).reshape(2, 2)
    pp_second = SimpleNamespace(mesh=grid, mesh_dim_names=("dp", "pp"))
    pp_first = SimpleNamespace(mesh=grid, mesh_dim_names=("pp", "dp"))
    assert [stage_of(pp_second, "pp", r) for r in range(4)] == [0, 1, 0, 1]
    assert [stage_of(pp_first, "pp", r) for r in range(4)] == [0, 0, 1, 1]
    assert [stage_of(pp_second, 1, r) for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(PlanError, match="Cannot find the pipeline dimension 'stage'"):
        stage_of(pp_second, "stage", 0)
    with pytest.raises(PlanError, match="rank 7 .* not in the device mesh"):
        stage_of(pp_second, "pp", 7)


def record(key: str, group: tuple[int, ...], shape=(4,)) -> tuple:
    return (key, "F32", shape, group, len(group) > 1)


def test_merged_holdings_follow_stage_order_and_refuse_lost_keys() -> None:
    # ranks 0/2 are stage 0 replicas, ranks 1/3 stage 1 replicas (pipeline dim second)
    published = [
        (0, [record("embed", (0,)), record("layers.0", (0,))]),
        (1, [record("layers.1", (1,)), record("head", (1,))]),
        (0, [record("embed", (2,)), record("layers.0", (2,))]),
        (1, [record("layers.1", (3,)), record("head", (3,))]),
    ]
    holdings = merge(published)
    assert [t.name for t in holdings.infos] == ["embed", "layers.0", "layers.1", "head"]
    assert holdings.source_group["head"] == (1,) and holdings.holders("head") == {1, 3}
    clash = [(0, [record("layers.0", (0,))]), (1, [record("layers.0", (1,))])]  # stages reusing local names
    with pytest.raises(PlanError, match="pipeline stages 0 .* and 1 .* both hold it"):
        merge(clash)
    with pytest.raises(PlanError, match="hold different sets of tensors"):
        merge([(None, [record("layers.0", (0,)), record("a", (0,))]), (None, [record("layers.0", (1,))])])
    with pytest.raises(PlanError, match="rank 1 as F32 \\[8\\]"):
        merge([(None, [record("w", (0,))]), (None, [record("w", (1,), shape=(8,))])])
    with pytest.raises(PlanError, match="DTensor over ranks \\[0, 1\\] but rank 1 does not hold it"):
        merge([(None, [record("w", (0, 1))]), (None, [])])


def test_local_part_rows_are_one_byte_range() -> None:
    rows = LocalPart((3, 0), (2, 4), (5, 4))
    assert rows.rows == (3, 5) and rows.byte_range("F32") == (48, 80) and rows.byte_range("BF16") == (24, 40)
    columns = LocalPart((0, 2), (5, 2), (5, 4))
    assert columns.rows is None and columns.byte_range("F32") is None
    full = torch.arange(20).reshape(5, 4)
    assert torch.equal(columns.take(full), full[:, 2:]) and torch.equal(rows.take(full), full[3:])
    assert LocalPart((), (), ()).byte_range("F32") == (0, 4)


def test_training_checkpoint_tensors_not_raw_on_disk_load_whole(samples_dir: Path) -> None:
    from torch import nn

    class Small(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 6)
            self.layers = nn.ModuleList([nn.Linear(6, 9)])
            self.head = nn.Linear(9, 4, bias=False)
            self.norm = nn.RMSNorm(6)

    source = wb.open_checkpoint(samples_dir / "training" / "dcp_2ranks")  # sharded chunks, some not contiguous
    with torch.device("meta"):
        model = Small()
    report = wb.load_into(model, source, presets.strip_prefix("model."), rest="drop")
    for key, value in model.state_dict().items():
        assert torch.equal(value, source.load("model." + key).to(value.dtype)), key
    assert report.ok and report.bytes_read == report.predicted_bytes_read > 0
    assert [Path(f).name for f in report.predicted_files] == ["__0_0.distcp", "__1_0.distcp"]
    assert list(report.frame.kind) == ["dtype"]  # norm.weight is stored as BF16
