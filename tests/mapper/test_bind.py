"""Binding: template expansion, dependency groups, byte recipes, the rest policy, and every user mistake
reported as a clear Problem (never a traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from workbench import mapper as M
from workbench.catalog import Catalog, TensorInfo
from workbench.errors import MapperError
from workbench.mapper.groups import ByteSlice

QKV = [f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkv"]
FUSED = "model.layers.{i}.self_attn.qkv_proj.weight"


def llama_like(layers: int, *, missing: tuple[str, ...] = ()) -> Catalog:
    """A metadata-only catalog with GQA-shaped q/k/v (BF16) and a norm per layer, laid out in one file."""
    infos, offset = [], 0
    for layer in range(layers):
        for name, shape in (("self_attn.q_proj.weight", (8, 4)), ("self_attn.k_proj.weight", (4, 4)),
                            ("self_attn.v_proj.weight", (4, 4)), ("input_layernorm.weight", (4,))):
            full = f"model.layers.{layer}.{name}"
            if full in missing:
                continue
            info = TensorInfo(full, "BF16", shape, "model.safetensors", offset, offset)
            infos.append(TensorInfo(full, "BF16", shape, "model.safetensors", offset, offset + info.nbytes))
            offset += info.nbytes
    return Catalog.from_infos(infos)


def messages(binding) -> list[str]:
    return [p.message for p in binding.problems]


def test_template_expands_per_layer_with_recipes_and_source_locations():
    catalog = llama_like(3)
    binding = M.Concat(QKV, FUSED).bind(catalog)
    assert binding.ok
    fused = [g for g in binding.groups if g.label == "Concat"]
    assert [g.outputs[0].name for g in fused] == [FUSED.format(i=i) for i in range(3)]
    group = fused[1]
    assert group.outputs[0].shape == (16, 4) and group.outputs[0].dtype == "BF16"
    assert [t.name for t in group.inputs] == [name.format(i=1) for name in QKV]
    assert all(t.file == "model.safetensors" and t.end > t.begin for t in group.inputs)  # locations kept
    q, k, v = (name.format(i=1) for name in QKV)
    assert dict(group.recipe) == {FUSED.format(i=1): (ByteSlice(q, 0, 64), ByteSlice(k, 0, 32), ByteSlice(v, 0, 32))}
    assert group.op == M.Concat([q, k, v], FUSED.format(i=1))  # concrete, template-free
    kept = [g for g in binding.groups if g.label == "keep"]
    assert [g.outputs[0].name for g in kept] == [f"model.layers.{i}.input_layernorm.weight" for i in range(3)]


def test_groups_follow_source_order_and_compose_steps_into_one_group():
    catalog = llama_like(2)
    mapper = M.Sequential(
        M.Rename("model.layers.{i}.self_attn.q_proj.weight", "tmp.{i}.q"),
        M.Concat(["tmp.{i}.q", QKV[1], QKV[2]], FUSED),
        M.Cast(FUSED, "F32"),
    )
    binding = mapper.bind(catalog)
    assert binding.ok
    names = [g.outputs[0].name for g in binding.groups]
    assert names == [FUSED.format(i=0), "model.layers.0.input_layernorm.weight", FUSED.format(i=1), "model.layers.1.input_layernorm.weight"]
    group = binding.groups[0]
    assert len(group.inputs) == 3 and group.label == "Rename+Concat+Cast"
    assert isinstance(group.op, M.Sequential) and not group.op.is_template
    assert group.recipe is None and group.outputs[0].dtype == "F32"
    tensors = {t.name: torch.randn(t.shape).to(torch.bfloat16) for t in group.inputs}
    out = group.apply(tensors)
    expected = torch.cat([tensors[t.name] for t in group.inputs]).float()
    assert list(out) == [FUSED.format(i=0)] and torch.equal(out[FUSED.format(i=0)], expected)


def test_rest_policies():
    catalog = llama_like(1)
    mapper = M.Concat(QKV, FUSED)
    kept = mapper.bind(catalog, rest="keep")
    assert [g.outputs[0].name for g in kept.groups] == [FUSED.format(i=0), "model.layers.0.input_layernorm.weight"]
    assert kept.groups[1].recipe == {"model.layers.0.input_layernorm.weight": (ByteSlice("model.layers.0.input_layernorm.weight", 0, 8),)}
    dropped = mapper.bind(catalog, rest="drop")
    assert dropped.ok and dropped.dropped == ["model.layers.0.input_layernorm.weight"] and len(dropped.groups) == 1
    strict = mapper.bind(catalog, rest="error")
    assert not strict.ok
    assert strict.problems[0].message == (
        "Cannot leave 'model.layers.0.input_layernorm.weight' unmapped: no operation mentions it and rest='error'. "
        "Map it, M.Drop('model.layers.0.input_layernorm.weight') it, or bind with rest='keep' or rest='drop'."
    )
    assert strict.problems[0].tensor == "model.layers.0.input_layernorm.weight"
    assert M.Parallel(mapper, M.Identity("model.layers.{i}.input_layernorm.weight")).bind(catalog, rest="error").ok
    with pytest.raises(MapperError, match="rest='sometimes'"):
        mapper.bind(catalog, rest="sometimes")


# -- every mistake of the issue, with its message -------------------------------------------------------
def test_template_matching_nothing_is_reported_with_closest_name():
    binding = M.Concat([QKV[0], QKV[1], "model.layers.{i}.self_attn.v_prj.weight"], FUSED).bind(llama_like(2))
    assert not binding.ok and len(binding.errors) == 1
    problem = binding.errors[0]
    assert problem.message.startswith(
        "Cannot bind Concat(['model.layers.{i}.self_attn.q_proj.weight', 'model.layers.{i}.self_attn.k_proj.weight', "
    )
    assert "template 'model.layers.{i}.self_attn.v_prj.weight' matches no tensor (8 available)." in problem.message
    assert "The closest name is 'model.layers.0.self_attn.v_proj.weight'." in problem.message
    assert problem.tensor == "model.layers.{i}.self_attn.v_prj.weight" and problem.op.startswith("Concat(")
    with pytest.raises(MapperError, match="matches no tensor"):
        binding.raise_for_problems()


def test_partial_match_names_the_incomplete_layer():
    catalog = llama_like(8, missing=("model.layers.7.self_attn.v_proj.weight",))
    binding = M.Concat(QKV, FUSED).bind(catalog)
    assert len(binding.errors) == 1
    problem = binding.errors[0]
    assert "'model.layers.7.self_attn.v_proj.weight' is missing, although 'model.layers.7.self_attn.q_proj.weight' matches ({i}=7)" in problem.message
    assert problem.message.endswith("Add the missing tensor, or limit the template to the matches that are complete (e.g. list them).")
    assert problem.tensor == "model.layers.7.self_attn.v_proj.weight"
    # Layers 0-6 still bind; layer 7's q and k are neither grouped nor passed through silently.
    fused = [g.outputs[0].name for g in binding.groups if g.label == "Concat"]
    assert fused == [FUSED.format(i=i) for i in range(7)]
    assert "model.layers.7.self_attn.q_proj.weight" not in binding.outputs


def test_two_operations_writing_one_name():
    tensors = {"a": torch.ones(2), "b": torch.ones(2)}
    binding = M.Parallel(M.Rename("a", "c"), M.Rename("b", "c")).bind(tensors)
    assert messages(binding) == ["Cannot write 'c': both Rename('a', 'c') and Rename('b', 'c') produce it. Give the outputs different names."]
    assert binding.groups == []


def test_output_colliding_with_a_passed_through_tensor():
    binding = M.Rename("a", "b").bind({"a": torch.ones(2), "b": torch.ones(2)})
    assert messages(binding) == [
        "Cannot write 'b': Rename('a', 'b') produces it, but a tensor of that name is already there and nothing "
        "consumes it. Drop or rename that tensor first (M.Drop('b')), or pick another output name."
    ]


def test_one_input_consumed_twice():
    binding = M.Parallel(M.Rename("a", "b"), M.Cast("a", "bf16", dst="c")).bind({"a": torch.ones(2)})
    assert messages(binding) == [
        "Cannot read 'a' twice: both Rename('a', 'b') and Cast('a', 'BF16', dst='c') consume it in the same step. "
        "Each tensor feeds one operation per step; chain the operations in a Sequential, or remove one."
    ]
    assert binding.problems[0].tensor == "a"


def test_input_missing_from_the_source():
    binding = M.Rename("model.norm.weigth", "norm.weight").bind({"model.norm.weight": torch.ones(2)})
    assert messages(binding) == [
        "Cannot bind Rename('model.norm.weigth', 'norm.weight'): input 'model.norm.weigth' is not in the source. "
        "The closest name is 'model.norm.weight'. Check the name against the source's tensors (or the step that should produce it)."
    ]


def test_shape_and_dtype_conflicts_are_problems_not_exceptions():
    catalog = Catalog.from_infos([TensorInfo("a", "F32", (2, 3)), TensorInfo("b", "F32", (3, 3)), TensorInfo("c", "BF16", (5,))])
    binding = M.Parallel(M.Concat(["a", "b"], "ab", dim=1), M.Split("c", ["c0", "c1"], sizes=[2, 2])).bind(catalog)
    assert messages(binding) == [
        "Cannot apply Concat(['a', 'b'], 'ab', dim=1): shapes differ outside dim 1 ('a' is [2, 3], 'b' is [3, 3]). "
        "Concatenate tensors whose other dims match, or concatenate along another dim.",
        "Cannot apply Split('c', ['c0', 'c1'], sizes=[2, 2]): sizes [2, 2] sum to 4, but dim 0 of 'c' has 5 entries [5]. "
        "Give sizes that sum to 5.",
    ]
    assert [p.tensor for p in binding.problems] == ["ab", "c0"]
    assert binding.groups == [] and binding.dropped == []


def test_failures_do_not_cascade_into_later_steps():
    mapper = M.Sequential(M.Concat(["a", "b"], "ab", dim=1), M.Reshape("ab", [-1]), M.Rename("ab", "out"))
    binding = mapper.bind({"a": torch.ones(2, 3), "b": torch.ones(3, 3)})
    assert len(binding.problems) == 1 and "shapes differ" in binding.problems[0].message


# -- composition semantics ------------------------------------------------------------------------------
def test_parallel_renames_can_swap_names():
    tensors = {"a": torch.zeros(1), "b": torch.ones(1)}
    mapper = M.Parallel(M.Rename("a", "b"), M.Rename("b", "a"))
    out = mapper.apply(tensors)
    assert torch.equal(out["a"], tensors["b"]) and torch.equal(out["b"], tensors["a"])
    binding = mapper.bind(tensors)
    assert binding.ok and {g.outputs[0].name: g.recipe[g.outputs[0].name][0].source for g in binding.groups} == {"b": "a", "a": "b"}


def test_prefix_scope_strips_and_adds_and_inverts():
    tensors = {"_orig_mod.model.w": torch.ones(2), "_orig_mod.model.b": torch.zeros(2)}
    mapper = M.PrefixScope(M.Rename("model.w", "model.weight"), "_orig_mod.", "")
    out = mapper.apply(tensors)
    assert sorted(out) == ["model.b", "model.weight"]
    binding = mapper.bind(tensors)
    assert sorted(binding.outputs) == ["model.b", "model.weight"] and binding.ok
    assert all(g.recipe is not None for g in binding.groups)
    back = mapper.inverse(tensors).apply(out)
    assert sorted(back) == sorted(tensors)
    clash = {"model.a": torch.ones(1), "b": torch.ones(1)}
    with pytest.raises(MapperError, match="lies outside the scope"):
        M.PrefixScope(M.Sequential(), "model.", "").inverse(clash)


def test_function_without_infer_runs_on_meta_tensors_and_checks_results():
    mapper = M.Function(fn="torch:neg", inputs=["layers.{i}.w"], outputs=["layers.{i}.neg"])
    tensors = {"layers.0.w": torch.ones(2, 3), "layers.1.w": torch.ones(4)}
    binding = mapper.bind(tensors)
    assert binding.ok and [(t.name, t.shape) for t in binding.outputs.values()] == [("layers.0.neg", (2, 3)), ("layers.1.neg", (4,))]
    assert torch.equal(mapper.apply(tensors)["layers.1.neg"], -torch.ones(4))
    lying = M.Function(fn="torch:neg", inputs=["x"], outputs=["y"], infer="tests.mapper.test_bind:infer_wrong_shape")
    with pytest.raises(MapperError, match=r"Cannot apply Function\(fn='torch:neg'.*output 'y' came out as F32 \[3\], but its inference declared F32 \[4\]"):
        lying.apply({"x": torch.ones(3)})
    broken = M.Function(fn="no_such_module_here:f", inputs=["x"], outputs=["y"])
    assert "module 'no_such_module_here' does not import" in broken.bind({"x": torch.ones(1)}).problems[0].message


def infer_wrong_shape(x, **params):
    return [(x.dtype, (4,))]


def test_bind_accepts_checkpoint_like_objects_and_rejects_others():
    class Checkpoint:
        catalog = llama_like(1)

    assert M.Concat(QKV, FUSED).bind(Checkpoint()).ok
    with pytest.raises(MapperError, match="expected a Catalog"):
        M.Concat(QKV, FUSED).bind(42)


# -- scale ----------------------------------------------------------------------------------------------
def test_large_catalog_binds_correctly():
    layers = 5000  # 20k tensors: the size at which a peer library needed minutes
    catalog = llama_like(layers)
    binding = M.Concat(QKV, FUSED).bind(catalog)
    assert binding.ok and len(binding.groups) == 2 * layers
    fused = binding.groups[2 * 4321]
    q, k, v = (name.format(i=4321) for name in QKV)
    assert fused.outputs[0].name == FUSED.format(i=4321)
    assert fused.recipe[FUSED.format(i=4321)] == (ByteSlice(q, 0, 64), ByteSlice(k, 0, 32), ByteSlice(v, 0, 32))
    assert sum(g.bytes_out for g in binding.groups) == catalog.total_bytes


SEED_SCRIPT = """
import json
from workbench import mapper as M
from workbench.catalog import Catalog, TensorInfo
kinds = ['q_proj', 'k_proj', 'v_proj', 'input_layernorm']
infos = [TensorInfo(f'model.layers.{i}.{k}.weight', 'F32', (4, 4)) for i in range(6) for k in kinds]
m = M.Parallel(M.Concat([f'model.layers.{{i}}.{k}.weight' for k in kinds[:3]], 'qkv.{i}'),
               M.Rename('model.layers.{i}.input_layernorm.weight', 'norm.{i}'))
