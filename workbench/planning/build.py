"""`plan()`: bind, schedule, lay out, assign ranks and check the destination, from metadata only."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ..api_types import CheckpointLike, OnOverflow, OutputName, Rest
from ..catalog import Catalog
from ..display import parse_size
from ..dtypes import policy_dtype
from ..errors import PlanError, WorkbenchError
from ..mapper.base import Mapper
from ..mapper.config_update import config_updates
from ..mapper.files import code_digest
from ..mapper.groups import Binding, Problem
from ..mapper.op import Op
from ..mapper.output_file import output_files
from ..mapper.presets.output_presets import OUTPUT_PRESETS
from ..output import OutputFormat, output_format
from ..output.destination import local_destination, remote_url
from .destination import check_destination, check_remote, spool_problems
from .extras import (
    GENERATED,
    Extra,
    layout_change,
    scan_extras,
    with_config_dtype,
    with_config_updates,
    with_generated_config,
    with_layout_note,
    with_output_files,
)
from .fingerprint import changed_sources, layout_fingerprint, run_fingerprint
from .gc_pause import gc_paused
from .header_metadata import HeaderMetadata
from .model import Plan, PlanOptions
from .page_align import reader_offsets
from .ranks import assign_ranks
from .runs import batch_casts, cast_run_binding, coalesce_copies, copy_run_binding, many_raw
from .schedule import SourceAccess, build_steps
from .sharding import layout_outputs
from .sources import bind, check_rest, mapper_json, resolve_catalog

DEFAULT_CHUNK = "32MiB"


def _duplicate_outputs(binding: Binding) -> list[Problem]:
    names = [t.name for group in binding.groups for t in group.outputs]
    if len(set(names)) == len(names):  # the usual answer, found without a Python step per name
        return []
    seen: set[str] = set()
    problems = []
    for group in binding.groups:
        for out in group.outputs:
            if out.name in seen:
                problems.append(
                    Problem("error", f"Cannot write output {out.name!r}: two groups produce it. Give one of them another name.",
                            tensor=out.name, kind="clash")
                )
            seen.add(out.name)
    return problems


def _scoped_outputs(binding: Binding, catalog: Catalog) -> list[Problem]:
    """Outputs still named `NAME::tensor` after another source of a multi-source catalog: nothing maps them."""
    sources = getattr(catalog, "sources", None)
    if not sources:
        return []
    left: dict[str, list[str]] = {}
    for group in binding.groups:
        for out in group.outputs:
            scope, sep, _ = out.name.partition("::")
            if sep and scope in sources:
                left.setdefault(scope, []).append(out.name)
    return [
        Problem("error", f"Cannot write {len(names)} tensor(s) of source {scope!r} under their scoped names (e.g. {names[0]!r}): "
                         "no operation maps them. Map them (e.g. with a preset) or M.Drop them.",
                tensor=names[0], kind="unmapped")
        for scope, names in left.items()
    ]


def _meta_hf_config(catalog: Catalog, binding: Binding) -> tuple[dict | None, list[Problem]]:
    """The HF config.json for a Meta folder (params.json, no config.json) converted to HF names (`meta_to_hf`):
    built from params.json and the tensors' shapes (`presets.meta_config`), tied when the output has no lm_head
    (a tied config's head is left out). None for any other source or output layout."""
    from ..mapper.presets.meta_config import hf_config_from_meta, meta_params_of

    params = meta_params_of(catalog.metadata)
    outputs = {t.name for group in binding.groups for t in group.outputs}
    if params is None or "model.embed_tokens.weight" not in outputs:
        return None, []
    try:
        config = hf_config_from_meta(params, catalog.tensors)
    except WorkbenchError as exc:
        return None, [Problem("warning", f"No config.json is written with this output: {exc}", kind="preset")]
    config["tie_word_embeddings"] = "lm_head.weight" not in outputs
    return config, []


def _gguf_hf_files(catalog: Catalog, binding: Binding, dtype: str | None) -> tuple[list[Extra], list[Problem]]:
    """config.json, generation_config.json and the tokenizer files for a GGUF file converted to HF names
    (`gguf_to_hf`): built from its key/values and vocabulary. None unless the output holds the HF embeddings."""
    import json

    from ..mapper.presets.gguf_config import (
        CLASSES,
        DTYPE_NAMES,
        adjust_transformers_config,
        generation_config,
        hf_config,
    )
    from ..mapper.presets.gguf_inverse import gguf_values, model_type
    from ..output.gguf.hf_tokenizer import TRANSFORMERS_CONFIG, tokenizer_files

    outputs = {t.name: t for group in binding.groups for t in group.outputs}
    embed = outputs.get("model.embed_tokens.weight") or outputs.get("transformer.wte.weight")  # GPT-2's
    if embed is None:
        return [], []
    path = catalog.root if catalog.root.is_file() else catalog.root / next(iter(catalog.files))
    code = dtype if dtype in ("F32", "F16", "BF16") else embed.dtype
    why = "from the GGUF metadata"
    try:
        values = gguf_values(catalog)
        family = model_type(values, catalog.tensors)
        tokenizer, missing = tokenizer_files(path, config=family not in CLASSES)  # transformers' config: only when needed
        tokenizer = dict(tokenizer)  # the cached answer stays whole
        if family in CLASSES:
            config = hf_config(values, family, {n: tuple(t.shape) for n, t in outputs.items()}, code)
        elif TRANSFORMERS_CONFIG in tokenizer:
            config = adjust_transformers_config({**json.loads(tokenizer[TRANSFORMERS_CONFIG]), "dtype": DTYPE_NAMES[code]},
                                                {n: tuple(t.shape) for n, t in outputs.items()})
            why = "transformers' config of the GGUF file"
        else:
            raise WorkbenchError(f"the workbench has no config table for {family} and transformers gave none ({missing})")
    except WorkbenchError as exc:
        return [], [Problem("warning", f"No config.json is written with this output: {exc}", kind="preset")]
    tokenizer.pop(TRANSFORMERS_CONFIG, None)
    texts = {"config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n"}
    generation = generation_config(values)
    if generation is not None:
        texts["generation_config.json"] = json.dumps(generation, indent=2) + "\n"
    problems = [] if not missing else [Problem("warning", f"No tokenizer files are written with this output: {missing}.",
                                               kind="preset")]
    extras = [Extra(name, GENERATED, len(text.encode("utf-8")), why, text) for name, text in texts.items()]
    extras += [Extra(name, GENERATED, len(text.encode("utf-8")), "from the GGUF vocabulary, as transformers builds it", text)
               for name, text in tokenizer.items()]
    return extras, problems


def _metadata_problems(header_metadata: HeaderMetadata, options: PlanOptions, output: OutputFormat) -> list[Problem]:
    """Warnings for source header metadata the output does not carry."""
    if not header_metadata.interesting:
        return []
    if not output.keeps_header_metadata:
        keys = sorted({k for m in header_metadata.per_file.values() for k in m if k != "format"})
        return [Problem("warning", f"The source's safetensors header metadata ({', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}) "
                                   f"is not kept: a {output.title} output has no header metadata. Convert to safetensors to keep it.", kind="metadata")]
    return [
        Problem("warning", f"Source header metadata {key!r} is not kept: {reason}. Convert those files separately to keep it.", kind="metadata")
        for key, reason in sorted(header_metadata.dropped.items())
    ]


def _runs_functions(mapper: Any) -> bool:
    """False when `mapper` is a mapper tree none of whose leaves calls a function (only such leaves (de)quantise):
    then the quantisation checks below need not import `mapper.presets.quantized` (a plain fusion or re-shard)."""
    if not isinstance(mapper, Mapper):
        return True
    return any(getattr(leaf, "fn", None) is not None for leaf in mapper.leaves())


def _quantisation_changes(binding: Binding, mapper: Any) -> dict | None:
    """What the mapper's (de)quantisation ops change in config.json (see `mapper.presets.quantized.config_changes`). The
    groups' ops are the mapper's leaves with their names filled (plus the dtype policy's casts, which never
    quantise): a mapper without such leaves changes nothing, found without a pass over the groups."""
    if not _runs_functions(mapper):
        return None
    from ..mapper.presets.quantized import changes_config, config_changes

    if not changes_config(mapper):
        return None
    return config_changes(_leaves(binding), (t for group in binding.groups for t in group.outputs))


def _preset_warnings(binding: Binding, catalog: Catalog, mapper: Any) -> list[Problem]:
    """Warnings about outputs that are right as tensors but that other tools read wrongly: partial FP8 tiles
    (`mapper.presets.quantized.partial_block_problems`), a Megatron vocabulary still padded (`mapper.presets.megatron.vocab_padding_problems`)."""
    found: list[Problem] = []
    if mapper is not None and _runs_functions(mapper):  # (imported only then: a copy or fusion imports no quantisation)
        from ..mapper.presets.quantized import changes_config, partial_block_problems

        found += partial_block_problems(binding.groups) if changes_config(mapper) else []
    if catalog.format == "megatron":
        from ..mapper.presets.megatron import vocab_padding_problems

        found += vocab_padding_problems(catalog, binding.outputs)
    return found


def _leaves(binding: Binding) -> Iterator[Any]:
    """Every operation leaf of the binding's groups. A Binding may carry any op with `apply`; only mapper ops (and
    the dtype policy's wrapper) have leaves. A leaf operation is its own only leaf: yielded without a generator
    per group (one per tensor of a fused checkpoint)."""
    for group in binding.groups:
        op = group.op
        if op is None:
            continue
        if isinstance(op, Op) or not hasattr(op, "leaves"):
            yield op
        else:
            yield from op.leaves()


ON_OVERFLOW = ("warn", "error")


def make_options(shard_size: int | str | None, nproc: int, rest: str, dtype: Any, extras: bool, overwrite: bool,
                 chunk_size: int | str, to: str = "safetensors", on_overflow: str = "warn",
                 page_align: bool = True, nproc_mp: int = 1, spool_size: int | str | None = None,
                 spool_dir: str | os.PathLike | None = None, remote_options: dict | None = None) -> PlanOptions:
    """Validate and normalise the user's options (a dtype policy must name a float dtype the engine produces)."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise PlanError(f"Cannot plan with nproc={nproc!r}: it must be a whole number of processes, at least 1.")
    output = output_format(to)
    if on_overflow not in ON_OVERFLOW:
        raise PlanError(f"Cannot plan with on_overflow={on_overflow!r}: choose 'warn' (count overflowing values and "
                        "report them) or 'error' (fail the run before its index is written).")
    if isinstance(nproc_mp, bool) or not isinstance(nproc_mp, int) or nproc_mp < 1:
        raise PlanError(f"Cannot plan with nproc_mp={nproc_mp!r}: it must be a whole number of model-parallel files, at least 1.")
    if nproc_mp > 1 and not output.model_parallel:
        raise PlanError(f"Cannot plan with nproc_mp={nproc_mp} for {output.title} output: model-parallel files are Meta's "
                        "consolidated.NN.pth layout. Write it with to='pth', or leave nproc_mp at 1.")
    code = None if dtype is None else output.policy(dtype)
    return PlanOptions(
        shard_size=parse_size(output.default_shard_size if shard_size is None else shard_size),
        nproc=nproc,
        rest=rest,
        dtype=code,
        extras=bool(extras),
        overwrite=bool(overwrite),
        chunk_bytes=parse_size(chunk_size, what="chunk size"),
        to=output.name,
        on_overflow=on_overflow,
        page_align=bool(page_align),
        nproc_mp=nproc_mp,
        spool_size=parse_size(spool_size, what="spool size") if spool_size is not None else PlanOptions.spool_size,
        spool_dir=os.fspath(spool_dir) if spool_dir is not None else None,
        remote=dict(remote_options or {}),
    )


def build_plan(
    catalog: Catalog,
    mapper: Any,
    options: PlanOptions,
    dest: str | os.PathLike | None,
    *,
    check_dest: bool = True,
    kept: Iterable[str] = (),
) -> Plan:
    """The plan for validated options. Workers pass `check_dest=False` and the launcher's `kept` list."""
    with gc_paused():
        return _build_plan(catalog, mapper, options, dest, check_dest, kept)


def _format_default(catalog: Catalog, mapper: Any, options: PlanOptions) -> tuple[Any, PlanOptions]:
    """Without a mapper, a source whose format names a default preset (`Catalog.default_preset`; a legacy Megatron
    folder's rank shards: the TP/PP merge `megatron_merge`) converts through it, shown in the plan like any mapper,
    with everything else (optimizer state) dropped."""
    if mapper is None and catalog.default_preset:
        from dataclasses import replace

        from ..mapper.presets.suggest import build_preset

        return build_preset(catalog.default_preset, catalog, None), replace(options, rest="drop")
    return mapper, options


def _build_plan(
    catalog: Catalog, mapper: Any, options: PlanOptions, dest: str | os.PathLike | None, check_dest: bool,
    kept: Iterable[str],
) -> Plan:
    url = remote_url(dest) if dest is not None else None  # a URL the workbench cannot write to is refused before any work
    if url is not None:
        from ..output.remote.spool import spool_folder

        dest_path: Path | None = spool_folder(url, options.spool_dir)  # files are written here, then uploaded
    else:
        dest_path = local_destination(dest) if dest is not None else None
    output = output_format(options.to)
    user_mapper = mapper  # what workers receive: they re-run `prepare` (and this default) themselves
    mapper, options = _format_default(catalog, mapper, options)
    try:
        mapper, output, options = output.prepare(catalog, mapper, options, OUTPUT_PRESETS.get(output.name))
    except WorkbenchError as exc:
        raise PlanError(exc.message if hasattr(exc, "message") else str(exc)) from None
    dtype = options.dtype if output.applies_dtype_policy else None
    runs = output.plans_runs and many_raw(catalog)  # whole copies of many tensors: planned in runs
    check_rest(options.rest)  # (the run bindings below do not read it)
    if runs and mapper is None and dtype is None:
        binding = copy_run_binding(catalog)
    elif runs and mapper is None:
        binding = cast_run_binding(catalog, policy_dtype(dtype))
    else:
        binding = bind(catalog, mapper, options.rest, dtype)
    problems = list(binding.problems) + _duplicate_outputs(binding) + _scoped_outputs(binding, catalog)
    if mapper is not None and options.nproc > 1:
        from ..mapper.function import rank_problems

        problems += [Problem("error", why, kind="ranks") for why in rank_problems(mapper, options.nproc)]
    problems += _preset_warnings(binding, catalog, mapper)
    steps = build_steps(binding.groups, SourceAccess(catalog.reader), options.chunk_bytes,
                        coalesce=coalesce_copies if runs else None)
    if not steps:
        problems.append(Problem("error", "Cannot convert: the mapper produces no tensors (everything is dropped). "
                                          "Check the mapper and the rest= policy.", kind="empty"))
    header_metadata = HeaderMetadata(catalog.file_metadata)
    try:
        offsets = reader_offsets(catalog.reader) if options.page_align else None
        files, warnings = layout_outputs(steps, options.shard_size, output, header_metadata.choose, offsets)
    except PlanError as exc:
        problems.append(Problem("error", exc.message, tensor=exc.tensor, kind="layout"))
        files, warnings = [], []
    problems += warnings + _metadata_problems(header_metadata, options, output)
    if files:
        # ranks may share a file only in a local folder (a remote destination uploads each rank's whole files)
        share = (SourceAccess(catalog.reader), options.chunk_bytes) if output.shares_files and url is None else None
        problems += assign_ranks(files, steps, options.nproc, share)
        batch_casts(steps, files, catalog.reader, options.chunk_bytes)
    exported = mapper_json(mapper)
    layout_fp = layout_fingerprint(catalog, steps, files, exported)
    # Only a checkpoint read from a folder has extras (a catalog built in memory has a root but no files).
    # A remote reader first brings its small files (config, tokenizer) into a local folder, its catalog root.
    fetch_extras = getattr(catalog.reader, "fetch_extras", None)
    if options.extras and output.copies_extras and fetch_extras is not None:
        fetch_extras()
    on_disk = options.extras and output.copies_extras and catalog.root.is_dir() and bool(catalog.files)
    extra_files = scan_extras(catalog.root, catalog.extras, dest_path, own=catalog.files) if on_disk else []
    quant_changes = _quantisation_changes(binding, mapper) if mapper is not None and extra_files else None
    extra_files = with_config_dtype(catalog.root, extra_files, options.dtype, quant_changes)
    if on_disk:
        meta_config, meta_problems = _meta_hf_config(catalog, binding)
        problems += meta_problems
        extra_files = with_generated_config(extra_files, meta_config, dtype, "from params.json")
    if options.extras and output.copies_extras and callable(getattr(catalog.reader, "key_values", None)):  # a GGUF header
        gguf_files, gguf_problems = _gguf_hf_files(catalog, binding, dtype)
        problems += gguf_problems
        extra_files = [*gguf_files, *(e for e in extra_files if e.path not in {g.path for g in gguf_files})]
    edits, whys, conflicts = config_updates(mapper)
    problems += [Problem("error", why, kind="clash") for why in conflicts]
    if edits and output.copies_extras:
        extra_files, not_made = with_config_updates(catalog.root, extra_files, edits, whys, options.dtype)
        problems += [Problem("warning", f"The mapper states a config.json edit that this conversion cannot make ({why}): "
                                        "edit the output's config.json yourself, or convert with extras.", kind="preset")
                     for why in not_made]
    stated_files, file_conflicts = output_files(mapper)
    problems += [Problem("error", why, kind="clash") for why in file_conflicts]
    if stated_files and options.extras and output.copies_extras:
        extra_files, not_made = with_output_files(extra_files, stated_files)
        problems += [Problem("error", why, kind="preset") for why in not_made]
    if mapper is not None and extra_files and quant_changes is None and not edits:
        extra_files = with_layout_note(extra_files, layout_change(binding.groups))
    extras = [e.path for e in extra_files if e.written]
    committed: list[str] = []  # files written at commit beside the shards (DCP: objects file, .metadata)
    objects, object_warnings = output.carried_objects(catalog.reader, options.rest)
    problems += [Problem("warning", w, kind="objects") for w in object_warnings]
    outputs = {t.name for step in steps for t in step.group.outputs} if objects else set()
    for name in sorted({o.name for o in objects} & outputs):
        problems.append(Problem("error", f"Cannot write {output.title} entry {name!r}: it is both an output tensor and a "
                                         "non-tensor entry of the source. Rename the tensor, or drop the entries with rest='drop'.",
                                tensor=name, kind="clash"))
    committed = output.commit_files([f.layout for f in files], bool(objects))
    kept_names = set(kept)
    complete = False
    code = code_digest(mapper)
    remote = None
    if url is not None:
        import hashlib

        from ..output.remote import open_destination

        # Objects are recorded with this: the layout (source states included) and the code of the mapper's Functions.
        remote_fp = hashlib.sha256(f"{layout_fp}:{code or ''}".encode()).hexdigest()
        remote = open_destination(url, remote_fp, options.remote)
    if remote is not None and check_dest and files:
        state = check_remote(remote, files, overwrite=options.overwrite)
        problems += state.problems
        kept_names |= state.kept
        complete = state.complete
    elif dest_path is not None and check_dest and files:
        sources = [catalog.root / rel if catalog.root.is_dir() else catalog.root for rel in catalog.files]
        state = check_destination(
            dest_path, files, extras + committed, layout_fp, overwrite=options.overwrite, source_root=catalog.root,
            source_files=sources, extra_bytes=sum(e.size for e in extra_files if e.written), code_digest=code,
            changed=lambda before: changed_sources(before, catalog),
        )
        problems += state.problems
        kept_names |= state.kept
        complete = state.complete
    for f in files:
        f.kept = f.name in kept_names
    result = Plan(
        source=catalog, dest=dest_path, options=options, binding=binding, steps=steps, files=files, problems=problems,
        extras=extras, extra_files=extra_files, layout_fingerprint=layout_fp, fingerprint=run_fingerprint(layout_fp, files, options.nproc),
        mapper=user_mapper, mapper_json=exported if user_mapper is mapper else mapper_json(user_mapper),
        header_metadata=header_metadata, output=output, complete=complete, code_digest=code, remote=remote,
    )
    if remote is not None and check_dest and files and not complete:
        problems += spool_problems(result)
    return result


def plan(
    source: CheckpointLike,
    mapper: Mapper | Binding | None = None,
    *,
    shard_size: int | str | None = None,
    nproc: int = 1,
    rest: Rest = "keep",
    dest: str | os.PathLike | None = None,
    dtype: Any = None,
    extras: bool = True,
    overwrite: bool = False,
    chunk_size: int | str = DEFAULT_CHUNK,
    to: OutputName = "safetensors",
    on_overflow: OnOverflow = "warn",
    page_align: bool = True,
    nproc_mp: int = 1,
    spool_size: int | str | None = None,
    spool_dir: str | os.PathLike | None = None,
    remote_options: dict | None = None,
) -> Plan:
    """Dry-run a conversion from metadata only; no tensor data is read.

        plan = wb.plan("llama/", M.presets.hf_to_fused("llama/"), shard_size="2GB", dest="out/")
        print(plan.summary()); plan.outputs; plan.peak_bytes

    `source`: a checkpoint path, a Checkpoint or a Catalog. `mapper`: a workbench mapper, a Binding,
    or None to copy every tensor. `shard_size`: bytes or '5GB' / '500MiB'. `rest`: what happens to
    source tensors the mapper does not mention ('keep', 'drop', 'error'). `dtype`: store every
    floating-point output in this dtype. `dest`: checked for leftovers, resumability and free space.
    `chunk_size`: input bytes a chunked cast converts at a time. `to`: 'safetensors' (HF shards + index)
    or 'dcp' (a torch.distributed.checkpoint folder that loads at any world size). `on_overflow`: what a run
    of this plan does when a cast meets values its dtype cannot hold ('warn': count and report, 'error': fail).
    `page_align=False` keeps every safetensors header minimal, byte-identical to `safetensors.save_file`
    (by default a file filled by kernel copies gets up to 4 KiB of header spaces so the copies run page-congruent).
    `nproc_mp` (with to='pth'): Meta's model-parallel files, consolidated.00 .. NN.pth, split as Meta's code expects.
    `dest` may be `s3://bucket/prefix/` or `hf://org/repo[@revision]`: files are written into a local spool
    (`spool_dir`, else $WORKBENCH_SPOOL_DIR, else the temporary folder) holding at most `spool_size` bytes
    of finished files per rank (default 4 GiB; `plan.spool_bytes`), uploaded as they finish, the index last;
    `remote_options`: the destination's own settings, see docs/remote.md: S3 `part_size` (bytes or '64MiB'),
    `part_threads` (parts of a file in flight at once, default 4);
    hf:// `create` (make the repo or branch when missing), `private` (a created repo is private), `create_pr`
    (publish as a pull request, `report.pr_url`), `commit_message`, `commit_description`.
    """
    options = make_options(shard_size, nproc, rest, dtype, extras, overwrite, chunk_size, to, on_overflow,
                           page_align=page_align, nproc_mp=nproc_mp, spool_size=spool_size, spool_dir=spool_dir,
                           remote_options=remote_options)
    from ..mapper.presets.folder_infos import forget

    forget()  # the recipe is built: the tensor lists its presets shared are not needed any more
    with gc_paused():
        return build_plan(resolve_catalog(source), mapper, options, dest)


__all__ = ["Plan", "PlanOptions", "build_plan", "make_options", "plan"]
