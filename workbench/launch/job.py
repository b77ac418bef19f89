"""A conversion job as JSON: what torchrun workers receive, and how they rebuild the same plan.

Workers do not unpickle anything: they get the source path, the destination, the mapper's JSON
export, the options and what the mapper's Functions import from the user's mapper file, re-plan deterministically, and refuse to run if their plan's fingerprint
differs from the launcher's (the source changed, or the mapper does not round-trip).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from ..errors import PlanError
from ..mapper.files import import_context, install_import_context
from ..planning.build import build_plan
from ..planning.model import Plan, PlanOptions


@dataclass
class Job:
    """Everything a worker needs to re-plan and run its share."""

    source: str | list[list[str]]  # a path, or [name, path] pairs in order for a multi-source catalog
    dest: str
    mapper_json: str | None
    options: dict
    fingerprint: str
    kept: list[str] = field(default_factory=list)
    # Mapper-file folders and mapper files the mapper's Functions import (see mapper.files.import_context).
    imports: dict = field(default_factory=dict)
    # The source's open options (Catalog.open_options), so workers list the same tensors.
    open_options: dict = field(default_factory=dict)

    def to_json(self) -> str:
        """The job as a JSON string."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Job:
        """Rebuild a job from `to_json()` output."""
        return cls(**json.loads(text))


def job_for(plan: Plan) -> Job:
    """The job that makes workers run `plan`; refuses plans that cannot be rebuilt elsewhere."""
    if plan.mapper is not None and plan.mapper_json is None:
        raise PlanError(
            "Cannot run this conversion on several processes: its mapper cannot be exported as JSON (a Binding or a "
            "custom object). Use a workbench.mapper mapper, or nproc=1."
        )
    root = plan.source.root
    remote = plan.source.url  # workers open the same URL (headers from the on-disk cache)
    if plan.source.reader is None or not (remote or root.exists()):
        raise PlanError(
            f"Cannot run this conversion on several processes: the source ({root}) is not a checkpoint on disk that "
            "workers can open. Pass a checkpoint path, or use nproc=1."
        )
    assert plan.dest is not None
    paths = getattr(plan.source, "source_paths", None)
    return Job(
        source=[[name, path] for name, path in paths.items()] if paths else (remote or os.path.abspath(root)),
        dest=plan.remote.url if plan.remote is not None else str(plan.dest),  # workers build their own spool
        mapper_json=plan.mapper_json,
        options=asdict(plan.options),
        fingerprint=plan.fingerprint,
        kept=sorted(plan.kept),
        imports=import_context(plan.mapper),
        open_options=dict(plan.source.open_options),
    )


def replan(job: Job) -> Plan:
    """Rebuild the launcher's plan from a job, and prove it is the same plan."""
    from ..formats import open_catalog

    install_import_context(job.imports)  # before binding: Functions defined in the mapper file must resolve
    mapper = None
    if job.mapper_json is not None:
        from ..mapper import from_json

        mapper = from_json(job.mapper_json)
    if isinstance(job.source, list):  # pairs, not a dict: the JSON sorts keys, and the first source is the primary
        from ..formats.multi import open_sources

        catalog = open_sources({name: path for name, path in job.source})
    else:
        catalog = open_catalog(job.source, **job.open_options)
    plan = build_plan(catalog, mapper, PlanOptions(**job.options), job.dest, check_dest=False, kept=job.kept)
    if plan.fingerprint != job.fingerprint:
        raise PlanError(
            f"Cannot run the conversion of {job.source}: this worker's plan differs from the launcher's (fingerprint "
            f"{plan.fingerprint[:12]} vs {job.fingerprint[:12]}). Did the source change during the run? Run it again."
        )
    return plan
