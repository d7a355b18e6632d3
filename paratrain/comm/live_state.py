"""How a replica that (re)joins a running ``allreduce-ft`` job gets the live state from a
peer: torchft's HTTP checkpoint transport, with two changes a training library owes its
users.

- What arrives is read with ``weights_only=True``: a peer sends tensors and plain values
  (dicts, lists, numbers, strings), never code; torchft's own transport unpickles
  anything (``weights_only=False``).
- The address a peer fetches from names the host this replica was told it is reachable at
  (``PARATRAIN_REPLICA_HOST``, 127.0.0.1 for local runs), not ``gethostname()``, which
  need not resolve from the other machines (or at all).

The transfer never touches the survivors' gradient process group: a failed transfer costs
the joiner its step, never theirs.
"""

from __future__ import annotations

import urllib.request
import warnings
from datetime import timedelta
from typing import Any

import torch
from torch.distributed._serialization import _streaming_load
from torch.utils._pytree import tree_map_only
from torchft.checkpointing.http_transport import HTTPTransport


class LiveStateTransport(HTTPTransport):
    """torchft's ``HTTPTransport`` that advertises ``host`` and loads with ``weights_only=True``."""

    def __init__(self, timeout: timedelta, host: str):
        self.host = host  # before the server starts: it logs its address
        super().__init__(timeout, num_chunks=0)
        # The server's handler would log every request on stderr.
        self._server.RequestHandlerClass.log_message = _quiet

    def address(self) -> str:
        port = self._server.socket.getsockname()[1]
        return f"http://{self.host}:{port}/checkpoint/"

    @classmethod
    def _load_from_address(cls, address: str, timeout: timedelta) -> Any:
        with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as response:
            with warnings.catch_warnings():  # made over the response's read-only buffer: copied below
                warnings.simplefilter("ignore", UserWarning)
                state = _streaming_load(response, weights_only=True)
        # Tensors of their own: an optimizer's load_state_dict keeps the tensors it is given
        # (momentum buffers), which are then updated in place.
        return tree_map_only(torch.Tensor, torch.Tensor.clone, state)


def _quiet(handler: Any, format: str, *args: Any) -> None:
    pass
