"""The binder's working state: named nodes of tensor metadata, indexed for template matching.

Each `Node` is one tensor value at some point of the conversion (a source tensor, or an output of an
operation instance). Nodes that feed each other share a `Comp` (union-find), which ends up as one
dependency group. The `State` maps current names to nodes and keeps a lazily built index by
(segment count, position, literal segment) so a template only looks at names that can match it.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from typing import Any

from ..names import Template
from .base import Meta


class Comp:
    """A connected set of nodes: the source tensors it reads and the operation instances it runs."""

    __slots__ = ("parent", "sources", "steps", "poisoned", "outputs")

    def __init__(self) -> None:
        self.parent: Comp | None = None
        self.sources: list[int] = []
        # (sequence number, path of the leaf in the mapper tree, concrete instance or None for a scope rename)
        self.steps: list[tuple[int, tuple[int, ...], Any]] = []
        self.poisoned = False
        self.outputs: list[Any] = []  # final TensorInfos, filled when the walk is over


def find(comp: Comp) -> Comp:
    """The representative of `comp`'s set (with path compression)."""
    root = comp
    while root.parent is not None:
        root = root.parent
    while comp.parent is not None and comp.parent is not root:
        comp.parent, comp = root, comp.parent
    return root


def union(comps: list[Comp]) -> Comp:
    """Merge sets; the biggest one absorbs the others (keeps merging near-linear)."""
    if len(comps) == 1:
        return find(comps[0])
    roots = list({id(root): root for root in map(find, comps)}.values())
    if len(roots) == 1:
        return roots[0]
    roots.sort(key=lambda c: len(c.sources) + len(c.steps), reverse=True)
    main = roots[0]
    for other in roots[1:]:
        other.parent = main
        main.sources.extend(other.sources)
        main.steps.extend(other.steps)
        main.poisoned = main.poisoned or other.poisoned
        other.sources, other.steps = [], []
    return main


class Node:
    """One tensor value: metadata (None once an error made it unknown), its component, its source index."""

    __slots__ = ("meta", "comp", "source")

    def __init__(self, meta: Meta | None, comp: Comp | None = None, source: int = -1) -> None:
        self.meta = meta
        self.comp = comp
        self.source = source


class State:
    """Current name -> Node, with an incrementally maintained template index.

    For each (segment count, literal positions) that some template uses, the index maps the tuple of
    segments at those positions to the names that have them: a template's candidates are then exactly
    the names whose literal segments equal its own; only its placeholder segments remain to check.
    """

    __slots__ = ("nodes", "_indexes")

    def __init__(self, nodes: dict[str, Node]) -> None:
        self.nodes = nodes
        # nseg -> literal positions -> literal segments -> names (ordered set)
        self._indexes: dict[int, dict[tuple[int, ...], dict[tuple[str, ...], dict[str, None]]]] = {}

    def copy(self) -> State:
        return State(dict(self.nodes))

    def _index(self, nseg: int, positions: tuple[int, ...]) -> dict[tuple[str, ...], dict[str, None]]:
        per_count = self._indexes.setdefault(nseg, {})
        index = per_count.get(positions)
        if index is None:
            index = per_count[positions] = {}
            dots = nseg - 1
            for name in self.nodes:
                if name.count(".") == dots:
                    segs = name.split(".")
                    key = tuple([segs[p] for p in positions])
                    names = index.get(key)
                    if names is None:
                        names = index[key] = {}
                    names[name] = None
        return index

    def candidates(self, template: Template) -> dict[str, None] | tuple[()]:
        """Names whose literal segments equal the template's (placeholders still to check).

        May include names removed since the index was built: check membership in `nodes`.
        """
        return self._index(template.nseg, template.positions).get(template.literal_key, ())

    def remove(self, name: str) -> None:
        # Index entries are left behind: `candidates` callers skip names no longer in `nodes`, and a
        # name inserted again lands on the same index key. This keeps a rename of 100k names cheap.
        del self.nodes[name]

    def remove_all(self, names: Iterable[str]) -> None:
        """`remove` for each of `names` (one call for a whole step's worth)."""
        nodes = self.nodes
        for name in names:
            del nodes[name]

    def insert_all(self, pairs: Iterable[tuple[str, Node]], indexed: Container[str]) -> None:
        """`insert` for each pair, in order; names in `indexed` were just removed, so the index still holds them."""
        nodes, indexes = self.nodes, self._indexes
        for name, node in pairs:
            nodes[name] = node
            if name in indexed:
                continue
            per_count = indexes.get(name.count(".") + 1)
            if per_count:
                segs = name.split(".")
                for positions, index in per_count.items():
                    key = tuple([segs[p] for p in positions])
                    names = index.get(key)
                    if names is None:
                        names = index[key] = {}
                    names[name] = None

    def insert(self, name: str, node: Node) -> None:
        self.insert_all(((name, node),), ())
