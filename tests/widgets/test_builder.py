"""MapperBuilder widget and the mapper graph, driven like a user: pick names, choose an operation,
click, and read the preview, problems, target check, graph and exported code."""

from __future__ import annotations

import html

import pytest

from workbench import mapper as M
from workbench.catalog import TensorInfo
from workbench.errors import MapperError
from workbench.mapper import presets
from workbench.widgets import MapperBuilder
from workbench.widgets.builder import closest_name, compare_to_target, expected_tensors, suggest_output
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
    assert "No problems" in builder.problems_html
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
    assert "x_proj" in builder.problems_html and "matches no tensor" in builder.problems_html
    assert "1 problem(s)" in builder.header.value
    builder.steps_list.value = 0
    builder.remove_button.click()
    assert builder.steps == [] and "No problems" in builder.problems_html


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


# --- issue 18: whole-checkpoint steps by clicking ---------------------------------------------------------
def source_names(llama_sample) -> dict:
    import workbench as wb

    return dict(wb.open_checkpoint(llama_sample).catalog.tensors)


def offered(builder: MapperBuilder) -> list[str]:
    return [value for _, value in builder.suggestions.options]


def strip_model_prefix(builder: MapperBuilder) -> None:
    """What a user does: choose Rename, type the prefix, click Add step."""
    builder.op_picker.value = "Rename"
    builder.prefix_box.value = "model."
    builder.add_button.click()


def test_names_offered_are_those_before_the_step(builder):
    assert "model.layers.{i}.self_attn.q_proj.weight" in offered(builder)
    strip_model_prefix(builder)
    names = offered(builder)
    assert "layers.{i}.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    assert not any(name.startswith("model.") for name in names)  # the old names are gone after the strip
    builder.edit(0)  # editing the strip itself: the names it reads are the source's
    assert "model.layers.{i}.self_attn.q_proj.weight" in offered(builder)
    builder.cancel_button.click()
    assert "layers.{i}.self_attn.q_proj.weight" in offered(builder)
    builder.combine_picker.value = "Parallel"  # side by side: every step reads the source
    assert "model.layers.{i}.self_attn.q_proj.weight" in offered(builder)


