"""The `workbench plan` and `workbench convert` subcommands (registered in `workbench.cli`).

    workbench plan SRC [--mapper mapper.py] [--preset NAME] [--shard-size 5GB] [--nproc N] [--dtype bf16] [--dest DST]
    workbench convert SRC DST [--mapper mapper.py] [--preset NAME] [--shard-size 5GB] [--dtype bf16] [--nproc N] [--launcher auto|local|torchrun]
                      [--dry-run] [--no-extras] [--overwrite] [--rest keep|drop|error] [--quiet] [--verify]
                      [--on-overflow warn|error]
    (both also take [--to safetensors|dcp] [--select model|all] [--lightning-weights ema|model])

A mapper file is any Python file that defines `mapper` (what `mapper.to_code()` writes). Both
commands print the dry-run first; `convert` then runs it and prints the report. Bad input exits
with status 2 and a one-paragraph message. Neither command imports torch unless a step computes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..errors import MapperError, WorkbenchError
from ..mapper.files import load_mapper_file

SOURCE_HELP = ("checkpoint file or folder, or a URL: hf://org/repo[@revision][/subfolder], https://host/folder/, "
               "s3://bucket/prefix/")

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_BAD_INPUT = 2


def _common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mapper", metavar="FILE", help="Python file defining `mapper` (default: copy every tensor)")
    parser.add_argument("--preset", metavar="NAME",
                        help="a preset of workbench.mapper.presets built from the source's config.json, e.g. from_transformers "
                             "(see `workbench inspect SRC` for the ones that apply); several, comma-separated, run in "
                             "order (each built on what the previous ones make); with --mapper, the presets run first")
    parser.add_argument("--shard-size", default=None, help="largest shard, e.g. 5GB (decimal) or 500MiB (default 5GB; one file for --to gguf)")
    parser.add_argument("--dtype", help="store every floating-point tensor in this floating-point dtype (bf16, fp16, fp32, "
                                        "fp64, fp8, F8_E5M2 ...); integer and bool tensors are never cast; with --to gguf the type of "
                                        "matrices: f32, f16, bf16, q8_0, q4_0 (norms stay F32)")
    parser.add_argument("--nproc", type=int, default=1, help="processes to run on (worker processes when > 1, see --launcher)")
    parser.add_argument("--rest", choices=("keep", "drop", "error"), default="keep",
                        help="what happens to tensors the mapper does not mention (default keep)")
    parser.add_argument("--no-extras", action="store_true", help="do not copy config.json, tokenizer files ...")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier conversion in the destination")
    parser.add_argument("--no-page-align", dest="page_align", action="store_false",
                        help="keep safetensors headers minimal (bytes identical to safetensors.save_file) instead of "
                             "padding them so kernel copies are page-congruent")
    parser.add_argument("--to", default="safetensors", metavar="FORMAT",
                        help="output format, one of workbench.output.OUTPUT_FORMATS: safetensors (HF shards, default) "
                             "or dcp (a torch.distributed.checkpoint folder), gguf (llama.cpp), pth (Meta consolidated.NN.pth)")
    parser.add_argument("--nproc-mp", type=int, default=1, metavar="N",
                        help="with --to pth: Meta's N model-parallel files consolidated.00 .. NN.pth (default 1)")
    parser.add_argument("--spool-size", default=None, metavar="SIZE",
                        help="remote destinations (s3://, hf://): bytes of finished files a rank's local spool may hold "
                             "while they upload (default 4GiB; the plan states what it needs as spool)")
    parser.add_argument("--spool-dir", default=None, metavar="DIR",
                        help="remote destinations: the local spool folder (default $WORKBENCH_SPOOL_DIR, else the temp folder)")
    parser.add_argument("--remote-option", action="append", default=[], metavar="KEY=VALUE", dest="remote_options",
                        help="a remote destination's own setting, e.g. part_size=64MiB for s3:// (see docs/remote.md); repeatable")
    parser.add_argument("--source", action="append", default=[], metavar="NAME=PATH", dest="sources",
                        help="another checkpoint to read from, its tensors named NAME::tensor (SRC is source 'base')")
    parser.add_argument("--adapter", metavar="DIR", action="append",
                        help="a PEFT adapter folder to merge into SRC (source 'adapter'; before --mapper if both); "
                             "repeated, the adapters merge one after the other, in order, as PEFT would merge_and_unload "
                             "each in turn (sources 'adapter', 'adapter2' ...)")
    parser.add_argument("--select", choices=("model", "all"),
                        help="training checkpoints: keep the model weights only (prefixes stripped), or everything")
    parser.add_argument("--lightning-weights", choices=("ema", "model"),
                        help="Lightning checkpoints: extract the EMA weights or the live model weights (prefixes stripped)")
    open_arguments(parser)


def open_arguments(parser: argparse.ArgumentParser) -> None:
    """How a source is opened (`open_options`): the same flags for inspect, plan and convert."""
    parser.add_argument("--zero-weights", choices=("fp32", "module"),
                        help="DeepSpeed runs: the fp32 master weights (default, as zero_to_fp32) or the lower-precision "
                             "module weights as saved (ZeRO 1 and 2)")
    parser.add_argument("--zero-moments", action="store_true",
                        help="DeepSpeed runs: also list Adam's moments as optimizer.state.<name>.exp_avg[_sq]")


def plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `workbench plan`."""
    parser.add_argument("source", metavar="SRC", help=SOURCE_HELP)
    parser.add_argument("--dest", metavar="DST", help="destination folder to check (not empty, free space, resumable)")
    _common_arguments(parser)


