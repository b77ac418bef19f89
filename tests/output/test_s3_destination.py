"""Conversions into `s3://bucket/prefix/` (moto's S3 server): byte-identical to the local conversion, within the
local spool bound, read back by range, resumed, locked; other URL schemes refused (issue 35)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
from remote_servers import MotoS3, folder_files, s3_destination_env, s3_server  # noqa: F401 - fixtures s3, _env
from safetensors.numpy import save_file

import workbench as wb
from workbench.errors import PlanError
from workbench.output.remote.s3 import LOCK_NAME, S3Destination
from workbench.planning.spool import streamed_files

pytestmark = pytest.mark.serial  # a server in this process

MiB = 1 << 20
SPOOL = dict(spool_size="8MiB", remote_options={"part_size": "5MiB"})  # 6 MiB shards: multipart, two parts each
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """32 MiB of float32 in four shards (sixteen 2 MiB tensors) and a config.json: 4x the 8 MiB spool."""
    folder = tmp_path_factory.mktemp("src")
    rng = np.random.default_rng(35)
    tensors = {f"layers.{i}.weight": rng.standard_normal((512, 1024), dtype=np.float32) for i in range(16)}
    names = list(tensors)
    for k in range(4):
        save_file({n: tensors[n] for n in names[4 * k:4 * k + 4]}, str(folder / f"model-{k + 1:05d}-of-00004.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float32"}))
    return folder


@pytest.fixture(scope="module")
def reference(source: Path, tmp_path_factory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("ref") / "out"
    wb.convert(source, out, shard_size="6MiB", quiet=True)
    return folder_files(out)


def _disk_bytes(spool: Path) -> int:
    """Bytes the spool folder's files hold on disk (their allocated blocks: a streamed file is sparse)."""
    return sum(p.stat().st_blocks * 512 for p in spool.rglob("*") if p.is_file() and not p.name.startswith(".workbench"))


def _spool_bytes_at_uploads(monkeypatch: pytest.MonkeyPatch, spool: Path) -> list[int]:
    """Bytes on disk in the spool folder each time a file or a streamed part starts uploading (the spool is fullest then)."""
    seen: list[int] = []
    upload, put = S3Destination.file_done, S3Destination.put_part

    def measured(self, name, local_path, size, sha256):
        seen.append(_disk_bytes(spool))
        return upload(self, name, local_path, size, sha256)

    def measured_part(self, name, number, data):
        seen.append(_disk_bytes(spool))
        return put(self, name, number, data)

    monkeypatch.setattr(S3Destination, "file_done", measured)
    monkeypatch.setattr(S3Destination, "put_part", measured_part)
    return seen


