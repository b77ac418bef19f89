"""`MapperBuilder`: compose a mapper in a notebook, step by step, and see what it produces.

Start empty or from a preset (Replace) and add presets as steps (Append preset); add operations by
picking source names as they are where the step runs (layer templates such as
`model.layers.{i}.self_attn.q_proj.weight` are offered; a glob such as `*.weight` is added as written and
binds where its step runs, a Rename can strip or add a prefix) and an operation with its parameters; edit, reorder or remove steps,
listed in words ("strip prefix `model.`") with their code beside. Problems are grouped by step, said with
the steps' words, with a fix where one is obvious (move the step, drop what it writes over, use the closest name). Every change re-binds the mapper to the source (metadata only) and updates
the preview of outputs, the problems, the target check and the exported code. `builder.mapper` is an
ordinary `M.Sequential` / `M.Parallel` of the steps; "Save .py" writes exactly `mapper.to_code()`.
"""

from __future__ import annotations

import dataclasses
import difflib
import html
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import pandas as pd
from ipywidgets.widgets.trait_types import TypedTuple
from traitlets import Any as AnyTrait

from .. import mapper as M
from ..catalog import TensorInfo
from ..display import format_bytes, format_shape
from ..dtypes import DTYPE_BITS
from ..errors import MapperError, WorkbenchError
from ..explore.layers import fold_name, natural_key
from ..mapper import globs
from ..mapper import target as target_check
from ..mapper.base import Mapper
from ..mapper.bind import StepwiseBinding, bind_steps
from ..mapper.compose import PrefixScope
from ..mapper.describe import describe_step
from ..mapper.export import code_expr
from ..mapper.groups import Problem
from ..mapper.merge.models import MergeModels
from ..mapper.op import Op
from ..mapper.patterns import is_glob
from ..mapper.patterns import matcher as glob_matcher
from ..names import Template, fill, filter_names, placeholders_of
from .common import (
    Panel,
    fit_narrow,
    frame_table,
    labelled,
    message_html,
    replace_output,
    set_options,
)
from .merge_form import MergeForm, merge_label, step_table_html

COMBINE = {"Sequential": "Sequential — each step sees the previous result", "Parallel": "Parallel — every step reads the source"}
CODE = "Code"  # the form mode that takes any mapper expression (M.…) — also how composite steps are edited
MERGE = "Merge"  # the form mode that merges whole models (sources of a multi-source checkpoint): see merge_form
OPERATIONS = ("Rename", "Concat", "Split", "Stack", "Unstack", "Transpose", "Reshape", "Cast", "Identity", "Drop", MERGE, CODE)
# Which parameter controls each operation shows (sources and outputs are always shown).
PARAMETERS: dict[str, tuple[str, ...]] = {
    "Rename": ("prefix",), "Identity": (), "Drop": (),
    "Concat": ("dim",), "Stack": ("dim",), "Split": ("sizes", "dim"), "Unstack": ("dim",),
    "Transpose": ("dim0", "dim1"), "Reshape": ("shape",), "Cast": ("dtype", "keep"), MERGE: (), CODE: ("code",),
}
OUTPUT_HINTS = {
    "Rename": "new name", "Concat": "output name", "Stack": "output name",
    "Split": "names of the parts, comma-separated", "Unstack": "one name per index, comma-separated",
    "Transpose": "optional: write to this name", "Reshape": "optional: write to this name",
    "Cast": "optional: write to this name", "Identity": "(none)", "Drop": "(none)", MERGE: "merge whole models",
    CODE: "(in the code)",
}
SINGLE_SOURCE = ("Rename", "Split", "Unstack", "Transpose", "Reshape", "Cast", "Identity", "Drop")
PER_SOURCE = ("Cast", "Identity", "Drop")  # several sources and no output name: one operation each
NO_OUTPUTS = ("Identity", "Drop", MERGE, CODE)
NO_NAMES = (MERGE, CODE)  # form modes without the name pickers
DEFAULT_ROWS = 60
SHOWN_PER_GROUP = 5  # problems listed under each group heading (the rest counted)
MAX_MOVE_TRIALS = 8  # positions tried (each a binding) when looking for where a step's names exist
CLOSEST_POOL = 5_000  # layer templates compared with a misspelt name (difflib is linear in them)
CLOSEST_FALLBACK = 2_000  # names compared one by one when no template fits
_CLOSEST = re.compile(r" The closest name is '[^']*'\.")  # the binder's hint, said again as a template when one is known
WORDED_LEAVES = 50  # operations of a composite step whose code a problem's message may quote, said in words
# the groups problems are shown in, in display order, by `Problem.kind` (any other kind: "invalid operations")
PROBLEM_GROUPS = (
    ("names not found", ("missing",)),
    ("name clashes", ("clash", "overwrite")),
    ("left unconverted", ("unconverted", "unmapped")),
)


def _unshrunk() -> widgets.Layout:
    """The layout of a part of a capped, scrolled box: it keeps its own height (a flex item would shrink)."""
    return widgets.Layout(flex="0 0 auto")


# --- presets -------------------------------------------------------------------------------------------
def _presets() -> dict[str, str]:
    """The presets the builder offers: `M.presets.PRESETS` (name -> label), the one list every front end uses."""
    from ..mapper.presets import PRESETS

    return dict(PRESETS)


def steps_of(mapper: Mapper) -> tuple[list[Mapper], str]:
    """A mapper as builder steps: the children of a top-level Sequential/Parallel, else the mapper itself."""
    if isinstance(mapper, (M.Sequential, M.Parallel)):
        return list(mapper.mappers), type(mapper).__name__
    return [mapper], "Sequential"


# --- names -------------------------------------------------------------------------------------------------
class _OneOrMany(TypedTuple):
    """A tuple trait that also takes one string (one chosen name)."""

    def validate(self, obj: Any, value: Any) -> Any:
        return super().validate(obj, (value,) if isinstance(value, str) else value)


class NamePicker(widgets.SelectMultiple):
    """The builder's list of names (several may be chosen); `picker.value = 'a.b'` chooses one, as before."""

    value = _OneOrMany(trait=AnyTrait(), help="Selected values")


def layers_template(names: Any) -> str | None:
    """The decoder-layer prefix template of `names` ('layers.{i}' after a 'model.' strip), None if none is seen."""
    for name in names:
        for marker in (".self_attn.", ".mlp."):
            if marker in name:
                head = name.split(marker, 1)[0]
                template = globs.fold_name(head)[0]
                if "{" in template:
                    return template
    return None


def suggest_output(sources: list[str]) -> str:
    """A name for the fusion of `sources`: what they share, with the parts that differ joined.

    q_proj, k_proj, v_proj -> qkv_proj; gate_proj, up_proj -> gate_up_proj. '' when there is no good guess.
    """
    if len(sources) < 2:
        return sources[0] if sources else ""
    prefix = os.path.commonprefix(sources)
    suffix = os.path.commonprefix([s[::-1] for s in sources])[::-1]
    shortest = min(len(s) for s in sources)
    suffix = suffix[len(suffix) - max(0, min(len(suffix), shortest - len(prefix))):]
    middles = [s[len(prefix): len(s) - len(suffix)] for s in sources]
    if any(not m or "." in m for m in middles):
        return ""
    joiner = "" if all(len(m) == 1 for m in middles) else "_"
    return prefix + joiner.join(middles) + suffix


def _is_prefix_only(name: str, names: Any) -> bool:
    """True when `name` (a name or template) is no tensor's name but a dotted prefix of some ('model.layers.{i}')."""
    return not globs.match_names(name, names) and bool(globs.match_names(name + ".*", names))


def _split_names(text: str) -> list[str]:
    return [part.strip() for chunk in text.splitlines() for part in chunk.split(",") if part.strip()]


def _parse_ints(text: str, what: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.replace("[", "").replace("]", "").replace("(", "").replace(")", "").split(",") if p.strip()]
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        raise MapperError(f"Cannot read {what} {text!r}: write whole numbers separated by commas, e.g. 64, 32, 32.") from None


# --- target check (the logic lives in workbench.mapper.target) ------------------------------------------
TARGET_STATUSES = target_check.TARGET_STATUSES


def expected_tensors(target: Any) -> dict[str, Any]:
    """What a target expects, as name -> Expected (name, dtype, shape): see `workbench.mapper.target.resolve_target`."""
    return target_check.resolve_target(target).tensors


def compare_to_target(produced: Any, target: Any) -> pd.DataFrame:
    """Differences between what a mapper produces (a Binding or name -> TensorInfo) and what `target`
    expects: one row per 'missing', 'unexpected', 'shape mismatch' or 'dtype differs' tensor.
    A thin wrapper over `workbench.mapper.check_target` (its report's frame without messages)."""
    return target_check.check_target(produced, None, target).frame.drop(columns="message")


# --- problems ---------------------------------------------------------------------------------------------
_KIND_ORDER = {kind: k for k, (kind, _) in enumerate(PROBLEM_GROUPS)}
_GROUP_OF = {kind: group for group, kinds in PROBLEM_GROUPS for kind in kinds}


_SINGULAR = {"names not found": "name not found", "name clashes": "name clash", "invalid operations": "invalid operation"}


def _counted(kind: str, n: int) -> str:
    return _SINGULAR.get(kind, kind) if n == 1 else kind


