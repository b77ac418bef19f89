"""The picture of a mapper bound to a source: source tensors -> operations -> outputs, folded by layer.

Binding gives concrete groups (one per connected set of tensors); this module walks each group's
operations, folds concrete names back into layer templates (`model.layers.{i}.…` ×N), carries each
tensor's dtype and shape along (inferred through the operations), and draws the folded graph left to
right as SVG: real text at a fixed size, so it stays readable however large the graph is (the view
scrolls, with fit / 100 % / 150 % zoom). Tensors the mapper does not touch are counted, not drawn.
"""

from __future__ import annotations

import dataclasses
import hashlib
import html
import os
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..catalog import TensorInfo
from ..explore.layers import fold_name
from ..mapper.compose import Parallel, PrefixScope, Sequential
from ..mapper.op import Op

TensorKey = tuple[str, str, Any]  # ("t", template, producing op key or None for a source tensor)
OpKey = tuple[str, str]  # ("op", folded code of the operation)

Meta = tuple[str, tuple[int, ...]]  # (dtype code, shape)

MAX_LABEL = 64
FONT_PX = 12  # label size in the SVG, in CSS pixels at 100 %
CHAR_PX = 7.3  # advance of one character of the monospace label font at FONT_PX
LINE_PX = 15
PAD_X, PAD_Y = 8, 5
ROW_GAP, COLUMN_GAP = 10, 56
COLORS = {"source": "#dbe9f6", "intermediate": "#eeeeee", "output": "#dff0d8", "op": "#fde7c8"}


@dataclass
class GraphNode:
    """One box of the folded graph: a tensor template or an operation, standing for `count` instances."""

    key: Any
    kind: str  # 'source' | 'intermediate' | 'output' | 'op'
    label: str
    members: set[str] = field(default_factory=set)
    depth: int = 0
    metas: set[Meta] = field(default_factory=set)  # (dtype, shape) of the members (tensors only)

    @property
    def count(self) -> int:
        return len(self.members)

    def text(self) -> str:
        """The label with its ×N multiplicity, shortened from the left if very long."""
        label = self.label if len(self.label) <= MAX_LABEL else "…" + self.label[-(MAX_LABEL - 1):]
        return f"{label}  ×{self.count}" if self.count > 1 else label

    def meta_text(self) -> str:
        """'F32 [64, 32]' for a tensor whose members agree; 'F32, 2 shapes' when they do not; '' when unknown."""
        if not self.metas:
            return ""
        if len(self.metas) == 1:
            ((dtype, shape),) = self.metas
            return f"{dtype} [{', '.join(map(str, shape))}]"
        dtypes = sorted({d for d, _ in self.metas})
        shapes = len({s for _, s in self.metas})
        kinds = ", ".join(dtypes) if len(dtypes) <= 3 else f"{len(dtypes)} dtypes"
        return f"{kinds}, {shapes} shapes" if shapes > 1 else f"{kinds} [{', '.join(map(str, next(iter(self.metas))[1]))}]"


@dataclass
class FoldedGraph:
    """Nodes and edges of a bound mapper, folded by layer; plus what was left out of the picture."""

    nodes: dict[Any, GraphNode]
    edges: set[tuple[Any, Any]]
    kept: int = 0
    groups: int = 0
    problems: int = 0

    def columns(self) -> list[list[GraphNode]]:
        """Nodes by depth (left to right), each column ordered to keep edges short."""
        by_depth: dict[int, list[GraphNode]] = defaultdict(list)
        for node in self.nodes.values():
            by_depth[node.depth].append(node)
        columns = [by_depth[d] for d in sorted(by_depth)]
        preds: dict[Any, list[Any]] = defaultdict(list)
        for a, b in self.edges:
            preds[b].append(a)
        position: dict[Any, float] = {}
        for depth, column in enumerate(columns):
            if depth:
                first = {id(n): k for k, n in enumerate(column)}

                def bary(node: GraphNode, first: dict[int, int] = first) -> tuple[float, int]:
                    ys = [position[p] for p in preds[node.key] if p in position]
                    return (sum(ys) / len(ys) if ys else float("inf"), first[id(node)])

                column.sort(key=bary)
            for k, node in enumerate(column):
                position[node.key] = k
        return columns


