"""Language-model data from any text: ``--dataset text-lm:PATH`` (a UTF-8 or any other file,
read as bytes) or ``--dataset text-lm`` (a corpus this module writes itself, no download).

Tokens are the file's bytes (a vocabulary of 256: every file is valid, whatever its
language or encoding). The first 90% of the bytes train and the last 10% test, so the
test text is text the model has not seen. An example is ``--seq-len`` tokens and its
target the same positions one byte on (the next token at every position); examples
tile the text without overlap.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.data import TensorDataset

from paratrain.data.spec import DataSpec, Splits
from paratrain.errors import ConfigError

if TYPE_CHECKING:
    from paratrain.config import TrainConfig

VOCAB = 256
TEST_SHARE = 0.1
CORPUS_BYTES = 400_000


def load_text_lm(config: TrainConfig, argument: str | None = None) -> Splits:
    """Splits of ``path``'s bytes (the built-in corpus when None) into examples of ``config.seq_len``."""
    path, seq_len = argument, config.seq_len
    what = f"--dataset text-lm:{path}" if path else "--dataset text-lm"
    data = _read(path, what) if path else builtin_corpus()
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    cut = int(len(tokens) * (1 - TEST_SHARE))
    train, test = _examples(tokens[:cut], seq_len), _examples(tokens[cut:], seq_len)
    if train is None or test is None:
        raise ConfigError(
            f"{what}: {len(tokens)} bytes give no {'test' if train else 'training'} example of --seq-len "
            f"{seq_len} (the last {TEST_SHARE:.0%} is the test text); give more text or a shorter --seq-len"
        )
    return Splits(
        train=train,
        test=test,
        spec=DataSpec(
            input_shape=(seq_len,), num_classes=VOCAB, input_kind="tokens", vocab_size=VOCAB, per_position=True
        ),
    )


def _read(path: str, what: str) -> bytes:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{what}: no such file (give a text file: its bytes are the tokens)")
    return file.read_bytes()


def _examples(tokens: torch.Tensor, seq_len: int) -> TensorDataset | None:
    """Windows of ``seq_len`` tokens and the next token at each of their positions."""
    count = (len(tokens) - 1) // seq_len
    if count < 1:
        return None
    used = count * seq_len
    return TensorDataset(tokens[:used].view(count, seq_len), tokens[1 : used + 1].view(count, seq_len))


_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the teacher", "a small bird", "the farmer", "our team"]
_VERBS = ["sees", "likes", "finds", "carries", "paints", "follows", "remembers", "builds"]
_OBJECTS = ["the red ball", "a green house", "the long road", "a quiet river", "the tall tree", "an old book"]
_PLACES = ["in the garden", "near the sea", "at school", "on the hill", "after dinner", "every morning"]


def builtin_corpus(size: int = CORPUS_BYTES) -> bytes:
    """``size`` bytes of simple English sentences from a fixed grammar and seed: the same
    text on every machine, with structure a small model learns within an epoch or two
    (words, agreement, punctuation, paragraphs)."""
    rng = random.Random(0)
    out: list[str] = []
    length = 0
    while length < size:
        subject = rng.choice(_SUBJECTS)
        verb = rng.choice(_VERBS)
        thing = rng.choice(_OBJECTS)
        sentence = f"{subject} {verb} {thing}"
        if rng.random() < 0.5:
            sentence += f" {rng.choice(_PLACES)}"
        sentence = sentence[0].upper() + sentence[1:] + rng.choice([".", ".", ".", "!"])
        sentence += "\n\n" if rng.random() < 0.1 else " "
        out.append(sentence)
        length += len(sentence)
    return "".join(out).encode()[:size]
