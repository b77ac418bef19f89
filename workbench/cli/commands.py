"""The `workbench` command: inspect, diff and verify checkpoints from the shell.

Each subcommand is a `Subcommand` entry in `SUBCOMMANDS`: a function that declares its arguments and a
function that runs it and returns the exit status. Both call the Python API and hold no logic of their
own beyond presenting results. Exit status: 0 success, 1 "differences found" (diff), 2 bad input (a
malformed or missing checkpoint, a bad argument), 3 a bug in workbench; failures print a one-paragraph
message on stderr instead of a traceback.

Header-only work (inspect, verify) imports neither torch nor pandas, so it answers in a fraction of a
second even for checkpoints with hundreds of shards; `inspect --layers` and `diff` use the pandas
tables of `workbench.explore.checkpoint`, and only `diff --values` reads tensor data (and imports torch).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TextIO

from ..display import format_bytes, format_count, format_shape, text_table
from ..errors import WorkbenchError
from ..names import name_filter, no_match_hint
from .convert import convert_arguments, open_arguments, open_options, plan_arguments, run_convert, run_plan
from .merge import merge_arguments, run_merge
from .terminal import escape, guarded_output

URL_FORMS = "hf://org/repo[@revision][/subfolder], https://host/folder/, s3://bucket/prefix/ (headers by range requests, cached)"

EXIT_OK = 0
EXIT_DIFFERENT = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class Subcommand:
    """One `workbench <name>` command: its help line, its arguments and what it runs."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ----------------------------------------------------------------------------------------- output


def write_csv(stream: TextIO, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """Rows as CSV with a header line."""
    import csv

    writer = csv.writer(stream, lineterminator="\n")
    writer.writerow(columns)
    writer.writerows(rows)


def _print(text: str = "") -> None:
    sys.stdout.write(text + "\n")


def _warn(text: str) -> None:
    sys.stderr.write(f"warning: {text}\n")


# ---------------------------------------------------------------------------------------- inspect


def _inspect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="a checkpoint file or folder (.safetensors, an HF model folder, an index file, DCP, "
                                     "torch, DeepSpeed, Megatron, GGUF ...), or a URL: " + URL_FORMS)
    parser.add_argument("--format", choices=("table", "json", "csv"), default="table", help="output format (default: table)")
    parser.add_argument("--layers", action="store_true", help="fold per-layer tensors into one row per pattern ({i})")
    parser.add_argument(
        "--filter",
        action="append",
        metavar="PATTERN",
        help="only tensors this pattern selects: the whole name or a run of its dotted segments, with * ? [..] "
        "globs and {i} placeholders, e.g. 'layers.{i}.self_attn.*' (repeatable: any match)",
    )
    open_arguments(parser)


def _selected(names: list[str], patterns: Sequence[str] | None) -> list[str]:
    if not patterns:
        return names
    tests = [name_filter(pattern) for pattern in patterns]
    return [n for n in names if any(keep(n) for keep in tests)]


def checkpoint_summary(catalog: Any, path: str) -> dict[str, Any]:
    """The facts of the inspect header line: format, counts, total size, dtypes, metadata, warnings."""
    dtypes: dict[str, dict[str, int]] = {}
    params = 0
    logical = catalog.columns.get("logical_shape", {})  # quantised blocks stored as bytes: count their values
    for info in catalog.tensors.values():
        entry = dtypes.setdefault(info.dtype, {"tensors": 0, "bytes": 0})
        entry["tensors"] += 1
        entry["bytes"] += info.nbytes
        shape = logical.get(info.name)
        params += info.numel if shape is None else math.prod(shape)
    return {
        "path": path,
        "format": catalog.format,
        "files": len(catalog.files),
        "tensors": len(catalog.tensors),
        "parameters": params,
        "total_bytes": sum(d["bytes"] for d in dtypes.values()),
        "dtypes": dict(sorted(dtypes.items(), key=lambda kv: -kv[1]["bytes"])),
        "metadata": dict(catalog.metadata),
        "warnings": list(catalog.warnings),
    }


