"""Snapshots on S3, against a real S3-compatible server (moto_server) on loopback."""

import pytest
from conftest import run_main, tiny_overrides
from s3_server import CREDENTIALS, CuttableProxy, MotoServer

from mingpt_ddp.snapshots.storage import S3Storage
from mingpt_ddp.snapshots.store import SnapshotError, SnapshotStore


def keys(s3, bucket: str) -> list[str]:
    return sorted(o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket).get("Contents", []))


def test_save_load_and_keep_last_n_on_s3(s3, bucket):
    import torch

    store = SnapshotStore(f"s3://{bucket}/run1/snapshots", keep_last=2, s3_endpoint_url=s3.url)
    store.check_writable()
    for step in (1, 2, 3):
        store.save({"step": step, "w": torch.full((3,), float(step))}, step)
    assert keys(s3, bucket) == [
        "run1/snapshots/latest.json",
        "run1/snapshots/snapshot_00000002.pt",
        "run1/snapshots/snapshot_00000003.pt",
    ]
    loaded = store.load_latest()
    assert loaded["step"] == 3 and torch.equal(loaded["w"], torch.full((3,), 3.0))


def test_big_objects_round_trip_through_multipart_upload_and_ranged_download(s3, bucket):
    storage = S3Storage(f"s3://{bucket}/big", s3.url)
    data = bytes(range(256)) * (40 * 4096)  # 40 MiB: three 16 MiB parts
    storage.write("blob", data)
    assert storage.read("blob") == data
    head = s3.client().head_object(Bucket=bucket, Key="big/blob")
    assert "-" in head["ETag"]  # an ETag like "...-3" is what a multipart upload produces


def test_training_run_saves_to_s3_and_resumes_from_it_finding_the_endpoint_in_the_environment(
    s3, bucket, shakespeare, tmp_path
):
    args = tiny_overrides(shakespeare, tmp_path, save_every=5) + [
        f"trainer_config.snapshot_path=s3://{bucket}/run"
    ]
    first = run_main(
        args + ["trainer_config.max_steps=10", f"trainer_config.s3_endpoint_url={s3.url}"],
        env=CREDENTIALS,
    )
    assert first.returncode == 0, first.stderr
    assert "snapshot_00000010.g1.pt" in keys(s3, bucket)[-1]  # g1: written under lease generation 1
    # The same job again, with the endpoint only in AWS_ENDPOINT_URL: it reads and writes there.
    second = run_main(
        args + ["trainer_config.max_steps=15"], env={**CREDENTIALS, "AWS_ENDPOINT_URL": s3.url}
    )
    assert second.returncode == 0, second.stderr
    assert "resume | step 10" in second.stdout
    assert any(key.startswith("run/snapshot_00000015.") for key in keys(s3, bucket))


def test_an_fsdp_snapshot_on_s3_resumes_at_another_world_size(s3, bucket, shakespeare, tmp_path):
    """DCP shards on S3: downloaded into a folder the ranks of a node share (snapshots/stage.py),
    resumed by 2 ranks, then resharded to 1."""
    args = tiny_overrides(shakespeare, tmp_path, save_every=5) + [
        f"trainer_config.snapshot_path=s3://{bucket}/run",
        f"trainer_config.s3_endpoint_url={s3.url}",
        "trainer_config.parallel=fsdp",
    ]
    first = run_main(args + ["trainer_config.max_steps=5"], nproc=2, env=CREDENTIALS)
    assert first.returncode == 0, first.stderr[-3000:]
    both = run_main(args + ["trainer_config.max_steps=8"], nproc=2, env=CREDENTIALS)  # one folder
    assert both.returncode == 0, both.stderr[-3000:]
    assert "resume | step 5" in both.stdout
    alone = run_main(args + ["trainer_config.max_steps=10"], nproc=1, env=CREDENTIALS)
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert "resume | step 8" in alone.stdout


def _startup_error(args, env) -> str:
    result = run_main(args, env=env, timeout=120)
    assert result.returncode == 1
    assert "step " not in result.stdout  # failed before any training step
    assert "Traceback" not in result.stderr
    return result.stderr


