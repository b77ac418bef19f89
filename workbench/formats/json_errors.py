"""Why `json.loads` refused a text, in words a user can act on.

Besides `JSONDecodeError`, `json.loads` raises a plain `ValueError` for an integer of more than 4300
digits (Python's limit on int-from-text conversion), with advice to raise a global interpreter limit
that is wrong for an untrusted file. Readers catch `ValueError` and describe it with `json_problem`.
"""

from __future__ import annotations

import json


def json_problem(exc: BaseException) -> str:
    """A short cause for a failed `json.loads`: the decoder's message and place, or the integer limit."""
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg}: line {exc.lineno} column {exc.colno}"
    if isinstance(exc, RecursionError):
        return "it nests too deeply"
    if isinstance(exc, ValueError) and "digits" in str(exc):
        return "it holds an integer of more than 4300 digits, which no size, offset or setting can be"
    return str(exc)[:200]
