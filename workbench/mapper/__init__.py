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

from . import presets
from .base import Mapper
from .claim import Claim
from .compose import Parallel, PrefixScope, Sequential
from .export import from_json
from .from_module import check_module, from_module
from .function import Function
from .groups import Binding, ByteSlice, Group, Problem
from .op import Op
from .ops import Cast, Concat, Drop, Identity, Rename, Reshape, Split, Stack, Transpose, Unstack
from .target import TargetReport, check_target
from .unsupported import Unsupported

__all__ = [
    "Binding", "ByteSlice", "Cast", "Claim", "Concat", "Drop", "Function", "Group", "Identity", "Mapper", "Op",
    "Parallel", "PrefixScope", "Problem", "Rename", "Reshape", "Sequential", "Split", "Stack", "TargetReport",
    "Transpose", "Unstack", "Unsupported", "check_module", "check_target", "from_json", "from_module", "presets",
]
