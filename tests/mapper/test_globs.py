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


# --- globs in operations (workbench.mapper.patterns): written in code, bound where the step runs -------------------
def test_globs_bind_in_code_for_every_single_input_op():
    source = infos()
    outputs = M.Cast("*.weight", "BF16").bind(source).raise_for_problems().outputs
    assert all(outputs[n].dtype == "BF16" for n in NAMES if n.endswith(".weight"))
    assert outputs["model.layers.3.mlp.up_proj.bias"].dtype == "F32"
    cast_all = M.Cast("*", "BF16").bind(source).raise_for_problems().outputs
    assert cast_all["model.step"].dtype == "I64"  # a glob did not name the integer step: it passes unchanged
    assert cast_all["model.layers.3.mlp.up_proj.bias"].dtype == "BF16"
    assert M.Cast("model.step", "F32").bind(source).outputs["model.step"].dtype == "F32"  # a name casts what it names
    kept = M.Drop("*.up_proj.*").bind(source).raise_for_problems().outputs
    assert not any("up_proj" in n for n in kept) and len(kept) == len(NAMES) - 13
    renamed = M.Rename("model.layers.{i}.mlp.*", "blocks.{i}.*").bind(source).raise_for_problems().outputs
    assert "blocks.3.up_proj.bias" in renamed and "model.norm.weight" in renamed and len(renamed) == len(NAMES)
    moved = M.Transpose("*.down_proj.weight").bind(source).raise_for_problems().outputs
    assert moved["model.layers.0.mlp.down_proj.weight"].shape == (2, 4) and moved["model.layers.0.mlp.up_proj.weight"].shape == (4, 2)
    parts = M.Split("*.up_proj.weight", ["*.a", "*.b"]).bind(source).raise_for_problems().outputs
    assert parts["model.layers.7.mlp.a"].shape == (2, 2)  # '*' took the text before '.up_proj.weight'


def test_globs_compute_like_the_operations_spelled_out():
    source = infos()
    tensors = state(source)
    ours = M.Sequential(M.Rename("model.*", "*"), M.Cast("layers.*.weight", "BF16")).apply(tensors)
    spelled = M.Parallel(*[M.Rename(n, n[len("model."):]) for n in NAMES if n.startswith("model.")])
    theirs = spelled.apply(tensors)
    assert ours.keys() == theirs.keys() and ours["step"].dtype == torch.int64
    assert torch.equal(ours["layers.0.mlp.up_proj.weight"], theirs["layers.0.mlp.up_proj.weight"].to(torch.bfloat16))
    assert torch.equal(ours["norm.weight"], theirs["norm.weight"])


def test_a_glob_binds_against_the_names_at_its_step():
    source = infos()
    after_rename = M.Sequential(M.Rename("model.*", "*"), M.Cast("layers.*", "BF16")).bind(source).raise_for_problems()
    assert after_rename.outputs["layers.5.mlp.down_proj.weight"].dtype == "BF16"
    before_rename = M.Sequential(M.Cast("layers.*", "BF16"), M.Rename("model.*", "*")).bind(source)
    assert [p.kind for p in before_rename.problems] == ["missing"]
    assert "glob 'layers.*' matches no tensor name" in before_rename.problems[0].message
    scoped = M.PrefixScope(M.Drop("layers.*"), source_prefix="model.", target_prefix="model.").bind(source).raise_for_problems()
    assert sorted(scoped.outputs) == ["lm_head.weight", "model.norm.weight", "model.step"]  # inside a scope: local names


def test_to_code_keeps_the_glob_and_rebuilds_an_equal_mapper():
    mapper = M.Sequential(M.Rename("model.layers.{i}.*", "blocks.{i}.*"), M.Cast("*.weight", "BF16"), M.Drop("*.rotary_emb.*"))
    code = mapper.to_code()
    assert "M.Cast('*.weight', 'BF16')" in code and "M.Drop('*.rotary_emb.*')" in code
    space: dict = {}
    exec(code, space)
    assert space["mapper"] == mapper


