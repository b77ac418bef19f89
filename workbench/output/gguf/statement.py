"""The GGUF preset's statement of what a GGUF file must hold (`output.statement.Statement`), for `--verify`."""

from __future__ import annotations

from typing import Any

from ..statement import Statement


def gguf_statement(spec: Any) -> Statement | None:
    """The GGUF preset's statement (`mapper.presets.gguf_preset.GgufTensors`, held as `spec.tensors`) with the tensors generated
    from config.json; a quantised tensor is stated as the written catalog holds it (U8, rows of block bytes).
    None when the spec holds no statement (a plain mapping)."""
    accounted = getattr(spec.tensors, "accounted", None)
    if accounted is None:
        return None
    import gguf

    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, planned in spec.tensors.items():
        shape = tuple(planned.shape)
        kind = gguf.GGMLQuantizationType[planned.type]
        block, size = gguf.GGML_QUANT_SIZES[kind]
        if block > 1:  # block-quantised: U8 bytes, whole blocks along the last dimension
            tensors[name] = ("U8", (*shape[:-1], shape[-1] // block * size))
        else:
            tensors[name] = (planned.type, shape)
    for made in spec.generated:
        tensors[made.name] = (made.type, tuple(made.shape))
    return Statement(f"llama.cpp GGUF ({spec.arch})", tensors, frozenset(accounted()))


__all__ = ["gguf_statement"]
