"""fetch_model against real servers on loopback: moto's S3 server and a small Range-aware HTTP server.

No wall-clock assertions: where two fetchers must overlap, the HTTP server holds its response until
the test lets it go, and the assertion is on what the server saw (how many GETs, which Range).
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from inferplane.storage.cache import cached_path
from inferplane.storage.digest import sha256_file, sha256_folder
from inferplane.storage.fetch import DigestMismatch, FetchError, fetch_model

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "models"
NOWHERE = "http://127.0.0.1:9"  # the discard port: nothing listens, so any network use fails
WAIT = 60  # generous: only a broken fetcher ever waits this long


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_gguf(seed: int, size: int = 256 * 1024) -> bytes:
    """b"GGUF" and pseudo-random bytes: storage only checks bytes, not the format."""
    out, block = bytearray(b"GGUF"), hashlib.sha256(str(seed).encode()).digest()
    while len(out) < size:
        block = hashlib.sha256(block).digest()
        out += block
    return bytes(out[:size])


# --- S3 (moto) ---


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    import boto3
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as mp:
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
            mp.delenv(name, raising=False)
        missing = str(tmp_path_factory.mktemp("aws") / "none")
        mp.setenv("AWS_CONFIG_FILE", missing)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", missing)
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        port = free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        try:
            endpoint = f"http://127.0.0.1:{port}"
            client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
            client.create_bucket(Bucket=BUCKET)
            gguf = fake_gguf(1)
            client.put_object(Bucket=BUCKET, Key="gguf/tiny.gguf", Body=gguf)
            from inferplane.bench.tiny_model import make_tiny_model

            folder = Path(make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny"))
            for path in sorted(folder.rglob("*")):
                if path.is_file():
                    client.upload_file(str(path), BUCKET, f"hf/tiny/{path.relative_to(folder).as_posix()}")
            client.put_object(Bucket=BUCKET, Key="hf/tiny/.gitattributes", Body=b"* binary\n")  # hidden: skipped
            yield SimpleNamespace(endpoint=endpoint, client=client, gguf=gguf,
                                  gguf_sha=hashlib.sha256(gguf).hexdigest(), folder=folder,
                                  folder_sha=sha256_folder(folder))
        finally:
            server.stop()


def test_s3_file_is_fetched_once_then_served_from_the_cache(s3: SimpleNamespace, tmp_path: Path) -> None:
    uri = f"s3://{BUCKET}/gguf/tiny.gguf"
    first = fetch_model(uri, tmp_path, sha256=s3.gguf_sha, s3_endpoint_url=s3.endpoint)
    assert first.path == cached_path(tmp_path, s3.gguf_sha, uri, folder=False) == tmp_path / s3.gguf_sha / "tiny.gguf"
    assert sha256_file(first.path) == first.sha256 == s3.gguf_sha
    assert (first.downloaded, first.size_bytes) == (True, len(s3.gguf))
    assert not any((tmp_path / ".partial").iterdir()) and not any((tmp_path / ".tmp").iterdir())
    again = fetch_model(uri, tmp_path, sha256=s3.gguf_sha, s3_endpoint_url=NOWHERE)  # a hit uses no network
    assert (again.path, again.downloaded, again.sha256) == (first.path, False, s3.gguf_sha)


def test_s3_file_without_a_digest_is_keyed_by_the_computed_one(s3: SimpleNamespace, tmp_path: Path) -> None:
    result = fetch_model(f"s3://{BUCKET}/gguf/tiny.gguf", tmp_path, s3_endpoint_url=s3.endpoint)
    assert result.sha256 == s3.gguf_sha
    assert result.path == tmp_path / s3.gguf_sha / "tiny.gguf"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [s3.gguf_sha]


def test_s3_prefix_is_fetched_as_a_folder(s3: SimpleNamespace, tmp_path: Path) -> None:
    result = fetch_model(f"s3://{BUCKET}/hf/tiny/", tmp_path, sha256=s3.folder_sha, s3_endpoint_url=s3.endpoint)
    assert result.path == tmp_path / s3.folder_sha / "model"
    assert sha256_folder(result.path) == sha256_folder(s3.folder) == result.sha256
    assert sorted(p.name for p in result.path.iterdir()) == sorted(p.name for p in s3.folder.iterdir())
    assert result.downloaded
    print(f"\ntiny HF folder from moto: {result.size_bytes} bytes, fetched in {result.fetch_seconds:.3f} s, "
          f"verified in {result.verify_seconds:.3f} s")
    # No trailing slash: no object has that name, so the bucket is asked for a prefix.
    fresh = fetch_model(f"s3://{BUCKET}/hf/tiny", tmp_path / "other", s3_endpoint_url=s3.endpoint)
    assert (fresh.sha256, fresh.path.name) == (s3.folder_sha, "model")


def test_s3_corrupted_object_is_a_digest_mismatch_and_leaves_nothing(s3: SimpleNamespace, tmp_path: Path) -> None:
    good = fake_gguf(2)
    s3.client.put_object(Bucket=BUCKET, Key="corrupt/tiny.gguf", Body=good)
    s3.client.put_object(Bucket=BUCKET, Key="corrupt/tiny.gguf", Body=good[:-1] + b"\0")
    expected = hashlib.sha256(good).hexdigest()
    uri = f"s3://{BUCKET}/corrupt/tiny.gguf"
    with pytest.raises(DigestMismatch) as caught:
        fetch_model(uri, tmp_path, sha256=expected, s3_endpoint_url=s3.endpoint)
    message = str(caught.value)
    assert uri in message and expected in message and caught.value.actual in message and "\n" not in message
    assert not (tmp_path / expected).exists()
    assert not (tmp_path / ".partial" / expected).exists()
    assert not any((tmp_path / ".tmp").iterdir())


def test_s3_missing_object_is_a_fetch_error(s3: SimpleNamespace, tmp_path: Path) -> None:
    with pytest.raises(FetchError, match=f"s3://{BUCKET}/nothing/here"):
        fetch_model(f"s3://{BUCKET}/nothing/here", tmp_path, sha256="0" * 64, s3_endpoint_url=s3.endpoint)


# --- HTTP ---


class FileServer:
    """Serves `files` by path, honours `Range: bytes=N-`, counts GETs (with their Range headers), and
    on request drops the connection after N body bytes of the next response, or holds responses
    until released."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.gets: list[tuple[str, str | None]] = []
        self.drop_after: int | None = None
        self.hold: threading.Event | None = None
        self.received = threading.Event()
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                with server._lock:
                    server.gets.append((self.path, self.headers.get("Range")))
                    drop, server.drop_after = server.drop_after, None
                server.received.set()
                if server.hold is not None:
                    server.hold.wait(WAIT)
                body = server.files.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                start = 0
                if (ranged := self.headers.get("Range")) is not None:
                    start = int(ranged.removeprefix("bytes=").rstrip("-"))
                    if start >= len(body):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(body)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                if drop is None:
                    self.wfile.write(body[start:])
                    return
                self.wfile.write(body[start:start + drop])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        if self.hold is not None:
            self.hold.set()
        self.httpd.shutdown()
        self.httpd.server_close()