def test_inverse_keeps_the_glob_where_it_stands_for_the_same_names_else_spells_them_out():
    source = infos(lambda n: "BF16")
    widen = M.Cast("*.mlp.*", "F32")
    inverse = widen.inverse(source)
    assert inverse == M.Cast("*.mlp.*", "BF16")
    tensors = state(infos())
    tensors = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in tensors.items()}
    back = inverse.apply(widen.apply(tensors))
    assert back.keys() == tensors.keys() and all(torch.equal(back[n], tensors[n]) and back[n].dtype == tensors[n].dtype for n in back)
    renamed = M.Rename("model.layers.{i}.*", "blocks.{i}.*")
    assert renamed.inverse(source) == M.Rename("blocks.{i}.*", "model.layers.{i}.*")
    strip = M.Rename("model.*", "*")  # '*' -> 'model.*' would also catch lm_head.weight: the inverse names its tensors
    undo = strip.inverse(source)
    assert isinstance(undo, M.Parallel) and M.Rename("norm.weight", "model.norm.weight") in undo.mappers
    assert sorted(undo.apply(strip.apply(tensors))) == sorted(tensors)
    sibling = M.Parallel(M.Cast("*.up_proj.weight", "F32"), M.Rename("model.norm.weight", "model.up_proj.weight"))
    spelled = sibling.inverse(source)  # the inverse glob would also catch the sibling's output: spelled out
    assert M.Cast("model.layers.0.mlp.up_proj.weight", "BF16") in spelled.mappers[0].mappers
    with pytest.raises(MapperError, match="not invertible|data is gone"):
        M.Drop("*.bias").inverse(source)


def test_globs_where_they_would_be_ambiguous_are_refused_with_the_fix():
    with pytest.raises(MapperError, match="reads 2 tensors"):
        M.Concat(["*.q_proj.weight", "*.k_proj.weight"], "*.qk.weight")
    with pytest.raises(MapperError, match="holds 0 '\\*' but the glob 'model.\\*' holds 1"):
        M.Rename("model.*", "x")
    with pytest.raises(MapperError, match="no input is a glob"):
        M.Rename("model.norm.weight", "*")
    with pytest.raises(MapperError, match="range"):
        M.Unstack("*.experts", ["*.experts.{e*}"])


def test_literal_names_with_glob_characters_escape_or_bind_as_themselves():
    from workbench.mapper.patterns import escape, is_glob

    odd = {"a[0].w": TensorInfo("a[0].w", "F32", (2,)), "a0.w": TensorInfo("a0.w", "F32", (2,)), "b.w": TensorInfo("b.w", "F32", (2,))}
    assert escape("a[0]*?.w") == "a[[]0][*][?].w" and not is_glob("x.{e*}.w") and is_glob("x.[ab].w")
    assert list(M.Drop(escape("a[0].w")).bind(odd).outputs) == ["a0.w", "b.w"]
    assert list(M.Drop("a[0].w").bind(odd).outputs) == ["a0.w", "b.w"]  # a present name is that name, as before globs
    assert list(M.Drop("a[0-9].w").bind(odd).outputs) == ["a[0].w", "b.w"]  # otherwise a set of characters
    assert list(M.Rename("*.w", "*.weight").bind(odd).outputs) == ["a[0].weight", "a0.weight", "b.weight"]


def test_placeholders_ranges_and_plain_names_bind_exactly_as_before():
    source = infos()
    template = M.Cast("model.layers.{i}.mlp.up_proj.weight", "BF16")
    assert not template.bind(source).problems and len(template.bind(source).outputs) == len(NAMES)
    missing = M.Cast("model.nothing.weight", "BF16").bind(source).problems
    assert [p.kind for p in missing] == ["missing"] and "is not in the source" in missing[0].message


def test_a_literal_name_that_wins_over_its_glob_is_a_warning_naming_what_the_glob_would_match():
    odd = {"a[0].w": TensorInfo("a[0].w", "F32", (2,)), "a0.w": TensorInfo("a0.w", "F32", (2,)), "b.w": TensorInfo("b.w", "F32", (2,))}
    binding = M.Drop("a[0].w").bind(odd)
    assert list(binding.outputs) == ["a0.w", "b.w"]  # the present name wins, as before globs
    [warning] = binding.problems
    assert warning.severity == "warning" and warning.tensor == "a[0].w" and binding.ok
    assert "takes that one tensor, not the 1 other name(s) the glob matches (e.g. 'a0.w')" in warning.message
    assert not M.Drop(escape_name("a[0].w")).bind(odd).problems  # escaped: no glob, nothing to say
    assert not M.Drop("b.w").bind(odd).problems  # no glob characters


def escape_name(name: str) -> str:
    from workbench.mapper.patterns import escape

    return escape(name)
