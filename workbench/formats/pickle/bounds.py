"""A bounds check of a pickle's opcodes, run before CPython's unpickler sees untrusted bytes.

CPython's C unpickler trusts the numbers a pickle declares:
- the length of a counted argument (BINBYTES, BINUNICODE8 ...), for which it allocates a buffer before
  finding the input too short;
- a memo index (PUT, LONG_BINPUT), for which it grows and zero-fills its memo table to twice that
  index: a 20-byte file asking for memo slot 2**31 makes it write 32 GiB;
- the digits of an integer (INT, LONG, LONG4), which later become text in messages and tables, where
  Python refuses integers of more than 4300 digits.

`pickle_problem` walks the opcodes without building anything. It refuses a declared length longer than
what remains, any byte after the STOP opcode (so the pickle's real extent is the whole input, and
bytes appended after it cannot pay for a larger memo or a longer argument), a memo index beyond the
number of memo entries written so far (a pickler numbers its memo entries 0, 1, 2 ... as it writes
them), and integers too long to print.

It also adds up what the objects the opcodes build would take in memory (`_cost_table`: an empty set is
216 bytes from one opcode byte, a reduced global a few hundred bytes from four) and refuses a pickle whose
objects would take more than `COST_FACTOR` times the bytes stored on disk (plus `COST_SLACK`): a deflated
stream of one-byte EMPTY_SETs (23:1) would otherwise reach 10,000 times the file. Measured on real pickles:
torch.save files, DeepSpeed and Lightning states build 10 to 55 bytes per pickle byte; torch.save never
deflates, and a state dict re-zipped with deflate (4-5:1) builds about 100 per stored byte. With the inflated
pickle itself (at most 64 times the stored bytes, see torch_zip), header work stays within 256 times the input.

The accounting costs a few Python operations per opcode (it doubled the scan of a 100k-tensor torch.save pickle), so
`cost_bound` first bounds every running total from the byte histogram (numpy, ~25 ms for 11 MB): when that bound is
within the budget, as for every uncompressed torch.save, DeepSpeed or Lightning pickle measured (57 per byte against
160), the accounting cannot refuse and is skipped; deflated or crafted pickles whose bound exceeds it are accounted.
"""

from __future__ import annotations

import functools
import pickletools
from array import array
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

_LINE = -1  # argument up to the next newline
_TWO_LINES = -11  # GLOBAL / INST: module and name, one line each
# Counted arguments: pickletools' marker -> (width of the length prefix, signed)
_COUNTED = {-2: (1, False), -3: (4, True), -4: (4, False), -5: (8, False)}
_STOP, _PUT, _BINPUT, _LONG_BINPUT, _MEMOIZE, _FRAME = ord("."), ord("p"), ord("q"), ord("r"), 0x94, 0x95
_INT, _LONG, _LONG4 = ord("I"), ord("L"), 0x8B
_MEMO_WRITES = frozenset({_PUT, _BINPUT, _LONG_BINPUT, _MEMOIZE})
# A memo index may run this far ahead of the entries written so far (BINPUT's one-byte index always fits).
MEMO_SLACK = 256
# Python prints integers of up to 4300 digits (sys.int_info.default_max_str_digits); 1785 bytes stay below.
MAX_INT_DIGITS = 4300
MAX_INT_BYTES = 1785
# What the built objects may take: this many bytes per stored byte (the file's bytes, before inflating), plus a floor.
COST_FACTOR = 160
COST_SLACK = 4 << 20

