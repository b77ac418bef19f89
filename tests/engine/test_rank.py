"""The streaming engine on one process: exact output bytes, files opened, memory, failures, resume."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import workbench as wb
from tests.conftest import load_safetensors_folder
from workbench import mapper as M
from workbench.catalog import Catalog
from workbench.engine import Cancelled
from workbench.errors import PlanError
from workbench.formats import open_catalog
from workbench.iostats import IO
from workbench.mapper import presets
from workbench.mapper.groups import Binding, Group
from workbench.planning.destination import COMPLETE_NAME

INDEX = "model.safetensors.index.json"


def assert_equals_save_file(dest: Path, expected: dict, scratch: Path) -> list[str]:
    """Every output shard is byte-identical to safetensors' save_file of the expected tensors it holds."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shards = sorted(n for n in os.listdir(dest) if n.endswith(".safetensors"))
    seen: set[str] = set()
    for shard in shards:
        with safe_open(dest / shard, framework="pt") as fh:
            names = list(fh.keys())
        seen.update(names)
        reference = scratch / f"reference-{shard}"
        save_file({n: expected[n].contiguous() for n in names}, reference, metadata={"format": "pt"})
        assert filecmp.cmp(reference, dest / shard, shallow=False), f"{shard} differs from save_file"
    assert seen == set(expected)
    return shards


def leftovers(dest: Path) -> list[str]:
    """Temporary files and run markers; a finished run's completion record is not a leftover."""
    return sorted(n for n in os.listdir(dest) if n.endswith(".partial") or (n.startswith(".workbench") and n != COMPLETE_NAME))


