"""Exact export: mappers as readable Python code and as JSON, both rebuilding an equal mapper.

Templates stay templates, so a preset over 80 layers exports as a few lines. The JSON form is what
the engine ships to torchrun workers; the code form is what users edit and pass to the CLI.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from ..errors import MapperError
from ..formats.json_errors import json_problem
from .base import Mapper
from .claim import Claim
from .compose import Parallel, PrefixScope, Sequential
from .config_update import ConfigUpdate
from .function import Function
from .op import Op
from .ops import Cast, Concat, Drop, Identity, Rename, Reshape, Split, Stack, Transpose, Unstack
from .output_file import OutputFile
from .ranges import ORDER_NOTE, has_ranges
from .unsupported import Unsupported

FORMAT = "workbench.mapper"
VERSION = 1
LINE_WIDTH = 100
SHORT_WIDTH = 160


@functools.cache
def _operations() -> dict[str, type[Mapper]]:
    """Operation name -> class, for reading JSON back. The merge operations are imported here, when a mapper is
    read, not with this module: exporting a plan's mapper (every conversion fingerprints it) needs none of them."""
    from .merge import Merge, MergeModels
    from .merge.refusal import Refused
    from .merge.slices import Duplicate, MergeSlices, SliceCopies
    from .merge.vocabulary import AlignVocabulary

    return {cls.__name__: cls for cls in (
        Rename, Identity, Drop, Concat, Stack, Split, Unstack, Transpose, Reshape, Cast, Unsupported, Function, Merge, MergeModels,
        MergeSlices, SliceCopies, Duplicate, Refused, AlignVocabulary, Sequential, Parallel, PrefixScope, Claim, ConfigUpdate, OutputFile)}


def __getattr__(name: str) -> Any:
    if name == "OPERATIONS":  # the public table, built on first use (see `_operations`)
        return _operations()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _literal(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_literal(item) for item in value) + "]"
    return repr(value)


def _leaf_fields(op: Op) -> list[tuple[str, Any]]:
    """(keyword or '' for positional, value) for each argument worth writing."""
    arguments = getattr(op, "arguments", None)
    if arguments is not None:  # an op whose fields are not its constructor's arguments (Merge, MergeModels)
        return [("" if key in op.POSITIONAL else key, value) for key, value in arguments().items()]  # type: ignore[attr-defined]
    args: list[tuple[str, Any]] = []
    keywords_only = isinstance(op, Function)
    for field in dataclasses.fields(op):  # type: ignore[arg-type]
        value = getattr(op, field.name)
        if field.name == "params" and isinstance(op, Function):
            if value:
                args.append(("params", op.kwargs))
            continue
        required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        if required and not keywords_only:
            args.append(("", value))
        elif required or value != field.default:
            args.append((field.name, value))
    return args


def _leaf_args(op: Op) -> list[str]:
    return [f"{key}={_literal(value)}" if key else _literal(value) for key, value in _leaf_fields(op)]


def _pretty_leaf_args(op: Op, indent: int) -> list[str]:
    """Arguments of a long leaf, one per line; a long name list gets one name per line."""
    out = []
    for key, value in _leaf_fields(op):
        text = f"{key}={_literal(value)}" if key else _literal(value)
        if isinstance(value, tuple) and len(value) > 1 and indent + len(text) > LINE_WIDTH:
            pad = " " * (indent + 4)
            items = "".join(f"{pad}{_literal(item)},\n" for item in value)
            text = f"{key + '=' if key else ''}[\n{items}{' ' * indent}]"
        out.append(text)
    return out


def _parts(mapper: Mapper, prefix: str) -> tuple[str, list[str]]:
    """Callable name and argument expressions (children rendered recursively, one line each)."""
    if isinstance(mapper, (Op, Claim, ConfigUpdate, OutputFile)):  # a Claim is a dataclass of plain fields, written like a leaf
        return prefix + type(mapper).__name__, _leaf_args(mapper)  # type: ignore[arg-type]
    if isinstance(mapper, (Sequential, Parallel)):
        return prefix + type(mapper).__name__, [code_expr(child, prefix) for child in mapper.mappers]
    if isinstance(mapper, PrefixScope):
        args = [code_expr(mapper.mapper, prefix)]
        args += [f"{f}={getattr(mapper, f)!r}" for f in ("source_prefix", "target_prefix") if getattr(mapper, f)]
        return prefix + "PrefixScope", args
    raise MapperError(f"Cannot export {type(mapper).__name__}: it is not a workbench mapper operation.")


def code_expr(mapper: Mapper, prefix: str = "M.") -> str:
    """A one-line Python expression rebuilding `mapper`."""
    name, args = _parts(mapper, prefix)
    return f"{name}({', '.join(args)})"


