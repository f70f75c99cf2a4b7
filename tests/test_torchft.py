"""Per-step fault tolerance with torchft (torchft_config): two replica groups train through a
lighthouse; one is SIGKILLed, the other trains on with a pause no longer than the lighthouse's
heartbeat timeout, and the killed group, restarted by its torchrun, heals from its live peer (no
snapshot read) and both end at the last step. Skipped where torchft is not installed (its wheels
are Linux only)."""

import inspect
import math
import re
import sys
from datetime import timedelta

import pytest
import torch

from mingpt_ddp.config.replica_groups import TorchftConfig
from mingpt_ddp.corpus.order import DataCursor
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.metrics import MetricsLog

STEPS, KILL = 700, 100  # the survivor trains 600 steps on: a loaded restart must find it there


def test_settings_name_the_group_and_its_fix():
    with pytest.raises(ConfigError, match="group must be 0 .. groups - 1"):
        TorchftConfig(groups=2, group=2)
    with pytest.raises(ConfigError, match="timeout_s must be positive"):
        TorchftConfig(groups=2, timeout_s=0)


def test_the_timeout_is_torchfts_own_default():
    """30 s was shorter than torchft's Manager default (60 s for timeout, quorum_timeout and
    connect_timeout): a group compiling or setting up NCCL in the first step could fail its peers'
    all-reduce."""
    assert TorchftConfig().timeout_s == 60.0
    torchft = pytest.importorskip("torchft")
    defaults = inspect.signature(torchft.Manager.__init__).parameters
    for name in ("timeout", "quorum_timeout", "connect_timeout"):
        assert defaults[name].default == timedelta(seconds=TorchftConfig().timeout_s), name