def test_local_and_s3_sources_upload_the_local_bytes_within_the_spool(s3: MotoS3, source: Path, reference: dict,
                                                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = s3.bucket()
    url = f"s3://{bucket}/out/"
    plan = wb.plan(source, dest=url, shard_size="6MiB", **SPOOL)
    assert plan.ok, plan.problems
    assert plan.dest is not None and str(plan.dest).startswith(str(tmp_path / "spool"))
    total = sum(f.size for f in plan.output_file_list)
    assert total >= 4 * (8 * MiB) and plan.spool_bytes == 8 * MiB  # the input is 4x the spool; the plan states the bound
    assert f"-> {url} (through the local spool {plan.dest})" in plan.summary()
    assert "local disk to provision: 8.0 MiB per rank" in plan.summary()
    rss = plan.rss_breakdown
    assert rss.loc["upload"].iloc[0] == 4 * 2 * 5 * MiB and "transport" in rss.index  # 4 parts in flight, s3fs for a local source
    seen = _spool_bytes_at_uploads(monkeypatch, plan.dest)
    report = wb.convert(source, url, shard_size="6MiB", quiet=True, **SPOOL)
    assert s3.output(bucket, "out") == reference  # every file, config.json and the index, byte for byte
    parts = sum(len(f.bounds) for f in streamed_files(plan, 0).values())  # shards above 5 MiB go up part by part
    assert len(seen) == parts + len(reference) - len(streamed_files(plan, 0))
    assert max(seen) <= plan.spool_bytes  # measured on disk, at every upload
    assert 0 < report.spool_peak <= plan.spool_bytes == report.predicted_spool_bytes
    assert "spool peak" in report.summary()
    assert report.url == url and report.summary().startswith(f"Converted into {url} in ")  # the bucket, not the spool
    assert str(plan.dest) not in report.summary().splitlines()[0]
    assert not [p for p in plan.dest.rglob("*") if p.is_file() and not p.name.startswith(".workbench")]  # spool emptied
    heads = {n: s3.client.head_object(Bucket=bucket, Key=f"out/{n}") for n in reference if n.endswith(".safetensors")}
    assert all(h["ETag"].endswith('-2"') for h in heads.values() if h["ContentLength"] > 5 * MiB)  # two multipart parts
    assert s3.uploads(bucket) == []

    remote_source = s3.upload_folder(source, bucket, "src")  # an s3:// source into another prefix
    wb.convert(remote_source, f"s3://{bucket}/again/", shard_size="6MiB", quiet=True, **SPOOL)
    assert s3.output(bucket, "again") == reference


def test_parts_upload_as_their_bytes_are_written_so_a_spool_smaller_than_a_shard_works(
        s3: MotoS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "big"  # 96 MiB in 1 MiB tensors: 4x the 24 MiB spool, two shards of 64 and 32 MiB
    folder.mkdir()
    rng = np.random.default_rng(8)
    save_file({f"layers.{i}.weight": rng.standard_normal((256, 1024), dtype=np.float32) for i in range(96)},
              str(folder / "model.safetensors"))
    options = dict(shard_size="64MiB", spool_size="24MiB", remote_options={"part_size": "8MiB"})
    wb.convert(folder, tmp_path / "ref", shard_size="64MiB", quiet=True)
    bucket = s3.bucket()
    url = f"s3://{bucket}/big/"
    plan = wb.plan(folder, dest=url, **options)
    streamed = streamed_files(plan, 0)
    assert max(f.size for f in plan.output_file_list) > 64 * MiB and len(streamed) == 2  # 64 MiB of tensors and a header
    assert [len(f.bounds) for f in streamed.values()] == [9, 5]  # 8 MiB parts
    assert plan.spool_bytes == 24 * MiB  # stated: the spool size (a part being written and parts waiting fit in it)
    seen = _spool_bytes_at_uploads(monkeypatch, plan.dest)
    opened: list[int] = []
    close = S3Destination.close_stream
    monkeypatch.setattr(S3Destination, "close_stream", lambda self, name, size: (opened.append(len(seen)), close(self, name, size)))
    report = wb.convert(folder, url, quiet=True, **options)
    assert s3.output(bucket, "big") == folder_files(tmp_path / "ref") and s3.uploads(bucket) == []
    assert len(seen) == 14 + 1 and opened[0] >= 9  # 14 parts, then the index; the first shard completed after its 9 parts
    assert max(seen) <= plan.spool_bytes and report.spool_peak <= plan.spool_bytes  # measured on disk and by the gate
    assert max(seen) < 64 * MiB  # never a whole shard on disk


def test_https_and_hf_sources_upload_the_local_bytes(s3: MotoS3, source: Path, reference: dict, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from remote_servers import NGINX, HubServer, Nginx

    if NGINX is None:
        pytest.skip("nginx is not installed (make test installs Debian's nginx; apt-get install nginx)")
    import shutil

    served = tmp_path / "served" / "src"  # an HTTP server cannot list a folder: the served copy has an index
    shutil.copytree(source, served)
    weight_map = {f"layers.{i}.weight": f"model-{i // 4 + 1:05d}-of-00004.safetensors" for i in range(16)}
    (served / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    bucket = s3.bucket()
    web = Nginx(served.parent, tmp_path / "nginx")
    hub = HubServer(tmp_path / "hub-store")
    try:
        hub.add("org/src", source)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        for name, url in (("web", f"{web.url}/src/"), ("hub", "hf://org/src")):
            report = wb.convert(url, f"s3://{bucket}/{name}/", shard_size="6MiB", quiet=True, **SPOOL)
            assert s3.output(bucket, name) == reference, name  # shards, config.json, index: the local bytes
            assert report.files_match_plan and report.url == f"s3://{bucket}/{name}/"
        assert any(r[1].endswith(".safetensors") and r[4] for r in web.requests())  # read from nginx, by range
        assert s3.uploads(bucket) == []
    finally:
        web.stop()
        hub.stop()


def test_two_local_processes_upload_their_own_files(s3: MotoS3, source: Path, reference: dict) -> None:
    bucket = s3.bucket()
    report = wb.convert(source, f"s3://{bucket}/out/", shard_size="6MiB", nproc=2, quiet=True, **SPOOL)
    assert report.launcher == "local" and all(r.files_written for r in report.ranks)
    assert s3.output(bucket, "out") == reference and s3.uploads(bucket) == []


def test_a_dcp_output_uploads_its_metadata_last(s3: MotoS3, source: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    wb.convert(source, tmp_path / "dcp", to="dcp", shard_size="6MiB", quiet=True)
    bucket = s3.bucket()
    order: list[str] = []
    upload = S3Destination.file_done
    monkeypatch.setattr(S3Destination, "file_done", lambda self, name, *rest: (order.append(name), upload(self, name, *rest)))
    report = wb.convert(source, f"s3://{bucket}/dcp/", to="dcp", shard_size="6MiB", quiet=True, verify=True, **SPOOL)
    assert report.verified and s3.output(bucket, "dcp") == folder_files(tmp_path / "dcp")
    assert order[-1] == ".metadata" and len(order) == len(folder_files(tmp_path / "dcp"))


def test_verify_and_open_checkpoint_read_the_uploaded_objects(s3: MotoS3, source: Path, tmp_path: Path) -> None:
    from workbench.engine.output_check import check_outputs

    bucket = s3.bucket()
    url = f"s3://{bucket}/out/"
    report = wb.convert(source, url, shard_size="6MiB", quiet=True, verify=True, **SPOOL)
    assert report.verified and report.output_check.dest == url
    ck = wb.open_checkpoint(url)
    assert len(ck.tensors) == 16
    assert np.array_equal(ck.load("layers.3.weight").numpy(), wb.open_checkpoint(source).load("layers.3.weight").numpy())
    # One byte changed in the bucket (the spool copies are long gone): re-reading the objects finds it.
    key = "out/model-00002-of-00006.safetensors"
    body = bytearray(s3.client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[-1] ^= 0xFF
    s3.client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    plan = wb.plan(source, dest=url, shard_size="6MiB", **SPOOL)
    check = check_outputs(plan)
    assert not check.ok and any(row[2] == "mismatch" for row in check.rows)


def test_verify_checks_the_uploaded_config_against_transformers(s3: MotoS3, tmp_path: Path) -> None:
    from tests.conftest import SAMPLES

    local = wb.convert(SAMPLES / "tiny-llama", tmp_path / "local", None, quiet=True, verify=True)
    assert local.output_check.statement.startswith("the transformers LlamaForCausalLM (llama) statement")
    bucket = s3.bucket()
    report = wb.convert(SAMPLES / "tiny-llama", f"s3://{bucket}/out/", None, quiet=True, verify=True)
    assert report.verified and report.output_check.unchecked is None
    assert report.output_check.statement == local.output_check.statement  # config.json read from the bucket
    s3.client.put_object(Bucket=bucket, Key="out/config.json", Body=b"[1, 2]")  # the uploaded config, damaged
    plan = wb.plan(SAMPLES / "tiny-llama", None, dest=f"s3://{bucket}/out/")
    from workbench.engine.output_check import check_outputs

    check = check_outputs(plan)
    assert check.unchecked == "not checked against transformers: the output's config.json is not a JSON object"


def test_a_rerun_does_nothing_another_plan_is_refused_overwrite_replaces(s3: MotoS3, source: Path, reference: dict) -> None:
    bucket = s3.bucket()
    url = f"s3://{bucket}/out/"
    wb.convert(source, url, shard_size="6MiB", quiet=True, **SPOOL)
    again = wb.convert(source, url, shard_size="6MiB", quiet=True, **SPOOL)
    assert again.already_complete and again.summary().startswith(f"Already complete, nothing to do: {url} holds")
    other = wb.plan(source, dest=url, shard_size="3MiB", **SPOOL)
    assert not other.ok and "holds a finished conversion of a different plan" in other.errors[0].message
    wb.convert(source, url, shard_size="12MiB", quiet=True, overwrite=True, **SPOOL)
    names = set(s3.output(bucket, "out"))
    assert names == {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
                     INDEX, "config.json"}  # the older conversion's six shards are gone
    s3.client.put_object(Bucket=bucket, Key="mine/notes.txt", Body=b"x")
    refused = wb.plan(source, dest=f"s3://{bucket}/mine/", shard_size="6MiB", **SPOOL)
    assert not refused.ok and "the prefix is not empty (1 objects: notes.txt)" in refused.errors[0].message


def test_a_resumed_run_keeps_finished_objects_and_aborts_leftover_uploads(s3: MotoS3, source: Path, reference: dict,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = s3.bucket()
    url = f"s3://{bucket}/out/"
    calls: list[str] = []
    close = S3Destination.close_stream  # shards above the 5 MiB part go up part by part, completed here

    def failing(self, name, size):
        calls.append(name)
        if len(calls) == 3:  # the third file: a multipart upload started, then the connection "dropped"
            self.call("create_multipart_upload", name, Key=self.key(name))
            raise PlanError(f"Cannot upload {name}: injected failure.")
        return close(self, name, size)

    monkeypatch.setattr(S3Destination, "close_stream", failing)
    with pytest.raises(PlanError, match="injected failure"):
        wb.convert(source, url, shard_size="6MiB", quiet=True, **SPOOL)
    assert INDEX not in s3.objects(bucket, "out") and len(s3.uploads(bucket)) == 1  # not visible; one upload left over
    monkeypatch.setattr(S3Destination, "close_stream", close)
    plan = wb.plan(source, dest=url, shard_size="6MiB", **SPOOL)
    assert {"model-00001-of-00006.safetensors", "model-00002-of-00006.safetensors"} <= plan.kept
    assert calls[2] not in plan.kept and len(plan.kept) < 6
    report = wb.convert(source, url, shard_size="6MiB", quiet=True, **SPOOL)
    assert sorted(report.kept) == sorted(plan.kept)
    assert s3.output(bucket, "out") == reference and s3.uploads(bucket) == []


def test_the_lock_is_a_conditional_write(s3: MotoS3, source: Path) -> None:
    bucket = s3.bucket()
    url = f"s3://{bucket}/out/"
    holder = {"host": "another-node", "pid": 1, "started": 0, "fingerprint": "x"}
    s3.client.put_object(Bucket=bucket, Key=f"out/{LOCK_NAME}", Body=json.dumps(holder).encode())
    with pytest.raises(PlanError, match=r"another conversion is writing there \(process 1 on another-node"):
        wb.convert(source, url, shard_size="6MiB", quiet=True, **SPOOL)
    assert INDEX not in s3.objects(bucket, "out")
    dead = {"host": socket.gethostname(), "pid": _dead_pid(), "started": 0, "fingerprint": "x"}  # a killed run here
    s3.client.put_object(Bucket=bucket, Key=f"out/{LOCK_NAME}", Body=json.dumps(dead).encode())
    wb.convert(source, url, shard_size="6MiB", quiet=True, **SPOOL)
    assert INDEX in s3.objects(bucket, "out") and LOCK_NAME not in s3.objects(bucket, "out")


def test_a_dead_lock_is_removed_only_while_it_is_the_one_read(s3: MotoS3) -> None:
    bucket = s3.bucket()
    destination = S3Destination(f"s3://{bucket}/out/", "fp")
    key = f"out/{LOCK_NAME}"
    stale = s3.client.put_object(Bucket=bucket, Key=key, Body=b'{"host": "h", "pid": 1}')["ETag"]
    s3.client.put_object(Bucket=bucket, Key=key, Body=b'{"host": "h", "pid": 2}')  # another run took it over meanwhile
    destination._remove_stale_lock(stale)
    assert json.loads(s3.objects(bucket, "out")[LOCK_NAME])["pid"] == 2  # the newer lock stays
    destination._remove_stale_lock(s3.client.head_object(Bucket=bucket, Key=key)["ETag"])
    assert LOCK_NAME not in s3.objects(bucket, "out")


def _parts_file(tmp_path: Path) -> tuple[Path, bytes]:
    body = np.random.default_rng(6).integers(0, 256, 16 * MiB, dtype=np.uint8).tobytes()  # 4 parts of 5 MiB (the last 1)
    (tmp_path / "big.bin").write_bytes(body)
    return tmp_path / "big.bin", body


def test_parts_of_one_file_upload_at_once_and_the_plan_counts_their_buffers(s3: MotoS3, tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    bucket = s3.bucket()
    destination = S3Destination(f"s3://{bucket}/out/", "fp", {"part_size": "5MiB", "part_threads": "2"})
    assert destination.memory_terms()[0][1] == 2 * 2 * 5 * MiB
    both = threading.Barrier(2, timeout=30)  # parts 1 and 2 meet here: it breaks if they were sent one after the other
    call = S3Destination.call

    def meeting(self, method, name, **kwargs):
        if method == "upload_part" and kwargs["PartNumber"] in (1, 2):
            both.wait()
        return call(self, method, name, **kwargs)

    monkeypatch.setattr(S3Destination, "call", meeting)
    path, body = _parts_file(tmp_path)
    destination.file_done("big.bin", path, len(body), "x")
    head = s3.client.head_object(Bucket=bucket, Key="out/big.bin")
    assert s3.objects(bucket, "out")["big.bin"] == body and head["ETag"].endswith('-4"') and s3.uploads(bucket) == []
    with pytest.raises(PlanError, match="part_threads=0"):
        S3Destination(f"s3://{bucket}/x/", "fp", {"part_threads": 0})


def test_a_failed_part_aborts_the_upload_after_the_others_stopped(s3: MotoS3, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = s3.bucket()
    destination = S3Destination(f"s3://{bucket}/out/", "fp", {"part_size": "5MiB", "part_threads": "2"})
    import threading

    sent: list[int] = []
    call = S3Destination.call
    part2_failed = threading.Event()

    def failing(self, method, name, **kwargs):
        if method == "upload_part":
            if kwargs["PartNumber"] == 2:
                part2_failed.set()
                raise PlanError("Cannot upload part 2: injected failure.")
            assert part2_failed.wait(30)  # part 1 is in flight while part 2 fails
            sent.append(kwargs["PartNumber"])
        if method == "abort_multipart_upload":
            sent.append(0)
        return call(self, method, name, **kwargs)

    monkeypatch.setattr(S3Destination, "call", failing)
    path, body = _parts_file(tmp_path)
    with pytest.raises(PlanError, match="injected failure"):
        destination.file_done("big.bin", path, len(body), "x")
    assert sent == [1, 0]  # part 1 finished, parts 3 and 4 never sent, the upload aborted after that
    assert s3.uploads(bucket) == [] and "big.bin" not in s3.objects(bucket, "out") and destination._uploads == {}


def _dead_pid() -> int:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("url", ["https://example.com/out/", "gs://b/p", "file:///tmp/x"])
def test_other_schemes_are_refused_by_name(url: str, source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PlanError, match=f"Cannot write to {url}: the workbench writes to local folders and to s3://, hf://"):
        wb.plan(source, None, dest=url)
    assert os.listdir(tmp_path) == []


def test_the_cli_converts_into_s3_with_a_spool_and_verifies(s3: MotoS3, source: Path, reference: dict,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from workbench import cli

    bucket = s3.bucket()
    url = f"s3://{bucket}/cli/"
    status = cli.main(["convert", str(source), url, "--shard-size", "6MiB", "--spool-size", "8MiB", "--remote-option",
                       "part_size=5MiB", "--verify", "--quiet"])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert f"-> {url} (through the local spool" in out and "local disk to provision: 8.0 MiB per rank" in out
    assert s3.output(bucket, "cli") == reference
    assert cli.main(["convert", str(source), url, "--remote-option", "part_size"]) == 2
    assert "Cannot read --remote-option 'part_size': write it as KEY=VALUE" in capsys.readouterr().err


@pytest.mark.parametrize("part", ["5MiB", "8MiB"])  # the 6 MiB file streamed in two parts / uploaded once written
def test_a_single_file_output_appears_only_when_the_run_finishes(s3: MotoS3, tmp_path: Path, part: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "one"  # one 6 MiB file and config.json
    folder.mkdir()
    save_file({"w": np.random.default_rng(3).standard_normal((1536, 1024), dtype=np.float32)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    wb.convert(folder, tmp_path / "ref", shard_size="64MiB", quiet=True)
    reference = folder_files(tmp_path / "ref")
    assert sorted(reference) == ["config.json", "model.safetensors"]  # no index: the data file is the marker
    bucket = s3.bucket()
    url = f"s3://{bucket}/one/"
    seen: list[set[str]] = []
    complete = S3Destination._complete_deferred

    def completing(self, name, size):  # config.json is up; the data file is not visible yet
        seen.append(set(s3.objects(bucket, "one")))
        if len(seen) == 1:
            raise PlanError("Cannot publish: failure injected before the completion.")
        return complete(self, name, size)

    monkeypatch.setattr(S3Destination, "_complete_deferred", completing)
    options = dict(shard_size="64MiB", remote_options={"part_size": part})
    assert len(streamed_files(wb.plan(folder, dest=url, **options), 0)) == (part == "5MiB")
    with pytest.raises(PlanError, match="failure injected"):
        wb.convert(folder, url, quiet=True, **options)
    assert "model.safetensors" not in s3.objects(bucket, "one")  # a failed run never showed the file
    wb.convert(folder, url, quiet=True, **options)  # the re-run uploads it again (the open upload was aborted)
    assert all("model.safetensors" not in names and "config.json" in names for names in seen)
    assert s3.output(bucket, "one") == reference and s3.uploads(bucket) == []


def _big_source(folder: Path) -> Path:
    """96 MiB in 1 MiB tensors, one file: with 64 MiB shards, two output files of 64 and 32 MiB (and headers)."""
    folder.mkdir()
    rng = np.random.default_rng(8)
    save_file({f"layers.{i}.weight": rng.standard_normal((256, 1024), dtype=np.float32) for i in range(96)},
              str(folder / "model.safetensors"))
    return folder


def _convert_without_holes(s3: MotoS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spool_dir: Path) -> None:
    """A streamed upload into a spool folder that cannot punch holes: planned and run as whole files, the plan
    stating the disk that takes (the largest file, not the 24 MiB spool size), held on disk, byte-identical."""
    from workbench.planning.spool import WHOLE_NO_HOLES, spool_route

    folder = _big_source(tmp_path / "big")
    options = dict(shard_size="64MiB", spool_size="24MiB", remote_options={"part_size": "8MiB"}, spool_dir=spool_dir)
    wb.convert(folder, tmp_path / "ref", shard_size="64MiB", quiet=True)
    bucket = s3.bucket()
    url = f"s3://{bucket}/big/"
    plan = wb.plan(folder, dest=url, **options)
    assert plan.ok, plan.problems
    assert spool_route(plan) == WHOLE_NO_HOLES and streamed_files(plan, 0) == {}  # would stream parts elsewhere
    largest = max(f.size for f in plan.output_file_list)
    assert largest > 64 * MiB and plan.spool_bytes == largest  # the stated need: one whole file, not --spool-size
    assert "the spool folder cannot punch holes" in plan.summary()
    seen = _spool_bytes_at_uploads(monkeypatch, plan.dest)
    report = wb.convert(folder, url, quiet=True, **options)
    assert s3.output(bucket, "big") == folder_files(tmp_path / "ref") and s3.uploads(bucket) == []
    assert len(seen) == 2 + 1  # two files uploaded whole, then the index
    assert max(seen) <= plan.spool_bytes + 4096  # on disk, one file at a time (its last block allocated whole)
    assert report.spool_peak <= plan.spool_bytes == report.predicted_spool_bytes
    assert not [p for p in plan.dest.rglob("*") if p.is_file() and not p.name.startswith(".workbench")]  # spool emptied


def test_a_spool_that_cannot_punch_holes_spools_whole_files_and_says_so(s3: MotoS3, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # The seam: the kernel call freeing a range's blocks answers what a file system without FALLOC_FL_PUNCH_HOLE
    # (vfat, ramfs) answers, EOPNOTSUPP, so the spool folder's probe finds it cannot. The next test does it for real
    # where this machine lets it mount one.
    import errno

    from workbench.output.remote import spool

    assert spool.can_punch_holes(tmp_path / "spool" / "not-yet")  # this test's own folder can: the seam is what differs
    monkeypatch.setattr(spool, "punch", lambda fd, offset, length: errno.EOPNOTSUPP)
    assert not spool.can_punch_holes(tmp_path / "spool" / "not-yet") and not (tmp_path / "spool").exists()  # no probe left
    _convert_without_holes(s3, tmp_path, monkeypatch, tmp_path / "spool")


@pytest.fixture
def ramfs(tmp_path: Path):
    """A ramfs mount (no FALLOC_FL_PUNCH_HOLE: fallocate answers EOPNOTSUPP), unmounted after the test; skipped where
    this process may not mount (not root, or a container without the capability)."""
    import subprocess

    point = tmp_path / "ramfs"
    point.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "ramfs", "-o", "mode=0700", "wb-test-ramfs", str(point)],
                                           capture_output=True).returncode:
        pytest.skip("cannot mount a ramfs here (needs root and the mount capability)")
    try:
        yield point
    finally:
        subprocess.run(["umount", str(point)], check=True)


def test_a_real_file_system_without_hole_punching_spools_whole_files(s3: MotoS3, tmp_path: Path, ramfs: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from workbench.output.remote.spool import can_punch_holes

    assert not can_punch_holes(ramfs) and list(ramfs.iterdir()) == []
    _convert_without_holes(s3, tmp_path, monkeypatch, ramfs / "spool")
