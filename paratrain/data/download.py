"""Fetching data set files: resumable HTTP downloads checked against SHA-256.

A file is downloaded to ``NAME.part`` next to its destination. When a ``.part`` is
already there (an interrupted download), the request asks for the rest with an HTTP
``Range`` header and appends; a server that ignores the range sends everything and
the file starts over. Only a file whose size and SHA-256 match the published ones is
renamed to its final name, so a half-written or tampered file is never read as data.

Several processes of one run may ask for the same files at once (torchrun starts
every rank with the same command): a lock file in the data directory lets the first
download while the others wait and then find the files in place.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from paratrain.errors import ConfigError

CHUNK = 1 << 20
TIMEOUT_SECONDS = 30.0


@dataclass(frozen=True)
class Remote:
    """A file of a data set as its publisher serves it."""

    name: str
    urls: tuple[str, ...]
    """Where to get it, tried in order (the canonical location first, then mirrors)."""
    sha256: str
    size: int


class DownloadFailed(Exception):
    """The network or the server did not deliver the file (not a corrupt file: see ConfigError)."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(remote: Remote, directory: Path, progress: object | None = None) -> Path:
    """Download ``remote`` into ``directory`` (resuming a ``.part``); its final path.

    Raises DownloadFailed when no URL could be read, and ConfigError when the
    bytes received do not have the published size and SHA-256 (the ``.part`` is
    deleted, so that the next attempt starts clean).
    """
    target = directory / remote.name
    partial = directory / (remote.name + ".part")
    errors = []
    for url in remote.urls:
        try:
            _download(url, partial, remote.size, progress)
            break
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as error:
            # The .part keeps what arrived: the next attempt asks for the rest.
            errors.append(f"{url}: {getattr(error, 'reason', None) or error}")
    else:
        raise DownloadFailed("; ".join(errors))
    size, digest = partial.stat().st_size, sha256_of(partial)
    if size != remote.size or digest != remote.sha256:
        partial.unlink()
        raise ConfigError(
            f"downloaded {remote.name} has {size} bytes and SHA-256 {digest}, expected "
            f"{remote.size} bytes and {remote.sha256}; deleted it, run again to retry"
        )
    os.replace(partial, target)
    return target


def _download(url: str, partial: Path, size: int, progress: object | None) -> None:
    have = partial.stat().st_size if partial.exists() else 0
    if have >= size:  # an overlong or finished .part: the hash check decides
        return
    request = urllib.request.Request(url, headers={"User-Agent": "paratrain"})
    if have:
        request.add_header("Range", f"bytes={have}-")
    with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as response:
        resumed = have > 0 and response.status == 206
        mode = "ab" if resumed else "wb"
        done = have if resumed else 0
        task = progress.add_task(partial.name.removesuffix(".part"), total=size, completed=done) if progress else None
        with open(partial, mode) as handle:
            for block in iter(lambda: response.read(CHUNK), b""):
                handle.write(block)
                if task is not None:
                    progress.advance(task, len(block))
    got = partial.stat().st_size
    if got < size:  # http.client returns a short body, not an error, when the peer hangs up
        raise ConnectionError(f"connection closed after {got} of {size} bytes")


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold ``directory/.download.lock`` (exclusive, across processes) for the block."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on POSIX: no lock, one process downloads
        yield
        return
    with open(directory / ".download.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_files(
    directory: Path,
    needed: Callable[[], Sequence[Remote]],
    *,
    dataset: str,
    expected: str,
    allowed: bool = True,
    unpack: Callable[[], None] | None = None,
) -> None:
    """Download what ``needed()`` lists into ``directory`` (progress bar on stderr), then
    ``unpack()``; nothing when ``needed()`` is empty.

    ``expected`` says in words which files the reader needs, for the error raised
    when downloads are off (``--no-download``) or the network does not allow one.
    """
    remotes = needed()
    if not remotes:
        return
    absent = [r.name for r in remotes if not (directory / r.name).is_file()]
    if absent and not allowed:
        raise offline_error(
            dataset, directory, expected, remotes, f"{', '.join(absent)} not found and --no-download is set"
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise offline_error(
            dataset, directory, expected, remotes, f"cannot create {directory} ({error.strerror})"
        ) from None
    with locked(directory):
        # Another process of the run may have done the work while this one waited.
        remotes = needed()
        if not remotes:
            return
        try:
            with _progress() as progress:
                for remote in remotes:
                    if not (directory / remote.name).is_file():
                        fetch(remote, directory, progress)
        except DownloadFailed as error:
            names = ", ".join(r.name for r in remotes)
            raise offline_error(dataset, directory, expected, remotes, f"cannot download {names} ({error})") from None
        if unpack is not None:
            unpack()


def offline_error(dataset: str, directory: Path, expected: str, remotes: Sequence[Remote], reason: str) -> ConfigError:
    """The one-line error that says which files to put where."""
    sources = ", ".join(sorted({url.rsplit("/", 1)[0] + "/" for r in remotes for url in r.urls[:1]}))
    return ConfigError(
        f"{dataset}: {reason}; put {expected} in {directory} (or pass --data-dir); they are published at {sources}"
    )


class _Bars:
    """A rich progress bar on stderr (like curl and pip: stdout stays the run's log),
    started by the first byte that arrives, so that a download that never starts
    prints nothing besides its error line."""

    def __init__(self) -> None:
        self.progress = None

    def add_task(self, description: str, total: int, completed: int = 0) -> int:
        if self.progress is None:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self.progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self.progress.start()
        return self.progress.add_task(description, total=total, completed=completed)

    def advance(self, task: int, amount: int) -> None:
        self.progress.advance(task, amount)


@contextlib.contextmanager
def _progress() -> Iterator[_Bars]:
    bars = _Bars()
    try:
        yield bars
    finally:
        if bars.progress is not None:
            bars.progress.stop()
