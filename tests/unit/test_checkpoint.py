"""Checkpoints: parts and manifest, exact resume, and every way a checkpoint can be bad."""

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

import paratrain
from paratrain.data.datasets import load_digits
from paratrain.errors import ConfigError
from paratrain.models import build_model
from paratrain.train.callbacks import Callback
from paratrain.train.checkpoint import Checkpoint, CheckpointStore, load_checkpoint


class Losses(Callback):
    """Every step's loss, and a stop after ``stop_at`` steps (a run cut short)."""

    def __init__(self, stop_at=None):
        self.losses, self.stop_at = [], stop_at

    def on_batch_end(self, step, logs):
        self.losses.append(logs["local_loss"].item())
        if step == self.stop_at:
            self.trainer.stop_training = True


def _trainer(seed=0, model="mlp"):
    torch.manual_seed(seed)
    splits = load_digits()
    net = build_model(model, splits.spec)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    strategy = paratrain.SingleDeviceStrategy(device="cpu")
    return paratrain.Trainer(net, "cross_entropy", optimizer, strategy=strategy), splits


def _fit(trainer, splits, *callbacks, epochs=2):
    return trainer.fit(
        splits.train, epochs=epochs, validation_data=splits.test, verbose=0, log_every=7, callbacks=list(callbacks)
    )


def test_saves_every_n_steps_and_at_the_end_keeping_the_newest(tmp_path):
    trainer, splits = _trainer()
    _fit(trainer, splits, Checkpoint(tmp_path, every_steps=10, keep=2), epochs=1)  # 44 steps
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000040", "ckpt-000000044"]
    manifest = json.loads((tmp_path / "ckpt-000000044" / "manifest.json").read_text())
    assert manifest["step"] == 44 and manifest["strategy"] == "single" and list(manifest["parts"]) == ["rank-0"]
    state = load_checkpoint(tmp_path)
    assert state["trainer"]["global_step"] == 44
    for name, tensor in trainer.module.state_dict().items():
        assert torch.equal(state["model"][name], tensor)
    assert state["optimizer"]["state"]  # momentum buffers


def test_resume_goes_on_bit_for_bit(tmp_path):
    trainer, splits = _trainer()
    whole = Losses()
    full = _fit(trainer, splits, whole)
    # Cut at step 25 (mid-epoch, between two loss reductions), resume from step 20.
    cut, splits = _trainer()
    _fit(cut, splits, Checkpoint(tmp_path, every_steps=10), Losses(stop_at=25))
    (tmp_path / "ckpt-000000025").rename(tmp_path / "ignored")  # the end-of-run save: go back to 20
    resumed, splits = _trainer(seed=1)  # other initial weights: all must come from the checkpoint
    after = Losses()
    checkpoint = Checkpoint(tmp_path, every_steps=10, resume=True)
    history = _fit(resumed, splits, checkpoint, after)
    assert checkpoint.restored_step == 20
    assert after.losses == whole.losses[20:]
    assert history.history["train_loss"] == full.history["train_loss"]
    assert history.history["test_loss"] == full.history["test_loss"]
    for a, b in zip(trainer.module.parameters(), resumed.module.parameters()):
        assert torch.equal(a, b)


def test_a_run_stopped_mid_epoch_resumes_where_it_stopped(tmp_path):
    """A callback stops the run at step 25 of the epoch's 44: the end's checkpoint holds
    that position, and the resumed run trains the epoch's last 19 batches and the rest as
    the run never stopped, bit for bit (it went on at the next epoch, skipping them)."""
    trainer, splits = _trainer()
    whole = Losses()
    full = _fit(trainer, splits, whole, epochs=2)
    cut, splits = _trainer()
    _fit(cut, splits, Checkpoint(tmp_path, every_steps=10), Losses(stop_at=25), epochs=2)
    saved = load_checkpoint(tmp_path)["trainer"]
    assert (saved["global_step"], saved["epoch"], saved["batch"]) == (25, 0, 25)
    resumed, splits = _trainer(seed=1)
    after = Losses()
    checkpoint = Checkpoint(tmp_path, every_steps=10, resume=True)
    history = _fit(resumed, splits, checkpoint, after, epochs=2)
    assert checkpoint.restored_step == 25 and resumed.global_step == 88
    assert after.losses == whole.losses[25:]
    assert history.history["test_loss"] == full.history["test_loss"]
    for a, b in zip(trainer.module.parameters(), resumed.module.parameters()):
        assert torch.equal(a, b)