def _summary_line(summary: dict[str, Any]) -> str:
    dtypes = ", ".join(f"{code} x{d['tensors']} ({format_bytes(d['bytes'])})" for code, d in summary["dtypes"].items())
    return (
        f"{summary['path']}: {summary['format']}, {format_count(summary['files'], 'file')}, {summary['tensors']} tensors, "
        f"{summary['parameters']:,} parameters, {format_bytes(summary['total_bytes'])}\n"
        f"dtypes: {dtypes or 'none'}"
    )


TENSOR_FIELDS = ("name", "dtype", "shape", "numel", "nbytes", "file", "begin", "end")


def tensor_records(catalog: Any, names: Iterable[str]) -> Iterator[dict[str, Any]]:
    """One JSON-ready record per tensor (name, dtype, shape, numel, nbytes, file, begin, end), made as it is
    written: a header of 10^6 tensors is listed without holding 10^6 records."""
    tensors = catalog.tensors
    for name in names:
        t = tensors[name]
        record = {"name": name, "dtype": t.dtype, "shape": list(t.shape), "numel": t.numel, "nbytes": t.nbytes,
                  "file": t.file, "begin": t.begin, "end": t.end}
        for column in catalog.shown_columns:
            value = catalog.columns.get(column, {}).get(name)
            record[column] = list(value) if isinstance(value, tuple) else value
        yield record


def layer_records(catalog: Any, names: Iterable[str]) -> list[dict[str, Any]]:
    """One record per folded pattern (`model.layers.{i}.x` xN), as `Checkpoint.layers` computes it: count,
    index range, typical dtype and shape, bytes of all members, members that differ (`odd_layers`)."""
    from ..catalog import Catalog
    from ..explore.checkpoint import Checkpoint

    chosen = Catalog(root=catalog.root, format=catalog.format, tensors={n: catalog.tensors[n] for n in names})
    frame = Checkpoint(chosen).layers
    records = []
    for pattern, row in zip(frame.index, frame.itertuples(index=False), strict=True):
        record = {"pattern": pattern, **{k: _plain(v) for k, v in row._asdict().items()}}
        record["shape"] = list(record["shape"])
        records.append(record)
    return records


def write_json(stream: TextIO, head: dict[str, Any], list_key: str, records: Iterable[dict[str, Any]]) -> None:
    """`{**head, list_key: records}` as JSON, one record per line so large outputs stay greppable."""
    stream.write("{\n")
    for key, value in head.items():
        stream.write(f" {json.dumps(key)}: {json.dumps(value)},\n")
    stream.write(f" {json.dumps(list_key)}: [")
    first = True
    for record in records:
        stream.write(("\n  " if first else ",\n  ") + json.dumps(record))
        first = False
    stream.write("]\n}\n" if first else "\n ]\n}\n")


