"""The MapperBuilder's Merge form, driven like a user: choose Merge, the models, a method, type parameters, read the
per-layer table and the message, add the step, export it, edit it again."""

from __future__ import annotations

import html

import pytest

import workbench as wb
from workbench import mapper as M
from workbench.mapper.merge.methods import METHODS
from workbench.widgets import MapperBuilder
from workbench.widgets.merge_form import OUTSIDE, FormError, MergeForm, parse_setting, setting_text


@pytest.fixture
def sources(llama_sample):
    """Three 'fine-tunes' (the sample three times: the form reads names and shapes only)."""
    return {"ft1": llama_sample, "ft2": llama_sample, "ft3": llama_sample}


@pytest.fixture
def builder(sources):
    builder = MapperBuilder(sources)
    builder.op_picker.value = "Merge"
    return builder


def message(builder: MapperBuilder) -> str:
    return html.unescape(builder.merge_form.message.value)


def test_every_method_of_the_code_is_offered_with_its_parameters(builder):
    form = builder.merge_form
    assert list(form.method_picker.options) == list(METHODS) and len(METHODS) == 17
    for name, spec in METHODS.items():
        form.method_picker.value = name
        assert list(form.parameter_boxes) == [p.name for p in spec.parameters]
        assert form.method_info.value.count(name) >= 1
        assert (form.base_picker.layout.display != "none") == (spec.base != "ignored")
        assert (form.seed_box.layout.display != "none") == spec.random
    assert builder.merge_form.box.layout.display != "none"
    assert builder.sources_box.layout.display == "none"  # model names, not tensor names, are picked
    builder.op_picker.value = "Concat"
    assert builder.merge_form.box.layout.display == "none" and builder.sources_box.layout.display != "none"


def test_slerp_gradient_table_follows_the_edits_and_the_step_exports(builder, sources, tmp_path):
    form = builder.merge_form
    assert form.models_picker.options == ("ft1", "ft2", "ft3")
    form.models_picker.value = ("ft1", "ft2")
    form.method_picker.value = "slerp"
    assert form.base_picker.value == "ft1"  # slerp needs a base: the first source is proposed
    assert "t is required and not set for 39 tensor(s)" in message(builder)
    form.parameter_boxes["t"].value = "0, 0.5, 1"
    assert "39 tensors merged" in message(builder)
    table = form.frame
    assert list(table.index) == [OUTSIDE, "0", "1", "2", "3"] and list(table.columns) == ["t"]
    assert [round(v, 6) for v in table["t"]] == [0.0, 0.0, 0.333333, 0.666667, 1.0]  # mergekit: t = i / (n - 1)
    assert "0.3333" in form.table.value and "outside layers" in form.table.value

    form.parameter_boxes["t"].value = "self_attn: 0, 1; mlp: 1, 0; 0.5"  # live: the table follows each edit
    table = form.frame
    assert list(table.columns) == ["t · self_attn", "t · mlp", "t · rest"]
    assert table.loc["1", "t · self_attn"] == pytest.approx(1 / 3) and table.loc["1", "t · mlp"] == pytest.approx(2 / 3)
    assert table.loc["3", "t · rest"] == 0.5 and table.loc[OUTSIDE, "t · rest"] == 0.5
    assert table.loc[OUTSIDE, "t · self_attn"] is None

    builder.add_button.click()
    assert "Added step 1: merge ft1 + ft2 by slerp (base ft1) → 39 tensors" in builder.form_message.value
    expected = M.presets.merge("slerp", ["ft1", "ft2"], base_model="ft1", parameters={
        "t": [{"filter": "self_attn", "value": [0, 1]}, {"filter": "mlp", "value": [1, 0]}, {"value": 0.5}]})
    assert builder.mapper == M.Sequential(expected)
    assert "M.MergeModels(" in builder.code() and "'filter': 'self_attn'" in builder.code()
    assert builder.binding.ok and len(builder.binding.outputs) == 39
    namespace: dict = {}
    exec(builder.code(), namespace)
    assert namespace["mapper"] == builder.mapper
    plan = wb.plan(wb.open_checkpoint(sources), namespace["mapper"])
    assert plan.ok and len(plan.outputs) == 39


