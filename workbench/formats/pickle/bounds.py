"""A bounds check of a pickle's opcodes, run before CPython's unpickler sees untrusted bytes.

CPython's C unpickler trusts two numbers a pickle declares: the length of a counted argument
(BINBYTES, BINUNICODE8 ...), for which it allocates a buffer before finding the input too short, and a
memo index (PUT, LONG_BINPUT), for which it grows and zero-fills its memo table to twice that index.
A 20-byte file asking for memo slot 2**31 makes it write 32 GiB. `pickle_problem` walks the opcodes
without building anything and refuses a declared length longer than what remains, and a memo index
no larger than the pickle could legitimately reach (each memo entry costs at least one opcode byte).
"""

from __future__ import annotations

import pickletools

_LINE = -1  # argument up to the next newline
_TWO_LINES = -11  # GLOBAL / INST: module and name, one line each
# Counted arguments: pickletools' marker -> (width of the length prefix, signed)
_COUNTED = {-2: (1, False), -3: (4, True), -4: (4, False), -5: (8, False)}
_STOP, _PUT, _LONG_BINPUT, _FRAME = ord("."), ord("p"), ord("r"), 0x95


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


def pickle_problem(data: bytes) -> str | None:
    """Why `data` must not be handed to the unpickler (a short phrase), or None when its sizes are sound."""
    end = len(data)
    table = _ARGUMENTS
    find = data.find
    from_bytes = int.from_bytes
    pos = 0
    while pos < end:
        code = data[pos]
        kind = table[code]
        at = pos
        pos += 1
        if kind == 0:
            if code == _STOP:
                return None
            continue
        if kind is None:
            return f"unknown opcode 0x{code:02x} at byte {at}"
        if kind > 0:
            if pos + kind > end:
                return f"the pickle ends inside the argument of the opcode at byte {at}"
            if code == _LONG_BINPUT and from_bytes(data[pos : pos + 4], "little") >= end:
                return f"memo index {from_bytes(data[pos : pos + 4], 'little')} at byte {at} is beyond any the pickle can use"
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
            if code == _PUT:
                try:
                    index = int(data[pos:newline])
                except ValueError:
                    return f"PUT at byte {at} has no memo index"
                if index >= end:
                    return f"memo index {index} at byte {at} is beyond any the pickle can use"
            pos = newline + 1
            continue
        width, signed = _COUNTED[kind]
        if pos + width > end:
            return f"the pickle ends inside the argument of the opcode at byte {at}"
        length = data[pos] if width == 1 else from_bytes(data[pos : pos + width], "little", signed=signed)
        pos += width
        if length < 0 or length > end - pos:
            return f"the opcode at byte {at} declares {length} bytes but {end - pos} remain"
        pos += length
    return "the pickle has no STOP opcode (truncated)"
