"""Text classification from folders of .txt files (the IMDB layout).

    DATA_DIR/train/<class>/*.txt      one document per file, one folder per class
    DATA_DIR/test/<class>/*.txt       the same classes

Class labels are the folder names in sorted order. Text is lower-cased, HTML tags
(IMDB's ``<br />``) become spaces, and words are runs of letters and digits with
inner apostrophes. The vocabulary is built on the training split only, so that the
test split holds words the model has never seen, as in use.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.data import TensorDataset

from paratrain.data.datasets import DataSpec, Splits
from paratrain.errors import ConfigError

if TYPE_CHECKING:
    from paratrain.config import TrainConfig

PAD, UNKNOWN = 0, 1
_TAG = re.compile(r"<[^>]*>")
_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)*")
LAYOUT = "train/ and test/, each with one folder of .txt files per class"


def tokenize(text: str) -> list[str]:
    """Lower-cased words: ``"It's <br />GOOD."`` -> ``["it's", "good"]``."""
    return _WORD.findall(_TAG.sub(" ", text.lower()))


class Vocabulary:
    """Word <-> id. Id 0 pads, id 1 stands for every word outside the vocabulary, then
    the most frequent training words (ties in alphabetical order, so that the ids do
    not depend on the order files were read)."""

    def __init__(self, words: Sequence[str]):
        self.words = ["<pad>", "<unk>", *words]
        self.ids = {word: i for i, word in enumerate(self.words)}

    @classmethod
    def build(cls, documents: Iterable[list[str]], size: int) -> Vocabulary:
        """The ``size - 2`` most frequent words of ``documents`` (plus padding and unknown)."""
        counts: Counter[str] = Counter()
        for words in documents:
            counts.update(words)
        ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
        return cls([word for word, _ in ranked[: max(size - 2, 0)]])

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, words: Sequence[str], length: int) -> list[int]:
        """Ids of ``words``, cut or padded to ``length``.

        Padding and cutting happen at the front (Keras' ``pad_sequences`` defaults):
        the classifier reads the LSTM's last output, which then always follows the
        document's last words rather than a run of padding.
        """
        ids = [self.ids.get(word, UNKNOWN) for word in words[-length:]]
        return [PAD] * (length - len(ids)) + ids


def class_folders(split: Path) -> list[str]:
    classes = sorted(p.name for p in split.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise ConfigError(f"text data: {split} has no class folders; expected one folder of .txt files per class")
    return classes


def read_documents(split: Path, classes: Sequence[str]) -> tuple[list[list[str]], list[int]]:
    """Tokenized documents of ``split`` and their labels (index in ``classes``)."""
    documents, labels = [], []
    for label, name in enumerate(classes):
        files = sorted((split / name).glob("*.txt"))
        if not files:
            raise ConfigError(f"text data: {split / name} has no .txt files")
        for path in files:
            try:
                text = path.read_bytes().decode("utf-8")
            except UnicodeDecodeError as error:
                raise ConfigError(
                    f"{path}: not UTF-8 text (byte 0x{error.object[error.start]:02x} at offset {error.start})"
                ) from None
            except OSError as error:
                raise ConfigError(f"{path}: cannot read ({error.strerror})") from None
            documents.append(tokenize(text))
            labels.append(label)
    return documents, labels


def encode(documents: Sequence[list[str]], labels: Sequence[int], vocabulary: Vocabulary, length: int) -> TensorDataset:
    ids = torch.tensor([vocabulary.encode(words, length) for words in documents], dtype=torch.long)
    return TensorDataset(ids.reshape(len(documents), length), torch.tensor(labels, dtype=torch.long))


def load_text(config: TrainConfig) -> Splits:
    """Token ids ``(N, max_len)`` from ``--data-dir``; vocabulary of ``--vocab-size`` words."""
    if config is None or not config.data_dir:
        raise ConfigError(f"--dataset text needs --data-dir: a folder with {LAYOUT}")
    root = Path(config.data_dir).expanduser()
    if not root.is_dir():
        raise ConfigError(f"--data-dir {root}: no such directory; expected a folder with {LAYOUT}")
    for split in (root / "train", root / "test"):
        if not split.is_dir():
            raise ConfigError(f"text data: {split} is not a directory; expected {root} to hold {LAYOUT}")
    train_classes, test_classes = class_folders(root / "train"), class_folders(root / "test")
    if train_classes != test_classes:
        raise ConfigError(
            f"text data dir {root}/train has classes {train_classes} but test has {test_classes}; "
            "both need the same class folders (IMDB: remove train/unsup, which is unlabelled)"
        )
    if len(train_classes) < 2:
        raise ConfigError(f"text data dir {root}: one class ({train_classes[0]}); a classifier needs at least two")
    train_docs, train_labels = read_documents(root / "train", train_classes)
    test_docs, test_labels = read_documents(root / "test", test_classes)
    vocabulary = Vocabulary.build(train_docs, config.vocab_size)
    return Splits(
        train=encode(train_docs, train_labels, vocabulary, config.max_len),
        test=encode(test_docs, test_labels, vocabulary, config.max_len),
        spec=DataSpec((config.max_len,), len(train_classes), input_kind="tokens", vocab_size=len(vocabulary)),
        classes=tuple(train_classes),
        vocabulary=vocabulary,
    )
