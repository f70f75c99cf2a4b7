"""Activation checkpointing (mingpt_ddp/parallel/checkpointing.py, trainer_config.
activation_checkpointing): the same losses and gradients as without it, at least half the default
model's activation memory with full, the same parameter names (a snapshot resumes across the
switch), applied in every parallel mode before compile and wrapping, and a clear refusal of a
value it does not know.

In process (DDP and FSDP at a world of one, over gloo); the compiled check and the DeepSpeed job
(torchrun, 2 ranks) are slow.
"""

import io

import pytest
import torch
import torch.distributed as dist
from conftest import run_main, tiny_overrides

from benchmarks.activation_memory import step_memory
from main import compose, to_job
from mingpt_ddp.config.data import DataConfig
from mingpt_ddp.config.deepspeed import DeepSpeedConfig
from mingpt_ddp.config.optimizer import OptimizerConfig
from mingpt_ddp.config.trainer import TrainerConfig
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.metrics import MetricsLog
from mingpt_ddp.parallel.checkpointing import apply_activation_checkpointing, checkpointed
from mingpt_ddp.parallel.plan import Plan
from mingpt_ddp.parallel.registry import build_strategy
from mingpt_ddp.parallel.strategy import StrategyArgs
from mingpt_ddp.runtime.distributed import ControlPlane, DistContext
from model import GPT, Block, GPTConfig
from trainer import step

VOCAB = 65


def gpt(n_layer=4, n_head=2, n_embd=16, block_size=8, **switches) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer, n_head, n_embd, vocab_size=VOCAB, block_size=block_size, **switches)
    return GPT(cfg)


def batch(b=3, t=8, seed=1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, VOCAB, (b, t), generator=g) for _ in "xy")


def strategy(parallel: str, setting: str, compile: bool = False, **switches):
    plan = Plan(parallel=parallel, activation_checkpointing=setting, compile=compile)
    ctx = DistContext(0, 0, 1, torch.device("cpu"))
    args = StrategyArgs(plan, ctx, OptimizerConfig(), 3, 2, ControlPlane(), DeepSpeedConfig())
    return build_strategy(parallel, gpt(**switches), args)


def train(s, micro: list) -> torch.Tensor:
    """One optimizer step over the micro-batches (the Trainer's step); this rank's mean loss."""
    loss, applied = step(s, iter(micro), len(micro), OptimizerConfig().grad_clip)
    assert applied
    return loss


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # an FSDP shard: the whole tensor


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# ------------------------------------------------------------------------- which blocks
@pytest.mark.parametrize(
    "setting, blocks",
    [
        ("none", []),
        ("full", [0, 1, 2, 3]),
        ("every-2", [0, 2]),
        ("every-3", [0, 3]),
        ("every-9", [0]),
    ],
)
def test_the_setting_checkpoints_the_first_block_and_every_kth_after_it(setting, blocks):
    model = gpt()
    assert apply_activation_checkpointing(model, setting) == len(blocks)
    assert apply_activation_checkpointing(model, setting) == len(blocks)  # again: no double wrap
    chosen = [b for b in model.blocks if getattr(b.forward, "func", None) is checkpointed]
    assert chosen == [model.blocks[i] for i in blocks]
    for block in chosen:  # the block's own forward, not a second checkpointed layer
        assert block.forward.args[0].__func__ is Block.forward


@pytest.mark.parametrize("value", ["every", "every-0", "every-x", "every_2", "all", "Full", "2"])
def test_a_value_it_does_not_know_is_refused_in_one_line_naming_the_accepted_ones(value):
    with pytest.raises(ConfigError) as refused:
        TrainerConfig(activation_checkpointing=value)
    assert str(refused.value) == (
        "trainer_config.activation_checkpointing must be none, full or every-K "
        f"(K a whole number from 1, e.g. every-2), got {value!r}"
    )


def test_the_command_line_takes_every_k_unquoted_and_refuses_a_bad_one():
    job = to_job(compose(["trainer_config.activation_checkpointing=every-2"]))
    assert job.trainer_config.activation_checkpointing == "every-2"
    assert to_job(compose([])).trainer_config.activation_checkpointing == "none"
    with pytest.raises(ConfigError, match="got 'every-0'"):
        to_job(compose(["trainer_config.activation_checkpointing=every-0"]))


