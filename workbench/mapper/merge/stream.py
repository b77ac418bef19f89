"""mergekit's random stream: where each random merge of a tensor starts in it, so DARE and DELLA give mergekit's bytes.

`mergekit-yaml --random-seed S` seeds torch's global generator once (`torch.manual_seed(S)`) and every random
sparsification then draws from it, tensor after tensor, in the order its executor runs the merges. Measured on
torch 2.13 (tests/mapper/test_merge_stream.py): `torch.bernoulli` of a float32 or bfloat16 probability tensor
consumes exactly one 32-bit draw per element, whatever the size (no seeding of a vectorised generator by a single
draw), so a merge of `numel` elements with `k` sparsified models (density < 1; DELLA: 0 < density < 1) moves the
stream by `k · numel` draws. mergekit's executor runs the merges in the order of their group label — the
largest of the source tensor names a merge reads (a lexicographic topological sort keyed by that label) — so
the draws before a tensor are the sum over the merges with a smaller label.

`assign_draws` computes that offset for every merge of a plan (`Merge.draws`), from names and shapes only: a
tensor's stream does not depend on which rank merges it, or when. `generator_at(seed, draws)` rebuilds the
generator at an offset by replaying the draws from the nearest state already reached in this process (about
10 ns a draw; a rank replays at most the draws of the whole merge once, as mergekit spends them), so no order
of work is assumed. Two merges with the same label would run in an order mergekit leaves to its graph's node
order; that case is reported, not guessed.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from .methods import method

SCOPE = "::"
CHUNK = 1 << 20  # draws replayed per call (a 4 MiB float32 buffer)
KEEP = 1024  # generator states kept per seed (5 KiB each)

_lock = threading.Lock()
_states: dict[int, tuple[list[int], list[Any]]] = {}  # seed -> (sorted offsets, generator states at them)


def draws_of(method_name: str, params: Mapping[str, Any], models: Sequence[str], base: str | None, numel: int) -> int:
    """The 32-bit draws mergekit's `method_name` makes merging one tensor of `numel` elements with the bound
    parameters `params` (Merge.bound_parameters): `numel` per sparsified model besides the base."""
    spec = method(method_name)
    if not spec.random:
        return 0
    sparsify = spec.options.get("sparsify")
    count = 0
    for model in models:
        if model == base:
            continue
        density = params["density"][model]
        if density < 1 and (sparsify == "random" or density > 0):
            count += numel
    return count


def label(inputs: Sequence[str]) -> str:
    """mergekit's group label of a merge reading `inputs` (names where the step runs): the largest source name."""
    return max(name.rpartition(SCOPE)[2] for name in inputs)


def assign_draws(merges: Sequence[Any], nodes: Mapping[str, Any], labels: Sequence[str] | None = None
                 ) -> tuple[list[Any], list[tuple[str, str | None, str]]]:
    """`merges` (Merge ops of one random method) with `draws` set to their offset in mergekit's stream, and the
    problems. `nodes`: name -> (dtype, shape) of the inputs; `labels`: each merge's group label (default: `label`
    of its inputs)."""
    from math import prod

    from ...dtypes import is_float

    problems: list[tuple[str, str | None, str]] = []
    labels = list(labels) if labels is not None else [label(op.inputs) for op in merges]
    counts = []
    for op in merges:
        metas = [nodes.get(name) for name in op.inputs]
        if any(meta is None for meta in metas):
            problems.append((f"Cannot place {op.output!r} in mergekit's random stream: the shape of its inputs is unknown "
                             "before reading. Use rng='tensor' (a stream per tensor).", op.output, "invalid"))
            counts.append(0)
            continue
        if not all(is_float(meta[0]) for meta in metas):
            counts.append(0)
            continue
        base = op.base if op.spec.base != "ignored" else None
        counts.append(draws_of(op.method, op.bound_parameters(), op.models, base, prod(metas[0][1])))
    order = sorted(range(len(merges)), key=lambda i: labels[i])
    seen: dict[str, str] = {}
    for i in order:
        if counts[i] and labels[i] in seen:
            problems.append((f"Cannot place {merges[i].output!r} in mergekit's random stream: it and {seen[labels[i]]!r} both "
                             f"read {labels[i]!r} last, and mergekit then orders them by its task graph. Use rng='tensor' "
                             "(a stream per tensor) for these slices.", merges[i].output, "invalid"))
        if counts[i]:
            seen.setdefault(labels[i], merges[i].output)
    offsets = [0] * len(merges)
    total = 0
    for i in order:
        offsets[i] = total
        total += counts[i]
    return [op.with_draws(offsets[i]) if counts[i] else op for i, op in enumerate(merges)], problems


def generator_at(seed: int, draws: int) -> Any:
    """A torch generator in the state `torch.manual_seed(seed)` reaches after `draws` 32-bit draws."""
    import torch

    with _lock:
        offsets, states = _states.setdefault(seed, ([0], [torch.Generator().manual_seed(seed).get_state()]))
        at = bisect.bisect_right(offsets, draws) - 1
        start, state = offsets[at], states[at]
    generator = torch.Generator()
    generator.set_state(state)
    left = draws - start
    if left:
        buffer = torch.empty(min(left, CHUNK), dtype=torch.float32)
        while left:
            step = min(left, CHUNK)
            buffer[:step].uniform_(generator=generator)  # one 32-bit draw per float32 element, as bernoulli's
            left -= step
        del buffer
        with _lock:
            offsets, states = _states[seed]
            where = bisect.bisect_left(offsets, draws)
            if where == len(offsets) or offsets[where] != draws:
                offsets.insert(where, draws)
                states.insert(where, generator.get_state())
            if len(offsets) > KEEP:  # thin out: every other state stays, the start always
                offsets[:], states[:] = offsets[::2], states[::2]
    return generator