def test_replica_groups_on_one_machine_take_a_gpu_each(monkeypatch):
    """Each group is a torchrun job of one process: LOCAL_RANK 0 in every one, so the GPU is
    picked by the group (on a fake machine of 4 GPUs), not all groups on cuda:0."""
    from mingpt_ddp.runtime import distributed
    from mingpt_ddp.runtime.distributed import choose_device

    cuda = [torch.device("cuda", i) for i in range(4)]
    picked = [choose_device("auto", 4, local_rank=0, local_world_size=1, group=g) for g in range(6)]
    assert picked == cuda + cuda[:2]  # more groups than GPUs: they share, round robin
    assert choose_device("cuda", 1, 0, 1, group=3) == cuda[0]  # CUDA_VISIBLE_DEVICES=<one GPU>
    assert choose_device("auto", 4, 0, 1) == cuda[0]  # no torchft: the local rank, as before
    for key in ("WORLD_SIZE", "RANK", "HOROVOD_RANK", "HOROVOD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(distributed, "_IS_MAIN", None)  # restored after the test
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert distributed.setup_distributed(device="auto", group=2).device == cuda[2] == chosen[0]


def test_main_hands_the_group_to_the_device_choice(monkeypatch):
    import main

    seen = []

    def setup(timeout_s, device, trace_dir, group=None):
        seen.append(group)
        raise ConfigError("stop here")

    monkeypatch.setattr(main, "setup_distributed", setup)
    for overrides, group in (
        ([], None),
        (["torchft_config.groups=3", "torchft_config.group=2"], 2),
    ):
        assert main.run(main.to_job(main.compose(overrides))).code == 1 and seen[-1] == group


def test_a_healed_group_reads_its_own_windows_of_the_step_it_joins_at():
    """The data position is a function of the step: seeking to step s equals taking s steps."""
    walked, sought = DataCursor(1000, 2, 1, 7), DataCursor(1000, 2, 1, 7)
    micro_steps = 3 * 125 + 5  # into the 4th epoch: 1000 windows hold 125 micro-steps of 2 x 4
    for _ in range(micro_steps):
        walked.next_starts(4)
    sought.seek(micro_steps, 4)
    assert (walked.epoch, walked.samples_consumed) == (sought.epoch, sought.samples_consumed)
    assert torch.equal(walked.next_starts(4), sought.next_starts(4))


def test_a_step_the_quorum_did_not_commit_is_neither_counted_nor_logged(shakespeare, tmp_path):
    """A step right after a logged one that torchft did not commit: the step counter stays, so the
    loop must not log it again (it divided by zero steps and crashed the survivor)."""
    from test_devices import tiny_trainer

    trainer = tiny_trainer(
        tmp_path, shakespeare, parallel="none", max_steps=4, log_every=1, eval_every=4
    )
    real, calls = trainer.strategy.reduce_gradients, []

    def third_rejected():  # torchft's manager: the quorum's vote after the gradients' all-reduce
        calls.append(trainer.state.step)
        return real() and len(calls) != 3

    trainer.strategy.reduce_gradients = third_rejected
    assert trainer._train_loop()
    assert calls == [0, 1, 2, 2, 3] and trainer.state.step == 4


def test_a_heal_travels_through_host_memory_whatever_the_models_device():
    """Gloo cannot send a CUDA tensor (an H200 said "writev: Bad address"): the heal's transport
    is on the CPU even for a GPU run, and heal() copies into the model's device."""
    pytest.importorskip("torchft")
    from torchft.checkpointing.pg_transport import PGTransport

    from mingpt_ddp.parallel.replica_groups import heal_transport

    transport = heal_transport(PGTransport, pg=None, timeout=timedelta(seconds=5))
    assert transport._device == torch.device("cpu")


def test_a_heal_copies_how_the_peer_computes_too():
    """Each group times attention's precision at start; a healed group must compute as its peer
    does (the walkthrough saw bf16 attention beside a peer's fp32), so it takes the peer's."""
    pytest.importorskip("torchft")
    from types import SimpleNamespace

    from mingpt_ddp.parallel.replica_groups import ReplicaGroupStrategy as Groups

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    peer = SimpleNamespace(model=model, optimizers=[optimizer], semi=None)
    peer.manager = SimpleNamespace(current_step=lambda: 7)  # the step the peer is at
    peer.snapshot_meta = lambda: {"scaler": {}, "attention_fp32": True}
    sent = Groups.peer_state(peer)
    assert sent["meta"] == {"scaler": {}, "attention_fp32": True}
    applied = []
    me = SimpleNamespace(model=torch.nn.Linear(2, 2), optimizers=[optimizer], healed=False)
    me.attention_choice = "attention fp32 (as the snapshot's run)"
    me.load_snapshot_meta = applied.append
    Groups.heal(me, sent)
    assert applied == [sent["meta"]] and me.healed and me.peer_step == sent["step"] == 7
    assert me.attention_choice == "attention fp32 (as the peer)"
    assert torch.equal(me.model.weight, model.weight)


@pytest.mark.slow
def test_an_unreachable_lighthouse_is_one_line_naming_the_setting(shakespeare, tmp_path):
    pytest.importorskip("torchft")
    from conftest import free_port, run_main, tiny_overrides

    nobody = f"http://127.0.0.1:{free_port()}"
    ft = ["torchft_config.groups=2", f"torchft_config.lighthouse={nobody}"]
    args = tiny_overrides(shakespeare, tmp_path, device="cpu") + ft + ["torchft_config.timeout_s=1"]
    result = run_main(args, nproc=1)
    assert result.returncode == 1
    assert f"error: no torchft lighthouse answered at {nobody} within 1 s" in result.stderr
    assert "torchft_config.lighthouse" in result.stderr and "Traceback" not in result.stderr
    alone = run_main(args)  # not under torchrun: torchft's group would miss MASTER_ADDR
    assert alone.returncode == 1 and "error: each torchft replica group is a torchrun job" in (
        alone.stderr
    )


def executable(path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return str(path)


def test_the_lighthouse_is_found_beside_the_interpreter_then_on_path_or_named_as_an_extra(
    tmp_path, monkeypatch
):
    """A venv used by its path (venv/bin/python benchmarks/fault_tolerance.py, its bin/ not on
    PATH) has torchft_lighthouse beside its python; without it, one line says what to install."""
    from benchmarks.replica_jobs import Lighthouse, lighthouse_program

    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "bin" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(SystemExit) as exit_:
        lighthouse_program()
    assert "\n" not in str(exit_.value) and 'pip install -e ".[torchft]"' in str(exit_.value)
    on_path = executable(tmp_path / "elsewhere" / "torchft_lighthouse")
    monkeypatch.setenv("PATH", str(tmp_path / "elsewhere"))
    assert lighthouse_program() == on_path
    beside = executable(tmp_path / "venv" / "bin" / "torchft_lighthouse")
    assert lighthouse_program() == beside == Lighthouse().cmd[0]  # before PATH's


@pytest.mark.slow
def test_a_killed_group_heals_from_its_peer_while_the_other_trains_on(shakespeare, tmp_path):
    pytest.importorskip("torchft")
    from benchmarks.replica_jobs import HEARTBEAT_MS, Lighthouse, group, overrides

    size = dict(steps=STEPS, save_every=50, batch=4)
    with Lighthouse() as lighthouse:
        runs = [tmp_path / f"group{g}" for g in (0, 1)]
        jobs = [
            group(lighthouse, 0, overrides(shakespeare, runs[0], size)),
            group(lighthouse, 1, overrides(shakespeare, runs[1], size), f"kill:0:{KILL}"),
        ]
        codes = [job.wait(timeout=400) for job in jobs]
    assert codes == [0, 0], jobs[1].text()[-3000:]
    survivor, killed = jobs[0], jobs[1]
    out = killed.text().split("restart 1 |", 1)
    assert f"fault | rank 0 | kill before step {KILL + 1}" in out[0] and len(out) == 2
    healed = [int(s) for s in re.findall(r"heal \| step 0 -> (\d+) \|", out[1])]
    assert healed and healed[0] > KILL, out[1][:1500] + out[1][-800:]  # where the survivor was
    assert "resume |" not in out[1]  # healed from the peer: no snapshot read
    # The survivor's steps: every one logged once, the longest gap bounded by the heartbeat
    steps = survivor.steps()  # from 1, or from where it healed to if its peer started first
    assert [s for _, s in steps] == list(range(steps[0][1], STEPS + 1))
    gaps = [b - a for (a, _), (b, _) in zip(steps, steps[1:])]
    assert max(gaps) < HEARTBEAT_MS / 1e3 + 2.0, max(gaps)
    assert "not committed" not in survivor.text()
    for run in runs:  # both end at the last step, with a finite loss
        last = [r for r in MetricsLog.read(str(run / "metrics.jsonl")) if "train_loss" in r][-1]
        assert last["step"] == STEPS and math.isfinite(last["train_loss"]), last


def test_semi_synchronous_settings_name_their_fix():
    with pytest.raises(ConfigError, match="sync must be one of step, local_sgd, diloco"):
        TorchftConfig(groups=2, sync="sometimes")
    with pytest.raises(ConfigError, match="set torchft_config.sync=local_sgd or diloco"):
        TorchftConfig(groups=2, sync_every=10)
    TorchftConfig(groups=2, sync="diloco", sync_every=10)


@pytest.mark.slow
def test_muon_is_refused_under_semi_synchronous_groups(shakespeare, tmp_path):
    """torchft's LocalSGD and DiLoCo hook one optimizer; Muon steps two."""
    pytest.importorskip("torchft")
    from conftest import run_main, tiny_overrides

    ft = ["torchft_config.groups=2", "torchft_config.sync=diloco", "torchft_config.sync_every=5"]
    args = tiny_overrides(shakespeare, tmp_path) + ft + ["optimizer_config.optimizer=muon"]
    result = run_main(args, nproc=1)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "error: torchft_config.sync=diloco hooks one optimizer" in result.stderr


@pytest.mark.slow
def test_semi_synchronous_groups_meet_every_h_steps_and_end_equal(shakespeare, tmp_path):
    """Two groups of local SGD meeting every 5 steps for 20: each hands the model's size to the
    all-reduce once a meeting (4 meetings), and after the last meeting both hold the same model.
    (DiLoCo: the resumed run below.)"""
    sync = "local_sgd"
    pytest.importorskip("torchft")
    from benchmarks.replica_jobs import Lighthouse, group, overrides

    size = dict(steps=20, save_every=10, batch=4)
    extra = [
        f"torchft_config.sync={sync}",
        "torchft_config.sync_every=5",
        "trainer_config.log_every=5",
    ]
    with Lighthouse(min_groups=2) as lighthouse:
        runs = [tmp_path / f"group{g}" for g in (0, 1)]
        jobs = [group(lighthouse, g, overrides(shakespeare, runs[g], size) + extra) for g in (0, 1)]
        codes = [job.wait(timeout=300) for job in jobs]
    assert codes == [0, 0], jobs[1].text()[-3000:]
    assert f"{sync}: meets every 5 steps" in jobs[0].text()
    records = [MetricsLog.read(str(run / "metrics.jsonl")) for run in runs]
    for group_records in records:
        sent = [r["sent_bytes"] for r in group_records if "train_loss" in r]
        assert len(sent) == 4 and sent[0] > 0 and sent == [k * sent[0] for k in (1, 2, 3, 4)]
    finals = [
        [r["val_loss"] for r in group_records if "val_loss" in r][-1] for group_records in records
    ]
    assert finals[0] == finals[1] and math.isfinite(finals[0]), finals


@pytest.mark.slow
def test_semi_synchronous_groups_resumed_mid_interval_meet_on_the_same_steps(shakespeare, tmp_path):
    """DiLoCo every 5 steps, both groups stopped at step 12 (two steps into an interval) and
    resumed to 20 from their snapshots: they meet at 15 and 20 (not 17), so each hands the
    model's size over twice and both end with the same model."""
    pytest.importorskip("torchft")
    from benchmarks.replica_jobs import Lighthouse, group, overrides

    extra = [
        "torchft_config.sync=diloco",
        "torchft_config.sync_every=5",
        "trainer_config.log_every=1",
    ]
    runs = [tmp_path / f"group{g}" for g in (0, 1)]
    for steps in (12, 20):
        size = dict(steps=steps, save_every=100, batch=4)
        with Lighthouse(min_groups=2) as lighthouse:
            jobs = [
                group(lighthouse, g, overrides(shakespeare, runs[g], size) + extra) for g in (0, 1)
            ]
            assert [job.wait(timeout=300) for job in jobs] == [0, 0], jobs[1].text()[-3000:]
    assert all("resume | step 12 |" in job.text() for job in jobs)
    records = [MetricsLog.read(str(run / "metrics.jsonl")) for run in runs]
    meeting = [r["sent_bytes"] for r in records[0] if r.get("step") == 5][0]  # the first run's
    for group_records in records:
        last = [r for r in group_records if "train_loss" in r][-1]
        assert last["step"] == 20 and last["sent_bytes"] == 2 * meeting, last
    finals = [
        [r["val_loss"] for r in group_records if "val_loss" in r][-1] for group_records in records
    ]
    assert finals[0] == finals[1], finals