def test_a_run_resumed_after_some_epochs_has_the_whole_run_s_history(tmp_path):
    whole, splits = _trainer()
    full = _fit(whole, splits, epochs=3)
    cut, splits = _trainer()
    _fit(cut, splits, Checkpoint(tmp_path, every_steps=30), epochs=2)
    assert isinstance(load_checkpoint(tmp_path)["trainer"]["history"], str)  # JSON, not pickled dicts
    resumed, splits = _trainer(seed=1)
    history = _fit(resumed, splits, Checkpoint(tmp_path, every_steps=30, resume=True), epochs=3)
    assert len(history.epochs) == 3
    for key in ("epoch", "train_loss", "test_loss", "test_accuracy", "learning_rate", "examples_seen"):
        assert history[key] == full[key], key  # bit for bit: JSON keeps every float exactly


def test_resume_with_nothing_to_resume_starts_from_the_beginning(tmp_path):
    trainer, splits = _trainer()
    checkpoint = Checkpoint(tmp_path / "new", every_steps=100, resume=True)
    _fit(trainer, splits, checkpoint, epochs=1)
    assert checkpoint.restored_step is None and trainer.global_step == 44


@pytest.fixture
def saved(tmp_path):
    trainer, splits = _trainer()
    _fit(trainer, splits, Checkpoint(tmp_path, every_steps=20, model_name="mlp"), epochs=1)  # 20, 40, 44
    return tmp_path


def _resume(folder, model="mlp"):
    trainer, splits = _trainer(model=model)
    _fit(trainer, splits, Checkpoint(folder, every_steps=20, resume=True, model_name=model), epochs=1)


def test_a_corrupt_or_truncated_part_is_named(saved):
    part = saved / "ckpt-000000044" / "rank-0.pt"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"rank-0.pt: corrupt or truncated"):
        load_checkpoint(saved / "ckpt-000000044")
    part.write_bytes(bytes(data[:100]))
    with pytest.raises(ConfigError, match="corrupt or truncated"):
        load_checkpoint(saved / "ckpt-000000044")
    # A part that no longer matches its manifest makes the checkpoint incomplete: resume takes the one before.
    assert CheckpointStore(saved).latest().name == "ckpt-000000040"


@pytest.mark.slow
def test_every_checkpoint_garbled_is_one_line_exit_2_and_nothing_is_deleted(saved, cli):
    before = {}
    for path in sorted(saved.rglob("*")):
        if path.is_file():
            path.write_bytes(os.urandom(64))  # every file of every checkpoint overwritten
            before[path] = path.read_bytes()
    result = cli("train", "--epochs", "1", "--checkpoint-dir", str(saved), "--resume", "--no-progress")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "no checkpoint in" in result.stderr and "ckpt-000000044" in result.stderr
    assert "unreadable manifest.json" in result.stderr
    assert {p: p.read_bytes() for p in sorted(saved.rglob("*")) if p.is_file()} == before


def test_a_corrupt_newest_checkpoint_is_kept_aside_and_the_one_before_resumed(saved, capsys):
    newest = saved / "ckpt-000000044"
    (newest / "manifest.json").write_text("{garbled")
    older_corrupt = saved / "ckpt-000000020"
    manifest = json.loads((older_corrupt / "manifest.json").read_text())
    manifest["parts"]["rank-0"]["bytes"] += 1  # a manifest that does not match its part
    (older_corrupt / "manifest.json").write_text(json.dumps(manifest))
    trainer, splits = _trainer()
    checkpoint = Checkpoint(saved, every_steps=20, resume=True, model_name="mlp")
    _fit(trainer, splits, checkpoint, epochs=1)
    assert checkpoint.restored_step == 40
    out = capsys.readouterr().out
    assert "ckpt-000000044 is corrupt (unreadable manifest.json" in out
    assert (saved / "ckpt-000000044.corrupt" / "manifest.json").read_text() == "{garbled"
    # the older corrupt one is neither resumed from nor removed by the run's pruning
    assert older_corrupt.exists() and CheckpointStore(saved).problem(older_corrupt).startswith("part rank-0.pt has")
    assert CheckpointStore(saved).latest().name == "ckpt-000000044"  # written again by the resumed run