def _fold(name: str) -> str:
    return fold_name(name)[0]


def _op_label(op: Op) -> str:
    """The operation's kind and non-name parameters that differ from their defaults ('Split sizes=[64, 32, 32]')."""
    names = set(getattr(op, "NAME_FIELDS", ())) | set(getattr(op, "NAME_LIST_FIELDS", ()))
    params = []
    if dataclasses.is_dataclass(op):
        for f in dataclasses.fields(op):
            if f.name in names:
                continue
            value = getattr(op, f.name)
            if f.default is not dataclasses.MISSING and value == f.default:
                continue
            if isinstance(value, tuple):
                value = list(value)
            params.append(f"{f.name}={value}")
    return " ".join([type(op).__name__, *params])


class _Builder:
    """Walks group operations with the binder's semantics, adding folded nodes and edges."""

    def __init__(self) -> None:
        self.nodes: dict[Any, GraphNode] = {}
        self.edges: set[tuple[Any, Any]] = set()
        self.sources: dict[str, Meta] = {}  # source tensor name -> (dtype, shape)
        self.metas: dict[tuple[Any, str], Meta] = {}  # (node key, concrete name) -> (dtype, shape)

    def node(self, key: Any, kind: str, label: str, member: str, meta: Meta | None = None) -> Any:
        found = self.nodes.get(key)
        if found is None:
            found = self.nodes[key] = GraphNode(key, kind, label)
        found.members.add(member)
        if meta is not None:
            found.metas.add(meta)
            self.metas[(key, member)] = meta
        return key

    def source(self, name: str) -> TensorKey:
        template = _fold(name)
        return self.node(("t", template, None), "source", template, name, self.sources.get(name))  # type: ignore[return-value]

    def _outputs_meta(self, op: Op, inputs: list[Meta | None]) -> list[Meta | None]:
        """The op's output (dtype, shape)s from its inputs', when all are known and the op accepts them."""
        if any(meta is None for meta in inputs):
            return [None] * len(op.outputs)
        try:
            infos = op.infer_outputs([TensorInfo(f"in{k}", m[0], tuple(m[1])) for k, m in enumerate(inputs)])  # type: ignore[index]
        except Exception:  # a failing operation is reported by the binder, not by the picture
            return [None] * len(op.outputs)
        return [(info.dtype, tuple(info.shape)) for info in infos]

    def resolve(self, key: Any) -> Any:
        """A node key for a state entry: source tensors get their node when first read, in reading order."""
        return self.source(key[1]) if key[0] == "src" else key

    def walk(self, mapper: Any, state: dict[str, Any], show: Callable[[str], str]) -> dict[str, Any]:
        """The state (name -> node key) after `mapper`; `show` turns a local name into the displayed one."""
        if isinstance(mapper, Op):
            return self.leaf(mapper, state, show)
        if isinstance(mapper, Sequential):
            for child in mapper.mappers:
                state = self.walk(child, state, show)
            return state
        if isinstance(mapper, Parallel):
            base = dict(state)
            consumed: set[str] = set()
            produced: dict[str, Any] = {}
            for child in mapper.mappers:
                after = self.walk(child, dict(base), show)
                consumed.update(n for n, k in base.items() if after.get(n) != k)
                produced.update((n, k) for n, k in after.items() if base.get(n) != k)
            merged = {n: k for n, k in base.items() if n not in consumed}
            merged.update(produced)
            return merged
        if isinstance(mapper, PrefixScope):
            return self.scope(mapper, state, show)
        return state

    def leaf(self, op: Op, state: dict[str, Any], show: Callable[[str], str]) -> dict[str, Any]:
        shown = op.rename_all(lambda n: _fold(show(n)))
        op_key = ("op", repr(shown))
        instance = repr(op.rename_all(show))
        self.node(op_key, "op", _op_label(op), instance)
        state = dict(state)
        metas: list[Meta | None] = []
        for name in op.inputs:
            key = self.resolve(state.pop(name, None) or ("src", show(name)))
            self.edges.add((key, op_key))
            metas.append(self.metas.get((key, show(name))))
        for name, meta in zip(op.outputs, self._outputs_meta(op, metas), strict=True):
            full = show(name)
            key = self.node(("t", _fold(full), op_key), "intermediate", _fold(full), full, meta)
            self.edges.add((op_key, key))
            state[name] = key
        return state

    def scope(self, scope: PrefixScope, state: dict[str, Any], show: Callable[[str], str]) -> dict[str, Any]:
        sp, tp = scope.source_prefix, scope.target_prefix
        inner = {n[len(sp):]: k for n, k in state.items() if n.startswith(sp)}
        after = self.walk(scope.mapper, dict(inner), lambda local: show(tp + local))
        result = {n: k for n, k in state.items() if not n.startswith(sp)}
        moved_key = ("op", f"PrefixScope {sp!r} -> {tp!r}")
        for local, key in after.items():
            if sp != tp and inner.get(local) == key:
                full = show(tp + local)
                self.node(moved_key, "op", f"move prefix {sp!r} → {tp!r}", full)
                before = self.resolve(key)
                meta = self.metas.get((before, show(sp + local)))
                out = self.node(("t", _fold(full), moved_key), "intermediate", _fold(full), full, meta)
                self.edges.add((before, moved_key))
                self.edges.add((moved_key, out))
                key = out
            result[tp + local] = key
        return result