b = m.bind(Catalog.from_infos(infos))
print(json.dumps([[g.label, [t.name for t in g.inputs], [t.name for t in g.outputs]] for g in b.groups]))
"""


def test_group_order_does_not_depend_on_hash_seed():
    runs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        runs.append(json.loads(subprocess.run([sys.executable, "-c", SEED_SCRIPT], env=env, capture_output=True, text=True, check=True).stdout))
    assert runs[0] == runs[1] and len(runs[0]) == 12


@pytest.mark.parametrize("rest", ["keep", "drop", "error"])
@pytest.mark.parametrize(("mapper", "clash"), [
    (M.presets.strip_prefix("model."), False),
    (M.presets.add_prefix("base."), False),
    (M.PrefixScope(M.Parallel(), source_prefix="model.layers.", target_prefix="blocks."), False),
    (M.presets.strip_prefix("model."), True),  # 'model.norm.weight' -> 'norm.weight', already there: the walk reports it
])
def test_a_bare_prefix_rename_binds_as_the_walk_does(mapper, clash: bool, rest: str) -> None:
    from workbench.mapper.bind import bind, run_binder, source_infos
    from workbench.mapper.grouping import rename_binding

    infos = list(llama_like(2).tensors.values())
    end = infos[-1].end
    extra = [TensorInfo("lm_head.weight", "F32", (3, 4), "model.safetensors", end, end + 48),
             TensorInfo("model.empty", "F32", (0,), "model.safetensors", end + 48, end + 48)]
    if clash:
        extra += [TensorInfo("model.norm.weight", "F32", (2,), "model.safetensors", end + 48, end + 56),
                  TensorInfo("norm.weight", "F32", (2,), "model.safetensors", end + 56, end + 64)]
    catalog = Catalog.from_infos(infos + extra)
    fast, walked = bind(mapper, catalog, rest), run_binder(mapper, catalog, rest)[0]
    assert [(g.inputs, g.outputs, dict(g.recipe or {}), g.chunk_cast, g.label, repr(g.op)) for g in fast.groups] == \
           [(g.inputs, g.outputs, dict(g.recipe or {}), g.chunk_cast, g.label, repr(g.op)) for g in walked.groups]
    assert fast.problems == walked.problems and fast.dropped == walked.dropped
    untouched = any(not i.name.startswith(mapper.source_prefix) for i in catalog.tensors.values())
    assert bool(fast.problems) == (clash or (rest == "error" and untouched))
    assert (rename_binding(mapper, source_infos(catalog), rest) is None) == (clash or rest == "error")  # the walk only then
    renamed = [g for g in fast.groups if g.label != "keep"]
    assert renamed and len({id(g.op) for g in renamed}) == 1  # one op shared by every renamed group


_QKV_CLAIM = M.Claim("q/k/v", r"model\.layers\.[^.]+\.self_attn\..*")
_Q = "model.layers.{i}.self_attn.q_proj.weight"
_PARALLEL_CASES = {  # name -> (mapper, extra source tensors, bound without the walk)
    "fused": (M.Sequential(M.Parallel(M.Concat(QKV, FUSED)), _QKV_CLAIM), (), True),
    "claimed": (M.Sequential(M.Parallel(M.Concat(QKV, FUSED)), _QKV_CLAIM), ("model.layers.0.self_attn.q_proj.bias",), True),
    "split_and_rename": (M.Parallel(M.Split(_Q, ["model.layers.{i}.q_a", "model.layers.{i}.q_b"]),
                                    M.Rename("model.layers.{i}.input_layernorm.weight", "norm.{i}")), (), True),
    "in_place": (M.Parallel(M.Concat(QKV, _Q)), (), True),  # writes the name of an input it reads
    "cast": (M.Sequential(M.Parallel(M.Cast(_Q, "F32"), M.Concat(QKV[1:], "model.layers.{i}.kv")), _QKV_CLAIM), (), True),
    "partial": (M.Parallel(M.Concat(QKV, FUSED)), ("model.layers.1.self_attn.v_proj.weight",), False),
    "read_twice": (M.Parallel(M.Concat(QKV, FUSED), M.Cast(QKV[1], "F32")), (), False),
    "lands_on_kept": (M.Parallel(M.Rename(_Q, "model.layers.{i}.input_layernorm.weight")), (), False),
    "two_write_one": (M.Parallel(M.Rename(QKV[0], "x.{i}"), M.Rename(QKV[1], "x.{i}")), (), False),
    "no_match": (M.Parallel(M.Concat(QKV, FUSED), M.Rename("nothing.{i}", "x.{i}")), (), False),
    "part_of_a_segment": (M.Parallel(M.Rename("model.layers.{i}.self_attn.{p}_proj.weight", "x.{i}.{p}")), (), False),
    "infer_error": (M.Parallel(M.Concat(QKV, FUSED, dim=1)), (), False),  # q is 8 rows, k 4: not joinable along dim 1
    "claim_first": (M.Sequential(_QKV_CLAIM, M.Parallel(M.Concat(QKV, FUSED))), (), False),
}


@pytest.mark.parametrize("rest", ["keep", "drop", "error"])
@pytest.mark.parametrize("case", sorted(_PARALLEL_CASES))
def test_a_parallel_of_templates_binds_as_the_walk_does(case: str, rest: str) -> None:
    """`parallel_binding` (hf_to_fused's shape, without the walk) gives the walk's groups, problems and drops."""
    from workbench.mapper.bind import bind, run_binder, source_infos
    from workbench.mapper.parallel_binding import parallel_binding

    mapper, extra, fast_path = _PARALLEL_CASES[case]
    catalog = llama_like(3, missing=extra if case == "partial" else ())
    if case != "partial":
        infos = list(catalog.tensors.values())
        catalog = Catalog.from_infos(infos + [TensorInfo(name, "BF16", (8,), "model.safetensors", 0, 16) for name in extra])
    fast, walked = bind(mapper, catalog, rest), run_binder(mapper, catalog, rest)[0]
    assert [(g.inputs, g.outputs, dict(g.recipe or {}), g.chunk_cast, g.label, repr(g.op)) for g in fast.groups] == \
           [(g.inputs, g.outputs, dict(g.recipe or {}), g.chunk_cast, g.label, repr(g.op)) for g in walked.groups]
    assert fast.problems == walked.problems and fast.dropped == walked.dropped
    assert (parallel_binding(mapper, source_infos(catalog), rest) is not None) == (fast_path and rest != "error")
    reported = {"claimed", "partial", "read_twice", "lands_on_kept", "two_write_one", "no_match", "infer_error", "claim_first"}
    assert bool(walked.problems) == (case in reported or rest == "error")


def test_no_public_mapper_name_is_also_a_submodule_name() -> None:
    """Importing such a submodule (e.g. through another lazily resolved name) would turn `M.<name>` into a module."""
    import pkgutil

    import workbench.mapper as package

    submodules = {m.name for m in pkgutil.iter_modules(package.__path__)}
    assert not (set(package.__all__) - {"presets"}) & submodules
    package.check_module  # resolving a neighbour first must leave the function in place  # noqa: B018
    assert callable(package.from_module) and not hasattr(package.from_module, "__path__")


@pytest.mark.parametrize("case", ["plain", "partial", "renamed_first", "read_twice", "stepwise"])
def test_joined_templates_bind_as_the_general_expansion_does(case: str, monkeypatch) -> None:
    """Several whole-segment templates (q/k/v -> qkv) take a fused path; it must equal `expand` + `instance`."""
    from workbench.mapper.bind import Binder, bind, bind_steps

    catalog = llama_like(3, missing=("model.layers.1.self_attn.v_proj.weight",) if case == "partial" else ())
    concat = M.Concat(QKV, FUSED)
    mapper = {
        "renamed_first": M.Sequential(M.Rename("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight.x"),
                                      M.Rename("model.layers.0.self_attn.q_proj.weight.x", "model.layers.0.self_attn.q_proj.weight"),
                                      concat),
        "read_twice": M.Parallel(concat, M.Cast("model.layers.{i}.self_attn.k_proj.weight", "F32")),
    }.get(case, concat)

    def outcome():
        if case == "stepwise":
            steps = bind_steps([M.Rename("model.layers.2.input_layernorm.weight", "norm2"), concat], catalog)
            binding, extra = steps.binding, [[repr(op) for op in ops] for ops in steps.instances]
        else:
            binding, extra = bind(mapper, catalog), None
        groups = [(g.inputs, g.outputs, dict(g.recipe or {}), g.chunk_cast, g.label, repr(g.op)) for g in binding.groups]
        return groups, binding.problems, binding.dropped, extra

    general_instances = []
    instance = Binder.instance
    monkeypatch.setattr(Binder, "instance", lambda self, op, *a, **k: general_instances.append(op) or instance(self, op, *a, **k))
    fast = outcome()
    if case == "plain":  # only the first layer goes the general way (its metadata is not inferred yet)
        assert len(general_instances) == 1
    calls = []
    monkeypatch.setattr(Binder, "_expand_joined", lambda self, *args: calls.append(1) or False)
    general = outcome()
    assert calls  # the fused path was on offer, and turned down the second time
    assert fast == general
    assert bool(fast[1]) == (case in ("partial", "read_twice"))


@pytest.mark.parametrize("case", ["fused", "cast", "split_and_rename"])
def test_shared_recipes_spell_and_count_as_their_byte_slices(case: str) -> None:
    """A fused group's recipe text (fingerprint), bytes per input (schedule) and renamed copies (later instances of a
    leaf) come from what its shared recipe keeps once per shape: each must equal the same from its ByteSlices."""
    from workbench.mapper.bind import bind
    from workbench.mapper.recipes import LazyRecipe
    from workbench.planning.fingerprint import _recipe_text
    from workbench.planning.schedule import COPY, SourceAccess, build_steps, step_cost

    mapper = _PARALLEL_CASES[case][0]
    binding = bind(mapper, llama_like(3), "keep")
    shared = [g for g in binding.groups if type(g.recipe) is LazyRecipe]
    assert len(shared) >= 3
    for group in shared:
        plain = dict(group.recipe)  # output -> ByteSlices
        assert _recipe_text(group.recipe) == _recipe_text(plain) == ";".join(
            f"{out}=" + ",".join(f"{p.source}[{p.begin}:{p.end}]" for p in pieces) for out, pieces in plain.items())
        totals: dict[str, int] = {}
        for pieces in plain.values():
            for p in pieces:
                totals[p.source] = totals.get(p.source, 0) + p.end - p.begin
        assert group.recipe.input_bytes() == list(totals.items())
        (step,) = build_steps([group], SourceAccess(None), 1 << 20)
        assert step.reads == step_cost(group, COPY, step.bytes_out, SourceAccess(None), 1 << 20)[1]
        names = [t.name for t in group.inputs] + [t.name for t in group.outputs]
        renamed = group.recipe.renamed([f"x.{name}" for name in group.recipe._names])
        assert {k[2:]: [(p.source[2:], p.begin, p.end) for p in v] for k, v in renamed.items()} == \
               {k: [(p.source, p.begin, p.end) for p in v] for k, v in plain.items()} and set(names) >= set(group.recipe._names)
