"""Binding: expand templates against a source catalog, infer every output, collect problems.

The binder walks the mapper tree over a `State` of metadata nodes, with the same semantics as
`evaluate.run` (leaves read then write, untouched names pass through, Parallel children read the
same state). Every user mistake becomes a `Problem`; nothing here raises for them. The result is
turned into dependency groups by `grouping.build_binding`.
"""

from __future__ import annotations

import difflib
import gc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..catalog import TensorInfo
from ..dtypes import normalize_dtype
from ..errors import MapperError, WorkbenchError
from ..names import Template, fill, placeholders_of
from .base import Mapper, Meta, Rest
from .claim import Claim
from .compose import Parallel, PrefixScope, Sequential
from .config_update import ConfigUpdate
from .groups import Binding, Problem, ProblemKind
from .op import Op
from .output_file import OutputFile
from .patterns import has_globs, no_match_message
from .patterns import instances as glob_instances
from .patterns import matcher as glob_matcher
from .ranges import expand as expand_ranges
from .ranges import has_ranges
from .state import Comp, Node, State, find, union
from .unsupported import Unsupported

Path = tuple[int, ...]


def _quoted(name: str) -> str:
    """A tensor name in a message, quoted as typed (a repr would double each backslash of 'model\\.layers')."""
    return f"'{name}'"


def source_infos(source: Any) -> list[TensorInfo]:
    """The source's tensors as TensorInfos in source order (Catalog, Mapping, or object with `.catalog`)."""
    catalog = getattr(source, "catalog", None)
    if isinstance(catalog, Mapping):
        source = catalog
    tensors = getattr(source, "tensors", None)
    items = tensors.items() if isinstance(tensors, dict) else source.items() if isinstance(source, Mapping) else None
    if items is None:
        raise MapperError(
            f"Cannot bind a mapper to {type(source).__name__}: expected a Catalog, a checkpoint, or a mapping "
            "name -> TensorInfo/tensor. Pass wb.open_checkpoint(path) or its .catalog."
        )
    infos = []
    for name, value in items:
        if isinstance(value, TensorInfo):
            infos.append(value if value.name == name else value.with_name(name))
        elif hasattr(value, "dtype") and hasattr(value, "shape"):
            try:
                dtype = normalize_dtype(value.dtype)
            except WorkbenchError as exc:
                raise MapperError(f"Cannot bind to tensor {name!r}: {exc.message}", tensor=name) from None
            infos.append(TensorInfo(name, dtype, tuple(int(size) for size in value.shape)))
        else:
            raise MapperError(
                f"Cannot bind to source entry {name!r}: it is a {type(value).__name__}, not a TensorInfo or tensor.", tensor=name
            )
    return infos


def source_names(source: Any) -> list[str] | None:
    """The source names of a multi-source catalog (the primary, whose names are unscoped, first); None otherwise."""
    names = getattr(getattr(source, "catalog", source), "sources", None)
    return list(names) if isinstance(names, Mapping) and names else None


class Effect:
    """What one step does to the state: names it consumes and nodes it produces (checked for clashes)."""

    __slots__ = ("binder", "consumed", "produced")

    def __init__(self, binder: Binder) -> None:
        self.binder = binder
        self.consumed: dict[str, tuple[Node, Mapper]] = {}
        self.produced: dict[str, tuple[Node, Mapper]] = {}

    def consume(self, name: str, node: Node, op: Mapper) -> None:
        if name in self.consumed:
            first_node, first = self.consumed[name]
            self.binder.problem(
                f"Cannot read {_quoted(name)} twice: both {first.short()} and {op.short()} consume it in the same step. "
                "Each tensor feeds one operation per step; chain the operations in a Sequential, or remove one.",
                op, name, kind="clash",
            )
            self.binder.poison(node)
            return
        self.consumed[name] = (node, op)

    def produce(self, name: str, node: Node, op: Mapper) -> None:
        if name in self.produced:
            other_node, first = self.produced[name]
            self.binder.problem(
                f"Cannot write {_quoted(name)}: both {first.short()} and {op.short()} produce it. Give the outputs different names.",
                op, name, kind="clash",
            )
            self.binder.poison(other_node)
            self.binder.poison(node)
            return
        self.produced[name] = (node, op)

    def absorb(self, other: Effect) -> None:
        for name, (node, op) in other.consumed.items():
            self.consume(name, node, op)
        for name, (node, op) in other.produced.items():
            self.produce(name, node, op)


