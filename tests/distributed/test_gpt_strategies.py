"""The built-in language model (``--model gpt`` on ``text-lm`` data) from the command line:
the synchronous strategies equal one process of the global batch."""

import json

import pytest

from paratrain.data.text_lm import builtin_corpus
from tests.conftest import run_cli

pytestmark = pytest.mark.distributed

SMALL = ("--model", "gpt", "--gpt-layers", "2", "--gpt-width", "32", "--gpt-heads", "2", "--seq-len", "32")
RUN = ("--epochs", "1", "--log-every", "0", "--no-progress", "--momentum", "0", "--lr", "0.5")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """12 KB of the built-in corpus: 337 training examples of 32 tokens, 10 steps of 32."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_bytes(builtin_corpus(12_000))
    return ("--dataset", f"text-lm:{path}")


def _train(tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    result = run_cli("train", *SMALL, *RUN, *args, "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr
    return json.loads(out.read_text()), result.stdout


@pytest.fixture(scope="module")
def single(tmp_path_factory, corpus):
    return _train(tmp_path_factory.mktemp("single"), "single", *corpus, "--batch-size", "32")


@pytest.mark.parametrize(
    "strategy, extra",
    [("allreduce", ()), ("fsdp", ()), ("ps-sync", ()), ("fsdp", ("--activation-checkpointing", "blocks"))],
)
def test_gpt_under_a_synchronous_strategy_equals_one_process(tmp_path, corpus, single, strategy, extra):
    """Plain SGD, float32: equal to rounding (1e-5 on the test loss, where a lost update or
    a wrong average moves it by more than 1e-2), and trained away from a uniform guess.
    Checkpointed blocks recompute the same activations: the same run."""
    single, log = single
    metrics, _ = _train(
        tmp_path, strategy, *corpus, "--strategy", strategy, "--workers", "2", "--batch-size", "16", *extra
    )
    assert metrics["test_loss"] == pytest.approx(single["test_loss"], rel=1e-5)
    assert single["test_loss"] < 0.9 * 5.545  # ln 256
    assert single["tokens_per_second"] > 0 and single["test_perplexity"] == pytest.approx(
        2.71828 ** single["test_loss"], rel=1e-4
    )
    assert "tokens/sec" in log and "test perplexity" in log
