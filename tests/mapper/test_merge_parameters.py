"""Merge parameters in mergekit's forms (workbench.mapper.merge.parameters): scalars, gradients over the layers
(t = i / (n - 1), embeddings / final norm / lm_head at t = 0), filtered lists with a default, and precedence
(a model's own parameters before the global ones, then the method's default)."""

from __future__ import annotations

import pytest

from workbench import mapper as M
from workbench.errors import MapperError
from workbench.mapper.merge.parameters import check, layer_of, resolve


def test_scalars_gradients_and_filters_resolve_as_mergekit_does() -> None:
    assert resolve(0.3, "model.layers.1.mlp.up_proj.weight", 1, 4) == 0.3
    # 5 layers over [0, 1]: layer 1 sits at t = 0.25, i.e. 0.25 of the way between the values
    assert resolve([0, 1], "model.layers.1.self_attn.q_proj.weight", 1, 5) == 0.25
    # three values, t = 0.75 -> 3/4 of the way from 0.5 to 1 on the second stretch: (1 - 0.5)·0.5 + 0.5·1
    assert resolve([0, 0.5, 1], "x", 3, 5) == (1 - 0.5) * 0.5 + 0.5 * 1
    assert resolve([0.2, 0.8], "model.embed_tokens.weight", None, 5) == 0.2  # outside the layers: t = 0
    assert resolve([0.2, 0.8], "model.layers.0.w", 0, 1) == 0.8  # a single layer sits at t = 1
    filtered = [{"filter": "self_attn", "value": [0, 1]}, {"filter": "mlp", "value": 0.7}, {"value": 0.1}]
    assert resolve(filtered, "model.layers.2.self_attn.o_proj.weight", 2, 3) == 1.0
    assert resolve(filtered, "model.layers.2.mlp.up_proj.weight", 2, 3) == 0.7
    assert resolve(filtered, "model.norm.weight", None, 3) == 0.1
    assert resolve([{"filter": "mlp", "value": 1}], "model.norm.weight") is None  # unset: the next source applies
    assert resolve([True, False], "x", 1, 2) is False  # non-numbers pick, never interpolate


def test_layer_index_comes_from_the_name() -> None:
    assert layer_of("model.layers.12.mlp.up_proj.weight") == 12
    assert layer_of("b::model.layers.3.input_layernorm.weight") == 3
    assert layer_of("transformer.h.7.attn.c_attn.weight") == 7
    assert layer_of("lm_head.weight") is None


def test_malformed_values_and_unknown_keys_are_refused_with_the_key() -> None:
    with pytest.raises(MapperError, match="'t'"):
        check({"filter": "mlp"}, "t")
    with pytest.raises(MapperError, match="'weight'"):
        M.presets.merge("linear", ["a", "b"], parameters={"weight": [{"value": {"x": 1}}]})
    with pytest.raises(MapperError, match="unknown. Known methods"):
        M.presets.merge("frankenmerge", ["a", "b"])


def test_model_parameters_come_before_the_global_ones_and_defaults_fill_the_rest() -> None:
    names = {"model.layers.0.w": ("F32", (2,)), "model.layers.1.w": ("F32", (2,)), "model.norm.weight": ("F32", (2,))}
    source = {**names, **{f"b::{n}": meta for n, meta in names.items()}, **{f"c::{n}": meta for n, meta in names.items()}}
    mapper = M.presets.merge("ties", ["b", "c"], base_model="a",
                             parameters={"weight": 0.5, "density": [{"filter": "norm", "value": 1.0}, {"value": [0.2, 0.6]}]},
                             model_parameters={"c": {"weight": [1, 2]}})
    from workbench.catalog import TensorInfo

    binding = mapper.bind({n: TensorInfo(n, d, s) for n, (d, s) in source.items()})
    assert not binding.problems, binding.problems
    ops = {group.outputs[0].name: group.op for group in binding.groups}
    layer1 = ops["model.layers.1.w"]
    assert layer1.models == ("b", "c", "a")  # the base merged last when the models omit it (mergekit's order)
    params = layer1.bound_parameters()
    assert params["weight"] == {"b": 0.5, "c": 2.0} and params["density"] == {"b": 0.6, "c": 0.6}
    assert params["normalize"] is True and params["lambda"] == 1.0  # defaults of ties
    assert ops["model.norm.weight"].bound_parameters()["density"] == {"b": 1.0, "c": 1.0}
    assert ops["model.layers.0.w"].bound_parameters()["weight"]["c"] == 1.0
