"""PEFT adapters merged from PEFT's own files (base and adapter in separate folders), checked bit for bit
against `PeftModel.merge_and_unload()`; multi-source planning; averaging; diff through a mapper."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from peft_fixtures import make_case
from safetensors.torch import load_file, save_file

import workbench as wb
from workbench import mapper as M

# peft (seconds to import) only where a test makes an adapter: the collection of both workers skips it
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft")

CASES = {
    "lora": dict(kind="llama", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    "rslora-patterns": dict(kind="llama", r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "k_proj"],
                            rank_pattern={"k_proj": 2}, alpha_pattern={"k_proj": 3}),
    "dora-modules-to-save": dict(kind="llama", r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj"],
                                 modules_to_save=["lm_head"]),
    "gpt2-fan-in-fan-out-bias": dict(kind="gpt2", r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
                                     lora_bias=True),
    "gpt2-dora": dict(kind="gpt2", r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, use_dora=True),
}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    made = {}
    for name, kw in CASES.items():
        kw = dict(kw)
        kind = kw.pop("kind")
        made[name] = make_case(tmp_path_factory.mktemp(name), kind, **kw)
    return made


def _check_equal(out: dict, ref: dict, base: dict) -> None:
    assert set(out) == {k for k in ref if k in base}  # every base tensor, no adapter tensor, nothing scoped
    changed = 0
    for name, tensor in out.items():
        assert torch.equal(tensor, ref[name]), name
        changed += not torch.equal(tensor, base[name])
    assert changed >= 2  # the adapter really moved weights


@pytest.mark.parametrize("case", list(CASES))
def test_merge_equals_peft_bit_for_bit(cases, case, tmp_path):
    base, adapter, ref = cases[case]
    source = {"base": base, "adapter": adapter}
    report = wb.convert(source, tmp_path / "out", M.presets.lora_merge(adapter), quiet=True)
    assert report.ok if hasattr(report, "ok") else True
    _check_equal(load_file(tmp_path / "out" / "model.safetensors"), ref, load_file(base / "model.safetensors"))
    assert (tmp_path / "out" / "config.json").exists()  # the base's extras are carried over


def test_merge_in_bf16_is_peft_rounded_once(cases, tmp_path):
    base, adapter, ref = cases["dora-modules-to-save"]
    wb.convert({"base": base, "adapter": adapter}, tmp_path / "out", M.presets.lora_merge(adapter), dtype="bf16", quiet=True)
    out = load_file(tmp_path / "out" / "model.safetensors")
    for name, tensor in out.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, ref[name].to(torch.bfloat16)), name


def test_cli_convert_with_adapter(cases, tmp_path, capsys):
    """`workbench convert --adapter`, `plan --source adapter=` and `diff --values` through the CLI's own entry point
    (in this process: its exit codes and output, not process start-up, are what is checked here)."""
    from workbench.cli import main

    base, adapter, ref = cases["gpt2-fan-in-fan-out-bias"]
    assert main(["convert", str(base), str(tmp_path / "out"), "--adapter", str(adapter), "--quiet"]) == 0
    _check_equal(load_file(tmp_path / "out" / "model.safetensors"), ref, load_file(base / "model.safetensors"))
    capsys.readouterr()
    assert main(["plan", str(base), "--source", f"adapter={adapter}", "--mapper", str(_mapper_file(tmp_path, adapter))]) == 0
    assert "adapter_model.safetensors" in capsys.readouterr().out
    mapper_file = str(_mapper_file(tmp_path, adapter))
    assert main(["diff", str(base), str(tmp_path / "out"), "--values", "--source", f"adapter={adapter}", "--mapper", mapper_file]) == 0
    capsys.readouterr()
    assert main(["diff", str(base), str(tmp_path / "out"), "--values"]) == 1
    assert "values changed" in capsys.readouterr().out


def _mapper_file(tmp_path, adapter):
    path = tmp_path / "mapper.py"
    path.write_text(M.presets.lora_merge(adapter).to_code())
    return path


def test_plan_covers_every_source(cases):
    base, adapter, _ = cases["lora"]
    ck = wb.open_checkpoint({"base": base, "adapter": adapter})
    assert set(ck.catalog.sources) == {"base", "adapter"}
    assert any(n.startswith("adapter::base_model.model.") for n in ck.catalog)
    assert ck.tensors["source"].value_counts().to_dict().keys() == {"base", "adapter"}
    plan = wb.plan(ck, M.presets.lora_merge(adapter))
    assert plan.ok, plan.problems
    paths = set(plan.files_read["path"])
    assert paths == {str(base / "model.safetensors"), str(adapter / "adapter_model.safetensors")}
    assert dict(zip(plan.files_read["path"], plan.files_read["source"], strict=True)) == {
        str(base / "model.safetensors"): "base", str(adapter / "adapter_model.safetensors"): "adapter"}
    from workbench.engine.source_guard import snapshot_for

    snapshot = snapshot_for(plan)
    assert snapshot.changes() == []
    before = plan.fingerprint
    stamp = os.stat(adapter / "adapter_model.safetensors").st_mtime_ns
    os.utime(adapter / "adapter_model.safetensors", ns=(stamp + 10**9, stamp + 10**9))
    try:
        assert "adapter_model.safetensors" in snapshot.changes()[0]  # the source guard watches the adapter too
        assert wb.plan({"base": base, "adapter": adapter}, M.presets.lora_merge(adapter)).fingerprint != before
    finally:
        os.utime(adapter / "adapter_model.safetensors", ns=(stamp, stamp))


def test_unknown_adapter_content_is_a_plan_problem(cases, tmp_path):
    base, adapter, _ = cases["lora"]
    odd = tmp_path / "odd"
    odd.mkdir()
    tensors = load_file(adapter / "adapter_model.safetensors")
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(4, 64)
    save_file(tensors, odd / "adapter_model.safetensors")
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["layer_replication"] = [[0, 2]]
    (odd / "adapter_config.json").write_text(json.dumps(config))
    plan = wb.plan({"base": base, "adapter": odd}, M.presets.lora_merge(odd))
    messages = " ".join(p.message for p in plan.errors)
    assert not plan.ok
    assert "lora_embedding_A" in messages and "layer_replication" in messages


def test_wrong_rank_is_a_plan_problem(cases, tmp_path):
    base, adapter, _ = cases["lora"]
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "adapter_model.safetensors").write_bytes((adapter / "adapter_model.safetensors").read_bytes())
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["rank_pattern"] = {"v_proj": 2}
    (odd / "adapter_config.json").write_text(json.dumps(config))
    plan = wb.plan({"base": base, "adapter": odd}, M.presets.lora_merge(odd))
    assert not plan.ok and "r=2" in plan.errors[0].message


def test_unmerge_restores_the_base_and_refuses_dora(cases, tmp_path):
    base, adapter, _ = cases["gpt2-fan-in-fan-out-bias"]
    wb.convert({"base": base, "adapter": adapter}, tmp_path / "merged", M.presets.lora_merge(adapter), quiet=True)
    wb.convert({"base": tmp_path / "merged", "adapter": adapter}, tmp_path / "back",
               M.presets.lora_merge(adapter, unmerge=True), quiet=True)
    back, original = load_file(tmp_path / "back" / "model.safetensors"), load_file(base / "model.safetensors")
    for name, tensor in back.items():
        torch.testing.assert_close(tensor, original[name], rtol=0, atol=1e-5)
    dbase, dadapter, _ = cases["dora-modules-to-save"]
    plan = wb.plan({"base": dbase, "adapter": dadapter}, M.presets.lora_merge(dadapter, unmerge=True))
    assert not plan.ok and "DoRA" in " ".join(p.message for p in plan.errors)


def test_average_of_three_equals_torch(tmp_path):
    gen = torch.Generator().manual_seed(0)
    states = []
    for i in range(3):
        state = {f"layers.{k}.weight": torch.randn(64, 32, generator=gen) for k in range(4)}
        state |= {"a.weight": torch.randn(64, 32, generator=gen), "b.weight": torch.randn(16, 8, generator=gen).to(torch.bfloat16),
                 "step": torch.tensor([7])}
        (tmp_path / f"c{i}").mkdir()
        save_file(state, tmp_path / f"c{i}" / "model.safetensors")
        states.append(state)
    ck = wb.open_checkpoint({f"c{i}": tmp_path / f"c{i}" for i in range(3)})
    weights = [0.5, 0.3, 0.2]
    mapper = M.presets.average(ck, weights)
    plan = wb.plan(ck, mapper)
    assert plan.ok, plan.problems
    big = 64 * 32 * 4
    assert plan.peak_bytes == 5 * big  # one group: the N inputs of a tensor, its output and the fp32 accumulator ...
    assert plan.peak_bytes < sum(ck.tensors["nbytes"]) / 3  # ... never a whole checkpoint
    wb.convert(ck, tmp_path / "out", mapper, quiet=True)
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert set(out) == set(states[0])
    for name in ("a.weight", "b.weight"):  # mergekit's linear merge: fused fp32 sum of w_i·x_i, divided by Σ w_i
        assert torch.equal(out[name], linear_reference([s[name] for s in states], weights)), name
    uniform = M.presets.average(["c0", "c1", "c2"])  # names only: written before any source is opened
    wb.convert(ck, tmp_path / "uniform", uniform, quiet=True)
    expected = linear_reference([s["a.weight"] for s in states], [1.0, 1.0, 1.0])
    assert torch.equal(load_file(tmp_path / "uniform" / "model.safetensors")["a.weight"], expected)
    pair = M.presets.average(["c1", "c2"], [1, 3], like=ck)  # the primary source c0 left out: dropped
    wb.convert(ck, tmp_path / "pair", pair, quiet=True)
    got = load_file(tmp_path / "pair" / "model.safetensors")
    assert set(got) == set(states[0])
    assert torch.equal(got["a.weight"], linear_reference([states[1]["a.weight"], states[2]["a.weight"]], [1.0, 3.0]))


def linear_reference(tensors, weights):
    """mergekit's linear kernel in plain torch: fp32 accumulator, addcmul per model, one division, one rounding."""
    acc = torch.zeros_like(tensors[0], dtype=torch.float32)
    for tensor, weight in zip(tensors, weights, strict=True):
        acc.addcmul_(tensor, torch.tensor(weight, dtype=torch.float32))
    return (acc / torch.tensor(weights, dtype=torch.float32).sum()).to(tensors[0].dtype)