def _assign_depths(graph: FoldedGraph) -> None:
    succ: dict[Any, list[Any]] = defaultdict(list)
    indegree = dict.fromkeys(graph.nodes, 0)
    for a, b in graph.edges:
        if a != b:
            succ[a].append(b)
            indegree[b] += 1
    ready = [k for k, d in indegree.items() if d == 0]
    while ready:
        key = ready.pop()
        depth = graph.nodes[key].depth
        for nxt in succ[key]:
            graph.nodes[nxt].depth = max(graph.nodes[nxt].depth, depth + 1)
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                ready.append(nxt)
    # Nodes left on a cycle (possible only after folding) keep the depth reached so far.


def mapper_graph(mapper: Any, source: Any, *, binding: Any = None) -> FoldedGraph:
    """The folded graph of `mapper` bound to `source` (pass `binding` to reuse an existing one)."""
    if binding is None:
        binding = mapper.bind(source)
    builder = _Builder()
    kept = 0
    for group in binding.groups:
        if group.label == "keep":
            kept += 1
            continue
        builder.sources.update((info.name, (info.dtype, tuple(info.shape))) for info in group.inputs)
        state = {info.name: ("src", info.name) for info in group.inputs}
        final = builder.walk(group.op, state, lambda n: n)
        for key in final.values():
            node = builder.nodes.get(key)
            if node is None:  # a source tensor the group passes through untouched
                continue
            if node.kind == "intermediate":
                node.kind = "output"
    graph = FoldedGraph(builder.nodes, builder.edges, kept=kept, groups=len(binding.groups) - kept, problems=len(binding.problems))
    _assign_depths(graph)
    return graph


@dataclass
class _Box:
    node: GraphNode
    x: float
    y: float
    width: float
    height: float


def _line_width(text: str) -> float:
    return len(text) * CHAR_PX


def _svg_text(x: float, y: float, text: str, css: str, anchor: str = "start") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" class="{css}" text-anchor="{anchor}">{html.escape(text)}</text>'


SVG_STYLE = (
    "<style>"
    f".wbg text{{font-family:var(--jp-code-font-family,monospace);font-size:{FONT_PX}px;fill:#1a1a1a}}"
    ".wbg text.meta{fill:#4a4a4a}"
    ".wbg text.title{font-family:var(--jp-ui-font-family,sans-serif);font-weight:bold;fill:var(--jp-ui-font-color1,#222)}"
    ".wbg text.more{font-style:italic;fill:var(--jp-ui-font-color2,#555)}"
    ".wbg rect{stroke:#888;stroke-width:0.8}"
    ".wbg path.edge{fill:none;stroke:var(--jp-ui-font-color2,#777);stroke-width:1}"
    ".wbg marker path{fill:var(--jp-ui-font-color2,#777)}"
    + "".join(f".wbg .n-{kind} rect{{fill:{color}}}" for kind, color in COLORS.items())
    + "</style>"
)