def test_search_box_narrows_the_names_and_several_are_added_at_once(builder):
    builder.name_search.value = "self_attn.*"
    assert sorted(offered(builder)) == sorted(f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkvo")
    builder.op_picker.value = "Concat"
    builder.suggestions.value = tuple(QKV)  # Ctrl-click three names
    builder.add_source_button.click()
    assert builder.sources_box.value.splitlines() == QKV
    assert builder.outputs_box.value == "model.layers.{i}.self_attn.qkv_proj.weight"
    builder.name_search.value = "no_such_thing"
    assert offered(builder) == []


def test_append_preset_keeps_the_steps_and_replace_replaces_them(builder, llama_sample):
    builder.op_picker.value = "Cast"
    builder.sources_box.value = "lm_head.weight"
    builder.add_button.click()
    builder.preset_picker.value = "hf_to_fused"
    builder.append_preset_button.click()
    assert len(builder.steps) == 2 and builder.steps[0] == M.Cast("lm_head.weight", "BF16")
    assert builder.steps[1] == presets.hf_to_fused(llama_sample / "config.json")
    assert "Appended preset" in builder.form_message.value and builder.binding.ok
    builder.preset_picker.value = "strip_prefix"
    builder.load_preset_button.click()  # Replace
    assert builder.steps == [presets.strip_prefix("model.")]


def test_appended_presets_are_built_for_the_names_at_that_step(builder):
    strip_model_prefix(builder)
    builder.preset_picker.value = "hf_to_fused"  # its layers are found under the new prefix
    builder.append_preset_button.click()
    assert builder.binding.ok, builder.problems_html
    assert builder.binding.outputs["layers.0.self_attn.qkv_proj.weight"].shape == (128, 64)
    builder.preset_picker.value = "cast_policy"  # lists the names as they are after the fusion
    builder.append_preset_button.click()
    outputs = builder.binding.outputs
    assert builder.binding.ok and outputs["layers.3.mlp.gate_up_proj.weight"].dtype == "BF16"
    assert outputs["layers.3.input_layernorm.weight"].dtype == "F32" and outputs["norm.weight"].dtype == "F32"


def test_glob_cast_keeping_norms(builder, llama_sample):
    builder.op_picker.value = "Cast"
    builder.sources_box.value = "*"
    builder.keep_box.value = "norm"
    builder.add_button.click()
    outputs = builder.binding.outputs
    names = source_names(llama_sample)
    norms = [n for n in names if "norm" in n]
    assert len(norms) == 9 and all(outputs[n].dtype == "F32" for n in norms)
    assert all(outputs[n].dtype == "BF16" for n in names if n not in norms)
    assert builder.step_labels() == [f"cast {len(names) - len(norms)} tensors → BF16, norms kept F32"]
    step = builder.steps[0]
    assert isinstance(step, M.Parallel) and len(step.mappers) < 12  # folded into {i} templates, not 30 casts
    assert M.Cast("model.layers.{i}.mlp.up_proj.weight", "BF16") in step.mappers


def test_a_cast_keeping_norms_is_listed_again_where_it_moves(builder, llama_sample):
    add_typed(builder, "Cast", "*", "", {"keep_box": "norm"})
    builder.keep_box.value = ""
    add_typed(builder, "Drop", "*.mlp.*", "", {})
    floats = len(source_names(llama_sample)) - 9  # 9 norms kept
    assert builder.step_labels() == [f"cast {floats} tensors → BF16, norms kept F32", "drop 12 tensors: *.mlp.*"]
    builder.move(0, +1)  # after the drop, the cast lists the names left there (no mlp tensor, no 'others')
    assert builder.binding.ok and builder.step_labels()[1] == f"cast {floats - 12} tensors → BF16, norms kept F32"
    assert not any(".mlp." in leaf.name for leaf in builder.steps[1].leaves())
    builder.move(1, -1)
    assert builder.binding.ok and builder.step_labels()[0] == f"cast {floats} tensors → BF16, norms kept F32"


def test_glob_sources_for_drop_rename_and_templates(builder, llama_sample):
    add_typed(builder, "Drop", "model.layers.{i}.*norm*", "", {})
    outputs = builder.binding.outputs
    assert not any("layernorm" in name for name in outputs) and "model.norm.weight" in outputs
    assert builder.steps[-1] == M.Drop("model.layers.{i}.*norm*")  # added as written, not as the names it matched
    add_typed(builder, "Rename", "model.layers.*.mlp.*", "blocks.*.ffn.*", {})
    outputs = builder.binding.outputs
    assert builder.binding.ok and outputs["blocks.2.ffn.down_proj.weight"].shape == (64, 128)
    assert not any(".mlp." in name for name in outputs)
    assert builder.steps[-1] == M.Rename("model.layers.*.mlp.*", "blocks.*.ffn.*")
    assert builder.step_labels()[-1] == "rename 12 tensors: model.layers.*.mlp.* → blocks.*.ffn.*"
    add_typed(builder, "Rename", "model.layers.{i}", "layers.{i}", {})  # a module prefix with {i}: a glob of what is under it
    assert builder.steps[-1] == M.Rename("model.layers.{i}.*", "layers.{i}.*")
    assert builder.binding.ok and "layers.1.self_attn.q_proj.weight" in builder.binding.outputs
    add_typed(builder, "Concat", "layers.*", "x", {})
    assert "holds 0 '*' but the glob 'layers.*' holds 1" in html.unescape(builder.form_message.value) and len(builder.steps) == 3
    add_typed(builder, "Cast", "nothing.*", "", {})
    assert builder.steps[-1] == M.Cast("nothing.*", "BF16") and builder.step_labels()[-1] == "cast (no tensor matched yet)"
    assert "glob 'nothing.*' matches no tensor name" in html.unescape(builder.problems_html)


def test_glob_steps_export_as_globs_and_rebind_when_moved(builder, llama_sample, tmp_path):
    strip_model_prefix(builder)
    add_typed(builder, "Cast", "layers.*", "", {})
    add_typed(builder, "Drop", "*.rotary_emb.*", "", {})
    assert builder.steps[1:] == [M.Cast("layers.*", "BF16"), M.Drop("*.rotary_emb.*")]
    layer_tensors = [n for n in source_names(llama_sample) if n.startswith("model.layers.")]
    assert builder.step_labels()[1] == f"cast {len(layer_tensors)} tensors → BF16, 3 others kept F32"
    assert builder.step_labels()[2] == "drop *.rotary_emb.* (matches no name here)"
    code = builder.code_area.value
    assert "M.Cast('layers.*', 'BF16')" in code and "M.Drop('*.rotary_emb.*')" in code
    builder.save_path.value = str(tmp_path / "mapper.py")
    builder.save_button.click()
    assert "M.Cast('layers.*', 'BF16')" in (tmp_path / "mapper.py").read_text()
    builder.move(1, -1)  # before the strip, 'layers.*' names nothing yet: the glob re-binds there
    assert builder.steps[0] == M.Cast("layers.*", "BF16") and builder.step_labels()[0] == "cast (no tensor matched yet)"
    assert any("glob 'layers.*' matches no tensor name" in p.message for p in builder.binding.problems)
    assert "Move step 1 after step 2" in [label for group in builder.problem_groups() for label, _ in group.fixes]
    builder.move(0, +1)
    assert builder.stepwise.problems[1] == [] and builder.step_labels()[1].startswith(f"cast {len(layer_tensors)} tensors")
    wider = M.Sequential(M.Rename("model.*", "*"), M.Cast("*", "BF16"))  # the same glob from code binds the same way
    assert MapperBuilder(llama_sample, mapper=wider).binding.outputs == wider.bind(source_names(llama_sample)).outputs


def test_prefix_field_strips_and_adds(builder):
    strip_model_prefix(builder)
    assert builder.steps == [presets.strip_prefix("model.")]
    assert builder.step_labels() == ["strip prefix `model.` (38 names)"]
    builder.op_picker.value = "Rename"
    builder.prefix_box.value = "model."
    builder.prefix_action.value = "add"
    builder.add_button.click()
    assert builder.steps[1] == presets.add_prefix("model.")
    assert set(builder.binding.outputs) == {f"model.{n}" for n in builder.names_before(1)}
    builder.edit(0)  # a prefix step is edited in the prefix field
    assert builder.op_picker.value == "Rename" and builder.prefix_box.value == "model." and builder.prefix_action.value == "strip"
    builder.sources_box.value = "lm_head.weight"
    builder.add_button.click()
    assert "either names" in builder.form_message.value


def test_step_labels_are_words_with_the_code_in_the_tooltip(builder, llama_sample):
    builder.load_preset("hf_to_fused")
    builder.preset_picker.value = "cast_policy"
    builder.append_preset_button.click()
    labels = [label for label, _ in builder.steps_list.options]
    assert labels[0] == "1. fuse q/k/v → qkv_proj, gate/up → gate_up_proj (×4)"
    assert labels[1].startswith("2. check: nothing of HF separate q/k/v and gate/up left unconverted")
    assert labels[2] == "3. cast 18 tensors → BF16, norms kept F32"
    assert "Claim(" in builder.steps_list.tooltip and "Concat(" in builder.steps_list.tooltip
    assert "\\\\" not in labels[1]  # no doubled backslashes of the claim's regular expression
    builder.steps_list.value = 0
    assert "M.Concat(" in builder.step_detail.value and "qkv_proj" in builder.step_detail.value


def test_problems_are_grouped_by_step_with_a_fix(builder):
    strip_model_prefix(builder)
    add_typed(builder, "Concat", "\n".join(QKV), "model.layers.{i}.self_attn.qkv_proj.weight", {})  # the old names: gone after the strip
    assert not builder.binding.ok
    groups = builder.problem_groups()
    assert [(g.step, g.kind) for g in groups] == [(1, "names not found")]
    assert "Step 2 · fuse q/k/v → qkv_proj — 1 name not found" in builder.problems_html
    heading, fix_row = builder.problem_groups_box.children[0].children  # the group's fixes sit right under it
    assert "1 name not found" in heading.value
    fixes = [button.description for button in fix_row.children]
    assert fixes == ["Move step 2 before step 1", "Remove step 2"]
    fix_row.children[0].click()
    assert builder.binding.ok and isinstance(builder.steps[0], M.Concat)
    assert "layers.0.self_attn.qkv_proj.weight" in builder.binding.outputs
    assert builder.problems_panel.layout.max_height and builder.problems_panel.layout.overflow == "auto"


OLD_NAMES = "\n".join(f"model.layers.{{i}}.{n}.weight" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                                "self_attn.o_proj", "mlp.down_proj"))


