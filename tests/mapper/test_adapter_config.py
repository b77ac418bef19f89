"""Hostile and unusual PEFT adapters (issue 29, C1/C2/D7/D16): values no adapter has are clear problems naming
adapter_config.json and the key; adapters whose initialisation changes the base (PiSSA, OLoRA) merge as PEFT
loads them, the ones no merge can reproduce are refused with the reason; trained biases (bias='all' /
'lora_only') replace the base's as in PEFT. References: peft's own merge_and_unload on the same files."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil

import pytest
import torch
from peft_fixtures import base_model, make_case, randomise
from safetensors.torch import load_file, save_file

import workbench as wb
from workbench import mapper as M
from workbench.errors import WorkbenchError

# peft (seconds to import) only where a test makes an adapter: the collection of both workers skips it
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft")


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    return make_case(tmp_path_factory.mktemp("lora"), "llama", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def _variant(adapter, folder, edit=None, text=None, tensors=None):
    """A copy of `adapter` in `folder` with its config edited (`edit(config)`) or replaced (`text`)."""
    folder.mkdir()
    if tensors is None:
        shutil.copy(adapter / "adapter_model.safetensors", folder / "adapter_model.safetensors")
    else:
        save_file(tensors, folder / "adapter_model.safetensors")
    if text is None:
        config = json.loads((adapter / "adapter_config.json").read_text())
        edit(config)
        text = json.dumps(config)  # NaN and Infinity are written as JSON's NaN / Infinity literals, as PEFT would
    (folder / "adapter_config.json").write_text(text)
    return folder


def _messages(base, adapter):
    plan = wb.plan({"base": base, "adapter": adapter}, M.presets.lora_merge(adapter))
    assert not plan.ok
    return " ".join(p.message for p in plan.errors)


BAD_VALUES = [
    ("lora_alpha", math.nan), ("lora_alpha", math.inf), ("lora_alpha", -math.inf), ("lora_alpha", 0), ("lora_alpha", -8),
    ("lora_alpha", "16"), ("r", 0), ("r", -4), ("r", 4.5), ("r", True), ("r", "4"), ("r", math.nan),
    ("alpha_pattern", {"q_proj": math.nan}), ("alpha_pattern", {"v_proj": -1}), ("rank_pattern", {"q_proj": 0}),
    ("rank_pattern", {"(": 4}), ("rank_pattern", [4]), ("use_rslora", "false"), ("fan_in_fan_out", 1), ("bias", "some"),
]


@pytest.mark.parametrize(("key", "value"), BAD_VALUES, ids=[f"{k}={v!r}" for k, v in BAD_VALUES])
def test_values_no_adapter_has_are_plan_problems_naming_the_key(lora, tmp_path, key, value):
    base, adapter, _ = lora
    odd = _variant(adapter, tmp_path / "odd", lambda c: c.__setitem__(key, value))
    message = _messages(base, odd)
    assert key in message and "adapter_config.json" in message and str(odd) in message
    assert "internal error" not in message.lower()


def test_non_finite_alpha_never_reaches_the_output(lora, tmp_path):
    base, adapter, _ = lora
    odd = _variant(adapter, tmp_path / "odd", lambda c: c.__setitem__("lora_alpha", math.nan))
    with pytest.raises(WorkbenchError, match="lora_alpha"):
        wb.convert({"base": base, "adapter": odd}, tmp_path / "out", M.presets.lora_merge(odd), quiet=True)
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.parametrize("alpha", [1e40, 1e300])
def test_finite_alpha_that_overflows_the_weights_is_refused_at_run_time(lora, tmp_path, alpha):
    """A finite alpha passes the config check but makes ±inf weights: the merge refuses instead of writing them."""
    base, adapter, _ = lora
    odd = _variant(adapter, tmp_path / "odd", lambda c: c.__setitem__("lora_alpha", alpha))
    assert wb.plan({"base": base, "adapter": odd}, M.presets.lora_merge(odd)).ok
    with pytest.raises(WorkbenchError, match="not finite") as info:
        wb.convert({"base": base, "adapter": odd}, tmp_path / "out", M.presets.lora_merge(odd), quiet=True)
    assert "lora_alpha" in str(info.value) and "q_proj" in str(info.value)
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_cli_refuses_with_exit_2_and_no_traceback(lora, tmp_path, capsys):
    from workbench.cli import main

    base, adapter, _ = lora
    cases = {
        "r0": _variant(adapter, tmp_path / "r0", lambda c: c.__setitem__("r", 0)),
        "alpha-string": _variant(adapter, tmp_path / "alpha", lambda c: c.__setitem__("lora_alpha", "16")),
        "deep": _variant(adapter, tmp_path / "deep", text='{"r": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        "deep-object": _variant(adapter, tmp_path / "deep2", text='{"a":' * 100_000 + "1" + "}" * 100_000),
        "not-json": _variant(adapter, tmp_path / "nj", text="{'r': 4}"),
        "list": _variant(adapter, tmp_path / "list", text="[4]"),
    }
    for name, odd in cases.items():
        capsys.readouterr()
        assert main(["convert", str(base), str(tmp_path / f"out-{name}"), "--adapter", str(odd), "--quiet"]) == 2, name
        err = capsys.readouterr().err
        assert "adapter_config.json" in err and "internal error" not in err and "Traceback" not in err, (name, err)
        assert not (tmp_path / f"out-{name}" / "model.safetensors").exists()


def test_deep_config_is_a_workbench_error_naming_the_file(lora, tmp_path):
    _, adapter, _ = lora
    odd = _variant(adapter, tmp_path / "odd", text="[" * 100_000 + "]" * 100_000)
    with pytest.raises(WorkbenchError, match="nested too deeply") as info:
        M.presets.lora_merge(odd)
    assert str(odd / "adapter_config.json") in str(info.value)


def test_dora_config_without_magnitudes_is_not_merged_as_plain_lora(lora, tmp_path):
    base, adapter, _ = lora
    odd = _variant(adapter, tmp_path / "odd", lambda c: c.__setitem__("use_dora", True))
    message = _messages(base, odd)
    assert "use_dora" in message and "lora_magnitude_vector" in message


def test_magnitudes_without_use_dora_are_a_problem(lora, tmp_path):
    base, adapter, _ = lora
    tensors = load_file(adapter / "adapter_model.safetensors")
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"] = torch.ones(32)
    odd = _variant(adapter, tmp_path / "odd", lambda c: None, tensors=tensors)
    assert "use_dora is false" in _messages(base, odd)


# -- D16: bias='all' / 'lora_only' ----------------------------------------------------------------------------
def _trained(root, kind, **lora_kw):
    """base/ and adapter/ under root, every trainable parameter randomised (biases too); PEFT's merged state."""
    from peft import LoraConfig, get_peft_model

    model = base_model(kind)
    model.save_pretrained(root / "base")
    peft_model = get_peft_model(model, LoraConfig(**lora_kw))
    randomise(peft_model)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if param.requires_grad and name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=gen))
    peft_model.save_pretrained(root / "adapter")
    merged = peft_model.merge_and_unload()
    return root / "base", root / "adapter", {k: v.detach().clone() for k, v in merged.state_dict().items()}


