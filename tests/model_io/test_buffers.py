"""load_into on meta-device modules: non-persistent buffers are filled from the source or recomputed.

Tiny random transformers models are saved with `save_pretrained` and loaded into the same model built
under `torch.device("meta")`; the result must compute bit-identical logits to `from_pretrained`.
Plain modules are compared with the same module built on CPU and loaded with `load_state_dict`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import workbench as wb
from workbench import mapper as M
from workbench.errors import PlanError
from workbench.iostats import IO
from workbench.model_io import UninitializedBufferError, dry_run_load

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

SMALL = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}


def qwen2_moe_fuse(layers: int, experts: int) -> M.Mapper:
    """The legacy per-expert layout save_pretrained writes -> the fused `gate_up_proj` / `down_proj` of the module."""
    def expert(j: int, name: str) -> str:
        return f"model.layers.{{i}}.mlp.experts.{j}.{name}.weight"

    ops: list[M.Mapper] = []
    for name in ("gate_proj", "up_proj", "down_proj"):
        ops.append(M.Stack([expert(j, name) for j in range(experts)], f"model.layers.{{i}}.mlp.experts.{name}"))
    ops.append(M.Concat(["model.layers.{i}.mlp.experts.gate_proj", "model.layers.{i}.mlp.experts.up_proj"],
                        "model.layers.{i}.mlp.experts.gate_up_proj", dim=1))
    return M.Sequential(*ops)


MODELS = {
    "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)), None),
    "qwen2": (lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL)), None),
    "gpt2": (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=40, bos_token_id=0, eos_token_id=0)), None),
    "bert": (lambda: transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=40)), None),
    "qwen2_moe": (lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **SMALL, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2)),
        lambda: qwen2_moe_fuse(2, 4)),
}


def saved(name: str, folder: Path):
    """A seeded tiny model of this family, saved with save_pretrained (distinctive values everywhere)."""
    build, mapper = MODELS[name]
    torch.manual_seed(0)
    model = build()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return type(model), model.config, mapper() if mapper else None


def on_meta(cls, config):
    with torch.device("meta"):
        return cls(config)


def logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("name", list(MODELS))
def test_meta_load_computes_what_from_pretrained_computes(name: str, tmp_path: Path) -> None:
    cls, config, mapper = saved(name, tmp_path)
    reference = cls.from_pretrained(tmp_path).eval()
    model = on_meta(cls, config).eval()
    lost = [k for k, b in model.named_buffers() if k not in model.state_dict()]
    report = wb.load_into(model, tmp_path, mapper)
    assert report.ok and report.uninitialized == [] and report.kept_on_meta == []
    assert sorted(report.recomputed) == sorted(lost)
    assert all("._init_weights(" in how for how in report.recomputed.values())
    ours, theirs = dict(model.named_buffers()), dict(reference.named_buffers())
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
    tokens = torch.tensor([[1, 5, 9, 2, 33, 7, 11, 4, 60, 3, 18, 25]])
    expected = logits(reference, tokens)
    assert torch.isfinite(expected).all()
    assert torch.equal(logits(model, tokens), expected)
    if lost:
        assert "recomputed" in str(report) and lost[0] in str(report)


def test_dry_run_names_the_buffers_a_load_recomputes(tmp_path: Path) -> None:
    cls, config, _ = saved("llama", tmp_path)
    check = dry_run_load(on_meta(cls, config), tmp_path)
    assert check.ok and check.recompute == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    assert "to recompute" in str(check)
    assert dry_run_load(cls(config), tmp_path).recompute == []  # real buffers are kept as they are


def with_position_ids(folder: Path, value) -> Path:
    """A BERT checkpoint as older transformers wrote it: `embeddings.position_ids` stored with the weights."""
    tensors = load_file(folder / "model.safetensors")
    tensors["embeddings.position_ids"] = value
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_a_buffer_the_checkpoint_holds_is_loaded_from_it(bert_sample: Path, tmp_path: Path) -> None:
    import shutil

    folder = shutil.copytree(bert_sample, tmp_path / "bert")
    config = transformers.BertConfig.from_pretrained(folder)
    stored = torch.arange(config.max_position_embeddings).flip(0)[None]  # distinctive: not what init computes
    with_position_ids(folder, stored)
    for model in (on_meta(transformers.BertModel, config), transformers.BertModel(config)):
        report = wb.load_into(model, folder)  # strict: the stored buffer is a key of the module, not "unexpected"
        assert report.ok and "embeddings.position_ids" in report.loaded
        assert "embeddings.position_ids" not in report.recomputed
        assert torch.equal(model.embeddings.position_ids, stored)
    assert report.check.unexpected == []


def test_sentence_transformers_style_bert_equals_from_pretrained(bert_sample: Path, tmp_path: Path) -> None:
    import shutil

    folder = shutil.copytree(bert_sample, tmp_path / "bert")
    config = transformers.BertConfig.from_pretrained(folder)
    with_position_ids(folder, torch.arange(config.max_position_embeddings)[None])
    reference = transformers.BertModel.from_pretrained(folder).eval()
    model = on_meta(transformers.BertModel, config).eval()
    report = wb.load_into(model, folder)
    assert list(report.recomputed) == ["embeddings.token_type_ids"]
    tokens = torch.tensor([[2, 40, 7, 100, 3]])
    with torch.no_grad():
        expected = reference(tokens).last_hidden_state
        assert torch.equal(model(tokens).last_hidden_state, expected)


def test_a_stored_buffer_of_the_wrong_shape_is_a_shape_error(bert_sample: Path, tmp_path: Path) -> None:
    import shutil

    folder = with_position_ids(shutil.copytree(bert_sample, tmp_path / "bert"), torch.arange(7)[None])
    config = transformers.BertConfig.from_pretrained(folder)
    check = dry_run_load(on_meta(transformers.BertModel, config), folder)
    assert check.mismatched == ["embeddings.position_ids"] and check.unexpected == []


# -- plain nn.Modules --------------------------------------------------------------------------------------
class Rotary(torch.nn.Module):
    """A non-persistent buffer computed by the constructor, recomputed by reset_parameters (torch style)."""

    def __init__(self, dim: int = 8, base: float = 10000.0) -> None:
        super().__init__()
        self.dim, self.base = dim, base
        self.scale = torch.nn.Parameter(torch.ones(dim // 2))
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self):
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim))

    def reset_parameters(self) -> None:
        torch.nn.init.normal_(self.scale)  # re-initialises the weights too: must not touch the loaded ones
        self.inv_freq.copy_(self._inv_freq().to(self.inv_freq.device))

    def forward(self, x):
        return x * self.inv_freq * self.scale


class NoReset(torch.nn.Module):
    """A non-persistent buffer and no initialisation hook at all."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4))
        self.register_buffer("table", torch.arange(4.0), persistent=False)

    def forward(self, x):
        return x * self.weight + self.table