def _pretty(mapper: Mapper, prefix: str, indent: int) -> str:
    line = code_expr(mapper, prefix)
    if indent + len(line) <= LINE_WIDTH:
        return line
    name = _parts(mapper, prefix)[0]
    pad = " " * (indent + 4)
    if isinstance(mapper, (Sequential, Parallel)):
        args = [_pretty(child, prefix, indent + 4) for child in mapper.mappers]
    elif isinstance(mapper, PrefixScope):
        args = [_pretty(mapper.mapper, prefix, indent + 4)] + _parts(mapper, prefix)[1][1:]
    else:
        args = _pretty_leaf_args(mapper, indent + 4)  # type: ignore[arg-type]
    body = "".join(f"{pad}{arg},\n" for arg in args)
    return f"{name}(\n{body}{' ' * indent})"


def short_repr(mapper: Mapper) -> str:
    """One line for messages: the code expression without the `M.` prefix, shortened if long."""
    if isinstance(mapper, (Sequential, Parallel)) and len(mapper.mappers) > 3:
        inner = ", ".join(short_repr(child) for child in mapper.mappers[:2])
        text = f"{type(mapper).__name__}({inner}, ... {len(mapper.mappers) - 2} more)"
    else:
        text = code_expr(mapper, prefix="")
    return text if len(text) <= SHORT_WIDTH else text[: SHORT_WIDTH - 3] + "..."


def to_code(mapper: Mapper) -> str:
    """A Python module that defines `mapper`."""
    return (
        '"""A workbench mapper (written by mapper.to_code(); edit freely, it is the source of truth)."""\n\n'
        "from workbench import mapper as M\n\n"
        + (ORDER_NOTE + "\n" if any(has_ranges(leaf) for leaf in mapper.leaves() if isinstance(leaf, Op)) else "")
        + f"mapper = {_pretty(mapper, 'M.', 0)}\n"
    )


def to_dict(mapper: Mapper) -> dict[str, Any]:
    """A JSON-ready dict describing `mapper`."""
    arguments = getattr(mapper, "arguments", None)
    if arguments is not None:  # Merge, MergeModels, MergeSlices (SliceCopies), AlignVocabulary: fields are not arguments
        return {"op": type(mapper).__name__, **arguments()}
    if isinstance(mapper, (Op, Claim, ConfigUpdate, OutputFile)):
        out: dict[str, Any] = {"op": type(mapper).__name__}
        for field in dataclasses.fields(mapper):  # type: ignore[arg-type]
            value = getattr(mapper, field.name)
            if field.name == "params":
                value = dict(mapper.kwargs)  # type: ignore[attr-defined]
            elif isinstance(value, tuple):
                value = list(value)
            out[field.name] = value
        return out
    if isinstance(mapper, (Sequential, Parallel)):
        return {"op": type(mapper).__name__, "mappers": [to_dict(child) for child in mapper.mappers]}
    if isinstance(mapper, PrefixScope):
        return {"op": "PrefixScope", "mapper": to_dict(mapper.mapper), "source_prefix": mapper.source_prefix, "target_prefix": mapper.target_prefix}
    raise MapperError(f"Cannot export {type(mapper).__name__}: it is not a workbench mapper operation.")


def from_dict(data: Any) -> Mapper:
    """Rebuild a mapper from `to_dict` output, with clear errors for malformed input."""
    if not isinstance(data, dict) or "op" not in data:
        raise MapperError(f"Cannot read mapper JSON: expected an object with an 'op' key (got {str(data)[:80]!r}).")
    fields = dict(data)
    kind = fields.pop("op")
    operations = _operations()
    cls = operations.get(kind)
    if cls is None:
        raise MapperError(f"Cannot read mapper JSON: unknown operation {kind!r}. Known: {', '.join(operations)}.")
    try:
        if cls in (Sequential, Parallel):
            return cls(*[from_dict(child) for child in fields.pop("mappers")])
        if cls is PrefixScope:
            fields["mapper"] = from_dict(fields["mapper"])
        return cls(**fields)
    except MapperError:
        raise
    except (TypeError, KeyError) as exc:
        raise MapperError(f"Cannot read mapper JSON: bad fields for {kind} ({exc}).") from None


def to_json(mapper: Mapper, indent: int | None = None) -> str:
    """`mapper` as a JSON document."""
    return json.dumps({"format": FORMAT, "version": VERSION, "mapper": to_dict(mapper)}, indent=indent)


def from_json(text: str) -> Mapper:
    """Rebuild a mapper from `to_json` output."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise MapperError(f"Cannot read mapper JSON: it does not parse ({json_problem(exc)}).") from None
    if isinstance(data, dict) and data.get("format") == FORMAT:
        if data.get("version") != VERSION:
            raise MapperError(f"Cannot read mapper JSON: version {data.get('version')!r} is not supported (this workbench reads {VERSION}).")
        data = data.get("mapper")
    return from_dict(data)