def _csv_cell(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return format_shape(value) if all(isinstance(v, int) for v in value) else " ".join(map(str, value))
    return value


def _suggestions(catalog: Any, path: str) -> list[dict[str, str]]:
    """Presets that apply to the checkpoint (from config.json and names); [] when its config cannot be read."""
    from ..mapper.presets.suggest import model_config, suggest_rows

    try:
        _, rows = suggest_rows(catalog.tensors, model_config(path, catalog), registry=False)
    except WorkbenchError as exc:
        _warn(f"no preset suggestions: {exc.message}")
        return []
    return [{"preset": preset, "why": why} for preset, why in rows]


def run_inspect(args: argparse.Namespace) -> int:
    """List a checkpoint's tensors (or folded layers) from its headers alone."""
    from ..explore.layers import natural_key
    from ..formats import open_catalog

    catalog = open_catalog(args.path, **open_options(args))
    from ..mapper.presets.packed import annotate_found

    annotate_found(catalog)  # packed quantised tensors: format, role, bits, group, which scales belong to which
    names = _selected(sorted(catalog.tensors, key=natural_key), args.filter)
    if args.filter and not names:
        hints = " ".join(filter(None, map(no_match_hint, args.filter)))
        _warn(f"no tensor of {args.path} matches {' or '.join(map(repr, args.filter))}." + (f" {hints}" if hints else ""))
    summary = checkpoint_summary(catalog, args.path)
    summary["shown"] = len(names)
    list_key = "layers" if args.layers else "tensors"
    records = layer_records(catalog, names) if args.layers else tensor_records(catalog, names)

    suggestions = _suggestions(catalog, args.path)
    if args.format == "json":
        summary["suggested_presets"] = suggestions
        write_json(sys.stdout, {"summary": summary}, list_key, records)
        return EXIT_OK
    if args.format == "csv":
        if args.layers:
            columns = list(records[0]) if records else ["pattern"]
        else:
            columns = [*TENSOR_FIELDS, *catalog.shown_columns]
        write_csv(sys.stdout, columns, ([_csv_cell(r[c]) for c in columns] for r in records))
        return EXIT_OK

    for warning in summary["warnings"]:
        _warn(warning)
    _print(_summary_line(summary))
    if args.filter:
        _print(f"showing {len(names)} of {summary['tensors']} tensors matching {' or '.join(args.filter)}")
    _print()
    if args.layers:
        rows = [
            (escape(r["pattern"]), r["count"], r["range"], r["dtype"], format_shape(r["shape"]), format_bytes(r["nbytes"]), r["odd_layers"])
            for r in records
        ]
        columns = ("pattern", "count", "range", "dtype", "shape", "size", "odd layers")
        _print(text_table(columns, rows, indent="", limit=None, rule=True, right=("count", "size")))
        _print_suggestions(suggestions)
        return EXIT_OK
    many_files = len(catalog.files) > 1
    extra = [(column, catalog.columns.get(column, {})) for column in catalog.shown_columns]
    columns = ["name", "dtype", "shape", "numel", "size"] + [c for c, _ in extra] + (["file"] if many_files else [])

    def rows() -> Iterator[list[str]]:
        for name in names:
            t = catalog.tensors[name]
            row = [escape(name), t.dtype, format_shape(t.shape), f"{t.numel:,}", format_bytes(t.nbytes)]
            row += [_column_cell(values.get(name)) for _, values in extra]
            yield [*row, escape(t.file)] if many_files else row

    _print_table(columns, rows, right=("numel", "size"))
    _print_key_values(catalog)
    _print_suggestions(suggestions)
    return EXIT_OK


def _column_cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, tuple) and all(isinstance(v, int) for v in value):
        return format_shape(value)
    if isinstance(value, tuple):  # names (a packed weight's parts): their last segments, the rest is the row's own
        return escape(", ".join(str(v).rsplit(".", 1)[-1] for v in value))
    return escape(str(value))


def _print_key_values(catalog: Any) -> None:
    """A GGUF file's key/values (any reader offering `key_values()`), arrays summarised, long values cut."""
    listing = getattr(catalog.reader, "key_values", None)
    if listing is None:
        return
    rows = [(escape(v.key), v.type, escape(v.shown()[:100])) for v in listing()]
    if rows:
        _print()
        _print(text_table(("key", "type", "value"), rows, indent="", limit=None, rule=True))


def _print_table(columns: list[str], rows: Callable[[], Iterator[list[str]]], right: tuple[str, ...]) -> None:
    """The aligned table `text_table(..., indent="", limit=None, rule=True)` prints, written a line at a time: one
    pass over `rows()` for the widths, one to print, so a table of 10^6 tensors never exists whole in memory."""
    widths = [len(c) for c in columns]
    for row in rows():
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    aligned = [c in right for c in columns]

    def line(texts: list[str]) -> str:
        return "  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(texts, widths, aligned, strict=True)).rstrip()

    write = sys.stdout.write
    write(line(columns) + "\n" + line(["-" * w for w in widths]) + "\n")
    for row in rows():
        write(line(row) + "\n")


def _print_suggestions(suggestions: list[dict[str, str]]) -> None:
    if suggestions:
        _print()
        for row in suggestions:
            _print(f"suggested preset: {row['preset']} ({row['why']})")


# ------------------------------------------------------------------------------------------- diff


def _diff_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", help="the first checkpoint (file, folder or URL)")
    parser.add_argument("b", help="the second checkpoint (file, folder or URL)")
    parser.add_argument("--values", action="store_true", help="also compare values (reads tensor data; imports torch)")
    parser.add_argument("--format", choices=("table", "json", "csv"), default="table", help="output format (default: table)")
    parser.add_argument("--mapper", metavar="FILE", help="Python file defining `mapper`: compare A seen through it with B")
    parser.add_argument("--source", action="append", default=[], metavar="NAME=PATH", dest="sources",
                        help="another checkpoint A reads from (its tensors named NAME::tensor; A is source 'base')")


