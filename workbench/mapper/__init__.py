"""The mapper vocabulary: describe a layout conversion as a small graph of tensor operations.

    from workbench import mapper as M
    mapper = M.Sequential(
        M.Concat(['model.layers.{i}.self_attn.q_proj.weight', 'model.layers.{i}.self_attn.k_proj.weight',
                  'model.layers.{i}.self_attn.v_proj.weight'], 'model.layers.{i}.self_attn.qkv_proj.weight'),
    )
    binding = mapper.bind(checkpoint)      # concrete groups + problems, no tensor data read

Names may hold `{placeholder}` segments (one dotted segment each); binding expands them against the
source. Everything here is metadata-only and torch-free until tensors are actually computed.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

# Public name -> the submodule defining it. Resolved on first use, so that the planner and the engine, which
# import `workbench.mapper.groups` and friends, do not pay for every preset and op module (a byte-copy
# `workbench convert` imports about half of them).
_LAZY = {
    "Mapper": "base", "Claim": "claim", "ConfigUpdate": "config_update", "Parallel": "compose", "PrefixScope": "compose", "Sequential": "compose",
    "from_json": "export", "check_module": "module_mapper", "from_module": "module_mapper", "Function": "function",
    "Binding": "groups", "ByteSlice": "groups", "Group": "groups", "Problem": "groups", "Op": "op",
    "Cast": "ops", "Concat": "ops", "Drop": "ops", "Identity": "ops", "Rename": "ops", "Reshape": "ops", "Split": "ops",
    "Stack": "ops", "Transpose": "ops", "Unstack": "ops", "TargetReport": "target", "check_target": "target",
    "Unsupported": "unsupported", "Merge": "merge", "MergeModels": "merge", "MergeSlices": "merge.slices", "SliceCopies": "merge.slices", "Duplicate": "merge.slices",
    "Refused": "merge.refusal", "AlignVocabulary": "merge.vocabulary", "OutputFile": "output_file",
}

__all__ = [
    "AlignVocabulary", "Binding", "ByteSlice", "Cast", "Claim", "Concat", "ConfigUpdate", "Drop", "Function", "Group", "Identity", "Mapper", "Duplicate", "Merge", "MergeModels", "MergeSlices", "Op", "OutputFile", "Refused", "SliceCopies",
    "Parallel", "PrefixScope", "Problem", "Rename", "Reshape", "Sequential", "Split", "Stack", "TargetReport",
    "Transpose", "Unstack", "Unsupported", "check_module", "check_target", "from_json", "from_module", "presets",
]


# No public name may also name a submodule: importing the submodule would rebind the package attribute to it.


def __getattr__(name: str) -> Any:
    if name == "presets":  # the family presets build on this algebra; the package only names them, on first use
        return import_module(".presets", __name__)
    try:
        module = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'workbench.mapper' has no attribute {name!r}") from None
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
