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
"""

from __future__ import annotations

import pickletools

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


def _memo_problem(index: int, writes: int, at: int) -> str | None:
    if index > writes + MEMO_SLACK:
        return f"memo index {index} at byte {at} is beyond the {writes} memo entries written before it"
    return None


def pickle_problem(data: bytes) -> str | None:
    """Why `data` must not be handed to the unpickler (a short phrase), or None when its sizes are sound."""
    end = len(data)
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
        if kind == 0:
            if code == _STOP:
                if pos != end:
                    return f"{end - pos} bytes follow the STOP opcode at byte {at}, where the pickle ends"
                return None
            continue
        if kind is None:
            return f"unknown opcode 0x{code:02x} at byte {at}"
        if kind > 0:
            if pos + kind > end:
                return f"the pickle ends inside the argument of the opcode at byte {at}"
            if code == _LONG_BINPUT:
                problem = _memo_problem(from_bytes(data[pos : pos + 4], "little"), writes - 1, at)
                if problem:
                    return problem
            if code == _FRAME and from_bytes(data[pos : pos + 8], "little") > end - pos - 8:
                return f"a frame at byte {at} declares {from_bytes(data[pos : pos + 8], 'little')} bytes, more than remain"
            pos += kind
            continue
        if kind in (_LINE, _TWO_LINES):
            newline = find(b"\n", pos)
            if kind == _TWO_LINES and newline >= 0:
                newline = find(b"\n", newline + 1)
            if newline < 0:
                return f"the pickle ends inside the argument of the opcode at byte {at}"
            if code in (_INT, _LONG) and newline - pos > MAX_INT_DIGITS:
                return f"an integer of {newline - pos} digits at byte {at}, more than any checkpoint holds"
            if code == _PUT:
                line = data[pos:newline]
                if len(line) > 20 or not line.isdigit():
                    return f"PUT at byte {at} has no memo index"
                problem = _memo_problem(int(line), writes - 1, at)
                if problem:
                    return problem
            pos = newline + 1
            continue
        width, signed = _COUNTED[kind]
        if pos + width > end:
            return f"the pickle ends inside the argument of the opcode at byte {at}"
        length = data[pos] if width == 1 else from_bytes(data[pos : pos + width], "little", signed=signed)
        pos += width
        if length < 0 or length > end - pos:
            return f"the opcode at byte {at} declares {length} bytes but {end - pos} remain"
        if code == _LONG4 and length > MAX_INT_BYTES:
            return f"an integer of {length} bytes at byte {at}, more than any checkpoint holds"
        pos += length
    return "the pickle has no STOP opcode (truncated)"