def problem_group(problem: Problem) -> str:
    """The group a problem is shown in ('names not found', 'name clashes', ...; else 'invalid operations')."""
    return _GROUP_OF.get(problem.kind, "invalid operations")


@dataclass
class ProblemGroup:
    """Problems of one kind raised by one step, and the fixes offered for them: (button label, action).
    `closest`: for names not found, the closest existing name of each misspelt one (typed -> closest)."""

    step: int
    kind: str
    problems: list[Problem]
    fixes: list[tuple[str, Callable[[], None]]] = field(default_factory=list)
    closest: dict[str, str] = field(default_factory=dict)


def _names_match(text: str, names: Mapping[str, TensorInfo]) -> bool:
    """True when `text` (a name, a {placeholder} template or a glob) names at least one of `names`."""
    if text in names:
        return True
    if is_glob(text):
        match = glob_matcher(text)
        return any(match(name) is not None for name in names)
    if "{" not in text:
        return False
    template = Template(text, placeholders_of(text))
    return any(template.match(name.split(".")) is not None for name in names)


def _renamed_placeholders(template: str, names: Mapping[str, str]) -> str:
    """`template` with its placeholders renamed ({i} -> {layer}) in one pass (no chain of renames)."""
    return re.sub(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: "{" + names.get(m.group(1), m.group(1)) + "}", template)


def closest_name(text: str, names: Iterable[str], folds: Mapping[int, list[str]] | None = None) -> str | None:
    """The existing name nearest to `text`, a misspelt name or {placeholder} template; None when none is close.

    Names are compared folded by layer (whole-number segments as placeholders: a few hundred templates, not every
    tensor), so a template's answer is a template with the typed placeholders: 'layers.{i}.self_atn.q_proj.weight'
    -> 'layers.{i}.self_attn.q_proj.weight' names every layer the typed template meant to. A plain name's answer
    is a plain name (its indices as typed, else the nearest of the names of as many segments). `folds`: the
    `layer_folds` of `names`, when several names are looked up among the same ones."""
    present = names if isinstance(names, Mapping) else dict.fromkeys(names)
    order = placeholders_of(text)
    if len(order) > len(globs.FOLD_PLACEHOLDERS):
        return None
    if order:
        probe, values = _renamed_placeholders(text, dict(zip(order, globs.FOLD_PLACEHOLDERS, strict=False))), order
    else:
        probe, values = globs.fold_name(text)
    templates = (folds if folds is not None else layer_folds(present)).get(len(values), [])
    found = difflib.get_close_matches(probe, templates[:CLOSEST_POOL], n=1)
    if order:
        return _renamed_placeholders(found[0], dict(zip(globs.FOLD_PLACEHOLDERS, order, strict=False))) if found else None
    if found:
        candidate = fill(found[0], dict(zip(globs.FOLD_PLACEHOLDERS, values, strict=False)))
        if candidate in present:
            return candidate
    segments = text.count(".")
    pool = [name for name in present if name.count(".") == segments][:CLOSEST_FALLBACK]
    found = difflib.get_close_matches(text, pool, n=1)
    return found[0] if found else None


def layer_folds(names: Iterable[str]) -> dict[int, list[str]]:
    """The layer templates of `names` (whole-number segments as {i}, {j}, ...) by how many placeholders they hold."""
    out: dict[int, dict[str, None]] = {}
    for name in names:
        template, values = globs.fold_name(name)
        out.setdefault(len(values), {})[template] = None
    return {count: list(templates) for count, templates in out.items()}


def _unscoped_leaves(step: Mapper) -> list[Op]:
    """The operations of `step` that read names as the step sees them (those inside a prefix scope read scoped names)."""
    if isinstance(step, Op):
        return [step]
    if isinstance(step, (M.Sequential, M.Parallel)):
        return [leaf for child in step.mappers for leaf in _unscoped_leaves(child)]
    return []


def _with_names(step: Mapper, swaps: Mapping[str, str]) -> Mapper:
    """`step` with the names in `swaps` replaced (old -> new) in its operations outside prefix scopes, checked
    again as if written so (an operation writing in place, such as a Cast without dst, writes the new name)."""
    if isinstance(step, (M.Sequential, M.Parallel)):
        return type(step)(*[_with_names(child, swaps) for child in step.mappers])
    if not isinstance(step, Op) or not any(name in swaps for name in step.inputs):
        return step
    if not dataclasses.is_dataclass(step):
        return step.rename_all(lambda name: swaps.get(name, name))
    changes: dict[str, Any] = {}
    for name_field in step.NAME_FIELDS:
        value = getattr(step, name_field)
        if value in swaps:
            changes[name_field] = swaps[value]
    for list_field in step.NAME_LIST_FIELDS:
        values = getattr(step, list_field)
        if any(value in swaps for value in values):
            changes[list_field] = tuple(swaps.get(value, value) for value in values)
    return dataclasses.replace(step, **changes)  # type: ignore[type-var]


def _op_words(op: Op) -> str:
    """An operation as the builder's form names it: "Cast 'model.norm.weight'", "Concat 'a' and 2 more → 'abc'"."""
    if not op.inputs:
        return type(op).__name__
    more = f" and {len(op.inputs) - 1} more" if len(op.inputs) > 1 else ""
    into = f" → '{op.outputs[0]}'" if len(op.outputs) == 1 and op.outputs != op.inputs else ""
    return f"{type(op).__name__} '{op.inputs[0]}'{more}{into}"


def fold_differences(frame: pd.DataFrame) -> pd.DataFrame:
    """Target differences folded by layer: one row per (pattern, status) with how many tensors it stands for
    ('model.layers.{i}.mlp.gate_proj.weight  missing  ×32') instead of one row per tensor."""
    if frame.empty:
        return frame
    rows: dict[tuple[str, str], list[Any]] = {}
    for name, row in zip(frame.index, frame.itertuples(index=False), strict=True):
        key = (fold_name(name)[0], str(row.status))
        if key in rows:
            rows[key][2] += 1
        else:
            rows[key] = [key[0], key[1], 1, row.dtype, row.shape, row.target_dtype, row.target_shape]
    out = pd.DataFrame(list(rows.values()), columns=["pattern", "status", "count", "dtype", "shape", "target_dtype", "target_shape"])
    out[["dtype", "target_dtype"]] = out[["dtype", "target_dtype"]].fillna("")
    return out.set_index("pattern")


def _shape_or_blank(shape: Any) -> str:
    return format_shape(shape) if isinstance(shape, (tuple, list)) else ""


def _holds_tensors(folder: Path) -> bool:
    """True when `folder` holds checkpoint files (not just a config.json)."""
    return any(p.suffix in (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".distcp") for p in folder.iterdir())


def _looks_like_model_type(text: str) -> bool:
    """A transformers model type is one lower-case word such as 'llama', 'qwen2', 'gpt_neox' or 'xlm-roberta'."""
    return bool(text) and all(c.islower() or c.isdigit() or c in "_-" for c in text) and not text[0].isdigit()


