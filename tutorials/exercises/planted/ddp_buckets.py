"""Exercise 2, planted wrong: right numbers, no overlap. Every bucket is all-reduced in finish(),
after backward has ended, so communication never hides behind compute. Equality cannot see it;
the overlap probe does."""

import torch
import torch.distributed as dist
import torch.nn as nn


class BucketedDDP:
    def __init__(self, model: nn.Module, bucket_cap_bytes: int):
        self.buckets: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in reversed(list(model.parameters())):
            nbytes = p.numel() * p.element_size()
            if self.buckets[-1] and size + nbytes > bucket_cap_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes

    def finish(self) -> None:
        for bucket in self.buckets:  # the bug: reduced only now, one bucket after another
            flat = torch.cat([p.grad.flatten() for p in bucket])
            dist.all_reduce(flat)
            flat /= dist.get_world_size()
            for p, part in zip(bucket, flat.split([q.numel() for q in bucket])):
                p.grad.copy_(part.view_as(p.grad))