def test_an_ordering_mistake_gives_two_groups_each_with_its_fixes_in_the_scrolled_box(builder):
    """Issue 34 item 1: a cast typed with the source's names moved below the prefix strip, and a rename onto a kept
    name: 6 problems in 2 groups. Each group's fix-its sit under it inside the capped box, whose parts keep their
    height (flex 0 0 auto) so that the box scrolls instead of squeezing the fix-it rows to 0 px."""
    add_typed(builder, "Cast", OLD_NAMES, "", {})
    strip_model_prefix(builder)
    add_typed(builder, "Rename", "lm_head.weight", "norm.weight", {})
    builder.move(0, +1)
    groups = builder.problem_groups()
    assert [(g.step, g.kind, len(g.problems)) for g in groups] == [(1, "names not found", 5), (2, "name clashes", 1)]
    assert "Problems (6)" in builder.problems_html
    boxes = builder.problem_groups_box.children
    assert len(boxes) == 2 and builder.problem_groups_box in builder.problems_panel.children
    rows = [box.children[1] for box in boxes]
    assert [[b.description for b in row.children] for row in rows] == [
        ["Move step 2 before step 1", "Remove step 2"], ["Drop 'norm.weight' before step 3", "Remove step 3"]]
    parts = [builder.problems_view, builder.problem_groups_box, *boxes, *rows, *(box.children[0] for box in boxes)]
    assert all(part.layout.flex == "0 0 auto" for part in parts)
    rows[0].children[0].click()
    assert "problem(s) fewer" in builder.form_message.value and len(builder.binding.problems) == 1


