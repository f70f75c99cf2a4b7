"""The config groups users switch between: how the model is spread over the ranks (parallel=) and
settings that go together for some hardware or goal (recipe=). Model sizes are in
config/model.py."""

from __future__ import annotations

from typing import Any

PARALLEL = {
    "ddp": (
        {"parallel": "ddp", "grad_reduce": "all_reduce"},
        "DDP: a full replica per rank, gradients all-reduced",
    ),
    "fsdp": (
        {"parallel": "fsdp"},
        "FSDP2: every rank holds 1/N of parameters, gradients, optimizer state",
    ),
    "none": ({"parallel": "none"}, "one process, no wrapping"),
    "ddp-star": (
        {"parallel": "ddp", "grad_reduce": "via_rank0"},
        "DDP with gradients averaged through rank 0 (a star: the parameter-server pattern)",
    ),
    **{
        f"zero{stage}": (
            {"parallel": "deepspeed"},
            f'DeepSpeed ZeRO-{stage}: {what} split over the ranks (pip install -e ".[deepspeed]")',
        )
        for stage, what in (
            (1, "optimizer state"),
            (2, "optimizer state and gradients"),
            (3, "optimizer state, gradients and parameters"),
        )
    },
    "horovod": (
        {"parallel": "horovod"},
        "Horovod: a full replica per rank, gradients averaged by hvd.DistributedOptimizer "
        "(horovodrun; Horovod built by tools/build_horovod.sh)",
    ),
}

RECIPES: dict[str, tuple[dict[str, Any], str]] = {
    "shakespeare-cpu": ({}, "the default: tiny Shakespeare on CPUs, the gpt-micro model"),
    "shakespeare-gpu": (
        {
            "model": "baby-gpt",
            "data_config": {"block_size": 256},
            "gpt_config": {"dropout": 0.2, "bias": False},
            "trainer_config": {
                "batch_size": 64,
                "max_steps": 5000,
                "eval_every": 500,
                "save_every": 500,
                "use_amp": True,
                "compile": True,
                "run_dir": "runs/shakespeare_char_gpu",
            },
        },
        "nanoGPT's shakespeare_char on a GPU: baby-gpt, context 256, 64 windows per GPU, "
        "bf16 + compile",
    ),
    "nanogpt-cpu": (
        {
            "gpt_config": {"bias": False},
            "trainer_config": {
                "batch_size": 12,
                "eval_every": 50,
                "eval_iters": 20,
                "run_dir": "runs/nanogpt_cpu",
            },
        },
        "nanoGPT's CPU recipe: gpt-micro without biases (nanoGPT's bias=False), context 64, "
        "batch 12, 2000 steps, lr 1e-3 -> 1e-4",
    ),
    "fast-cpu": (
        {
            "gpt_config": {"bias": False},
            "trainer_config": {
                "batch_size": 24,
                "max_steps": 700,
                "eval_every": 50,
                "eval_iters": 10,
                "run_dir": "runs/fast_cpu",
            },
            "optimizer_config": {"learning_rate": 6e-3, "warmup_steps": 50},
        },
        "to val loss 1.88 fast on 2 CPU cores with AdamW: no biases, batch 24, lr 6e-3, "
        "a 700-step cosine",
    ),
    "speedrun-cpu": (
        {
            "gpt_config": {"rotary": True, "qk_norm": True, "bias": False},
            "trainer_config": {
                "batch_size": 24,
                "max_steps": 300,
                "eval_every": 25,
                "eval_iters": 10,
                "run_dir": "runs/speedrun_cpu",
            },
            "optimizer_config": {
                "optimizer": "muon",
                "muon_lr": 0.05,
                "learning_rate": 6e-3,
                "warmup_steps": 50,
            },
        },
        "this project's record to val loss 1.88 on CPUs: fast-cpu + Muon, rotary, QK-norm, "
        "a 300-step cosine (benchmarks/time_to_quality.py --ablation)",
    ),
    "gpt2-gpu": (
        {
            "model": "gpt2",
            "data_config": {"block_size": 1024},
            "trainer_config": {
                "batch_size": 16,
                "use_amp": True,
                "compile": True,
                "run_dir": "runs/gpt2",
            },
        },
        "GPT-2 small's shape (124M parameters with a GPT-2 vocabulary), context 1024, "
        "bf16 + compile",
    ),
}
