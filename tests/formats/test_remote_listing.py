"""An S3 listing is bounded (issue 29 A1): a server that answers list_objects_v2 with page after page (each with a
continuation token) is refused after `MAX_LISTING_PAGES` pages / `MAX_LISTING_ENTRIES` entries, and a token sent
twice ends it at once, instead of the process paging (and growing) for ever."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

import workbench as wb
from workbench.errors import WorkbenchError
from workbench.formats import remote_limits

pytest.importorskip("s3fs")


class _Endless(BaseHTTPRequestHandler):
    """list_objects_v2 that never ends: `mode` "empty" (no entries, a new token each page), "full" (one key a page),
    "loop" (the same token again)."""

    mode = "empty"
    pages = 0

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        type(self).pages += 1
        query = parse_qs(urlsplit(self.path).query)
        n = int(query.get("continuation-token", ["0"])[0]) + 1
        token = "1" if self.mode == "loop" else str(n)
        contents = (f"<Contents><Key>p/file{n}</Key><Size>1</Size><ETag>&quot;e{n}&quot;</ETag>"
                    "<LastModified>2020-01-01T00:00:00.000Z</LastModified></Contents>") if self.mode == "full" else ""
        body = ('<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                f"<Name>b</Name><Prefix>p</Prefix><KeyCount>{1 if contents else 0}</KeyCount><MaxKeys>1000</MaxKeys>"
                f"<IsTruncated>true</IsTruncated><NextContinuationToken>{token}</NextContinuationToken>{contents}"
                "</ListBucketResult>").encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def endless(monkeypatch, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Endless)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    for key, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.server_address[1]}",
                       "WORKBENCH_CACHE": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    _Endless.pages = 0
    yield _Endless
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(("mode", "why"), [("empty", "did not end after 50 pages"), ("full", "more than 20 entries"),
                                           ("loop", "continuation token '1' twice")])
def test_endless_listing_pages_are_refused(endless, monkeypatch, mode: str, why: str) -> None:
    monkeypatch.setattr(remote_limits, "MAX_LISTING_PAGES", 50)
    monkeypatch.setattr("workbench.formats.remote.MAX_LISTING_PAGES", 50)
    monkeypatch.setattr("workbench.formats.remote.MAX_LISTING_ENTRIES", 20)
    endless.mode = mode
    with pytest.raises(WorkbenchError, match=why) as caught:
        wb.open_checkpoint("s3://b/p/")
    assert "Cannot list s3://b/p/" in caught.value.message
    assert endless.pages <= 51


def test_the_caps_are_documented_constants() -> None:
    assert remote_limits.MAX_LISTING_PAGES == 1_000 and remote_limits.MAX_LISTING_ENTRIES == 200_000
    assert "MAX_LISTING_PAGES" in remote_limits.__doc__