class Binder:
    """One binding run: walks the tree, tracks components and problems."""

    def __init__(self, mapper: Mapper, infos: list[TensorInfo], *, record: bool = False, keep_after: bool = False) -> None:
        self.mapper = mapper
        self.infos = infos
        self.problems: list[Problem] = []
        self.comps: list[Comp] = []
        self.seq = 0
        self.records: dict[Path, list[tuple[Op, tuple[Meta, ...]]]] | None = {} if record else None
        self.scope_clashes: dict[Path, str] = {}  # scope path -> an outside name that lands under target_prefix
        self.after: dict[Path, dict[str, Meta | None]] = {}  # glob leaf path -> names (metadata) once its step ran (inverse)
        self.keep_after = keep_after
        self._infer_cache: dict[tuple[Path, type, tuple[Meta, ...]], list[Meta]] = {}
        self._templates: dict[Path, tuple[tuple[str, ...], list[Template]]] = {}
        self._failed_templates: set[str] = set()
        self._scopes: set[str] | None = None  # the named sources of a multi-source catalog (NAME of NAME::tensor)
        self.source_names: list[str] | None = None  # a multi-source catalog's source names, the primary first
        nodes = {info.name: Node((info.dtype, tuple(info.shape)), None, index) for index, info in enumerate(infos)}
        self.state = State(nodes)

    # -- bookkeeping -------------------------------------------------------------------------------
    def problem(self, message: str, op: Mapper | None, tensor: str | None, severity: str = "error", *, kind: ProblemKind) -> None:
        self.problems.append(Problem(severity, message, op.short() if op is not None else None, tensor, kind=kind))  # type: ignore[arg-type]

    def comp_of(self, node: Node) -> Comp:
        if node.comp is None:
            comp = node.comp = Comp()
            comp.sources.append(node.source)
            self.comps.append(comp)
        return find(node.comp)

    def new_comp(self) -> Comp:
        comp = Comp()
        self.comps.append(comp)
        return comp

    def poison(self, node: Node) -> None:
        self.comp_of(node).poisoned = True

    def commit(self, state: State, effect: Effect, where: Mapper) -> None:
        consumed, produced = effect.consumed, effect.produced
        state.remove_all(consumed)
        nodes = state.nodes
        for name, (node, op) in produced.items():
            if name in nodes:  # not consumed (those are gone): a clash with a tensor left in place
                self.problem(
                    f"Cannot write {_quoted(name)}: {op.short()} produces it, but a tensor of that name is already there and "
                    f"nothing consumes it. Drop or rename that tensor first (M.Drop({name!r})), or pick another output name.",
                    op, name, kind="overwrite",
                )
                self.poison(node)
                self.poison(nodes[name])
                state.remove(name)
        state.insert_all([(name, node) for name, (node, _) in produced.items()], consumed)

    # -- the walk ----------------------------------------------------------------------------------
    def run(self, mapper: Mapper, state: State, path: Path) -> None:
        if isinstance(mapper, Op):
            self.commit(state, self.leaf_effect(mapper, state, path), mapper)
            if self.keep_after and has_globs(mapper):
                self.after[path] = {name: node.meta for name, node in state.nodes.items()}
        elif isinstance(mapper, Sequential):
            for index, child in enumerate(mapper.mappers):
                self.run(child, state, path + (index,))
        elif isinstance(mapper, Parallel):
            merged = Effect(self)
            for index, child in enumerate(mapper.mappers):
                if isinstance(child, Op):  # leaves record straight into the shared effect (clashes checked there)
                    self.leaf_effect(child, state, path + (index,), merged)
                else:
                    merged.absorb(self.effect_of(child, state, path + (index,)))
            self.commit(state, merged, mapper)
            if self.keep_after and any(isinstance(child, Op) and has_globs(child) for child in mapper.mappers):
                after = {name: node.meta for name, node in state.nodes.items()}
                self.after.update({path + (index,): after for index, child in enumerate(mapper.mappers)
                                   if isinstance(child, Op) and has_globs(child)})
        elif isinstance(mapper, PrefixScope):
            self.run_scope(mapper, state, path)
        elif isinstance(mapper, Claim):
            self.check_claim(mapper, state)
        elif isinstance(mapper, (ConfigUpdate, OutputFile)):
            pass  # a statement about config.json, which the planner carries; no tensor is read or written
        else:  # pragma: no cover
            raise MapperError(f"Cannot bind {mapper!r}: unknown mapper type {type(mapper).__name__}.")

    def check_claim(self, claim: Claim, state: State) -> None:
        """Report the source tensors `claim` covers that no step has read (still under their source names)."""
        left = claim.leftovers([name for name, node in state.nodes.items() if node.source >= 0])
        if left:
            self.problem(claim.message(left), claim, left[0], kind="unconverted")

    def effect_of(self, mapper: Mapper, state: State, path: Path) -> Effect:
        """The effect of `mapper` on `state` without changing it (composites run on a copy)."""
        if isinstance(mapper, Op):
            return self.leaf_effect(mapper, state, path)
        scratch = state.copy()
        keep_after, self.keep_after = self.keep_after, False  # a scratch state is not what the inverse of a leaf in it reads
        try:
            self.run(mapper, scratch, path)
        finally:
            self.keep_after = keep_after
        effect = Effect(self)
        for name, node in state.nodes.items():
            if scratch.nodes.get(name) is not node:
                effect.consume(name, node, mapper)
        for name, node in scratch.nodes.items():
            if state.nodes.get(name) is not node:
                effect.produce(name, node, mapper)
        return effect

    def run_scope(self, scope: PrefixScope, state: State, path: Path) -> None:
        source, target = scope.source_prefix, scope.target_prefix
        cut = len(source)
        before = {name[cut:]: node for name, node in state.nodes.items() if name.startswith(source)}
        inner = State(dict(before))
        self.run(scope.mapper, inner, path + (0,))
        effect = Effect(self)
        consumed, produced, after = effect.consumed, effect.produced, inner.nodes
        for local, node in before.items():
            if after.get(local) is not node:
                effect.consume(source + local, node, scope)
            elif source != target:  # renamed by the scope alone: once per tensor, Effect's checks inlined
                name = source + local
                if name in consumed:
                    effect.consume(name, node, scope)
                else:
                    consumed[name] = (node, scope)
                comp = self.comp_of(node)
                self.seq += 1
                comp.steps.append((self.seq, path, None))
                name = target + local
                if name in produced:
                    effect.produce(name, Node(node.meta, comp), scope)
                else:
                    produced[name] = (Node(node.meta, comp), scope)
        for local, node in inner.nodes.items():
            if before.get(local) is not node:
                effect.produce(target + local, node, scope)
        if source != target and path not in self.scope_clashes:
            clash = next((n for n in state.nodes if n.startswith(target) and not n.startswith(source)), None)
            if clash is not None:
                self.scope_clashes[path] = clash
        self.commit(state, effect, scope)

    # -- leaves ------------------------------------------------------------------------------------
    def leaf_effect(self, leaf: Op, state: State, path: Path, effect: Effect | None = None) -> Effect:
        """What `leaf` does to `state`, added to `effect` (a new one by default)."""
        effect = Effect(self) if effect is None else effect
        if has_globs(leaf):
            self._warn_literal_glob(leaf, state)
            self._expand_glob(leaf, state, path, effect)
            return effect
        if has_ranges(leaf):
            for instance, reported in expand_ranges(self, leaf, state, path):
                self.instance(instance, state, path, effect, reported=reported)
            return effect
        if not leaf.is_template:
            self.instance(leaf, state, path, effect, reported=False)
            return effect
        templates = self._compiled(leaf, path)[1]
        if len(templates) == 1 and templates[0].simple is not None and len(leaf.outputs) == 1:
            self._expand_one_to_one(leaf, templates[0], state, path, effect)
            return effect
        joinable = len(templates) > 1 and all(template.simple is not None for template in templates)
        if joinable and self._expand_joined(leaf, state, path, effect):
            return effect
        for instance, reported in self.expand(leaf, state, path):
            self.instance(instance, state, path, effect, reported=reported)
        return effect

    def _warn_literal_glob(self, leaf: Op, state: State) -> None:
        """A glob that is exactly a present tensor's name names that tensor (`patterns`): say so when the glob would
        have matched other names too, so a pattern meant for many does not silently take one."""
        glob = leaf.inputs[0] if leaf.inputs else ""
        nodes = state.nodes
        if "{" in glob or glob not in nodes:
            return
        match = glob_matcher(glob)
        others = [name for name in nodes if name != glob and match(name) is not None]
        if others:
            self.problem(f"'{glob}' is the name of a tensor and a glob: {type(leaf).__name__} takes that one tensor, "
                         f"not the {len(others)} other name(s) the glob matches (e.g. '{others[0]}'). To reach those, "
                         "write a pattern that is not itself a tensor's name.", leaf, glob, "warning", kind="clash")

    def _expand_glob(self, leaf: Op, state: State, path: Path, effect: Effect) -> None:
        """A leaf whose input is a glob: one instance per name it matches among those present now (`patterns`)."""
        nodes = state.nodes
        metas = {name: node.meta for name, node in nodes.items()}
        expand = getattr(leaf, "bind_instances", None)  # an op that expands itself (a whole-checkpoint merge)
        if expand is not None:
            # a leaf that asks for them also gets the checkpoint's source names (the primary first)
            found, problems = expand(metas, self.source_names) if getattr(leaf, "BIND_WITH_SOURCES", False) else expand(metas)
            for message, tensor, kind in problems:
                self.problem(message, leaf, tensor, kind=kind)
            for op in found:
                self.instance(op, state, path, effect, reported=False)
            return
        found = glob_instances(leaf, metas)
        if not found:
            if leaf.inputs[0] not in self._failed_templates:
                self.problem(no_match_message(leaf, len(nodes)), leaf, leaf.inputs[0], kind="missing")
            self._failed_templates.update(leaf.outputs)
        for op in found:
            self.instance(op, state, path, effect, reported=False)

    def _expand_joined(self, leaf: Op, state: State, path: Path, effect: Effect) -> bool:
        """`expand` + `instance` fused for several inputs whose placeholders are whole segments (q/k/v -> qkv).

        Returns False, having changed nothing, unless every match is complete (then `expand` reports the
        partial ones). Instances whose inputs clash, already belong to a component, or whose metadata is
        not inferred yet take the general `instance`; the rest are recorded inline with exactly its effects.
        """
        order, templates = self._compiled(leaf, path)
        nodes = state.nodes
        matches: list[dict[tuple[str, ...], str]] = []
        for template in templates:
            at = dict((name, pos) for pos, name in template.simple)  # type: ignore[union-attr]
            positions = [at[name] for name in order]
            found: dict[tuple[str, ...], str] = {}
            for name in state.candidates(template):
                if name in nodes:
                    segments = name.split(".")
                    found[tuple([segments[pos] for pos in positions])] = name
            if not found:
                return False
            matches.append(found)
        first, others = matches[0], matches[1:]
        if any(len(found) != len(first) for found in others) or any(key not in found for found in others for key in first):
            return False
        consumed, produced = effect.consumed, effect.produced
        cache, records, comps = self._infer_cache, self.records, self.comps
        for key in first:
            op = leaf.fill_names(dict(zip(order, key, strict=True)))
            names = op.inputs
            found_nodes = [nodes[name] for name in names]
            metas = tuple([node.meta for node in found_nodes])
            outputs = cache.get((path, type(op), metas))  # type: ignore[arg-type]
            general = outputs is None
            if not general:
                for name, node in zip(names, found_nodes, strict=True):
                    if node.comp is not None or name in consumed:
                        general = True
                        break
                for name in op.outputs:
                    if name in produced:
                        general = True
            if general:
                self.instance(op, state, path, effect, reported=False)
                continue
            # What comp_of + union make of fresh components: one, holding the sources in input order.
            comp = Comp()
            comps.append(comp)
            sources = comp.sources
            for node in found_nodes:
                node.comp = comp
                sources.append(node.source)
            self.seq += 1
            comp.steps.append((self.seq, path, op))
            if records is not None:
                records.setdefault(path, []).append((op, metas))  # type: ignore[arg-type]
            for name, node in zip(names, found_nodes, strict=True):
                consumed[name] = (node, op)
            for index, name in enumerate(op.outputs):
                produced[name] = (Node(outputs[index], comp), op)
        return True

    def _expand_one_to_one(self, leaf: Op, template: Template, state: State, path: Path, effect: Effect) -> None:
        """`expand` + `instance` fused for one input, one output (renames, reshapes, casts: most of a big walk).

        Instances whose input is unknown, that clash, or whose metadata is not inferred yet take the general
        `instance`; the rest are recorded inline with exactly its effects.
        """
        nodes = state.nodes
        consumed, produced = effect.consumed, effect.produced
        cache, records, comps = self._infer_cache, self.records, self.comps
        simple = template.simple
        inferred: dict[Meta, list[Meta]] = {}  # this leaf's slice of the infer cache, keyed by meta alone
        found_any = False
        for name in state.candidates(template):
            node = nodes.get(name)
            if node is None:
                continue
            segments = name.split(".")
            op = leaf.fill_names({key: segments[pos] for pos, key in simple})  # type: ignore[union-attr]
            found_any = True
            meta = node.meta
            out = op.outputs[0]
            outputs = inferred.get(meta)  # type: ignore[arg-type]
            if outputs is None and meta is not None:
                outputs = cache.get((path, type(op), (meta,)))
                if outputs is not None:
                    inferred[meta] = outputs
            if outputs is None or name in consumed or out in produced:
                self.instance(op, state, path, effect, reported=False)
                continue
            comp = node.comp
            if comp is None:
                comp = node.comp = Comp()
                comp.sources.append(node.source)
                comps.append(comp)
            elif comp.parent is not None:
                comp = find(comp)
            self.seq += 1
            comp.steps.append((self.seq, path, op))
            if records is not None:
                records.setdefault(path, []).append((op, (meta,)))
            consumed[name] = (node, op)
            produced[out] = (Node(outputs[0], comp), op)
        if not found_any:
            self._report_unmatched(leaf, [template.text], state)
            self._failed_templates.update(leaf.outputs)

    def _compiled(self, leaf: Op, path: Path) -> tuple[tuple[str, ...], list[Template]]:
        found = self._templates.get(path)
        if found is None:
            order = tuple(sorted(placeholders_of(leaf.inputs[0])))
            found = self._templates[path] = (order, [Template(text, order) for text in leaf.inputs])
        return found

    def expand(self, leaf: Op, state: State, path: Path) -> list[tuple[Op, bool]]:
        """Concrete instances of a templated leaf; partial matches become problems (instances flagged)."""
        order, templates = self._compiled(leaf, path)
        nodes = state.nodes
        if len(templates) == 1:  # one input template: every match is complete
            template = templates[0]
            instances: list[tuple[Op, bool]] = []
            for name in state.candidates(template):
                if name in nodes:
                    values = template.capture_values(name.split("."))
                    if values is not None:
                        instances.append((leaf.fill_names(values), False))
            if not instances:
                self._report_unmatched(leaf, [template.text], state)
                self._failed_templates.update(leaf.outputs)
            return instances
        matches: list[dict[tuple[str, ...], str]] = []
        for template in templates:
            found: dict[tuple[str, ...], str] = {}
            for name in state.candidates(template):
                if name in nodes:
                    key = template.capture(name.split("."))
                    if key is not None:
                        found[key] = name
            matches.append(found)
        empty = [t.text for t, found in zip(templates, matches, strict=True) if not found]
        if empty:
            self._report_unmatched(leaf, empty, state)
            self._failed_templates.update(leaf.outputs)
            return []
        instances = []
        keys = dict.fromkeys(key for found in matches for key in found)
        for key in keys:
            values = dict(zip(order, key, strict=True))
            complete = all(key in found for found in matches)
            if not complete:
                missing = [fill(t.text, values) for t, found in zip(templates, matches, strict=True) if key not in found]
                present = [found[key] for found in matches if key in found]
                where = ", ".join(f"{{{k}}}={v}" for k, v in values.items())
                self.problem(
                    f"Cannot bind {leaf.short()}: {_quoted(missing[0])} is missing, although {_quoted(present[0])} matches ({where})"
                    + (f"; {len(missing) - 1} more input(s) missing" if len(missing) > 1 else "")
                    + ". Add the missing tensor, or limit the template to the matches that are complete (e.g. list them).",
                    leaf, missing[0], kind="missing",
                )
            instances.append((leaf.fill_names(values), not complete))
        return instances

    def _report_unmatched(self, leaf: Op, empty: list[str], state: State) -> None:
        if all(text in self._failed_templates for text in empty):
            return  # an earlier failed operation was to produce these; that failure is already reported
        text = next(t for t in empty if t not in self._failed_templates)
        probe = Template(text, placeholders_of(text))
        same_length = [n for n in state.candidates(Template(".".join(f"{{x{i}}}" for i in range(probe.nseg)), [])) if n in state.nodes]
        pool = same_length[:5000] or list(state.nodes)[:5000]
        guess = difflib.get_close_matches(fill(text, {name: "0" for name in probe.order}), pool, n=1)
        hint = f" The closest name is {_quoted(guess[0])}." if guess else ""
        self.problem(
            f"Cannot bind {leaf.short()}: template {_quoted(text)} matches no tensor ({len(state.nodes)} available).{hint} "
            "Check the spelling against the source's tensor names, or remove the operation.",
            leaf, text, kind="missing",
        )

    def instance(self, op: Op, state: State, path: Path, effect: Effect, *, reported: bool) -> None:
        """Record one concrete operation: consume its inputs, infer and produce its outputs."""
        nodes = state.nodes
        names = op.inputs
        found = [nodes.get(name) for name in names]
        metas = tuple([node.meta if node is not None else None for node in found])
        outputs: list[Meta] | None = None
        present: list[tuple[str, Node | None]] | None = None  # None: every input is there
        if None in metas:
            present = list(zip(names, found, strict=True))
            self._report_missing(op, state, present, reported)
            present = [(name, node) for name, node in present if node is not None]
        else:
            key = (path, type(op), metas)  # a self-expanding leaf's instances are of several kinds (Merge, Drop)
            outputs = self._infer_cache.get(key)  # type: ignore[arg-type]
            if outputs is None:
                try:
                    outputs = op._infer(list(metas))  # type: ignore[arg-type]
                except MapperError as exc:
                    self.problem(exc.message, op, (op.outputs or op.inputs)[0], kind="unsupported" if isinstance(op, Unsupported) else "invalid")
                    self._failed_templates.update(op.outputs)
                else:
                    self._infer_cache[key] = outputs  # type: ignore[index]
        if present is None and len(found) == 1:
            node = found[0]
            comp = node.comp  # type: ignore[union-attr]
            if comp is None:
                comp = self.comp_of(node)  # type: ignore[arg-type]
            elif comp.parent is not None:
                comp = find(comp)
        else:
            nodes_in = found if present is None else [node for _, node in present]
            if len(nodes_in) == 1:
                comp = self.comp_of(nodes_in[0])  # type: ignore[arg-type]
            else:
                comp = union([self.comp_of(node) for node in nodes_in]) if nodes_in else self.new_comp()  # type: ignore[arg-type]
        if outputs is None:
            comp.poisoned = True
        else:
            self.seq += 1
            comp.steps.append((self.seq, path, op))
            if self.records is not None:
                self.records.setdefault(path, []).append((op, metas))  # type: ignore[arg-type]
        consumed, produced = effect.consumed, effect.produced
        for name, node in zip(names, found, strict=True) if present is None else present:
            if name in consumed:
                effect.consume(name, node, op)  # type: ignore[arg-type]  # reports the clash
            else:
                consumed[name] = (node, op)  # type: ignore[assignment]
        for index, name in enumerate(op.outputs):
            node = Node(None if outputs is None else outputs[index], comp)
            if name in produced:
                effect.produce(name, node, op)  # reports the clash
            else:
                produced[name] = (node, op)

    def _absent_source_hint(self, name: str) -> str:
        """For `NAME::tensor` when the catalog has no source NAME: how to open it with the checkpoint."""
        scope, sep, _ = name.partition("::")
        if not sep:
            return ""
        if self._scopes is None:
            self._scopes = {info.name.partition("::")[0] for info in self.infos if "::" in info.name}
        if scope in self._scopes:
            return ""
        return (f" It is read from a checkpoint named '{scope}', which the source does not include (a mapper such as "
                f"lora_merge reads the adapter as a second source). Open them together: wb.open_checkpoint({{'base': "
                f"BASE, '{scope}': PATH}}), or from the shell add --source {scope}=PATH (diff, plan, convert).")

    def _report_missing(self, op: Op, state: State, present: list[tuple[str, Node | None]], reported: bool) -> None:
        """An input is absent (or unknown after an earlier error): report it once, poison the outputs."""
        missing = [name for name, node in present if node is None]
        if missing and not reported and not any(name in self._failed_templates for name in missing):
            absent = self._absent_source_hint(missing[0])
            guess = [] if absent else difflib.get_close_matches(missing[0], list(state.nodes)[:20000], n=1)
            hint = f" The closest name is {_quoted(guess[0])}." if guess else ""
            fix = absent or " Check the name against the source's tensors (or the step that should produce it)."
            self.problem(
                f"Cannot bind {op.short()}: input {_quoted(missing[0])} is not in the source.{hint}{fix}",
                op, missing[0], kind="missing",
            )
        self._failed_templates.update(op.outputs)


