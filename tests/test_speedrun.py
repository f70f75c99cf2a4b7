"""The speedrun's switches (model.py) and optimizers and schedules (mingpt_ddp/optim.py): each
switch trains, does what it says, and Muon is correct under DDP and resumes exactly."""

import math
import signal

import pytest
import torch
from conftest import run_main, start_main, tiny_gpt, tiny_overrides, wait_for_line

from mingpt_ddp.config.optimizer import OptimizerConfig
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.metrics import MetricsLog
from mingpt_ddp.optim import Muon, build_optimizers, check_muon_supported, set_learning_rates
from mingpt_ddp.snapshots.store import SnapshotStore
from model import GPT, GPTConfig, Rotary, rotate

V, T = 13, 16


def tiny(**switches) -> GPT:
    return tiny_gpt(
        vocab_size=V, block_size=T, **switches
    )  # the test models' tiny GPT, at this file's V, T


SWITCHES = [
    {},
    {"rotary": True},
    {"qk_norm": True},
    {"activation": "relu2"},
    {"zero_init_proj": True},
    {"tie_embeddings": False},
    {"logit_softcap": 5.0},
    {
        "rotary": True,
        "qk_norm": True,
        "activation": "relu2",
        "zero_init_proj": True,
        "tie_embeddings": False,
        "logit_softcap": 5.0,
    },
]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("switches", SWITCHES, ids=lambda s: "+".join(s) or "nanoGPT")
def test_each_switch_on_or_off_learns_a_fixed_batch(switches, optimizer):
    model = tiny(**switches)
    optimizers = build_optimizers(
        model, OptimizerConfig(optimizer=optimizer, learning_rate=1e-2, muon_lr=0.05), "cpu"
    )
    x, y = torch.randint(0, V, (2, 4, T), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(30):
        loss = model(x, y)[1]
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.6 * losses[0]  # memorising 4 windows: the loss must fall a long way


def test_rotary_attention_scores_depend_only_on_the_distance_between_positions():
    rope = Rotary(head_size=8, block_size=32)(torch.arange(32))  # positions 0..31
    q, k = torch.randn(2, 8)

    def at(
        vector, pos
    ):  # the vector at one position of a (B=1, T=32, 1, nh=1, hs=8) tensor, rotated
        x = torch.zeros(1, 32, 1, 1, 8)
        x[0, pos, 0, 0] = vector
        return rotate(x, rope)[0, pos, 0, 0]

    score = lambda i, j: (at(q, i) @ at(k, j)).item()
    assert score(5, 2) == pytest.approx(score(25, 22), abs=1e-5)  # same distance, anywhere
    assert score(5, 2) != pytest.approx(score(5, 4), abs=1e-3)  # another distance, another score
    assert "wpe.weight" not in dict(
        tiny(rotary=True).named_parameters()
    )  # no position table to learn


def test_zero_init_and_an_untied_head_start_from_a_uniform_prediction():
    model = tiny(zero_init_proj=True, tie_embeddings=False)
    assert model.lm_head.weight is not model.wte.weight
    assert all(
        p.abs().sum() == 0 for name, p in model.named_parameters() if name.endswith("proj.weight")
    )
    idx = torch.randint(0, V, (2, T))
    assert model(idx, idx)[1].item() == pytest.approx(math.log(V))  # zero logits: every token 1/V
    assert tiny(tie_embeddings=False).num_params() == tiny().num_params() + V * 16


def test_softcap_bounds_the_logits_and_relu2_squares_the_positive_part():
    idx = torch.randint(0, V, (2, T))
    capped, free = tiny(logit_softcap=0.5), tiny()
    with torch.no_grad():
        capped.wte.weight.mul_(100)
        free.wte.weight.mul_(100)
    assert free(idx)[0].abs().max() > 5 and capped(idx)[0].abs().max() <= 0.5
    relu2 = tiny(activation="relu2").blocks[0].mlp.activation
    assert torch.equal(relu2(torch.tensor([-2.0, 0.0, 3.0])), torch.tensor([0.0, 0.0, 9.0]))
    with pytest.raises(
        ConfigError, match="gpt_config.activation must be one of gelu, gelu_tanh, relu2"
    ):
        GPTConfig(activation="swish")


def test_muon_owns_the_blocks_matrices_and_adamw_the_rest():
    model = tiny(tie_embeddings=False)
    adamw, muon = build_optimizers(model, OptimizerConfig(optimizer="muon"), "cpu")
    names = {id(p): name for name, p in model.named_parameters()}
    muon_names = {names[id(p)] for group in muon.param_groups for p in group["params"]}
    assert muon_names == {
        n for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks.")
    }
    adamw_names = {names[id(p)] for group in adamw.param_groups for p in group["params"]}
    assert {
        "wte.weight",
        "lm_head.weight",
        "ln_f.weight",
    } <= adamw_names and not adamw_names & muon_names
    assert len(build_optimizers(model, OptimizerConfig(), "cpu")) == 1  # adamw: AdamW alone


def test_batched_muon_takes_exactly_the_steps_torch_muon_takes():
    torch.manual_seed(0)
    shapes = [
        (24, 8),
        (8, 8),
        (24, 8),
        (8, 32),
        (8, 8),
    ]  # tall, square and wide; some shapes repeat
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt_ours, opt_theirs = Muon(ours, lr=0.02), torch.optim.Muon(theirs, lr=0.02)
    for _ in range(3):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt_ours.step()
        opt_theirs.step()
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(ours, theirs))
    assert opt_ours.state_dict()["state"].keys() == opt_theirs.state_dict()["state"].keys()


