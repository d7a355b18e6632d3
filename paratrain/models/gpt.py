"""A small decoder-only transformer (GPT-2's layout) for ``--model gpt``.

Token and position embeddings, ``--gpt-layers`` pre-norm blocks (causal self-attention
through ``scaled_dot_product_attention``, then a 4x MLP with GELU), a final LayerNorm and
an output layer tied to the token embedding, as GPT-2 and most language models tie them.
The model is an ``nn.Sequential`` (embeddings, blocks, head) whose blocks are named in
``_no_split_modules``, so fsdp shards it block by block as it does a Hugging Face model.
Its outputs are next-token logits ``(batch, positions, vocabulary)``; the ``text-lm``
data (``data/text_lm.py``) gives each position's next token as its target.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.data.spec import DataSpec
from paratrain.errors import ConfigError
from paratrain.models.gpt_config import GPTConfig


class Embeddings(nn.Module):
    def __init__(self, vocab: int, context: int, width: int, dropout: float):
        super().__init__()
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[-1], device=ids.device)
        return self.dropout(self.token(ids) + self.position(positions))


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.head_width = width // heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The heads are counted from the projection's width: split by tensor parallelism,
        # a process holds some of them (paratrain/parallel/tensor.py).
        # The positions are counted from the projection too: under sequence parallelism x
        # holds a process's positions, the projection (which gathers them first) all of them.
        qkv = self.qkv(x)
        batch, length = qkv.shape[:2]
        q, k, v = qkv.view(batch, length, 3, -1, self.head_width).permute(2, 0, 3, 1, 4)
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, length, -1))


class GPTBlock(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads, dropout)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.norm1(x)))
        return x + self.dropout(self.mlp(self.norm2(x)))


class LMHead(nn.Module):
    """The final norm and the output layer, whose weight is the token embedding's. The
    output layer is an ``nn.Linear`` holding the embedding's weight, (vocabulary, width):
    tensor parallelism splits a Linear's output features and an embedding's rows by that
    same first dimension, so the tied weight is split alike in both and stays one parameter."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.norm = nn.LayerNorm(embedding.embedding_dim)
        width, vocab = embedding.embedding_dim, embedding.num_embeddings
        self.output = nn.Linear(width, vocab, bias=False, device="meta")  # its own weight never made
        self.output.weight = embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x))

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # A state dict written while the head held the weight itself names it "weight".
        if prefix + "weight" in state_dict and prefix + "output.weight" not in state_dict:
            state_dict[prefix + "output.weight"] = state_dict.pop(prefix + "weight")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class GPT(nn.Sequential):
    _no_split_modules = ["GPTBlock"]
    _tp_plan = {  # how tensor parallelism splits it (parallel/tensor.py)
        "*.token": "rowwise",  # the vocabulary's rows, as the tied output layer splits them
        "*.attention.qkv": "colwise:3",
        "*.attention.out": "rowwise",
        "*.mlp.0": "colwise",
        "*.mlp.2": "rowwise",
        "*.output": "colwise_rep",  # the logits: split by vocabulary for the loss (parallel/vocabulary.py)
        # --sequence-parallel (parallel/sequence.py): the embeddings' output split by position,
        # the norms run on each process's positions
        "0": "split_sequence",
        "*.norm1": "sequence",
        "*.norm2": "sequence",
        "*.norm": "sequence",
    }

    def __init__(self, vocab: int, context: int, sizes: GPTConfig):
        embeddings = Embeddings(vocab, context, sizes.gpt_width, sizes.gpt_dropout)
        blocks = [GPTBlock(sizes.gpt_width, sizes.gpt_heads, sizes.gpt_dropout) for _ in range(sizes.gpt_layers)]
        super().__init__(embeddings, *blocks, LMHead(embeddings.token))
        self.context = context
        self._initialise(sizes.gpt_layers)

    def _initialise(self, layers: int) -> None:
        """GPT-2's: weights N(0, 0.02), biases zero, each block's projections back into the
        residual stream scaled by 1/sqrt(2 x layers) so that its variance does not grow with depth."""
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif param.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("attention.out.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(param, std=std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[-1] > self.context:
            raise ValueError(f"gpt: {ids.shape[-1]} tokens, more than its context of {self.context}")
        return super().forward(ids)


def build_gpt(spec: DataSpec, sizes: GPTConfig | None = None) -> nn.Module:
    """A GPT for token data: its vocabulary and context from ``spec``, its sizes from ``--gpt-*``."""
    if spec.input_kind != "tokens" or not spec.per_position:
        raise ConfigError(
            "model gpt predicts the next token at every position: use --dataset text-lm (or text-lm:PATH), "
            f"not data of {spec.input_kind} with one label per example"
        )
    sizes = sizes or GPTConfig()
    sizes.check()
    return GPT(spec.vocab_size, spec.input_shape[0], sizes)