# ------------------------------------------------------------------ the same numbers, less memory
@pytest.mark.parametrize("setting", ["full", "every-2"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_losses_and_gradients_equal_those_without_it(setting, dropout):
    """fp32; with dropout too: each checkpointed block saves the RNG state, so the recompute draws
    the same masks."""
    x, y = batch()
    results = []
    for spec in ("none", setting):
        model = gpt(dropout=dropout, attn_dropout=dropout)
        apply_activation_checkpointing(model, spec)
        torch.manual_seed(7)
        _, loss = model(x, y)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (plain, plain_grads), (ckpt, ckpt_grads) = results
    torch.testing.assert_close(ckpt, plain, rtol=0, atol=1e-6)
    assert plain_grads.keys() == ckpt_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=0, atol=1e-6, msg=name)


def test_full_at_least_halves_the_default_models_activation_memory():
    """The default run's model, context and batch (the dataclasses' defaults), fp32: tensor bytes
    held for backward when forward ends, and the peak over forward and backward (recomputation
    included), counted by benchmarks/activation_memory.py's LiveTensorBytes: deterministic."""
    g, t, b = GPTConfig(), DataConfig().block_size, TrainerConfig().batch_size
    x, y = batch(b, t)
    mem = {}
    for setting in ("none", "every-2", "full"):
        model = gpt(g.n_layer, g.n_head, g.n_embd, block_size=t)
        apply_activation_checkpointing(model, setting)
        mem[setting] = step_memory(model, x, y)
    none, every2, whole = mem["none"], mem["every-2"], mem["full"]
    assert whole["peak"] <= none["peak"] / 2 and whole["held"] <= none["held"] / 2, mem
    assert whole["peak"] < every2["peak"] < none["peak"], mem
    assert none["peak"] > 10e6  # the count sees the activations (18 MB here), not a few tensors


# ---------------------------------------------------------------- names, snapshots, every mode
def test_parameter_names_are_unchanged_so_a_snapshot_resumes_across_the_switch():
    x, y = batch()
    plain, ckpt = strategy("none", "none"), strategy("none", "full")
    assert list(plain.model.state_dict()) == list(ckpt.model.state_dict())
    assert [n for n, _ in plain.model.named_parameters()] == [
        n for n, _ in ckpt.model.named_parameters()
    ]
    for writer, reader in [(ckpt, plain), (plain, ckpt)]:  # each way
        train(writer, [(x, y)])
        saved = io.BytesIO()
        torch.save(writer.tensor_state(), saved)
        saved.seek(0)
        reader.load_tensor_state(torch.load(saved, weights_only=True))
        for s in (writer, reader):  # the next step: the same from the same state
            train(s, [(x, y)])
        for a, b in zip(writer.model.parameters(), reader.model.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("parallel", ["none", "ddp", "fsdp"])
def test_every_mode_trains_the_same_with_it_and_says_so(parallel, world_of_one):
    micro = [batch(seed=s) for s in (1, 2)]
    runs = {}
    for setting in ("none", "full"):
        s = strategy(parallel, setting)
        losses = [train(s, micro).item() for _ in range(2)]
        runs[setting] = (losses, [full(p).detach() for p in s.model.parameters()], s.describe())
    (plain_losses, plain_params, plain_words), (losses, params, words) = runs.values()
    assert losses == pytest.approx(plain_losses, abs=1e-6)
    for a, b in zip(params, plain_params, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert "checkpointing" not in plain_words[0]
    assert words[0] == plain_words[0] + " + activation checkpointing (4 of 4 blocks)"


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["none", "fsdp"])
def test_compiled_checkpointed_blocks_train_like_eager_ones(parallel, world_of_one):
    """Checkpointing goes in before compile: compile traces each checkpointed block as a region
    whose insides it recomputes (the whole model at once, or block by block under FSDP)."""
    micro = [batch(seed=1)]
    eager, compiled = strategy(parallel, "none"), strategy(parallel, "full", compile=True)
    for _ in range(2):
        want = train(eager, micro).item()
        assert train(compiled, micro).item() == pytest.approx(want, abs=1e-5)
    for a, b in zip(compiled.model.parameters(), eager.model.parameters(), strict=True):
        torch.testing.assert_close(full(a), full(b), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_deepspeed_zero3_trains_the_same_losses_with_it(shakespeare, tmp_path):
    """ZeRO-3 gathers each layer's parameters in hooks that the recompute runs again, inside
    backward: the checkpointed job (torchrun, 2 ranks) takes the same steps as DDP without."""
    pytest.importorskip("deepspeed", reason='pip install -e ".[deepspeed]"')
    losses = {}
    for parallel, setting in [("ddp", "none"), ("zero3", "full")]:
        run_dir = tmp_path / parallel
        settings = dict(max_steps=6, log_every=1, save_every=6, eval_every=6)
        args = tiny_overrides(shakespeare, run_dir, **settings, activation_checkpointing=setting)
        result = run_main(args + [f"parallel={parallel}"], nproc=2)
        assert result.returncode == 0, result.stderr[-3000:]
        records = MetricsLog.read(str(run_dir / "metrics.jsonl"))
        # Flat: pytest.approx (9.2 on) takes no nested sequences.
        losses[parallel] = [
            value
            for r in records
            if "train_loss" in r
            for value in (r["train_loss"], r["grad_norm"])
        ]
    assert "ZeRO-3 + activation checkpointing (2 of 2 blocks)" in result.stdout
    assert losses["zero3"] == pytest.approx(losses["ddp"], abs=1e-5)