class Custom:
    """Any class: loading it would run the pickle's code, which weights_only refuses."""


def test_foreign_files_and_code_in_a_checkpoint_are_refused(saved):
    folder = saved / "ckpt-000000044"
    (folder / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ConfigError, match="not a paratrain checkpoint"):
        load_checkpoint(folder)
    (folder / "manifest.json").write_text(json.dumps({"format": "paratrain-checkpoint", "version": 3, "parts": {}}))
    with pytest.raises(ConfigError, match="format version 3, this paratrain reads 1 and 2"):
        load_checkpoint(folder)  # a checkpoint of a later paratrain
    (folder / "manifest.json").write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable manifest.json"):
        load_checkpoint(folder)
    evil = saved / "ckpt-000000050"
    evil.mkdir()
    torch.save({"model": Custom()}, evil / "rank-0.pt")
    store = CheckpointStore(saved)
    store.commit(50, ["rank-0"], {}, timeout=1)
    with pytest.raises(ConfigError, match="not a readable checkpoint"):
        load_checkpoint(evil)


def test_a_manifest_that_names_a_file_outside_its_checkpoint_is_refused(saved, cli):
    """A crafted manifest whose part points outside its folder (with that file's true size
    and SHA-256): refused before anything is read, one line and exit 2, nothing touched."""
    folder = saved / "ckpt-000000044"
    outside = saved / "outside.pt"
    torch.save({"trainer": {}, "strategy": {}}, outside)
    manifest = json.loads((folder / "manifest.json").read_text())
    data = outside.read_bytes()
    manifest["parts"]["../outside"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest["part_names"] = ["../outside"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    before = {p: p.stat().st_mtime_ns for p in saved.rglob("*")}
    with pytest.raises(ConfigError, match=r"names a file outside the checkpoint \('\.\./outside'\); refused"):
        load_checkpoint(folder)
    result = cli("train", "--epochs", "3", "--checkpoint-dir", str(saved), "--resume", "--no-progress")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "names a file outside the checkpoint" in result.stderr
    assert {p: p.stat().st_mtime_ns for p in saved.rglob("*")} == before


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda m: m.pop("step"), "has no step"),
        (lambda m: m.update(step="44"), "has step '44'; a whole number >= 0"),
        (lambda m: m.update(workers=0), "has workers 0; a whole number >= 1"),
        (lambda m: m["parts"].update({"rank-0": m["parts"]["rank-0"]["bytes"]}), "describes part 'rank-0' as"),
        (lambda m: m["parts"]["rank-0"].pop("sha256"), "paratrain writes {'bytes': N, 'sha256': HEX}"),
        (lambda m: [m.pop("workers"), m.pop("replicas", None)], "workers=None"),  # single's signature names it
    ],
    ids=["no step", "a step as text", "no workers", "a part as its size", "a part without its digest", "no count"],
)
def test_a_manifest_not_as_paratrain_writes_it_is_one_line_and_exit_2(saved, cli, edit, words):
    """Each field a resume reads, checked before any of it is used: one line naming the
    field, exit 2, and the checkpoint as it was."""
    path = saved / "ckpt-000000044" / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    before = {p: p.stat().st_mtime_ns for p in saved.rglob("*")}
    result = cli("train", "--epochs", "3", "--checkpoint-dir", str(saved), "--resume", "--no-progress")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert words in result.stderr
    assert {p: p.stat().st_mtime_ns for p in saved.rglob("*")} == before


def test_a_part_without_the_state_a_resume_takes_is_one_line(saved):
    """A part whose file reads but holds no ``trainer`` state (its manifest rewritten to
    match it): named in one line, not a KeyError."""
    folder = saved / "ckpt-000000044"
    part = folder / "rank-0.pt"
    state = torch.load(part, weights_only=True)
    del state["trainer"]
    torch.save(state, part)
    manifest = json.loads((folder / "manifest.json").read_text())
    data = part.read_bytes()
    manifest["parts"]["rank-0"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="its part rank-0 holds no 'trainer' state; not written by paratrain"):
        _resume(saved)