def test_problem_kinds_and_many_groups_stay_in_a_capped_box(builder):
    add_typed(builder, "Rename", "lm_head.weight", "model.norm.weight", {})  # writes over a kept tensor
    add_typed(builder, "Cast", "model.nope.weight", "", {})
    kinds = {(g.step, g.kind) for g in builder.problem_groups()}
    assert kinds == {(0, "name clashes"), (1, "names not found")}
    assert builder.problems_panel.layout.max_height == "220px"
    clash = next(g for g in builder.problem_groups() if g.kind == "name clashes")
    assert [label for label, _ in clash.fixes] == ["Drop 'model.norm.weight' before step 1", "Remove step 1"]
    clash.fixes[0][1]()  # the binder's own advice, as a button
    assert builder.steps[0] == M.Drop("model.norm.weight") and builder.binding.outputs["model.norm.weight"].shape == (256, 64)
    assert {g.kind for g in builder.problem_groups()} == {"names not found"}


def test_one_output_pattern_is_singular(builder):
    add_typed(builder, "Drop", "model.*", "", {})
    assert "1 output pattern<" in builder.preview_table.value or "1 output pattern " in builder.preview_table.value
    assert "1 output patterns" not in builder.preview_table.value


def test_target_check_is_folded_and_takes_a_model_type_or_config(builder, llama_sample):
    pytest.importorskip("transformers")
    builder.load_preset("hf_to_fused")
    builder.target_box.value = "llama"
    builder.target_button.click()
    view = builder.target_view.value
    assert "LlamaForCausalLM from model type" in view and "20 missing, 8 unexpected" in view
    assert "model.layers.{i}.self_attn.q_proj.weight" in view and "×4" in view
    assert "model.layers.0.self_attn.q_proj.weight" not in view  # folded: 5 missing patterns, not 20 rows
    assert "7 difference patterns" in view
    assert len(builder.target_report()) == 28  # the report itself keeps one row per tensor
    builder.target_box.value = str(llama_sample / "config.json")
    builder.target_button.click()
    assert "LlamaForCausalLM from config" in builder.target_view.value
    builder.target_box.value = "lamma"
    builder.target_button.click()
    message = html.unescape(builder.target_view.value)
    assert "knows no model type 'lamma'" in message and "Did you mean 'llama'" in message