def _merge_and_compare(base, adapter, ref, out):
    """Merge with the workbench into `out`; every tensor bit for bit PEFT's; how many the adapter moved."""
    wb.convert({"base": base, "adapter": adapter}, out, M.presets.lora_merge(adapter), quiet=True)
    got, original = load_file(out / "model.safetensors"), load_file(base / "model.safetensors")
    assert set(got) == set(original)
    moved = 0
    for name, tensor in got.items():
        assert torch.equal(tensor, ref[name]), name
        moved += not torch.equal(tensor, original[name])
    return moved


@pytest.mark.parametrize("bias", ["lora_only", "all"])
def test_trained_biases_replace_the_base_ones_as_in_peft(tmp_path, bias):
    base, adapter, ref = _trained(tmp_path, "gpt2", r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"],
                                  fan_in_fan_out=True, bias=bias)
    assert any(".base_layer.bias" in k for k in load_file(adapter / "adapter_model.safetensors"))
    moved = _merge_and_compare(base, adapter, ref, tmp_path / "out")
    changed_biases = [k for k in ref if k.endswith("bias") and not torch.equal(ref[k], load_file(base / "model.safetensors")[k])]
    assert moved >= 8 and len(changed_biases) >= (4 if bias == "lora_only" else 10)


def test_trained_bias_and_lora_bias_together(tmp_path):
    base, adapter, ref = _trained(tmp_path, "gpt2", r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True,
                                  bias="lora_only", lora_bias=True)
    assert _merge_and_compare(base, adapter, ref, tmp_path / "out") >= 4


