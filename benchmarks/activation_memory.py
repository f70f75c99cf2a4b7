"""Activation checkpointing (trainer_config.activation_checkpointing): the memory it saves and the
time it costs, none against every-2 against full.

    python benchmarks/activation_memory.py            # the default model and batch, fp32 and auto
    python benchmarks/activation_memory.py --large    # also gpt-mini at context 256, batch 16

For each model, precision and setting, memory counted three ways and by the kernel, and time:
- held after forward: the bytes of the tensors alive when forward ends, what backward will read
  (the logits and loss included), counted by LiveTensorBytes below;
- peak activations: the most bytes alive at once over forward and backward, counting the
  activations, the blocks recomputed in backward and the gradients of activations, not the
  parameters' gradients (the same whatever is checkpointed; the next column adds them);
- peak RSS delta: how far a fresh process's resident memory rises over 3 steps (optimizer
  included) above where it rests after a warm-up step, the kernel's measure, independent of the
  count: with malloc unmapping every freed block over 64 KiB it agrees with the count's peak
  with gradients to within 2%;
- ms/step: a whole step as main.py takes it (trainer.step: forward, backward, clipping,
  AdamW), the median of every timed step, in rounds that take the settings in turn so that a
  machine whose speed drifts slows all of them alike.

Why count tensors, not the autograd's saved-tensor hooks: checkpointing itself works through
those hooks, and its own pair shadows an outer one inside each checkpointed block, so an outer
pair would see almost nothing there, neither the block inputs checkpointing keeps nor the
recomputed activations. A dispatch mode sees every op that makes a tensor, including backward's
and the recompute's, and the count is deterministic (tests/test_activation_checkpointing.py
asserts it). Only eager mode: compiled code allocates its buffers where no mode sees them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.common import hardware  # noqa: E402
from mingpt_ddp.config.data import DataConfig  # noqa: E402
from mingpt_ddp.config.deepspeed import DeepSpeedConfig  # noqa: E402
from mingpt_ddp.config.optimizer import OptimizerConfig  # noqa: E402
from mingpt_ddp.config.trainer import TrainerConfig  # noqa: E402
from mingpt_ddp.parallel.grid import GridStrategy  # noqa: E402
from mingpt_ddp.parallel.plan import Plan, choose_precision  # noqa: E402
from mingpt_ddp.parallel.strategy import StrategyArgs  # noqa: E402
from mingpt_ddp.runtime.distributed import ControlPlane, DistContext  # noqa: E402
from mingpt_ddp.runtime.host import keep_freed_cpu_memory  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from trainer import step  # noqa: E402

SETTINGS = ("none", "every-2", "full")
VOCAB = 65  # tinyshakespeare's characters
OUT = os.path.join(REPO, "benchmarks", "results", "activation_memory.json")


def tensors(tree) -> list[torch.Tensor]:
    return [
        t for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.layout == torch.strided
    ]


class LiveTensorBytes(TorchDispatchMode):
    """Every tensor storage the ops run under it create, from the op that makes it until it is
    freed: a timeline of (id, +bytes) when one is made and (id, -bytes) when it is gone. A view of
    an input, or an op writing in place, makes none. Freed storages are noticed at the next op."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int, int]] = {}  # address: (ref, id, bytes)
        self.events: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.collect()
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tensors((args, kwargs))}
        for t in tensors(out):
            storage = t.untyped_storage()
            if storage._cdata not in inputs and storage._cdata not in self.live:
                # The weak reference keeps the address from being reused while it is tracked.
                ident = len(self.events)
                self.live[storage._cdata] = (StorageWeakRef(storage), ident, storage.nbytes())
                self.events.append((ident, storage.nbytes()))
        return out

    def collect(self) -> None:
        for address in [a for a, (ref, _, _) in self.live.items() if ref.expired()]:
            _, ident, nbytes = self.live.pop(address)
            self.events.append((ident, -nbytes))

    def now(self) -> int:
        self.collect()
        return sum(nbytes for _, _, nbytes in self.live.values())

    def ids_of(self, some: list[torch.Tensor]) -> set[int]:
        addresses = {t.untyped_storage()._cdata for t in some}
        return {ident for address, (_, ident, _) in self.live.items() if address in addresses}

    def peak(self, leaving_out: set[int] = frozenset()) -> int:
        """The most bytes alive at once so far, leaving out the storages with those ids."""
        self.collect()
        now = top = 0
        for ident, delta in self.events:
            if ident not in leaving_out:
                now += delta
                top = max(top, now)
        return top


