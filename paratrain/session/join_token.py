"""The join token of a parameter-server run: the secret a worker proves it knows before a
running ps-async or ps-backup run lets it in (``--join``).

A local launch makes one per run (``PARATRAIN_JOIN_TOKEN`` in its processes' environment,
never in the store); a run under torchrun, or one whose scheduler injects a secret, takes
it from ``--join-token-file`` or that variable, the same on every process. The chief
prints it with the join line and saves it in a file only its owner can read. Each shard
asks a joiner a fresh random challenge; the joiner answers with the HMAC-SHA256 of the
challenge under the token, bound to the run, its worker number and the shard, so that the
token itself never crosses the network and an answer is good for that one shard once.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from paratrain.errors import ConfigError

JOIN_TOKEN_ENV = "PARATRAIN_JOIN_TOKEN"
HANDSHAKE_S = 10.0
"""How long a shard waits for a joiner's answer to its challenge: the answer is one store
round trip away, so a joiner that has not answered by then holds no later joiner up."""


def read_join_token(path: str | None) -> str | None:
    """The token in the file ``path`` (its first line), else ``PARATRAIN_JOIN_TOKEN``'s;
    None where there is neither. ConfigError for a file that cannot be read or is empty."""
    if path is not None:
        try:
            lines = Path(path).expanduser().read_text().strip().splitlines()
        except (OSError, UnicodeDecodeError) as error:
            reason = getattr(error, "strerror", None) or "not text"
            raise ConfigError(f"--join-token-file {path}: cannot read it ({reason})") from None
        if not lines or not lines[0].strip():
            raise ConfigError(f"--join-token-file {path} is empty: it holds the run's join token (one line)")
        return lines[0].strip()
    return os.environ.get(JOIN_TOKEN_ENV) or None


def new_join_token() -> str:
    return secrets.token_urlsafe(24)


def challenge() -> str:
    return secrets.token_hex(16)


def proof(token: str, run: str, who: int | str, shard: int, asked: str) -> str:
    """The answer to challenge ``asked`` of ``shard`` in run ``run`` for joiner ``who``."""
    message = f"paratrain-join|{run}|{who}|{shard}|{asked}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def proves(token: str, run: str, who: int | str, shard: int, asked: str, answer: str) -> bool:
    return hmac.compare_digest(proof(token, run, who, shard, asked), answer)


def save_join_token(token: str, path: Path) -> Path:
    """Write ``token`` to ``path``, readable and writable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(descriptor, 0o600)  # an older file of that name keeps its mode otherwise
        os.write(descriptor, (token + "\n").encode())
    finally:
        os.close(descriptor)
    return path