def test_a_run_that_does_not_resume_refuses_a_folder_of_checkpoints(saved, cli):
    """Started afresh in a folder of an earlier run's checkpoints, a run would have its own
    pruned beside the earlier run's higher steps, and a restart would resume the earlier
    run: refused in one line, exit 2, from the command line and from Python, and nothing
    there touched; --resume goes on from them."""
    before = {p: p.stat().st_mtime_ns for p in saved.rglob("*")}
    result = cli("train", "--epochs", "1", "--checkpoint-dir", str(saved), "--no-progress")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "holds the checkpoints of an earlier run (the newest at step 44): go on from it with --resume" in (
        result.stderr
    )
    trainer, splits = _trainer()
    with pytest.raises(ConfigError, match="holds the checkpoints of an earlier run"):
        _fit(trainer, splits, Checkpoint(saved, every_steps=20), epochs=1)
    assert {p: p.stat().st_mtime_ns for p in saved.rglob("*")} == before
    _resume(saved)


def test_a_checkpoint_of_another_model_or_run_is_refused(saved):
    with pytest.raises(ConfigError, match=r"written by a run with model=mlp; this run has model=cifar_cnn"):
        _resume(saved, model="cifar_cnn")
    manifest_path = saved / "ckpt-000000044" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["model"] = "MLP"  # same name, other shapes: caught at load
    manifest_path.write_text(json.dumps(manifest))
    trainer, splits = _trainer()
    trainer.module.fc = torch.nn.Linear(3, 3)  # another architecture under the same name
    with pytest.raises(ConfigError, match="holds another model"):
        _fit(trainer, splits, Checkpoint(saved, resume=True, model_name="MLP"), epochs=1)


def test_refusals_leave_every_checkpoint_in_place(saved):
    before = sorted(p.name for p in saved.iterdir())
    with pytest.raises(ConfigError):
        _resume(saved, model="cifar_cnn")
    assert sorted(p.name for p in saved.iterdir()) == before


CRASH_MID_WRITE = """
import os, sys, torch
import paratrain.train.checkpoint as ckpt
def dying_fsync(fd):
    os.ftruncate(fd, os.fstat(fd).st_size // 2)
    os._exit(9)  # the machine goes down half-way through writing a part
os.fsync = dying_fsync
ckpt.CheckpointStore(sys.argv[1]).write_part(60, "rank-0", {"x": torch.zeros(1000)})
"""


def test_a_crash_while_writing_leaves_the_previous_checkpoint_loadable(saved):
    crashed = subprocess.run([sys.executable, "-c", CRASH_MID_WRITE, str(saved)], capture_output=True)
    assert crashed.returncode == 9
    assert [p.name for p in (saved / "ckpt-000000060").iterdir()][0].startswith(".rank-0.pt.")  # only a temporary
    assert CheckpointStore(saved).latest().name == "ckpt-000000044"
    assert load_checkpoint(saved)["trainer"]["global_step"] == 44
    _resume(saved)  # goes on from 44, and its saves clear the debris
    assert not (saved / "ckpt-000000060").exists()


def test_a_replica_resuming_beside_a_live_writer_leaves_its_unfinished_save(saved):
    """A fault-tolerant replica that resumes late (from 44) while a peer that resumed
    sooner is saving step 60: the save under way is the peer's, and completes; a corrupt
    checkpoint after 44 is still moved aside. A run with no live peers removes it."""
    store = CheckpointStore(saved)
    (saved / "ckpt-000000050").mkdir()
    (saved / "ckpt-000000050" / "manifest.json").write_text("{garbled")
    (saved / "ckpt-000000060").mkdir()
    (saved / "ckpt-000000060" / ".rank-0.pt.abc").write_bytes(b"half")  # the peer's write under way
    assert [p.name for p in store.clear_after(44, unfinished=False)] == ["ckpt-000000050.corrupt"]
    store.write_part(60, "rank-0", {"x": torch.zeros(3)})
    store.commit(60, ["rank-0"], {}, timeout=1)
    assert store.latest().name == "ckpt-000000060"
    (saved / "ckpt-000000070").mkdir()
    store.clear_after(60)
    assert not (saved / "ckpt-000000070").exists()