# -- D7: inits that change the base ---------------------------------------------------------------------------
def _peft_loaded(kind, adapter):
    """What PEFT makes of the saved files: the original base, the adapter loaded onto it, merged."""
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(base_model(kind), adapter)
    return {k: v.detach().clone() for k, v in loaded.merge_and_unload().state_dict().items()}


@pytest.mark.parametrize(("kind", "init", "extra"), [
    ("llama", "pissa", {}), ("llama", "olora", {}), ("gpt2", "pissa", {"fan_in_fan_out": True}),
    ("llama", "pissa", {"use_dora": True}), ("llama", "eva", {}), ("llama", "orthogonal", {}),
])
def test_inits_merge_as_peft_loads_them(tmp_path, kind, init, extra):
    targets = ["q_proj", "v_proj"] if kind == "llama" else ["c_attn"]
    base, adapter, in_memory = make_case(tmp_path, kind, r=4, lora_alpha=8, target_modules=targets, init_lora_weights=init,
                                         **extra)
    assert json.loads((adapter / "adapter_config.json").read_text())["init_lora_weights"] == init
    ref = _peft_loaded(kind, adapter)
    for name in ref:  # PEFT's load reproduces the residual base it trained on: the reference is self-consistent
        assert torch.equal(ref[name], in_memory[name]), name
    assert _merge_and_compare(base, adapter, ref, tmp_path / "out") >= 2


def test_pissa_in_bf16_within_rounding_of_peft(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    model = base_model("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "base")
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights="pissa"))
    randomise(peft_model)
    peft_model.save_pretrained(tmp_path / "adapter")
    ref = PeftModel.from_pretrained(base_model("llama").to(torch.bfloat16), tmp_path / "adapter").merge_and_unload().state_dict()
    wb.convert({"base": tmp_path / "base", "adapter": tmp_path / "adapter"}, tmp_path / "out",
               M.presets.lora_merge(tmp_path / "adapter"), quiet=True)
    out = load_file(tmp_path / "out" / "model.safetensors")
    # PEFT adds ΔW rounded to bf16 in bf16; the workbench adds in float32 and rounds once (as for plain LoRA in bf16)
    for name, tensor in out.items():
        torch.testing.assert_close(tensor.float(), ref[name].float(), rtol=2 ** -6, atol=2 ** -10)


def test_converted_pissa_is_a_plain_lora_of_double_rank(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = base_model("llama")
    model.save_pretrained(tmp_path / "base")
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights="pissa"))
    peft_model.save_pretrained(tmp_path / "initial")
    randomise(peft_model)
    peft_model.save_pretrained(tmp_path / "adapter", path_initial_model_for_weight_conversion=str(tmp_path / "initial"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["init_lora_weights"] is True and config["r"] == 8
    ref = _peft_loaded("llama", tmp_path / "adapter")
    assert _merge_and_compare(tmp_path / "base", tmp_path / "adapter", ref, tmp_path / "out") >= 2


@pytest.mark.parametrize(("init", "why"), [("pissa_niter_4", "randomised SVD"), ("corda", "calibration data"),
                                           ("loftq", "LoftQ"), ("something_new", "does not know")])
def test_inits_no_merge_can_reproduce_are_refused_with_the_reason(lora, tmp_path, init, why):
    base, adapter, _ = lora
    odd = _variant(adapter, tmp_path / "odd", lambda c: c.__setitem__("init_lora_weights", init))
    message = _messages(base, odd)
    assert "init_lora_weights" in message and why in message and "path_initial_model_for_weight_conversion" in message


def test_unmerge_of_a_residual_init_is_refused(tmp_path):
    base, adapter, _ = make_case(tmp_path, "llama", r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights="olora")
    plan = wb.plan({"base": base, "adapter": adapter}, M.presets.lora_merge(adapter, unmerge=True))
    assert not plan.ok and "olora" in plan.errors[0].message
