"""Model I/O: stream checkpoints into `nn.Module`s and save modules (plain or distributed) as HF checkpoints.

    report = wb.load_into(model, "ckpt/", mapper)      # in place; meta modules materialised, DTensors get their part
                                                       # (non-persistent buffers recomputed as from_pretrained does)
    report = wb.save_from(model, "out/", shard_size="5GB")   # under torchrun: gathered tensor by tensor

Both reuse the mapper, the planner and the writer: a load is checked from metadata before any byte
is read, and a save lays out its output exactly as a conversion of the same tensors would.
"""

from .buffers import UninitializedBufferError
from .check import KeyProblem, LoadCheck, ModuleMismatchError
from .load import LoadReport, dry_run_load, load_into
from .save import SaveReport, save_from

__all__ = [
    "KeyProblem", "LoadCheck", "LoadReport", "ModuleMismatchError", "SaveReport", "UninitializedBufferError", "dry_run_load",
    "load_into", "save_from",
]
