"""Readers of the real file formats (IDX, CIFAR-10 binary records, text folders) and
the one-line errors for files that are missing, truncated or not in their format."""

import numpy as np
import pytest
import torch

from paratrain.config import TrainConfig
from paratrain.data.augment import CifarCentralCrop, CifarDistortions, Rescale
from paratrain.data.cifar import load_cifar10, read_batch
from paratrain.data.datasets import data_dir, load_dataset
from paratrain.data.idx import load_fashion_mnist, read_idx
from paratrain.data.text import Vocabulary, load_text, tokenize
from paratrain.errors import ConfigError
from paratrain.testing import write_cifar10, write_fashion_mnist, write_idx, write_text_folders


def _config(name, path, **extra):
    return TrainConfig(dataset=name, data_dir=str(path), download=False, **extra)


def _error(load, *args):
    with pytest.raises(ConfigError) as error:
        load(*args)
    message = str(error.value)
    assert "\n" not in message
    return message


# ----- IDX / Fashion-MNIST ----------------------------------------------------------------


@pytest.mark.parametrize("compress", [True, False])
def test_fashion_mnist_reads_gzip_and_plain_idx(tmp_path, compress):
    write_fashion_mnist(tmp_path, num_train=30, num_test=20, compress=compress)
    splits = load_fashion_mnist(_config("fashion-mnist", tmp_path))
    assert (len(splits.train), len(splits.test)) == (30, 20)
    assert splits.spec.input_shape == (1, 28, 28) and splits.spec.num_classes == 10
    assert splits.classes[0] == "T-shirt/top" and splits.classes[9] == "Ankle boot"
    images, labels = splits.train.tensors
    assert images.dtype == torch.uint8 and labels.dtype == torch.long
    assert isinstance(splits.train.batch_transform, Rescale)


def test_idx_round_trip_keeps_values_and_shape(tmp_path):
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    path = write_idx(tmp_path / "x-idx3-ubyte.gz", array)
    assert np.array_equal(read_idx(path, 0x803, "images"), array)


def test_wrong_magic_number(tmp_path):
    write_fashion_mnist(tmp_path, 10, 10)
    labels = np.zeros(10, dtype=np.uint8)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", labels)  # a labels file in the images' place
    message = _error(load_fashion_mnist, _config("fashion-mnist", tmp_path))
    assert "train-images-idx3-ubyte.gz: magic number 2049, expected 2051 (IDX images)" in message


def test_truncated_idx(tmp_path):
    write_fashion_mnist(tmp_path, 10, 10, compress=False)
    path = tmp_path / "t10k-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-100])
    message = _error(load_fashion_mnist, _config("fashion-mnist", tmp_path))
    assert f"{path}: truncated: the header promises 10x28x28 = 7840 bytes of images, the file has 7740" in message


def test_truncated_gzip(tmp_path):
    write_fashion_mnist(tmp_path, 10, 10)
    path = tmp_path / "train-labels-idx1-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-12])
    assert "gzip stream is truncated" in _error(load_fashion_mnist, _config("fashion-mnist", tmp_path))


def test_corrupt_gzip(tmp_path):
    write_fashion_mnist(tmp_path, 10, 10)
    path = tmp_path / "train-images-idx3-ubyte.gz"
    data = bytearray(path.read_bytes())
    data[20:40] = b"\xff" * 20
    path.write_bytes(bytes(data))
    assert f"{path}: corrupt gzip data" in _error(load_fashion_mnist, _config("fashion-mnist", tmp_path))


def test_images_and_labels_disagree(tmp_path):
    write_fashion_mnist(tmp_path, 10, 10)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(9, dtype=np.uint8))
    message = _error(load_fashion_mnist, _config("fashion-mnist", tmp_path))
    assert "has 10 images but" in message and "has 9 labels" in message