@pytest.mark.parametrize("parallel", ["fsdp", "deepspeed"])
def test_muon_is_refused_where_matrices_are_split_over_ranks(parallel):
    with pytest.raises(ConfigError, match=f"parallel={parallel} splits them; use parallel=ddp"):
        check_muon_supported(OptimizerConfig(optimizer="muon"), parallel)
    check_muon_supported(OptimizerConfig(optimizer="adamw"), parallel)  # AdamW is elementwise: fine


def test_warmup_stable_decay_holds_the_peak_then_falls_in_a_straight_line():
    cfg = OptimizerConfig(
        optimizer="muon",
        schedule="wsd",
        learning_rate=1e-2,
        min_lr=1e-3,
        warmup_steps=10,
        decay_frac=0.2,
        muon_lr=0.04,
    )
    assert cfg.lr_at(4, 100) == pytest.approx(5e-3)  # warmup
    assert (
        cfg.lr_at(10, 100) == cfg.lr_at(80, 100) == pytest.approx(1e-2)
    )  # stable until the last 20 steps
    assert cfg.lr_at(90, 100) == pytest.approx(5.5e-3)  # halfway down
    assert cfg.lr_at(100, 100) == pytest.approx(1e-3)
    optimizers = build_optimizers(tiny(), cfg, "cpu")
    set_learning_rates(optimizers, cfg, 90, 100)
    assert optimizers[0].param_groups[0]["lr"] == pytest.approx(5.5e-3)
    assert optimizers[1].param_groups[0]["lr"] == pytest.approx(
        0.04 * 0.55
    )  # Muon's peak, the same shape


MUON = {
    "optimizer_config.optimizer": "muon",
    "optimizer_config.muon_lr": 0.05,
    "optimizer_config.warmup_steps": 5,
    "gpt_config.rotary": "true",
    "gpt_config.activation": "relu2",
    "gpt_config.qk_norm": "true",
}


def muon_args(shakespeare, run_dir, nproc, batch_size, max_steps) -> list[str]:
    return tiny_overrides(
        shakespeare,
        run_dir,
        batch_size=batch_size,
        max_steps=max_steps,
        log_every=1,
        save_every=10,
        eval_every=10,
        parallel="ddp" if nproc else "none",
    ) + [f"{k}={v}" for k, v in MUON.items()]