def test_average_refuses_mismatched_checkpoints(tmp_path):
    for i, rows in enumerate((4, 5)):
        (tmp_path / f"c{i}").mkdir()
        save_file({"w": torch.zeros(rows, 2)}, tmp_path / f"c{i}" / "model.safetensors")
    ck = wb.open_checkpoint({"c0": tmp_path / "c0", "c1": tmp_path / "c1"})
    plan = wb.plan(ck, M.presets.average(ck))
    assert not plan.ok and "'w'" in plan.errors[0].message


def test_diff_through_a_mapper(cases, tmp_path):
    base, adapter, _ = cases["rslora-patterns"]
    source = wb.open_checkpoint({"base": base, "adapter": adapter})
    merge = M.presets.lora_merge(adapter)
    wb.convert(source, tmp_path / "out", merge, quiet=True)
    through = source.diff(tmp_path / "out", mapper=merge, values=True, include_same=True)
    assert set(through["status"]) == {"same"} and len(through) == len(load_file(base / "model.safetensors"))
    plain = wb.open_checkpoint(base).diff(tmp_path / "out", values=True)
    assert "values changed" in set(plain["status"])


def test_builder_adds_a_source_and_the_lora_preset_by_clicking(cases, tmp_path):
    from workbench.widgets import MapperBuilder

    base, adapter, ref = cases["dora-modules-to-save"]
    builder = MapperBuilder(base)
    builder.preset_picker.value = "lora_merge"
    builder.load_preset_button.click()
    assert "no source named" in builder.form_message.value and not builder.steps
    builder.checkpoint_name.value = "adapter"
    builder.checkpoint_path.value = str(adapter)
    builder.add_checkpoint_button.click()
    assert any(value.startswith("adapter::") for _, value in builder.suggestions.options)
    builder.load_preset_button.click()
    assert builder.steps and builder.binding is not None and builder.binding.ok
    assert "lora_magnitude_vector" in builder.code()
    wb.convert(builder.source, tmp_path / "out", builder.mapper, quiet=True)
    _check_equal(load_file(tmp_path / "out" / "model.safetensors"), ref, load_file(base / "model.safetensors"))


