"""Exercise 2: DDP's gradient buckets, all-reduced while backward still runs. (README section 4;
hint: hints/ddp_buckets.md)

    python tutorials/exercises/grade.py ddp_buckets

Graded on 2 gloo ranks, each with its half of a batch: after backward and finish(), every
gradient must equal one process's on the whole batch; the bytes must be one ring all-reduce of
every gradient; and at least one all-reduce must start before backward ends (the overlap probe).
"""

import torch.distributed as dist  # noqa: F401 - what you will need
import torch.nn as nn


class BucketedDDP:
    """Average `model`'s gradients over the ranks as DDP does, bucket by bucket.

    Group the parameters, in the order backward produces their gradients (the reverse of
    model.parameters()), into buckets of at most bucket_cap_bytes of gradients. Register a hook on
    each parameter (Tensor.register_post_accumulate_grad_hook): when every gradient of a bucket is
    ready, start its all-reduce without waiting (async_op=True). finish(), called after backward,
    waits for them and leaves every .grad the average over the ranks.
    """

    def __init__(self, model: nn.Module, bucket_cap_bytes: int):
        raise NotImplementedError("write BucketedDDP: buckets, a hook per parameter, finish()")

    def finish(self) -> None:
        raise NotImplementedError("write finish(): wait for each bucket, divide, copy back")
