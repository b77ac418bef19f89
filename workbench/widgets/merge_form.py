"""The MapperBuilder's Merge form: the models (sources of a multi-source checkpoint), a method, its parameters,
and the value each parameter takes in each layer, updated as the fields change.

The methods and their parameters are read from `workbench.mapper.merge.methods.METHODS`. A parameter field
takes mergekit's value forms in a short text syntax (`parse_setting`):

- `0.5` — one value for every tensor; `true` / `false` for a boolean;
- `0, 0.5, 1` — a gradient over the layers (`[0, 0.5, 1]` also reads);
- `self_attn: 0, 1; mlp: 1, 0; 0.5` — per-filter values (a filter is a substring of the tensor name), the entry
  without a filter being the default for the rest;
- `@ft1: 0.7; @ft2: 0.3` — one value per model, for the parameters mergekit takes per model (`weight`,
  `density`, ...); `@ft1 mlp: 0, 1` combines both.

Two menus set the merge's dtypes as mergekit's config keys do: `dtype` (the inputs are cast to it and the method
computes in it; unset, the inputs' promoted dtype) and `out_dtype` (the dtype the merged tensors are written in;
unset, the one the method computed in).

The form builds `M.MergeModels(...)` (what `M.presets.merge` returns), binds it to the names where the step would
run, and shows a table of layer × parameter built from the bound `Merge` operations (`bound_parameters()`),
so it shows what the merge will compute with, defaults included. Mistakes are messages in the form, never
exceptions out of a callback.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ipywidgets as widgets
import pandas as pd

from ..dtypes import normalize_dtype
from ..errors import MapperError, WorkbenchError
from ..mapper.bind import source_names
from ..mapper.merge.methods import METHODS, Method, Parameter
from ..mapper.merge.models import MergeModels
from ..mapper.merge.op import Merge
from ..mapper.merge.parameters import layer_of
from .common import fit_narrow, frame_table, labelled, message_html

OUTSIDE = "outside layers"  # the table's row for embeddings, final norm, lm_head (mergekit evaluates them at t=0)
NO_BASE = ""
SCOPES = {"shared": "same for every model", "input": "per model", "non_base": "per model but the base"}
EXAMPLE = "0.5 · gradient 0, 0.5, 1 · self_attn: 0, 1; mlp: 1, 0; 0.5"
SHOWN_PROBLEMS = 3
DTYPES = ("float32", "bfloat16", "float16", "float64")  # the merge's dtype / out_dtype menus (mergekit's names)
_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


class FormError(MapperError):
    """A mistake in the Merge form's fields, said to the user in the form."""


# --- the text syntax -------------------------------------------------------------------------------------------
def _token(text: str, parameter: Parameter) -> Any:
    """One value of a parameter field: a number, or true/false."""
    word = text.strip()
    if word.lower() in ("true", "false"):
        return word.lower() == "true"
    if _NUMBER.match(word):
        number = float(word)
        return int(number) if number.is_integer() and "." not in word and "e" not in word.lower() else number
    want = "true or false" if parameter.kind == "bool" else "a number"
    raise FormError(f"Cannot read {parameter.name} {word!r}: it is not {want}. Write a number (0.5), a gradient of numbers "
                    "(0, 0.5, 1) or per-filter values (self_attn: 0, 1; mlp: 0.5).")


def _values(text: str, parameter: Parameter) -> Any:
    """A scalar or a gradient (several comma-separated values) of one entry."""
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    parts = body.split(",")
    if not body.strip() or any(not part.strip() for part in parts):
        raise FormError(f"Cannot read {parameter.name} {text.strip()!r}: a value is missing. Write e.g. 0.5 or 0, 0.5, 1.")
    values = [_token(part, parameter) for part in parts]
    for value in values:
        try:
            parameter.validate(value, "the Merge form")
        except WorkbenchError:
            raise FormError(f"Cannot use {parameter.name} = {value!r}: {parameter.name} is a {parameter.kind.rstrip('?')}. "
                            f"Write e.g. {'true' if parameter.kind == 'bool' else '0.5'}.") from None
    if len(values) > 1 and not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise FormError(f"Cannot read {parameter.name} {text.strip()!r}: a gradient is a list of numbers (0, 0.5, 1).")
    return values[0] if len(values) == 1 else values