def test_per_model_parameters_and_a_base_outside_the_models(builder):
    form = builder.merge_form
    form.method_picker.value = "ties"
    form.models_picker.value = ("ft2", "ft3")
    form.base_picker.value = "ft1"
    form.parameter_boxes["weight"].value = "@ft2: 0.7; @ft3 mlp: 0, 1; @ft3: 0.3"
    form.parameter_boxes["density"].value = "0.5"
    assert "39 tensors merged" in message(builder), message(builder)
    table = form.frame
    assert list(table.columns) == ["weight[ft2]", "weight[ft3] · mlp", "weight[ft3] · rest", "density"]
    assert table.loc["0", "weight[ft3] · mlp"] == 0 and table.loc["3", "weight[ft3] · mlp"] == 1
    assert table.loc["2", "weight[ft2]"] == 0.7 and table.loc[OUTSIDE, "weight[ft3] · rest"] == 0.3
    step = form.build()
    assert step == M.presets.merge("ties", ["ft2", "ft3"], base_model="ft1", parameters={"density": 0.5}, model_parameters={
        "ft2": {"weight": 0.7}, "ft3": {"weight": [{"filter": "mlp", "value": [0, 1]}, {"value": 0.3}]}})
    builder.add_button.click()
    builder.op_picker.value = "Concat"
    builder.edit(0)  # the step comes back into the Merge form
    assert builder.op_picker.value == "Merge" and form.method_picker.value == "ties"
    assert form.parameter_boxes["weight"].value == "@ft2: 0.7; @ft3 mlp: 0, 1; @ft3: 0.3"
    assert form.build() == step


@pytest.mark.parametrize(("field", "text", "said"), [
    ("method", "slurp", "Cannot merge by 'slurp': unknown method. Choose one of linear, passthrough"),
    ("t", "0, half, 1", "Cannot read t 'half': it is not a number"),
    ("t", "0, , 1", "a value is missing"),
    ("t", "0, true, 1", "Cannot use t = True: t is a float"),
    ("t", "mlp: 0, 1; mlp: 1", "filter 'mlp' is given twice"),
    ("t", "@ft1: 0.5", "t is one value for the whole merge"),
    ("base", "", "it needs a base model. Choose one in Base"),
    ("models", (), "no models chosen"),
])
def test_mistakes_are_messages_never_exceptions(builder, field, text, said):
    form = builder.merge_form
    form.method_picker.value = "slerp"
    form.models_picker.value = ("ft1", "ft2")
    form.parameter_boxes["t"].value = "0.5"
    assert form.frame is not None and not form.frame.empty
    control = {"method": form.method_picker, "base": form.base_picker, "models": form.models_picker}.get(field) \
        or form.parameter_boxes[field]
    control.value = text
    assert said in message(builder)
    assert "wb-error" in form.message.value and form.table.value == ""
    steps = len(builder.steps)
    builder.add_button.click()  # the form's mistake again, said in the builder's message; nothing is added
    assert len(builder.steps) == steps and said in html.unescape(builder.form_message.value)


def test_plan_problems_of_the_merge_are_shown(builder):
    form = builder.merge_form
    form.method_picker.value = "model_stock"  # needs at least 3 inputs
    form.models_picker.value = ("ft2",)
    form.base_picker.value = "ft1"
    assert "model_stock merges at least 3 inputs, got 2" in message(builder)
    form.models_picker.value = ("ft1", "ft2", "ft3")
    assert "39 tensors merged" in message(builder)
    assert list(form.frame.columns) == ["filter_wise"] and not form.frame["filter_wise"].any()  # nothing set: the defaults
    form.method_picker.value = "ties"
    form.parameter_boxes["weight"].value = "1"
    assert list(form.frame.columns) == ["weight"]  # what is set or required; the rest is said under the table
    assert "at their default: int8_mask = false, normalize = true, rescale = false, lambda = 1.0, density = 1.0" in form.table.value


def test_a_single_checkpoint_is_told_to_add_another(llama_sample, tmp_path):
    builder = MapperBuilder(llama_sample)
    builder.op_picker.value = "Merge"
    assert "Merging needs several sources" in message(builder)
    builder.add_checkpoint("ft2", str(llama_sample))  # the builder's Add checkpoint: now two sources
    assert builder.merge_form.models_picker.options == ("base", "ft2")  # the first source is called 'base' (add_checkpoint)
    builder.merge_form.method_picker.value = "linear"
    builder.merge_form.parameter_boxes["weight"].value = "1"
    assert "39 tensors merged" in message(builder)


