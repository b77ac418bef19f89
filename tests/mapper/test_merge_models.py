"""Whole-checkpoint merges (`M.presets.merge`, `M.MergeModels`): written before any source is opened, bound to one
`Merge` per tensor, planned with one group of N inputs + output + the method's work tensors as the peak, run on
one or two ranks with the same bytes, problems named."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import workbench as wb
from workbench import mapper as M
from workbench.mapper.merge.memory import scratch_bytes


def models(tmp_path: Path, dtype=torch.bfloat16) -> dict[str, Path]:
    gen = torch.Generator().manual_seed(0)
    base = {"model.embed_tokens.weight": torch.randn(64, 16, generator=gen), "model.norm.weight": torch.ones(16),
            **{f"model.layers.{i}.mlp.up_proj.weight": torch.randn(32, 16, generator=gen) for i in range(3)},
            **{f"model.layers.{i}.self_attn.q_proj.weight": torch.randn(16, 16, generator=gen) for i in range(3)}}
    out = {}
    for k, name in enumerate(("base", "a", "b")):
        state = {n: (t + 0.1 * k * torch.randn(t.shape, generator=gen)).to(dtype) for n, t in base.items()}
        state["step"] = torch.tensor([5])
        (tmp_path / name).mkdir()
        save_file(state, tmp_path / name / "model.safetensors")
        out[name] = tmp_path / name
    return out


def test_a_merge_is_planned_as_groups_of_n_inputs_and_runs_on_two_ranks_alike(tmp_path) -> None:
    sources = models(tmp_path)
    mapper = M.presets.merge("ties", ["a", "b"], base_model="base",
                             parameters={"density": 0.5, "weight": [{"filter": "mlp", "value": [0.2, 1.0]}, {"value": 0.5}]})
    namespace: dict = {}
    exec(mapper.to_code(), namespace)  # written before any checkpoint was opened; its code rebuilds it
    assert namespace["mapper"] == mapper and M.from_json(mapper.to_json()) == mapper
    ck = wb.open_checkpoint(sources)
    plan = wb.plan(ck, mapper)
    assert plan.ok, plan.problems
    embed = 64 * 16
    # the largest group: the embedding of 3 models (bf16) + its output + the method's work tensors
    expected = 4 * embed * 2 + scratch_bytes("ties", ["BF16"] * 3, embed, "BF16", 2, {"sparsify": "magnitude", "consensus": "sum"},
                                             unmade=embed * 2)  # the output is made after the sorts and task vectors
    assert plan.peak_bytes == expected
    assert plan.outputs.loc["model.layers.2.mlp.up_proj.weight", "dtype"] == "BF16"
    wb.convert(ck, tmp_path / "one", mapper, quiet=True)
    wb.convert(ck, tmp_path / "two", mapper, nproc=2, quiet=True)
    assert (tmp_path / "one" / "model.safetensors").read_bytes() == (tmp_path / "two" / "model.safetensors").read_bytes()
    out = load_file(tmp_path / "one" / "model.safetensors")
    assert set(out) == set(load_file(sources["base"] / "model.safetensors")) and torch.equal(out["step"], torch.tensor([5]))
    # each tensor is the Merge of its own inputs with the parameters resolved for it (layer 1 of 3: t = 0.5)
    inputs = {m: load_file(p / "model.safetensors") for m, p in sources.items()}
    name = "model.layers.1.mlp.up_proj.weight"
    op = M.Merge("ties", name, {"a": "a", "b": "b", "base": "base"}, base="base", params={"density": 0.5, "weight": 0.6})
    assert torch.equal(out[name], op.apply({m: t[name] for m, t in inputs.items()})[name])


def test_problems_name_the_key_the_model_and_the_tensor(tmp_path) -> None:
    sources = models(tmp_path)
    ck = wb.open_checkpoint(sources)
    unknown = wb.plan(ck, M.presets.merge("slerp", ["base", "a"], base_model="base", parameters={"t": 0.5, "lamda": 1}))
    assert not unknown.ok and "'lamda'" in unknown.errors[0].message
    absent = wb.plan(ck, M.presets.merge("linear", ["a", "zz"], parameters={"weight": 1.0}))
    assert not absent.ok and "'zz'" in absent.errors[0].message
    required = wb.plan(ck, M.presets.merge("slerp", ["base", "a"], base_model="base"))
    assert not required.ok and "'t' is required" in required.errors[0].message
    save_file({"only.in.b": torch.ones(2)}, tmp_path / "extra.safetensors")
    lacking = wb.plan({**sources, "c": tmp_path / "extra.safetensors"}, M.presets.merge("linear", ["base", "c"],
                                                                                        parameters={"weight": 1.0}))
    assert not lacking.ok and "has no such tensor" in lacking.errors[0].message


def test_average_is_the_linear_merge_and_binds_before_any_source_is_opened(tmp_path) -> None:
    mapper = M.presets.average(["base", "a", "b"], weights=[1, 1, 2])
    assert mapper == M.presets.merge("linear", ["base", "a", "b"], model_parameters={"base": {"weight": 1.0},
                                                                                     "a": {"weight": 1.0}, "b": {"weight": 2.0}})
    sources = models(tmp_path, torch.float32)
    wb.convert(sources, tmp_path / "avg", mapper, quiet=True)
    got = load_file(tmp_path / "avg" / "model.safetensors")["model.norm.weight"]
    xs = [load_file(p / "model.safetensors")["model.norm.weight"] for p in sources.values()]
    acc = torch.zeros(16)
    for x, w in zip(xs, (1.0, 1.0, 2.0), strict=True):
        acc.addcmul_(x, torch.tensor(w))
    assert torch.equal(got, acc / 4.0)


def test_the_short_form_names_the_base_and_global_parameters_as_keywords() -> None:
    import pytest

    from workbench.errors import MapperError

    long = M.presets.merge("slerp", ["a", "b"], base_model="a", parameters={"t": 0.3})
    assert M.presets.merge("slerp", ["a", "b"], base="a", t=0.3) == long  # DESIGN.md's `merge(method, sources, base=, **p)`
    with pytest.raises(MapperError, match="two base models"):
        M.presets.merge("slerp", ["a", "b"], base="a", base_model="b", t=0.3)
    with pytest.raises(MapperError, match="given twice"):
        M.presets.merge("slerp", ["a", "b"], base="a", parameters={"t": 0.3}, t=0.5)


def test_ties_maps_its_large_inputs_gives_them_back_for_the_sorts_and_writes_the_same_bits(tmp_path, monkeypatch) -> None:
    """Inputs of >= 1 MiB lying raw on disk are mapped from their files (`mapped_inputs`) for the methods that sort;
    the kernel gives their pages back before each sort and reads them again after: the output is bit for bit the
    merge of plainly loaded tensors, and the plan counts the sorts without the inputs."""
    from workbench.mapped_inputs import MAPPED_INPUT_BYTES
    from workbench.mapper.merge import task_arithmetic

    gen = torch.Generator().manual_seed(1)
    name, shape = "model.layers.0.mlp.up_proj.weight", (1024, 768)  # 1.5 MiB in bf16
    sources = {}
    for model in ("base", "a", "b"):
        (tmp_path / model).mkdir()
        tensor = (torch.randn(shape, generator=gen) * 4).round().to(torch.bfloat16)  # many equal magnitudes: ties
        save_file({name: tensor, "model.norm.weight": torch.ones(16)}, tmp_path / model / "model.safetensors")
        sources[model] = tmp_path / model
    assert MAPPED_INPUT_BYTES <= 1024 * 768 * 2
    given_back = []
    real = task_arithmetic.give_back
    monkeypatch.setattr(task_arithmetic, "give_back", lambda tensors: given_back.append(real(tensors)) or given_back[-1])
    mapper = M.presets.merge("ties", ["a", "b"], base_model="base", parameters={"density": 0.3, "weight": 0.7})
    plan = wb.plan(sources, mapper)
    numel = 1024 * 768
    held = scratch_bytes("ties", ["BF16"] * 3, numel, "BF16", 2, {"sparsify": "magnitude", "consensus": "sum"},
                         unmade=numel * 2)
    assert plan.peak_bytes == 4 * numel * 2 + held  # the task vectors' phase: the sorts need less without the inputs
    wb.convert(sources, tmp_path / "out", mapper, quiet=True)
    large = [g for g in given_back if g]  # the norm's merge (64 bytes) was read as usual: nothing to give back
    assert len(large) == 2 and all(g >= 2 * numel * 2 for g in large)  # a non-base input and the base, per sort
    inputs = {m: load_file(p / "model.safetensors")[name] for m, p in sources.items()}
    op = M.Merge("ties", name, {"a": "a", "b": "b", "base": "base"}, base="base", params={"density": 0.3, "weight": 0.7})
    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")[name], op.apply(inputs)[name])