def bind(mapper: Mapper, source: Any, rest: Rest = "keep") -> Binding:
    """Bind `mapper` to `source`; see `Mapper.bind`."""
    if type(mapper) is PrefixScope:  # a bare prefix rename binds without the walk where it can
        from .grouping import rename_binding

        found = rename_binding(mapper, source_infos(source), rest)
        if found is not None:
            return found
    if type(mapper) in (Sequential, Parallel):  # a Parallel of templated operations binds without the walk where it can
        from .parallel_binding import parallel_binding

        collecting = gc.isenabled()
        gc.disable()  # as in run_binder: many small acyclic objects
        try:
            found = parallel_binding(mapper, source_infos(source), rest)
        finally:
            if collecting:
                gc.enable()
        if found is not None:
            return found
    return run_binder(mapper, source, rest)[0]


def run_binder(mapper: Mapper, source: Any, rest: Rest = "keep", *, record: bool = False) -> tuple[Binding, Binder]:
    """Bind and also return the binder (instance records, scope clashes) for `inverse`."""
    if rest not in ("keep", "drop", "error"):
        raise MapperError(f"Cannot bind with rest={rest!r}: use 'keep', 'drop' or 'error'.")
    if not isinstance(mapper, Mapper):
        raise MapperError(f"Cannot bind {mapper!r}: it is not a mapper.")
    from .grouping import build_binding

    # Binding allocates hundreds of thousands of small acyclic objects; the cyclic collector would
    # rescan all of them again and again (3x the run time at 100k tensors) and find nothing.
    collecting = gc.isenabled()
    gc.disable()
    try:
        binder = Binder(mapper, source_infos(source), record=record, keep_after=record)
        binder.source_names = source_names(source)
        binder.run(mapper, binder.state, ())
        return build_binding(binder, rest), binder
    finally:
        if collecting:
            gc.enable()


