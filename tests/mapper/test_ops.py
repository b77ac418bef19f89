"""Leaf operations: inferred metadata equals what `apply` produces, byte recipes equal the real bytes,
and `inverse` restores the inputs bit for bit — for random shapes and dtypes (hypothesis)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench import mapper as M
from workbench.catalog import TensorInfo
from workbench.dtypes import from_torch, to_torch
from workbench.errors import MapperError
from workbench.mapper.ops import _WIDER

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BYTE_DTYPES = ["F32", "BF16", "F16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL"]


def random_tensor(dtype: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bit patterns of `dtype` (NaNs included: byte-moving ops must not care)."""
    generator = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=to_torch(dtype)).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * itemsize,), dtype=torch.uint8, generator=generator)
    if dtype == "BOOL":
        raw = raw % 2
    return raw.view(to_torch(dtype)).reshape(shape)


def raw_bytes(tensor: torch.Tensor) -> bytes:
    if tensor.numel() == 0:
        return b""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def check_operation(op: M.Mapper, tensors: dict[str, torch.Tensor], invertible: bool = True) -> None:
    """The four properties every leaf must have."""
    infos = [TensorInfo(name, from_torch(t.dtype), tuple(t.shape)) for name, t in tensors.items()]
    declared = {info.name: (info.dtype, info.shape) for info in op.infer_outputs([i for i in infos if i.name in op.inputs])}
    result = op.apply(tensors)
    produced = {name: (from_torch(t.dtype), tuple(t.shape)) for name, t in result.items() if name in op.outputs}
    assert produced == declared
    assert set(result) == (set(tensors) - set(op.inputs)) | set(op.outputs)

    binding = op.bind(tensors)
    assert binding.ok, binding.problems
    for group in binding.groups:
        if group.recipe is None:
            continue
        for name, slices in group.recipe.items():
            assembled = b"".join(raw_bytes(tensors[s.source])[s.begin:s.end] for s in slices)
            assert assembled == raw_bytes(result[name]), f"recipe of {name} disagrees with apply"

    if invertible:
        restored = op.inverse(tensors).apply(result)
        assert set(restored) == set(tensors)
        for name, tensor in tensors.items():
            assert restored[name].dtype == tensor.dtype and restored[name].shape == tensor.shape
            assert raw_bytes(restored[name]) == raw_bytes(tensor)


shapes = st.lists(st.integers(0, 4), min_size=1, max_size=4).map(tuple)
nonzero_shapes = st.lists(st.integers(1, 4), min_size=1, max_size=4).map(tuple)
dtypes = st.sampled_from(BYTE_DTYPES)
seeds = st.integers(0, 2**16)


@SETTINGS
@given(data=st.data(), shape=shapes, dtype=dtypes, seed=seeds)
def test_concat_properties(data, shape, dtype, seed):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    count = data.draw(st.integers(1, 4))
    tensors = {}
    for k in range(count):
        part = list(shape)
        part[dim] = data.draw(st.integers(0, 3))
        tensors[f"in{k}"] = random_tensor(dtype, tuple(part), seed + k)
    check_operation(M.Concat(list(tensors), "out", dim=dim), tensors)


@SETTINGS
@given(data=st.data(), shape=shapes, dtype=dtypes, seed=seeds)
def test_stack_properties(data, shape, dtype, seed):
    dim = data.draw(st.integers(-len(shape) - 1, len(shape)))
    tensors = {f"in{k}": random_tensor(dtype, shape, seed + k) for k in range(data.draw(st.integers(1, 3)))}
    check_operation(M.Stack(list(tensors), "out", dim=dim), tensors)


@SETTINGS
@given(data=st.data(), shape=shapes, dtype=dtypes, seed=seeds)
def test_split_properties(data, shape, dtype, seed):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    length = shape[dim]
    if data.draw(st.booleans()) and length:
        parts = data.draw(st.sampled_from([d for d in range(1, length + 1) if length % d == 0]))
        op = M.Split("x", [f"p{k}" for k in range(parts)], dim=dim)
    else:
        cuts = sorted(data.draw(st.lists(st.integers(0, length), min_size=0, max_size=3)))
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, length], strict=True)]
        op = M.Split("x", [f"p{k}" for k in range(len(sizes))], sizes=sizes, dim=dim)
    check_operation(op, {"x": random_tensor(dtype, shape, seed)})


@SETTINGS
@given(data=st.data(), shape=nonzero_shapes, dtype=dtypes, seed=seeds)
def test_unstack_properties(data, shape, dtype, seed):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    op = M.Unstack("x", [f"p{k}" for k in range(shape[dim])], dim=dim)
    check_operation(op, {"x": random_tensor(dtype, shape, seed)})


@SETTINGS
@given(data=st.data(), shape=shapes, dtype=dtypes, seed=seeds, rename=st.booleans())
def test_transpose_properties(data, shape, dtype, seed, rename):
    dim0 = data.draw(st.integers(-len(shape), len(shape) - 1))
    dim1 = data.draw(st.integers(-len(shape), len(shape) - 1))
    op = M.Transpose("x", dim0, dim1, dst="y" if rename else None)
    check_operation(op, {"x": random_tensor(dtype, shape, seed)})


@SETTINGS
@given(data=st.data(), shape=shapes, dtype=dtypes, seed=seeds, rename=st.booleans())
def test_reshape_properties(data, shape, dtype, seed, rename):
    numel = math.prod(shape)
    choices = [[numel], list(reversed(shape))]
    if numel:  # -1 is ambiguous for empty tensors (torch refuses it too)
        choices += [[-1], [shape[0], -1], [1, numel, 1]]
    target = data.draw(st.sampled_from(choices))
    op = M.Reshape("x", target, dst="y" if rename else None)
    check_operation(op, {"x": random_tensor(dtype, shape, seed)})


