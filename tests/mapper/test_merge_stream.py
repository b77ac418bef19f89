"""mergekit's random stream (`workbench.mapper.merge.stream`): the draw count it rests on (measured on this torch),
the generator rebuilt at any offset whatever the order of asks, each merge's offset from names and shapes only (label
order, densities of 1 drawing nothing), a tie between labels refused, and a DARE merge with rng='mergekit' giving the
bytes of one global generator run in label order, the same on one rank or two."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import workbench as wb
from workbench import mapper as M
from workbench.mapper.merge.slices import MergeSlices
from workbench.mapper.merge.stream import assign_draws, draws_of, generator_at
from workbench.mapper.merge.task_arithmetic import merge_task_vectors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel", [1, 7, 1000, 70001])
def test_bernoulli_consumes_one_draw_per_element(dtype, numel) -> None:
    """The fact the stream rests on: bernoulli of a probability tensor moves the generator as `numel` float32
    uniforms do (so its state after a tensor follows from the tensor's size)."""
    drawn = torch.Generator().manual_seed(42)
    torch.bernoulli(torch.full((numel,), 0.3, dtype=dtype), generator=drawn)
    replayed = generator_at(42, numel)
    assert torch.equal(drawn.get_state(), replayed.get_state())


def test_generator_at_any_offset_in_any_order_is_the_stream_there() -> None:
    reference = torch.Generator().manual_seed(5)
    head = torch.rand(5000, generator=reference)
    for offset in (4000, 123, 0, 2999, 4000):  # out of order, repeated: the states kept in between do not matter
        assert torch.equal(torch.rand(1000, generator=generator_at(5, offset)), head[offset:offset + 1000])


def test_draws_follow_the_density_and_the_method() -> None:
    params = {"density": {"a": 0.5, "b": 1.0, "c": 0.0}}
    assert draws_of("dare_ties", params, ["a", "b", "c", "base"], "base", 10) == 20  # b keeps all: no draw; c: drawn
    assert draws_of("della", params, ["a", "b", "c", "base"], "base", 10) == 10  # della zeroes density 0 without drawing
    assert draws_of("ties", params, ["a", "b", "c", "base"], "base", 10) == 0


def _merge(output: str, density: float, names: tuple[str, str] | None = None) -> M.Merge:
    a, b = names or (output, output)
    return M.Merge("dare_linear", output, {"x": f"x::{a}", "base": b}, base="base", params={"weight": 1.0, "density": density})


def test_offsets_follow_the_largest_source_name_not_the_output_order() -> None:
    merges = [_merge("model.norm.weight", 0.5), _merge("lm_head.weight", 0.5), _merge("model.layers.0.w", 1.0),
              _merge("model.layers.1.w", 0.5, ("model.layers.3.w", "model.layers.2.w"))]
    nodes = {name: ("F32", (4, 3)) for op in merges for name in op.inputs}
    placed, problems = assign_draws(merges, nodes)
    assert problems == []
    # lm_head < model.layers.3 (the slice's largest source name) < model.norm; density 1 draws nothing
    assert [op.draws for op in placed] == [24, 0, None, 12]


def test_two_merges_reading_the_same_last_name_are_refused_not_guessed() -> None:
    merges = [_merge("model.layers.0.w", 0.5, ("model.layers.2.w", "model.layers.0.w")),
              _merge("model.layers.1.w", 0.5, ("model.layers.2.w", "model.layers.1.w"))]
    nodes = {name: ("F32", (4,)) for op in merges for name in op.inputs}
    _, problems = assign_draws(merges, nodes)
    assert len(problems) == 1 and "'model.layers.2.w'" in problems[0][0] and "rng='tensor'" in problems[0][0]


def test_slices_with_a_tied_label_are_a_plan_problem() -> None:
    slices = [{"sources": [{"model": "a", "layer_range": [0, 2]}, {"model": "b", "layer_range": [1, 3]}]},
              {"sources": [{"model": "a", "layer_range": [2, 3]}, {"model": "b", "layer_range": [2, 3]}]}]
    op = MergeSlices("dare_linear", slices, base_model="a", parameters={"weight": 1.0, "density": 0.5}, rng="mergekit")
    nodes = {f"{p}model.layers.{i}.w": ("F32", (2, 2)) for p in ("", "b::") for i in range(3)}
    _, problems = op._plan(nodes)
    assert any("mergekit then orders them by its task graph" in message for message, _, _ in problems)


def test_rng_is_checked_and_exported() -> None:
    with pytest.raises(wb.WorkbenchError, match="rng 'global' is unknown"):
        M.presets.merge("dare_ties", ["a", "b"], base_model="a", rng="global")
    mapper = M.presets.merge("dare_ties", ["a", "b"], base_model="a", seed=3, rng="mergekit")
    assert "rng='mergekit'" in mapper.to_code() and M.from_json(mapper.to_json()) == mapper


def test_a_dare_merge_in_mergekits_stream_is_one_global_generator_in_label_order(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (40, 8), "lm_head.weight": (40, 8), "model.norm.weight": (8,),
              **{f"model.layers.{i}.mlp.up_proj.weight": (16, 8) for i in range(3)}}
    states = {}
    for name in ("base", "a", "b"):
        states[name] = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in shapes.items()}
        (tmp_path / name).mkdir()
        save_file(states[name], tmp_path / name / "model.safetensors")
    params = {"weight": 0.5, "density": [{"filter": "norm", "value": 1.0}, {"value": 0.6}]}
    mapper = M.presets.merge("dare_ties", ["a", "b"], base_model="base", parameters=params, seed=11, rng="mergekit")
    ck = wb.open_checkpoint({m: tmp_path / m for m in ("base", "a", "b")})
    wb.convert(ck, tmp_path / "one", mapper, quiet=True)
    wb.convert(ck, tmp_path / "two", mapper, nproc=2, quiet=True)
    assert (tmp_path / "one" / "model.safetensors").read_bytes() == (tmp_path / "two" / "model.safetensors").read_bytes()
    out = load_file(tmp_path / "one" / "model.safetensors")
    torch.manual_seed(11)  # what mergekit-yaml --random-seed 11 does, then its merges in name order
    for name in sorted(shapes):
        density = 1.0 if "norm" in name else 0.6
        want = merge_task_vectors([states[m][name] for m in ("a", "b", "base")], ["a", "b", "base"], "base",
                                  {"density": {"a": density, "b": density}, "weight": {"a": 0.5, "b": 0.5}, "rescale": True,
                                   "normalize": False, "lambda": 1.0, "int8_mask": False},
                                  consensus="sum", sparsify="random", generator=torch.default_generator)
        assert torch.equal(out[name], want), name