@dataclass
class StepwiseBinding:
    """A list of steps bound in one walk, with what each step saw: what the MapperBuilder shows.

    `binding`: the steps combined (Sequential: each sees the previous result; Parallel: each reads the
    source). `before[k]`: name -> TensorInfo of the tensors step k reads from (Sequential: the result of
    steps 0..k-1; Parallel: the source); `before[len(steps)]` is what a step appended next would see.
    `problems[k]`: the problems step k raised; `instances[k]`: its concrete operations (templates filled).
    """

    binding: Binding
    before: list[Mapping[str, TensorInfo]]
    problems: list[list[Problem]]
    instances: list[list[Op]]


class StepNames(Mapping):
    """Name -> TensorInfo of the tensors present at one point of a walk (names whose metadata a failed
    operation left unknown are left out). Holds (dtype, shape) pairs; a TensorInfo is made when asked for."""

    __slots__ = ("_metas",)

    def __init__(self, metas: dict[str, Meta]) -> None:
        self._metas = metas

    def __getitem__(self, name: str) -> TensorInfo:
        dtype, shape = self._metas[name]
        return TensorInfo(name, dtype, shape)

    def __contains__(self, name: object) -> bool:
        return name in self._metas

    def __iter__(self) -> Any:
        return iter(self._metas)

    def __len__(self) -> int:
        return len(self._metas)


