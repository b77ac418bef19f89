"""A rank's uploads to a remote destination: each finished spool file is hashed, uploaded and deleted.

The engine writes into the spool folder (`plan.dest`) as into any folder; this hooks the two moments a remote
destination needs: before a file is opened (`opening`: wait while finished files awaiting upload fill the
spool, `output/remote/spool.SpoolGate`) and after it is committed (`upload`, on the committer's thread:
SHA-256, `file_done`, delete the spool copy).
"""

from __future__ import annotations

import os
import threading

from ..output.remote.spool import SpoolGate, file_sha256
from ..planning.model import Plan


class SpoolUploads:
    """The spool gate and upload hook of one rank of a plan with a remote destination."""

    def __init__(self, plan: Plan) -> None:
        assert plan.remote is not None and plan.dest is not None
        self.plan = plan
        self.gate = SpoolGate(plan.options.spool_size)
        self.sizes = {f.name: f.size for f in plan.output_file_list}
        self.uploaded: list[str] = []

    def opening(self, name: str, stop: threading.Event | None = None) -> None:
        """`name` is about to be written: wait for room in the spool."""
        self.gate.open(self.sizes.get(name, 0), stop)

    def finished(self, name: str) -> None:
        """`name` is complete; its commit and upload are queued."""
        self.gate.finished(self.sizes.get(name, 0))

    def upload(self, name: str) -> None:
        """Upload the committed spool file `name`, then delete it (the committer thread calls this)."""
        assert self.plan.dest is not None and self.plan.remote is not None
        path = self.plan.dest / name
        try:
            size = os.stat(path).st_size
            self.plan.remote.file_done(name, path, size, file_sha256(path))
            os.unlink(path)
            self.uploaded.append(name)
        finally:
            self.gate.released(self.sizes.get(name, 0))  # also on failure: a lane waiting for room must not hang
