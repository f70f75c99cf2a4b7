"""Exercise 3, planted wrong: every rank keeps an AdamW over every parameter. The model comes out
right (each rank computes the same update), so equality cannot see it; the state probe counts
the moments each rank holds: N copies, not one split."""

import torch
import torch.nn as nn


class ZeroOneAdamW:
    def __init__(self, params: list[nn.Parameter], **adamw):
        self.optimizer = torch.optim.AdamW(list(params), **adamw)  # the bug: all the state here

    def step(self) -> None:
        self.optimizer.step()
