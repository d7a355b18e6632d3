"""A part's writer notes its SHA-256 for the commit, so that the committing process does not
read every part again; a note that is not of the file there is never trusted."""

import hashlib
import json
import os

import pytest
import torch

from paratrain.checkpoints import store as store_module
from paratrain.checkpoints.store import CheckpointStore, digest_path


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_commit_takes_each_writers_note_and_reads_no_part(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    for rank in range(3):
        store.write_part(20, f"rank-{rank}", {"x": torch.randn(1000 + rank)})
    folder = store.folder(20)
    assert all(digest_path(folder / f"rank-{rank}.pt").exists() for rank in range(3))

    def no_reading(path):
        raise AssertionError(f"the commit read {path}")

    monkeypatch.setattr(store_module, "_describe_file", no_reading)
    store.commit(20, ["rank-0", "rank-1", "rank-2"], {}, timeout=1)
    monkeypatch.undo()
    manifest = json.loads((folder / "manifest.json").read_text())
    for rank in range(3):
        path = folder / f"rank-{rank}.pt"
        assert manifest["parts"][f"rank-{rank}"] == {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "rank-0.pt", "rank-1.pt", "rank-2.pt"]
    assert CheckpointStore.read_part(folder, "rank-2", manifest)["x"].numel() == 1002


@pytest.mark.parametrize("how", ["replaced", "rewritten in place", "note garbled"])
def test_a_note_that_is_not_of_the_file_there_is_not_trusted(tmp_path, how):
    """The part changed after its note (another file renamed over it, or the same file
    rewritten), or the note does not read: the commit reads the file, and the manifest
    describes what is on disk."""
    store = CheckpointStore(tmp_path)
    store.write_part(20, "rank-0", {"x": torch.zeros(100)})
    path = store.folder(20) / "rank-0.pt"
    if how == "replaced":
        other = path.with_name("other.pt")
        torch.save({"x": torch.ones(100)}, other)
        os.replace(other, path)
    elif how == "rewritten in place":
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
        stamp = path.stat()
        os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 1_000_000))
    else:
        digest_path(path).write_text("{not json")
    store.commit(20, ["rank-0"], {}, timeout=1)
    manifest = json.loads((store.folder(20) / "manifest.json").read_text())
    assert manifest["parts"]["rank-0"] == {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def test_a_part_without_a_note_is_read_for_its_digest(tmp_path):
    """A part put in place by other means (no note) commits as before."""
    folder = tmp_path / "ckpt-000000020"
    folder.mkdir()
    torch.save({"x": torch.arange(5)}, folder / "rank-0.pt")
    CheckpointStore(tmp_path).commit(20, ["rank-0"], {}, timeout=1)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["parts"]["rank-0"]["sha256"] == _sha256(folder / "rank-0.pt")


def test_a_save_commits_only_its_own_parts_not_those_a_crash_left(tmp_path):
    """A fault-tolerant run whose every replica was lost while its first replica saved step
    40 (stage 0's part written, stage 1's not) saves step 40 again in its next life: the
    chief's commit waits for stage 0's part of this save (its token), and the manifest holds
    the new part's digest, never the one the crash left."""
    store = CheckpointStore(tmp_path)
    store.write_part(40, "stage-0", {"x": torch.zeros(100)}, save="former")  # the life a crash ended
    store.write_part(40, "stage-1", {"x": torch.ones(100)}, save="now")  # the chief's own part
    with pytest.raises(RuntimeError, match="the part of stage-0 did not arrive"):
        store.commit(40, ["stage-0", "stage-1"], {}, timeout=0.3, save="now")
    assert not (store.folder(40) / "manifest.json").exists()
    store.write_part(40, "stage-0", {"x": torch.full((100,), 2.0)}, save="now")
    store.commit(40, ["stage-0", "stage-1"], {}, timeout=1, save="now")
    folder = store.folder(40)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["parts"]["stage-0"]["sha256"] == _sha256(folder / "stage-0.pt")
    assert torch.equal(CheckpointStore.read_part(folder, "stage-0", manifest)["x"], torch.full((100,), 2.0))
