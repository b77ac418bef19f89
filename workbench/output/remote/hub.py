"""`hf://org/repo[@revision][/subfolder]` destinations: every output file uploaded while the conversion runs,
all of them published in ONE commit (or one pull request) at the end.

Through huggingface_hub, so its usual configuration applies: the token (`hf auth login` or `HF_TOKEN`; never
an option, which would travel in the plan and the workers' job), the endpoint (`HF_ENDPOINT` or the `endpoint`
option) and its transfer choice (Xet when `hf_xet` is installed, else LFS). Options (`wb.convert(...,
remote_options={...})`): `create` (create the repo, or the branch, when missing), `private` (a created repo is
private), `create_pr` (open a pull request instead of committing to the branch), `commit_message`,
`commit_description`, `ledger_dir` (see below).

`file_done` pre-uploads a finished spool file (`HfApi.preupload_lfs_files`): the content is stored on the Hub
but belongs to no commit, so nothing is visible in the repo until `finish` commits every file at once. Each
upload is recorded in a local ledger (one JSON line per file: name, size, sha256, fingerprint);
a re-run reads it back and keeps the files whose objects the Hub still holds (asked through the LFS batch
endpoint), so a killed conversion resumes without uploading them again. The ledger lives in
`$WORKBENCH_CACHE/hub-ledger/` (default ~/.cache/workbench, or the `ledger_dir` option), one per endpoint and
URL. Ranks on several nodes need no shared folder: after the ranks ran, each sends its ledger's records (name,
size, SHA-256 = the LFS oid; an inline file's bytes) to rank 0 over the job's process group (`records`,
`adopt`), and rank 0 makes the one commit. A resumed multi-node run recognises rank 0's own records; the other
ranks pre-upload their files again, which for LFS objects the Hub still holds is one batch request that answers
"already present" (no bytes sent).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from ...errors import PlanError, WorkbenchError
from .base import FinishedFile, RemoteDestination, RemoteState

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
LEDGER = "ledger.jsonl"


def _flag(options: Mapping[str, Any], key: str, url: str) -> bool:
    """A yes/no option, given as a bool (Python) or as text (the CLI's --remote-option KEY=VALUE)."""
    value = options.get(key, False)
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise PlanError(f"Cannot write to {url}: the option {key}={value!r} is not yes or no. Write {key}=true or {key}=false.",
                    file=url)


class HubError(WorkbenchError):
    """The Hub refused or failed an upload or the commit (the message names the repo and the fix)."""


def parse_hub_url(url: str) -> tuple[str, str, str]:
    """`hf://org/repo[@revision][/subfolder]` -> (repo_id, revision, subfolder); revision "main" when absent.

    As for sources, a revision with slashes is written quoted (`refs%2Fpr%2F1`)."""
    spec = url[len("hf://"):] if url.startswith("hf://") else url
    spec = spec[len("models/"):] if spec.startswith("models/") else spec
    parts = spec.strip("/").split("/")
    repo, revision = (parts[1].split("@", 1) + ["main"])[:2] if len(parts) >= 2 else ("", "")
    repo_id = f"{parts[0]}/{repo}" if len(parts) >= 2 else ""
    if not _REPO_ID.match(repo_id) or not revision:
        raise PlanError(f"Cannot write to {url}: a Hub destination is hf://org/repo[@revision][/subfolder].", file=url)
    return repo_id, unquote(revision), "/".join(p for p in parts[2:] if p)


class HubDestination(RemoteDestination):
    """A Hub repo (branch, or a new pull request) as a conversion's destination; see the module docstring."""

    scheme = "hf://"

    def __init__(self, url: str, fingerprint: str, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(url, fingerprint, options)
        self.repo_id, self.revision, self.subfolder = parse_hub_url(url)
        if _COMMIT.match(self.revision):
            raise PlanError(f"Cannot write to {url}: {self.revision} is a commit, and a commit cannot change. Name a "
                            "branch (hf://org/repo@branch) or leave the revision out for main.", file=url)
        self.create = _flag(self.options, "create", url)
        self.private = _flag(self.options, "private", url)
        self.create_pr = _flag(self.options, "create_pr", url)
        self.endpoint = (self.options.get("endpoint") or os.environ.get("HF_ENDPOINT") or "").rstrip("/") or None
        base = self.options.get("ledger_dir") or os.path.join(
            os.environ.get("WORKBENCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "workbench"), "hub-ledger")
        where = f"{self.endpoint or 'default endpoint'} {url}"  # one repo name on two endpoints is two repos
        self.folder = Path(os.path.abspath(base)) / hashlib.sha256(where.encode("utf-8")).hexdigest()[:16]
        self._api = None

    # -- huggingface_hub -------------------------------------------------------------------------------------

    def _token(self) -> str | None:
        from huggingface_hub import get_token

        return get_token()

    @property
    def api(self):
        """An `HfApi` for the endpoint and token (built on first use, in the process that uses it)."""
        if self._api is None:
            from huggingface_hub import HfApi

            self._api = HfApi(endpoint=self.endpoint, token=self._token(), library_name="checkpoint-workbench")
        return self._api

    def _path(self, name: str) -> str:
        return f"{self.subfolder}/{name}" if self.subfolder else name

    def _refusal(self, exc: Exception, doing: str) -> str:
        """A one-paragraph reason for a failed Hub call, with the fix."""
        from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

        where = f"Cannot write to {self.url}"
        if isinstance(exc, RevisionNotFoundError):
            return (f"{where}: the repo {self.repo_id} has no branch {self.revision!r}. Create it (`hf repo branch create "
                    f"{self.repo_id} {self.revision}`) or pass create=True (CLI: --remote-option create=true).")
        if isinstance(exc, RepositoryNotFoundError):
            return (f"{where}: the repo {self.repo_id} does not exist, or your token cannot see it. Create it "
                    f"(`hf repo create {self.repo_id}`), pass create=True (CLI: --remote-option create=true), or log in with a token "
                    "that can see it.")
        status = getattr(getattr(exc, "response", None), "status_code", None)
        server = getattr(exc, "server_message", None) or ""
        why = f" ({server.strip()})" if server.strip() else ""
        if status == 401:
            return (f"{where}: the Hub refused the token while {doing} (HTTP 401{why}). Log in again (`hf auth login`) "
                    "or set HF_TOKEN to a valid token.")
        if status == 403:
            return (f"{where}: your token may not write to {self.repo_id} (HTTP 403{why}) while {doing}. Use a token "
                    "with write access to this repo or its organisation (a fine-grained token needs 'write' on it).")
        if isinstance(exc, HfHubHTTPError):
            return f"{where}: the Hub answered HTTP {status}{why} while {doing}. {str(exc).splitlines()[0]}"
        return f"{where}: {type(exc).__name__} while {doing} ({exc}). Check the connection and HF_ENDPOINT."

    # -- the ledger: what this machine uploaded -----------------------------------------------------------------

    @property
    def ledger(self) -> Path:
        """The JSON-lines record of this destination's uploads (beside the spool, kept across runs)."""
        return self.folder / LEDGER

    def _record(self, entry: dict) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        line = (json.dumps({"fingerprint": self.fingerprint, **entry}, sort_keys=True) + "\n").encode()
        fd = os.open(self.ledger, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, line)  # one write of one line: appends from several ranks never interleave
            os.fsync(fd)
        finally:
            os.close(fd)

    def _entries(self) -> list[dict]:
        try:
            text = self.ledger.read_text()
        except FileNotFoundError:
            return []
        entries = []
        for line in text.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill
            if isinstance(entry, dict) and entry.get("fingerprint") == self.fingerprint:
                entries.append(entry)
        return entries

    def _regular_copy(self, sha256: str) -> Path:
        return self.folder / "regular" / sha256

    # -- the interface ---------------------------------------------------------------------------------------------

    @property
    def read_url(self) -> str:
        """`hf://org/repo@<commit>` of the published commit (a PR's commit too) once `finish` ran, else the URL."""
        commits = [e for e in self._entries() if "commit" in e]
        if not commits:
            return self.url
        sub = f"/{self.subfolder}" if self.subfolder else ""
        return f"hf://{self.repo_id}@{commits[-1]['commit']}{sub}"

    @property
    def pr_revision(self) -> str | None:
        """The pull request's ref (`refs/pr/N`) when `finish` opened one."""
        commits = [e for e in self._entries() if e.get("pr")]
        return commits[-1]["pr"] if commits else None

    @property
    def pr_url(self) -> str | None:
        """The pull request's page on the Hub when `finish` opened one (what to tell the user to review)."""
        commits = [e for e in self._entries() if e.get("pr_url")]
        return commits[-1]["pr_url"] if commits else None

    def state(self, files: Mapping[str, int], *, overwrite: bool) -> RemoteState:
        """Token, repo, branch and permission checked; this plan's earlier uploads recognised (see module doc)."""
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

        result = RemoteState()
        if not self._token():
            result.errors.append(f"Cannot write to {self.url}: no Hugging Face token. Log in (`hf auth login`) or set "
                                 "HF_TOKEN to a token with write access.")
            return result
        try:
            self.api.auth_check(self.repo_id, write=not self.create_pr)  # anyone who can read may open a pull request
        except RepositoryNotFoundError as exc:
            if not self.create:
                result.errors.append(self._refusal(exc, "checking the repo"))
            return result  # a repo to create holds nothing yet
        except Exception as exc:  # noqa: BLE001 - every refusal becomes a message
            result.errors.append(self._refusal(exc, "checking the token's rights"))
            return result
        try:
            info = self.api.model_info(self.repo_id, revision=self.revision, files_metadata=True)
        except RevisionNotFoundError as exc:
            if not self.create:
                result.errors.append(self._refusal(exc, "reading the branch"))
            return result
        except Exception as exc:  # noqa: BLE001
            result.errors.append(self._refusal(exc, "reading the branch"))
            return result
        held = {s.rfilename: s for s in info.siblings or []}
        entries = self._entries()
        uploads = {e["name"]: e for e in entries if "name" in e}
        published = [e for e in entries if "commit" in e]
        if published and self._still_published(published[-1], held, files, uploads):
            result.complete = True
            return result
        clash = sorted(n for n in self._outputs_held(held) if n in files or _owned(n))
        if clash and not overwrite and not self.create_pr:
            result.errors.append(
                f"Cannot write to {self.url}: the repo already holds {', '.join(clash[:3])}"
                f"{' ...' if len(clash) > 3 else ''} at {self.revision}. Pass overwrite=True (CLI --overwrite) to replace "
                "them in one new commit (which also deletes the older output's other files), create_pr=True to propose "
                "them as a pull request, or name another repo or branch.")
            return result
        result.kept = self._verified({n: e for n, e in uploads.items() if n in files and e["size"] == files[n]})
        return result

    def _still_published(self, entry: dict, held: dict, files: Mapping[str, int], uploads: Mapping[str, dict]) -> bool:
        """Whether the branch (or the pull request this plan opened) still holds exactly this plan's files."""
        if entry.get("pr"):
            try:
                held = {s.rfilename: s for s in self.api.model_info(
                    self.repo_id, revision=entry["pr"], files_metadata=True).siblings or []}
            except Exception:  # noqa: BLE001 - a closed or unreadable pull request: not published any more
                return False
        return all(self._same(held.get(self._path(n)), uploads.get(n), size) for n, size in files.items())

    def _outputs_held(self, held) -> list[str]:
        """The top-level names (under the subfolder) the revision holds: where an older output would be."""
        prefix = f"{self.subfolder}/" if self.subfolder else ""
        return [n[len(prefix):] for n in held if n.startswith(prefix) and "/" not in n[len(prefix):]]

    @staticmethod
    def _same(sibling, entry: dict | None, size: int) -> bool:
        if sibling is None or entry is None or entry["size"] != size or sibling.size != size:
            return False
        lfs = getattr(sibling, "lfs", None)
        return lfs is not None and lfs.sha256 == entry["sha256"]

    def _verified(self, uploads: Mapping[str, dict]) -> dict[str, FinishedFile]:
        """The recorded uploads the Hub still holds (an LFS batch answer without upload action), or kept locally."""
        from huggingface_hub.lfs import UploadInfo, post_lfs_batch_info

        kept: dict[str, FinishedFile] = {}
        lfs = {n: e for n, e in uploads.items() if e.get("mode") == "lfs"}
        for name, e in uploads.items():
            if e.get("mode") == "regular" and self._regular_copy(e["sha256"]).is_file():
                kept[name] = FinishedFile(name, e["size"], e["sha256"])
        if not lfs:
            return kept
        infos = [UploadInfo(size=e["size"], sample=b"", sha256=bytes.fromhex(e["sha256"])) for e in lfs.values()]
        try:
            actions, _errors, _ = post_lfs_batch_info(
                upload_infos=infos, repo_id=self.repo_id, repo_type="model", revision=quote(self.revision, safe=""),
                endpoint=self.api.endpoint, headers=self.api._build_hf_headers(), token=None)
        except Exception:  # noqa: BLE001 - cannot ask: upload again rather than trust the ledger
            return kept
        present = {a["oid"] for a in actions if not a.get("actions")}
        for name, e in lfs.items():
            if e["sha256"] in present:
                kept[name] = FinishedFile(name, e["size"], e["sha256"])
        return kept

    def begin(self, files: Mapping[str, int], kept: Sequence[str], markers: Sequence[str] = (),
              stale: Callable[[str], bool] | None = None) -> None:
        """Create the repo (or branch) when asked and missing, and record the branch head the commit will build on.

        No lock and no marker to hide: nothing is visible before the one commit, and that commit names this head as
        its parent, so a commit landing meanwhile makes it fail rather than overwrite. `stale` files are deleted by
        that commit (`finish`), not here: until then the branch stays as it was."""
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

        try:
            if self.create:
                self.api.create_repo(self.repo_id, private=self.private, exist_ok=True)
            try:
                head = self.api.model_info(self.repo_id, revision=self.revision).sha
            except RevisionNotFoundError:
                if not self.create:
                    raise
                self.api.create_branch(self.repo_id, branch=self.revision, exist_ok=True)
                head = self.api.model_info(self.repo_id, revision=self.revision).sha
        except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
            raise PlanError(self._refusal(exc, "preparing the repo"), file=self.url) from None
        except Exception as exc:  # noqa: BLE001
            raise PlanError(self._refusal(exc, "preparing the repo"), file=self.url) from None
        self._record({"begin": sorted(files), "head": head})

    def file_done(self, name: str, local_path: Path, size: int, sha256: str) -> None:
        """Pre-upload the spool file (content on the Hub, in no commit yet) and record it in the ledger."""
        from huggingface_hub import CommitOperationAdd

        op = CommitOperationAdd(path_in_repo=self._path(name), path_or_fileobj=str(local_path))
        op.upload_info.sha256 = bytes.fromhex(sha256)  # known already: huggingface_hub need not read the file again
        try:
            with _quiet_hub():
                self.api.preupload_lfs_files(self.repo_id, [op], revision=self.revision, create_pr=self.create_pr)
        except Exception as exc:  # noqa: BLE001
            raise HubError(self._refusal(exc, f"uploading {name}"), file=name) from None
        mode = getattr(op, "_upload_mode", None) or "lfs"
        if mode != "lfs":  # the Hub wants it inline in the commit: keep a copy, the spool file goes away
            target = self._regular_copy(sha256)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(local_path, target)
        self._record({"name": name, "size": size, "sha256": sha256, "mode": "lfs" if mode == "lfs" else "regular"})

    def records(self) -> list[dict]:
        """This node's ledger records of uploaded files (an inline file's bytes included, base64), for rank 0."""
        import base64

        found = []
        for e in self._entries():
            if "name" not in e:
                continue
            entry = dict(e)
            if e.get("mode") == "regular":
                copy = self._regular_copy(e["sha256"])
                if not copy.is_file():
                    continue
                entry["data"] = base64.b64encode(copy.read_bytes()).decode("ascii")
            found.append(entry)
        return found

    def adopt(self, records: Sequence[dict]) -> None:
        """Append the other nodes' upload records (of this fingerprint) that this ledger lacks (rank 0, before `finish`)."""
        import base64

        have = {(e["name"], e["size"], e["sha256"]) for e in self._entries() if "name" in e}
        for e in records:
            if not isinstance(e, dict) or e.get("fingerprint") != self.fingerprint or "name" not in e:
                continue
            key = (e["name"], e["size"], e["sha256"])
            if key in have:
                continue
            mode = "regular" if e.get("mode") == "regular" else "lfs"
            if mode == "regular":
                data = base64.b64decode(e.get("data") or "")
                if hashlib.sha256(data).hexdigest() != e["sha256"]:
                    continue  # never commit bytes that are not the ones recorded
                target = self._regular_copy(e["sha256"])
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
            self._record({"name": e["name"], "size": e["size"], "sha256": e["sha256"], "mode": mode})
            have.add(key)

    def completed(self) -> dict[str, FinishedFile]:
        """The files this fingerprint's ledger records as uploaded (the last record of a name wins)."""
        done: dict[str, FinishedFile] = {}
        for e in self._entries():
            if "name" in e:
                done[e["name"]] = FinishedFile(e["name"], e["size"], e["sha256"])
        return done

    def finish(self, uploads: Sequence[tuple[str, Path]], planned: Mapping[str, int]) -> None:
        """One commit (or one pull request) holding every planned file and the `uploads`."""
        from huggingface_hub import CommitOperationAdd

        entries = self._entries()
        recorded = {e["name"]: e for e in entries if "name" in e}
        missing = sorted(n for n, size in planned.items() if n not in recorded or recorded[n]["size"] != size)
        if missing:
            raise HubError(f"Cannot publish {self.url}: {len(missing)} planned file(s) were never uploaded "
                           f"({', '.join(missing[:3])}). Run the conversion again: finished files are kept.", file=self.url)
        operations = []
        for name in sorted(planned):
            e = recorded[name]
            if e.get("mode") == "regular":
                operations.append(CommitOperationAdd(self._path(name), str(self._regular_copy(e["sha256"]))))
            else:
                operations.append(_uploaded(self._path(name), e["size"], e["sha256"]))
        operations += [CommitOperationAdd(self._path(name), str(path)) for name, path in uploads]
        heads = [e["head"] for e in entries if "head" in e]
        operations += self._stale(heads[-1] if heads else self.revision, {*planned, *(n for n, _ in uploads)})
        message = self.options.get("commit_message") or f"Upload {len(planned)} converted file(s) with checkpoint-workbench"
        description = self.options.get("commit_description") or ""
        try:
            with _quiet_hub():
                info = self.api.create_commit(
                    self.repo_id, operations, commit_message=message, commit_description=description,
                    revision=self.revision, create_pr=self.create_pr, parent_commit=heads[-1] if heads else None)
        except Exception as exc:  # noqa: BLE001
            from huggingface_hub.errors import HfHubHTTPError

            status = getattr(getattr(exc, "response", None), "status_code", None)
            if isinstance(exc, HfHubHTTPError) and status in (409, 412) or "parentCommit" in str(exc):
                raise HubError(f"Cannot publish {self.url}: {self.revision} moved while the conversion ran (another "
                               "commit landed). Run the conversion again: finished uploads are kept, and the commit is "
                               "built on the new head.", file=self.url) from None
            raise HubError(self._refusal(exc, "committing"), file=self.url) from None
        self._record({"commit": info.oid, "pr": info.pr_revision, "pr_url": info.pr_url})
        for e in recorded.values():  # the inline copies are in the commit now
            if e.get("mode") == "regular":
                self._regular_copy(e["sha256"]).unlink(missing_ok=True)

    def _stale(self, revision: str, written: set[str]) -> list:
        """Deletions of an older output's files (any format's data files, index, markers) this commit does not
        replace. `state` refused such files unless overwrite=True or create_pr=True, so here they are to go: a
        repo holding old shards beside new ones would contradict its own index."""
        from huggingface_hub import CommitOperationDelete

        try:
            held = [s.rfilename for s in self.api.model_info(self.repo_id, revision=revision).siblings or []]
        except Exception as exc:  # noqa: BLE001
            raise HubError(self._refusal(exc, "listing the branch before the commit"), file=self.url) from None
        return [CommitOperationDelete(self._path(n)) for n in self._outputs_held(held) if _owned(n) and n not in written]

    def abort(self) -> None:
        """Nothing to undo: pre-uploaded objects belong to no commit (the Hub drops them), and the ledger keeps them
        for a re-run."""


@contextlib.contextmanager
def _quiet_hub():
    """huggingface_hub's per-file upload bars off while a file uploads: the conversion's own bar reports progress, and
    the two would garble each other's lines (its bars have no group name to turn off alone)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if are_progress_bars_disabled():
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()


# A local conversion's run records (planning/destination.py), uploaded with a folder someone pushed by hand.
_RUN_RECORDS = (".workbench-convert.json", ".workbench-complete.json")


def _owned(name: str) -> bool:
    """Whether `name` belongs to an output (any format's data file, index, marker, or a workbench run record)."""
    from .. import owned

    return name in _RUN_RECORDS or owned(name)


def _uploaded(path_in_repo: str, size: int, sha256: str):
    """A `CommitOperationAdd` for content pre-uploaded earlier (perhaps by another process): huggingface_hub's commit
    needs only its path, size and sha256, so it is marked as uploaded LFS content and carries no data."""
    from huggingface_hub import CommitOperationAdd
    from huggingface_hub.lfs import UploadInfo

    op = CommitOperationAdd(path_in_repo=path_in_repo, path_or_fileobj=b"")
    op.upload_info = UploadInfo(size=size, sample=b"", sha256=bytes.fromhex(sha256))
    op._upload_mode = "lfs"
    op._is_uploaded = True
    return op