def test_label_out_of_range(tmp_path):
    write_fashion_mnist(tmp_path, 10, 10)
    labels = np.zeros(10, dtype=np.uint8)
    labels[4] = 12
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", labels)
    assert "label 12 at index 4, expected 0..9" in _error(load_fashion_mnist, _config("fashion-mnist", tmp_path))


def test_missing_files_offline_say_which_files_go_where(tmp_path):
    write_fashion_mnist(tmp_path, 10, 10)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    message = _error(load_fashion_mnist, _config("fashion-mnist", tmp_path))
    assert message.startswith("fashion-mnist: t10k-labels-idx1-ubyte.gz not found and --no-download is set")
    assert f"put these IDX files (gzip or plain) in {tmp_path} (or pass --data-dir)" in message
    assert "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/" in message


def test_default_data_dir_and_paratrain_data(monkeypatch, tmp_path):
    monkeypatch.delenv("PARATRAIN_DATA", raising=False)
    assert str(data_dir(None, "cifar10")).endswith(".cache/paratrain/cifar10")
    monkeypatch.setenv("PARATRAIN_DATA", str(tmp_path))
    assert data_dir(None, "cifar10") == tmp_path / "cifar10"
    assert data_dir(TrainConfig(data_dir="/x"), "cifar10").as_posix() == "/x"


# ----- CIFAR-10 binary -----------------------------------------------------------------------


def test_cifar10_reads_binary_records(tmp_path):
    folder = write_cifar10(tmp_path, per_batch=7, num_test=5)
    raw = (folder / "test_batch.bin").read_bytes()
    splits = load_cifar10(_config("cifar10", tmp_path))
    assert (len(splits.train), len(splits.test)) == (35, 5)
    images, labels = splits.test.tensors
    # record 2: label byte, then 1024 red, 1024 green, 1024 blue bytes, row-major
    record = raw[2 * 3073 : 3 * 3073]
    assert labels[2] == record[0]
    assert images[2, 1, 3, 5] == record[1 + 1024 + 3 * 32 + 5]
    assert splits.spec.input_shape == (3, 24, 24)
    assert isinstance(splits.train.batch_transform, CifarDistortions)
    assert isinstance(splits.test.batch_transform, CifarCentralCrop)
    assert splits.classes[3] == "cat"


def test_cifar10_files_directly_in_the_data_dir(tmp_path):
    folder = write_cifar10(tmp_path / "nested", per_batch=3, num_test=3)
    assert len(load_cifar10(_config("cifar10", folder)).train) == 15


def test_cifar10_record_size_is_checked(tmp_path):
    folder = write_cifar10(tmp_path, per_batch=10, num_test=5)
    path = folder / "data_batch_3.bin"
    path.write_bytes(path.read_bytes()[:30000])
    message = _error(load_cifar10, _config("cifar10", tmp_path))
    assert f"{path}: 30000 bytes is not a multiple of 3073-byte records" in message


def test_cifar10_empty_file_and_bad_label(tmp_path):
    folder = write_cifar10(tmp_path, per_batch=4, num_test=4)
    (folder / "test_batch.bin").write_bytes(b"")
    assert "test_batch.bin: empty" in _error(load_cifar10, _config("cifar10", tmp_path))
    (folder / "test_batch.bin").write_bytes(bytes([57]) + bytes(3072))
    message = _error(load_cifar10, _config("cifar10", tmp_path))
    assert "record 0 has label 57, expected 0..9" in message and "CIFAR-100" in message


def test_cifar10_missing_file_offline(tmp_path):
    folder = write_cifar10(tmp_path, per_batch=4, num_test=4)
    (folder / "data_batch_5.bin").unlink()
    message = _error(load_cifar10, _config("cifar10", tmp_path))
    assert message.startswith("cifar10: cifar-10-binary.tar.gz not found and --no-download is set")
    assert "data_batch_5.bin missing from" in message
    assert "https://www.cs.toronto.edu/~kriz/" in message


