"""`mapper.inverse(source)`: the source supplies what the mapper alone does not say (split sizes,
original shapes and dtypes); templates stay templates when every match inverts alike."""

from __future__ import annotations

import pytest
import torch

from workbench import mapper as M
from workbench.errors import MapperError

QKV = [f"layers.{{i}}.{p}" for p in "qkv"]


def gqa_state(layers: int, kv_rows=lambda layer: 2) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    state = {}
    for layer in range(layers):
        state[f"layers.{layer}.q"] = torch.randn(4, 3)
        state[f"layers.{layer}.k"] = torch.randn(kv_rows(layer), 3)
        state[f"layers.{layer}.v"] = torch.randn(kv_rows(layer), 3)
    return state


def test_concat_inverse_is_a_templated_split_with_sizes_from_the_source():
    mapper = M.Concat(QKV, "layers.{i}.qkv")
    inverse = mapper.inverse(gqa_state(3))
    assert inverse == M.Split("layers.{i}.qkv", QKV, sizes=[4, 2, 2])
    fused = mapper.apply(gqa_state(3))
    restored = inverse.apply(fused)
    assert all(torch.equal(restored[name], tensor) for name, tensor in gqa_state(3).items())


def test_inverse_expands_when_matches_differ():
    state = gqa_state(3, kv_rows=lambda layer: 1 + layer)
    inverse = M.Concat(QKV, "layers.{i}.qkv").inverse(state)
    assert inverse == M.Parallel(*[
        M.Split(f"layers.{i}.qkv", [f"layers.{i}.{p}" for p in "qkv"], sizes=[4, 1 + i, 1 + i]) for i in range(3)
    ])
    restored = inverse.apply(M.Concat(QKV, "layers.{i}.qkv").apply(state))
    assert all(torch.equal(restored[name], tensor) for name, tensor in state.items())


def test_sequential_inverse_runs_backwards_with_the_metadata_of_each_step():
    mapper = M.Sequential(
        M.Parallel(M.Rename("layers.{i}.q", "q.{i}"), M.Cast("layers.{i}.k", "F64")),
        M.Reshape("q.{i}", [2, 2, 3]),
        M.Transpose("q.{i}", 0, 1, dst="qt.{i}"),
        M.Stack(["layers.{i}.k", "layers.{i}.v"], "kv.{i}", dim=1),
    )
    state = {name: t for name, t in gqa_state(2).items()}
    state["layers.0.v"] = state["layers.0.v"].double()
    state["layers.1.v"] = state["layers.1.v"].double()
    out = mapper.apply(state)
    assert sorted(out) == ["kv.0", "kv.1", "qt.0", "qt.1"]
    inverse = mapper.inverse(state)
    assert inverse == M.Sequential(
        M.Unstack("kv.{i}", ["layers.{i}.k", "layers.{i}.v"], dim=1),
        M.Transpose("qt.{i}", 0, 1, dst="q.{i}"),
        M.Reshape("q.{i}", [4, 3]),
        M.Parallel(M.Rename("q.{i}", "layers.{i}.q"), M.Cast("layers.{i}.k", "F32")),
    )
    restored = inverse.apply(out)
    assert sorted(restored) == sorted(state)
    assert all(torch.equal(restored[name], tensor) and restored[name].dtype == tensor.dtype for name, tensor in state.items())


def test_non_invertible_mapper_names_the_blocking_operation():
    state = gqa_state(1)
    with pytest.raises(MapperError, match=r"Cannot invert Cast\('layers\.\{i\}\.q', 'BF16'\): casting F32 to BF16 loses information"):
        M.Sequential(M.Rename("layers.{i}.k", "k.{i}"), M.Cast("layers.{i}.q", "bf16")).inverse(state)
    with pytest.raises(MapperError, match=r"Cannot invert Function\(fn='torch:neg'.*is not invertible"):
        M.Function(fn="torch:neg", inputs=["layers.{i}.q"], outputs=["n.{i}"]).inverse(state)
    with pytest.raises(MapperError, match="does not bind cleanly to the source"):
        M.Rename("missing", "x").inverse(state)