class ResetsWeightsOnly(NoReset):
    """A reset_parameters() that leaves the buffer alone."""

    def reset_parameters(self) -> None:
        torch.nn.init.zeros_(self.weight)


class Net(torch.nn.Module):
    def __init__(self, inner: type = Rotary) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.inner = inner()


def saved_plain(model, folder: Path) -> Path:
    folder.mkdir()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_plain_module_buffers_are_recomputed_by_reset_parameters(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = Net()
    folder = saved_plain(reference, tmp_path / "ckpt")
    cpu = Net()
    cpu.load_state_dict(load_file(folder / "model.safetensors"))
    with torch.device("meta"):
        model = Net()
    report = wb.load_into(model, folder)
    assert report.recomputed == {"inner.inv_freq": "Rotary.reset_parameters() of inner"}
    assert torch.equal(model.inner.scale, reference.inner.scale)  # the loaded weight, not re-initialised
    assert torch.equal(model.inner.inv_freq, cpu.inner.inv_freq)
    x = torch.randn(3, 4)
    assert torch.equal(model.inner(x), cpu.inner(x))


def test_a_buffer_nothing_can_set_is_refused_before_reading(tmp_path: Path) -> None:
    folder = saved_plain(Net(NoReset), tmp_path / "ckpt")
    source = wb.open_checkpoint(folder)  # the header is read here
    with torch.device("meta"):
        model = Net(NoReset)
    IO.reset()
    with pytest.raises(UninitializedBufferError) as raised:
        wb.load_into(model, source)
    message = str(raised.value)
    assert message.startswith(f"Cannot load {folder} into Net: 1 non-persistent buffer(s) are on the meta device")
    assert "'inner.table': no initialisation hook found" in message
    assert "on_uninitialized='meta'" in message and "Nothing was read or allocated." in message
    assert raised.value.keys == ["inner.table"]
    assert IO.snapshot()["bytes_read"] == 0 and all(t.is_meta for t in model.parameters())


def test_opting_out_keeps_the_buffer_on_meta_or_empty(tmp_path: Path) -> None:
    folder = saved_plain(Net(NoReset), tmp_path / "ckpt")
    with torch.device("meta"):
        model = Net(NoReset)
    report = wb.load_into(model, folder, on_uninitialized="meta")
    assert report.kept_on_meta == ["inner.table"] and report.recomputed == {} and report.uninitialized == []
    assert model.inner.table.is_meta and not model.inner.weight.is_meta
    assert "left on the meta device" in str(report)
    with pytest.raises((RuntimeError, NotImplementedError)):
        model.inner(torch.ones(4)).sum().item()  # forward fails loudly instead of using garbage

    with torch.device("meta"):
        model = Net(NoReset)
    report = wb.load_into(model, folder, on_uninitialized="empty")
    assert report.uninitialized == ["inner.table"] and not model.inner.table.is_meta
    assert "left uninitialised" in str(report)
    with pytest.raises(PlanError, match="on_uninitialized='later'"):
        wb.load_into(model, folder, on_uninitialized="later")


def test_a_hook_that_does_not_set_the_buffer_is_not_trusted(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = Net(ResetsWeightsOnly)
    folder = saved_plain(reference, tmp_path / "ckpt")
    with torch.device("meta"):
        model = Net(ResetsWeightsOnly)
    with pytest.raises(UninitializedBufferError) as raised:
        wb.load_into(model, folder)
    message = str(raised.value)
    assert "'inner.table': ResetsWeightsOnly.reset_parameters() of inner does not set it" in message
    assert "Nothing was read or allocated." in message
    assert all(t.is_meta for t in model.state_dict().values())
    report = wb.load_into(model, folder, on_uninitialized="meta")
    assert report.kept_on_meta == ["inner.table"] and model.inner.table.is_meta
    assert torch.equal(model.inner.weight, reference.inner.weight)  # loaded, not reset to zeros by the hook


def test_a_mismatched_stored_buffer_is_recomputed_when_not_strict(bert_sample: Path, tmp_path: Path) -> None:
    import shutil

    folder = with_position_ids(shutil.copytree(bert_sample, tmp_path / "bert"), torch.arange(7)[None])
    config = transformers.BertConfig.from_pretrained(folder)
    model = on_meta(transformers.BertModel, config)
    report = wb.load_into(model, folder, strict=False)
    assert report.check.mismatched == ["embeddings.position_ids"] and report.uninitialized == []
    assert sorted(report.recomputed) == ["embeddings.position_ids", "embeddings.token_type_ids"]
    assert torch.equal(model.embeddings.position_ids, torch.arange(config.max_position_embeddings)[None])


class TitanStyle(torch.nn.Module):
    """A buffer on the root, recomputed (re-assigned) by an init_weights() that also re-initialises every weight."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
        self.register_buffer("freqs", self._freqs(), persistent=False)

    @staticmethod
    def _freqs():
        return torch.polar(torch.ones(3, 2), torch.outer(torch.arange(3.0), torch.tensor([1.0, 0.5])))

    def init_weights(self, buffer_device=None) -> None:
        with torch.device(buffer_device or self.freqs.device):
            self.freqs = self._freqs()
        for layer in self.layers:
            torch.nn.init.zeros_(layer.weight)
            layer.reset_parameters()


def test_a_root_init_weights_that_resets_everything_touches_no_loaded_weight(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = TitanStyle()
    folder = saved_plain(reference, tmp_path / "ckpt")
    with torch.device("meta"):
        model = TitanStyle()
    report = wb.load_into(model, folder)
    assert report.recomputed == {"freqs": "TitanStyle.init_weights() of the model"}
    assert model.freqs.dtype == torch.complex64 and torch.equal(model.freqs, reference.freqs)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)