def _diff_source(args: argparse.Namespace) -> Any:
    """A alone, or {'base': A, NAME: PATH ...} with --source."""
    from .convert import named_sources

    return named_sources(args.a, args.sources)


def run_diff(args: argparse.Namespace) -> int:
    """Show tensors added, removed or changed between two checkpoints; exit 1 when any differ."""
    from ..explore.checkpoint import open_checkpoint

    a = open_checkpoint(_diff_source(args))
    mapper = None
    if args.mapper:
        from .convert import load_mapper_file

        mapper = load_mapper_file(args.mapper)
    frame = a.diff(open_checkpoint(args.b), values=args.values, mapper=mapper)
    columns = ["name", *frame.columns]
    rows = []
    for name, record in zip(frame.index, frame.itertuples(index=False), strict=True):
        rows.append((name, *(_plain(v) for v in record)))
    if args.format == "json":
        records = [dict(zip(columns, (list(v) if isinstance(v, tuple) else v for v in row), strict=True)) for row in rows]
        write_json(sys.stdout, {"a": args.a, "b": args.b}, "differences", records)
    elif args.format == "csv":
        write_csv(sys.stdout, columns, [[_csv_cell(v) for v in row] for row in rows])
    elif not rows:
        _print(f"{args.a} and {args.b} hold the same {len(a)} tensors (names, dtypes, shapes{', values' if args.values else ''}).")
    else:
        counts: dict[str, int] = {}
        for row in rows:
            counts[row[1]] = counts.get(row[1], 0) + 1
        _print(f"{args.a} -> {args.b}: " + ", ".join(f"{n} {status}" for status, n in counts.items()))
        _print()
        table_rows = [tuple(format_shape(v) if isinstance(v, tuple) else escape(_cell(v)) for v in row) for row in rows]
        _print(text_table(columns, table_rows, indent="", limit=None, rule=True, right=("max_abs_diff",)))
    return EXIT_DIFFERENT if rows else EXIT_OK


def _plain(value: Any) -> Any:
    """A pandas cell as a JSON-friendly Python value (NaN and missing become None)."""
    if value is None:
        return None
    if isinstance(value, float) and value != value:
        return None
    if hasattr(value, "item"):
        return value.item()
    return value


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


# ----------------------------------------------------------------------------------------- verify


def _verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="a checkpoint file or folder, or a URL: " + URL_FORMS)
    parser.add_argument(
        "--checksums", action="store_true",
        help="also hash every tensor (SHA-256): record the sums in a sidecar the first time, check them after",
    )
    parser.add_argument("--sidecar", metavar="PATH", help="checksum file to record or check (default: checksums.sha256.json beside the checkpoint)")
    parser.add_argument("--record", action="store_true", help="record the checksums again even if a sidecar exists")
    parser.add_argument("--model", action="store_true",
                        help="also check tensor names and shapes against the model transformers builds from config.json "
                             "(on the meta device; imports torch and transformers)")


def run_verify(args: argparse.Namespace) -> int:
    """Check a checkpoint's structure (headers, index, every shard complete) and optionally its tensors' checksums."""
    from ..explore.verify import verify

    report = verify(args.path, checksums=args.checksums, sidecar=args.sidecar, record=args.record, model=args.model)
    _print(report.summary())
    for finding in report.findings:
        _print(f"  {finding}")
    errors = report.errors
    if errors:
        first = errors[0]
        more = f" ({len(errors) - 1} more listed above)" if len(errors) > 1 else ""
        sys.stderr.write(f"workbench verify: {first.message}{more}\n")
        return EXIT_BAD_INPUT
    return EXIT_OK


# ------------------------------------------------------------------------------------------- main