def convert_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `workbench convert`."""
    parser.add_argument("source", metavar="SRC", help=SOURCE_HELP)
    parser.add_argument("dest", metavar="DST", help="output folder, local (safetensors shards; DCP, GGUF or Meta .pth "
                                                    "with --to); a URL destination is refused")
    _common_arguments(parser)
    parser.add_argument("--launcher", choices=("auto", "local", "torchrun"), default="auto",
                        help="how --nproc > 1 starts its workers on this machine: auto (default: local), local (no "
                             "torch import, no torchrun start-up) or torchrun; multi-node: run `workbench convert` "
                             "under your own torchrun instead")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and stop")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--verify", action="store_true",
        help="re-read every output and compare it with the source (exit 1 on any mismatch)",
    )
    parser.add_argument("--on-overflow", choices=("warn", "error"), default="warn",
                        help="values a cast cannot hold (fp16 -> inf, fp8 saturation): warn and count them (default), "
                             "or fail the run before its index is written")


def adapter_names(adapters: Sequence[str] | None) -> list[str]:
    """The source names of repeated --adapter folders: 'adapter', then 'adapter2', 'adapter3' ..."""
    return ["adapter" if i == 0 else f"adapter{i + 1}" for i in range(len(adapters or ()))]


def named_sources(source: str, items: Sequence[str], adapters: Sequence[str] | None = None) -> str | dict[str, str]:
    """SRC alone, or {'base': SRC, NAME: PATH ..., 'adapter': DIR, 'adapter2': DIR2 ...} from --source / --adapter.

    Each name must be new: SRC is source 'base' (a `--source base=X` would replace it, and convert X instead),
    a NAME given twice would keep only its last path, and `--source adapter=` would collide with --adapter.
    """
    extra: dict[str, str] = {"base": source}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise MapperError(f"Cannot use --source {item!r}: write it as NAME=PATH, e.g. --source step2000=ckpt/step2000.")
        if name == "base":
            raise MapperError(f"Cannot use --source {item!r}: 'base' is SRC ({source}), the checkpoint being converted. "
                              f"Give the other checkpoint another name (e.g. --source other={path}), or pass it as SRC.")
        if name in extra:
            raise MapperError(f"Cannot use --source {name}= twice ({extra[name]} and {path}): each source needs its own "
                              f"name. Rename one (e.g. --source {name}2={path}).")
        extra[name] = path
    for name, path in zip(adapter_names(adapters), adapters or (), strict=True):
        if name in extra:
            raise MapperError(f"Cannot use --source {name}={extra[name]} with --adapter {path}: --adapter folders are "
                              f"sources '{name}' (then adapter2, adapter3 ...). Give the --source another name.")
        extra[name] = path
    return extra if len(extra) > 1 else source


def _source(args: argparse.Namespace) -> Any:
    """SRC alone, or {'base': SRC, NAME: PATH ..., 'adapter': DIR ...} when --source / --adapter add sources."""
    sources = named_sources(args.source, args.sources, args.adapter)
    options = open_options(args)
    if options:
        if isinstance(sources, dict):
            raise MapperError("Cannot combine --zero-weights / --zero-moments with --source or --adapter: open the "
                              "DeepSpeed run alone.")
        from ..formats import open_catalog

        return open_catalog(args.source, **options)
    return sources


def open_options(args: argparse.Namespace) -> dict[str, object]:
    """The format options the command line asks for (DeepSpeed's weight selection and moments)."""
    options: dict[str, object] = {}
    if getattr(args, "zero_weights", None):
        options["weights"] = args.zero_weights
    if getattr(args, "zero_moments", False):
        options["moments"] = True
    return options


def _mapper(args: argparse.Namespace) -> tuple[Any, str]:
    """The user's mapper file, preceded by the --adapter merge and the --select / --lightning-weights extraction."""
    mapper = load_mapper_file(args.mapper) if args.mapper else None
    if getattr(args, "preset", None):
        from ..formats import open_catalog
        from ..mapper import Sequential
        from ..mapper.presets.suggest import build_chain, model_config

        source: Any = open_catalog(args.source, **open_options(args))
        args.preset_catalog = source  # `_plan` plans from it: the folder's headers are read once
        preset = build_chain([part.strip() for part in args.preset.split(",") if part.strip()], source,
                             model_config(args.source, source))
        mapper = preset if mapper is None else Sequential(preset, mapper)
    if args.adapter:
        from ..mapper import Sequential, presets

        merges = [presets.lora_merge(path, source=name, base=args.source) for name, path in zip(adapter_names(args.adapter), args.adapter, strict=True)]
        merge = merges[0] if len(merges) == 1 else Sequential(*merges)
        mapper = merge if mapper is None else Sequential(merge, mapper)
    if args.select is None and args.lightning_weights is None:
        return mapper, args.rest
    from ..training.extract import training_mapper

    return training_mapper(args.source, select=args.select, lightning_weights=args.lightning_weights, mapper=mapper, rest=args.rest)


def _plan(args: argparse.Namespace, dest: str | None):
    from ..planning import plan

    source = _source(args)  # first: a --source that cannot mean anything is refused before the mapper is built
    mapper, rest = _mapper(args)
    if source is args.source and getattr(args, "preset_catalog", None) is not None:
        source = args.preset_catalog  # SRC alone, already opened for --preset
    return plan(
        source, mapper, shard_size=args.shard_size, nproc=args.nproc, rest=rest, dest=dest,
        dtype=args.dtype, extras=not args.no_extras, overwrite=args.overwrite, to=args.to,
        on_overflow=getattr(args, "on_overflow", "warn"), page_align=args.page_align, nproc_mp=args.nproc_mp,
        **_remote_arguments(args),
    )


def _remote_arguments(args: argparse.Namespace) -> dict:
    """--spool-size, --spool-dir and --remote-option KEY=VALUE as keyword arguments of wb.plan / wb.convert."""
    from ..errors import PlanError

    options: dict = {}
    for item in args.remote_options:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise PlanError(f"Cannot read --remote-option {item!r}: write it as KEY=VALUE, e.g. part_size=64MiB.")
        options[key.strip()] = value
    return {"spool_size": args.spool_size, "spool_dir": args.spool_dir, "remote_options": options}


def _refuse(command: str, the_plan) -> int:
    errors = the_plan.errors
    first = errors[0].message
    more = f" ({len(errors) - 1} more problems listed above)" if len(errors) > 1 else ""
    sys.stderr.write(f"workbench {command}: {first}{more}\n")
    return EXIT_BAD_INPUT


def run_plan(args: argparse.Namespace) -> int:
    """`workbench plan`: print the dry-run; exit 2 when it has errors."""
    the_plan = _plan(args, args.dest)
    print(the_plan.summary())
    return EXIT_OK if the_plan.ok else _refuse("plan", the_plan)


def run_convert(args: argparse.Namespace) -> int:
    """`workbench convert`: print the dry-run, run it, print the report."""

    def convert_share():
        from ..conversion import convert

        source = _source(args)
        mapper, rest = _mapper(args)
        return convert(source, args.dest, mapper, shard_size=args.shard_size, rest=rest, dtype=args.dtype,
                       extras=not args.no_extras, overwrite=args.overwrite, quiet=args.quiet, to=args.to,
                       verify=args.verify, on_overflow=args.on_overflow, page_align=args.page_align,
                       nproc_mp=args.nproc_mp, **_remote_arguments(args))

    return plan_and_run("convert", args, lambda: _plan(args, args.dest), convert_share)


def plan_and_run(command: str, args: argparse.Namespace, make_plan: Callable[[], Any],
                 convert_share: Callable[[], Any]) -> int:
    """The tail `workbench convert` and `workbench merge` share, so both answer alike. Started by the user's
    torchrun (and not --dry-run): `convert_share()` does this rank's share and rank 0 prints the report. Otherwise:
    print `make_plan()`'s dry-run, refuse on any problem (exit 2), stop at --dry-run, else run the plan (args.quiet,
    args.verify, args.launcher) and print the report. The exit status says whether --verify found a mismatch."""
    from ..launch.inplace import under_torchrun

    if under_torchrun() and not args.dry_run:
        with _overflow_in_the_report():
            report = convert_share()
        if int(os.environ.get("RANK", "0")) == 0:
            print(report.summary())
        return _verdict(report)
    the_plan = make_plan()
    print(the_plan.summary())
    if not the_plan.ok:
        return _refuse(command, the_plan)
    if args.dry_run:
        return EXIT_OK
    from ..conversion import execute

    sys.stdout.flush()
    with _overflow_in_the_report():
        report = execute(the_plan, quiet=args.quiet, verify=args.verify, launcher=args.launcher)
    print(report.summary())
    return _verdict(report)


@contextlib.contextmanager
def _overflow_in_the_report() -> Iterator[None]:
    """Silence the Python CastOverflowWarning: the printed report carries the same warning line."""
    from ..errors import CastOverflowWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CastOverflowWarning)
        yield