def test_read_batch_shape(tmp_path):
    folder = write_cifar10(tmp_path, per_batch=2, num_test=3)
    images, labels = read_batch(folder / "test_batch.bin")
    assert images.shape == (3, 3, 32, 32) and labels.shape == (3,)


# ----- text folders ------------------------------------------------------------------------------


def test_tokenize_lowercases_and_drops_html():
    assert tokenize("It's GOOD.<br /><br />Not bad_at all, 10/10") == [
        "it's",
        "good",
        "not",
        "bad",
        "at",
        "all",
        "10",
        "10",
    ]


def test_vocabulary_ranks_by_count_then_alphabet_and_pads_at_the_front():
    vocabulary = Vocabulary.build([["b", "a", "c", "a"], ["b", "d"]], size=4)
    assert vocabulary.words == ["<pad>", "<unk>", "a", "b"]
    assert vocabulary.encode(["a", "zzz", "b"], 5) == [0, 0, 2, 1, 3]
    assert vocabulary.encode(["a", "b", "a", "b"], 2) == [2, 3]  # the last words are kept


def test_text_folders(tmp_path):
    write_text_folders(tmp_path, docs_per_class=6, num_test=3)
    splits = load_text(_config("text", tmp_path, max_len=16, vocab_size=10))
    assert splits.classes == ("neg", "pos")
    assert splits.spec.input_kind == "tokens" and splits.spec.input_shape == (16,)
    assert splits.spec.vocab_size == len(splits.vocabulary) == 10
    ids, labels = splits.train.tensors
    assert ids.shape == (12, 16) and ids.dtype == torch.long
    assert labels.tolist() == [0] * 6 + [1] * 6
    assert int(ids.max()) < 10


def test_text_missing_class_in_test(tmp_path):
    write_text_folders(tmp_path, 3, 2)
    for path in (tmp_path / "test" / "pos").iterdir():
        path.unlink()
    (tmp_path / "test" / "pos").rmdir()
    message = _error(load_text, _config("text", tmp_path))
    assert f"text data dir {tmp_path}/train has classes ['neg', 'pos'] but test has ['neg']" in message


def test_text_errors(tmp_path):
    assert "--dataset text needs --data-dir" in _error(load_text, TrainConfig(dataset="text"))
    assert "no such directory" in _error(load_text, _config("text", tmp_path / "absent"))
    tmp_path.joinpath("train").mkdir()
    assert f"{tmp_path}/test is not a directory" in _error(load_text, _config("text", tmp_path))
    write_text_folders(tmp_path, 3, 2, classes=("only",))
    assert "a classifier needs at least two" in _error(load_text, _config("text", tmp_path))


def test_text_empty_class_and_bad_encoding(tmp_path):
    write_text_folders(tmp_path, 3, 2)
    (tmp_path / "train" / "zz").mkdir()
    (tmp_path / "test" / "zz").mkdir()
    assert f"{tmp_path}/train/zz has no .txt files" in _error(load_text, _config("text", tmp_path))
    (tmp_path / "train" / "zz").rmdir()
    (tmp_path / "test" / "zz").rmdir()
    bad = tmp_path / "test" / "neg" / "0_1.txt"
    bad.write_bytes(b"caf\xe9")
    assert f"{bad}: not UTF-8 text (byte 0xe9 at offset 3)" in _error(load_text, _config("text", tmp_path))


def test_load_dataset_by_name_with_options(tmp_path):
    write_fashion_mnist(tmp_path, 10, 10)
    assert len(load_dataset("fashion_mnist", data_dir=str(tmp_path), download=False).train) == 10


def test_text_options_are_validated():
    with pytest.raises(ConfigError, match="--vocab-size must be >= 3"):
        TrainConfig(vocab_size=2)
    with pytest.raises(ConfigError, match="--max-len must be >= 1"):
        TrainConfig(max_len=0)
