"""The merge methods of `M.Merge` on small tensors: the formulas mergekit 0.1.5 uses, computed here independently
(bit for bit where the float operations are few and fixed; scripts/check_merge_methods.py compares every method
with mergekit-yaml itself, and tests/fixtures/mergekit/ holds its digests), the random methods statistically."""

from __future__ import annotations

import pytest
import torch

from workbench import mapper as M
from workbench.errors import MapperError
from workbench.mapper.merge.task_arithmetic import merge_task_vectors


def merge(method: str, tensors: dict[str, torch.Tensor], **kwargs) -> torch.Tensor:
    """`Merge` of one tensor named 'w' over models given as {model: tensor} (the first model is the primary source)."""
    names = {m: ("w" if k == 0 else f"{m}::w") for k, m in enumerate(tensors)}
    op = M.Merge(method, "w", names, **kwargs)
    return op.apply({names[m]: t for m, t in tensors.items()})["w"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_is_a_fused_fp32_sum_divided_once(dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    xs = {m: torch.randn(33, 7, generator=gen).to(dtype) for m in "abc"}
    weights = {"a": 0.5, "b": 0.3, "c": 0.25}
    got = merge("linear", xs, params={"weight": weights})
    acc = torch.zeros(33, 7, dtype=torch.float32)
    for m, x in xs.items():
        acc.addcmul_(x, torch.tensor(weights[m]))
    assert got.dtype == dtype
    assert torch.equal(got, (acc / torch.tensor(list(weights.values())).sum()).to(dtype))
    plain = merge("linear", xs, params={"weight": weights, "normalize": False})
    assert torch.equal(plain, acc.to(dtype))
    assert merge("linear", xs, params={"weight": 1.0}, out_dtype="F32").dtype == torch.float32


def test_ties_elects_signs_and_normalises_by_the_weights_that_voted() -> None:
    base = torch.zeros(4)
    a, b = torch.tensor([1.0, -2.0, 3.0, 0.0]), torch.tensor([-1.0, -1.0, 1.0, 2.0])
    got = merge("ties", {"base": base, "a": a, "b": b}, base="base", params={"weight": 1.0})
    # summed deltas [0, -3, 4, 2] elect [+, -, +, +]; a's 0 and b's -1 in column 0 disagree with their vote
    assert torch.equal(got, torch.tensor([1.0, -1.5, 2.0, 2.0]))
    arithmetic = merge("task_arithmetic", {"base": base + 1, "a": a, "b": b}, base="base",
                       params={"weight": {"a": 0.5, "b": 2.0}, "lambda": 0.5})
    assert torch.equal(arithmetic, 1 + 0.5 * (0.5 * (a - 1) + 2.0 * (b - 1)))
    b2 = torch.tensor([-1.0, -0.5, 0.25, 2.0])
    sparse = merge("ties", {"base": base, "a": a, "b": b2}, base="base", params={"weight": 1.0, "density": 0.5})
    assert torch.equal(sparse, torch.tensor([-1.0, -2.0, 3.0, 2.0]))  # a keeps 3, -2; b2 keeps 2, -1: no vote is split


def test_breadcrumbs_drops_the_largest_and_the_smallest() -> None:
    base = torch.zeros(100)
    a = torch.arange(1, 101, dtype=torch.float32)
    got = merge("breadcrumbs", {"base": base, "a": a}, base="base", params={"weight": 1.0, "density": 0.5, "gamma": 0.1})
    kept = a[got != 0]
    assert kept.tolist() == list(range(41, 91))  # 10 % outliers off the top, then the 50 % largest of the rest


def _sorted_window(delta: torch.Tensor, start: int, stop: int, descending: bool) -> torch.Tensor:
    """The reference selection: float32 magnitudes argsorted in full, positions [start, stop) kept (mergekit's way)."""
    order = torch.argsort(delta.abs().reshape(-1).float(), descending=descending)
    mask = torch.zeros(delta.numel(), dtype=delta.dtype)
    mask[order[start:stop]] = 1
    return delta * mask.reshape_as(delta)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_lean_magnitude_sort_keeps_the_full_float32_argsorts_ties(dtype) -> None:
    """TIES and breadcrumbs sort the magnitudes in place in the input's half dtype (no float32 copy, no second
    values array): the elements kept, ties at the threshold included, are those of a float32 argsort of all of them.
    bf16 task vectors of 300,000 elements hold a few thousand distinct magnitudes: the threshold is a large tie."""
    gen = torch.Generator().manual_seed(9)
    base = (torch.randn(600, 500, generator=gen) * 0.1).to(dtype)
    a = (base.float() + 0.01 * torch.randn(600, 500, generator=gen)).to(dtype)
    b = (base.float() + 0.01 * torch.randn(600, 500, generator=gen)).to(dtype)
    delta_a, delta_b = a - base, b - base
    params = {"weight": {"a": 1.0, "b": 1.0}, "density": {"a": 0.37, "b": 0.61}, "normalize": False, "rescale": False,
              "lambda": 1.0, "int8_mask": False}
    got = merge_task_vectors([base, a, b], ["base", "a", "b"], "base", params, consensus=None, sparsify="magnitude")
    count = base.numel()
    want = base + (_sorted_window(delta_a, 0, int(0.37 * count), True) + _sorted_window(delta_b, 0, int(0.61 * count), True))
    assert torch.equal(got, want)
    ties = (delta_a.abs().reshape(-1).float() == delta_a.abs().reshape(-1).float().sort(descending=True).values[int(0.37 * count)])
    assert int(ties.sum()) > 100 or dtype == torch.float32  # the threshold is a tie the sort's order decides
    outliers = {**params, "density": {"a": 0.5, "b": 0.8}, "gamma": {"a": 0.05, "b": 0.01}}
    got = merge_task_vectors([base, a, b], ["base", "a", "b"], "base", outliers, consensus=None, sparsify="magnitude_outliers")
    low_a, low_b = count - int(0.5 * count) - int(0.05 * count), count - int(0.8 * count) - int(0.01 * count)
    want = base + (_sorted_window(delta_a, low_a, low_a + int(0.5 * count), False)
                   + _sorted_window(delta_b, low_b, low_b + int(0.8 * count), False))
    assert torch.equal(got, want)


@pytest.mark.parametrize("method", ["dare_linear", "dare_ties", "della", "della_linear"])
def test_random_methods_keep_the_density_rescale_the_l1_norm_and_repeat_under_a_seed(method) -> None:
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(200, 50, generator=gen)
    a = base + torch.randn(200, 50, generator=gen)
    params = {"weight": 1.0, "density": 0.3, **({"normalize": False} if method == "della" else {})}
    first = merge(method, {"base": base, "a": a}, base="base", params=params, seed=7)
    delta = first - base
    kept = (delta != 0).float().mean().item()
    assert abs(kept - 0.3) < 0.02
    # the kept entries are the task vector's, scaled so that its sum of absolute values is the original one's
    scale = (a - base).abs().sum() / (a - base)[delta != 0].abs().sum()
    torch.testing.assert_close(delta[delta != 0], (a - base)[delta != 0] * scale, rtol=1e-5, atol=1e-5)
    assert torch.equal(first, merge(method, {"base": base, "a": a}, base="base", params=params, seed=7))
    assert not torch.equal(first, merge(method, {"base": base, "a": a}, base="base", params=params, seed=8))


def test_spherical_methods_and_model_stock_return_a_model_merged_with_itself() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 8, generator=gen)
    base = torch.randn(16, 8, generator=gen)
    same = {"a": x, "b": x.clone(), "c": x.clone()}
    torch.testing.assert_close(merge("karcher", same), x)
    torch.testing.assert_close(merge("multislerp", same, params={"weight": 1.0}), x)
    torch.testing.assert_close(merge("nuslerp", {"a": x, "b": x.clone()}, params={"weight": 1.0}), x)
    torch.testing.assert_close(merge("slerp", {"base": base, "a": x}, base="base", params={"t": 1.0}), x)
    torch.testing.assert_close(merge("slerp", {"base": base, "a": x}, base="base", params={"t": 0.0}), base)
    stock = merge("model_stock", {"base": base, "a": x, "b": x.clone()}, base="base")
    torch.testing.assert_close(stock, x)  # the fine-tunes agree (cos 1): t = 1, their mean


def test_nearswap_and_passthrough() -> None:
    base, other = torch.tensor([0.0, 1.0, 5.0]), torch.tensor([0.001, 3.0, 5.0])
    got = merge("nearswap", {"base": base, "a": other}, base="base", params={"t": 0.01})
    assert got[0] == other[0] and got[2] == 5.0 and abs(got[1].item() - (0.005 * 3 + 0.995 * 1)) < 1e-6
    assert torch.equal(merge("passthrough", {"a": other}, params={"scale": {"a": 2.0}}), other * 2.0)


def test_integer_buffers_are_copied_when_equal_and_refused_when_not() -> None:
    step = torch.tensor([7])
    assert torch.equal(merge("linear", {"a": step, "b": step.clone()}, params={"weight": 1.0}), step)
    with pytest.raises(MapperError, match="differs between models"):
        merge("linear", {"a": step, "b": step + 1}, params={"weight": 1.0})


def test_a_merge_is_an_op_like_every_other() -> None:
    op = M.Merge("slerp", "model.layers.{i}.w", {"a": "model.layers.{i}.w", "b": "b::model.layers.{i}.w"}, base="a",
                 params={"t": 0.25}, dtype="bfloat16", seed=3)
    assert M.from_json(op.to_json()) == op
    namespace: dict = {}
    exec(op.to_code(), namespace)
    assert namespace["mapper"] == op
    source = {"model.layers.0.w": torch.ones(2), "b::model.layers.0.w": torch.zeros(2),
              "model.layers.1.w": torch.ones(2), "b::model.layers.1.w": torch.zeros(2)}
    binding = op.bind(source)
    assert not binding.problems and [g.outputs[0].dtype for g in binding.groups] == ["BF16", "BF16"]
    with pytest.raises(MapperError, match="not invertible"):
        op.inverse(source)
    unknown = M.Merge("linear", "w", {"a": "w", "b": "b::w"}, params={"weight": 1.0, "wieght": 2.0})
    problems = unknown.bind({"w": torch.ones(2), "b::w": torch.ones(2)}).problems
    assert problems and "'wieght'" in problems[0].message
    missing = M.Merge("ties", "w", {"a": "w", "b": "b::w"}, params={"weight": 1.0}).bind({"w": torch.ones(2), "b::w": torch.ones(2)})
    assert "needs a base model" in missing.problems[0].message
