"""A GGUF file compared with a checkpoint of another format (an HF folder) through the GGUF -> HF name mapping.

The GGUF side is seen through `M.presets.gguf_to_hf` with every output in float32 (quantised types de-quantised by
the `gguf` package, q/k rows put back in HF order, experts unstacked), so names and shapes line up with the HF
checkpoint and `values=True` measures what quantisation changed. Two columns say where each row comes from:
`gguf_name` (the GGUF tensor) and `gguf_type` (F16, Q8_0, Q4_K, ...): "what was quantised to what".
"""

from __future__ import annotations

from typing import Any

from ..catalog import Catalog
from .diff import diff_catalogs
from .mapped import mapped_catalog


def diff_gguf(a: Catalog, b: Catalog, **options: Any) -> Any:
    """`diff_catalogs` of `a` and `b`, one of them a GGUF file seen through `gguf_to_hf(dtype='F32')`, plus the
    `gguf_name` and `gguf_type` of each row."""
    from ..mapper.presets.gguf_inverse import gguf_to_hf_plan

    gguf = a if a.format == "gguf" else b
    mapper, planned = gguf_to_hf_plan(gguf, "F32")
    seen = mapped_catalog(gguf, mapper, "drop")
    frame = diff_catalogs(seen, b, **options) if gguf is a else diff_catalogs(a, seen, **options)
    kinds = gguf.columns.get("gguf_type", {})
    frame["gguf_name"] = [planned[n].source if n in planned else None for n in frame.index]
    frame["gguf_type"] = [kinds.get(planned[n].source) if n in planned else None for n in frame.index]
    return frame


__all__ = ["diff_gguf"]
