"""Downloads against a local HTTP server on 127.0.0.1 (no test touches the network):
SHA-256 checks, resuming with HTTP Range, the offline error, and the archive unpacking."""

import hashlib
import http.server
import io
import tarfile
import threading

import pytest

import paratrain.data.cifar as cifar
import paratrain.data.idx as idx
from paratrain.comm.transport import free_port
from paratrain.config import TrainConfig
from paratrain.data.download import DownloadFailed, Remote, ensure_files, fetch
from paratrain.errors import ConfigError
from paratrain.testing import write_cifar10, write_fashion_mnist


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        server = self.server
        server.requests.append((self.path, self.headers.get("Range")))
        data = server.files.get(self.path)
        if data is None:
            self.send_error(404)
            return
        start = 0
        ranged = self.headers.get("Range")
        if ranged and server.honour_range:
            start = int(ranged.removeprefix("bytes=").rstrip("-"))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if server.cut_after is not None:  # a connection that drops mid-file, once
            body, server.cut_after = body[: server.cut_after], None
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.files = {}
    httpd.requests = []
    httpd.honour_range = True
    httpd.cut_after = None
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def _remote(server, name, data, **changes):
    server.files[f"/{name}"] = data
    fields = {"urls": (f"{server.url}/{name}",), "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    return Remote(name, **{**fields, **changes})


def test_fetch_checks_the_hash_and_renames(server, tmp_path):
    data = bytes(range(256)) * 100
    path = fetch(_remote(server, "f.bin", data), tmp_path)
    assert path == tmp_path / "f.bin" and path.read_bytes() == data
    assert not (tmp_path / "f.bin.part").exists()


def test_a_dropped_connection_resumes_with_a_range_request(server, tmp_path):
    data = bytes(range(256)) * 100
    remote = _remote(server, "f.bin", data)
    server.cut_after = 5000
    with pytest.raises(DownloadFailed):
        fetch(remote, tmp_path)
    assert (tmp_path / "f.bin.part").stat().st_size == 5000
    fetch(remote, tmp_path)
    assert (tmp_path / "f.bin").read_bytes() == data
    assert server.requests[-1] == ("/f.bin", "bytes=5000-")


def test_a_server_that_ignores_range_starts_over(server, tmp_path):
    data = b"x" * 3000
    (tmp_path / "f.bin.part").write_bytes(b"garbage!")
    server.honour_range = False
    fetch(_remote(server, "f.bin", data), tmp_path)
    assert (tmp_path / "f.bin").read_bytes() == data


def test_a_hash_mismatch_deletes_the_download(server, tmp_path):
    remote = _remote(server, "f.bin", b"tampered", sha256="0" * 64)
    with pytest.raises(ConfigError, match="downloaded f.bin has 8 bytes and SHA-256 .* expected 8 bytes and 0000"):
        fetch(remote, tmp_path)
    assert not (tmp_path / "f.bin").exists() and not (tmp_path / "f.bin.part").exists()


def test_file_urls_work_and_are_checked(tmp_path):
    source = tmp_path / "source.bin"
    source.write_bytes(b"payload")
    remote = Remote("copy.bin", (source.as_uri(),), hashlib.sha256(b"payload").hexdigest(), 7)
    (tmp_path / "out").mkdir()
    assert fetch(remote, tmp_path / "out").read_bytes() == b"payload"
    bad = Remote("bad.bin", (source.as_uri(),), hashlib.sha256(b"other").hexdigest(), 7)
    with pytest.raises(ConfigError, match="SHA-256"):
        fetch(bad, tmp_path / "out")


def test_unreachable_server_is_the_offline_error(tmp_path):
    remote = Remote("f.bin", (f"http://127.0.0.1:{free_port()}/f.bin",), "0" * 64, 1)
    with pytest.raises(ConfigError) as error:
        ensure_files(tmp_path / "d", lambda: [remote], dataset="demo", expected="f.bin (the demo file)")
    message = str(error.value)
    assert message.startswith("demo: cannot download f.bin (http://127.0.0.1:")
    assert f"put f.bin (the demo file) in {tmp_path / 'd'} (or pass --data-dir)" in message
    assert "\n" not in message


def test_fashion_mnist_downloads_every_missing_file(server, tmp_path, monkeypatch):
    write_fashion_mnist(tmp_path / "published", 12, 6)
    remotes = tuple(
        _remote(server, r.name, (tmp_path / "published" / r.name).read_bytes()) for r in idx.FASHION_MNIST_REMOTES
    )
    monkeypatch.setattr(idx, "FASHION_MNIST_REMOTES", remotes)
    splits = idx.load_fashion_mnist(TrainConfig(dataset="fashion-mnist", data_dir=str(tmp_path / "data")))
    assert (len(splits.train), len(splits.test)) == (12, 6)
    assert len(server.requests) == 4
    idx.load_fashion_mnist(TrainConfig(dataset="fashion-mnist", data_dir=str(tmp_path / "data")))
    assert len(server.requests) == 4  # present files are not fetched again


def test_cifar10_downloads_and_unpacks_only_the_expected_files(server, tmp_path, monkeypatch):
    folder = write_cifar10(tmp_path / "published", per_batch=3, num_test=2)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in sorted(folder.iterdir()):
            tar.add(path, arcname=f"cifar-10-batches-bin/{path.name}")
        evil = tarfile.TarInfo("cifar-10-batches-bin/../../evil.bin")
        tar.addfile(evil, io.BytesIO(b""))
    monkeypatch.setattr(cifar, "ARCHIVE", _remote(server, "cifar-10-binary.tar.gz", buffer.getvalue()))
    root = tmp_path / "data"
    splits = cifar.load_cifar10(TrainConfig(dataset="cifar10", data_dir=str(root)))
    assert (len(splits.train), len(splits.test)) == (15, 2)
    assert sorted(p.name for p in (root / "cifar-10-batches-bin").iterdir()) == sorted(p.name for p in folder.iterdir())
    assert not (root / "cifar-10-binary.tar.gz").exists()  # unpacked, then removed
    assert not (tmp_path / "evil.bin").exists()