def graph_svg(graph: FoldedGraph, *, max_rows: int = 40, title: str | None = None) -> tuple[str, float, float]:
    """The folded graph as a standalone SVG document (boxes per column, curved arrows), and its width and
    height in pixels at 100 %. Tensor boxes carry their dtype and shape under the name."""
    columns = graph.columns()
    hidden = [max(0, len(column) - max_rows) for column in columns]
    columns = [column[:max_rows] for column in columns]
    heading = title or "mapper graph"
    notes = [f"{graph.groups} group(s)"]
    if graph.kept:
        notes.append(f"{graph.kept} tensor(s) kept unchanged (not drawn)")
    if graph.problems:
        notes.append(f"{graph.problems} problem(s): failing operations are not drawn")
    title_text = f"{heading} — " + ", ".join(notes)
    top = 34.0
    boxes: dict[Any, _Box] = {}
    x = 10.0
    column_heights = []
    laid: list[tuple[list[_Box], int, float]] = []
    for column, more in zip(columns, hidden, strict=True):
        sized = []
        for node in column:
            lines = [node.text()] + ([node.meta_text()] if node.kind != "op" and node.meta_text() else [])
            width = max(_line_width(line) for line in lines) + 2 * PAD_X
            sized.append((node, width, len(lines) * LINE_PX + 2 * PAD_Y))
        column_width = max((w for _, w, _ in sized), default=80.0)
        height = sum(h for _, _, h in sized) + ROW_GAP * max(len(sized) - 1, 0) + (LINE_PX + ROW_GAP if more else 0)
        column_heights.append(height)
        placed = []
        for node, width, box_height in sized:
            left = x + (column_width - width) / 2 if node.kind == "op" else x
            placed.append(_Box(node, left, 0.0, width, box_height))
        laid.append((placed, more, x))
        x += column_width + COLUMN_GAP
    tallest = max(column_heights, default=0.0)
    for (placed, _more, _x), height in zip(laid, column_heights, strict=True):
        y = top + (tallest - height) / 2
        for box in placed:
            box.y = y
            boxes[box.node.key] = box
            y += box.height + ROW_GAP
    width = max(x - COLUMN_GAP + 10, _line_width(title_text) + 20, 320.0)
    height = top + max(tallest, LINE_PX) + 14
    parts = [_svg_text(10, 20, title_text, "title")]
    if not graph.nodes:
        parts.append(_svg_text(10, top + 12, "nothing to draw: no operation applies to the source", "more"))
    for a, b in sorted(graph.edges, key=repr):
        if a in boxes and b in boxes and a != b:
            start, end = boxes[a], boxes[b]
            x0, y0 = start.x + start.width, start.y + start.height / 2
            x1, y1 = end.x - 2, end.y + end.height / 2
            bend = max((x1 - x0) / 2, 12)
            parts.append(f'<path class="edge" marker-end="url(#wbg-arrow)" d="M{x0:.1f},{y0:.1f} C{x0 + bend:.1f},{y0:.1f} '
                         f'{x1 - bend:.1f},{y1:.1f} {x1:.1f},{y1:.1f}"/>')
    for box in boxes.values():
        node = box.node
        radius = 9 if node.kind == "op" else 2
        tip = html.escape(f"{node.label} ({node.count} tensor{'s' if node.count != 1 else ''})" if node.kind != "op"
                          else f"{node.label} ({node.count} instance{'s' if node.count != 1 else ''})")
        lines = [_svg_text(box.x + PAD_X, box.y + PAD_Y + LINE_PX - 3, node.text(), "name")]
        if node.kind != "op" and node.meta_text():
            lines.append(_svg_text(box.x + PAD_X, box.y + PAD_Y + 2 * LINE_PX - 3, node.meta_text(), "meta"))
        parts.append(f'<g class="n-{node.kind}"><title>{tip}</title><rect x="{box.x:.1f}" y="{box.y:.1f}" width="{box.width:.1f}" '
                     f'height="{box.height:.1f}" rx="{radius}"/>{"".join(lines)}</g>')
    for placed, more, left in laid:
        if more:
            last = placed[-1]
            parts.append(_svg_text(left, last.y + last.height + ROW_GAP + LINE_PX - 3, f"… {more} more", "more"))
    arrow = ('<defs><marker id="wbg-arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
             'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z"/></marker></defs>')
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" class="wbg" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{html.escape(title_text)}">'
           f"{SVG_STYLE}{arrow}{''.join(parts)}</svg>")
    return svg, width, height


