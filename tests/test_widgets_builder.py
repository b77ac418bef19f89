"""MapperBuilder widget and the mapper graph, driven like a user: pick names, choose an operation,
click, and read the preview, problems, target check, graph and exported code."""

from __future__ import annotations

import pytest

from workbench import mapper as M
from workbench.catalog import TensorInfo
from workbench.mapper import presets
from workbench.widgets import MapperBuilder
from workbench.widgets.builder import compare_to_target, expected_tensors, suggest_output
from workbench.widgets.graph import mapper_graph

QKV = [f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkv"]
GATE_UP = [f"model.layers.{{i}}.mlp.{p}_proj.weight" for p in ("gate", "up")]


def add_concat(builder: MapperBuilder, sources: list[str]) -> None:
    """What a user does: choose Concat, add each source from the suggestions, click Add step."""
    builder.op_picker.value = "Concat"
    for name in sources:
        builder.suggestions.value = name
        builder.add_source_button.click()
    builder.add_button.click()


def add_typed(builder: MapperBuilder, op: str, sources: str, outputs: str, extra: dict) -> None:
    """What a user does: choose `op`, type the sources, the outputs and the `extra` controls, click Add step."""
    builder.op_picker.value = op
    builder.sources_box.value = sources
    builder.outputs_box.value = outputs
    for control, value in extra.items():
        getattr(builder, control).value = value
    builder.add_button.click()


@pytest.fixture
def builder(llama_sample):
    return MapperBuilder(llama_sample)


@pytest.fixture(scope="module")
def meta_llama(llama_sample):
    """The sample's architecture as a transformers model on the meta device (no memory, no weights)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig.from_pretrained(llama_sample)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def test_suggestions_are_folded_templates(builder):
    values = [value for _, value in builder.suggestions.options]
    assert "model.layers.{i}.self_attn.q_proj.weight" in values and "lm_head.weight" in values
    assert len(values) == 12
    labels = dict((value, label) for label, value in builder.suggestions.options)
    assert labels["model.layers.{i}.self_attn.q_proj.weight"].endswith("×4")


def test_building_the_fused_layout_with_the_controls(builder, llama_sample):
    add_concat(builder, QKV)
    assert builder.sources_box.value == ""  # cleared for the next operation
    assert "Added step 1" in builder.form_message.value
    add_concat(builder, GATE_UP)
    assert builder.mapper == M.Sequential(M.Concat(QKV, "model.layers.{i}.self_attn.qkv_proj.weight"),
                                          M.Concat(GATE_UP, "model.layers.{i}.mlp.gate_up_proj.weight"))
    builder.combine_picker.value = "Parallel"
    assert builder.mapper == presets.hf_to_fused(llama_sample).mappers[0]  # the preset adds a Claim after the steps
    preview = builder.preview_frame(folded=False)
    assert preview.loc["model.layers.2.self_attn.qkv_proj.weight", "shape"] == (128, 64)
    assert preview.loc["model.layers.2.mlp.gate_up_proj.weight", "shape"] == (256, 64)
    assert "model.layers.0.self_attn.q_proj.weight" not in preview.index
    assert len(preview) == 39 - 4 * 5 + 4 * 2
    assert "model.layers.{i}.self_attn.qkv_proj.weight" in builder.preview_table.value
    assert "No problems" in builder.problems_view.value
    assert "2 step(s) · 27 output tensors · 0 problem(s)" in builder.header.value
    builder.changed_only.value = True
    assert "model.norm.weight" not in builder.preview_table.value


def test_output_name_is_suggested_from_the_sources(builder):
    builder.op_picker.value = "Concat"
    for name in GATE_UP:
        builder.suggestions.value = name
        builder.add_source_button.click()
    assert builder.outputs_box.value == "model.layers.{i}.mlp.gate_up_proj.weight"
    builder.outputs_box.value = "my.{i}.name"  # the user's own choice is kept
    builder.sources_box.value = "\n".join(QKV)
    assert builder.outputs_box.value == "my.{i}.name"


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (QKV, "model.layers.{i}.self_attn.qkv_proj.weight"),
        (GATE_UP, "model.layers.{i}.mlp.gate_up_proj.weight"),
        (["a.w", "b.w"], "ab.w"),
        (["x.weight", "x.weight2"], ""),
        (["only"], "only"),
    ],
)
def test_suggest_output(names, expected):
    assert suggest_output(names) == expected


@pytest.mark.parametrize(
    ("op", "sources", "outputs", "extra", "message"),
    [
        ("Concat", "", "x", {}, "no source names"),
        ("Split", "lm_head.weight", "a, b", {"sizes_box": "1, two"}, "whole numbers"),
        ("Rename", "lm_head.weight\nmodel.norm.weight", "x", {}, "takes one source"),
        ("Reshape", "lm_head.weight", "", {}, "give the new shape"),
        ("Code", "", "", {"code_box": "M.Nope()"}, "does not evaluate"),
        ("Code", "", "", {"code_box": "42"}, "not a mapper"),
        ("Concat", "lm_head.weight", "bad..name", {}, "empty dotted segment"),
    ],
)
def test_form_mistakes_are_messages_and_add_nothing(builder, op, sources, outputs, extra, message):
    add_typed(builder, op, sources, outputs, extra)
    assert message in builder.form_message.value
    assert "wb-error" in builder.form_message.value
    assert builder.steps == []


def test_every_operation_kind_from_the_form(builder):
    cases = [
        ("Rename", "lm_head.weight", "output.weight", {}, M.Rename("lm_head.weight", "output.weight")),
        ("Split", "model.layers.{i}.mlp.up_proj.weight", "u.{i}.a, u.{i}.b", {"sizes_box": "100, 28"},
         M.Split("model.layers.{i}.mlp.up_proj.weight", ["u.{i}.a", "u.{i}.b"], sizes=[100, 28])),
        ("Transpose", "model.layers.{i}.mlp.down_proj.weight", "", {"dim0_box": 0, "dim1_box": 1},
         M.Transpose("model.layers.{i}.mlp.down_proj.weight")),
        ("Reshape", "model.norm.weight", "norm2d", {"shape_box": "8, -1"}, M.Reshape("model.norm.weight", [8, -1], dst="norm2d")),
        ("Cast", "model.embed_tokens.weight", "", {"dtype_picker": "BF16"}, M.Cast("model.embed_tokens.weight", "BF16")),
        ("Drop", "model.layers.{i}.input_layernorm.weight\nmodel.layers.{i}.post_attention_layernorm.weight", "", {},
         M.Parallel(M.Drop("model.layers.{i}.input_layernorm.weight"), M.Drop("model.layers.{i}.post_attention_layernorm.weight"))),
        ("Code", "", "", {"code_box": "M.Identity('model.layers.0.self_attn.o_proj.weight')"},
         M.Identity("model.layers.0.self_attn.o_proj.weight")),
    ]
    for op, sources, outputs, extra, expected in cases:
        add_typed(builder, op, sources, outputs, extra)
        assert builder.steps[-1] == expected, builder.form_message.value
    assert builder.binding.ok
    outputs = builder.binding.outputs
    assert outputs["u.3.a"].shape == (100, 64) and outputs["norm2d"].shape == (8, 8)
    assert outputs["model.embed_tokens.weight"].dtype == "BF16"
    assert outputs["model.layers.1.mlp.down_proj.weight"].shape == (128, 64)
    assert "model.layers.0.input_layernorm.weight" not in outputs


def test_problems_appear_and_go_away(builder):
    builder.op_picker.value = "Concat"
    builder.sources_box.value = QKV[0] + "\nmodel.layers.{i}.self_attn.x_proj.weight"  # typed, with a typo
    builder.outputs_box.value = "model.layers.{i}.self_attn.qx.weight"
    builder.add_button.click()
    assert len(builder.steps) == 1
    assert "new problem" in builder.form_message.value
    assert "x_proj" in builder.problems_view.value and "matches no tensor" in builder.problems_view.value
    assert "1 problem(s)" in builder.header.value
    builder.steps_list.value = 0
    builder.remove_button.click()
    assert builder.steps == [] and "No problems" in builder.problems_view.value


def test_edit_reorder_and_remove_steps(builder):
    builder.op_picker.value = "Cast"
    builder.sources_box.value = "model.norm.weight"
    builder.add_button.click()
    add_concat(builder, GATE_UP)
    builder.steps_list.value = 0
    builder.edit_button.click()
    assert builder.op_picker.value == "Cast" and builder.sources_box.value == "model.norm.weight"
    assert builder.add_button.description == "Update step 1"
    builder.dtype_picker.value = "F16"
    builder.add_button.click()
    assert builder.steps[0] == M.Cast("model.norm.weight", "F16") and len(builder.steps) == 2
    assert builder.add_button.description == "Add step"
    builder.steps_list.value = 1
    builder.up_button.click()
    assert isinstance(builder.steps[0], M.Concat) and builder.steps_list.value == 0
    builder.down_button.click()
    assert isinstance(builder.steps[1], M.Concat)
    builder.remove(0)
    assert builder.steps == [M.Concat(GATE_UP, "model.layers.{i}.mlp.gate_up_proj.weight")]


def test_composite_steps_are_edited_as_code(builder):
    builder.preset_picker.value = "hf_to_meta"
    builder.load_preset_button.click()
    assert builder.combine_picker.value == "Sequential" and len(builder.steps) == 4  # three stages and the Claim
    assert builder.binding.ok and "tok_embeddings.weight" in builder.binding.outputs
    builder.edit(0)
    assert builder.op_picker.value == "Code" and builder.code_box.value.startswith("M.Parallel(M.Rename(")
    builder.code_box.value = builder.code_box.value.replace("'tok_embeddings.weight'", "'embeddings.weight'")
    builder.add_button.click()
    assert "embeddings.weight" in builder.binding.outputs and "tok_embeddings.weight" not in builder.binding.outputs


def test_presets_need_a_config_when_the_source_has_none(tiny_checkpoint):
    builder = MapperBuilder(tiny_checkpoint(layers=2))
    builder.preset_picker.value = "hf_to_fused"
    builder.load_preset_button.click()
    assert "needs the model" in builder.form_message.value and builder.steps == []
    builder.preset_picker.value = "cast_policy"
    builder.load_preset_button.click()
    assert builder.binding.outputs["model.layers.0.mlp.up_proj.weight"].dtype == "BF16"
    assert builder.binding.outputs["model.norm.weight"].dtype == "F32"
    config = {"num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 8}
    fused = MapperBuilder(tiny_checkpoint(layers=2, name="other"), preset="hf_to_fused", config=config)
    assert fused.binding.outputs["model.layers.1.self_attn.qkv_proj.weight"].shape == (16, 8)


def test_start_from_a_mapper(llama_sample):
    start = M.Parallel(M.Rename("lm_head.weight", "output.weight"), M.Drop("model.norm.weight"))
    builder = MapperBuilder(llama_sample, mapper=start)
    assert builder.combine_picker.value == "Parallel" and builder.mapper == start
    assert "output.weight" in builder.preview_table.value


def test_target_check_against_a_meta_device_model(llama_sample, meta_llama):
    builder = MapperBuilder(llama_sample, target=meta_llama)
    assert "Matches the target (39 tensors)" in builder.target_view.value
    assert builder.target_report().empty
    builder.load_preset("hf_to_fused")
    report = builder.target_report()
    statuses = report["status"].value_counts()
    assert statuses["missing"] == 4 * 5 and statuses["unexpected"] == 4 * 2
    assert report.loc["model.layers.0.self_attn.qkv_proj.weight", "status"] == "unexpected"
    assert "Does not match the target: 20 missing, 8 unexpected" in builder.target_view.value
    # A target with the fused names: the preset applied to the model's own (meta) state.
    fused_target = presets.hf_to_fused(llama_sample).bind(meta_llama.state_dict())
    builder.set_target(fused_target)
    assert builder.target_report().empty and "Matches the target (27 tensors)" in builder.target_view.value


def test_target_check_reports_shape_and_dtype_differences(builder, llama_sample):
    expected = dict(expected_tensors(llama_sample))
    expected["lm_head.weight"] = TensorInfo("lm_head.weight", "F32", (255, 64))
    expected["model.norm.weight"] = TensorInfo("model.norm.weight", "BF16", (64,))
    builder.set_target(expected)
    report = builder.target_report()
    assert report.loc["lm_head.weight", "status"] == "shape mismatch"
    assert report.loc["model.norm.weight", "status"] == "dtype differs"
    assert "1 shape mismatch, 1 dtype differs" in builder.target_view.value
    builder.set_target(None)
    assert builder.target_report() is None and "No target" in builder.target_view.value


def test_target_checkpoint_path_from_the_text_box(builder, tiny_checkpoint):
    builder.target_box.value = str(tiny_checkpoint(layers=1))
    builder.target_button.click()
    assert "Does not match the target" in builder.target_view.value
    assert "missing" not in builder.target_report()["status"].astype(str).unique()  # the target is a subset
    builder.target_box.value = "/no/such/checkpoint"
    builder.target_button.click()
    assert "wb-error" in builder.target_view.value


def test_compare_to_target_with_a_mapping():
    produced = {"a": TensorInfo("a", "F32", (2,)), "b": TensorInfo("b", "F32", (3,))}
    target = {"a": TensorInfo("a", "F32", (2,)), "c": TensorInfo("c", "F32", (1,))}
    frame = compare_to_target(produced, target)
    assert frame["status"].astype(str).to_dict() == {"c": "missing", "b": "unexpected"}
    assert frame.equals(M.check_target(produced, None, target).frame.drop(columns="message"))  # a thin wrapper


def test_the_widget_keeps_the_whole_target_report(builder):
    builder.set_target({"model.norm.weight": (64,), "extra.weight": (3,)})
    report = builder.target_check
    assert isinstance(report, M.TargetReport) and report.missing == ["extra.weight"] and len(report.unexpected) == 38
    assert builder.target_report().equals(report.frame.drop(columns="message"))
    assert report.headline() in builder.target_view.value
    assert "checking against dict of 2 tensors" in builder.target_box.placeholder
    builder.set_target(42)
    assert "Cannot check against a int" in builder.target_view.value and builder.target_check is report  # kept the last good one


def test_graph_tab_draws_the_folded_graph(builder, llama_sample):
    builder.load_preset("hf_to_fused")
    assert builder.graph_output.outputs == ()  # drawn when the tab is opened
    builder.tabs.selected_index = 1
    assert "<svg" in builder.graph_output.outputs[0]["data"]["text/html"]  # an SVG with real text (widgets/graph.py)
    add_concat(builder, ["model.norm.weight", "lm_head.weight"])  # a change redraws the visible graph
    assert len(builder.graph_output.outputs) == 1
    graph = mapper_graph(presets.hf_to_fused(llama_sample), builder.source)
    ops = [node for node in graph.nodes.values() if node.kind == "op"]
    assert sorted((node.label, node.count) for node in ops) == [("Concat", 4), ("Concat", 4)]
    outputs = {node.label: node.count for node in graph.nodes.values() if node.kind == "output"}
    assert outputs == {"model.layers.{i}.self_attn.qkv_proj.weight": 4, "model.layers.{i}.mlp.gate_up_proj.weight": 4}
    assert graph.kept == 39 - 4 * 5
    assert max(node.depth for node in graph.nodes.values()) == 2


def test_graph_of_chains_swaps_and_scopes(llama_sample):
    import workbench as wb

    source = wb.open_checkpoint(llama_sample)
    chain = M.Sequential(
        M.Concat(GATE_UP, "model.layers.{i}.mlp.gu.weight"),
        M.Cast("model.layers.{i}.mlp.gu.weight", "bf16"),
        M.Parallel(M.Rename("lm_head.weight", "model.norm.weight"), M.Rename("model.norm.weight", "lm_head.weight")),
    )
    graph = mapper_graph(chain, source)
    labels = {(node.kind, node.label) for node in graph.nodes.values()}
    assert ("op", "Cast dtype=BF16") in labels
    assert ("intermediate", "model.layers.{i}.mlp.gu.weight") in labels and ("output", "model.layers.{i}.mlp.gu.weight") in labels
    renames = [key for key, node in graph.nodes.items() if node.label == "Rename"]
    sources_into = {graph.nodes[a].label for a, b in graph.edges if b in renames}
    assert sources_into == {"lm_head.weight", "model.norm.weight"}  # each rename reads the original, not its sibling's output
    scoped = mapper_graph(presets.strip_prefix("model."), source)
    assert any(node.label == "norm.weight" and node.kind == "output" for node in scoped.nodes.values())


def test_export_copy_and_save(builder, tmp_path):
    add_concat(builder, QKV)
    assert builder.code_area.value == builder.mapper.to_code()
    assert "qkv_proj" in builder.clipboard.value and "navigator.clipboard.writeText" in builder.clipboard.value
    builder.copy_button.click()
    assert builder.tabs.selected_index == 3 and "select it and copy" in builder.export_message.value
    path = tmp_path / "fused.py"
    builder.save_path.value = str(path)
    builder.save_button.click()
    assert f"to {path}" in builder.export_message.value
    namespace: dict = {}
    exec(path.read_text(), namespace)
    assert namespace["mapper"] == builder.mapper
    builder.save_path.value = str(tmp_path / "missing" / "m.py")
    builder.save_button.click()
    assert "Cannot save" in builder.export_message.value and "wb-error" in builder.export_message.value
    builder.save_path.value = str(tmp_path / "m.txt")
    builder.save_button.click()
    assert "use a .py file name" in builder.export_message.value


def test_display_carries_a_static_html_copy(builder):
    add_concat(builder, GATE_UP)
    bundle = builder._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    html = bundle["text/html"]
    assert "gate_up_proj" in html and "<pre>" in html and "from workbench import mapper as M" in html
    assert bundle["text/plain"] == "<MapperBuilder over tiny-llama: 1 step(s), 35 outputs, 0 problem(s)>"