def test_glob_errors_quote_names_as_typed(builder):
    add_typed(builder, "Cast", "model\\.layers.*", "", {})
    message = html.unescape(builder.problems_html)
    assert "model\\.layers.*" in message and "model\\\\.layers" not in message
    with pytest.raises(MapperError) as caught:
        M.Claim("family", "(a\\.b")
    assert "'(a\\.b'" in str(caught.value)


def test_reordering_says_when_validity_changes(builder):
    strip_model_prefix(builder)
    add_typed(builder, "Cast", "layers.{i}.mlp.up_proj.weight", "", {})
    assert builder.binding.ok
    builder.move(1, -1)  # the cast now runs before the strip: its names do not exist yet
    assert "new problem(s)" in builder.form_message.value and not builder.binding.ok
    builder.move(0, +1)
    assert "fewer" in builder.form_message.value and builder.binding.ok


def test_export_tab_has_one_copy_button(builder):
    export = builder.tabs.children[3]
    shown = [w for box in export.children for w in getattr(box, "children", [box])]
    assert builder.copy_button not in shown and builder.clipboard in shown
    assert "Copy to clipboard" in builder.clipboard.value  # the HTML button copies; no second "copy" that does not


def test_problem_messages_quote_names_as_typed(builder):
    add_typed(builder, "Cast", "model\\.norm\\.weight", "", {})  # a regular expression typed where a name goes
    problems = html.unescape(builder.problems_html)
    assert "input 'model\\.norm\\.weight' is not in the source" in problems and "\\\\." not in problems.split("is not in")[0][-40:]


