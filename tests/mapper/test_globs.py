"""Glob sources (workbench.mapper.globs): a `*` picks whole names where the step runs and expands into ordinary
operations over folded templates; the expansion must convert exactly like the same operations spelled out."""

from __future__ import annotations

import pytest
import torch

from workbench import mapper as M
from workbench.catalog import TensorInfo
from workbench.errors import MapperError
from workbench.mapper import globs

NAMES = [f"model.layers.{i}.mlp.{p}.weight" for i in range(12) for p in ("up_proj", "down_proj")] + [
    "model.layers.3.mlp.up_proj.bias", "model.norm.weight", "lm_head.weight", "model.step",
]


def infos(dtype_of=lambda name: "F32") -> dict[str, TensorInfo]:
    return {n: TensorInfo(n, "I64" if n.endswith("step") else dtype_of(n), (4, 2) if n.endswith("weight") else (4,)) for n in NAMES}


def state(source: dict[str, TensorInfo]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {n: (torch.randn(info.shape, generator=generator) if info.dtype == "F32" else torch.arange(4)) for n, info in source.items()}


def test_globs_match_whole_names_and_combine_with_placeholders():
    assert globs.match_names("model.*", NAMES) == [n for n in NAMES if n.startswith("model.")]
    assert globs.match_names("*.weight", NAMES) == [n for n in NAMES if n.endswith(".weight")]
    assert globs.match_names("layers.*", NAMES) == []  # whole names only (a filter would match inside)
    assert globs.match_names("model.layers.{i}.mlp.up_proj.*", NAMES) == [n for n in NAMES if ".up_proj." in n]
    assert globs.match_names("model.layers.1?.*.weight", NAMES) == [n for n in NAMES if n.startswith("model.layers.1") and len(n.split(".")[2]) == 2]


def test_fold_exactly_folds_only_when_the_template_catches_no_other_name():
    assert globs.fold_exactly([n for n in NAMES if ".up_proj.weight" in n], NAMES) == ["model.layers.{i}.mlp.up_proj.weight"]
    teens = globs.match_names("model.layers.1*.mlp.up_proj.weight", NAMES)  # layers 1, 10, 11 of 0..11: no fold
    assert globs.fold_exactly(teens, NAMES) == teens


def test_glob_cast_skips_integers_and_tensors_already_in_the_dtype_and_keeps_named_kinds():
    source = infos(lambda n: "BF16" if ".3." in n else "F32")
    mapper = globs.glob_cast("*", source, "BF16", keep=("norm", "bias"))
    outputs = mapper.bind(source).raise_for_problems().outputs
    assert outputs["model.step"].dtype == "I64" and outputs["model.norm.weight"].dtype == "F32"
    assert outputs["model.layers.3.mlp.up_proj.bias"].dtype == "F32"  # BF16 bias cast up to the kept dtype
    assert all(outputs[n].dtype == "BF16" for n in NAMES if n.endswith("proj.weight"))
    casts = {(leaf.name, leaf.dtype) for leaf in mapper.leaves()}
    assert ("model.layers.3.mlp.up_proj.weight", "BF16") not in casts  # already BF16: no operation
    assert len(casts) == 22 + 2  # a {i} fold would catch layer 3 too: the other 22 weights are spelled out
    folded = globs.glob_cast("*", infos(), "BF16", keep=("norm", "bias"))
    assert {(leaf.name, leaf.dtype) for leaf in folded.leaves()} == {
        ("model.layers.{i}.mlp.up_proj.weight", "BF16"), ("model.layers.{i}.mlp.down_proj.weight", "BF16"), ("lm_head.weight", "BF16"),
    }  # every float weight cast with two templates; the F32 norm and bias need nothing
    with pytest.raises(MapperError, match="already in the dtypes"):
        globs.glob_cast("model.step", source, "BF16")


def test_glob_rename_converts_like_renames_spelled_out():
    source = infos()
    mapper = globs.glob_rename("model.layers.*.mlp.*", "blocks.*.ffn.*", NAMES)
    spelled = M.Parallel(*[M.Rename(n, n.replace("model.layers.", "blocks.").replace(".mlp.", ".ffn.")) for n in NAMES if ".mlp." in n])
    tensors = state(source)
    ours, theirs = mapper.apply(tensors), spelled.apply(tensors)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)
    assert len(mapper.mappers) == 3  # up/down weights fold over {i}; the one bias is spelled out


def test_prefix_globs_are_prefix_scopes_and_bad_globs_are_explained():
    assert globs.glob_rename("model.*", "*", NAMES) == M.PrefixScope(M.Sequential(), source_prefix="model.")
    assert globs.glob_rename("*", "ckpt.*", NAMES) == M.PrefixScope(M.Sequential(), target_prefix="ckpt.")
    with pytest.raises(MapperError, match="as many"):
        globs.glob_rename("model.*", "x", NAMES)
    with pytest.raises(MapperError, match="matches no tensor name"):
        globs.expand_each("nothing.*", NAMES, M.Drop, "drop")
    with pytest.raises(MapperError, match="malformed placeholder"):
        globs.match_names("model.{1}.*", NAMES)