SUBCOMMANDS: list[Subcommand] = [
    Subcommand("inspect", "list a checkpoint's tensors from its headers (no tensor data read)", _inspect_arguments, run_inspect),
    Subcommand("diff", "show tensors added, removed or changed between two checkpoints", _diff_arguments, run_diff),
    Subcommand("verify", "check headers, index consistency and that every shard is complete", _verify_arguments, run_verify),
    Subcommand("plan", "dry-run a conversion: layout, files and bytes read, peak memory, problems", plan_arguments, run_plan),
    Subcommand("convert", "convert a checkpoint to safetensors shards, DCP, GGUF or Meta .pth (dry-run first, report after)",
               convert_arguments, run_convert),
    Subcommand("merge", "merge models by a mergekit config (YAML): dry-run first, report after", merge_arguments, run_merge),
]


class _Parser(argparse.ArgumentParser):
    """A parser whose "invalid choice" errors (a mistyped command, `--rest kep`) name the closest choice."""

    def error(self, message: str) -> NoReturn:
        import difflib
        import re

        typed = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        choices = re.findall(r"'([^']*)'", typed.group(2)) if typed else []
        close = difflib.get_close_matches(typed.group(1), choices, n=1) if typed else []
        super().error(message + (f". Did you mean {close[0]}?" if close else ""))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one subparser per entry of `SUBCOMMANDS`."""
    from .. import __version__

    parser = _Parser(
        prog="workbench",
        description="Look inside PyTorch checkpoints without loading them; plan and run layout conversions.",
        epilog="A checkpoint (SRC, PATH, A, B) is a local file or folder, or a URL: " + URL_FORMS + ". Destinations "
               "are local folders. `workbench COMMAND --help` lists a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"workbench {__version__}")
    parser.add_argument("--debug", action="store_true", help="show a traceback for unexpected errors")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands: dict[str, argparse.ArgumentParser] = {}
    for sub in SUBCOMMANDS:
        sub_parser = subparsers.add_parser(sub.name, help=sub.help, description=sub.help[0].upper() + sub.help[1:] + ".")
        sub.add_arguments(sub_parser)
        sub_parser.set_defaults(run=sub.run)
        commands[sub.name] = sub_parser
    parser.set_defaults(commands=commands)
    return parser


def _refuse_unknown(args: argparse.Namespace, unknown: list[str]) -> None:
    """Exit with the subcommand's own usage naming the arguments it does not take, and the closest option to
    each mistyped one (argparse alone shows the top-level usage and no suggestion)."""
    import difflib

    sub_parser: argparse.ArgumentParser = args.commands[args.command]
    options = [option for action in sub_parser._actions for option in action.option_strings]
    hints = []
    for item in unknown:
        flag = item.split("=", 1)[0]
        close = difflib.get_close_matches(flag, options, n=1, cutoff=0.6) if flag.startswith("-") else []
        if close:
            hints.append(f"{close[0]} (for {flag})")
    message = f"unrecognized arguments: {' '.join(unknown)}." + (f" Did you mean {', '.join(hints)}?" if hints else "")
    sub_parser.error(message)


def _os_error_message(exc: OSError, command: str) -> str:
    target = f" {exc.filename}" if exc.filename else ""
    return f"Cannot {command}{target}: {exc.strerror or exc}. Check the path and its permissions."


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `workbench` console script; returns the exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _refuse_unknown(args, unknown)
    with guarded_output():  # names from untrusted files reach the terminal escaped (see cli.terminal)
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """Run the parsed command; map its errors to an exit status and a one-paragraph message."""
    prefix = f"workbench {args.command}"
    try:
        return args.run(args)
    except WorkbenchError as exc:
        sys.stderr.write(f"{prefix}: {exc.message}\n")
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        # The reader of our output went away (`| head`): stop quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except OSError as exc:
        sys.stderr.write(f"{prefix}: {_os_error_message(exc, args.command)}\n")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        sys.stderr.write(f"{prefix}: interrupted.\n")
        return EXIT_INTERRUPTED
    except Exception as exc:
        if args.debug:
            traceback.print_exc()
        else:
            sys.stderr.write(
                f"{prefix}: internal error: {type(exc).__name__}: {exc}. This is a bug in workbench; "
                "re-run with --debug for a traceback and report it.\n"
            )
        return EXIT_INTERNAL