def test_missing_bucket_fails_before_training(s3, shakespeare, tmp_path):
    args = tiny_overrides(shakespeare, tmp_path) + [
        "trainer_config.snapshot_path=s3://no-such-bucket/x",
        f"trainer_config.s3_endpoint_url={s3.url}",
    ]
    err = _startup_error(args, CREDENTIALS)
    assert "NoSuchBucket" in err and "create the bucket" in err


def test_missing_credentials_fail_before_training(s3, shakespeare, tmp_path):
    args = tiny_overrides(shakespeare, tmp_path) + [
        "trainer_config.snapshot_path=s3://any-bucket/x",
        f"trainer_config.s3_endpoint_url={s3.url}",
    ]
    env = {
        "AWS_ACCESS_KEY_ID": "",
        "AWS_SECRET_ACCESS_KEY": "",
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    err = _startup_error(args, env)
    assert "check the AWS credentials" in err


@pytest.mark.slow
def test_bad_credentials_fail_before_training(shakespeare, tmp_path):
    server = MotoServer(require_auth=True)  # this server checks access keys
    try:
        args = tiny_overrides(shakespeare, tmp_path) + [
            "trainer_config.snapshot_path=s3://any-bucket/x",
            f"trainer_config.s3_endpoint_url={server.url}",
        ]
        err = _startup_error(args, {**CREDENTIALS, "AWS_ACCESS_KEY_ID": "AKIAWRONGWRONGWRONG"})
        assert "InvalidAccessKeyId" in err and "check the AWS credentials" in err
    finally:
        server.stop()


@pytest.mark.slow
def test_unreachable_endpoint_fails_before_training(shakespeare, tmp_path):
    from conftest import free_port

    args = tiny_overrides(shakespeare, tmp_path) + [
        "trainer_config.snapshot_path=s3://any-bucket/x",
        f"trainer_config.s3_endpoint_url=http://127.0.0.1:{free_port()}",
    ]
    err = _startup_error(args, CREDENTIALS)
    assert "s3_endpoint_url" in err


@pytest.mark.slow
def test_server_dying_mid_upload_leaves_the_previous_snapshot_to_resume_from(
    s3, bucket, shakespeare, tmp_path
):
    proxy = CuttableProxy(s3.port)
    args = tiny_overrides(shakespeare, tmp_path, save_every=10) + [
        f"trainer_config.snapshot_path=s3://{bucket}/run",
        f"trainer_config.s3_endpoint_url={proxy.url}",
    ]
    assert run_main(args + ["trainer_config.max_steps=10"], env=CREDENTIALS).returncode == 0
    size = s3.client().head_object(Bucket=bucket, Key="run/snapshot_00000010.g1.pt")[
        "ContentLength"
    ]

    proxy.cut_after = (
        proxy.sent + size // 2
    )  # the line dies half-way through the next snapshot's upload
    failed = run_main(args + ["trainer_config.max_steps=30"], env=CREDENTIALS)
    assert proxy.is_cut and failed.returncode != 0
    assert (
        "snapshot save of step 20 to 's3://" in failed.stderr
    )  # tried again at step 30, and failed again
    assert (
        "error: the last save of this run failed" in failed.stderr
        and "a rerun resumes from step 10" in failed.stderr
    )
    assert "snapshot_00000020" not in " ".join(keys(s3, bucket))  # no partial object became visible

    proxy.restore()
    resumed = run_main(args + ["trainer_config.max_steps=30"], env=CREDENTIALS)
    assert resumed.returncode == 0, resumed.stderr
    assert "resume | step 10" in resumed.stdout
    assert SnapshotStore(f"s3://{bucket}/run", s3_endpoint_url=s3.url).load_latest()["step"] == 30


def test_a_failed_background_save_is_raised_not_lost(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    store = SnapshotStore(str(blocker / "snaps"))
    store.save_async({"step": 1}, 1)
    with pytest.raises(SnapshotError, match="background snapshot save to .* failed"):
        store.wait()