# Bytes charged per value pushed on the stack: its stack slot and the container slot it usually ends in (with the
# over-allocation of a growing list). Existing objects (memo gets, DUP, None, True) cost only this.
_PUSH = 24
# Opcode name -> (bytes for the object it creates, bytes per stack item it consumes), measured with tracemalloc on
# CPython 3.11 through the inert unpickler, rounded up. Counted arguments (strings, bytes) add their length.
_COSTS = {
    "INT": (32, 0), "BININT": (32, 0), "BININT1": (32, 0), "BININT2": (32, 0), "LONG": (32, 0), "LONG1": (32, 0), "LONG4": (32, 0),
    "FLOAT": (24, 0), "BINFLOAT": (24, 0),
    "STRING": (56, 0), "BINSTRING": (56, 0), "SHORT_BINSTRING": (56, 0), "BINBYTES": (56, 0), "SHORT_BINBYTES": (56, 0),
    "BINBYTES8": (56, 0), "BYTEARRAY8": (64, 0), "UNICODE": (56, 0), "SHORT_BINUNICODE": (56, 0), "BINUNICODE": (56, 0),
    "BINUNICODE8": (56, 0),
    "EMPTY_LIST": (56, 0), "LIST": (56, 0), "EMPTY_DICT": (64, 0), "DICT": (64, 32), "SETITEM": (0, 32), "SETITEMS": (0, 32),
    "EMPTY_SET": (216, 0), "FROZENSET": (216, 64), "ADDITEMS": (0, 64),
    "TUPLE": (40, 8), "TUPLE1": (40, 8), "TUPLE2": (40, 8), "TUPLE3": (40, 8),
    "REDUCE": (320, 0), "NEWOBJ": (320, 0), "NEWOBJ_EX": (320, 0), "OBJ": (320, 8), "INST": (320, 8), "BUILD": (96, 0),
    "GLOBAL": (2400, 0), "STACK_GLOBAL": (2400, 0), "EXT1": (2400, 0), "EXT2": (2400, 0), "EXT4": (2400, 0),
    "PERSID": (256, 0), "BINPERSID": (256, 0),
    "PUT": (16, 0), "BINPUT": (16, 0), "LONG_BINPUT": (16, 0), "MEMOIZE": (16, 0), "MARK": (16, 0),
}


def _argument_table() -> list[int | None]:
    """Opcode byte -> argument kind: 0 none, n > 0 fixed bytes, or one of the markers above; None unknown."""
    table: list[int | None] = [None] * 256
    for op in pickletools.opcodes:
        kind = 0 if op.arg is None else op.arg.n
        if op.arg is not None and op.arg.name == "stringnl_noescape_pair":
            kind = _TWO_LINES
        table[ord(op.code)] = kind
    return table


_ARGUMENTS = _argument_table()


def _cost_table() -> list[tuple[int, int, bool, int, int]]:
    """Opcode byte -> (stack items popped, pushed, pops to the last MARK, bytes of the object made, bytes per item)."""
    table = [(0, 0, False, 0, 0)] * 256
    for op in pickletools.opcodes:
        to_mark = any(s.name == "mark" for s in op.stack_before)
        pops = 0 if to_mark else len(op.stack_before)
        pushes = sum(s.name != "mark" for s in op.stack_after)
        base, per_item = _COSTS.get(op.name, (0, 0))
        table[ord(op.code)] = (pops, pushes, to_mark, base + _PUSH * pushes, per_item)
    return table


_EFFECTS = _cost_table()


def _memo_problem(index: int, writes: int, at: int) -> str | None:
    if index > writes + MEMO_SLACK:
        return f"memo index {index} at byte {at} is beyond the {writes} memo entries written before it"
    return None


@functools.cache
def _byte_weights() -> np.ndarray:
    """Byte value -> the most the accounting can charge for one occurrence of that byte (see `cost_bound`)."""
    import numpy as np

    most_per_item = max(per_item for *_, per_item in _EFFECTS)
    return np.array([max(made + most_per_item * pushes, 1) for _, pushes, _, made, _ in _EFFECTS], dtype=np.int64)


_HISTOGRAM_CHUNK = 1 << 18


def cost_bound(data: bytes) -> int:
    """An upper bound, computed from the byte histogram alone, on every running total of the scan's accounting.

    Proof. Let P be the largest cost per item popped to a MARK (64) and take the potential Phi = P * depth (0 at the
    start, never negative). An opcode charges `made` (which includes its pushes), plus `per_item <= P` for each of the
    items it removes down to its MARK, plus at most one byte per argument byte (strings, lines). Removing k items
    lowers Phi by P*k (depth never rises above what is removed and pushed: `depth = min(depth, below)`), and pushes
    raise it by P per item, so charge + change of Phi <= made + P * pushes + argument bytes. Summed over any prefix
    of opcodes, the charge is at most the sum of these amortised costs minus the final Phi, so at most
    sum(made + P * pushes) over the opcode bytes + 1 per argument byte. Weighting every byte of `data` with
    max(made + P * pushes, 1) of its value counts every opcode byte with its own weight and every argument byte with at
    least 1, so the histogram's weighted sum bounds the cost at every opcode: when it is within the budget, the
    accounting can never refuse and is skipped. The heaviest byte (GLOBAL, 2488) makes no general per-byte bound
    useful, but a real torch.save pickle (100k tensors, 10.8 MB) weighs 57 per byte, under the 160 allowed per
    stored byte: uncompressed torch, DeepSpeed and Lightning pickles skip the accounting, a deflated stream (where
    the budget follows the compressed size) or a crafted pickle of heavy opcodes does not.
    """
    import numpy as np  # here: a safetensors-only run (which imports this module) never loads numpy

    values = np.frombuffer(data, dtype=np.uint8)
    histogram = np.zeros(256, dtype=np.int64)
    for start in range(0, len(values), _HISTOGRAM_CHUNK):  # bincount widens to 8 bytes per byte: 2 MiB at a time
        histogram += np.bincount(values[start : start + _HISTOGRAM_CHUNK], minlength=256)
    return int(histogram @ _byte_weights())