def _assemble(entries: list[tuple[str | None, Any]]) -> Any:
    """Entries (filter or None, value) as mergekit's value: the plain value when there is one entry without a filter,
    else a list of {'filter': ..., 'value': ...} with the default (no filter) last."""
    if len(entries) == 1 and entries[0][0] is None:
        return entries[0][1]
    filtered = [{"filter": flt, "value": value} for flt, value in entries if flt is not None]
    rest = [{"value": value} for flt, value in entries if flt is None]
    return filtered + rest


def parse_setting(text: str, parameter: Parameter, models: Sequence[str] = ()) -> tuple[Any, dict[str, Any]]:
    """A parameter field's text (see the module docstring) as (global value or None, model -> value). FormError
    naming the parameter when the text is none of the forms."""
    scopes: dict[str | None, list[tuple[str | None, Any]]] = {}
    for raw in re.split(r"[;\n]", text):
        entry = raw.strip()
        if not entry:
            continue
        model = None
        if entry.startswith("@"):
            found = re.match(r"@([^\s:]+)\s*(.*)$", entry, re.S)
            model, entry = (found.group(1), found.group(2)) if found else ("", "")
            if parameter.scope == "shared":
                raise FormError(f"Cannot set {parameter.name} for model {model!r}: {parameter.name} is one value for the whole "
                                f"merge. Remove '@{model}'.")
            if model not in models:
                raise FormError(f"Cannot set {parameter.name} for model {model!r}: it is not among the models {list(models)}. "
                                "Choose it in Models, or fix the name.")
        flt: str | None = None
        head, colon, tail = entry.partition(":")
        if colon:
            flt, entry = head.strip(), tail
            if not flt and model is None:
                raise FormError(f"Cannot read {parameter.name} {raw.strip()!r}: a filter is missing before ':'. "
                                "Write e.g. self_attn: 0, 1.")
            if flt in ("", "*", "default"):
                flt = None
        items = scopes.setdefault(model, [])
        if any(seen == flt for seen, _ in items):
            said = f"filter {flt!r}" if flt else "the default (an entry without filter)"
            raise FormError(f"Cannot read {parameter.name}: {said} is given twice. Give each filter once.")
        items.append((flt, _values(entry, parameter)))
    shared = _assemble(scopes.pop(None)) if None in scopes else None
    return shared, {model: _assemble(entries) for model, entries in scopes.items()}


def setting_text(value: Any) -> str:
    """A mergekit value (scalar, gradient or filtered list) in the field syntax: the inverse of `parse_setting`."""
    def plain(item: Any) -> str:
        if isinstance(item, bool):
            return "true" if item else "false"
        if isinstance(item, (list, tuple)):
            return ", ".join(plain(v) for v in item)
        return str(item)

    if isinstance(value, Mapping):
        value = [value]
    if isinstance(value, list) and value and all(isinstance(item, Mapping) for item in value):
        return "; ".join(f"{item['filter']}: {plain(item['value'])}" if item.get("filter") not in (None, "*") else plain(item["value"])
                         for item in value)
    return plain(value)


def method_summary(spec: Method) -> str:
    """What a method takes, in a line: base model, number of inputs, parameters with their defaults."""
    base = {"required": "base model required", "optional": "base model optional", "forbidden": "no base model",
            "ignored": "no base model"}[spec.base]
    counts = []
    for what, low, high in (("inputs", spec.min_inputs, spec.max_inputs), ("models besides the base", spec.min_non_base, spec.max_non_base)):
        if high is not None and low == high:
            counts.append(f"exactly {low} {what}")
        elif high is not None:
            counts.append(f"{low or 0} to {high} {what}")
        elif low and low > 1:
            counts.append(f"at least {low} {what}")
    params = ", ".join(p.name + (" (required)" if p.required else f" = {setting_text(p.default)}") for p in spec.parameters)
    parts = [base, *counts, "random (seeded)" if spec.random else "", f"parameters: {params or 'none'}"]
    return f"{spec.name}: " + " · ".join(part for part in parts if part)


# --- the per-layer table ----------------------------------------------------------------------------------------
def _group_of(filters: Sequence[str], name: str) -> str | None:
    return next((flt for flt in filters if flt in name), None)


def _filters_of(value: Any) -> list[str]:
    if isinstance(value, Mapping):
        value = [value]
    if isinstance(value, list):
        return [item["filter"] for item in value if isinstance(item, Mapping) and item.get("filter") not in (None, "*")]
    return []


