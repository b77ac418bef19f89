"""Span runs (`planning.span_runs`): a fusion preset's concatenations and the kept tensors between them are planned
as runs of neighbours, with the files, bytes, labels and output check of one step per group; and the groups of
many layers share one traced recipe per distinct shape (counted, not timed)."""

from __future__ import annotations

from pathlib import Path

import pytest

import workbench as wb
from tests.conftest import (
    assert_same_outputs,
    llama_like_tensors,
    plan_in_runs,
    plan_per_tensor,
    planned_files,
)
from workbench import mapper as M
from workbench.conversion import execute
from workbench.mapper import recipes
from workbench.planning import runs as copy_runs
from workbench.planning.span_runs import SpanRun

LAYERS = 120  # 9 tensors a layer: past the 1024 tensors from which runs are planned
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_attention_heads": 2,
          "num_key_value_heads": 1, "intermediate_size": 16, "num_hidden_layers": LAYERS, "vocab_size": 16}


@pytest.fixture
def fused_source(tiny_checkpoint) -> Path:
    return tiny_checkpoint(llama_like_tensors(layers=LAYERS), shards=3)


@pytest.mark.parametrize("shard_size", [None, "20KB"])
def test_span_runs_give_the_files_bytes_and_labels_of_one_step_per_group(
    fused_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shard_size: str | None,
) -> None:
    mapper = M.presets.hf_to_fused(CONFIG)
    plan_per_tensor(monkeypatch)
    single = wb.plan(fused_source, mapper, shard_size=shard_size, nproc=2)
    wb.convert(fused_source, tmp_path / "reference", mapper, shard_size=shard_size, quiet=True)
    plan_in_runs(monkeypatch, 37, 4096)
    runs = wb.plan(fused_source, mapper, shard_size=shard_size, nproc=2)
    assert single.ok and runs.ok
    spans = [s for s in runs.steps if type(s.group.recipe) is SpanRun]
    assert spans and len(runs.steps) < len(single.steps) // 5  # the concatenations joined their neighbours
    assert all(len(s.files) == 1 for s in runs.steps)  # a run crossing into the next file was cut there
    for step in spans:
        recipe = step.group.recipe
        assert len({t.file for t in step.group.inputs}) == 1 and step.bytes_out == recipe.total
        assert {"keep", "Concat"} >= set(recipe.labels) and "Concat" in step.group.label
        fused = next(g for g in recipe.members if len(g.inputs) > 1)
        out = fused.outputs[0].name
        assert recipe.spans(out) == [(p.source, p.begin, p.end) for p in fused.recipe[out]] == [
            (p.source, p.begin, p.end) for p in recipe[out]]
    assert planned_files(runs) == planned_files(single)
    assert runs.reads() == single.reads()
    assert runs.outputs["group"].sort_index().equals(single.outputs["group"].sort_index())  # each member's label
    assert wb.convert(fused_source, tmp_path / "out", mapper, shard_size=shard_size, quiet=True).ok
    assert_same_outputs(tmp_path / "reference", tmp_path / "out")


def test_two_ranks_write_span_runs_as_one_step_per_group(fused_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The workers plan again in their own processes, with the default run sizes.
    mapper = M.presets.hf_to_fused(CONFIG)
    monkeypatch.setattr(copy_runs, "RUN_MIN_TENSORS", 10**9)
    wb.convert(fused_source, tmp_path / "reference", mapper, shard_size="40KB", quiet=True)
    monkeypatch.undo()
    plan = wb.plan(fused_source, mapper, shard_size="40KB", nproc=2, dest=tmp_path / "out")
    assert any(type(s.group.recipe) is SpanRun for s in plan.steps)
    report = execute(plan, quiet=True)
    assert report.ok and {r.rank for r in report.ranks} == {0, 1}
    assert_same_outputs(tmp_path / "reference", tmp_path / "out")


def test_the_output_check_finds_a_changed_fused_tensor_in_a_span_run(
    fused_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from safetensors.torch import load_file, save_file

    from workbench.engine.output_check import check_outputs

    plan_in_runs(monkeypatch, 37, 4096)
    plan = wb.plan(fused_source, M.presets.hf_to_fused(CONFIG), dest=tmp_path / "out", shard_size="1GB")
    execute(plan, quiet=True)
    assert all(row[2] == "ok" for row in check_outputs(plan).rows)
    path = tmp_path / "out" / "model.safetensors"
    tensors = load_file(path)
    changed = "model.layers.7.self_attn.qkv_proj.weight"
    tensors[changed] = tensors[changed] + 1
    save_file(tensors, path, metadata={"format": "pt"})
    assert {row[0]: row[2] for row in check_outputs(plan).rows if row[2] != "ok"} == {changed: "mismatch"}


def test_fused_layers_are_traced_once_per_distinct_shape(fused_source: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    traced: list[tuple] = []
    trace = recipes.Tracer.trace

    def counting(self, op, inputs, outputs):  # noqa: ANN001, ANN202
        traced.append(tuple((t.dtype, tuple(t.shape)) for t in inputs))
        return trace(self, op, inputs, outputs)

    monkeypatch.setattr(recipes.Tracer, "trace", counting)
    binding = M.presets.hf_to_fused(CONFIG).bind(wb.open_checkpoint(fused_source))
    fused = [g for g in binding.groups if len(g.inputs) > 1]
    assert len(fused) == 2 * LAYERS
    assert len(traced) == len(set(traced)) == 2  # q/k/v and gate/up: one trace each, stamped for every layer
    assert all(type(g.recipe) is recipes.LazyRecipe for g in fused)