def step_memory(model, x, y, precision=nullcontext) -> dict[str, int]:
    """Bytes of one forward and backward (see the module's docstring): held after forward, peak
    activations, peak with the parameters' gradients."""
    model.zero_grad(set_to_none=True)
    with LiveTensorBytes() as live:
        with precision():
            _, loss = model(x, y)
        held = live.now()
        loss.backward()
        grads = live.ids_of([p.grad for p in model.parameters() if p.grad is not None])
        return {"held": held, "peak": live.peak(grads), "peak_with_grads": live.peak()}


ATTENTION_FP32: dict[str, bool] = {}  # per model and precision: the first build's choice


def build(case: dict, setting: str) -> tuple[GridStrategy, torch.Tensor, torch.Tensor]:
    """The model of case, checkpointed by setting, in the strategy main.py runs on one process.
    Under bf16 autocast the strategy times attention in bf16 and fp32 and picks the faster; every
    setting of one case keeps the first build's pick, so that they compute alike."""
    torch.manual_seed(0)
    n_layer, n_head, n_embd = case["shape"]
    cfg = GPTConfig(n_layer, n_head, n_embd, vocab_size=VOCAB, block_size=case["block"])
    plan = Plan(parallel="none", use_amp=case["amp"], activation_checkpointing=setting)
    ctx = DistContext(0, 0, 1, torch.device("cpu"))
    args = StrategyArgs(
        plan, ctx, OptimizerConfig(), case["batch"], 1, ControlPlane(), DeepSpeedConfig()
    )
    strategy = GridStrategy(GPT(cfg), args)
    if strategy.attention_fp32 is not None:
        key = f"{case['model']} {case['precision']}"
        strategy.set_attention_fp32(ATTENTION_FP32.setdefault(key, strategy.attention_fp32))
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, VOCAB, (case["batch"], case["block"]), generator=g) for _ in "xy")
    return strategy, x, y


def train_step(strategy: GridStrategy, x: torch.Tensor, y: torch.Tensor) -> None:
    """One optimizer step on the batch (x, y), as the Trainer takes it (trainer.step)."""
    step(strategy, iter([(x, y)]), 1, strategy.args.optim.grad_clip)