def pickle_problem(data: bytes, stored: int | None = None) -> str | None:
    """Why `data` must not be handed to the unpickler (a short phrase), or None when its sizes are sound.

    `stored` is how many bytes the pickle takes on disk (a deflated zip entry's compressed size); the objects
    it builds may take `COST_FACTOR` times that (default: the pickle's own length).
    """
    budget = COST_FACTOR * (len(data) if stored is None else stored) + COST_SLACK
    problem, _ = _scan(data, budget, account=cost_bound(data) > budget, stored=stored)
    return problem


def _scan(data: bytes, budget: float, *, account: bool, stored: int | None = None) -> tuple[str | None, int]:
    """The opcode walk: (the problem or None, the cost accounted when it stopped); `account` False skips the cost."""
    end = len(data)
    effects = _EFFECTS
    cost = 0
    depth = 0
    marks = array("q")  # stack depth at each open MARK: 8 bytes each, like the unpickler's own
    table = _ARGUMENTS
    find = data.find
    from_bytes = int.from_bytes
    memo_writes = _MEMO_WRITES
    writes = 0
    pos = 0
    while pos < end:
        code = data[pos]
        kind = table[code]
        at = pos
        pos += 1
        if code in memo_writes:
            writes += 1
        if account:
            pops, pushes, to_mark, made, per_item = effects[code]
            if to_mark:
                below = marks.pop() if marks else 0
                cost += made + per_item * max(depth - below, 0)
                depth = min(depth, below)  # the items above the MARK are gone (never more: see cost_bound)
            else:
                cost += made
                depth = max(depth - pops, 0)
            if code == 0x28:  # MARK
                marks.append(depth)
            depth += pushes
            if cost > budget:
                return (f"its objects would take over {cost} bytes in memory by byte {at}, more than {COST_FACTOR} times "
                        f"the {end if stored is None else stored} bytes stored (a memory bomb, not a checkpoint)"), cost
        if kind == 0:
            if code == _STOP:
                if pos != end:
                    return f"{end - pos} bytes follow the STOP opcode at byte {at}, where the pickle ends", cost
                return None, cost
            continue
        if kind is None:
            return f"unknown opcode 0x{code:02x} at byte {at}", cost
        if kind > 0:
            if pos + kind > end:
                return f"the pickle ends inside the argument of the opcode at byte {at}", cost
            if code == _LONG_BINPUT:
                problem = _memo_problem(from_bytes(data[pos : pos + 4], "little"), writes - 1, at)
                if problem:
                    return problem, cost
            if code == _FRAME and from_bytes(data[pos : pos + 8], "little") > end - pos - 8:
                return f"a frame at byte {at} declares {from_bytes(data[pos : pos + 8], 'little')} bytes, more than remain", cost
            pos += kind
            continue
        if kind in (_LINE, _TWO_LINES):
            newline = find(b"\n", pos)
            if kind == _TWO_LINES and newline >= 0:
                newline = find(b"\n", newline + 1)
            if newline < 0:
                return f"the pickle ends inside the argument of the opcode at byte {at}", cost
            if code in (_INT, _LONG) and newline - pos > MAX_INT_DIGITS:
                return f"an integer of {newline - pos} digits at byte {at}, more than any checkpoint holds", cost
            if code == _PUT:
                line = data[pos:newline]
                if len(line) > 20 or not line.isdigit():
                    return f"PUT at byte {at} has no memo index", cost
                problem = _memo_problem(int(line), writes - 1, at)
                if problem:
                    return problem, cost
            cost += newline - pos
            pos = newline + 1
            continue
        width, signed = _COUNTED[kind]
        if pos + width > end:
            return f"the pickle ends inside the argument of the opcode at byte {at}", cost
        length = data[pos] if width == 1 else from_bytes(data[pos : pos + width], "little", signed=signed)
        pos += width
        if length < 0 or length > end - pos:
            return f"the opcode at byte {at} declares {length} bytes but {end - pos} remain", cost
        if code == _LONG4 and length > MAX_INT_BYTES:
            return f"an integer of {length} bytes at byte {at}, more than any checkpoint holds", cost
        cost += length
        pos += length
    return "the pickle has no STOP opcode (truncated)", cost