# --- the widget -------------------------------------------------------------------------------------------
class MapperBuilder(Panel):
    """Build a mapper interactively over `source` (a path, Checkpoint or Catalog).

    `target` (optional): what the result should look like — a model built on the meta device, a target
    checkpoint, or a mapping name -> tensor; see `workbench.mapper.check_target`. `mapper` or `preset` (a key of
    `MapperBuilder.presets()`) gives the starting steps; `config` (a config.json path, dict or
    transformers config) feeds presets that need model facts and defaults to the source's config.json.
    Controls are public attributes, so a notebook or a test can drive the widget like a user.
    """

    def __init__(
        self,
        source: Any,
        target: Any = None,
        *,
        mapper: Mapper | None = None,
        preset: str | None = None,
        config: Any = None,
        max_rows: int = DEFAULT_ROWS,
    ) -> None:
        from ..explore.checkpoint import open_checkpoint

        self.source = open_checkpoint(source)
        self.config = config if config is not None else self._find_config()
        self.steps: list[Mapper] = []
        self.binding: M.Binding | None = None
        self.stepwise: StepwiseBinding | None = None
        self.target: Any = None
        self._target: target_check.Target | None = None
        self.target_check: target_check.TargetReport | None = None
        self.target_frame: pd.DataFrame | None = None
        self._editing: int | None = None
        self._auto_output = ""
        self._graph_stale = True
        self._quiet = False
        self._fold_cache: dict[str, str] = {}
        self._groups_html = ""
        self._step_words: dict[int, tuple[str, dict[str, str]]] = {}  # step -> its words for problem texts (see problem_text)
        # Casts with 'keep F32' words list their names (no glob says "all but the norms"); each remembers how it was
        # asked for, so that moved elsewhere it is listed again for the names there: id -> (step, recipe, built after)
        self._kept_casts: dict[int, tuple[Mapper, tuple[tuple[str, ...], str, tuple[str, ...]], tuple[Mapper, ...]]] = {}
        self.max_rows = max_rows

        self._build_controls()
        super().__init__(self._layout())
        self.add_class("wb-builder")
        self._wire()
        if mapper is not None:
            self.steps, kind = steps_of(mapper)
            self._quiet = True
            self.combine_picker.value = kind
            self._quiet = False
        elif preset is not None:
            self.preset_picker.value = preset
            self.load_preset()
        if target is not None:
            self.set_target(target)
        self.refresh()

    @staticmethod
    def presets() -> dict[str, str]:
        """Preset keys and what they do."""
        return _presets()

    def _preset_options(self) -> list[tuple[str, str]]:
        """(label, key) of every preset; those that apply to the source first, marked ★ (names and config only)."""
        from ..mapper.presets.suggest import suggest_rows

        try:
            _, rows = suggest_rows(self.source.catalog.tensors, self.config, registry=False)
        except WorkbenchError:
            rows = []
        suggested = [preset for preset, _ in rows if preset in _presets()]
        labels = self.presets()
        return [(f"★ {labels[key]}", key) for key in suggested] + [(label, key) for key, label in labels.items() if key not in suggested]

    def _find_config(self) -> Path | None:
        from ..mapper.presets.suggest import find_config

        return find_config(self.source.path, self.source.catalog)  # a URL's config.json too, as the CLI finds it

    # --- controls -----------------------------------------------------------------------------------
    def _build_controls(self) -> None:
        W = widgets
        self.header = W.HTML()
        self.preset_picker = labelled(
            W.Dropdown(options=[("(empty)", "")] + self._preset_options(), value="",
                       description="Preset", layout=W.Layout(width="380px")),
            "wb-builder-preset",
        )
        self.append_preset_button = labelled(
            W.Button(description="Append preset", icon="plus", button_style="primary",
                     tooltip="add the preset as one more step, built for the names the steps so far produce"),
            "wb-builder-append-preset")
        self.load_preset_button = labelled(W.Button(description="Replace", icon="download", tooltip="replace the steps with the preset's"), "wb-builder-load")
        self.checkpoint_name = labelled(W.Text(value="adapter", description="Name", layout=W.Layout(width="200px")),
                                        "wb-builder-checkpoint-name")
        self.checkpoint_path = labelled(W.Text(placeholder="folder of another checkpoint or PEFT adapter", description="Path",
                                               layout=W.Layout(width="420px")), "wb-builder-checkpoint-path")
        self.add_checkpoint_button = labelled(W.Button(description="Add checkpoint", icon="plus",
                                                       tooltip="read from a second source: its tensors become NAME::tensor"),
                                              "wb-builder-add-checkpoint")
        self.combine_picker = labelled(
            W.Dropdown(options=[(label, key) for key, label in COMBINE.items()], value="Sequential", description="Combine",
                       layout=W.Layout(width="420px")),
            "wb-builder-combine",
        )

        self.op_picker = labelled(W.ToggleButtons(options=OPERATIONS, value="Concat", style={"button_width": "92px"},
                                                  tooltips=[OUTPUT_HINTS[op] for op in OPERATIONS]), "wb-builder-op")
        self.name_search = labelled(
            W.Text(placeholder="search: a word, a glob (*.mlp.*) or a template (layers.{i}.*)", description="Names",
                   continuous_update=True, layout=W.Layout(width="560px")),
            "wb-builder-search")
        self.suggestions = labelled(NamePicker(options=[], rows=7, layout=W.Layout(width="560px", margin="0 0 0 90px")), "wb-builder-suggest")
        self.add_source_button = labelled(W.Button(description="Add selected", icon="plus",
                                                   tooltip="append the chosen names to the sources (Ctrl/Shift-click chooses several)"),
                                          "wb-builder-add-source")
        self.add_pattern_button = labelled(
            W.Button(description="Add all matching", icon="asterisk", layout=W.Layout(width="auto"),
                     tooltip="append the search itself when it is a glob of whole names (model.*, *), else every name it lists; "
                             "with no search: every name (*)"),
            "wb-builder-add-pattern")
        self.clear_sources_button = labelled(W.Button(description="Clear", icon="eraser", layout=W.Layout(width="90px")), "wb-builder-clear")
        self.sources_box = labelled(
            W.Textarea(placeholder="source names or {i} templates, one per line, in order", description="Sources",
                       layout=W.Layout(width="620px", height="76px")),
            "wb-builder-sources",
        )
        self.outputs_box = labelled(W.Text(description="Output", layout=W.Layout(width="620px")), "wb-builder-outputs")
        self.dim_box = W.IntText(value=0, description="dim", layout=W.Layout(width="150px"))
        self.dim0_box = W.IntText(value=0, description="dim0", layout=W.Layout(width="150px"))
        self.dim1_box = W.IntText(value=1, description="dim1", layout=W.Layout(width="150px"))
        self.sizes_box = W.Text(placeholder="empty: equal parts; or 64, 32, 32", description="sizes", layout=W.Layout(width="330px"))
        self.shape_box = W.Text(placeholder="e.g. 4, 2, 8, -1", description="shape", layout=W.Layout(width="330px"))
        self.dtype_picker = W.Dropdown(options=sorted(DTYPE_BITS), value="BF16", description="dtype", layout=W.Layout(width="200px"))
        self.keep_box = labelled(W.Text(placeholder="e.g. norm, bias", description="keep F32",
                                        tooltip="names with a segment containing one of these words are cast to F32 instead",
                                        layout=W.Layout(width="300px")), "wb-builder-keep")
        self.prefix_box = labelled(W.Text(placeholder="e.g. model.", description="or prefix", layout=W.Layout(width="260px"),
                                          tooltip="rename a prefix of every name instead of one name (leave Sources empty)"),
                                   "wb-builder-prefix")
        self.prefix_action = labelled(W.ToggleButtons(options=["strip", "add"], value="strip", style={"button_width": "60px"}),
                                      "wb-builder-prefix-action")
        self.code_box = labelled(
            W.Textarea(placeholder="any mapper expression, e.g. M.Rename('a', 'b')", description="Code",
                       layout=W.Layout(width="620px", height="76px")),
            "wb-builder-code",
        )
        self.merge_form = MergeForm(self.source_names, self._merge_target, active=False)
        self.add_button = labelled(W.Button(description="Add step", button_style="primary", icon="plus"), "wb-builder-add")
        self.cancel_button = W.Button(description="Cancel edit", layout=W.Layout(display="none"))
        self.form_message = labelled(W.HTML(), "wb-builder-form-message")

        self.steps_list = labelled(W.Select(options=[], rows=6, description="Steps", layout=W.Layout(width="760px")), "wb-builder-steps")
        self.step_detail = labelled(W.HTML(layout=W.Layout(width="860px")), "wb-builder-step-detail")
        self.edit_button = W.Button(description="Edit", icon="pencil", layout=W.Layout(width="90px"))
        self.remove_button = labelled(W.Button(description="Remove", icon="trash", layout=W.Layout(width="100px")), "wb-builder-remove")
        self.up_button = W.Button(description="Up", icon="arrow-up", layout=W.Layout(width="80px"))
        self.down_button = W.Button(description="Down", icon="arrow-down", layout=W.Layout(width="90px"))
        self.problems_view = labelled(W.HTML(layout=_unshrunk()), "wb-builder-problems")
        # one box per problem group: its problems, then its fix-it buttons right under them
        self.problem_groups_box = labelled(W.VBox(layout=_unshrunk()), "wb-builder-problem-groups")
        # capped and scrolled, so that a long list never pushes the preview out of view; its parts keep their
        # height (flex items of a capped box would otherwise shrink, the fix-it rows to 0 px) and scroll instead
        self.problems_panel = labelled(W.VBox([self.problems_view, self.problem_groups_box],
                                              layout=W.Layout(max_height="220px", overflow="auto")),
                                       "wb-builder-problems-panel")

        self.changed_only = W.Checkbox(value=False, description="changed only", indent=False, layout=W.Layout(width="130px"))
        self.fold_preview = W.Checkbox(value=True, description="fold layers (×N)", indent=False, layout=W.Layout(width="150px"))
        self.preview_table = labelled(W.HTML(layout=W.Layout(max_height="420px", overflow="auto")), "wb-builder-preview")

        self.graph_button = W.Button(description="Redraw", icon="refresh")
        self.graph_output = labelled(W.Output(), "wb-builder-graph")

        self.target_box = labelled(W.Text(placeholder="a target checkpoint, a config.json, or a model type (llama)", description="Target",
                                          layout=W.Layout(width="520px")), "wb-builder-target")
        self.target_button = labelled(W.Button(description="Check", icon="check"), "wb-builder-target-check")
        self.target_view = labelled(W.HTML(), "wb-builder-target-view")

        self.code_area = labelled(W.Textarea(layout=W.Layout(width="860px", height="220px")), "wb-builder-code-area")
        self.copy_button = labelled(W.Button(description="Copy", icon="copy", tooltip="refresh the code in the box, ready to select and copy"), "wb-builder-copy")
        self.clipboard = W.HTML()
        self.save_path = labelled(W.Text(value="mapper.py", description="Save to", layout=W.Layout(width="420px")), "wb-builder-save-path")
        self.save_button = labelled(W.Button(description="Save .py", icon="save"), "wb-builder-save")
        self.export_message = labelled(W.HTML(), "wb-builder-export-message")

    def _layout(self) -> list[widgets.Widget]:
        W = widgets
        self.params_box = W.HBox([self.dim_box, self.dim0_box, self.dim1_box, self.sizes_box, self.shape_box, self.dtype_picker,
                                  self.keep_box, self.prefix_box, self.prefix_action])
        form = W.VBox(
            [
                W.HTML("<b>Add an operation</b>"),
                self.op_picker,
                W.HBox([self.name_search, self.add_pattern_button]),
                W.HBox([self.suggestions, W.VBox([self.add_source_button, self.clear_sources_button])]),
                self.sources_box,
                self.outputs_box,
                self.params_box,
                self.merge_form.box,
                self.code_box,
                W.HBox([self.add_button, self.cancel_button]),
                self.form_message,
            ],
            layout=W.Layout(border="1px solid var(--jp-border-color2, #ddd)", padding="4px", margin="4px 0"),
        )
        steps = W.VBox([W.HBox([self.steps_list, W.VBox([self.edit_button, self.remove_button, self.up_button, self.down_button])]),
                        self.step_detail, self.problems_panel])
        self.tabs = W.Tab(
            children=[
                W.VBox([W.HBox([self.changed_only, self.fold_preview]), self.preview_table]),
                W.VBox([self.graph_button, self.graph_output]),
                W.VBox([W.HBox([self.target_box, self.target_button]), self.target_view]),
                # one copy button: the clipboard one (copy_button / copy_code() stay for code that calls them)
                W.VBox([self.clipboard, self.code_area, W.HBox([self.save_path, self.save_button]), self.export_message]),
            ],
            titles=["Preview", "Graph", "Target", "Export"],
        )
        sources = W.HBox([self.checkpoint_name, self.checkpoint_path, self.add_checkpoint_button])
        presets = W.HBox([self.preset_picker, self.append_preset_button, self.load_preset_button])
        parts = [self.header, sources, presets, self.combine_picker, form, steps, self.tabs]
        fit_narrow(*parts)
        return parts

    def _wire(self) -> None:
        self.load_preset_button.on_click(lambda _: self.load_preset())
        self.append_preset_button.on_click(lambda _: self.append_preset())
        self.add_checkpoint_button.on_click(lambda _: self.add_checkpoint())
        self.combine_picker.observe(lambda _: None if self._quiet else self.refresh(), names="value")
        self.op_picker.observe(lambda _: self._show_parameters(), names="value")
        self.add_source_button.on_click(lambda _: self.add_source())
        self.add_pattern_button.on_click(lambda _: self.add_matching())
        self.name_search.observe(lambda _: self._update_suggestions(), names="value")
        self.steps_list.observe(lambda _: self._show_step_detail(), names="value")
        self.clear_sources_button.on_click(lambda _: setattr(self.sources_box, "value", ""))
        self.sources_box.observe(lambda _: self._suggest_output(), names="value")
        self.add_button.on_click(lambda _: self.submit())
        self.cancel_button.on_click(lambda _: self._end_edit("Edit cancelled."))
        self.edit_button.on_click(lambda _: self.edit(self.steps_list.value))
        self.remove_button.on_click(lambda _: self.remove(self.steps_list.value))
        self.up_button.on_click(lambda _: self.move(self.steps_list.value, -1))
        self.down_button.on_click(lambda _: self.move(self.steps_list.value, +1))
        for box in (self.changed_only, self.fold_preview):
            box.observe(lambda _: self._show_preview(), names="value")
        self.graph_button.on_click(lambda _: self.draw_graph())
        self.tabs.observe(self._on_tab, names="selected_index")
        self.target_button.on_click(lambda _: self.check_clicked())
        self.copy_button.on_click(lambda _: self.copy_code())
        self.save_button.on_click(lambda _: self.save())
        self._show_parameters()

    # --- the mapper ---------------------------------------------------------------------------------------
    @property
    def mapper(self) -> Mapper:
        """The steps combined as chosen: `M.Sequential(*steps)` or `M.Parallel(*steps)`."""
        kind = M.Parallel if self.combine_picker.value == "Parallel" else M.Sequential
        return kind(*self.steps)

    def add(self, step: Mapper) -> None:
        """Append a step (any mapper) and refresh."""
        if not isinstance(step, Mapper):
            raise MapperError(f"Cannot add {step!r}: it is not a mapper. Pass an operation such as M.Rename(...).")
        self.steps.append(step)
        self.refresh(select=len(self.steps) - 1)

    def remove(self, index: int | None) -> None:
        """Remove step `index` (0-based)."""
        if index is None or not 0 <= index < len(self.steps):
            self.form_message.value = message_html("Choose a step in the list first.", "warning")
            return
        removed = self.steps.pop(index)
        if self._editing is not None:
            self._end_edit()
        self.form_message.value = message_html(f"Removed step {index + 1}: {removed.short()}", "info")
        self.refresh(select=min(index, len(self.steps) - 1) if self.steps else None)

    def move(self, index: int | None, offset: int) -> None:
        """Move step `index` up (-1) or down (+1)."""
        if index is None:
            return
        other = index + offset
        if 0 <= other < len(self.steps):
            before = len(self.binding.problems) if self.binding is not None else 0
            self.steps[index], self.steps[other] = self.steps[other], self.steps[index]
            self.refresh(select=other)
            self._say_moved(index, other, before)

    def _say_moved(self, index: int, position: int, before: int) -> None:
        """Say that a step moved, and whether the order changed what binds (in Sequential it may)."""
        after = len(self.binding.problems) if self.binding is not None else 0
        text = f"Moved step {index + 1} to position {position + 1}"
        if after > before:
            self.form_message.value = message_html(f"{text}: {after - before} new problem(s) — the steps read other names now.", "warning")
        elif after < before:
            self.form_message.value = message_html(f"{text}: {before - after} problem(s) fewer.", "ok")
        else:
            self.form_message.value = message_html(f"{text}.", "info")

    def add_checkpoint(self, name: str | None = None, path: str | os.PathLike | None = None) -> None:
        """Add another source (the Name/Path boxes unless given): the builder then works over all sources,
        the first keeping its names and this one's tensors named `NAME::tensor` (workbench.formats.multi)."""
        from ..explore.checkpoint import open_checkpoint

        name = (self.checkpoint_name.value if name is None else name).strip()
        path = str(self.checkpoint_path.value if path is None else path).strip()
        paths = dict(getattr(self.source.catalog, "source_paths", None) or {"base": str(self.source.path)})
        if not name or not path or name in paths:
            self.form_message.value = message_html(
                f"Cannot add checkpoint {name!r}: give a new source name (not one of {sorted(paths)}) and a path.", "error")
            return
        try:
            self.source = open_checkpoint({**paths, name: path})
        except WorkbenchError as exc:
            self.form_message.value = message_html(exc.message, "error")
            return
        self.form_message.value = message_html(f"Added source {name!r}: its tensors are named {name}::….", "ok")
        self.refresh()

    def load_preset(self, key: str | None = None) -> None:
        """Replace the steps with a preset's (the picker's choice unless `key` is given)."""
        key = self.preset_picker.value if key is None else key
        if not key:
            self.steps = []
            self.refresh()
            return
        from ..mapper.presets.suggest import build_preset

        label = _presets()[key]
        try:
            preset = build_preset(key, self.source.catalog, self.config)
        except WorkbenchError as exc:
            self.form_message.value = message_html(exc.message, "error")
            return
        self.steps, kind = steps_of(preset)
        self._quiet = True
        try:
            self.combine_picker.value = kind
        finally:
            self._quiet = False
        self.form_message.value = message_html(f"Loaded preset {label!r}: {len(self.steps)} step(s).", "ok")
        self.refresh()

    def append_preset(self, key: str | None = None) -> bool:
        """Add a preset (the picker's choice unless `key` is given) as one more step, built for the names
        the steps so far produce: `cast_policy` lists those names, `hf_to_fused` finds the layers under
        their current prefix. False, with a message, when the preset cannot be built."""
        key = self.preset_picker.value if key is None else key
        if not key:
            self.form_message.value = message_html("Choose a preset first.", "warning")
            return False
        from ..mapper.presets.suggest import build_preset

        names = self.names_before()
        source = self.source.catalog if not self.steps or key in ("lora_merge", "average") else names
        layers = layers_template(names)
        options = {"layers": layers} if layers else {}
        try:
            preset = build_preset(key, source, self.config, options)
        except WorkbenchError as exc:
            self.form_message.value = message_html(exc.message, "error")
            return False
        self.steps.append(preset)
        index = len(self.steps) - 1
        self.refresh(select=index)
        label = self.step_labels()[index]
        problems = len(self.stepwise.problems[index]) if self.stepwise is not None else 0
        text = f"Appended preset {_presets().get(key, key)!r} as step {index + 1}: {label}"
        self.form_message.value = message_html(text + (f" — {problems} problem(s), see below." if problems else ""),
                                               "warning" if problems else "ok")
        return True

    # --- the form --------------------------------------------------------------------------------------
    def _show_parameters(self) -> None:
        kind = self.op_picker.value
        shown = set(PARAMETERS[kind])
        for name, box in (("dim", self.dim_box), ("dim0", self.dim0_box), ("dim1", self.dim1_box), ("sizes", self.sizes_box),
                          ("shape", self.shape_box), ("dtype", self.dtype_picker)):
            box.layout.display = None if name in shown else "none"
        self.keep_box.layout.display = None if "keep" in shown else "none"
        for box in (self.prefix_box, self.prefix_action):
            box.layout.display = None if "prefix" in shown else "none"
        self.code_box.layout.display = None if kind == CODE else "none"
        self.merge_form.box.layout.display = None if kind == MERGE else "none"
        self.merge_form.active = kind == MERGE
        self.merge_form.update()
        for box in (self.sources_box, self.suggestions, self.add_source_button, self.clear_sources_button, self.name_search,
                    self.add_pattern_button):
            box.layout.display = "none" if kind in NO_NAMES else None
        self.outputs_box.layout.display = "none" if kind in NO_OUTPUTS else None
        self.outputs_box.placeholder = OUTPUT_HINTS[kind]
        self._suggest_output()

    def add_source(self, name: str | list[str] | tuple[str, ...] | None = None) -> None:
        """Append names (the picker's chosen names by default; a glob or template is kept as written) to the
        sources box."""
        chosen = list(self.suggestions.value) if name is None else [name] if isinstance(name, str) else list(name)
        chosen = [n for n in chosen if n]
        if not chosen:
            self.form_message.value = message_html("Choose names in the list (or type a search to add as a glob) first.", "warning")
            return
        lines = _split_names(self.sources_box.value)
        if self.op_picker.value in SINGLE_SOURCE and self.op_picker.value not in PER_SOURCE:
            lines = []  # one source only: the new choice replaces the old one
        self.sources_box.value = "\n".join([*lines, *[n for n in chosen if n not in lines]])

    def add_matching(self) -> None:
        """Append what the search selects: the search text itself when, read as a glob of whole names, it picks
        exactly the names listed (`model.*`, `*`), else each listed name or template."""
        text = self.name_search.value.strip() or "*"  # no search: all of them, as the button says
        names = list(self.names_before(self._editing))
        try:
            exact = set(globs.match_names(text, names)) == set(filter_names(names, text))
        except WorkbenchError as exc:
            self.form_message.value = message_html(exc.message, "error")
            return
        self.add_source(text if exact else [value for _, value in self.suggestions.options])

    def _suggest_output(self) -> None:
        kind = self.op_picker.value
        sources = _split_names(self.sources_box.value)
        if kind in ("Concat", "Stack"):
            guess = suggest_output(sources)
        elif kind == "Rename":
            guess = sources[0] if sources else ""
        else:
            guess = ""
        if self.outputs_box.value.strip() in ("", self._auto_output):
            self.outputs_box.value = guess
        self._auto_output = guess

    def build_operation(self) -> Mapper:
        """The operation the form describes (raises MapperError with a message for the user)."""
        kind = self.op_picker.value
        if kind == CODE:
            return self._from_code(self.code_box.value)
        if kind == MERGE:
            return self.merge_form.build()
        sources = _split_names(self.sources_box.value)
        outputs = _split_names(self.outputs_box.value) if kind not in NO_OUTPUTS else []
        prefix = self.prefix_box.value.strip() if kind == "Rename" else ""
        if prefix:
            if sources:
                raise MapperError("Cannot add Rename: give either names (Sources and Output) or a prefix, not both. "
                                  "Clear the sources to rename a prefix, or clear the prefix.")
            return globs.prefix_rename(prefix, "") if self.prefix_action.value == "strip" else globs.prefix_rename("", prefix)
        if not sources:
            raise MapperError(f"Cannot add {kind}: no source names. Pick names and click 'Add selected', or type names (one per line).")
        names = self.names_before(self._editing)
        keep = tuple(_split_names(self.keep_box.value)) if kind == "Cast" else ()
        if keep:  # kinds kept in another dtype: no glob says "all but norms", so the names are listed (see _expand_globs)
            return self._expand_globs(kind, sources, outputs, names, keep)
        if kind == "Rename" and len(sources) == 1 and len(outputs) == 1 and _is_prefix_only(sources[0], names):
            return M.Rename(sources[0] + ".*", outputs[0] + ".*")  # a module prefix such as 'model.layers.{i}': a glob
        if kind in SINGLE_SOURCE and len(sources) > 1:
            if (kind in PER_SOURCE or kind in ("Transpose", "Reshape")) and not outputs:  # e.g. several globs
                return M.Parallel(*[self._single(kind, name, None) for name in sources])
            raise MapperError(f"Cannot add {kind}: it takes one source, and {len(sources)} are listed. Keep one (or use a {{i}} template).")
        if kind in ("Concat", "Stack"):
            if len(outputs) != 1:
                raise MapperError(f"Cannot add {kind}: give exactly one output name (got {len(outputs)}).")
            return getattr(M, kind)(sources, outputs[0], dim=self.dim_box.value)
        if kind in ("Split", "Unstack"):
            if not outputs:
                raise MapperError(f"Cannot add {kind}: list the names of the parts in Output, comma-separated.")
            if kind == "Split":
                sizes = _parse_ints(self.sizes_box.value, "sizes") or None
                return M.Split(sources[0], outputs, sizes=sizes, dim=self.dim_box.value)
            return M.Unstack(sources[0], outputs, dim=self.dim_box.value)
        if kind == "Rename" and len(outputs) != 1:
            raise MapperError("Cannot add Rename: give exactly one new name in Output.")
        if len(outputs) > 1:
            raise MapperError(f"Cannot add {kind}: it writes one tensor; give at most one output name.")
        return self._single(kind, sources[0], outputs[0] if outputs else None)

    def _expand_globs(self, kind: str, sources: list[str], outputs: list[str], names: Mapping[str, TensorInfo],
                      keep: tuple[str, ...]) -> Mapper:
        """A Cast keeping named kinds (norms, biases) in F32: the casts of the names each source matches at this step,
        listed (folded into {i} templates). Every other glob is added as written and binds where its step runs."""
        if outputs:
            raise MapperError("Cannot add Cast with 'keep F32' words: each tensor keeps its own name; clear Output.")
        position = len(self.steps) if self._editing is None else self._editing
        before = () if self.combine_picker.value == "Parallel" else tuple(self.steps[:position])
        return self._list_kept_cast((tuple(sources), self.dtype_picker.value, keep), names, before)

    def _list_kept_cast(self, recipe: tuple[tuple[str, ...], str, tuple[str, ...]], names: Mapping[str, TensorInfo],
                        before: tuple[Mapper, ...]) -> Mapper:
        sources, dtype, keep = recipe
        parts: list[Mapper] = []
        for source in sources:
            part = globs.glob_cast(source, names, dtype, keep=keep)
            parts.extend(part.mappers if isinstance(part, M.Parallel) else [part])
        step = parts[0] if len(parts) == 1 else M.Parallel(*parts)
        self._kept_casts[id(step)] = (step, recipe, before)
        return step

    def _relist_kept_casts(self) -> None:
        """List each keep-words Cast again for the names where it now runs, when the steps before it changed."""
        parallel = self.combine_picker.value == "Parallel"
        for index, step in enumerate(self.steps):
            entry = self._kept_casts.get(id(step))
            if entry is None or entry[0] is not step:
                continue
            before = () if parallel else tuple(self.steps[:index])
            if len(entry[2]) == len(before) and all(a is b for a, b in zip(entry[2], before, strict=True)):
                continue
            names = dict(self.source.catalog.tensors) if not before else bind_steps(self.steps[:index], self.source).before[index]
            try:
                fresh = self._list_kept_cast(entry[1], names, before)
            except MapperError:  # it matches nothing here: the old list stays, and its problems say why
                self._kept_casts[id(step)] = (step, entry[1], before)
                continue
            self.steps[index] = fresh
            if fresh is not step:
                self._kept_casts.pop(id(step), None)

    def _single(self, kind: str, name: str, dst: str | None) -> Mapper:
        if kind == "Rename":
            return M.Rename(name, dst)  # type: ignore[arg-type]
        if kind in ("Identity", "Drop"):
            return getattr(M, kind)(name)
        if kind == "Transpose":
            return M.Transpose(name, self.dim0_box.value, self.dim1_box.value, dst=dst)
        if kind == "Reshape":
            shape = _parse_ints(self.shape_box.value, "shape")
            if not shape:
                raise MapperError("Cannot add Reshape: give the new shape, e.g. 4, 2, 8, -1.")
            return M.Reshape(name, shape, dst=dst)
        return M.Cast(name, self.dtype_picker.value, dst=dst)

    @staticmethod
    def _from_code(text: str) -> Mapper:
        if not text.strip():
            raise MapperError("Cannot add code: the box is empty. Write a mapper expression such as M.Rename('a', 'b').")
        try:
            value = eval(text, {"M": M, "__builtins__": {}})  # the user's own expression, as if typed in a cell
        except MapperError:
            raise
        except Exception as exc:
            raise MapperError(f"Cannot add code: it does not evaluate ({type(exc).__name__}: {exc}). Write an expression using M.…") from None
        if not isinstance(value, Mapper):
            raise MapperError(f"Cannot add code: it gives a {type(value).__name__}, not a mapper. Write e.g. M.Rename('a', 'b').")
        return value

    def submit(self) -> bool:
        """Add the form's operation as a new step (or replace the step being edited). False on a mistake."""
        try:
            step = self.build_operation()
        except MapperError as exc:
            self.form_message.value = message_html(exc.message, "error")
            return False
        before = len(self.binding.problems) if self.binding is not None else 0
        if self._editing is not None:
            index = self._editing
            self.steps[index] = step
            verb = "Updated"
            self._end_edit()
        else:
            self.steps.append(step)
            index = len(self.steps) - 1
            verb = "Added"
        self.refresh(select=index)
        new_problems = len(self.binding.problems) - before if self.binding is not None else 0
        text = f"{verb} step {index + 1}: {self.step_labels()[index]}"
        self.sources_box.value = ""  # the step is kept either way: the form is ready for the next one
        self.outputs_box.value = ""
        self.code_box.value = ""
        self.prefix_box.value = ""
        if new_problems > 0:
            self.form_message.value = message_html(f"{text} — {new_problems} new problem(s), see below.", "warning")
        else:
            self.form_message.value = message_html(text, "ok")
        return True

    def edit(self, index: int | None) -> None:
        """Load step `index` into the form; the add button then updates it in place."""
        if index is None or not 0 <= index < len(self.steps):
            self.form_message.value = message_html("Choose a step in the list first.", "warning")
            return
        step = self.steps[index]
        kind = type(step).__name__
        if isinstance(step, M.PrefixScope) and isinstance(step.mapper, M.Sequential) and not step.mapper.mappers \
                and not (step.source_prefix and step.target_prefix):
            self.op_picker.value = "Rename"
            self.sources_box.value = self.outputs_box.value = ""
            self.prefix_action.value = "strip" if step.source_prefix else "add"
            self.prefix_box.value = step.source_prefix or step.target_prefix
        elif isinstance(step, MergeModels):
            self.op_picker.value = MERGE
            self.merge_form.load(step)
        elif isinstance(step, Op) and kind in PARAMETERS:
            self.op_picker.value = kind
            self.sources_box.value = "\n".join(step.inputs)
            fields = {f: getattr(step, f) for f in step.__dataclass_fields__}  # type: ignore[attr-defined]
            dst = fields.get("dst")
            outputs = fields.get("dsts") or ([dst] if dst else [])
            self.outputs_box.value = ", ".join(outputs)
            self._auto_output = ""
            if "dim" in fields:
                self.dim_box.value = fields["dim"]
            if kind == "Transpose":
                self.dim0_box.value, self.dim1_box.value = fields["dim0"], fields["dim1"]
            if kind == "Split":
                self.sizes_box.value = ", ".join(map(str, fields["sizes"])) if fields["sizes"] else ""
            if kind == "Reshape":
                self.shape_box.value = ", ".join(map(str, fields["shape"]))
            if kind == "Cast":
                self.dtype_picker.value = fields["dtype"]
        else:
            self.op_picker.value = CODE
            self.code_box.value = code_expr(step)
        self._editing = index
        self._update_suggestions()  # the names as they are before this step
        self.add_button.description = f"Update step {index + 1}"
        self.add_button.icon = "check"
        self.cancel_button.layout.display = None
        self.form_message.value = message_html(f"Editing step {index + 1}: change the fields, then click 'Update step {index + 1}'.")

    def _end_edit(self, message: str | None = None) -> None:
        self._editing = None
        self.prefix_box.value = ""
        self._update_suggestions()  # back to the names a new step would read
        self.add_button.description = "Add step"
        self.add_button.icon = "plus"
        self.cancel_button.layout.display = "none"
        if message:
            self.form_message.value = message_html(message)

    # --- refresh ----------------------------------------------------------------------------------------
    def refresh(self, select: int | None = None) -> None:
        """Re-bind the steps to the source (one walk, recording what each step sees) and update every view."""
        self._relist_kept_casts()
        self.stepwise = bind_steps(self.steps, self.source, parallel=self.combine_picker.value == "Parallel")
        self.binding = self.stepwise.binding
        self.header.value = self._header_html()
        labels = self.step_labels()
        options = [(f"{k + 1}. {label}", k) for k, label in enumerate(labels)]
        keep = select if select is not None else self.steps_list.value
        set_options(self.steps_list, options, keep)
        self.steps_list.tooltip = "\n".join(f"{k + 1}. {step.short()}" for k, step in enumerate(self.steps)) or None
        self._show_step_detail()
        self._update_suggestions()
        self._show_preview()
        self._show_problems()
        self._check_target()
        self._show_code()
        self.merge_form.set_sources(self.source_names())
        if self.op_picker.value == MERGE:
            self.merge_form.update()  # the names where a merge step would run may have changed
        self._graph_stale = True
        if self.tabs.selected_index == 1:
            self.draw_graph()

    def step_labels(self) -> list[str]:
        """Each step in words ("strip prefix `model.`", "cast 24 tensors → BF16, norms kept F32"); the code is in
        the list's tooltip and under the list for the chosen step."""
        wise = self.stepwise
        bound = wise is not None and len(wise.instances) == len(self.steps)
        return [merge_label(step, wise.instances[k] if bound else None) if isinstance(step, MergeModels)  # type: ignore[union-attr]
                else describe_step(step, wise.before[k], wise.instances[k]) if bound else describe_step(step)  # type: ignore[union-attr]
                for k, step in enumerate(self.steps)]

    def source_names(self) -> list[str]:
        """The source names of a multi-source checkpoint (the primary first): the models a Merge step can name;
        [] for a single checkpoint."""
        return list(getattr(self.source.catalog, "sources", None) or {})

    def _merge_target(self) -> Any:
        """What a Merge step added (or edited) now would read: the checkpoint when it comes first or the steps run in
        Parallel, else the names the steps before it produce."""
        position = len(self.steps) if self._editing is None else self._editing
        if position == 0 or self.combine_picker.value == "Parallel" or self.stepwise is None:
            return self.source
        return self.names_before(position)

    def names_before(self, index: int | None = None) -> Mapping[str, TensorInfo]:
        """The tensors (name -> TensorInfo) a step at position `index` reads: in Sequential the result of the
        steps before it, in Parallel the source. None: a step appended now."""
        wise = self.stepwise
        if wise is None or len(wise.before) != len(self.steps) + 1:
            return dict(self.source.catalog.tensors)
        k = len(self.steps) if index is None else max(0, min(index, len(self.steps)))
        return wise.before[k]

    def _show_step_detail(self) -> None:
        index = self.steps_list.value
        if index is None or not 0 <= index < len(self.steps):
            self.step_detail.value = ""
            return
        code = html.escape(code_expr(self.steps[index], prefix="M."))
        self.step_detail.value = (f'<details class="wb-step-code"><summary>step {index + 1} as code</summary>'
                                  f'<code style="white-space:pre-wrap;word-break:break-all">{code}</code></details>')

    def _header_html(self) -> str:
        ck = self.source
        binding = self.binding
        n_out = len(binding.outputs) if binding is not None else 0
        n_problems = len(binding.problems) if binding is not None else 0
        state = "ok" if binding is not None and binding.ok else "error"
        status = message_html(
            f"{len(self.steps)} step(s) · {n_out:,} output tensors · {n_problems} problem(s)", "ok" if state == "ok" and not n_problems else "error"
        )
        return (
            f"<b>MapperBuilder</b> over <code>{html.escape(str(ck.path))}</code> ({html.escape(ck.format)}, "
            f"{len(ck):,} tensors){status}"
        )

    def _update_suggestions(self) -> None:
        """Offer the names as they are where the next step runs (or the step being edited), folded ×N and
        narrowed by the search box (the filter syntax of workbench.names)."""
        names = list(self.names_before(self._editing))
        try:
            shown = filter_names(names, self.name_search.value.strip())
        except WorkbenchError:
            shown = []
        cache = self._fold_cache  # name -> layer template, kept across refreshes (most names stay)
        folds: dict[str, int] = {}
        for name in shown:
            template = cache.get(name)
            if template is None:
                template = cache[name] = fold_name(name)[0]
            folds[template] = folds.get(template, 0) + 1
        ordered = sorted(folds, key=natural_key)
        options = [(f"{t}  ×{folds[t]}" if folds[t] > 1 else t, t) for t in ordered]
        if list(self.suggestions.options) != options:
            keep = tuple(v for v in self.suggestions.value if v in folds)
            self.suggestions.options = options
            self.suggestions.value = keep

    def preview_frame(self, folded: bool | None = None, changed_only: bool | None = None) -> pd.DataFrame:
        """The outputs (name or layer pattern -> dtype, shape, bytes, the operation making it)."""
        folded = self.fold_preview.value if folded is None else folded
        changed_only = self.changed_only.value if changed_only is None else changed_only
        frame = self.binding.outputs_frame() if self.binding is not None else pd.DataFrame()
        if frame.empty:
            return frame
        frame = frame.rename(columns={"op": "made by"})
        if changed_only:
            frame = frame[frame["made by"] != "keep"]
        if folded:
            patterns = [fold_name(n)[0] for n in frame.index]
            grouped = frame.assign(pattern=patterns).groupby("pattern", sort=False)
            frame = grouped.agg(count=("dtype", "size"), dtype=("dtype", "first"), shape=("shape", "first"),
                                nbytes=("nbytes", "sum"), **{"made by": ("made by", "first")})
        order = sorted(range(len(frame)), key=lambda k: natural_key(frame.index[k]))
        return frame.iloc[order]

    def _show_preview(self) -> None:
        frame = self.preview_frame()
        if frame.empty:
            self.preview_table.value = message_html("no outputs")
            return
        shown = frame.drop(columns=[c for c in ("numel", "n_inputs") if c in frame.columns])
        formatters = {"nbytes": format_bytes, "shape": format_shape, "count": lambda n: f"×{n}"}
        noun = ("output pattern" if "count" in frame.columns else "output tensor") + ("" if len(frame) == 1 else "s")
        self.preview_table.value = frame_table(shown, max_rows=self.max_rows, formatters=formatters, noun=noun)

    def problem_groups(self) -> list[ProblemGroup]:
        """The binding's problems grouped by step and kind, each group with the fixes that are obvious."""
        wise = self.stepwise
        if wise is None:
            return []
        groups: list[ProblemGroup] = []
        for index, problems in enumerate(wise.problems):
            by_kind: dict[str, list[Problem]] = {}
            for problem in problems:
                by_kind.setdefault(problem_group(problem), []).append(problem)
            for kind, members in sorted(by_kind.items(), key=lambda item: _KIND_ORDER.get(item[0], len(_KIND_ORDER))):
                group = ProblemGroup(index, kind, members)
                if kind == "names not found":
                    target = self._better_position(index, members)
                    if target is not None:
                        where = f"before step {target + 1}" if target < index else f"after step {target + 1}"
                        group.fixes.append((f"Move step {index + 1} {where}", lambda i=index, t=target: self.move_to(i, t)))
                    else:  # the names exist nowhere in the order: misspelt, perhaps
                        swaps = group.closest = self.closest_names(index, members)
                        if swaps:
                            first = next(iter(swaps.values()))
                            label = f"Use the closest name: {first}" if len(swaps) == 1 else f"Use the {len(swaps)} closest names"
                            group.fixes.append((label, lambda i=index, s=swaps: self.use_names(i, s)))
                if kind == "name clashes":
                    kept = [p.tensor for p in members if p.tensor and p.kind == "overwrite"]
                    if kept:
                        label = f"Drop {kept[0]!r} before step {index + 1}" if len(kept) == 1 else \
                            f"Drop the {len(kept)} old tensors before step {index + 1}"
                        group.fixes.append((label, lambda i=index, names=kept: self.drop_before(i, names)))
                group.fixes.append((f"Remove step {index + 1}", lambda i=index: self.remove(i)))
                groups.append(group)
        return groups

    def _better_position(self, index: int, problems: list[Problem]) -> int | None:
        """The nearest position for step `index` (Sequential only) where every name it missed exists and where
        the step, bound to the names there, has no problem; None when there is none."""
        wise = self.stepwise
        if wise is None or self.combine_picker.value == "Parallel" or len(self.steps) < 2:
            return None
        missing = {p.tensor for p in problems if p.tensor}
        candidates = sorted((p for p in range(len(self.steps)) if p != index), key=lambda p: abs(p - index))
        for position in candidates[:MAX_MOVE_TRIALS]:
            seen = wise.before[position] if position < index else wise.before[position + 1]
            if missing and all(_names_match(text, seen) for text in missing) and self.steps[index].bind(seen).ok:
                return position
        return None

    def closest_names(self, index: int, problems: list[Problem]) -> dict[str, str]:
        """For each name step `index` reads as typed and did not find ('missing' problems), the closest name that
        exists where the step runs (a template for a template, see `closest_name`): typed -> closest."""
        if not 0 <= index < len(self.steps):
            return {}
        typed = {name for leaf in _unscoped_leaves(self.steps[index]) for name in leaf.inputs}
        seen = self.names_before(index)
        folds: dict[int, list[str]] | None = None
        swaps: dict[str, str] = {}
        for problem in problems:
            text = problem.tensor
            if problem.kind != "missing" or not text or text in swaps or text not in typed or is_glob(text):
                continue  # a glob, or one filled instance of a template (its other layers were found)
            folds = layer_folds(seen) if folds is None else folds
            guess = closest_name(text, seen, folds)
            if guess is not None and guess != text and _names_match(guess, seen):
                swaps[text] = guess
        return swaps

    def use_names(self, index: int, swaps: Mapping[str, str]) -> None:
        """Replace names (typed -> new) in step `index`: the fix-it "Use the closest name" for a misspelt name."""
        if not 0 <= index < len(self.steps) or not swaps:
            return
        try:
            self.steps[index] = _with_names(self.steps[index], swaps)
        except MapperError as exc:
            self.form_message.value = message_html(exc.message, "error")
            return
        if self._editing == index:
            self._end_edit()
        said = ", ".join(f"'{old}' → '{new}'" for old, new in swaps.items())
        self.form_message.value = message_html(f"Step {index + 1} now reads the closest name(s): {said}.", "info")
        self.refresh(select=index)

    def drop_before(self, index: int, names: list[str]) -> None:
        """Insert a step dropping `names` (folded into templates where exact) before step `index`: the fix the
        binder suggests when a step writes over a tensor nothing consumes."""
        before = self.names_before(index)
        templates = globs.fold_exactly([n for n in names if n in before], before) or names
        drops = [M.Drop(t) for t in templates]
        self.steps.insert(index, drops[0] if len(drops) == 1 else M.Parallel(*drops))
        self.form_message.value = message_html(f"Inserted step {index + 1}: drop {len(names)} tensor(s) that step {index + 2} writes over.", "info")
        self.refresh(select=index)

    def move_to(self, index: int, position: int) -> None:
        """Move step `index` to `position` (0-based; the steps in between shift down)."""
        if not (0 <= index < len(self.steps) and 0 <= position < len(self.steps)):
            return
        before = len(self.binding.problems) if self.binding is not None else 0
        step = self.steps.pop(index)
        self.steps.insert(position, step)
        self.refresh(select=position)
        self._say_moved(index, position, before)

    def _show_problems(self) -> None:
        self._step_words = {}
        groups = self.problem_groups()
        if not groups:
            self.problems_view.value = message_html("No problems: every operation binds to the source.", "ok")
            self.problem_groups_box.children = ()
            self._groups_html = ""
            return
        total = sum(len(group.problems) for group in groups)
        self.problems_view.value = f"<b>Problems ({total})</b> — grouped by step, each with its fixes"
        boxes = []
        texts = self._group_html(groups)
        self._groups_html = "".join(texts)
        for group, text in zip(groups, texts, strict=True):
            buttons = []
            for label, action in group.fixes:
                button = widgets.Button(description=label, icon="wrench", layout=widgets.Layout(width="auto", flex="0 0 auto"),
                                        tooltip=f"{label}: fixes '{group.kind}' of step {group.step + 1}")
                button.add_class("wb-builder-fix")
                button.on_click(lambda _, act=action: act())
                buttons.append(button)
            fixes = labelled(widgets.HBox(buttons, layout=widgets.Layout(flex_flow="row wrap", flex="0 0 auto", margin="0 0 4px 16px")),
                             "wb-builder-fixes")
            boxes.append(labelled(widgets.VBox([widgets.HTML(text, layout=_unshrunk()), fixes], layout=_unshrunk()),
                                  "wb-builder-problem-group"))
        self.problem_groups_box.children = tuple(boxes)

    def _group_html(self, groups: list[ProblemGroup]) -> list[str]:
        """Each problem group as HTML: a heading (step, count, kind) over its first problems."""
        labels = self.step_labels()
        parts = []
        for group in groups:
            step = f"Step {group.step + 1} · {html.escape(labels[group.step])}" if group.step < len(labels) else "Steps"
            n = len(group.problems)
            error = any(p.severity == "error" for p in group.problems)
            color = "var(--jp-error-color1, #c62828)" if error else "var(--jp-warn-color1, #b26a00)"
            items = "".join(f"<li>{html.escape(self.problem_text(p, group.step, labels, group.closest))}</li>"
                            for p in group.problems[:SHOWN_PER_GROUP])
            more = f"<li>… {n - SHOWN_PER_GROUP} more (builder.binding.problems)</li>" if n > SHOWN_PER_GROUP else ""
            parts.append(
                f'<details class="wb-problem-group" open><summary style="color:{color}">{step} — {n} {html.escape(_counted(group.kind, n))}'
                f'</summary><ul class="wb-problems" style="margin:2px 0">{items}{more}</ul></details>'
            )
        return parts

    def problem_text(self, problem: Problem, index: int, labels: list[str] | None = None, closest: Mapping[str, str] | None = None) -> str:
        """`problem`'s message with the code of the operations it names (`short()`, e.g. "PrefixScope(Sequential(),
        source_prefix='model.')") said as the builder lists step `index`: "step 3 (strip prefix 'model.')", or
        "Cast 'x' in step 3 (...)" for one operation of a composite step; the closest name, when `closest` has one
        for the problem's name, as the template its fix-it uses. The mapper's own message is unchanged."""
        message = problem.message
        if closest and problem.tensor in closest:
            message = _CLOSEST.sub(lambda _: f" The closest name is '{closest[problem.tensor]}'.", message, count=1)
        if not 0 <= index < len(self.steps) or "(" not in message:
            return message
        step = self.steps[index]
        whole, words = self._step_words.get(index) or self._words_of(index, labels)
        words = dict(words)
        if problem.op and problem.op not in words:  # one instance of a template, or an operation in a scope
            words[problem.op] = whole if isinstance(step, Op) else f"a {problem.op.split('(')[0]} in {whole}"
        for code in sorted(words, key=len, reverse=True):  # the longest first: a part's code is inside its step's
            if code in message:
                message = message.replace(code, words[code])
        return message

    def _words_of(self, index: int, labels: list[str] | None) -> tuple[str, dict[str, str]]:
        """Step `index` in words ("step 3 (strip prefix 'model.')") and the code of it and its operations -> words
        (kept until the problems are shown again)."""
        step = self.steps[index]
        wise = self.stepwise
        bound = wise is not None and len(wise.instances) == len(self.steps) and bool(wise.instances[index])
        if isinstance(step, Op) and not bound:
            label = _op_words(step)  # a label such as "cast (no tensor matched yet)" says less than the names typed
        elif isinstance(step, PrefixScope):
            label = describe_step(step)  # without its count of names, which reads as a second parenthesis
        else:
            label = (labels if labels is not None else self.step_labels())[index]
        plain = label.replace("`", "'")
        whole = f"step {index + 1} ({plain})"
        words = {step.short(): whole}
        if not isinstance(step, Op):
            for leaf in list(_unscoped_leaves(step))[:WORDED_LEAVES]:
                words.setdefault(leaf.short(), f"{_op_words(leaf)} in {whole}")
        self._step_words[index] = (whole, words)
        return whole, words

    @property
    def problems_html(self) -> str:
        """The problems as one piece of HTML (heading and every group), for the static copy and for tests."""
        return self.problems_view.value + self._groups_html

    def _on_tab(self, change: Any) -> None:
        if change["new"] == 1 and self._graph_stale:
            self.draw_graph()

    def graph_figure(self) -> Any:
        """A matplotlib Figure of the mapper bound to the source (source -> operations -> outputs, folded ×N)."""
        from .graph import mapper_graph_figure

        return mapper_graph_figure(self.mapper, self.source, binding=self.binding, title=f"{self.combine_picker.value} of {len(self.steps)} step(s)")

    def draw_graph(self) -> None:
        """Draw the graph into the Graph tab."""
        replace_output(self.graph_output, self.graph_figure())
        self._graph_stale = False

    # --- target ------------------------------------------------------------------------------------------
    def set_target(self, target: Any) -> None:
        """Check the outputs against `target` from now on (None stops checking); see `workbench.mapper.check_target`."""
        if target is None:
            self.target, self._target, self.target_check, self.target_frame = None, None, None, None
            self.target_view.value = message_html("No target: give a target checkpoint path, or pass target=model.")
            return
        try:
            resolved = target_check.resolve_target(target)
        except WorkbenchError as exc:
            self.target_view.value = message_html(exc.message, "error")
            return
        self.target, self._target = target, resolved
        if not isinstance(target, (str, os.PathLike)):
            self.target_box.value = ""
            self.target_box.placeholder = f"checking against {resolved.description} (type a path to check another)"
        self._check_target()

    def set_target_text(self, text: str) -> None:
        """Check against what the Target box names: a checkpoint path, a config.json (or a folder holding only
        one), or a transformers model type such as 'llama' (built with the source's config.json sizes)."""
        text = text.strip()
        if not text:
            self.set_target(None)
            return
        from ..mapper.presets.transformers_target import config_target

        path = Path(text).expanduser()
        try:
            if path.is_file() and path.suffix == ".json":
                target: Any = config_target(path)
            elif path.is_dir() and (path / "config.json").is_file() and not _holds_tensors(path):
                target = config_target(path / "config.json")
            elif not path.exists() and _looks_like_model_type(text):
                target = config_target(self.config, model_type=text)
            else:
                target = text
        except WorkbenchError as exc:
            self.target_view.value = message_html(exc.message, "error")
            return
        self.set_target(target)
        if not isinstance(target, str):
            self.target_box.value = text  # keep what was typed: it names the target

    def check_clicked(self) -> None:
        """The Check button: the check takes seconds for a model type (transformers builds it on the meta device), so
        the button says "Checking…" and is disabled, and the view says what is being checked, until it ends."""
        text = self.target_box.value.strip()
        button = self.target_button
        button.disabled, button.description, button.icon = True, "Checking…", "hourglass-half"
        if text:
            self.target_view.value = message_html(f"Checking the outputs against {text}…")
        try:
            self.set_target_text(text)
        finally:
            button.disabled, button.description, button.icon = False, "Check", "check"

    def target_report(self) -> pd.DataFrame | None:
        """The last target check's differences (see `compare_to_target`), None without a target;
        `target_check` holds the whole TargetReport."""
        return self.target_frame

    def _check_target(self) -> None:
        if self._target is None or self.binding is None:
            if self.target is None:
                self.target_view.value = message_html("No target: give a target checkpoint path, or pass target=model.")
            return
        report = target_check.check_target(self.binding, None, self._target)
        self.target_check = report
        frame = report.frame.drop(columns="message")
        self.target_frame = frame
        summary = message_html(report.headline(), report.level)
        folded = fold_differences(frame)
        noun = "difference pattern" if len(folded) == 1 else "difference patterns"
        table = frame_table(folded, max_rows=self.max_rows, noun=noun,
                            formatters={"shape": _shape_or_blank, "target_shape": _shape_or_blank, "count": lambda n: f"×{n}"}) if len(frame) else ""
        self.target_view.value = f"<div class='wb-note'>target: {html.escape(report.target)}</div>{summary}{table}"

    # --- export ---------------------------------------------------------------------------------------------
    def code(self) -> str:
        """The mapper as a Python module (exactly `mapper.to_code()`)."""
        return self.mapper.to_code()

    def _show_code(self) -> None:
        code = self.code()
        self.code_area.value = code
        escaped = html.escape(code)
        self.clipboard.value = (
            '<span class="wb-clipboard">'
            f'<textarea class="wb-code-src" style="display:none">{escaped}</textarea>'
            '<button class="jupyter-button wb-clipboard-button" title="copy the code to the clipboard" '
            "onclick=\"navigator.clipboard.writeText(this.parentElement.querySelector('textarea.wb-code-src').value)"
            ".then(() => { this.textContent = 'Copied'; setTimeout(() => { this.textContent = 'Copy to clipboard'; }, 1500); })\">"
            "Copy to clipboard</button></span>"
        )

    def copy_code(self) -> str:
        """Put the current code in the export box (ready to select) and return it."""
        self._show_code()
        self.tabs.selected_index = 3
        self.export_message.value = message_html("The code is in the box below: select it and copy (Ctrl+A, Ctrl+C inside the box).")
        return self.code_area.value

    def save(self, path: str | os.PathLike | None = None) -> Path | None:
        """Write the mapper module to `path` (the path box by default). None, with a message, on failure."""
        target = Path(self.save_path.value if path is None else path).expanduser()
        if target.suffix != ".py":
            self.export_message.value = message_html(f"Cannot save to {str(target)!r}: use a .py file name (the CLI imports it).", "error")
            return None
        code = self.code()
        try:
            target.write_text(code)
        except OSError as exc:
            self.export_message.value = message_html(
                f"Cannot save to {str(target)!r}: {exc.strerror or exc}. Check that the folder exists and is writable.", "error")
            return None
        self.export_message.value = message_html(f"Saved {len(code.encode()):,} bytes to {target} (it defines `mapper`).", "ok")
        return target

    # --- static copy ---------------------------------------------------------------------------------------
    def _describe(self) -> str:
        n_out = len(self.binding.outputs) if self.binding is not None else 0
        n_problems = len(self.binding.problems) if self.binding is not None else 0
        return f"MapperBuilder over {self.source.path.name}: {len(self.steps)} step(s), {n_out} outputs, {n_problems} problem(s)"

    def _merge_tables_html(self) -> str:
        """The per-layer values of each Merge step (where it runs), and the Merge form's live table when it shows one."""
        parts = []
        for k, step in enumerate(self.steps):
            if isinstance(step, MergeModels):
                target = self.source if k == 0 or self.combine_picker.value == "Parallel" or self.stepwise is None \
                    else self.names_before(k)
                table = step_table_html(step, target)
                parts += [f"<div class='wb-merge-static'>step {k + 1}: {table}</div>"] if table else []
        if self.merge_form.active and self.merge_form.table.value:
            parts.append(f"<div class='wb-merge-static'>Merge form: {self.merge_form.table.value}</div>")
        return "".join(parts)

    def _repr_html_(self) -> str:
        steps = "".join(f"<li>{html.escape(label)}</li>" for label in self.step_labels()) or "<li>(no steps)</li>"
        return (
            f'<div class="wb-builder-static">{self._header_html()}'
            f"<b>{html.escape(self.combine_picker.value)} steps</b><ol>{steps}</ol>{self.problems_html}"
            + self._merge_tables_html()
            + f"<b>Preview</b>{self.preview_table.value}"
            + (f"<b>Target</b>{self.target_view.value}" if self.target is not None else "")
            + f"<b>Code</b><pre>{html.escape(self.code_area.value)}</pre></div>"
        )


__all__ = ["MapperBuilder", "closest_name", "compare_to_target", "expected_tensors", "steps_of", "suggest_output"]