ZOOMS = (("fit", None), ("100%", 1.0), ("150%", 1.5))
FIT_MIN_SCALE = 0.75  # "fit" shrinks a wide graph at most to this: labels stay >= 9 px (FONT_PX 12), the view scrolls


class GraphFigure:
    """A drawn mapper graph: `svg` (a standalone SVG document), `graph` (the `FoldedGraph`), its size in
    pixels; shown in a notebook as the SVG in a scrolling view with fit / 100 % / 150 % zoom (plain CSS,
    no script), and written to a file with `save(path)`."""

    def __init__(self, graph: FoldedGraph, svg: str, width: float, height: float) -> None:
        self.graph = graph
        self.svg = svg
        self.width = width
        self.height = height

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the SVG to `path` (an .svg file any browser or vector editor opens)."""
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(self.svg)

    def _repr_svg_(self) -> str:
        return self.svg

    def _repr_html_(self) -> str:
        uid = "wbg" + hashlib.sha1(self.svg.encode()).hexdigest()[:10]  # stable across runs: no random ids in outputs
        radios, rules = [], []
        for k, (label, scale) in enumerate(ZOOMS):
            checked = " checked" if scale == 1.0 else ""
            radios.append(f'<input type="radio" name="{uid}" id="{uid}-{k}" class="wb-graph-zoom"{checked}>'
                          f'<label for="{uid}-{k}" style="margin:0 10px 0 2px;cursor:pointer">{label}</label>')
            if scale is None:  # the view's width, but never so small that labels are unreadable: then it scrolls
                size = f"width:100%;height:auto;min-width:{self.width * FIT_MIN_SCALE:.0f}px"
            else:
                size = f"width:{self.width * scale:.0f}px;height:{self.height * scale:.0f}px"
            rules.append(f"#{uid}-{k}:checked~.wb-graph-view svg{{{size}}}")
        style = f"<style>{''.join(rules)}#{uid} .wb-graph-view{{overflow:auto;max-height:640px;border:1px solid var(--jp-border-color2,#ddd)}}</style>"
        return (f'<div class="wb-graph" id="{uid}">{style}<span class="wb-note" style="font-size:12px">zoom </span>'
                f'{"".join(radios)}<div class="wb-graph-view">{self.svg}</div></div>')

    def __repr__(self) -> str:
        nodes = self.graph.nodes.values()
        ops = sum(1 for n in nodes if n.kind == "op")
        return f"<mapper graph: {len(self.graph.nodes) - ops} tensor boxes, {ops} operations, {self.width:.0f}×{self.height:.0f} px>"


def draw_graph(graph: FoldedGraph, *, max_rows: int = 40, title: str | None = None) -> GraphFigure:
    """A `GraphFigure` (SVG) of a folded graph: boxes per column with names ×N, dtypes and shapes; arrows between."""
    svg, width, height = graph_svg(graph, max_rows=max_rows, title=title)
    return GraphFigure(graph, svg, width, height)


def mapper_graph_figure(mapper: Any, source: Any, *, binding: Any = None, max_rows: int = 40, title: str | None = None) -> GraphFigure:
    """Draw `mapper` bound to `source` as source tensors -> operations -> outputs, folded by layer ×N, each
    tensor box with its dtype and shape (a `GraphFigure`: SVG, zoomable in a notebook, `save(path)`)."""
    return draw_graph(mapper_graph(mapper, source, binding=binding), max_rows=max_rows, title=title)