@pytest.mark.slow
def test_a_full_disk_while_saving_is_one_line_exit_2_and_keeps_the_checkpoints(saved, tmp_path):
    import resource
    import signal

    before = {p.name: p.stat().st_mtime for p in saved.iterdir()}

    def small_disk():  # writes past 100 kB fail with EFBIG, as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "paratrain",
            "train",
            "--epochs",
            "2",
            "--checkpoint-dir",
            str(saved),
            "--checkpoint-every",
            "50",
            "--resume",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        preexec_fn=small_disk,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "cannot write (File too large); the earlier checkpoints are kept" in last
    assert {p.name: p.stat().st_mtime for p in saved.iterdir() if p.name in before} == before
    assert CheckpointStore(saved).latest().name == "ckpt-000000044"


def _nan_at(call):
    """Cross-entropy whose ``call``-th evaluation is NaN (one bad batch)."""
    calls = {"n": 0}

    def loss(logits, targets):
        calls["n"] += 1
        value = torch.nn.functional.cross_entropy(logits, targets)
        return value * float("nan") if calls["n"] == call else value

    return loss


def test_on_nan_skip_skips_that_update_and_counts_it():
    torch.manual_seed(0)
    splits = load_digits()
    net = build_model("mlp", splits.spec)
    strategy = paratrain.SingleDeviceStrategy(device="cpu")
    strategy.on_nan = "skip"
    trainer = paratrain.Trainer(net, _nan_at(5), torch.optim.SGD(net.parameters(), lr=0.05), strategy=strategy)
    history = trainer.fit(splits.train, epochs=1, verbose=0, log_every=2)
    assert strategy.skipped_updates == 1 and trainer.global_step == 44
    assert all(torch.isfinite(p).all() for p in net.parameters())
    assert 0 < history.history["train_loss"][0] < float("inf")  # the NaN step is left out of the epoch loss


def test_a_nan_loss_stops_the_run_and_the_last_good_checkpoint_stays(tmp_path):
    torch.manual_seed(0)
    splits = load_digits()
    net = build_model("mlp", splits.spec)
    strategy = paratrain.SingleDeviceStrategy(device="cpu")
    trainer = paratrain.Trainer(net, _nan_at(25), torch.optim.SGD(net.parameters(), lr=0.05), strategy=strategy)
    with pytest.raises(paratrain.DivergedError, match="model diverged with loss = nan at step 25"):
        trainer.fit(splits.train, epochs=1, verbose=0, callbacks=[Checkpoint(tmp_path, every_steps=10)])
    # The save at step 30 found the NaN first: 10 and 20 stay, nothing diverged was written.
    assert [step for step, _ in CheckpointStore(tmp_path).complete()] == [20, 10]


def test_a_resumed_fp16_run_takes_the_scalers_state():
    """fp16's gradient scaler (its scale, halved at each overflow, and its growth count) is in
    the checkpoint: a resumed run starts with the saved run's, not a fresh 65536, and skips
    the steps the run never stopped skips."""
    import tempfile

    def trainer():
        torch.manual_seed(0)
        splits = load_digits()
        net = build_model("mlp", splits.spec)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        strategy = paratrain.SingleDeviceStrategy(device="cpu")
        return paratrain.Trainer(net, "cross_entropy", opt, strategy=strategy, precision="fp16"), splits

    with tempfile.TemporaryDirectory() as folder:
        first, splits = trainer()
        x, y = splits.train.tensors
        first.fit((x[:320], y[:320]), epochs=1, batch_size=32, verbose=0, callbacks=[Checkpoint(folder, 5)])
        saved = load_checkpoint(folder)["strategy"]["scaler"]
        counted = saved["_growth_tracker"]
        assert counted >= 5 and saved["scale"] < 65536.0  # the first step overflowed: halved
        again, _ = trainer()
        again.fit(
            (x[:320], y[:320]), epochs=2, batch_size=32, verbose=0, callbacks=[Checkpoint(folder, 5, resume=True)]
        )
        # went on counting from the saved count (a fresh scaler counts from 0)
        assert int(again.strategy.scaler._growth_tracker) == counted + 10
        assert again.strategy.scaler.get_scale() == saved["scale"]