def _cell(values: list[Any]) -> Any:
    distinct = list(dict.fromkeys(values))
    if not distinct:
        return None
    if len(distinct) == 1:
        return distinct[0]
    numbers = [v for v in distinct if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if len(numbers) == len(distinct):
        return f"{min(numbers):.4g} … {max(numbers):.4g}"
    return " / ".join(str(v) for v in distinct)


def layer_table(step: MergeModels, merges: Sequence[Merge]) -> pd.DataFrame:
    """Layer × parameter: the value each parameter of `step` takes in each layer (row `OUTSIDE` for the tensors
    outside the layers), from the bound `merges`. A parameter given with filters has one column per filter
    (`t · self_attn`, ..., `t · rest`); one given per model has one column per model (`weight[ft1]`). Only the
    parameters `step` sets, and the required ones, are columns (the others keep their default). A cell holding
    different values for tensors of one layer and group (not expected) says their range."""
    spec = METHODS[step.method]
    parameters = step.arguments().get("parameters", {})
    per_model = step.arguments().get("model_parameters", {})
    shown = [p for p in spec.parameters if p.name in parameters or any(p.name in v for v in per_model.values()) or p.required]
    shown = shown or list(spec.parameters)  # nothing given: the defaults are what the merge uses
    cells: dict[tuple[str, str], dict[str, list[Any]]] = {}
    columns: dict[str, tuple[int, int, int]] = {}  # column -> (parameter, model, filter) order
    models = list(step.models)
    for index, parameter in enumerate(shown):
        shared = _filters_of(parameters.get(parameter.name))
        own = {model: _filters_of(values.get(parameter.name)) for model, values in per_model.items()}
        every = list(dict.fromkeys([*shared, *(f for found in own.values() for f in found)]))
        by_model = parameter.scope != "shared" and any(parameter.name in v for v in per_model.values())
        for merge in merges:
            row = OUTSIDE if (layer := layer_of(merge.output)) is None else str(layer)
            value = _value_of(merge, parameter)
            if isinstance(value, Mapping):
                items = list(value.items()) if by_model else [(None, v) for v in value.values()]
            else:
                items = [(None, value)]
            for model, item in items:
                # a model's value comes from its own setting, else the global one: their filters split its column
                filters = every if model is None else list(dict.fromkeys([*own.get(model, ()), *shared]))
                group = _group_of(filters, merge.output)
                where = f" · {group}" if group else " · rest" if filters else ""
                column = parameter.name + (f"[{model}]" if model is not None else "") + where
                columns.setdefault(column, (index, models.index(model) if model in models else -1,
                                            every.index(group) if group else len(every)))
                cells.setdefault((row, column), {}).setdefault("v", []).append(item)
    rows = sorted({row for row, _ in cells}, key=lambda r: -1 if r == OUTSIDE else int(r))
    columns = sorted(columns, key=columns.__getitem__)  # type: ignore[assignment]
    frame = pd.DataFrame([[_cell(cells.get((row, column), {}).get("v", [])) for column in columns] for row in rows],
                         index=pd.Index(rows, name="layer"), columns=columns, dtype=object)
    return frame


def _value_of(merge: Merge, parameter: Parameter) -> Any:
    """What `merge` computes with for `parameter` (a value, model -> value, or 'unset' when required and missing)."""
    given = dict(merge.params).get(parameter.name)
    if isinstance(given, tuple):
        given = dict(given)
    if given is None:
        if parameter.required:
            return "unset"
        return parameter.default
    if isinstance(given, Mapping) and parameter.scope != "shared":
        return {model: given.get(model, "unset" if parameter.required else parameter.default) for model in merge.models
                if parameter.scope == "input" or model != merge.base}
    return given


def _unset(step: MergeModels, merges: Sequence[Merge]) -> str | None:
    """What to say when a required parameter is unset for some tensors (a filter list without default), else None."""
    for parameter in METHODS[step.method].parameters:
        if not parameter.required:
            continue
        lacking = [m.output for m in merges if _value_of(m, parameter) == "unset"
                   or (isinstance(v := _value_of(m, parameter), Mapping) and "unset" in v.values())]
        if lacking:
            return (f"Cannot merge by {step.method}: {parameter.name} is required and not set for {len(lacking)} tensor(s), e.g. "
                    f"{lacking[0]!r}. Give a value (0.5), a gradient (0, 0.5, 1), or a default entry after the filters "
                    "(self_attn: 0, 1; 0.5).")
    return None


def _show(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def merge_label(step: MergeModels, instances: Sequence[Any] | None = None) -> str:
    """A Merge step in words for the builder's list: "merge ft1 + ft2 by slerp (base ft1) → 39 tensors"."""
    notes = [f"base {step.base_model}"] if step.base_model else []
    notes += [f"{field} {getattr(step, field)}" for field in ("dtype", "out_dtype") if getattr(step, field)]
    count = sum(isinstance(op, Merge) for op in instances or ())
    return (f"merge {' + '.join(step.models)} by {step.method}" + (f" ({', '.join(notes)})" if notes else "")
            + (f" → {count} tensors" if count else ""))


# --- the form ---------------------------------------------------------------------------------------------------
class MergeForm:
    """The Merge part of the MapperBuilder's form (also usable alone): `box` holds the controls, `build()` the step.

    `sources()` gives the checkpoint's source names (the primary first); `target()` what the step would read (the
    checkpoint, or the names where the step runs) for the live table. `active`: update the table as fields change
    (the builder turns it on while its form shows Merge). Controls are public attributes."""

    def __init__(self, sources: Callable[[], Sequence[str]], target: Callable[[], Any], *, active: bool = True) -> None:
        W = widgets
        self.active = active
        self._sources = sources
        self._target = target
        self._texts: dict[str, str] = {}  # parameter name -> text typed, kept when the method changes
        self._quiet = False
        self.frame: pd.DataFrame = pd.DataFrame()
        self.problems: list[str] = []
        self.models_picker = labelled(W.SelectMultiple(options=[], rows=3, description="Models", layout=W.Layout(width="420px"),
                                                       tooltip="the sources to merge (Ctrl/Shift-click chooses several)"),
                                      "wb-merge-models")
        self.method_picker = labelled(W.Combobox(options=list(METHODS), value="linear", ensure_option=False, description="Method",
                                                 placeholder="slerp, ties, …", layout=W.Layout(width="300px")), "wb-merge-method")
        self.base_picker = labelled(W.Dropdown(options=[("(none)", NO_BASE)], value=NO_BASE, description="Base",
                                               layout=W.Layout(width="300px")), "wb-merge-base")
        self.seed_box = labelled(W.Text(placeholder="e.g. 0", description="seed", layout=W.Layout(width="200px")), "wb-merge-seed")
        self.dtype_picker = labelled(W.Dropdown(options=[("(inputs' dtype)", "")] + [(d, d) for d in DTYPES], value="",
                                                description="dtype", layout=W.Layout(width="240px"),
                                                tooltip="mergekit's dtype: the inputs are cast to it and the merge computes in it"),
                                     "wb-merge-dtype")
        self.out_dtype_picker = labelled(W.Dropdown(options=[("(the merge's dtype)", "")] + [(d, d) for d in DTYPES], value="",
                                                    description="out_dtype", layout=W.Layout(width="260px"),
                                                    tooltip="mergekit's out_dtype: the dtype the merged tensors are written in"),
                                         "wb-merge-out-dtype")
        self.method_info = labelled(W.HTML(), "wb-merge-info")
        self.parameters_box = labelled(W.VBox(), "wb-merge-parameters")
        self.parameter_boxes: dict[str, widgets.Text] = {}
        self.message = labelled(W.HTML(), "wb-merge-message")
        self.table = labelled(W.HTML(layout=W.Layout(max_height="320px", overflow="auto")), "wb-merge-table")
        self.box = labelled(W.VBox([W.HTML("<b>Merge whole models</b> (the sources of a multi-source checkpoint)"), W.HBox([self.models_picker, W.VBox([self.method_picker, self.base_picker])]), self.method_info,
                                    self.parameters_box, W.HBox([self.dtype_picker, self.out_dtype_picker]), self.seed_box,
                                    self.message, self.table]), "wb-merge-form")
        for control in (self.models_picker, self.base_picker, self.seed_box, self.dtype_picker, self.out_dtype_picker):
            control.observe(lambda _: self.update(), names="value")
        self.method_picker.observe(lambda _: self._method_changed(), names="value")
        self.set_sources(list(sources()))
        self._method_changed()

    # --- controls ---------------------------------------------------------------------------------------------
    def set_sources(self, names: Sequence[str]) -> None:
        """Offer `names` as the models and the base (keeping what is chosen and still offered; all by default)."""
        names = list(names)
        if list(self.models_picker.options) == names:
            return
        chosen = [n for n in self.models_picker.value if n in names]
        base = self.base_picker.value
        self._quiet = True
        try:
            self.models_picker.options = names
            self.models_picker.value = tuple(chosen or names)
            self.base_picker.options = [("(none)", NO_BASE)] + [(n, n) for n in names]
            self.base_picker.value = base if base in names else NO_BASE
        finally:
            self._quiet = False
        self._default_base()
        self.update()

    def _spec(self) -> Method | None:
        return METHODS.get(self.method_picker.value.strip())

    def _default_base(self) -> None:
        spec = self._spec()
        if spec is not None and spec.base == "required" and self.base_picker.value == NO_BASE and self.models_picker.options:
            self._quiet = True
            self.base_picker.value = self.models_picker.options[0]
            self._quiet = False

    def _method_changed(self) -> None:
        spec = self._spec()
        for name, box in self.parameter_boxes.items():
            self._texts[name] = box.value
        rows = []
        self.parameter_boxes = {}
        for parameter in spec.parameters if spec is not None else ():
            default = "required" if parameter.required else f"default {setting_text(parameter.default)}"
            box = labelled(widgets.Text(value=self._texts.get(parameter.name, ""), description=parameter.name,
                                        placeholder=EXAMPLE if parameter.kind != "bool" else "true or false",
                                        tooltip=f"{parameter.name}: {parameter.kind.rstrip('?')}, {SCOPES[parameter.scope]}, {default}",
                                        style={"description_width": "110px"}, layout=widgets.Layout(width="560px")),
                           f"wb-merge-param-{parameter.name}")
            box.add_class("wb-merge-param")
            box.observe(lambda _: self.update(), names="value")
            note = widgets.HTML(f"<span class='wb-note'>{html.escape(parameter.kind.rstrip('?'))}, {SCOPES[parameter.scope]}, "
                                f"{html.escape(default)}</span>")
            self.parameter_boxes[parameter.name] = box
            rows.append(widgets.HBox([box, note]))
        fit_narrow(*rows)  # built after the builder's layout was fitted: rows wrap, fields shrink to the row
        self.parameters_box.children = tuple(rows)
        self.base_picker.layout.display = None if spec is None or spec.base != "ignored" else "none"
        self.seed_box.layout.display = None if spec is not None and spec.random else "none"
        self.method_info.value = f"<div class='wb-note'>{html.escape(method_summary(spec))}</div>" if spec is not None else ""
        self._default_base()
        self.update()

    # --- the step -----------------------------------------------------------------------------------------------
    def build(self) -> MergeModels:
        """The step the fields describe, `M.MergeModels(...)`; FormError (a WorkbenchError) saying what to fix."""
        name = self.method_picker.value.strip()
        spec = METHODS.get(name)
        if spec is None:
            raise FormError(f"Cannot merge by {name!r}: unknown method. Choose one of {', '.join(METHODS)}." if name else
                            f"Cannot merge: no method. Choose one of {', '.join(METHODS)}.")
        models = list(self.models_picker.value)
        if not models:
            raise FormError("Cannot merge: no models chosen. Choose the sources to merge in Models (Ctrl/Shift-click for several).")
        base = self.base_picker.value or None if spec.base != "ignored" else None
        if spec.base == "required" and base is None:
            raise FormError(f"Cannot merge by {spec.name}: it needs a base model. Choose one in Base.")
        parameters: dict[str, Any] = {}
        model_parameters: dict[str, dict[str, Any]] = {}
        for parameter in spec.parameters:
            box = self.parameter_boxes.get(parameter.name)
            if box is None or not box.value.strip():
                continue
            shared, per = parse_setting(box.value, parameter, [*models, *([base] if base and base not in models else [])])
            if shared is not None:
                parameters[parameter.name] = shared
            for model, value in per.items():
                model_parameters.setdefault(model, {})[parameter.name] = value
        seed = None
        if spec.random and self.seed_box.value.strip():
            text = self.seed_box.value.strip()
            if not re.fullmatch(r"\d+", text):
                raise FormError(f"Cannot use seed {text!r}: write a whole number such as 0.")
            seed = int(text)
        return MergeModels(spec.name, models, base_model=base, parameters=parameters or None,
                           model_parameters=model_parameters or None, dtype=self.dtype_picker.value or None,
                           out_dtype=self.out_dtype_picker.value or None, seed=seed)

    def load(self, step: MergeModels) -> None:
        """Show `step` in the fields (to edit it)."""
        args = step.arguments()
        self._quiet = True
        try:
            self.method_picker.value = step.method
            base = step.base_model
            self.models_picker.value = tuple(m for m in step.models if m in self.models_picker.options)
            self.base_picker.value = base if base in self.models_picker.options else NO_BASE
            self.seed_box.value = "" if step.seed is None else str(step.seed)
            names = {normalize_dtype(d): d for d in DTYPES}
            self.dtype_picker.value = names.get(step.dtype, "") if step.dtype else ""
            self.out_dtype_picker.value = names.get(step.out_dtype, "") if step.out_dtype else ""
            for name, box in self.parameter_boxes.items():
                parts = []
                if name in args.get("parameters", {}):
                    parts.append(setting_text(args["parameters"][name]))
                for model, values in args.get("model_parameters", {}).items():
                    if name in values:
                        text = setting_text(values[name])
                        parts.extend(f"@{model} {piece}" if ":" in piece else f"@{model}: {piece}" for piece in text.split("; "))
                box.value = "; ".join(parts)
        finally:
            self._quiet = False
        self.update()

    def update(self) -> None:
        """Rebuild the step from the fields and show what it would do: the message and the per-layer table."""
        if self._quiet or not self.active:
            return
        self.frame, self.problems = pd.DataFrame(), []
        if len(self.models_picker.options) < 2:
            self._say("Merging needs several sources: add a checkpoint above (Name, Path, Add checkpoint), or open them "
                      "together, e.g. MapperBuilder({'a': 'a/', 'b': 'b/'}).", "warning")
            return
        try:
            step = self.build()
            target = self._target()
            binding = step.bind(target)
            names = getattr(getattr(target, "catalog", None), "tensors", target)
            instances, _ = step.bind_instances(dict.fromkeys(names), source_names(target))
        except WorkbenchError as exc:
            self._say(exc.message, "error")
            return
        merges = [op for op in instances if isinstance(op, Merge)]  # those whose parameters fail too (not in the binding)
        self.problems = list(dict.fromkeys(p.message for p in binding.problems))
        try:
            self.frame = layer_table(step, merges) if merges else pd.DataFrame()
        except WorkbenchError as exc:
            self._say(exc.message, "error")
            return
        unset = _unset(step, merges)
        if unset:
            self._say(unset, "error", keep_table=True)
            return
        if self.problems:
            more = f" … and {len(self.problems) - SHOWN_PROBLEMS} more" if len(self.problems) > SHOWN_PROBLEMS else ""
            self._say(" · ".join(self.problems[:SHOWN_PROBLEMS]) + more, "error", keep_table=bool(merges))
            return
        self._say(f"{step.method} of {', '.join(step.models)}: {len(merges)} tensors merged. The table lists the values each "
                  "layer uses.", "ok", keep_table=True)

    def _say(self, text: str, kind: str, keep_table: bool = False) -> None:
        self.message.value = message_html(text, kind)
        if keep_table and not self.frame.empty:
            self.table.value = table_html(self.frame, self._spec())
        else:
            self.table.value = ""


def table_html(frame: pd.DataFrame, spec: Method | None) -> str:
    """The per-layer table as HTML, with the parameters left at their default named below it."""
    shown = frame.map(_show)
    rest = [p for p in spec.parameters if not any(c.split("[")[0].split(" · ")[0] == p.name for c in frame.columns)] \
        if spec is not None else []
    note = ("<div class='wb-note'>at their default: " + html.escape(", ".join(f"{p.name} = {setting_text(p.default)}"
                                                                             for p in rest)) + "</div>") if rest else ""
    return "<b>Values per layer</b> (what the merge computes with)" + frame_table(shown, max_rows=400, noun="rows") + note


def step_table_html(step: MergeModels, target: Any) -> str:
    """The per-layer table of a Merge step bound where it runs (`target`: a checkpoint or the names before it), as
    HTML for the builder's static copy; '' when it does not bind."""
    try:
        names = getattr(getattr(target, "catalog", None), "tensors", target)
        instances, _ = step.bind_instances(dict.fromkeys(names), source_names(target))
        merges = [op for op in instances if isinstance(op, Merge)]
        return table_html(layer_table(step, merges), METHODS[step.method]) if merges else ""
    except WorkbenchError:
        return ""


__all__ = ["MergeForm", "layer_table", "merge_label", "method_summary", "parse_setting", "setting_text", "step_table_html",
           "table_html"]
