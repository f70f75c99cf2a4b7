"""Tensor, sequence and context parallelism (tensor_config, context_config): each layout trains
what one process trains and sends the bytes its formula predicts (benchmarks/parallelisms.py),
a SIGKILLed tp2 job resumes exactly and its snapshot resumes without tensor parallelism, and
what they cannot run is refused in one line.

The runs through main.py are 8 steps of the tiny model (2 blocks, 2 heads, width 32) with a
global batch of 4 windows: one process, or 2 ranks of tensor parallelism on the same windows.
"""

import shutil

import pytest
import torch
from conftest import assert_same_run, parallelisms, run_faulty, run_main, tiny_overrides

from mingpt_ddp.config.context import ContextConfig
from mingpt_ddp.config.mesh import MeshConfig
from mingpt_ddp.config.optimizer import OptimizerConfig
from mingpt_ddp.config.pipeline import PipelineConfig
from mingpt_ddp.config.tensor import TensorConfig
from mingpt_ddp.config.trainer import TrainerConfig
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.metrics import MetricsLog
from mingpt_ddp.parallel.grid import GridStrategy
from mingpt_ddp.parallel.plan import Plan, replica
from mingpt_ddp.parallel.strategy import StrategyArgs
from mingpt_ddp.runtime.distributed import DistContext

STEPS = dict(max_steps=8, log_every=1, eval_every=4, save_every=4, sample_chars=24)


def ok(result) -> str:
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    return result.stdout


def history(run_dir) -> list[dict]:
    return MetricsLog.read(str(run_dir / "metrics.jsonl"))


def samples(out: str) -> list[str]:
    return [line.split("sample:", 1)[1] for line in out.splitlines() if "sample:" in line]


# ------------------------------------------------------------- in process


