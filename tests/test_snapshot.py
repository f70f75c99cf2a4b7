"""Snapshot storage: atomic commit, keep-last-N, integrity fallback, safe loading."""

import json

import pytest
import torch

from mingpt_ddp.snapshots.store import MANIFEST, SnapshotError, SnapshotStore


def state(step: int) -> dict:
    return {
        "step": step,
        "model": {"w": torch.full((4, 4), float(step))},
        "vocab": "abc",
        "rng": [None],
    }


def test_round_trip_restores_tensors_and_metadata(tmp_path):
    store = SnapshotStore(str(tmp_path / "s"))
    store.save(state(7), 7)
    loaded = store.load_latest()
    assert loaded["step"] == 7 and loaded["vocab"] == "abc"
    assert torch.equal(loaded["model"]["w"], torch.full((4, 4), 7.0))


def test_empty_location_means_a_fresh_start(tmp_path):
    assert SnapshotStore(str(tmp_path / "nothing")).load_latest() is None


def test_keeps_only_the_newest_n(tmp_path):
    store = SnapshotStore(str(tmp_path), keep_last=2)
    for step in (10, 20, 30):
        store.save(state(step), step)
    assert sorted(p.name for p in tmp_path.glob("snapshot_*.pt")) == [
        "snapshot_00000020.pt",
        "snapshot_00000030.pt",
    ]
    assert [e["step"] for e in json.loads((tmp_path / MANIFEST).read_text())["snapshots"]] == [
        20,
        30,
    ]


def test_truncated_newest_snapshot_falls_back_to_the_previous_one(tmp_path, capsys):
    store = SnapshotStore(str(tmp_path))
    store.save(state(10), 10)
    store.save(state(20), 20)
    newest = tmp_path / "snapshot_00000020.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    assert store.load_latest()["step"] == 10
    assert "snapshot_00000020.pt is unusable" in capsys.readouterr().err


def test_bit_flip_is_caught_by_the_checksum(tmp_path, capsys):
    store = SnapshotStore(str(tmp_path))
    store.save(state(10), 10)
    store.save(state(20), 20)
    newest = tmp_path / "snapshot_00000020.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    assert store.load_latest()["step"] == 10
    assert "checksum mismatch" in capsys.readouterr().err


def test_no_usable_snapshot_starts_fresh_with_a_warning(tmp_path, capsys):
    store = SnapshotStore(str(tmp_path))
    store.save(state(10), 10)
    (tmp_path / "snapshot_00000010.pt").write_bytes(b"garbage")
    assert store.load_latest() is None
    assert "starting fresh" in capsys.readouterr().err


def test_without_a_manifest_the_files_are_scanned(tmp_path):
    store = SnapshotStore(str(tmp_path))
    store.save(state(10), 10)
    store.save(state(20), 20)
    (tmp_path / MANIFEST).unlink()
    assert store.load_latest()["step"] == 20


def test_a_leftover_temp_file_from_a_crash_is_ignored(tmp_path):
    store = SnapshotStore(str(tmp_path))
    store.save(state(10), 10)
    (tmp_path / ".snapshot_00000020.pt.deadbeef.tmp").write_bytes(b"half written")
    assert store.load_latest()["step"] == 10


def test_loading_refuses_pickled_code(tmp_path, capsys):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    store = SnapshotStore(str(tmp_path))
    store.save({"step": 1, "payload": Evil()}, 1)
    assert store.load_latest() is None  # weights_only=True rejects arbitrary objects
    assert "pwned" not in capsys.readouterr().out


def test_fsspec_urls_save_load_and_keep_only_the_newest(tmp_path):
    store = SnapshotStore("memory://snapshots/run1", keep_last=1)
    store.check_writable()
    store.save(state(5), 5)
    store.save(state(6), 6)
    assert store.load_latest()["step"] == 6
    assert sorted(store.storage.list()) == [
        "latest.json",
        "snapshot_00000006.pt",
    ]  # step 5 deleted, no probe left
    assert [e["step"] for e in json.loads(store.storage.read(MANIFEST))["snapshots"]] == [6]


def test_unwritable_location_fails_the_probe_with_the_setting_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SnapshotError, match="trainer_config.snapshot_path"):
        SnapshotStore(str(blocker / "sub")).check_writable()