def _verdict(report) -> int:
    """Exit status of a finished conversion: 1 when --verify found outputs that differ from the source."""
    if report.verified is False:
        rows = [r for r in report.output_check.rows if r[2] != "ok"]
        for name, check, status, *_, detail in rows[:20]:
            print(f"  {status}: {name} ({check}): {detail}")
        sys.stderr.write(
            f"workbench convert: {len(rows)} output tensors do not match the source (e.g. {rows[0][0]!r}, listed above). "
            f"Do not use {report.where}: re-run the conversion with --overwrite and check the disk.\n"
        )
        return EXIT_MISMATCH
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run `plan` or `convert` on their own (the `workbench` command registers the same functions)."""
    parser = argparse.ArgumentParser(prog="workbench")
    sub = parser.add_subparsers(dest="command", required=True)
    plan_arguments(sub.add_parser("plan", help="dry-run a conversion"))
    convert_arguments(sub.add_parser("convert", help="convert a checkpoint"))
    args = parser.parse_args(argv)
    from .terminal import guarded_output

    with guarded_output():
        try:
            return run_plan(args) if args.command == "plan" else run_convert(args)
        except WorkbenchError as exc:
            sys.stderr.write(f"workbench {args.command}: {exc.message}\n")
            return EXIT_BAD_INPUT


__all__ = ["convert_arguments", "load_mapper_file", "main", "plan_arguments", "run_convert", "run_plan"]
