"""The `workbench merge` subcommand: a mergekit merge config, planned and run like a conversion.

    workbench merge merge.yml OUT [--dry-run] [--verify] [--random-seed N] [--shard-size 5GB] [--dtype bf16]
                                  [--nproc N] [--launcher auto|local|torchrun] [--no-extras] [--overwrite] [--quiet]

The config is read by `wb.merge_config` (model paths relative to the config's folder); the command prints the
dry-run (memory, files read, output layout, and every config key the workbench refuses as a problem), stops there
with --dry-run or on any problem (exit 2), else runs the plan and prints the report (exit 1 when --verify finds
a mismatch).
"""

from __future__ import annotations

import argparse

from .convert import plan_and_run


def merge_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `workbench merge`."""
    parser.add_argument("config", metavar="CONFIG", help="a mergekit merge config (YAML: merge_method, models or slices, ...)")
    parser.add_argument("dest", metavar="OUT", help="output folder (HF safetensors shards, config.json and tokenizer files "
                                                    "of the base model, else the first model)")
    parser.add_argument("--random-seed", type=int, default=None, metavar="N",
                        help="seed of the random methods (DARE, DELLA), as mergekit-yaml's --random-seed")
    parser.add_argument("--shard-size", default=None, help="largest shard, e.g. 5GB (decimal) or 500MiB (default 5GB)")
    parser.add_argument("--dtype", help="store every floating-point tensor in this dtype (bf16, fp16, fp32 ...) after the "
                                        "merge; the config's dtype / out_dtype apply first")
    parser.add_argument("--nproc", type=int, default=1, help="processes to run on")
    parser.add_argument("--launcher", choices=("auto", "local", "torchrun"), default="auto",
                        help="how --nproc > 1 starts its workers (default: local processes)")
    parser.add_argument("--no-extras", action="store_true", help="do not copy config.json, tokenizer files ...")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier merge in the destination")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and stop")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--verify", action="store_true", help="re-read every output and check it (exit 1 on any mismatch)")


def run_merge(args: argparse.Namespace) -> int:
    """`workbench merge`: print the dry-run of the config's merge, run it, print the report."""
    from ..mergekit_config import merge_config

    checkpoint, mapper = merge_config(args.config, seed=args.random_seed)

    def make_plan():
        from ..planning import plan

        return plan(checkpoint, mapper, shard_size=args.shard_size, nproc=args.nproc, dest=args.dest, dtype=args.dtype,
                    extras=not args.no_extras, overwrite=args.overwrite)

    def convert_share():
        from ..conversion import convert

        return convert(checkpoint, args.dest, mapper, shard_size=args.shard_size, dtype=args.dtype,
                       extras=not args.no_extras, overwrite=args.overwrite, quiet=args.quiet, verify=args.verify)

    return plan_and_run("merge", args, make_plan, convert_share)