def test_two_ranks_merge_from_two_sources(cases, tmp_path):
    base, adapter, ref = cases["lora"]
    source = {"base": base, "adapter": adapter}
    report = wb.convert(source, tmp_path / "out", M.presets.lora_merge(adapter), nproc=2, shard_size="30KB",
                        launcher="local", quiet=True)
    assert report.ok if hasattr(report, "ok") else True
    out = wb.open_checkpoint(tmp_path / "out")
    assert len(out.files) >= 2
    for name in out.tensors.index:
        assert torch.equal(out.load(name), ref[name]), name


def test_unmapped_tensors_of_another_source_are_a_problem(cases):
    base, adapter, _ = cases["lora"]
    plan = wb.plan({"base": base, "adapter": adapter})
    assert not plan.ok and "source 'adapter'" in plan.errors[0].message


def test_bf16_base_and_adapter_within_bf16_rounding_of_peft(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from peft_fixtures import base_model, randomise

    model = base_model("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "base")
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "o_proj"]))
    randomise(peft_model)
    peft_model.save_pretrained(tmp_path / "adapter")
    ref = PeftModel.from_pretrained(base_model("llama").to(torch.bfloat16), tmp_path / "adapter")
    ref.load_state_dict(peft_model.state_dict())
    expected = ref.merge_and_unload().state_dict()
    wb.convert({"base": tmp_path / "base", "adapter": tmp_path / "adapter"}, tmp_path / "out",
               M.presets.lora_merge(tmp_path / "adapter"), quiet=True)
    out = load_file(tmp_path / "out" / "model.safetensors")
    moved = 0
    for name, tensor in out.items():
        assert tensor.dtype == torch.bfloat16
        # PEFT rounds ΔW to bf16 before adding in bf16; we round once from fp32: at most a couple of bf16 steps apart
        torch.testing.assert_close(tensor.float(), expected[name].float(), rtol=2 ** -6, atol=2 ** -12)
        moved += not torch.equal(tensor, load_file(tmp_path / "base" / "model.safetensors")[name])
    assert moved >= 4