def test_heads_first_gives_each_rank_its_own_heads_q_k_and_v():
    from mingpt_ddp.parallel.tensor import heads_first

    C, nh, tp = 8, 4, 2  # head size 2
    rows = [(part, row // 2) for part in "qkv" for row in range(C)]  # (q/k/v, head) per row
    order = heads_first(C, tp)
    for rank in range(tp):
        mine = [rows[i] for i in order[rank * 3 * C // tp : (rank + 1) * 3 * C // tp]]
        heads = set(range(rank * nh // tp, (rank + 1) * nh // tp))
        assert [p for p, _ in mine] == ["q"] * 4 + ["k"] * 4 + ["v"] * 4
        assert {h for _, h in mine} == heads  # whole heads, the same ones for q, k and v
    assert sorted(order.tolist()) == list(range(3 * C))


def test_balanced_chunks_cover_the_window_and_give_each_rank_the_same_causal_work():
    from mingpt_ddp.parallel.ring import balanced_positions

    T = 16
    for degree in (2, 4):
        held = [balanced_positions(T, degree, r) for r in range(degree)]
        assert sorted(torch.cat(held).tolist()) == list(range(T))
        work = {int((p + 1).sum()) for p in held}  # keys each rank's queries see, causally
        assert len(work) == 1, work
    assert balanced_positions(T, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]


class _Logged(torch.utils._python_dispatch.TorchDispatchMode):
    """Logs each batched matmul (a block's compute) into log, beside the ring's posts and waits."""

    def __init__(self, log: list[str]):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.bmm.default:
            self.log.append("mm")
        return func(*args, **(kwargs or {}))


def _fake_ring(n: int, index: int, log: list[str]):
    """A RingAttention of n ranks without a group: post() logs and hands the tensor back."""
    from mingpt_ddp.parallel.ring import RingAttention

    ring = object.__new__(RingAttention)
    ring.ranks, ring.index, ring._visible = list(range(n)), index, {}

    class InFlight:
        def __init__(self, tensor, tag):
            self.tensor, self.tag = tensor, tag

        def wait(self):
            log.append(f"wait{self.tag}")
            return self.tensor.clone()

    def post(tensor, tag=0):
        log.append(f"post{tag}")
        return InFlight(tensor, tag)

    ring.post = post
    return ring


def test_the_ring_posts_each_send_before_the_block_it_overlaps_and_waits_after_it():
    """Forward: step s's K, V leave before its block is computed and are waited for after it.
    Backward: K, V likewise (tag 0); the gradients (tag 1) of a block travel while the next block
    is computed, waited for just before this rank adds its share, the last hop home at the end."""
    from mingpt_ddp.parallel.ring import _ring_backward, _ring_forward

    B, nh, T_local, hs, n = 1, 2, 4, 8, 3
    q, k, v, d_out = (torch.randn(B, nh, T_local, hs) for _ in range(4))
    log: list[str] = []
    ring = _fake_ring(n, 1, log)
    with _Logged(log):
        out, lse = _ring_forward(q, torch.stack([k, v]), ring)
    assert log == ["post0", "mm", "mm", "wait0"] * (n - 1) + ["mm", "mm"]
    log.clear()
    with _Logged(log):
        _ring_backward(q, k, v, out, lse, d_out, ring)
    block = ["mm"] * 5
    assert log == (
        ["post0", *block, "post1", "wait0"]  # step 0: nothing to add to yet
        + ["post0", *block, "wait1", "post1", "wait0"]
        + [*block, "wait1", "post1"]  # the last step: no K, V to fetch; the gradients go home
        + ["wait1"]
    )


def test_the_ring_makes_its_masks_on_the_tensors_device_without_a_copy():
    """No host round trip: positions and masks are made where the tensors are (here "meta",
    which has no data to copy: a .to() would show as aten._to_copy), once per source."""
    from mingpt_ddp.parallel.ring import balanced_positions

    seen: list[str] = []

    class Ops(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    ring = _fake_ring(2, 0, [])
    with Ops():
        mask = ring.visible(4, 1, torch.device("meta"))
    assert mask.device.type == "meta" and mask.shape == (4, 4)
    assert not [op for op in seen if "copy" in op], seen
    assert ring.visible(4, 1, torch.device("meta")) is mask  # every layer reuses it
    cpu = ring.visible(4, 1, torch.device("cpu"))  # the same mask as the positions say
    mine, theirs = balanced_positions(8, 2, 0), balanced_positions(8, 2, 1)
    assert torch.equal(cpu, mine[:, None] >= theirs[None, :])


def test_the_mesh_puts_tp_innermost_and_refuses_degrees_that_do_not_divide():
    plan = Plan(parallel="fsdp", tensor=TensorConfig(degree=2))
    dims = plan.dims(4)
    assert dims.shape() == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2}
    assert [dims.coordinates(r)["tp"] for r in range(4)] == [0, 1, 0, 1]
    assert [replica(r, 4, plan) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    with pytest.raises(
        ConfigError, match=r"\(mesh_config.tp=2 = 2 ranks\) must divide the world size 3"
    ):
        plan.dims(3)
    with pytest.raises(ConfigError, match="set mesh_config.tp to 2 or more"):
        Plan.of(TrainerConfig(), torch.device("cpu"), tensor=TensorConfig(sequence_parallel=True))
    with pytest.raises(ConfigError, match="context_config.degree must be 1 or more"):
        ContextConfig(degree=0)
    with pytest.raises(ConfigError, match="mesh_config.cp must be 1 or more"):
        MeshConfig(cp=0)


def args(world: int, optimizer: str = "adamw", **plan) -> StrategyArgs:
    ctx = DistContext(0, 0, world, torch.device("cpu"))
    return StrategyArgs(Plan(**plan), ctx, OptimizerConfig(optimizer=optimizer), 4, 1, None, None)


@pytest.mark.parametrize(
    "made, refused",
    [
        (args(2, "muon", tensor=TensorConfig(2)), "muon needs .* mesh_config.tp=2 splits"),
        (args(2, tensor=TensorConfig(2), compile=True), "set compile=false"),
        (args(4, pipeline=PipelineConfig(2), tensor=TensorConfig(2, True)), "sequence_parallel"),
    ],
)
def test_each_split_refuses_what_it_would_run_wrongly_naming_the_fix(made, refused):
    with pytest.raises(ConfigError, match=refused):
        GridStrategy.check(made)
    GridStrategy.check(args(4, parallel="fsdp", tensor=TensorConfig(2)))


@pytest.mark.parametrize(
    "made",
    [
        args(4, tensor=TensorConfig(2)),  # 2 DDP replicas x tp 2 (once: "use fsdp")
        args(2, parallel="fsdp", context=ContextConfig(2)),  # cp under FSDP (once: "use ddp")
        args(4, pipeline=PipelineConfig(2), context=ContextConfig(2)),  # pp x cp
    ],
)
def test_the_combinations_one_mesh_composes_are_accepted(made):
    GridStrategy.check(made)


def test_context_with_tensor_parallelism_is_accepted_on_one_grid():
    made = args(4, tensor=TensorConfig(2), context=ContextConfig(2))
    GridStrategy.check(made)  # once refused: "cp x tp is not built yet"
    dims = made.plan.dims(4)
    assert dims.shape() == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 2}
    assert [dims.coordinates(r)["cp"] for r in range(4)] == [0, 0, 1, 1]  # tp innermost
    assert [replica(r, 4, made.plan) for r in range(4)] == [(0, 1)] * 4  # one replica: same data


# ------------------------------------------------------------- through torchrun


@pytest.mark.slow
def test_parallelisms_tp_sp_cp_match_one_process_and_send_what_the_formulas_say(tmp_path):
    rows, _ = parallelisms(tmp_path, "tp2,tp2 sp,cp2,dp2 fsdp x tp2,tp2 x cp2")
    for r in rows.values():
        assert r["sent_bytes_per_step"] == r["sent_bytes_formula"] > 0, r  # counted = predicted
    tp, sp, cp = rows["tp2"], rows["tp2 sp"], rows["cp2"]
    assert tp["degrees"] == {"dp_replicate": 1, "dp_shard": 1, "tp": 2, "cp": 1, "pp": 1, "ep": 1}
    assert sp["sequence_parallel"] and rows["tp2 x cp2"]["degrees"]["cp"] == 2
    # TP's 4 all-reduces per block become all-gathers + reduce-scatters of the same bytes
    assert set(tp["sent_bytes_by_op"][0]) >= {"_c10d_functional::all_reduce"}
    assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= {
        op.split("::")[-1] for op in sp["sent_bytes_by_op"][0]
    }
    # half the parameters' split matrices per rank; SP and CP hold fewer activations than TP
    assert tp["param_bytes_per_rank"] == pytest.approx(tp["param_bytes_formula"], rel=0.01)
    assert sp["activation_bytes_per_rank"] < tp["activation_bytes_per_rank"]
    assert cp["activation_bytes_per_rank"] == pytest.approx(cp["activation_bytes_formula"], 0.05)


@pytest.fixture(scope="module")
def one_process(shakespeare, tmp_path_factory):
    """The reference: one process, batch_size 4, 8 steps; its run directory and output."""
    run_dir = tmp_path_factory.mktemp("one-process")
    out = ok(run_main(tiny_overrides(shakespeare, run_dir, **STEPS)))
    return run_dir, out


@pytest.mark.slow
def test_a_sigkilled_tp2_job_resumes_exactly_and_its_snapshot_resumes_at_tp1(
    one_process, shakespeare, tmp_path
):
    reference, reference_out = one_process
    args = tiny_overrides(shakespeare, tmp_path, **STEPS) + ["tensor_config.degree=2"]
    out = run_faulty(args, "kill:1:6")
    assert "tensor parallel 2 x 1 replica" in out
    assert "fault | rank 1 | kill before step 7" in out and "resume | step 4 |" in out, out
    assert_same_run(history(reference), history(tmp_path), 8)  # steps 5-6 redone alike
    assert samples(out)[-1] == samples(reference_out)[-1]  # the whole model, put together

    # The tp2 snapshot (DCP shards, QKV rows whole) read by one process: 4 more steps equal
    # one process resumed from its own step-8 snapshot.
    more = dict(STEPS, max_steps=12)
    one = tmp_path.parent / f"{tmp_path.name}-one"
    shutil.copytree(reference, one)
    ok(run_main(tiny_overrides(shakespeare, one, **more)))
    out = ok(run_main(tiny_overrides(shakespeare, tmp_path, **more)))
    assert "resume | step 8 |" in out and "saved at world size 2, now 1" in out
    assert_same_run(history(one), history(tmp_path), 12)
