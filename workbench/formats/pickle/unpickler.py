"""Reading pickles from untrusted checkpoints without running any of their code.

A pickle names globals (classes, functions) and asks the loader to call them. This unpickler never
imports what a pickle names: a small set of harmless builders (containers, `torch.Size`, dtypes,
tensor rebuild functions) is replaced by our own inert equivalents, and every other global becomes a
`Placeholder` subclass that records the arguments and state it was given. Tensors come out as
`TensorRef` records pointing at storages (`StorageRef`); no tensor data is touched.

`strict=True` (for pickles that should hold only known metadata, such as DCP's `.metadata`) refuses any
global outside the caller's allowlist instead of making a placeholder.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ...errors import CheckpointError
from .bounds import pickle_problem

# torch storage classes of the legacy typed API -> torch dtype name of their elements.
STORAGE_DTYPES: dict[str, str] = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
    "QInt8Storage": "qint8",
    "QUInt8Storage": "quint8",
    "QInt32Storage": "qint32",
    "QUInt4x2Storage": "quint4x2",
    "QUInt2x4Storage": "quint2x4",
    "UntypedStorage": "uint8",
    "TypedStorage": "uint8",
}

# Every torch dtype attribute name a pickle may reference as `torch.<name>`.
TORCH_DTYPE_NAMES = frozenset(
    {
        "float32", "float", "float64", "double", "float16", "half", "bfloat16", "int64", "long", "int32", "int",
        "int16", "short", "int8", "uint8", "bool", "complex32", "chalf", "complex64", "cfloat", "complex128",
        "cdouble", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
        "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "qint8", "quint8", "qint32", "quint4x2",
        "quint2x4", "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16",
        *(f"uint{n}" for n in range(1, 8)), *(f"int{n}" for n in range(1, 8)),
    }
)

# Globals torch.load(weights_only=True) accepts besides dtypes and storage/tensor classes (torch 2.3-2.13).
_WEIGHTS_ONLY_EXTRA = frozenset(
    {
        "_codecs.encode", "builtins.bytearray", "builtins.complex", "builtins.set", "collections.Counter",
        "collections.OrderedDict", "torch.Size", "torch.Tensor", "torch.device", "torch.nn.parameter.Parameter",
        "torch.serialization._get_layout", "torch._tensor._rebuild_from_type_v2",
        "torch.per_channel_affine", "torch.per_channel_affine_float_qparams", "torch.per_channel_symmetric",
        "torch.per_tensor_affine", "torch.per_tensor_symmetric",
        "torch.storage.TypedStorage", "torch.storage.UntypedStorage",
        *(
            f"torch._utils.{fn}"
            for fn in (
                "_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
                "_rebuild_parameter_with_state", "_rebuild_qtensor", "_rebuild_sparse_tensor",
                "_rebuild_meta_tensor_no_storage", "_rebuild_nested_tensor", "_rebuild_wrapper_subclass",
                "_rebuild_device_tensor_from_numpy", "_rebuild_device_tensor_from_cpu_tensor",
            )
        ),
    }
)

_CLASS_MODULES = ("torch", "torch.sparse", "torch.cuda", "torch.cuda.sparse")


def weights_only_allows(qualified: str) -> bool:
    """True when `torch.load(weights_only=True)` accepts this global by default (no add_safe_globals)."""
    if qualified in _WEIGHTS_ONLY_EXTRA:
        return True
    module, _, name = qualified.rpartition(".")
    if module == "torch" and name in TORCH_DTYPE_NAMES:
        return True
    if module in ("torch", "torch.cuda") and name.endswith("Storage"):
        return True
    return module in _CLASS_MODULES and name.endswith("Tensor") and name != "Tensor"


class Placeholder:
    """An instance of a global the unpickler refused to import: what the pickle asked to build.

    `wb_args`/`wb_kwargs` are the constructor (or function call) arguments, `wb_state` what BUILD set,
    `wb_items`/`wb_list` what SETITEMS/APPENDS added (dict and list subclasses pickle that way).
    """

    wb_global = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> Placeholder:
        obj = object.__new__(cls)
        obj.wb_args = args
        obj.wb_kwargs = kwargs
        obj.wb_state = None
        obj.wb_items = {}
        obj.wb_list = []
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.wb_state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.wb_items[key] = value

    def append(self, value: Any) -> None:
        self.wb_list.append(value)

    def extend(self, values: Iterable[Any]) -> None:
        self.wb_list.extend(values)

    def field(self, name: str, default: Any = None) -> Any:
        """A named field of the object, wherever the pickle put it (state dict, slot state, kwargs)."""
        state = self.wb_state
        if isinstance(state, dict) and name in state:
            return state[name]
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict) and name in state[1]:
            return state[1][name]
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict) and name in state[0]:
            return state[0][name]
        return self.wb_kwargs.get(name, default)

    def __repr__(self) -> str:
        return _short_repr(self, 200)


def _short_repr(value: Any, limit: int = 60) -> str:
    """repr(value) cut to `limit` characters, without rendering more than that.

    An unpickled tree may be far larger than its file (one 1 MB string referenced a million times), so
    the rendering visits only what fits in the budget and at most `_REPR_DEPTH` levels.
    """
    parts: list[str] = []
    _render(value, parts, [limit + 1], 0)
    text = "".join(parts)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_REPR_DEPTH = 4
_BRACKETS = {list: "[]", tuple: "()", set: "{}", frozenset: "{}", dict: "{}"}


def _render(value: Any, parts: list[str], budget: list[int], depth: int) -> None:
    def emit(text: str) -> None:
        parts.append(text[: budget[0]])
        budget[0] -= len(text)

    if budget[0] <= 0:
        return
    if isinstance(value, (str, bytes, bytearray)):
        emit(repr(value[: budget[0]]))  # slice first: the repr of a huge string costs its size
    elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        emit(f"<int of {value.bit_length()} bits>")
    elif value is None or isinstance(value, (bool, int, float, complex, DtypeRef)):
        emit(repr(value))
    elif isinstance(value, TensorRef):
        emit(f"TensorRef({value.dtype}, shape=")
        _render(list(value.shape), parts, budget, depth + 1)
        emit(", storage=")
        _render(value.storage.key, parts, budget, depth + 1)
        emit(")")
    elif isinstance(value, Builder):
        emit(repr(value))
    elif isinstance(value, Placeholder):
        emit(f"<{value.wb_global}(")
        _render_items(value.wb_args, parts, budget, depth, emit)
        emit(")>")
    elif isinstance(value, (list, tuple, set, frozenset, dict)):
        kind = next(k for k in _BRACKETS if isinstance(value, k))
        emit(_BRACKETS[kind][0])
        _render_items(value, parts, budget, depth, emit)
        emit(_BRACKETS[kind][1])
    else:
        emit(f"<{type(value).__name__}>")


def _render_items(items: Any, parts: list[str], budget: list[int], depth: int, emit: Callable[[str], None]) -> None:
    if depth >= _REPR_DEPTH:
        if len(items):
            emit("...")
        return
    pairs = items.items() if isinstance(items, dict) else ((None, v) for v in items)
    for i, (key, item) in enumerate(pairs):
        if budget[0] <= 0:
            return
        if i:
            emit(", ")
        if key is not None or isinstance(items, dict):
            _render(key, parts, budget, depth + 1)
            emit(": ")
        _render(item, parts, budget, depth + 1)


@dataclass(frozen=True)
class DtypeRef:
    """A torch dtype named by a pickle (`torch.float32` ...), kept as its attribute name."""

    name: str

    def __repr__(self) -> str:
        return f"torch.{self.name}"


@dataclass(frozen=True)
class StorageType:
    """A torch storage class named by a pickle; `dtype` is the torch name of its elements."""

    name: str
    dtype: str


@dataclass(frozen=True)
class StorageRef:
    """A storage persisted beside the pickle (a `data/<key>` zip entry); numel counts `dtype` elements."""

    key: str
    dtype: str
    numel: int
    location: str
    untyped: bool


@dataclass(eq=False)
class TensorRef:
    """A tensor the pickle would rebuild: a strided view of a storage, by reference, no data."""

    storage: StorageRef
    storage_offset: int  # in elements of `dtype`
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str  # torch dtype name
    requires_grad: bool = False
    parameter: bool = False

    def __repr__(self) -> str:
        return f"TensorRef({self.dtype}, shape={list(self.shape)}, storage={self.storage.key!r})"


@dataclass(eq=False)
class UnsupportedTensor:
    """A tensor-like object the workbench cannot read in place (meta, sparse, quantized, subclass ...)."""

    kind: str
    args: tuple = field(default=(), repr=False)


@dataclass
class PickleResult:
    """What an unpickled object tree holds, plus every global it named (module.name)."""

    root: Any
    globals: list[str]

    @property
    def unsafe_globals(self) -> list[str]:
        """Globals `torch.load(weights_only=True)` would refuse; non-empty means the file needs trust."""
        return [g for g in self.globals if not weights_only_allows(g)]


def _int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _int_tuple(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)):
        raise ValueError(f"{what} must be a tuple of integers, got {value!r}")
    return tuple(_int(v, what) for v in value)


def _rebuild_tensor_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any = False, *rest: Any) -> Any:
    if not isinstance(storage, StorageRef):
        return UnsupportedTensor("tensor over a storage that is not in the file", (storage,))
    if storage.untyped:
        return UnsupportedTensor("tensor over an untyped storage without dtype", (storage,))
    return TensorRef(
        storage, _int(storage_offset, "storage offset"), _int_tuple(size, "size"), _int_tuple(stride, "stride"),
        storage.dtype, bool(requires_grad),
    )


def _rebuild_tensor_v3(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any, *rest: Any) -> Any:
    if not isinstance(storage, StorageRef) or not isinstance(dtype, DtypeRef):
        return UnsupportedTensor("tensor over a storage that is not in the file", (storage,))
    return TensorRef(
        storage, _int(storage_offset, "storage offset"), _int_tuple(size, "size"), _int_tuple(stride, "stride"),
        dtype.name, bool(requires_grad),
    )


def _rebuild_parameter(data: Any, requires_grad: Any = True, *rest: Any) -> Any:
    if isinstance(data, TensorRef):
        data.parameter = True
        data.requires_grad = bool(requires_grad)
    return data


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    # Only our own builders are ever called; a subclass keeps its base tensor's data.
    if isinstance(func, Builder) and func.wb_global in _SAFE_CALLS and isinstance(args, tuple):
        return func(*args)
    return UnsupportedTensor(f"tensor subclass {getattr(new_type, 'wb_global', new_type)!r}", (func, args))


def _unsupported(kind: str) -> Callable[..., UnsupportedTensor]:
    def build(*args: Any, **kwargs: Any) -> UnsupportedTensor:
        return UnsupportedTensor(kind, args)

    return build


def _encode(text: Any, encoding: str = "utf-8") -> Any:
    # Protocol-2 pickles spell bytes as _codecs.encode(str, 'latin1').
    if isinstance(text, str) and encoding.lower() in ("latin1", "latin-1", "iso-8859-1", "utf-8", "utf8", "ascii"):
        return text.encode(encoding)
    return _placeholder_class("_codecs", "encode")(text, encoding)


def _bytes_like(kind: type) -> Callable[..., Any]:
    def build(*args: Any) -> Any:
        # bytes(n) / bytearray(n) would allocate n bytes chosen by the file: refuse integer sizes.
        if not args:
            return kind()
        if isinstance(args[0], (bytes, bytearray, list, tuple)) or (isinstance(args[0], str) and len(args) == 2):
            return kind(*args[:2])
        return _placeholder_class("builtins", kind.__name__)(*args)

    return build


def _plain_dict(*args: Any) -> dict:
    # defaultdict/Counter: keep the items, drop the factory (it would be a call into user code).
    return dict(args[0]) if args and isinstance(args[0], dict) else {}


def _complex(*args: Any) -> Any:
    if all(isinstance(a, (int, float)) for a in args) and len(args) <= 2:
        return complex(*args)
    return _placeholder_class("builtins", "complex")(*args)


def _reconstructor(cls: Any, base: Any, state: Any = None) -> Any:
    # copyreg._reconstructor(cls, object, None) is how protocol 0/1 spells "a bare instance of cls".
    if isinstance(cls, type) and issubclass(cls, Placeholder):
        return cls.__new__(cls)
    if cls in (dict, list, OrderedDict, set):
        return cls()
    return _placeholder_class("copyreg", "_reconstructor")(cls, base, state)


def _numpy_scalar(dtype: Any, data: Any = None) -> Any:
    """numpy scalars (common in trainer state): decoded when dtype is a plain numeric code, else kept inert."""
    code = dtype.wb_args[0] if isinstance(dtype, Placeholder) and dtype.wb_global.endswith(".dtype") and dtype.wb_args else None
    if isinstance(code, str) and len(code) <= 4 and code.lstrip("<>=|")[:1] in "fiub" and isinstance(data, bytes):
        import numpy as np

        np_dtype = np.dtype(code)
        if len(data) == np_dtype.itemsize:
            return np.frombuffer(data, dtype=np_dtype)[0].item()
    return _placeholder_class("numpy", "scalar")(dtype, data)


_SAFE_CALLS = frozenset({"torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3", "torch._utils._rebuild_parameter"})


class Builder:
    """An allowed global as the unpickler hands it out: callable, and closed to any state a pickle sets.

    The BUILD opcode sets attributes on whatever is on the stack, a global included: on a plain
    function it would change `__defaults__`, `__kwdefaults__`, `__qualname__` ... of this module's own
    builders, and the change would outlive the file and apply to every file read after it. A Builder
    has no `__dict__`, refuses `setattr`, and its `__setstate__` refuses BUILD.
    """

    __slots__ = ("_fn", "wb_global")

    def __init__(self, qualified: str, fn: Callable[..., Any]) -> None:
        object.__setattr__(self, "wb_global", qualified)
        object.__setattr__(self, "_fn", fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)

    def __setstate__(self, state: Any) -> None:
        raise _StateOnGlobal(self.wb_global)

    def __setattr__(self, name: str, value: Any) -> None:
        raise _StateOnGlobal(self.wb_global)

    def __delattr__(self, name: str) -> None:
        raise _StateOnGlobal(self.wb_global)

    def __repr__(self) -> str:
        return f"<{self.wb_global}>"


_TYPE_REPLACEMENTS: dict[str, Any] = {
    "builtins.set": set,
    "builtins.frozenset": frozenset,
    "builtins.list": list,
    "builtins.dict": dict,
    "builtins.tuple": tuple,
    "builtins.slice": slice,
    "collections.OrderedDict": OrderedDict,
}

# Builtin types above are immutable (setting an attribute on them raises); every function is wrapped.
_FUNCTION_REPLACEMENTS: dict[str, Callable[..., Any]] = {
    "builtins.complex": _complex,
    "builtins.bytearray": _bytes_like(bytearray),
    "builtins.bytes": _bytes_like(bytes),
    "_codecs.encode": _encode,
    "collections.defaultdict": _plain_dict,
    "collections.Counter": _plain_dict,
    "copyreg._reconstructor": _reconstructor,
    "torch.Size": lambda dims=(): _int_tuple(dims, "torch.Size"),
    "torch.device": lambda *args: ":".join(str(a) for a in args),
    "torch.serialization._get_layout": lambda name: str(name),
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
    "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
    "torch._utils._rebuild_tensor": _unsupported("legacy tensor"),
    "torch._utils._rebuild_qtensor": _unsupported("quantized tensor"),
    "torch._utils._rebuild_sparse_tensor": _unsupported("sparse tensor"),
    "torch._utils._rebuild_meta_tensor_no_storage": _unsupported("meta tensor (no data)"),
    "torch._utils._rebuild_nested_tensor": _unsupported("nested tensor"),
    "torch._utils._rebuild_wrapper_subclass": _unsupported("tensor subclass"),
    "torch._utils._rebuild_device_tensor_from_numpy": _unsupported("tensor rebuilt from numpy"),
    "torch._utils._rebuild_device_tensor_from_cpu_tensor": _unsupported("device tensor"),
    "numpy.core.multiarray.scalar": _numpy_scalar,
    "numpy._core.multiarray.scalar": _numpy_scalar,
}

_REPLACEMENTS: dict[str, Any] = {
    **_TYPE_REPLACEMENTS,
    **{name: Builder(name, fn) for name, fn in _FUNCTION_REPLACEMENTS.items()},
}

_PLACEHOLDER_CLASSES: dict[str, type[Placeholder]] = {}


def _placeholder_class(module: str, name: str) -> type[Placeholder]:
    qualified = f"{module}.{name}"
    cls = _PLACEHOLDER_CLASSES.get(qualified)
    if cls is None:
        safe_name = "".join(c if c.isalnum() or c == "_" else "_" for c in name)[:60] or "Global"
        cls = type(safe_name, (Placeholder,), {"wb_global": qualified, "__module__": __name__})
        _PLACEHOLDER_CLASSES[qualified] = cls
    return cls


class _InertUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, *, strict: Callable[[str], bool] | None) -> None:
        super().__init__(io.BytesIO(data))
        self.seen_globals: list[str] = []
        self._strict = strict

    def find_class(self, module: str, name: str) -> Any:
        qualified = f"{module}.{name}"
        if qualified not in self.seen_globals:
            self.seen_globals.append(qualified)
        if self._strict is not None and not self._strict(qualified):
            raise _Refused(qualified)
        if qualified in _REPLACEMENTS:
            return _REPLACEMENTS[qualified]
        if module == "torch" and name in TORCH_DTYPE_NAMES:
            return DtypeRef(name)
        if module in ("torch", "torch.storage", "torch.cuda") and name in STORAGE_DTYPES:
            return StorageType(name, STORAGE_DTYPES[name])
        return _placeholder_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage":
            _, storage_type, key, location, numel = pid
            if isinstance(storage_type, StorageType) and isinstance(key, str):
                untyped = storage_type.name in ("UntypedStorage", "TypedStorage")
                return StorageRef(key, storage_type.dtype, _int(numel, "storage size"), str(location), untyped)
        raise ValueError(f"unsupported persistent id {_short_repr(pid)}")


class _Refused(Exception):
    def __init__(self, qualified: str) -> None:
        super().__init__(qualified)
        self.qualified = qualified


class _StateOnGlobal(Exception):
    def __init__(self, qualified: str) -> None:
        super().__init__(qualified)
        self.qualified = qualified


def load_inert(data: bytes, *, source: str, strict: Callable[[str], bool] | None = None, stored: int | None = None) -> PickleResult:
    """Unpickle `data` without executing anything it names; `source` names the file in errors.

    With `strict`, a global for which `strict(qualified_name)` is False is refused with a CheckpointError.
    """
    problem = pickle_problem(data, stored)
    if problem is not None:
        raise CheckpointError(
            f"Cannot read {source}: its pickle is corrupt or crafted ({problem}). Re-download or re-save the file.", file=source
        )
    unpickler = _InertUnpickler(data, strict=strict)
    try:
        root = unpickler.load()
    except _Refused as refused:
        raise CheckpointError(
            f"Cannot read {source}: its pickle names {refused.qualified}, which is not allowed in this kind of file. "
            "The file may have been tampered with; regenerate it from a trusted source.",
            file=source,
        ) from None
    except _StateOnGlobal as refused:
        raise CheckpointError(
            f"Cannot read {source}: its pickle tries to set attributes on {refused.qualified}, a function the reader "
            "provides (no checkpoint does this). The file is crafted; regenerate it from a trusted source.",
            file=source,
        ) from None
    except RecursionError:
        raise CheckpointError(f"Cannot read {source}: its pickle nests too deeply to be a checkpoint. Check the file.", file=source) from None
    except Exception as exc:  # only inert builders run: any failure (OverflowError on a FRAME length ...) means a bad pickle
        raise CheckpointError(
            f"Cannot read {source}: its pickle is corrupt or not a checkpoint ({type(exc).__name__}: {_short_repr(str(exc), 200)}). "
            "Re-download or re-save the file.",
            file=source,
        ) from None
    return PickleResult(root, unpickler.seen_globals)


def global_name(obj: Any) -> str | None:
    """The qualified global a placeholder stands for, or None for plain values."""
    return obj.wb_global if isinstance(obj, Placeholder) or (isinstance(obj, type) and issubclass(obj, Placeholder)) else None


def describe(value: Any, limit: int = 80) -> str:
    """A short human-readable rendering of any unpickled value, for tables."""
    if isinstance(value, (TensorRef, Placeholder, DtypeRef, UnsupportedTensor)):
        return _short_repr(value, limit)
    if isinstance(value, type) and issubclass(value, Placeholder):
        return f"<class {value.wb_global}>"
    return _short_repr(value, limit)
