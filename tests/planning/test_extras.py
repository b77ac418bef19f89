"""Files that hold weights are never copied along as extras (issue 29, D11).

A conversion copies the non-tensor files beside the weights (config, tokenizer). A second copy of the
model in another format (`pytorch_model.bin`, `tf_model.h5`, `model.gguf` ...) is not such a file: left
beside a bf16 output it is a stale fp32 model that loaders may pick. The plan lists each as skipped,
saying what it holds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file

import workbench as wb

OTHER_WEIGHTS = {
    "pytorch_model.bin": "PyTorch",
    "tf_model.h5": "TensorFlow/Keras",
    "flax_model.msgpack": "Flax",
    "rust_model.ot": "rust-bert",
    "model.gguf": "GGUF",
    "model.onnx": "ONNX",
    "weights.npz": "NumPy",
    "last.ckpt": "training checkpoint",
    "pytorch_model-00001-of-00002.bin": "PyTorch",
    "consolidated.pth": "PyTorch",
}


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "src"
    (folder / "tokenizer").mkdir(parents=True)
    (folder / "2_Dense").mkdir()
    save_file({"embed.weight": np.ones((4, 2), np.float32), "lm.weight": np.full((2, 2), 2.0, np.float32)},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"architectures": ["X"], "torch_dtype": "float32"}))
    (folder / "tokenizer.json").write_text('{"model": {}}')
    (folder / "tokenizer" / "vocab.txt").write_text("[PAD]\n")
    torch.save({"embed.weight": torch.ones(4, 2)}, folder / "pytorch_model.bin")
    torch.save({"embed.weight": torch.ones(4, 2)}, folder / "pytorch_model-00001-of-00002.bin")
    torch.save({"embed.weight": torch.ones(4, 2)}, folder / "consolidated.pth")
    torch.save({"state_dict": {}}, folder / "last.ckpt")
    (folder / "tf_model.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(64))
    (folder / "flax_model.msgpack").write_bytes(b"\x81\xa5embed" + bytes(32))
    (folder / "rust_model.ot").write_bytes(b"PK\x03\x04" + bytes(32))
    (folder / "model.gguf").write_bytes(b"GGUF" + bytes(32))
    (folder / "model.onnx").write_bytes(b"\x08\x07\x12\x07pytorch")
    np.savez(folder / "weights.npz", w=np.ones(3))
    # Weights under a name that does not say so: told by their first bytes.
    torch.save({"embed.weight": torch.ones(4, 2)}, folder / "weights_backup")
    (folder / "2_Dense" / "config.json").write_text('{"in_features": 2}')
    torch.save({"linear.weight": torch.ones(2, 2)}, folder / "2_Dense" / "dense_weights")
    return folder


def test_weight_files_of_other_formats_are_skipped_with_the_reason(tmp_path: Path) -> None:
    source = _folder(tmp_path)
    dest = tmp_path / "out"
    plan = wb.plan(source, dest=dest, dtype="BF16")
    table = plan.extras_table.set_index("path")
    for name, what in {**OTHER_WEIGHTS, "weights_backup": "torch.save"}.items():
        assert table.loc[name, "action"] == "skip", name
        assert what in table.loc[name, "reason"] and "stale" in table.loc[name, "reason"], (name, table.loc[name, "reason"])
    assert table.loc["2_Dense", "action"] == "skip" and "2_Dense/dense_weights" in table.loc["2_Dense", "reason"]
    assert table.loc["config.json", "action"] == "update"
    assert table.loc["tokenizer.json", "action"] == "copy" and table.loc["tokenizer/vocab.txt", "action"] == "copy"
    assert "tf_model.h5" in plan.summary()
    report = wb.convert(source, dest, dtype="BF16", quiet=True)
    assert report is not None
    assert sorted(os.listdir(dest)) == [".workbench-complete.json", "config.json", "model.safetensors", "tokenizer", "tokenizer.json"]
    assert json.loads((dest / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_stray_weights_outside_the_index_are_listed_as_not_part_of_the_source(tmp_path: Path) -> None:
    """A sharded folder also holding an old single-file `model.safetensors` the index does not list: never copied,
    and the plan says so instead of leaving it out silently."""
    folder = tmp_path / "src"
    folder.mkdir()
    save_file({"a": np.ones((2, 2), np.float32)}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({"b": np.ones((2, 2), np.float32)}, str(folder / "model-00002-of-00002.safetensors"))
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_file({"a": np.zeros((2, 2), np.float32)}, str(folder / "model.safetensors.old"))  # no weight suffix: told by content
    save_file({"a": np.zeros((2, 2), np.float32)}, str(folder / "stale.safetensors"))
    (folder / "config.json").write_text("{}")
    plan = wb.plan(folder, dest=tmp_path / "out")
    table = plan.extras_table.set_index("path")
    assert table.loc["stale.safetensors", "action"] == "skip" and "not part of the source" in table.loc["stale.safetensors", "reason"]
    assert table.loc["model.safetensors.old", "action"] == "skip" and "safetensors weights" in table.loc["model.safetensors.old", "reason"]
    assert "model.safetensors.index.json" not in table.index  # the source's own index
    assert plan.extras == ["config.json"]


def test_weight_kind_rule() -> None:
    from workbench.planning.extras import weight_kind

    for name in ["pytorch_model.bin", "TF_MODEL.H5", "x.safetensors", "model-00001-of-00002.bin", "a.bin.index.json",
                 "model.onnx_data", "adapter.pt", "rust_model.ot", "m.gguf"]:
        assert weight_kind(name) is not None, name
    for name in ["config.json", "tokenizer.json", "tokenizer.model", "vocab.txt", "README.md", "merges.txt", "modules.json"]:
        assert weight_kind(name) is None, name


def test_a_generated_config_follows_the_dtype_policy_and_the_mapper_edits(tmp_path: Path) -> None:
    from workbench.planning.extras import (
        COPIED,
        GENERATED,
        Extra,
        updated_bytes,
        with_config_updates,
        with_generated_config,
    )

    config = {"model_type": "llama", "torch_dtype": "float32", "tie_word_embeddings": False}
    extras = with_generated_config([Extra("params.json", COPIED, 9)], config, "BF16", "from params.json")
    generated = extras[0]
    assert (generated.path, generated.action, generated.reason) == ("config.json", GENERATED, "from params.json")
    assert json.loads(updated_bytes(tmp_path, generated, "BF16"))["torch_dtype"] == "bfloat16"  # no source file read
    edited, not_made = with_config_updates(tmp_path, extras, {"tie_word_embeddings": True}, {}, "BF16")
    assert not not_made and edited[0].action == GENERATED and "tie_word_embeddings false -> true" in edited[0].reason
    assert json.loads(updated_bytes(tmp_path, edited[0], "BF16"))["tie_word_embeddings"] is True
    source_has_one = [Extra("config.json", COPIED, 5)]
    assert with_generated_config(source_has_one, config, None, "from params.json") == source_has_one


def test_output_file_statements_replace_add_and_leave_out_extras(tmp_path: Path) -> None:
    """A mapper's `OutputFile` statements: the written file replaces the copy (generated, with its text), a new one
    is added, a left-out one is skipped with its reason; the conversion writes exactly those bytes."""
    from workbench import mapper as M

    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": np.ones((2, 2), dtype=np.float32)}, str(src / "model.safetensors"))
    for name, text in (("config.json", "{}"), ("tokenizer.json", '{"added_tokens": [], "model": {}}'),
                       ("tokenizer_config.json", '{"chat_template": "old"}'), ("vocab.json", "{}")):
        (src / name).write_text(text)
    mapper = M.Sequential(M.Identity("w"), M.OutputFile("tokenizer_config.json", text="{}\n", why="template moved"),
                          M.OutputFile("chat_template.jinja", text="{{ new }}", why="chat_template"),
                          M.OutputFile("vocab.json", why="stale beside the new vocabulary"),
                          M.OutputFile("tokenizer.json", source=str(src / "tokenizer.json"), added=['{"id": 3, "content": "z"}']))
    plan = wb.plan(wb.open_checkpoint(src), mapper)
    assert plan.ok, plan.problems
    actions = {e.path: (e.action, e.reason) for e in plan.extra_files}
    assert actions["chat_template.jinja"] == ("generate", "chat_template")
    assert actions["vocab.json"] == ("skip", "stale beside the new vocabulary")
    assert actions["config.json"][0] == "copy"
    wb.convert(wb.open_checkpoint(src), tmp_path / "out", mapper, quiet=True)
    out = tmp_path / "out"
    assert (out / "chat_template.jinja").read_text() == "{{ new }}" and (out / "tokenizer_config.json").read_text() == "{}\n"
    assert not (out / "vocab.json").exists()
    assert json.loads((out / "tokenizer.json").read_text())["added_tokens"] == [{"id": 3, "content": "z"}]
    gone = M.Sequential(M.Identity("w"), M.OutputFile("tokenizer.json", source=str(tmp_path / "missing.json")))
    assert any("cannot be read" in p.message for p in wb.plan(wb.open_checkpoint(src), gone).problems)