def muon_run(shakespeare, run_dir, nproc, batch_size, max_steps) -> list[dict]:
    result = run_main(muon_args(shakespeare, run_dir, nproc, batch_size, max_steps), nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    return MetricsLog.read(str(run_dir / "metrics.jsonl"))


@pytest.fixture(scope="module")
def muon_ddp(shakespeare, tmp_path_factory):
    """A Muon run under DDP, 2 ranks x 4 windows, 30 steps saved every 10: the uninterrupted run the
    resumed one is compared with. Returns its run directory and metrics records."""
    run_dir = tmp_path_factory.mktemp("muon-ddp")
    return run_dir, muon_run(shakespeare, run_dir, nproc=2, batch_size=4, max_steps=30)


@pytest.mark.slow
def test_muon_under_ddp_takes_the_single_process_steps_on_the_same_global_batch(
    shakespeare, tmp_path
):
    """Every replica orthogonalises the same all-reduced gradient: 2 ranks x 4 windows = 1 process
    x 8."""
    # 20 steps (not the 30 of muon_ddp): bf16 Newton-Schulz rounding differences grow with the
    # steps.
    ddp = muon_run(shakespeare, tmp_path / "ddp", nproc=2, batch_size=4, max_steps=20)
    single = muon_run(shakespeare, tmp_path / "one", nproc=0, batch_size=8, max_steps=20)
    losses = [(a["train_loss"], b["train_loss"]) for a, b in zip(ddp, single) if "train_loss" in a]
    assert len(losses) == 20
    # Equal but for float summation order (an all-reduce of two halves vs one sum), which bf16
    # Newton-Schulz may round differently: a wrong gradient (one rank's half) is off by far more.
    assert all(a == pytest.approx(b, rel=2e-3) for a, b in losses), losses
    assert losses[-1][0] < losses[0][0] - 0.3  # and it learns


@pytest.mark.slow
def test_muon_resumes_bitwise_exactly_and_refuses_adamw_on_its_snapshot(
    muon_ddp, shakespeare, tmp_path
):
    """Stopped by SIGTERM after its step-10 snapshot and resumed, a Muon run under DDP equals one
    never stopped: the same losses, weights and momentum buffers, bit for bit (the momentum is in
    the snapshot)."""
    straight_dir, straight = muon_ddp
    args = muon_args(shakespeare, tmp_path / "resumed", nproc=2, batch_size=4, max_steps=30)
    job = start_main(args, nproc=2)
    lines = wait_for_line(job, "snapshot | step 10")
    job.send_signal(
        signal.SIGTERM
    )  # torchrun forwards it: the ranks finish the step, save and exit
    log = "".join(lines) + job.communicate(timeout=60)[0]
    assert "preempted | SIGTERM received | saving step" in log, log[-2000:]
    resumed = muon_run(shakespeare, tmp_path / "resumed", nproc=2, batch_size=4, max_steps=30)
    assert [r["train_loss"] for r in straight if "train_loss" in r] == [
        r["train_loss"] for r in resumed if "train_loss" in r
    ]
    a, b = (
        SnapshotStore(str(d / "snapshots")).load_latest()
        for d in (straight_dir, tmp_path / "resumed")
    )
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    momenta = [(k, v) for k, v in a["optimizer"]["state"].items() if "momentum_buffer" in v]
    assert momenta and all(
        torch.equal(v["momentum_buffer"], b["optimizer"]["state"][k]["momentum_buffer"])
        for k, v in momenta
    )
    refused = run_main(
        tiny_overrides(shakespeare, tmp_path / "resumed", max_steps=40, parallel="none")
        + [f"{k}={v}" for k, v in MUON.items() if k.startswith("gpt_config")],
        timeout=120,
    )
    assert refused.returncode == 1
    assert (
        "holds muon state, and this run uses adamw; resume with optimizer_config.optimizer=muon"
        in refused.stderr
    )
