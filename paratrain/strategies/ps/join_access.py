"""Whether and how workers join a running ps-async or ps-backup run, as the run's own
processes see it: the join token the shards check (session/join_token.py), whether the
shards admit joiners (``--no-joiners``: no; a run with no token admits none either),
and the chief's word of it: the join line, and the token saved where only its owner reads it."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paratrain.session.join_token import read_join_token, save_join_token


@dataclass
class JoinAccess:
    token: str | None
    """The run's join token (a joiner's: the one it proves); None where there is none."""
    open: bool
    """Whether the shards admit joiners: the mode takes them, --joiners, and a token."""
    token_file: str | None = None
    """Where the token came from, when it came from a file (--join-token-file)."""
    saved: Path | None = field(default=None, init=False)
    """The file the chief saved the token in (removed when the run is over: ``close``)."""

    @classmethod
    def of(cls, admits_joiners: bool, config: Any) -> JoinAccess:
        """For a run of a mode that ``admits_joiners`` (or not), with ``config`` (PSConfig)."""
        if not admits_joiners:
            return cls(None, False)
        token = read_join_token(config.join_token_file)
        return cls(token, bool(config.joiners and token), config.join_token_file)

    def key(self, run: str) -> tuple[str, str] | None:
        """What a shard checks joiners' proofs with in run ``run`` (its store prefix); None: it admits none."""
        return (self.token, run) if self.open and self.token else None

    def announce(self, address: str, folder: Path | None) -> None:
        """The chief's lines: how to join (the token saved in ``folder``, default
        ~/.cache/paratrain/join-tokens), or why no worker can."""
        if not self.open:
            if self.token is None:
                print(
                    "paratrain: no worker can join this run: it has no join token (give every process "
                    "--join-token-file FILE or PARATRAIN_JOIN_TOKEN, the same secret, to let workers join)",
                    flush=True,
                )
            return
        path = self.token_file
        if path is None:
            host, _, port = address.rpartition(":")
            base = folder if folder is not None else Path.home() / ".cache" / "paratrain" / "join-tokens"
            self.saved = save_join_token(self.token, base / f"join-token-{host}-{port}")
            path = str(self.saved)
        print(  # flushed: a joiner's launcher may be reading the pipe for it
            f"paratrain: more workers may join this run: paratrain train ... --join {address} --join-token-file {path}",
            flush=True,
        )
        print(
            f"paratrain: the run's join token, a secret for the workers that may join, is {self.token} "
            f"(in {path}, readable by you only)",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        """The run is over: the token file the chief saved goes."""
        if self.saved is not None:
            self.saved.unlink(missing_ok=True)
            self.saved = None


def output_folder(metrics_out: str | None, checkpoint_dir: str | None, logdir: str | None) -> Path | None:
    """The run's output folder: that of its metrics file, else its checkpoints', else its logs'."""
    if metrics_out:
        return Path(metrics_out).expanduser().resolve().parent
    for folder in (checkpoint_dir, logdir):
        if folder:
            return Path(folder).expanduser()
    return None


def say_joined(worker: int, address: str, position: dict[str, int]) -> None:
    """A joiner's line once the shards took it in."""
    print(
        f"paratrain: worker {worker} joined the run at {address} at version {position['version']} "
        f"(epoch {position['epoch'] + 1}) with the shards' current parameters",
        file=sys.stderr,
        flush=True,
    )