def test_add_all_matching_adds_a_whole_name_glob_or_the_listed_names(builder):
    builder.op_picker.value = "Drop"
    builder.name_search.value = "model.layers.{i}.*norm*"  # a glob of whole names: added as written
    builder.add_pattern_button.click()
    assert builder.sources_box.value == "model.layers.{i}.*norm*"
    builder.sources_box.value = ""
    builder.name_search.value = "self_attn"  # a filter word (matches inside names): the listed templates are added
    builder.add_pattern_button.click()
    assert sorted(builder.sources_box.value.splitlines()) == sorted(f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkvo")
    builder.add_button.click()
    assert not any(".self_attn." in name for name in builder.binding.outputs)
    builder.name_search.value = ""  # no search: "all matching" is all of them
    builder.add_pattern_button.click()
    assert builder.sources_box.value == "*"


def test_a_glob_written_in_code_binds_like_the_builder_step(llama_sample):
    import workbench as wb

    binding = M.Cast("model.*", "BF16").bind(wb.open_checkpoint(llama_sample))
    assert binding.ok and binding.outputs["model.norm.weight"].dtype == "BF16" and binding.outputs["lm_head.weight"].dtype == "F32"


def test_a_misspelt_template_offers_the_closest_name_as_a_template(builder):
    """Issue 34 item 7: an unknown name's fix-it is the closest name, folded back into the typed template; a click
    puts it into the step, and the problem goes."""
    strip_model_prefix(builder)
    add_typed(builder, "Cast", "layers.{i}.self_atn.q_proj.weight", "", {})  # typed after the strip, misspelt
    [group] = builder.problem_groups()
    assert group.kind == "names not found"
    heading, fix_row = builder.problem_groups_box.children[0].children
    labels = [button.description for button in fix_row.children]
    assert labels == ["Use the closest name: layers.{i}.self_attn.q_proj.weight", "Remove step 2"]
    text = html.unescape(builder.problems_html)
    assert "The closest name is 'layers.{i}.self_attn.q_proj.weight'" in text  # the message says what the button does
    assert "Cast(" not in text and "step 2 (Cast 'layers.{i}.self_atn.q_proj.weight')" in text  # the user's words
    fix_row.children[0].click()
    assert builder.steps[1] == M.Cast("layers.{i}.self_attn.q_proj.weight", "BF16")
    assert builder.binding.ok and not builder.binding.problems and "No problems" in builder.problems_html
    assert builder.binding.outputs["layers.3.self_attn.q_proj.weight"].dtype == "BF16"


def test_closest_name_keeps_the_typed_placeholders():
    names = [f"model.layers.{k}.mlp.{p}_proj.weight" for k in range(3) for p in ("up", "down")] + ["model.norm.weight"]
    assert closest_name("model.layers.{layer}.mlp.dwn_proj.weight", names) == "model.layers.{layer}.mlp.down_proj.weight"
    assert closest_name("model.nrm.weight", names) == "model.norm.weight"  # a plain name stays plain
    assert closest_name("model.layers.2.mlp.dwn_proj.weight", names) == "model.layers.2.mlp.down_proj.weight"  # its index kept
    assert closest_name("something.else.entirely", names) is None


def test_follow_on_problems_name_steps_in_words(builder):
    """A clash caused by the prefix strip is said with the step's label, not the mapper's code."""
    add_typed(builder, "Rename", "lm_head.weight", "norm.weight", {})
    strip_model_prefix(builder)  # model.norm.weight -> norm.weight, which the rename already wrote
    text = html.unescape(builder.problems_html)
    assert "Cannot write 'norm.weight': step 2 (strip prefix 'model.') produces it" in text
    assert "PrefixScope" not in text
    problem = builder.binding.problems[0]
    assert problem.message.startswith("Cannot write 'norm.weight': PrefixScope(")  # the mapper's own message stays


def test_a_regular_expression_typed_as_a_name_is_quoted_as_typed(builder):
    add_typed(builder, "Cast", "model\\.layers\\.[0-9]{2}\\.mlp", "", {})
    message = html.unescape(builder.form_message.value)
    assert "name 'model\\.layers\\.[0-9]{2}\\.mlp' has a malformed placeholder" in message
    assert "\\\\" not in message and "Names are not regular expressions" in message and builder.steps == []


def test_the_target_check_shows_a_busy_sign_while_it_runs(builder, tiny_checkpoint, monkeypatch):
    builder.target_box.value = str(tiny_checkpoint(layers=1))
    seen = []
    real = builder.set_target_text

    def watched(text):  # what the page shows while the (seconds-long) check runs
        button = builder.target_button
        seen.append((button.disabled, button.description, "Checking the outputs against" in builder.target_view.value))
        real(text)

    monkeypatch.setattr(builder, "set_target_text", watched)
    builder.target_button.click()
    assert seen == [(True, "Checking…", True)]
    assert not builder.target_button.disabled and builder.target_button.description == "Check"
    assert "Does not match the target" in builder.target_view.value
