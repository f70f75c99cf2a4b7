"""One writer per snapshot path: the lease, fencing against a paused (zombie) job, and saves that
ride out transient storage faults. Real processes, and a real S3 server (moto_server) on
loopback."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, kill_tree, run_main, start_main, tiny_overrides, wait_for_line
from s3_server import CREDENTIALS, FlakyS3Proxy

from mingpt_ddp.metrics import MetricsLog
from mingpt_ddp.snapshots.lease import (
    LEASE,
    Lease,
    LeaseError,
    holder_is_gone,
    process_start,
    this_process,
)
from mingpt_ddp.snapshots.storage import LocalStorage
from mingpt_ddp.snapshots.store import MANIFEST, SnapshotStore

FAULTY = REPO / "tests" / "faulty_main.py"  # main.py with faults injected (FAULT=...)


def start_job(args: list[str], env: dict | None = None) -> subprocess.Popen:
    return start_main(args, env=env)  # one process


def state(step: int) -> dict:
    return {"step": step, "model": {"w": torch.full((2,), float(step))}}


# ---------------------------------------------------------------------------- the lease, in process
def test_a_second_owner_is_refused_naming_the_holder_until_the_lease_goes_stale(tmp_path):
    now = [1000.0]
    first = Lease(
        LocalStorage(str(tmp_path)), str(tmp_path), "job-a", ttl_s=60, clock=lambda: now[0]
    )
    second = Lease(
        LocalStorage(str(tmp_path)), str(tmp_path), "job-b", ttl_s=60, clock=lambda: now[0]
    )
    assert first.acquire() == "free" and first.generation == 1
    with pytest.raises(
        LeaseError, match=rf"in use by another job: job-a \(host .*, pid {os.getpid()}"
    ):
        second.acquire()
    now[0] += 61  # job-a stopped renewing a minute ago
    assert second.acquire().startswith("stale since") and second.generation == 2
    with pytest.raises(LeaseError, match="lost the lease .* to job job-b"):
        first._valid_until = 0  # as if paused past its lease: check() asks the storage
        first.check()


def test_the_same_job_takes_its_own_lease_back_at_once(tmp_path):
    first = Lease(LocalStorage(str(tmp_path)), str(tmp_path), "run-42", ttl_s=600)
    first.acquire()
    again = Lease(
        LocalStorage(str(tmp_path)), str(tmp_path), "run-42", ttl_s=600
    )  # a torchrun restart
    assert "a restart" in again.acquire() and again.generation == 2


def test_a_zombie_cannot_commit_after_a_new_owner_fenced_the_manifest(tmp_path):
    url = str(tmp_path / "snaps")
    now = [0.0]
    zombie = SnapshotStore(url, keep_last=1)
    zombie.acquire("job-a", ttl_s=10, clock=lambda: now[0], renew=False)
    zombie.save(state(5), 5)
    now[0] += 11  # job-a was paused past its lease
    owner = SnapshotStore(url, keep_last=1)
    owner.acquire("job-b", ttl_s=10, clock=lambda: now[0], renew=False)
    with pytest.raises(LeaseError, match="holds lease generation 1, .* by generation 2"):
        zombie.save(
            state(10), 10
        )  # its data file is written under its own name, the commit refused
    assert not (tmp_path / "snaps" / "snapshot_00000010.g1.pt").exists()  # and that orphan removed
    owner.save(state(7), 7)
    assert [
        e["step"] for e in json.loads((tmp_path / "snaps" / MANIFEST).read_text())["snapshots"]
    ] == [7]
    assert SnapshotStore(url).load_latest()["step"] == 7


# ------------------------------------------------------------------ the manifest is untrusted input
def crafted_manifests(victim_name: str) -> list[dict]:
    shard_entry = {
        "file": "snapshot_00000001.dcp",
        "step": 1,
        "kind": "sharded",
        "bytes": 1,
        "files": {f"../../{victim_name}": {"bytes": 1, "sha256": "0" * 64}},
    }
    return [
        {"snapshots": [shard_entry]},
        {"snapshots": [{"file": f"../{victim_name}", "step": 1, "bytes": 1, "sha256": "0" * 64}]},
        {"snapshots": [{"file": f"/tmp/{victim_name}", "step": 1, "bytes": 1, "sha256": "0" * 64}]},
        {
            "snapshots": [
                {**shard_entry, "files": {f"/abs/{victim_name}": {"bytes": 1, "sha256": "0" * 64}}}
            ]
        },
        {"snapshots": [{"file": "snapshot_00000001.pt", "step": "1; rm -rf", "bytes": None}]},
        {"snapshots": "not a list"},
        ["not", "an", "object"],
    ]


@pytest.mark.parametrize("case", range(7))
def test_a_crafted_local_manifest_touches_nothing_outside_the_snapshot_path(tmp_path, case, capsys):
    outside = tmp_path / "victim.txt"
    outside.write_text("precious")
    snap_dir = tmp_path / "a" / "b"
    (snap_dir / "snapshot_00000001.dcp").mkdir(parents=True)
    (snap_dir / MANIFEST).write_text(json.dumps(crafted_manifests("victim.txt")[case]))
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    store = SnapshotStore(str(snap_dir), keep_last=1)
    assert store.load_latest() is None  # nothing usable: a fresh start, not a crash
    store.save(state(2), 2)  # retention with keep_last=1 drops every older entry
    store.save(state(3), 3)
    assert outside.read_text() == "precious"
    assert [
        p for p in sorted(str(p) for p in tmp_path.rglob("*")) if not p.startswith(str(snap_dir))
    ] == [p for p in before if not p.startswith(str(snap_dir))]
    assert store.load_latest()["step"] == 3
    if case < 5:
        assert "skipped" in capsys.readouterr().err  # the bad entry is reported


@pytest.mark.parametrize("case", [0, 1, 3])
def test_a_crafted_s3_manifest_touches_nothing_outside_the_snapshot_prefix(s3, bucket, case):
    client = s3.client()
    client.put_object(Bucket=bucket, Key="victim.txt", Body=b"precious")
    client.put_object(Bucket=bucket, Key=f"team{case}/victim.txt", Body=b"precious")
    client.put_object(
        Bucket=bucket,
        Key=f"team{case}/run/{MANIFEST}",
        Body=json.dumps(crafted_manifests("victim.txt")[case]),
    )
    store = SnapshotStore(f"s3://{bucket}/team{case}/run", keep_last=1, s3_endpoint_url=s3.url)
    assert store.load_latest() is None
    store.save(state(2), 2)
    store.save(state(3), 3)
    assert client.get_object(Bucket=bucket, Key="victim.txt")["Body"].read() == b"precious"
    assert (
        client.get_object(Bucket=bucket, Key=f"team{case}/victim.txt")["Body"].read() == b"precious"
    )
    assert store.load_latest()["step"] == 3


# ------------------------------------------------------------------------- two jobs, real processes
@pytest.mark.slow
def test_two_identical_jobs_started_at_once_on_one_local_path_only_one_trains(
    shakespeare, tmp_path
):
    args = tiny_overrides(shakespeare, tmp_path, max_steps=100000, save_every=50)
    jobs = [start_job(args), start_job(args)]  # the same command twice, at the same moment
    try:
        t0 = time.monotonic()
        while all(
            job.poll() is None for job in jobs
        ):  # the loser stops at start; the winner trains on
            assert time.monotonic() - t0 < 120, "neither job stopped"
            time.sleep(0.1)
        loser = next(job for job in jobs if job.poll() is not None)
        winner = next(job for job in jobs if job is not loser)
        out = loser.stdout.read()
        assert (
            loser.returncode == 1 and "in use by another job" in out and f"pid {winner.pid}" in out
        ), out[-2000:]
        assert "step " not in out and "Traceback" not in out
        wait_for_line(winner, "step ")  # and the other one trains
        assert winner.poll() is None
    finally:
        for job in jobs:
            kill_tree(job)


@pytest.mark.slow
def test_two_identical_jobs_on_one_s3_path_only_one_trains(s3, bucket, shakespeare, tmp_path):
    args = tiny_overrides(shakespeare, tmp_path, max_steps=100000, save_every=50) + [
        f"trainer_config.snapshot_path=s3://{bucket}/run",
        f"trainer_config.s3_endpoint_url={s3.url}",
    ]
    first = start_job(args, env=CREDENTIALS)
    try:
        wait_for_line(first, "step ")
        second = run_main(args, env=CREDENTIALS, timeout=120)
        assert second.returncode == 1 and "in use by another job" in second.stderr, second.stderr[
            -2000:
        ]
        assert "step " not in second.stdout
    finally:
        kill_tree(first)


@pytest.mark.slow
def test_a_holder_that_exited_but_was_not_yet_reaped_counts_as_gone():
    # A SIGKILLed torchrun worker stays a zombie until whoever adopts it collects its exit status;
    # a rerun must not wait for that.
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    record = {**this_process(), "pid": child.pid, "pid_start": process_start(child.pid)}
    assert record["pid_start"] and not holder_is_gone(record)  # alive: it holds the lease
    child.stdin.close()  # it exits; until child.wait() it is a zombie
    while open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        os.sched_yield()
    assert holder_is_gone(record)
    child.wait()
    assert holder_is_gone(record)


@pytest.mark.slow
def test_a_rerun_after_sigkill_on_the_same_host_takes_the_lease_at_once(shakespeare, tmp_path):
    def args(max_steps: int) -> list[str]:
        return tiny_overrides(
            shakespeare, tmp_path, max_steps=max_steps, save_every=5, lease_ttl_s=3600
        )

    first = start_job(args(100000))
    wait_for_line(first, "snapshot | step 5")
    kill_tree(first)
    rerun = run_main(args(12))
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "has exited" in rerun.stdout and "resume | step " in rerun.stdout  # no hour-long wait


@pytest.mark.slow
def test_a_paused_job_that_lost_its_lease_cannot_write_and_the_new_owner_is_intact(
    shakespeare, tmp_path
):
    def args(max_steps: int) -> list[str]:
        return tiny_overrides(
            shakespeare, tmp_path, max_steps=max_steps, save_every=5, lease_ttl_s=2, log_every=1
        )

    zombie = start_job(args(100000))
    wait_for_line(zombie, "snapshot | step 5")
    os.kill(zombie.pid, signal.SIGSTOP)  # a VM freeze, a swap storm: it stops renewing
    try:
        lease = json.loads((tmp_path / "snapshots" / LEASE).read_text())
        while time.time() <= lease["renewed"] + lease["ttl_s"]:  # wait out the lease it holds
            time.sleep(0.2)
        owner = run_main(args(30))
        assert owner.returncode == 0, owner.stderr[-2000:]
        assert "stale since" in owner.stdout and "done | step 30" in owner.stdout
    finally:
        os.kill(zombie.pid, signal.SIGCONT)
    out, _ = zombie.communicate(timeout=60)
    assert zombie.returncode == 1 and "lost the lease" in out, out[-2000:]
    steps = [
        r["step"] for r in MetricsLog.read(str(tmp_path / "metrics.jsonl")) if "event" not in r
    ]
    assert steps == sorted(set(steps)) and steps[-1] == 30  # the owner's history alone, once each
    assert SnapshotStore(str(tmp_path / "snapshots")).load_latest()["step"] == 30
    again = run_main(args(35))
    assert again.returncode == 0 and "resume | step 30" in again.stdout


# --------------------------------------------------------------------------------- transient faults
@pytest.mark.slow
def test_a_save_that_fails_for_a_while_does_not_stop_training(shakespeare, tmp_path):
    args = tiny_overrides(shakespeare, tmp_path, max_steps=20, save_every=5)
    result = run_main(args, script=FAULTY, env={"FAULT": "enospc_at:0:5"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "snapshot save of step 5" in result.stderr and "training goes on" in result.stderr
    assert "done | step 20" in result.stdout
    store = SnapshotStore(str(tmp_path / "snapshots"))
    assert [e["step"] for e in store._manifest()] == [10, 15, 20]


@pytest.mark.slow
def test_saves_that_keep_failing_fail_the_job_naming_the_resume_point(shakespeare, tmp_path):
    args = tiny_overrides(shakespeare, tmp_path, max_steps=40, save_every=5, max_failed_saves=2)
    result = run_main(args, script=FAULTY, env={"FAULT": "enospc_from:0:10"})
    assert result.returncode == 1
    last_line = result.stderr.strip().splitlines()[-1]
    assert (
        last_line.startswith("error:")
        and "2 saves in a row failed" in last_line
        and "resumes from step 5" in last_line
    )
    assert "done | step" not in result.stdout
    rerun = run_main(args)
    assert rerun.returncode == 0 and "resume | step 5 |" in rerun.stdout


@pytest.mark.slow
def test_an_s3_endpoint_returning_503_for_a_while_loses_no_work(s3, bucket, shakespeare, tmp_path):
    proxy = FlakyS3Proxy(
        s3.port, fail_puts_matching="snapshot_", failures=12
    )  # 503 SlowDown for a while
    try:
        args = tiny_overrides(shakespeare, tmp_path, max_steps=20, save_every=5) + [
            f"trainer_config.snapshot_path=s3://{bucket}/run",
            f"trainer_config.s3_endpoint_url={proxy.url}",
        ]
        result = run_main(args, env=CREDENTIALS)
        assert result.returncode == 0, result.stderr[-2000:]
        assert proxy.failed == 12 and "training goes on" in result.stderr
        store = SnapshotStore(f"s3://{bucket}/run", s3_endpoint_url=s3.url)
        assert store.load_latest()["step"] == 20
    finally:
        proxy.stop()