@SETTINGS
@given(shape=shapes, dtype=dtypes, seed=seeds)
def test_rename_identity_properties(shape, dtype, seed):
    tensor = random_tensor(dtype, shape, seed)
    check_operation(M.Rename("x", "y"), {"x": tensor, "other": tensor[:0]})
    check_operation(M.Identity("x"), {"x": tensor})


LOSSLESS = sorted((src, dst) for src, targets in _WIDER.items() for dst in targets if not src.startswith("F8"))


@SETTINGS
@given(pair=st.sampled_from(LOSSLESS), shape=shapes, seed=seeds)
def test_lossless_cast_properties(pair, shape, seed):
    source, target = pair
    generator = torch.Generator().manual_seed(seed)
    if source in ("F16", "BF16", "F32"):
        values = torch.randn(shape, generator=generator).to(to_torch(source))
    else:
        values = random_tensor(source, shape, seed)
    check_operation(M.Cast("x", target), {"x": values})


def test_cast_groups_are_chunked_casts_and_lossy_casts_do_not_invert():
    tensors = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    binding = M.Cast("w", "bf16").bind(tensors)
    cast_group = next(g for g in binding.groups if g.outputs[0].name == "w")
    assert cast_group.chunk_cast == "BF16" and cast_group.recipe is None
    assert M.Cast("w", "bf16").apply(tensors)["w"].dtype == torch.bfloat16
    # Same dtype: no conversion, so the bytes can be moved.
    same = next(g for g in M.Cast("w", "F32").bind(tensors).groups if g.outputs[0].name == "w")
    assert same.recipe is not None and same.chunk_cast is None
    with pytest.raises(MapperError, match=r"Cannot invert Cast\('w', 'BF16'\): casting F32 to BF16 loses information"):
        M.Cast("w", "bf16").inverse(tensors)


def test_drop_removes_and_blocks_inverse():
    tensors = {"a": torch.ones(2), "b": torch.zeros(2)}
    assert set(M.Drop("a").apply(tensors)) == {"b"}
    binding = M.Drop("a").bind(tensors)
    assert binding.dropped == ["a"] and [g.outputs[0].name for g in binding.groups] == ["b"]
    with pytest.raises(MapperError, match=r"Cannot invert Drop\('a'\)"):
        M.Sequential(M.Rename("b", "c"), M.Drop("a")).inverse(tensors)


def test_construction_errors_are_clear():
    with pytest.raises(MapperError, match="listed twice"):
        M.Concat(["a", "a"], "b")
    with pytest.raises(MapperError, match="different placeholders"):
        M.Concat(["a.{i}", "b.{j}"], "c.{i}")
    with pytest.raises(MapperError, match="uses placeholders"):
        M.Rename("a.{i}.w", "b.w")
    with pytest.raises(MapperError, match="malformed placeholder"):
        M.Rename("a.{i.w", "b.w")
    with pytest.raises(MapperError, match="2 sizes"):
        M.Split("a", ["x", "y", "z"], sizes=[1, 2])
    with pytest.raises(MapperError, match="at most one -1"):
        M.Reshape("a", [-1, -1])
    with pytest.raises(MapperError, match="not a known dtype"):
        M.Cast("a", "float7")
    with pytest.raises(MapperError, match="not a mapper operation"):
        M.Sequential(M.Rename("a", "b"), "c")


def test_metadata_conflicts_name_the_operation():
    with pytest.raises(MapperError, match=r"Cannot apply Concat\(\['a', 'b'\], 'c', dim=1\): shapes differ outside dim 1"):
        M.Concat(["a", "b"], "c", dim=1).apply({"a": torch.ones(2, 3), "b": torch.ones(3, 3)})
    with pytest.raises(MapperError, match=r"sizes \[2, 2\] sum to 4, but dim 0 of 'a' has 5 entries"):
        M.Split("a", ["x", "y"], sizes=[2, 2]).apply({"a": torch.ones(5)})
    with pytest.raises(MapperError, match="do not split into 2 equal parts"):
        M.Split("a", ["x", "y"]).apply({"a": torch.ones(5)})
    with pytest.raises(MapperError, match="different dtypes"):
        M.Concat(["a", "b"], "c").apply({"a": torch.ones(2), "b": torch.ones(2, dtype=torch.bfloat16)})
    with pytest.raises(MapperError, match="out of range for a 2-D tensor"):
        M.Transpose("a", 0, 2).apply({"a": torch.ones(2, 2)})
    with pytest.raises(MapperError, match="does not fit"):
        M.Reshape("a", [4, -1]).apply({"a": torch.ones(6)})


def test_transposed_matrix_has_no_recipe_but_block_transpose_does():
    tensors = {"w": random_tensor("F32", (6, 5), 1), "h": random_tensor("BF16", (2, 3, 2, 4), 2)}
    mapper = M.Parallel(M.Transpose("w"), M.Transpose("h", 1, 2))
    groups = {g.outputs[0].name: g for g in mapper.bind(tensors).groups}
    assert groups["w"].recipe is None  # an element shuffle needs arithmetic, not byte copies
    check_operation(mapper, tensors)
    # 2*3*2 row blocks of 8 bytes; the last block of the first outer row continues into the next one.
    assert groups["h"].recipe is not None and len(groups["h"].recipe["h"]) == 2 * 3 * 2 - 1
