"""Checkpoint.diff: metadata differences from headers, value differences chunk by chunk."""

from __future__ import annotations

import math

import torch

import workbench as wb
from workbench.iostats import IO


def test_diff_with_itself_is_empty(llama_sample):
    ck = wb.open_checkpoint(llama_sample)
    assert ck.diff(llama_sample).empty
    assert ck.diff(ck, values=True).empty
    same = ck.diff(ck, include_same=True)
    assert len(same) == 39 and (same["status"] == "same").all()


def test_diff_reads_no_data_without_values(llama_sample):
    ck = wb.open_checkpoint(llama_sample)
    other = wb.open_checkpoint(llama_sample)
    IO.reset()
    ck.diff(other)
    assert IO.snapshot()["bytes_read"] == 0


def test_diff_finds_every_kind_of_change(tiny_checkpoint, tiny_tensors):
    before = tiny_tensors(layers=2, hidden=8)
    after = dict(before)
    del after["lm_head.weight"]  # removed
    after["model.layers.2.mlp.up_proj.weight"] = torch.ones(16, 8)  # added
    after["model.norm.weight"] = before["model.norm.weight"].to(torch.bfloat16)  # dtype changed
    after["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(5, 8)  # shape changed
    changed = before["model.layers.1.mlp.down_proj.weight"].clone()
    changed[3, 7] += 0.5
    after["model.layers.1.mlp.down_proj.weight"] = changed  # values changed
    a = wb.open_checkpoint(tiny_checkpoint(before, name="a"))
    b = wb.open_checkpoint(tiny_checkpoint(after, name="b", shards=3))

    meta = a.diff(b)
    assert dict(meta["status"]) == {
        "lm_head.weight": "removed",
        "model.layers.2.mlp.up_proj.weight": "added",
        "model.norm.weight": "dtype changed",
        "model.layers.0.self_attn.k_proj.weight": "shape changed",
    }
    assert "max_abs_diff" not in meta.columns
    assert meta.loc["model.norm.weight", "dtype"] == "F32"
    assert meta.loc["model.norm.weight", "other_dtype"] == "BF16"
    assert meta.loc["model.layers.0.self_attn.k_proj.weight", "shape"] == (4, 8)
    assert meta.loc["model.layers.0.self_attn.k_proj.weight", "other_shape"] == (5, 8)

    full = a.diff(b, values=True, chunk_elements=7)
    assert full.loc["model.layers.1.mlp.down_proj.weight", "status"] == "values changed"
    assert math.isclose(full.loc["model.layers.1.mlp.down_proj.weight", "max_abs_diff"], 0.5, rel_tol=1e-6)
    expected_cast = float((before["model.norm.weight"] - before["model.norm.weight"].to(torch.bfloat16).float()).abs().max())
    assert full.loc["model.norm.weight", "max_abs_diff"] == expected_cast > 0
    assert len(full) == 5

    reverse = b.diff(a)
    assert reverse.loc["lm_head.weight", "status"] == "added"
    assert reverse.loc["model.layers.2.mlp.up_proj.weight", "status"] == "removed"


def test_values_diff_is_chunked_and_bounded(tiny_checkpoint):
    base = torch.arange(1000, dtype=torch.float32)
    moved = base.clone()
    moved[999] = -1.0  # only in the last chunk
    a = wb.open_checkpoint(tiny_checkpoint({"x": base}, name="a", single_file=True))
    b = wb.open_checkpoint(tiny_checkpoint({"x": moved}, name="b", single_file=True))
    IO.reset()
    result = a.diff(b, values=True, chunk_elements=100)
    snap = IO.snapshot()
    assert result.loc["x", "max_abs_diff"] == 1000.0
    assert snap["read_calls"] == 20  # 10 chunks per side, never the whole tensor in one read
    assert snap["bytes_read"] == 2 * 4000


def test_values_diff_treats_matching_nans_as_equal(tiny_checkpoint):
    x = torch.tensor([1.0, float("nan"), float("inf"), 4.0])
    y = x.clone()
    y[0] = 1.25
    z = x.clone()
    z[3] = float("nan")
    ck = wb.open_checkpoint(tiny_checkpoint({"y": y, "z": z, "same": x}, name="a", single_file=True))
    other = wb.open_checkpoint(tiny_checkpoint({"y": x, "z": x.clone(), "same": x.clone()}, name="b", single_file=True))
    result = ck.diff(other, values=True, include_same=True)
    assert result.loc["y", "max_abs_diff"] == 0.25
    assert result.loc["same", "status"] == "same"
    assert result.loc["z", "status"] == "values changed" and math.isnan(result.loc["z", "max_abs_diff"])

