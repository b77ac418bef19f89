"""`check_target`: a mapper's outputs against a model (meta device too), a checkpoint or a mapping, from metadata."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import workbench as wb
from workbench import mapper as M
from workbench.catalog import TensorInfo
from workbench.errors import MapperError
from workbench.mapper import presets
from workbench.mapper.target import resolve_target


class TiedLM(nn.Module):
    """An embedding and an LM head sharing one weight (state_dict lists both names)."""

    def __init__(self, vocab: int = 16, hidden: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight


def meta_tied_lm() -> TiedLM:
    with torch.device("meta"):
        return TiedLM()


@pytest.fixture
def lm_checkpoint(tiny_checkpoint):
    """What a save of TiedLM writes when the tie is stored once (the head left out)."""
    model = TiedLM()
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "head.weight"}
    return tiny_checkpoint(state, name="lm")


def test_a_meta_model_matches_the_checkpoint_it_was_saved_from(lm_checkpoint):
    report = M.check_target(None, lm_checkpoint, meta_tied_lm())
    assert report.ok and report.level == "ok" and report.frame.empty
    assert report.matched == ["embed.weight", "norm.weight", "norm.bias"]
    assert report.tied == ["head.weight"]  # filled through embed.weight: not missing
    assert report.expected == 4 and report.produced == 3
    assert report.headline() == "Matches the target (4 tensors): names, shapes and dtypes agree."
    assert report.target == "TiedLM model"


def test_every_kind_of_difference_has_a_row_and_a_message(lm_checkpoint):
    mapper = M.Sequential(
        M.Rename("norm.bias", "norm.shift"),  # missing norm.bias, unexpected norm.shift
        M.Cast("norm.weight", "BF16"),  # dtype differs
        M.Reshape("embed.weight", (8, 16)),  # shape mismatch
    )
    report = M.check_target(mapper, lm_checkpoint, meta_tied_lm())
    statuses = report.frame["status"].astype(str).to_dict()
    assert statuses == {"norm.bias": "missing", "norm.shift": "unexpected", "embed.weight": "shape mismatch", "norm.weight": "dtype differs"}
    assert list(report.frame["status"].astype(str)) == ["missing", "unexpected", "shape mismatch", "dtype differs"]
    assert report.missing == ["norm.bias"] and report.unexpected == ["norm.shift"]
    assert report.mismatched == ["embed.weight"] and report.dtype_differs == ["norm.weight"]
    assert not report.ok and report.level == "error"
    assert report.headline() == "Does not match the target: 1 missing, 1 unexpected, 1 shape mismatch, 1 dtype differs."
    messages = report.frame["message"].to_dict()
    assert messages["norm.bias"].startswith("Missing 'norm.bias': the module expects F32 [8]")
    assert "the module has no tensor of that name" in messages["norm.shift"]
    assert "expects [16, 8] but the source (after the mapper) gives [8, 16]" in messages["embed.weight"]
    assert "is BF16 after the mapper but the module holds F32" in messages["norm.weight"]
    # head.weight's tie leader has the wrong shape: the head is not reported twice
    assert "head.weight" not in report.frame.index and report.tied == ["head.weight"]
    text = str(report)
    assert text.startswith("Target check against TiedLM model: Does not match") and text.count("\n") == 5
    with pytest.raises(MapperError, match=r"Cannot match TiedLM model: 3 problem\(s\)\. \(1\) Missing 'norm.bias'"):
        report.raise_for_problems()


def test_only_dtypes_differ_is_ok_with_a_warning(lm_checkpoint):
    report = M.check_target(M.Cast("norm.{p}", "BF16"), lm_checkpoint, meta_tied_lm())
    assert report.ok and report.level == "warning" and report.dtype_differs == ["norm.weight", "norm.bias"]
    assert report.headline() == "Names and shapes match the target (4 tensors); 2 dtype(s) differ."
    assert report.raise_for_problems() is report


def test_a_mapper_that_does_not_bind_is_not_ok(lm_checkpoint):
    report = M.check_target(M.Drop("no.such.weight"), lm_checkpoint, meta_tied_lm())
    assert report.frame.empty and not report.ok and len(report.mapper_errors) == 1
    assert "The mapper has 1 problem(s) binding to its source." in report.headline()
    with pytest.raises(MapperError, match="no.such.weight"):
        report.raise_for_problems()


def test_checkpoint_targets_path_checkpoint_or_catalog(llama_sample):
    fused = presets.hf_to_fused(llama_sample)
    for target in (llama_sample, wb.open_checkpoint(llama_sample), wb.open_checkpoint(llama_sample).catalog):
        report = M.check_target(fused, llama_sample, target)
        assert report.counts == {"missing": 20, "unexpected": 8}, type(target)
        assert report.target == str(llama_sample)
        assert "the target checkpoint expects" in report.frame.loc["model.layers.0.self_attn.q_proj.weight", "message"]
    back = fused.bind(wb.open_checkpoint(llama_sample))  # a Binding as the target: the fused layout
    assert M.check_target(fused, llama_sample, back).ok
    assert M.check_target(back, None, fused.bind(wb.open_checkpoint(llama_sample))).frame.empty


def test_mapping_targets_of_tensors_infos_and_bare_shapes():
    produced = {"a": TensorInfo("a", "F32", (2, 3)), "b": TensorInfo("b", "BF16", (4,))}
    target = {"a": torch.empty(2, 3, device="meta"), "b": (4,), "c": TensorInfo("c", "F32", (1,))}
    report = M.check_target(produced, None, target)
    assert report.frame["status"].astype(str).to_dict() == {"c": "missing"}  # b: a shape alone accepts any dtype
    assert report.frame.loc["c", "message"].startswith("Missing 'c': the target expects F32 [1]")
    assert resolve_target(target).tensors["b"].dtype is None
    shape_only = M.check_target(produced, None, {"a": torch.Size([3, 2]), "b": [4]})
    assert shape_only.mismatched == ["a"] and "any dtype" not in shape_only.frame.loc["a", "message"]
    assert M.check_target(produced, None, {"a": (2, 3), "b": (4,)}).frame.empty


def test_source_tensors_as_a_mapping(lm_checkpoint):
    source = {"embed.weight": torch.zeros(16, 8), "norm.weight": torch.zeros(8), "norm.bias": torch.zeros(8)}
    assert M.check_target(M.Sequential(), source, meta_tied_lm()).ok
    assert M.check_target(None, source, lm_checkpoint).ok


def test_bad_inputs_are_clear_errors(lm_checkpoint):
    with pytest.raises(MapperError, match="Cannot check against a int: pass a model"):
        M.check_target(None, lm_checkpoint, 3)
    with pytest.raises(MapperError, match="without its source"):
        M.check_target(M.Rename("a", "b"), None, {"b": (1,)})
    with pytest.raises(MapperError, match="none was given"):
        M.check_target(None, lm_checkpoint)
    with pytest.raises(MapperError, match="target entry 'x': it is a str"):
        M.check_target(None, lm_checkpoint, {"x": "big"})
    with pytest.raises(MapperError, match="Cannot check a int against a target"):
        M.check_target(5, lm_checkpoint, {"x": (1,)})
    report = M.check_target(None, lm_checkpoint, {"x": (1,)})
    with pytest.raises(MapperError, match="choose one of missing"):
        report.names("wrong")


def test_check_module_is_check_target_with_the_module(lm_checkpoint):
    model = meta_tied_lm()
    renamed = M.Rename("norm.bias", "norm.shift")
    by_module = M.check_module(model, lm_checkpoint, renamed)
    by_target = M.check_target(renamed, lm_checkpoint, model)
    assert by_module.frame.equals(by_target.frame) and by_module.tied == by_target.tied == ["head.weight"]
    assert by_module.missing == ["norm.bias"] and by_module.unexpected == ["norm.shift"]


def test_html_escapes_and_hides_messages(tiny_checkpoint):
    path = tiny_checkpoint({"<b>x</b>": torch.zeros(2)}, name="html")
    page = M.check_target(None, path, {"<i>y</i>": (2,)})._repr_html_()
    assert "&lt;b&gt;x&lt;/b&gt;" in page and "<b>x</b>" not in page and "<i>y</i>" not in page
    assert "Does not match the target: 1 missing, 1 unexpected." in page and "#c62828" in page
    assert "Map it from a source tensor" not in page  # the table shows values; messages are in str(report)


def test_checking_against_a_checkpoint_does_not_import_torch(llama_sample):
    code = (
        "import sys; from workbench import mapper as M; from workbench.mapper import presets; "
        "r = M.check_target(presets.hf_to_fused(sys.argv[1]), sys.argv[1], sys.argv[1]); "
        "assert r.counts == {'missing': 20, 'unexpected': 8}, r.counts; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code, str(llama_sample)], check=True)
