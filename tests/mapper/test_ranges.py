"""Ranges in templates: `{e*}` takes every value present, in natural order; counts checked; inverse exact."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from workbench import mapper as M  # noqa: E402
from workbench.errors import MapperError  # noqa: E402

EXPERTS = [0, 1, 2, 10, 3, 4, 5, 6, 7, 8, 9]  # stored out of order; 10 after 9 in natural order, not after 1


def moe(layers: int = 2, experts: list[int] = EXPERTS) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        f"model.layers.{i}.experts.{e}.{w}.weight": torch.randn(4, 3, generator=g)
        for i in range(layers) for e in experts for w in ("w1", "w3")
    }


GATE_UP = M.Sequential(
    M.Parallel(
        M.Stack(["model.layers.{i}.experts.{e*}.w1.weight"], "model.layers.{i}.experts.w1"),
        M.Stack(["model.layers.{i}.experts.{e*}.w3.weight"], "model.layers.{i}.experts.w3"),
    ),
    M.Concat(["model.layers.{i}.experts.w1", "model.layers.{i}.experts.w3"], "model.layers.{i}.experts.gate_up", dim=1),
)


def test_a_range_takes_every_expert_in_natural_order() -> None:
    src = moe()
    out = GATE_UP.apply(src)
    assert sorted(out) == ["model.layers.0.experts.gate_up", "model.layers.1.experts.gate_up"]
    for i in range(2):
        w1 = torch.stack([src[f"model.layers.{i}.experts.{e}.w1.weight"] for e in range(11)])
        w3 = torch.stack([src[f"model.layers.{i}.experts.{e}.w3.weight"] for e in range(11)])
        assert torch.equal(out[f"model.layers.{i}.experts.gate_up"], torch.cat([w1, w3], dim=1))


def test_inverse_takes_the_count_from_the_source_and_restores_every_tensor() -> None:
    src = moe()
    inverse = GATE_UP.inverse(src)
    unstacks = [leaf for leaf in inverse.leaves() if isinstance(leaf, M.Unstack)]
    assert [leaf.dsts for leaf in unstacks] == [("model.layers.{i}.experts.{e*}.w1.weight",), ("model.layers.{i}.experts.{e*}.w3.weight",)]
    back = inverse.apply(GATE_UP.apply(src))
    assert sorted(back) == sorted(src) and all(torch.equal(back[k], src[k]) for k in src)


def test_a_range_that_does_not_start_at_zero_inverts_concretely() -> None:
    src = moe(layers=1, experts=[4, 5, 6])
    mapper = M.Stack(["model.layers.{i}.experts.{e*}.w1.weight"], "model.layers.{i}.experts.w1")
    inverse = mapper.inverse(src)
    assert not any(isinstance(leaf, M.Unstack) and "*}" in leaf.dsts[0] for leaf in inverse.leaves())
    out = mapper.apply({k: v for k, v in src.items() if ".w1." in k})
    back = inverse.apply(out)
    assert all(torch.equal(back[k], src[k]) for k in back) and len(back) == 3


def test_to_code_states_the_order_and_rebuilds_an_equal_mapper() -> None:
    code = GATE_UP.to_code()
    assert "natural order" in code and "{e*}" in code
    namespace: dict = {}
    exec(code, namespace)
    assert namespace["mapper"] == GATE_UP
    assert M.from_json(GATE_UP.to_json()) == GATE_UP


def test_a_missing_expert_is_named() -> None:
    src = moe()
    del src["model.layers.1.experts.5.w3.weight"]
    problems = GATE_UP.bind(src).errors
    assert "'model.layers.1.experts.5.w3.weight'" in problems[0].message and "skips 5" in problems[0].message


def test_inputs_ranging_over_one_placeholder_must_agree() -> None:
    src = moe(layers=1)
    del src["model.layers.0.experts.10.w3.weight"]  # the last one: no gap, but w1 has 11 experts and w3 10
    mapper = M.Concat(["model.layers.{i}.experts.{e*}.w1.weight", "model.layers.{i}.experts.{e*}.w3.weight"], "model.layers.{i}.w13")
    (problem,) = mapper.bind(src).errors
    assert "'model.layers.0.experts.10.w3.weight' is missing although 'model.layers.0.experts.10.w1.weight' is present" in problem.message


def test_unstack_and_split_outputs_count_from_shape_and_sizes() -> None:
    stacked = {"experts.w": torch.arange(24.0).reshape(4, 3, 2)}
    out = M.Unstack("experts.w", ["experts.{e*}.w"]).apply(stacked)
    assert sorted(out) == [f"experts.{e}.w" for e in range(4)]
    assert torch.equal(out["experts.3.w"], stacked["experts.w"][3])
    parts = M.Split("experts.w", ["head", "experts.{e*}.w"], sizes=[1, 1, 2], dim=0).apply(stacked)
    assert sorted(parts) == ["experts.0.w", "experts.1.w", "head"]
    assert torch.equal(parts["experts.1.w"], stacked["experts.w"][2:])


@pytest.mark.parametrize("build", [
    lambda: M.Rename("a.{e*}.w", "b.{e*}.w"),  # ranges only where a count is defined
    lambda: M.Stack(["a.{e*}.{e}.w"], "b.{e}"),  # the range reuses a placeholder
    lambda: M.Split("w", ["a.{e*}"]),  # a ranged split needs sizes
    lambda: M.Stack(["a.{e*}.{f*}"], "b"),  # two ranges in one name
])
def test_ranges_where_they_mean_nothing_are_refused(build) -> None:
    with pytest.raises(MapperError, match="Cannot build"):
        build()