WEIGHTS = fake_gguf(3)
WEIGHTS_SHA = hashlib.sha256(WEIGHTS).hexdigest()


@pytest.fixture
def http() -> Iterator[FileServer]:
    server = FileServer({"/w/weights.gguf": WEIGHTS})
    yield server
    server.close()


def test_interrupted_download_keeps_the_partial_and_resumes_with_range(http: FileServer, tmp_path: Path) -> None:
    uri = f"{http.url}/w/weights.gguf"
    http.drop_after = 100_000
    with pytest.raises(FetchError, match="weights.gguf"):
        fetch_model(uri, tmp_path, sha256=WEIGHTS_SHA, timeout=WAIT)
    assert not (tmp_path / WEIGHTS_SHA).exists()
    partial = tmp_path / ".partial" / WEIGHTS_SHA / "weights.gguf"
    kept = partial.stat().st_size
    assert 0 < kept <= 100_000
    result = fetch_model(uri, tmp_path, sha256=WEIGHTS_SHA, timeout=WAIT)
    assert http.gets == [("/w/weights.gguf", None), ("/w/weights.gguf", f"bytes={kept}-")]
    assert (result.downloaded, result.sha256, sha256_file(result.path)) == (True, WEIGHTS_SHA, WEIGHTS_SHA)
    assert result.path == tmp_path / WEIGHTS_SHA / "weights.gguf"
    assert not partial.exists()


def test_second_fetch_of_a_digest_downloads_nothing(http: FileServer, tmp_path: Path) -> None:
    uri = f"{http.url}/w/weights.gguf"
    first = fetch_model(uri, tmp_path, sha256=WEIGHTS_SHA, timeout=WAIT)
    second = fetch_model(uri, tmp_path, sha256=WEIGHTS_SHA, timeout=WAIT)
    assert len(http.gets) == 1
    assert (first.downloaded, second.downloaded, second.path) == (True, False, first.path)


