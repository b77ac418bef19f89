"""The config.json edits a mapper states (`mapper.config_update.ConfigUpdate`), applied to the config's bytes.

Each edit sets one value at a dotted key; a key absent from its object is added (transformers then reads the
stated value instead of its class default: an absent `tie_word_embeddings` means tied). Every other key and its
order stay as they were; the bytes are written as transformers writes configs (two-space indents, final newline).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def _shown(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def edit_config(raw: bytes, edits: Mapping[str, Any]) -> tuple[bytes | None, list[tuple[str, str]], list[str]]:
    """(the config bytes with `edits` applied, or None when nothing changes or the bytes are not a JSON object;
    the changes made as (key, text), e.g. ("tie_word_embeddings", "tie_word_embeddings true -> false"); the edits that could not be made, with why)."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None, [], [f"{key}: config.json is not JSON" for key in edits]
    if not isinstance(data, dict):
        return None, [], [f"{key}: config.json is not a JSON object" for key in edits]
    changes: list[tuple[str, str]] = []
    failed: list[str] = []
    for key, value in edits.items():
        *parents, last = key.split(".")
        node: Any = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            failed.append(f"{key}: config.json has no object {'.'.join(parents)!r}")
            continue
        if last in node and node[last] == value and type(node[last]) is type(value):
            continue
        before = _shown(node[last]) if last in node else "(absent)"
        node[last] = value
        changes.append((key, f"{key} {before} -> {_shown(value)}"))
    if not changes:
        return None, [], failed
    return (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode("utf-8"), changes, failed
