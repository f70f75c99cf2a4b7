"""One training step, nanoGPT's model against this project's, in one process, taking turns.

    python benchmarks/step_time.py --nanogpt ~/nanoGPT  # eager and compiled, 7 rounds
    python benchmarks/step_time.py --nanogpt ~/nanoGPT --out step.json  # also as JSON

time_to_quality.py --step-time times the two programs whole (each its own loop, data and logging);
this times only what a step computes: forward, loss, backward, gradient clipping and AdamW, on the
same random batches, at nanoGPT's CPU recipe's model (4 layers, 4 heads, 128 wide, no biases,
context 64, vocabulary 65) and batch (12). nanoGPT's GPT and its configure_optimizers come from its
checkout and run as its train.py runs them on a CPU (fp32, no compile: its README's CPU command).
This project's GPT runs as main.py would run it on this machine: precision auto, attention in the
precision timed faster, AdamW from optim.build_optimizers; eagerly, then compiled (the whole model,
as trainer_config.compile=true does). Each round times every candidate for a few dozen steps, one
after the other, so that a machine whose speed drifts (shared, throttled) slows all of them alike;
the report is the median of the rounds, and the ratio is of medians.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext

import torch
from common import REPO, hardware

sys.path.insert(0, REPO)

from mingpt_ddp.config.optimizer import OptimizerConfig  # noqa: E402
from mingpt_ddp.optim import build_optimizers  # noqa: E402
from mingpt_ddp.parallel.plan import (  # noqa: E402
    AMP_DTYPES,
    Plan,
    autocast_attention_fp32,
    choose_precision,
)
from mingpt_ddp.runtime.host import keep_freed_cpu_memory  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

N_LAYER, N_HEAD, N_EMBD, BLOCK, BATCH, VOCAB = 4, 4, 128, 64, 12, 65  # nanoGPT's CPU recipe


def nanogpt_step(checkout: str, batches: torch.Tensor):
    """A training step of nanoGPT's own model.py and optimizer, as its train.py takes one on a
    CPU."""
    spec = importlib.util.spec_from_file_location(
        "nanogpt_model", os.path.join(checkout, "model.py")
    )
    nano = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nano)
    model = nano.GPT(
        nano.GPTConfig(
            block_size=BLOCK,
            vocab_size=VOCAB,
            n_layer=N_LAYER,
            n_head=N_HEAD,
            n_embd=N_EMBD,
            dropout=0.0,
            bias=False,
        )
    )
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")

    def step(i: int) -> None:
        x, y = batches[i, :, :-1].contiguous(), batches[i, :, 1:].contiguous()  # (B, T) each
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def our_step(batches: torch.Tensor, compile: bool):
    """A training step of this project's GPT, precision and attention decided as main.py decides
    them."""
    device = torch.device("cpu")
    use_amp, amp_dtype, why = choose_precision("auto", "auto", device)
    plan = Plan(parallel="none", use_amp=use_amp, amp_dtype=amp_dtype)
    attention_fp32, choice = autocast_attention_fp32(
        plan, device, (BATCH, N_HEAD, BLOCK, N_EMBD // N_HEAD)
    )
    model = GPT(
        GPTConfig(
            n_layer=N_LAYER,
            n_head=N_HEAD,
            n_embd=N_EMBD,
            bias=False,
            vocab_size=VOCAB,
            block_size=BLOCK,
        )
    )
    for block in model.blocks:
        block.attn.fp32_under_autocast = attention_fp32
    if compile:
        # in place, the whole model: what parallelize (parallel/parallelize.py) does with
        # compile=true where nothing splits the model (no FSDP, tensor, context or pipeline)
        model.compile()
    optimizers = build_optimizers(model, OptimizerConfig(learning_rate=1e-3), device.type)
    dtype = AMP_DTYPES.get(amp_dtype)  # None: fp32, no autocast
    precision = lambda: torch.autocast("cpu", dtype) if use_amp else nullcontext()

    def step(i: int) -> None:
        x, y = batches[i, :, :-1], batches[i, :, 1:]  # (B, T) each
        with precision():
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    words = f"{amp_dtype} autocast, {choice}" if use_amp else "fp32"
    return step, f"{words} ({why})"


def time_round(step, batches: int, steps: int) -> float:
    """ms per step over `steps` consecutive steps."""
    t0 = time.perf_counter()
    for i in range(steps):
        step(i % batches)
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--nanogpt", required=True, help="a nanoGPT checkout (its model.py is imported)"
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=40, help="steps per candidate per round")
    parser.add_argument(
        "--eager-only",
        action="store_true",
        help="skip the compiled candidate (seconds of compiling)",
    )
    parser.add_argument(
        "--default-malloc",
        action="store_true",
        help="leave glibc's allocator at its defaults "
        "(main.py keeps freed memory: trainer_config.cpu_keep_freed_memory)",
    )
    parser.add_argument("--out", default="", help="also write the result as JSON here")
    args = parser.parse_args()
    if not os.path.exists(os.path.join(args.nanogpt, "model.py")):
        sys.exit(
            f"error: no nanoGPT model.py under {args.nanogpt}; "
            "git clone https://github.com/karpathy/nanoGPT"
        )
    # As main.py sets it up; the setting is the process's, so both models run under it.
    allocator = keep_freed_cpu_memory(torch.device("cpu"), not args.default_malloc) or "default"
    torch.manual_seed(0)
    batches = torch.randint(
        0, VOCAB, (64, BATCH, BLOCK + 1)
    )  # the same batches for every candidate
    ours_eager, precision = our_step(batches, compile=False)
    candidates = {"nanoGPT": nanogpt_step(args.nanogpt, batches), "ours, eager": ours_eager}
    if not args.eager_only:
        candidates["ours, compiled"] = our_step(batches, compile=True)[0]
    for (
        name,
        step,
    ) in candidates.items():  # warm up: first steps allocate, and compiling happens here
        t0 = time.perf_counter()
        time_round(step, len(batches), 5)
        print(f"step-time | {name} | warm-up {time.perf_counter() - t0:.1f} s", flush=True)
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(args.rounds):
        for name, step in candidates.items():
            times[name].append(round(time_round(step, len(batches), args.steps), 2))
    medians = {name: statistics.median(ms) for name, ms in times.items()}
    print(
        f"step-time | one process, {torch.get_num_threads()} threads, malloc: {allocator} | "
        f"this project: {precision}"
    )
    for name, ms in times.items():
        print(
            f"step-time | {name:<14} | median {medians[name]:.1f} ms | "
            f"x nanoGPT {medians[name] / medians['nanoGPT']:.2f} | "
            f"rounds {ms}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "hardware": hardware(),
                    "precision": precision,
                    "threads": torch.get_num_threads(),
                    "malloc": allocator,
                    "ms": times,
                    "ratio": {n: round(m / medians["nanoGPT"], 2) for n, m in medians.items()},
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