def test_concurrent_fetches_of_a_digest_download_once(http: FileServer, tmp_path: Path) -> None:
    uri = f"{http.url}/w/weights.gguf"
    http.hold = threading.Event()
    results: dict[str, object] = {}

    def fetch(name: str) -> None:
        try:
            results[name] = fetch_model(uri, tmp_path, sha256=WEIGHTS_SHA, timeout=WAIT)
        except BaseException as e:  # noqa: BLE001 (reported by the assertion below)
            results[name] = e

    first = threading.Thread(target=fetch, args=("first",))
    first.start()
    assert http.received.wait(WAIT)  # the first fetcher holds the lock and waits on the server
    second = threading.Thread(target=fetch, args=("second",))
    second.start()
    second.join(0.5)  # room for it to reach the lock; without one it would send a second GET meanwhile
    assert second.is_alive() and len(http.gets) == 1
    http.hold.set()
    first.join(WAIT)
    second.join(WAIT)
    assert len(http.gets) == 1
    a, b = results["first"], results["second"]
    assert not isinstance(a, BaseException) and not isinstance(b, BaseException), results
    assert a.path == b.path == tmp_path / WEIGHTS_SHA / "weights.gguf"
    assert (a.downloaded, b.downloaded) == (True, False)


def test_http_error_status_is_named(http: FileServer, tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="HTTP 404"):
        fetch_model(f"{http.url}/w/missing.gguf", tmp_path, sha256=WEIGHTS_SHA, timeout=WAIT)
    assert not (tmp_path / WEIGHTS_SHA).exists()


def test_http_digest_mismatch_deletes_the_download(http: FileServer, tmp_path: Path) -> None:
    wrong = "0" * 64
    with pytest.raises(DigestMismatch, match=f"expected sha256 {wrong}, got {WEIGHTS_SHA}"):
        fetch_model(f"{http.url}/w/weights.gguf", tmp_path, sha256=wrong, timeout=WAIT)
    assert not (tmp_path / wrong).exists() and not (tmp_path / WEIGHTS_SHA).exists()
    assert not (tmp_path / ".partial" / wrong).exists()


# --- local paths ---


def test_local_file_is_verified_in_place_not_copied(tmp_path: Path) -> None:
    weights = tmp_path / "w.gguf"
    weights.write_bytes(WEIGHTS)
    cache = tmp_path / "cache"
    result = fetch_model(f"file://{weights}", cache, sha256=WEIGHTS_SHA)
    assert (result.path, result.downloaded, result.sha256) == (weights, False, WEIGHTS_SHA)
    assert fetch_model(str(weights), cache).sha256 == WEIGHTS_SHA
    assert not cache.exists()
    with pytest.raises(DigestMismatch, match=str(weights)):
        fetch_model(str(weights), cache, sha256="0" * 64)
    with pytest.raises(ValueError, match="pvc://claim/w.gguf.*mounted"):
        fetch_model("pvc://claim/w.gguf", cache, sha256=WEIGHTS_SHA)


# --- the CLI ---


def fetch_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "inferplane.cli", "fetch-model", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_prints_the_cached_path(s3: SimpleNamespace, tmp_path: Path) -> None:
    args = ("--uri", f"s3://{BUCKET}/gguf/tiny.gguf", "--sha256", s3.gguf_sha, "--cache-dir", str(tmp_path),
            "--s3-endpoint-url", s3.endpoint, "--termination-log", str(tmp_path / "termination-log"))
    done = fetch_cli(*args)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / s3.gguf_sha / "tiny.gguf")
    assert done.stderr.startswith("fetched 0.2 MiB in ") and ", verified in " in done.stderr
    again = fetch_cli(*args)
    assert again.stdout == done.stdout and again.stderr.startswith("cached: 0.2 MiB")
    assert not (tmp_path / "termination-log").exists()


def test_cli_mismatch_exits_1_with_one_line_also_in_the_termination_log(http: FileServer, tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    done = fetch_cli("--uri", f"{http.url}/w/weights.gguf", "--sha256", "0" * 64, "--cache-dir", str(tmp_path / "c"),
                     "--termination-log", str(log))
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "digest mismatch" in lines[0] and WEIGHTS_SHA in lines[0]
    assert log.read_text() == lines[0] + "\n"


def test_s3_object_resumes_from_its_partial_file(s3: SimpleNamespace, tmp_path: Path) -> None:
    uri = f"s3://{BUCKET}/gguf/tiny.gguf"
    partial = tmp_path / ".partial" / s3.gguf_sha / "tiny.gguf"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"X" * 1000)  # a garbled prefix: only a ranged GET keeps it, and then the digest is off
    with pytest.raises(DigestMismatch):
        fetch_model(uri, tmp_path, sha256=s3.gguf_sha, s3_endpoint_url=s3.endpoint)
    assert not partial.exists() and not (tmp_path / s3.gguf_sha).exists()
    partial.parent.mkdir(parents=True)
    partial.write_bytes(s3.gguf[:1000])  # the right prefix: resumed to the right bytes
    result = fetch_model(uri, tmp_path, sha256=s3.gguf_sha, s3_endpoint_url=s3.endpoint)
    assert sha256_file(result.path) == s3.gguf_sha and result.downloaded