def _snapshot(state: State) -> StepNames:
    return StepNames({name: node.meta for name, node in state.nodes.items() if node.meta is not None})


def _parts(mapper: Mapper) -> list[Mapper]:
    """`mapper` and every mapper inside it (composites too: problems may name either)."""
    inner = list(getattr(mapper, "mappers", ())) + ([mapper.mapper] if isinstance(mapper, PrefixScope) else [])
    return [mapper] + [part for child in inner for part in _parts(child)]


def bind_steps(steps: list[Mapper], source: Any, *, parallel: bool = False, rest: Rest = "keep") -> StepwiseBinding:
    """Bind `Sequential(*steps)` (or `Parallel(*steps)`) to `source` once, recording each step's view."""
    if rest not in ("keep", "drop", "error"):
        raise MapperError(f"Cannot bind with rest={rest!r}: use 'keep', 'drop' or 'error'.")
    from .grouping import build_binding

    mapper = Parallel(*steps) if parallel else Sequential(*steps)
    collecting = gc.isenabled()
    gc.disable()
    try:
        binder = Binder(mapper, source_infos(source), record=True)
        binder.source_names = source_names(source)
        before: list[Mapping[str, TensorInfo]] = []
        problems: list[list[Problem]] = []
        if parallel:
            start = {info.name: info for info in binder.infos}
            binder.run(mapper, binder.state, ())
            before = [start] * (len(steps) + 1)
            # Parallel children are merged before their clashes are known: attribute problems by operation.
            owner = {part.short(): k for k, step in reversed(list(enumerate(steps))) for part in _parts(step)}
            problems = [[] for _ in steps]
            for problem in binder.problems:
                problems[owner.get(problem.op, len(steps) - 1)].append(problem)
        else:
            for index, step in enumerate(steps):
                before.append(_snapshot(binder.state))
                first = len(binder.problems)
                binder.run(step, binder.state, (index,))
                problems.append(binder.problems[first:])
            before.append(_snapshot(binder.state))
        instances: list[list[Op]] = [[] for _ in steps]
        for path, records in (binder.records or {}).items():
            if path:
                instances[path[0]].extend(op for op, _ in records)
        return StepwiseBinding(build_binding(binder, rest), before, problems, instances)
    finally:
        if collecting:
            gc.enable()
