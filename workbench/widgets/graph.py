"""The picture of a mapper bound to a source: source tensors -> operations -> outputs, folded by layer.

Binding gives concrete groups (one per connected set of tensors); this module walks each group's
operations, folds concrete names back into layer templates (`model.layers.{i}.…` ×N) and draws the
folded graph left to right with matplotlib. Tensors the mapper does not touch are counted, not drawn.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..explore.layers import fold_name
from ..mapper.compose import Parallel, PrefixScope, Sequential
from ..mapper.op import Op

TensorKey = tuple[str, str, Any]  # ("t", template, producing op key or None for a source tensor)
OpKey = tuple[str, str]  # ("op", folded code of the operation)

MAX_LABEL = 64
CHAR_WIDTH = 0.055  # inches per character of the 7 pt monospace font used for labels
ROW_HEIGHT = 0.34
FONT_SIZE = 7
DPI = 100
COLORS = {"source": "#dbe9f6", "intermediate": "#eeeeee", "output": "#dff0d8", "op": "#fde7c8"}


@dataclass
class GraphNode:
    """One box of the folded graph: a tensor template or an operation, standing for `count` instances."""

    key: Any
    kind: str  # 'source' | 'intermediate' | 'output' | 'op'
    label: str
    members: set[str] = field(default_factory=set)
    depth: int = 0

    @property
    def count(self) -> int:
        return len(self.members)

    def text(self) -> str:
        """The label with its ×N multiplicity, shortened from the left if very long."""
        label = self.label if len(self.label) <= MAX_LABEL else "…" + self.label[-(MAX_LABEL - 1):]
        return f"{label}  ×{self.count}" if self.count > 1 else label


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

    def node(self, key: Any, kind: str, label: str, member: str) -> Any:
        found = self.nodes.get(key)
        if found is None:
            found = self.nodes[key] = GraphNode(key, kind, label)
        found.members.add(member)
        return key

    def source(self, name: str) -> TensorKey:
        template = _fold(name)
        return self.node(("t", template, None), "source", template, name)  # type: ignore[return-value]

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
        for name in op.inputs:
            key = self.resolve(state.pop(name, None) or ("src", show(name)))
            self.edges.add((key, op_key))
        for name in op.outputs:
            full = show(name)
            key = self.node(("t", _fold(full), op_key), "intermediate", _fold(full), full)
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
                out = self.node(("t", _fold(full), moved_key), "intermediate", _fold(full), full)
                self.edges.add((self.resolve(key), moved_key))
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


def _new_figure(width: float, height: float) -> Any:
    import matplotlib.pyplot as plt
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    # Made through pyplot so a notebook's inline display is registered, then detached from pyplot (shown
    # once when returned, never accumulated) and given an Agg canvas at a fixed dpi: arrows are placed from
    # text extents measured with the renderer and dpi the PNG is drawn with (save at dpi='figure').
    fig = plt.figure(figsize=(width, height), dpi=DPI)
    plt.close(fig)
    FigureCanvasAgg(fig)
    return fig


def draw_graph(graph: FoldedGraph, *, max_rows: int = 40, title: str | None = None) -> Any:
    """A matplotlib Figure of a folded graph: boxes per column, arrows between them."""
    columns = graph.columns()
    hidden = [max(0, len(column) - max_rows) for column in columns]
    columns = [column[:max_rows] for column in columns]
    widths = [max((len(n.text()) for n in column), default=10) * CHAR_WIDTH + 0.3 for column in columns]
    gap = 0.45
    width = max(sum(widths) + gap * max(len(columns) - 1, 0) + 0.4, 4.0)
    rows = max((len(c) + (1 if h else 0) for c, h in zip(columns, hidden, strict=True)), default=1)
    height = max(rows * ROW_HEIGHT + 0.9, 1.6)
    fig = _new_figure(width, height)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.axis("off")
    heading = title or "mapper graph"
    notes = [f"{graph.groups} group(s)"]
    if graph.kept:
        notes.append(f"{graph.kept} tensor(s) kept unchanged (not drawn)")
    if graph.problems:
        notes.append(f"{graph.problems} problem(s): failing operations are not drawn")
    ax.text(0.2, 0.3, f"{heading} — " + ", ".join(notes), fontsize=9, va="center", ha="left", weight="bold")
    if not graph.nodes:
        ax.text(0.2, 0.75, "nothing to draw: no operation applies to the source", fontsize=8, va="center")
        return fig
    placed: dict[Any, tuple[Any, float]] = {}  # key -> (text artist, y)
    x = 0.2
    for column, col_width, more in zip(columns, widths, hidden, strict=True):
        top = 0.75 + (rows - len(column) - (1 if more else 0)) * ROW_HEIGHT / 2
        for k, node in enumerate(column):
            y = top + k * ROW_HEIGHT
            text = node.text()
            left = x + (col_width - 0.3 - len(text) * CHAR_WIDTH) / 2 if node.kind == "op" else x
            style = "round,pad=0.25" if node.kind == "op" else "square,pad=0.25"
            artist = ax.text(
                left, y, text, fontsize=FONT_SIZE, family="monospace", va="center", ha="left",
                bbox={"boxstyle": style, "facecolor": COLORS[node.kind], "edgecolor": "#888", "linewidth": 0.6},
            )
            placed[node.key] = (artist, y)
        if more:
            ax.text(x, top + len(column) * ROW_HEIGHT, f"… {more} more", fontsize=FONT_SIZE, style="italic", va="center")
        x += col_width + gap
    # Arrows join the boxes' real edges, measured once the text is laid out (axes units are inches).
    pad = 0.25 * FONT_SIZE / 72
    edges = {}
    for key, (artist, y) in placed.items():
        extent = artist.get_window_extent()  # lays the text out with the figure's own renderer
        edges[key] = (extent.x0 / fig.dpi - pad, extent.x1 / fig.dpi + pad, y)
    for a, b in sorted(graph.edges, key=repr):
        if a in edges and b in edges and a != b:
            _, a_right, ay = edges[a]
            b_left, _, by = edges[b]
            ax.annotate(
                "", xy=(b_left, by), xytext=(a_right, ay),
                arrowprops={"arrowstyle": "->", "color": "#666", "linewidth": 0.7, "shrinkA": 1, "shrinkB": 1},
            )
    return fig


def mapper_graph_figure(mapper: Any, source: Any, *, binding: Any = None, max_rows: int = 40, title: str | None = None) -> Any:
    """Draw `mapper` bound to `source` as source tensors -> operations -> outputs, folded by layer ×N."""
    return draw_graph(mapper_graph(mapper, source, binding=binding), max_rows=max_rows, title=title)