@pytest.mark.parametrize(("text", "shared", "per"), [
    ("0.5", 0.5, {}),
    ("[0, 0.5, 1]", [0, 0.5, 1], {}),
    ("self_attn: 0, 1; 0.5", [{"filter": "self_attn", "value": [0, 1]}, {"value": 0.5}], {}),
    ("0.5; mlp: 1", [{"filter": "mlp", "value": 1}, {"value": 0.5}], {}),  # the default goes last, as mergekit reads it
    ("@a: 0.7; @b: 0.3", None, {"a": 0.7, "b": 0.3}),
    ("1e-3", 0.001, {}),
])
def test_parse_setting_and_back(text, shared, per):
    parameter = METHODS["ties"].parameter("weight")
    assert parse_setting(text, parameter, ["a", "b"]) == (shared, per)
    if shared is not None and not per:
        assert parse_setting(setting_text(shared), parameter, ["a", "b"]) == (shared, per)


def test_parse_setting_refuses_unknown_models():
    with pytest.raises(FormError, match="not among the models"):
        parse_setting("@zz: 1", METHODS["ties"].parameter("weight"), ["a", "b"])


def test_the_form_works_alone(sources):
    checkpoint = wb.open_checkpoint(sources)
    form = MergeForm(lambda: list(checkpoint.catalog.sources), lambda: checkpoint)
    form.method_picker.value = "nearswap"
    form.parameter_boxes["t"].value = "0.001"
    assert form.base_picker.value == "ft1" and "wb-error" in form.message.value  # nearswap takes exactly 2 inputs
    form.models_picker.value = ("ft1", "ft3")
    assert "39 tensors merged" in html.unescape(form.message.value)
    assert set(form.frame["t"]) == {0.001}


def test_dtype_and_out_dtype_map_to_mergekits_keys_and_export(builder, sources):
    """The dtype menus set the merge's accumulation and output dtypes as mergekit's `dtype` / `out_dtype` do: the
    step equals what a config with those keys builds, its exported code rebuilds it, the plan writes out_dtype, and
    loading the step shows them again. The static HTML copy carries the per-layer table."""
    form = builder.merge_form
    form.models_picker.value = ("ft1", "ft2")
    form.method_picker.value = "linear"
    form.parameter_boxes["weight"].value = "@ft1: 0.6; @ft2: 0.4"
    form.dtype_picker.value = "float32"
    form.out_dtype_picker.value = "bfloat16"
    assert "39 tensors merged" in message(builder)
    step = form.build()
    assert step == M.presets.merge("linear", ["ft1", "ft2"], model_parameters={"ft1": {"weight": 0.6}, "ft2": {"weight": 0.4}},
                                   dtype="float32", out_dtype="bfloat16")
    from workbench.mapper.presets.mergekit import config_mapper
    config = {"merge_method": "linear", "dtype": "float32", "out_dtype": "bfloat16",
              "models": [{"model": "a", "parameters": {"weight": 0.6}}, {"model": "b", "parameters": {"weight": 0.4}}]}
    assert config_mapper(config, {"a": "ft1", "b": "ft2"}) == step
    html_copy = builder._repr_html_()
    assert "Values per layer" in html_copy and "weight[ft1]" in html_copy
    builder.add_button.click()
    assert "(dtype F32, out_dtype BF16)" in builder.form_message.value
    html_copy = builder._repr_html_()  # the added step's values, where it runs
    assert "step 1: <b>Values per layer</b>" in html_copy and "weight[ft2]" in html_copy
    namespace: dict = {}
    exec(builder.code(), namespace)
    assert namespace["mapper"] == builder.mapper and "dtype='F32'" in builder.code() and "out_dtype='BF16'" in builder.code()
    plan = wb.plan(wb.open_checkpoint(sources), namespace["mapper"])
    assert plan.ok and set(plan.outputs["dtype"]) == {"BF16"}
    form.dtype_picker.value, form.out_dtype_picker.value = "", ""
    assert form.build().dtype is None and form.build().out_dtype is None
    form.load(step)
    assert (form.dtype_picker.value, form.out_dtype_picker.value) == ("float32", "bfloat16")