def status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM: its peak)."""
    with open("/proc/self/status") as f:
        return 1024 * int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def peak_rss_delta(case: dict, setting: str) -> int:
    """Child process: how far its resident memory rises over 3 steps above where it rests after a
    warm-up step (bytes). The peak is reset first (Linux >= 4.0): a child inherits its parent's
    through fork."""
    strategy, x, y = build(case, setting)
    train_step(strategy, x, y)  # first-use set-up, AdamW's state
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = status_bytes("VmRSS")
    for _ in range(3):
        train_step(strategy, x, y)
    return status_bytes("VmHWM") - before


def measure_rss(case: dict, setting: str) -> int:
    """peak_rss_delta in a fresh process whose glibc malloc serves every block over 64 KiB with
    its own mmap and unmaps it when freed: resident memory then follows the live tensors (with its
    default, adaptive threshold, freed memory stays resident and the rise depends on history)."""
    child = [sys.executable, os.path.abspath(__file__), "--rss-child", json.dumps([case, setting])]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    result = subprocess.run(child, capture_output=True, text=True, check=True, timeout=600, env=env)
    return int(result.stdout.split()[-1])


def time_steps(case: dict, rounds: int, steps: int, warmup: int) -> dict[str, float]:
    """Median ms of a whole training step per setting: after warm-up, rounds of a few steps each,
    the settings taking turns, so that a machine whose speed drifts (shared) slows all alike."""
    built = {s: build(case, s) for s in SETTINGS}
    times: dict[str, list[float]] = {s: [] for s in SETTINGS}
    for strategy, x, y in built.values():
        for _ in range(warmup):
            train_step(strategy, x, y)
    for _ in range(rounds):
        for setting, (strategy, x, y) in built.items():
            for _ in range(steps):
                t0 = time.perf_counter()
                train_step(strategy, x, y)
                times[setting].append(1e3 * (time.perf_counter() - t0))
    return {s: statistics.median(t) for s, t in times.items()}


def rows_of(case: dict, rounds: int, steps: int, warmup: int) -> list[dict]:
    ms = time_steps(case, rounds, steps, warmup)
    rows = []
    for setting in SETTINGS:
        strategy, x, y = build(case, setting)
        mem = step_memory(strategy.train_model, x, y, strategy.forward_context)
        row = {**case, "setting": setting, "checkpointed_blocks": strategy.checkpointed}
        row |= {f"{k}_MB": round(v / 1e6, 3) for k, v in mem.items()}
        row |= {"rss_delta_MB": round(measure_rss(case, setting) / 1e6, 1)}
        rows.append(row | {"ms_per_step": round(ms[setting], 2)})
    for row in rows:  # relative to no checkpointing
        row["peak_vs_none"] = round(row["peak_MB"] / rows[0]["peak_MB"], 3)
        row["time_vs_none"] = round(row["ms_per_step"] / rows[0]["ms_per_step"], 3)
    return rows


def cases(large: bool, smoke: bool) -> list[dict]:
    """The default run's model, context and batch (the dataclasses' defaults), in fp32 and in the
    precision main.py picks here (trainer_config.use_amp=auto); --large adds gpt-mini."""
    g, block, batch = GPTConfig(), DataConfig().block_size, TrainerConfig().batch_size
    auto = choose_precision("auto", "auto", torch.device("cpu"))
    amps = [False] + ([True] if auto[0] else [])
    shapes = [("gpt-micro", (g.n_layer, g.n_head, g.n_embd), block, batch)]
    if large:
        shapes.append(("gpt-mini", (6, 6, 192), 256, 16))
    if smoke:
        shapes, amps = [("tiny", (4, 2, 32), 16, 2)], [False]
    return [
        {"model": m, "shape": s, "block": t, "batch": b, "amp": amp, "precision": prec(amp, auto)}
        for m, s, t, b in shapes
        for amp in amps
    ]


def prec(amp: bool, auto: tuple) -> str:
    return f"{auto[1]} autocast" if amp else "fp32"


COLUMNS = (
    "model precision setting checkpointed_blocks held_MB peak_MB peak_vs_none "
    "peak_with_grads_MB rss_delta_MB ms_per_step time_vs_none"
).split()


def print_table(machine: dict, rows: list[dict]) -> None:
    print(
        f"machine: {machine['device']}, {machine.get('cores', '?')} cores, torch {machine['torch']}"
    )
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for row in rows:
        name = f"{row['model']} B={row['batch']} T={row['block']}"
        print("| " + " | ".join(str(row[c]) if c != "model" else name for c in COLUMNS) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--large", action="store_true", help="also gpt-mini, context 256, batch 16")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=3, help="timed steps per setting per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="a tiny model, a few steps (for tests)")
    p.add_argument("--out", default=OUT)
    p.add_argument("--rss-child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rss_child:
        print(peak_rss_delta(*json.loads(a.rss_child)))
        return
    keep_freed_cpu_memory(torch.device("cpu"))  # as main.py runs
    rounds, steps, warmup = (1, 2, 1) if a.smoke else (a.rounds, a.steps, a.warmup)
    rows = [r for case in cases(a.large, a.smoke) for r in rows_of(case, rounds, steps, warmup)]
    machine = hardware()
    print_table(machine, rows)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"machine": machine, "rows": rows}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