def test_reshard_is_byte_identical_and_opens_exactly_the_planned_files(llama_sample: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    plan = wb.plan(llama_sample, shard_size="300KB", dest=dest)
    report = wb.convert(llama_sample, dest, shard_size="300KB", quiet=True)
    shards = assert_equals_save_file(dest, load_safetensors_folder(llama_sample), tmp_path)
    assert shards == [f.name for f in plan.output_file_list] and len(shards) == 3
    assert IO.snapshot()["files_opened"] == plan.source_paths() == report.files_opened
    assert report.files_match_plan and report.ok
    assert report.bytes_read == plan.bytes_read and report.bytes_written == plan.bytes_written
    assert report.peak_tensor_bytes == plan.peak_bytes == 0
    index = json.loads((dest / INDEX).read_text())
    assert index == plan.index and list(index["weight_map"]) == sorted(index["weight_map"])
    assert (dest / "config.json").read_bytes() == (llama_sample / "config.json").read_bytes()
    assert leftovers(dest) == []
    assert report.to_frame().loc["bytes read", "measured"] == plan.bytes_read
    assert "files opened match the plan: yes" in str(report) and "<table>" in report._repr_html_()


def test_identity_of_a_single_file_reproduces_it(bert_sample: Path, tmp_path: Path) -> None:
    report = wb.convert(wb.open_checkpoint(bert_sample), tmp_path / "out", quiet=True, extras=False)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (bert_sample / "model.safetensors").read_bytes()
    assert sorted(os.listdir(tmp_path / "out")) == [".workbench-complete.json", "model.safetensors"] and not report.index_written


def test_cast_to_bf16_in_small_chunks(llama_sample: Path, tmp_path: Path) -> None:
    import torch

    dest = tmp_path / "out"
    report = wb.convert(llama_sample, dest, dtype="bf16", chunk_size="4KB", quiet=True)
    expected = {n: t.to(torch.bfloat16) for n, t in load_safetensors_folder(llama_sample).items()}
    assert_equals_save_file(dest, expected, tmp_path)
    assert report.predicted_peak_bytes == 1000 * 4 + 1000 * 2  # one chunk in, one chunk out
    assert abs(report.peak_tensor_bytes - report.predicted_peak_bytes) <= 0.1 * report.predicted_peak_bytes
    assert report.files_match_plan


def test_fused_qkv_and_gate_up_are_concatenations(llama_sample: Path, tmp_path: Path) -> None:
    import torch

    dest = tmp_path / "out"
    mapper = presets.hf_to_fused(llama_sample / "config.json")
    plan = wb.plan(llama_sample, mapper, shard_size="300KB", dest=dest)
    assert all(s.kind == "copy" for s in plan.steps)
    wb.convert(llama_sample, dest, mapper, shard_size="300KB", quiet=True)
    src = load_safetensors_folder(llama_sample)
    expected = {n: t for n, t in src.items() if not any(p in n for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))}
    for i in range(4):
        p = f"model.layers.{i}."
        expected[p + "self_attn.qkv_proj.weight"] = torch.cat([src[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        expected[p + "mlp.gate_up_proj.weight"] = torch.cat([src[p + "mlp.gate_proj.weight"], src[p + "mlp.up_proj.weight"]])
    assert_equals_save_file(dest, expected, tmp_path)


class _NoLocate:
    """A reader that refuses kernel copies, so every byte goes through read_bytes."""

    def __init__(self, reader) -> None:
        self.reader = reader

    def read_bytes(self, info):
        return self.reader.read_bytes(info)

    def locate(self, info):
        return None

    def close(self) -> None:
        self.reader.close()


def test_compute_groups_and_unlocated_sources_match_predicted_memory(llama_sample: Path, tmp_path: Path) -> None:
    base = open_catalog(llama_sample)
    catalog = Catalog(root=base.root, format=base.format, tensors=base.tensors, files=base.files, reader=_NoLocate(base.reader))
    mapper = M.Transpose("model.embed_tokens.weight", dst="embed_t")
    plan = wb.plan(catalog, mapper, dest=tmp_path / "out")
    kinds = {s.group.outputs[0].name: s.kind for s in plan.steps}
    assert kinds["embed_t"] == "compute" and kinds["lm_head.weight"] == "copy"
    report = wb.convert(catalog, tmp_path / "out", mapper, quiet=True)
    src = load_safetensors_folder(llama_sample)
    expected = {n: t for n, t in src.items() if n != "model.embed_tokens.weight"}
    expected["embed_t"] = src["model.embed_tokens.weight"].t().contiguous()
    assert_equals_save_file(tmp_path / "out", expected, tmp_path)
    assert plan.peak_bytes == 2 * 256 * 64 * 4  # the transpose holds its input and its output
    assert report.peak_tensor_bytes == report.predicted_peak_bytes == plan.peak_bytes


def test_many_tiny_tensors_are_copied_in_few_calls(tiny_checkpoint, tmp_path: Path) -> None:
    import torch

    tensors = {f"block.{i:04d}.w": torch.full((3,), float(i)) for i in range(3000)}
    src = tiny_checkpoint(tensors, shards=2)
    report = wb.convert(src, tmp_path / "out", shard_size="20KB", quiet=True)
    assert_equals_save_file(tmp_path / "out", tensors, tmp_path)
    shards = [n for n in os.listdir(tmp_path / "out") if n.endswith(".safetensors")]
    assert report.ranks[0].copy_calls <= 2 * len(shards)  # runs adjacent in source and output are merged


@pytest.mark.parametrize("window", [None, 1000])
def test_fused_tiny_tensors_are_assembled_in_few_calls(tiny_checkpoint, tmp_path: Path, window, monkeypatch) -> None:
    # q/k/v sit apart in the source (k, o, q, v in name order) but side by side in each fused output: the tiny
    # runs are gathered per output window (a few reads, one write) rather than copied one by one.
    import torch

    from workbench.engine import copier

    if window is not None:  # many windows: each one's size and end are counted afresh
        monkeypatch.setattr(copier, "WRITE_CALL_MAX", window)

    layers = 400
    tensors = {}
    for i in range(layers):
        for part, rows in (("k", 2), ("o", 4), ("q", 4), ("v", 2)):
            tensors[f"layers.{i}.{part}_proj.weight"] = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + 1000 * i
    src = tiny_checkpoint(tensors, shards=2)
    mapper = M.Concat([f"layers.{{i}}.{p}_proj.weight" for p in "qkv"], "layers.{i}.qkv_proj.weight")
    report = wb.convert(src, tmp_path / "out", mapper, shard_size="40KB", quiet=True)
    expected = {n: t for n, t in tensors.items() if ".o_proj" in n}
    for i in range(layers):
        expected[f"layers.{i}.qkv_proj.weight"] = torch.cat([tensors[f"layers.{i}.{p}_proj.weight"] for p in "qkv"])
    shards = assert_equals_save_file(tmp_path / "out", expected, tmp_path)
    calls = report.ranks[0].copy_calls
    if window is None:
        assert len(shards) > 1 and calls <= 4 * len(shards)  # 4 * layers one by one
    else:  # 76.8 KB of output in windows of at most 1000 bytes: about one call per 1000 bytes
        assert 76_800 // window <= calls <= 2 * 76_800 // window


def test_byte_level_conversion_never_imports_torch(llama_sample: Path, tmp_path: Path) -> None:
    code = (
        "import sys, workbench as wb\nfrom workbench.mapper import presets\n"
        f"m = presets.hf_to_fused({str(llama_sample / 'config.json')!r})\n"
        f"r = wb.convert({str(llama_sample)!r}, {str(tmp_path / 'out')!r}, m, shard_size='300KB', quiet=True)\n"
        "assert r.ok and r.files_match_plan\n"
        "print('torch' in sys.modules, 'pandas' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_interrupted_run_resumes_to_identical_output(llama_sample: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clean, dest = tmp_path / "clean", tmp_path / "out"
    wb.convert(llama_sample, clean, shard_size="300KB", quiet=True)
    monkeypatch.setenv("WORKBENCH_FAIL_RANK", "0")
    with pytest.raises(PlanError, match="failure injected"):
        wb.convert(llama_sample, dest, shard_size="300KB", quiet=True)
    assert not (dest / INDEX).exists()
    assert sorted(os.listdir(dest)) == [".workbench-convert.json", "model-00001-of-00003.safetensors",
                                        "model-00002-of-00003.safetensors"]
    monkeypatch.delenv("WORKBENCH_FAIL_RANK")
    busy = wb.plan(llama_sample, shard_size="500KB", dest=dest)
    assert not busy.ok and "different plan" in busy.errors[0].message
    report = wb.convert(llama_sample, dest, shard_size="300KB", quiet=True)
    assert report.kept == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"]
    assert report.files_opened == [str(llama_sample / "model-00003-of-00003.safetensors")] and report.files_match_plan
    assert sorted(os.listdir(dest)) == sorted(os.listdir(clean))
    for name in os.listdir(clean):
        assert filecmp.cmp(clean / name, dest / name, shallow=False), name


class _Broken:
    def apply(self, tensors):
        raise RuntimeError("boom")


def test_a_failing_op_names_the_tensor_and_leaves_nothing_half_written(llama_sample: Path, tmp_path: Path) -> None:
    catalog = open_catalog(llama_sample)
    info = catalog["model.norm.weight"]
    binding = Binding([Group((info,), (info.meta(),), _Broken(), label="broken")])
    with pytest.raises(PlanError, match=r"model\.norm\.weight.*boom"):
        wb.convert(catalog, tmp_path / "out", binding, quiet=True)
    assert os.listdir(tmp_path / "out") == [".workbench-convert.json"]


def test_cancel_from_the_progress_callback(llama_sample: Path, tmp_path: Path) -> None:
    calls = []

    def stop(rank: int, done: int, total: int) -> bool:
        calls.append((rank, done, total))
        return False

    with pytest.raises(Cancelled, match="cancelled"):
        wb.convert(llama_sample, tmp_path / "out", shard_size="300KB", on_progress=stop, quiet=True)
    assert calls and calls[0][0] == 0 and calls[0][2] == open_catalog(llama_sample).total_bytes
    assert not (tmp_path / "out" / INDEX).exists() and not [n for n in os.listdir(tmp_path / "out") if n.endswith(".partial")]


def test_destination_rules_overwrite_and_extras(llama_sample: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    wb.convert(llama_sample, dest, shard_size="300KB", quiet=True)
    with pytest.raises(PlanError, match="holds a finished conversion of a different plan"):  # another shard size
        wb.convert(llama_sample, dest, quiet=True)
    wb.convert(llama_sample, dest, quiet=True, overwrite=True, extras=False)
    assert sorted(os.listdir(dest)) == [".workbench-complete.json", "config.json", "generation_config.json", "model.safetensors"]  # old shards gone
    assert_equals_save_file(dest, load_safetensors_folder(llama_sample), tmp_path)


def _sentence_transformers_folder(root: Path) -> Path:
    """A sentence-transformers layout: the transformer at the top, modules in numbered subfolders."""
    import numpy as np
    from safetensors.numpy import save_file

    folder = root / "st"
    for sub in ("1_Pooling", "2_Dense", "3_Normalize", ".cache/huggingface", "tokenizer/extra"):
        (folder / sub).mkdir(parents=True)
    save_file({"embeddings.weight": np.ones((4, 2), np.float32)}, str(folder / "model.safetensors"))
    save_file({"linear.weight": np.ones((2, 2), np.float32)}, str(folder / "2_Dense" / "model.safetensors"))
    (folder / "2_Dense" / "config.json").write_text('{"in_features": 2}')
    (folder / "config.json").write_text('{"architectures": ["BertModel"]}')
    (folder / "modules.json").write_text(json.dumps([{"idx": 0, "path": ""}, {"idx": 1, "path": "1_Pooling"}]))
    (folder / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    (folder / "tokenizer" / "extra" / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    (folder / ".cache" / "huggingface" / "model.safetensors.metadata").write_text("etag")
    return folder


def test_subfolders_without_tensors_travel_with_the_weights(tmp_path: Path) -> None:
    source = _sentence_transformers_folder(tmp_path)
    dest = tmp_path / "out"
    plan = wb.plan(source, dest=dest)
    actions = dict(zip(plan.extras_table["path"], plan.extras_table["action"], strict=True))
    assert actions == {
        ".cache": "skip", "1_Pooling/config.json": "copy", "2_Dense": "skip", "3_Normalize/": "copy",
        "config.json": "copy", "modules.json": "copy", "tokenizer/extra/vocab.txt": "copy",
    }
    summary = plan.summary()
    assert "1_Pooling/config.json" in summary and "2_Dense (holds tensors (2_Dense/model.safetensors)" in summary
    assert ".cache (a hidden folder" in summary
    report = wb.convert(source, dest, quiet=True)
    assert "1_Pooling/config.json" in report.extras and "tokenizer/extra/vocab.txt" in report.extras
    for rel in ("1_Pooling/config.json", "tokenizer/extra/vocab.txt", "modules.json", "config.json"):
        assert filecmp.cmp(source / rel, dest / rel, shallow=False), rel
    assert not (dest / "2_Dense").exists() and not (dest / ".cache").exists()
    assert sorted(os.listdir(dest)) == [".workbench-complete.json", "1_Pooling", "3_Normalize", "config.json", "model.safetensors",
                                        "modules.json", "tokenizer"]
    assert os.listdir(dest / "3_Normalize") == []  # sentence-transformers' Normalize module: an empty folder
    # The free-space check counts the subfolders' bytes too.
    assert plan.extras_table.set_index("path").loc["tokenizer/extra/vocab.txt", "bytes"] == len("[PAD]\n[UNK]\n")


def test_source_header_metadata_is_kept_sorted_and_rank_independent(tmp_path: Path) -> None:
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import save_file

    folder = tmp_path / "lora"
    folder.mkdir()
    meta = {"ss_network_dim": "8", "format": "pt", "modelspec.architecture": "sdxl/lora", "ss_base_model": "x"}
    save_file({f"t{i}": np.full(64, i, np.float32) for i in range(6)}, str(folder / "model.safetensors"), metadata=meta)
    one, two = tmp_path / "one", tmp_path / "two"
    wb.convert(folder, one, dtype="bf16", quiet=True)
    wb.convert(folder, two, dtype="bf16", nproc=2, quiet=True)
    assert filecmp.cmp(one / "model.safetensors", two / "model.safetensors", shallow=False)
    with safe_open(one / "model.safetensors", framework="np") as fh:
        assert fh.metadata() == meta
    raw = (one / "model.safetensors").read_bytes()
    header = raw[8 : 8 + int.from_bytes(raw[:8], "little")].decode()
    assert '"__metadata__":{"format":"pt","modelspec.architecture":"sdxl/lora","ss_base_model":"x","ss_network_dim":"8"}' in header


def test_source_header_metadata_kept_where_the_files_agree(tmp_path: Path) -> None:
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import save_file

    folder = tmp_path / "two_files"
    folder.mkdir()
    save_file({"a": np.ones(256, np.float32)}, str(folder / "a.safetensors"), metadata={"format": "pt", "run": "r1", "step": "10"})
    save_file({"b": np.ones(256, np.float32)}, str(folder / "b.safetensors"), metadata={"format": "pt", "run": "r1", "step": "20"})
    merged = wb.plan(folder, dest=tmp_path / "merged")
    assert merged.output_metadata == {"model.safetensors": {"format": "pt", "run": "r1"}}
    dropped = [p.message for p in merged.warnings if "'step'" in p.message]
    assert dropped and "disagree" in dropped[0] and "a.safetensors: '10'" in dropped[0]
    assert "source header metadata dropped: step" in merged.summary()
    wb.convert(folder, tmp_path / "merged", quiet=True)
    with safe_open(tmp_path / "merged" / "model.safetensors", framework="np") as fh:
        assert fh.metadata() == {"format": "pt", "run": "r1"}
    # One source file per output shard: each shard keeps its own file's values.
    split = wb.plan(folder, shard_size=1024, dest=tmp_path / "split")
    assert list(split.output_metadata.values()) == [
        {"format": "pt", "run": "r1", "step": "10"}, {"format": "pt", "run": "r1", "step": "20"},
    ]
    assert not [p for p in split.warnings if "metadata" in p.message]
