"""`Problem.kind`: every problem says what it is about (one of `PROBLEM_KINDS`), set where it is raised, so
front ends group and fix problems without reading their wording."""

from __future__ import annotations

import ast
import math
import typing
from pathlib import Path

import pytest

from workbench import mapper as M
from workbench.catalog import Catalog, TensorInfo
from workbench.mapper.groups import PROBLEM_KINDS, ProblemKind

PACKAGE = Path(__file__).resolve().parents[2] / "workbench"
Q0, K0, NORM0 = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight", "model.layers.0.input_layernorm.weight"
QKV = [f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkv"]


def catalog(*, missing: tuple[str, ...] = (), experts: bool = False) -> Catalog:
    """Two Llama-like layers (q/k/v and a norm, BF16) in one file; with `experts`, expert 1 lacks its w3."""
    shapes = {"self_attn.q_proj.weight": (8, 4), "self_attn.k_proj.weight": (4, 4), "self_attn.v_proj.weight": (4, 4),
              "input_layernorm.weight": (4,)}
    names = [(f"model.layers.{layer}.{name}", shape) for layer in range(2) for name, shape in shapes.items()]
    if experts:
        names += [("mlp.experts.0.w1.weight", (4, 4)), ("mlp.experts.0.w3.weight", (4, 4)), ("mlp.experts.1.w1.weight", (4, 4))]
    infos, offset = [], 0
    for name, shape in names:
        if name in missing:
            continue
        size = 2 * math.prod(shape)
        infos.append(TensorInfo(name, "BF16", shape, "model.safetensors", offset, offset + size))
        offset += size
    return Catalog.from_infos(infos)


FAILING = {
    "input not in the source": (M.Rename("model.layers.0.nope.weight", "x"), {}, "missing"),
    "template matching nothing": (M.Concat(["model.layers.{i}.nope.weight", "model.layers.{i}.other.weight"], "x.{i}"), {}, "missing"),
    "template instance incomplete": (M.Concat(QKV, "model.layers.{i}.qkv.weight"),
                                     {"missing": ("model.layers.1.self_attn.v_proj.weight",)}, "missing"),
    "range missing a value": (M.Concat(["mlp.experts.{e*}.w1.weight", "mlp.experts.{e*}.w3.weight"], "mlp.w13"),
                              {"experts": True}, "missing"),
    "two outputs of one name": (M.Parallel(M.Rename(Q0, "x"), M.Rename(K0, "x")), {}, "clash"),
    "one input read twice": (M.Parallel(M.Rename(Q0, "a"), M.Rename(Q0, "b")), {}, "clash"),
    "output over a kept tensor": (M.Rename(Q0, NORM0), {}, "overwrite"),
    "shapes that do not concatenate": (M.Concat([Q0, NORM0], "x"), {}, "invalid"),
    "a split that does not divide": (M.Split(NORM0, ["a", "b", "c"]), {}, "invalid"),
    "a preset's unsupported step": (M.Unsupported([Q0], "no workbench equivalent"), {}, "unsupported"),
    "a claim left unconverted": (M.Sequential(M.Rename(Q0, "q"), M.Claim("HF Llama (test)", r"model\..*")), {}, "unconverted"),
    "rest='error' with tensors unmapped": (M.Rename(Q0, "q"), {"rest": "error"}, "unmapped"),
}


@pytest.mark.parametrize("case", FAILING)
def test_every_problem_of_a_failing_binding_has_a_known_kind(case: str) -> None:
    mapper, options, expected = FAILING[case]
    rest = options.get("rest", "keep")
    binding = mapper.bind(catalog(missing=options.get("missing", ()), experts=options.get("experts", False)), rest=rest)
    assert binding.problems, case
    assert {p.kind for p in binding.problems} <= set(PROBLEM_KINDS), [(p.kind, p.message) for p in binding.problems]
    assert expected in {p.kind for p in binding.problems}, [(p.kind, p.message) for p in binding.problems]


def _kinds_given(call: ast.Call) -> list[ast.expr] | None:
    """The expression given as `kind=` (None when the call has no such keyword)."""
    return next(([k.value] for k in call.keywords if k.arg == "kind"), None)


def _constants(node: ast.expr) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_every_place_that_raises_a_problem_names_its_kind() -> None:
    """Statically: each `Problem(...)` and each binder `.problem(...)` call in the package passes `kind=`, and any
    literal it gives is in the vocabulary (a new call site without a kind fails here, not in a front end)."""
    missing, unknown = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name not in ("Problem", "problem"):
                continue
            where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
            given = _kinds_given(node)
            if given is None:
                missing.append(where)
            else:
                unknown += [f"{where} {kind!r}" for kind in _constants(given[0]) - set(PROBLEM_KINDS)]
    assert missing == [] and unknown == []


def test_a_problem_built_by_hand_keeps_its_positional_fields() -> None:
    """`M.Problem(severity, message, op, tensor)` still builds (users make them too); its kind is then empty."""
    problem = M.Problem("warning", "look", "Rename(a -> b)", "a")
    assert (problem.severity, problem.message, problem.op, problem.tensor, problem.kind) == ("warning", "look", "Rename(a -> b)", "a", "")
    assert M.Problem("error", "x", kind="missing").kind == "missing"


def test_the_vocabulary_and_its_type_name_the_same_kinds() -> None:
    assert set(typing.get_args(ProblemKind)) == set(PROBLEM_KINDS) and all(PROBLEM_KINDS.values())
