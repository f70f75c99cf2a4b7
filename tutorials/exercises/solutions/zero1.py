"""Exercise 3, a reference solution: each rank's AdamW over its parameters, then a broadcast of
each parameter from its owner."""

import torch
import torch.distributed as dist
import torch.nn as nn


class ZeroOneAdamW:
    def __init__(self, params: list[nn.Parameter], **adamw):
        self.params, world = list(params), dist.get_world_size()
        self.owner = [i % world for i in range(len(self.params))]
        mine = [p for p, r in zip(self.params, self.owner) if r == dist.get_rank()]
        self.optimizer = torch.optim.AdamW(mine, **adamw)  # moments for these only

    def step(self) -> None:
        self.optimizer.step()
        for p, owner in zip(self.params, self.owner):
            dist.broadcast(p.data, src=owner)  # the owner's update, to every rank
