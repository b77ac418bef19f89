"""The run report: what the plan predicted next to what the run measured, overall and per rank."""

from __future__ import annotations

import html
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..display import format_bytes, html_table, text_table
from ..overflow import OverflowCounts

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd


@dataclass
class RankResult:
    """What one rank did and measured (JSON-serialisable: workers send it to the launcher)."""

    rank: int
    ok: bool = True
    error: str | None = None
    seconds: float = 0.0
    steps: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    copy_calls: int = 0
    files_opened: list[str] = field(default_factory=list)
    files_written: list[str] = field(default_factory=list)
    predicted_files: list[str] = field(default_factory=list)
    predicted_peak_bytes: int = 0
    peak_tensor_bytes: int = 0
    predicted_rss_bytes: int = 0  # the plan's predicted peak RSS of this rank's process (planning.rss)
    rss_baseline: int = 0
    rss_peak: int = 0
    spool_peak: int = 0  # a remote destination: the most bytes this rank's local spool held
    predicted_spool_bytes: int = 0  # ... and what the plan said it would need (plan.rank_spool_bytes)
    overflow: dict[str, list] = field(default_factory=dict)  # output tensor -> [values a cast could not hold, largest magnitude, dtype]

    def to_dict(self) -> dict:
        """Plain data for JSON."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RankResult:
        """Rebuild from `to_dict()` output."""
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


@dataclass
class RunReport:
    """Predicted (from the plan) next to measured (from the run), plus per-rank detail.

    `files_match_plan` proves the run opened exactly the source files the plan listed.
    """

    dest: Path
    ranks: list[RankResult]
    seconds: float
    predicted_peak_bytes: int
    predicted_files: list[str]
    predicted_bytes_read: int
    predicted_bytes_written: int
    files: list[str]  # output files of the conversion (shards, index), in the destination
    kept: list[str] = field(default_factory=list)
    extras: list[str] = field(default_factory=list)
    index_written: bool = False
    output_check: Any = None  # an OutputCheck when the run was verified (convert(..., verify=True))
    already_complete: bool = False  # the destination held this conversion's finished output: nothing ran
    launcher: str = "in process"  # what ran the ranks: "in process", "local", "torchrun" or "in place" (user's torchrun)
    url: str | None = None  # a remote destination: where the output is read from (`plan.remote.read_url`)
    pr_url: str | None = None  # a Hub destination with create_pr: the pull request's page, to review and merge

    @property
    def where(self) -> str:
        """Where the output is, for people: the remote URL, else the local folder (never a remote run's spool)."""
        return self.url if self.url is not None else str(self.dest)

    @classmethod
    def nothing_to_do(cls, plan: Any) -> RunReport:
        """The report of a run whose destination already holds the plan's finished output (`plan.complete`)."""
        return cls(
            dest=plan.dest, ranks=[], seconds=0.0, predicted_peak_bytes=0, predicted_files=[], predicted_bytes_read=0,
            predicted_bytes_written=0, files=[f.name for f in plan.output_file_list] + list(plan.commit_files),
            kept=[f.name for f in plan.output_file_list], extras=list(plan.extras), already_complete=True,
            **remote_names(plan),
        )

    @property
    def verification(self) -> pd.DataFrame | None:
        """Per output tensor: how it was checked against the source, status, max_abs_diff (None if not verified)."""
        return None if self.output_check is None else self.output_check.frame()

    @property
    def verified(self) -> bool | None:
        """True when every output matched its source on re-reading, False if any did not, None if not verified."""
        return None if self.output_check is None else self.output_check.ok

    @property
    def overflow(self) -> dict[str, tuple[int, float]]:
        """Per output tensor whose cast met values its dtype cannot hold (they became ±inf, saturated, NaN or
        wrapped): (how many, the largest magnitude among them). Empty when every cast stayed in range."""
        counts = OverflowCounts()
        for r in self.ranks:
            counts.merge(r.overflow)
        return {name: (int(entry[0]), float(entry[1])) for name, entry in sorted(counts.counts.items())}

    @property
    def overflow_values(self) -> int:
        """Values, over all tensors, that a cast could not represent."""
        return sum(count for count, _ in self.overflow.values())

    @property
    def overflow_warning(self) -> str | None:
        """One line naming the tensors with the most overflowing values, or None when there are none."""
        found = self.overflow
        if not found:
            return None
        dtypes = {r_name: entry[2] for r in self.ranks for r_name, entry in r.overflow.items()}
        worst = sorted(found.items(), key=lambda item: (-item[1][0], item[0]))[:5]
        named = ", ".join(f"{name} ({count} -> {dtypes.get(name, '?')}, largest |x| {largest:g})"
                          for name, (count, largest) in worst)
        more = f" and {len(found) - len(worst)} more" if len(found) > len(worst) else ""
        tensors = f"{len(found)} tensor{'s' if len(found) != 1 else ''}"
        return (f"warning: overflow: {self.overflow_values} values in {tensors} did not fit their dtype and "
                f"became ±inf, saturated or NaN: {named}{more}. See report.overflow; on_overflow='error' "
                "(--on-overflow error) fails such a run.")

    @property
    def ok(self) -> bool:
        """True when every rank succeeded."""
        return all(r.ok for r in self.ranks)

    @property
    def nproc(self) -> int:
        """Number of ranks that ran."""
        return len(self.ranks)

    @property
    def peak_tensor_bytes(self) -> int:
        """Measured peak of tensor bytes held by one process (the engine's own ledger)."""
        return max((r.peak_tensor_bytes for r in self.ranks), default=0)

    @property
    def rss_peak(self) -> int:
        """Largest process RSS high-water mark over the ranks."""
        return max((r.rss_peak for r in self.ranks), default=0)

    @property
    def spool_peak(self) -> int:
        """A remote destination: the most bytes one rank's local spool held (compare with `plan.spool_bytes`)."""
        return max((r.spool_peak for r in self.ranks), default=0)

    @property
    def predicted_spool_bytes(self) -> int:
        """A remote destination: the plan's spool bound of one rank, the largest over ranks (`plan.spool_bytes`)."""
        return max((r.predicted_spool_bytes for r in self.ranks), default=0)

    @property
    def predicted_rss_bytes(self) -> int:
        """The plan's predicted peak RSS of one process (the largest over ranks): compare with `rss_peak`."""
        return max((r.predicted_rss_bytes for r in self.ranks), default=0)

    @property
    def rss_note(self) -> str | None:
        """Why the measured RSS may exceed the prediction: a rank that started in a process already larger than a
        fresh one (whatever the caller loaded before); None when every rank started as predicted."""
        grown = [r for r in self.ranks if r.predicted_rss_bytes
                 and r.rss_baseline > 1.15 * max(1, r.predicted_rss_bytes - r.predicted_peak_bytes)]
        if not grown:
            return None
        r = max(grown, key=lambda r: r.rss_baseline)
        return (f"note: rank {r.rank}'s process already held {format_bytes(r.rss_baseline)} when the run began, more than "
                f"the {format_bytes(r.predicted_rss_bytes - r.predicted_peak_bytes)} predicted for a fresh process (workbench convert or a worker) "
                "before its first tensor: what was loaded before the conversion began counts on top of the predicted RSS.")

    @property
    def rss_above_baseline(self) -> int:
        """Largest growth of RSS during the run over the ranks (peak minus RSS at the start)."""
        return max((max(0, r.rss_peak - r.rss_baseline) for r in self.ranks), default=0)

    @property
    def files_opened(self) -> list[str]:
        """Source files the run actually opened (union over ranks)."""
        return sorted({f for r in self.ranks for f in r.files_opened})

    @property
    def files_match_plan(self) -> bool:
        """True when every rank opened exactly the source files the plan said it would."""
        return all(sorted(r.files_opened) == sorted(r.predicted_files) for r in self.ranks)

    @property
    def bytes_read(self) -> int:
        """Source bytes read (reads and kernel copies), all ranks."""
        return sum(r.bytes_read for r in self.ranks)

    @property
    def bytes_written(self) -> int:
        """Bytes written to output files, all ranks."""
        return sum(r.bytes_written for r in self.ranks)

    @property
    def throughput(self) -> float:
        """Bytes written to the output files per second of wall time since the run started (worker start-up and
        commit included): the one definition of speed, also the RunPanel's live figure."""
        return self.bytes_written / self.seconds if self.seconds > 0 else 0.0

    @property
    def rank_balance(self) -> dict[str, float]:
        """How evenly the ranks shared the work: the largest rank's bytes written and seconds over the
        smallest's (1.0 = perfectly even). A planner that splits badly, or one slow rank, shows here."""
        if len(self.ranks) < 2:
            return {"bytes": 1.0, "seconds": 1.0}
        written = [r.bytes_written for r in self.ranks]
        seconds = [r.seconds for r in self.ranks]
        return {"bytes": _spread(written), "seconds": _spread(seconds)}

    def _balance_line(self) -> str:
        """The rank balance for people: ratios over the ranks that wrote something, and which ranks idled (a
        ratio over an idle rank is infinite and says nothing)."""
        idle = [r.rank for r in self.ranks if r.bytes_written == 0]
        busy = [r for r in self.ranks if r.bytes_written > 0]
        pool = busy or self.ranks
        ratios = (f"bytes written {_times(_spread([r.bytes_written for r in pool]))}, "
                  f"seconds {_times(_spread([r.seconds for r in pool]))}")
        if not idle or not busy:
            return f"  rank balance (largest / smallest rank): {ratios}"
        ranks = f"rank {idle[0]}" if len(idle) == 1 else "ranks " + ", ".join(map(str, idle))
        line = (f"  rank balance: {ranks} of {len(self.ranks)} wrote nothing (the plan gives each rank whole output files, "
                "and there were fewer files than ranks: a smaller --nproc, or a smaller --shard-size for more files, "
                "evens it out)")
        return line + (f"; among the others (largest / smallest): {ratios}" if len(busy) > 1 else "")

    def _comparison(self) -> list[tuple[str, object, object]]:
        return [
            ("peak tensor bytes", self.predicted_peak_bytes, self.peak_tensor_bytes),
            ("source files opened", len(self.predicted_files), len(self.files_opened)),
            ("bytes read", self.predicted_bytes_read, self.bytes_read),
            ("bytes written", self.predicted_bytes_written, self.bytes_written),
            ("overflowed values", 0, self.overflow_values),
            ("RSS peak", self.predicted_rss_bytes or None, self.rss_peak),
            ("RSS above start", None, self.rss_above_baseline),
            *((("spool peak", self.predicted_spool_bytes, self.spool_peak),) if self.spool_peak else ()),
            ("seconds", None, round(self.seconds, 3)),
            ("throughput (bytes/s)", None, round(self.throughput)),
        ]

    def to_frame(self) -> pd.DataFrame:
        """Predicted vs measured, one row per metric."""
        import pandas as pd

        return pd.DataFrame(self._comparison(), columns=["metric", "predicted", "measured"]).set_index("metric")

    def ranks_frame(self) -> pd.DataFrame:
        """One row per rank: time, bytes, files, memory, status."""
        import pandas as pd

        return pd.DataFrame([r.to_dict() for r in self.ranks]).set_index("rank")

    def _rows(self) -> list[tuple[str, str, str]]:
        size = format_bytes
        return [
            ("peak tensor bytes", size(self.predicted_peak_bytes), size(self.peak_tensor_bytes)),
            ("source files opened", str(len(self.predicted_files)), str(len(self.files_opened))),
            ("bytes read", size(self.predicted_bytes_read), size(self.bytes_read)),
            ("bytes written", size(self.predicted_bytes_written), size(self.bytes_written)),
            ("overflowed values", "0", str(self.overflow_values)),
            ("RSS peak", size(self.predicted_rss_bytes) if self.predicted_rss_bytes else "-", size(self.rss_peak)),
            ("RSS above start", "-", size(self.rss_above_baseline)),
            *((("spool peak", size(self.predicted_spool_bytes), size(self.spool_peak)),) if self.spool_peak else ()),
            ("time", "-", f"{self.seconds:.2f}s"),
            ("throughput", "-", f"{size(self.throughput)}/s"),
        ]

    def _rank_rows(self) -> list[tuple]:
        return [
            (r.rank, "ok" if r.ok else "FAILED", f"{r.seconds:.2f}s", format_bytes(r.bytes_read), format_bytes(r.bytes_written),
             len(r.files_opened), format_bytes(r.peak_tensor_bytes), format_bytes(r.predicted_rss_bytes), format_bytes(r.rss_peak))
            for r in self.ranks
        ]

    _RANK_HEADERS = ("rank", "status", "time", "read", "written", "files opened", "peak tensors", "RSS predicted", "RSS peak")

    def summary(self) -> str:
        """Text report: status line, predicted vs measured, per-rank lines."""
        head = (f"Converted into {self.where} in {self.seconds:.2f}s ({len(self.files)} files"
                + (f", {len(self.kept)} kept from an earlier run" if self.kept else "") + ")")
        if not self.ok:
            head = f"Conversion into {self.where} FAILED"
        if self.already_complete:
            parts = [f"Already complete, nothing to do: {self.where} holds this conversion's finished output "
                     f"({len(self.files)} files, same source, mapper and options); nothing was read or written."]
            if self.output_check is not None:
                parts.append(self.output_check.summary())
            return "\n".join(parts)
        if self.pr_url is not None:
            head += f"; pull request to review: {self.pr_url}"
        check = "yes" if self.files_match_plan else "NO"
        parts = [head, text_table(["", "predicted", "measured"], self._rows()), f"  files opened match the plan: {check}"]
        if self.nproc > 1:
            parts.append(f"  ranks started by: {self.launcher}")
            parts.append(text_table(list(self._RANK_HEADERS), self._rank_rows()))
            parts.append(self._balance_line())
        if self.rss_note is not None:
            parts.append(self.rss_note)
        if self.output_check is not None:
            parts.append(self.output_check.summary())
        if self.overflow_warning is not None:
            parts.append(self.overflow_warning)
        return "\n".join(parts)

    def __str__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        if self.already_complete:  # nothing ran: no table of zeros
            return "".join(f"<div>{html.escape(line)}</div>" for line in self.summary().splitlines())
        head = html.escape(self.summary().splitlines()[0])
        note = f"<div>{html.escape(self.rss_note)}</div>" if self.rss_note is not None else ""
        balance = f"<div>{html.escape(self._balance_line().strip())}</div>" if self.nproc > 1 else ""
        return (f"<div><b>{head}</b></div>" + html_table(["", "predicted", "measured"], self._rows()) + note
                + html_table(list(self._RANK_HEADERS), self._rank_rows()) + balance)


def remote_names(plan: Any) -> dict[str, str | None]:
    """`url` and `pr_url` of a run report for `plan`: where a remote destination's output is read from (a Hub commit's
    `hf://org/repo@<commit>` once published) and the Hub pull request, if one was opened; empty for a local folder."""
    remote = getattr(plan, "remote", None)
    if remote is None:
        return {}
    try:
        return {"url": remote.read_url, "pr_url": getattr(remote, "pr_url", None)}
    except Exception:  # noqa: BLE001 - records that cannot be read back: name the URL as the user wrote it
        return {"url": remote.url}


def _times(ratio: float) -> str:
    """A spread for people: '1.05x', or 'n/a' when the smallest is zero (e.g. a rank that took no measurable time)."""
    return f"{ratio:.2f}x" if ratio != float("inf") else "n/a (a rank measured 0)"


def _spread(values: list[float]) -> float:
    """Largest over smallest; inf when one rank did nothing while another did something."""
    largest, smallest = max(values), min(values)
    if largest == 0:
        return 1.0
    return largest / smallest if smallest > 0 else float("inf")
