"""Exercise 3: a ZeRO-1 optimizer, its state sharded over the ranks. (README section 5; hint:
hints/zero1.md)

    python tutorials/exercises/grade.py zero1

Graded on 2 gloo ranks over 3 steps: the parameters must equal one process's torch AdamW; the
optimizer state the ranks hold together must be one copy, split (each rank's AdamW moments for
its own parameters only); the bytes: each parameter broadcast once, by its owner.
"""

import torch.distributed as dist  # noqa: F401 - what you will need
import torch.nn as nn


class ZeroOneAdamW:
    """AdamW whose state (two moments a parameter) is split over the ranks: ZeRO stage 1.

    params: the model's parameters, the same on every rank; when step() is called their .grad is
    already the average over the ranks. Parameter i (in the order given) belongs to rank i % N.
    Keep a torch.optim.AdamW (with **adamw: lr, weight_decay, ...) over your own parameters only;
    step() updates them, then every parameter is broadcast from the rank that owns it, so that all
    ranks hold the same updated model again.
    """

    def __init__(self, params: list[nn.Parameter], **adamw):
        raise NotImplementedError("write ZeroOneAdamW: an AdamW over this rank's parameters only")

    def step(self) -> None:
        raise NotImplementedError("write step(): update your parameters, then broadcast each")
