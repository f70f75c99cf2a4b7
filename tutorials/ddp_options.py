"""Three DDP constructor options, each shown by an experiment: find_unused_parameters,
static_graph and gradient_as_bucket_view.

    torchrun --standalone --nproc_per_node=2 tutorials/ddp_options.py

Every rank builds the same tiny model (same seed; DDP would broadcast rank 0's weights anyway)
and feeds it a batch of its own (a generator seeded by the rank), so averaged and unaveraged
gradients differ and the difference can be seen. What is claimed about DDP comes from
torch/nn/parallel/distributed.py in torch 2.13 (and the reducer's messages, printed as they come);
docs/ddp-in-practice.md quotes the lines.
"""

import torch
import torch.distributed as dist
import torch.nn.parallel.distributed as ddp_module
from common import finish, init, say, title
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

STEPS = 3
# How often DDP collected forward's output tensors to search the autograd graph from: counted by
# wrapping the module-level helper that DistributedDataParallel._post_forward calls only when
# find_unused_parameters=True and static_graph=False (torch 2.13).
searches = {"count": 0}
_find_tensors = ddp_module._find_tensors


def counting_find_tensors(obj):
    searches["count"] += 1
    return _find_tensors(obj)


ddp_module._find_tensors = counting_find_tensors


class Branchy(nn.Module):
    """Two layers; forward uses one. x: (batch, 4) -> (batch, 4)."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


class CheckpointTwice(nn.Module):
    """l2 runs twice, each time inside reentrant activation checkpointing (forward without
    saving activations, recomputed in a backward pass of its own). x: (batch, 4) -> (batch, 4)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        x = checkpoint(self.l2, self.l1(x), use_reentrant=True)
        return checkpoint(self.l2, x, use_reentrant=True)


def first_sentence(error: Exception) -> str:
    return str(error).split(". ")[0].strip() + "."


def grad_sum(p: torch.Tensor) -> str:
    return "None" if p.grad is None else f"{p.grad.sum().item():.4f}"


def train(ddp: DDP, watch: str, steps: int = STEPS) -> dict:
    """Run zero_grad, forward, backward `steps` times on this rank's own batches (2 rows of 4).
    Returns the iteration reached, where it failed ("forward"/"backward") and the error's first
    sentence (or None), and the watched parameter's gradient sum after each finished iteration;
    `searches` counts anew."""
    batches, searches["count"], sums = torch.Generator().manual_seed(dist.get_rank()), 0, []
    for it in range(1, steps + 1):
        ddp.zero_grad()  # to None: each sum below is that iteration's gradient alone
        phase = "forward"
        try:
            out = ddp(torch.randn(2, 4, generator=batches))
            phase = "backward"
            out.sum().backward()
        except RuntimeError as e:  # every rank raises at the same point: the group stays usable
            return {"it": it, "phase": phase, "error": first_sentence(e), "sums": sums}
        sums.append(grad_sum(ddp.module.get_parameter(watch)))
    return {"it": steps, "phase": None, "error": None, "sums": sums}


def outcome(run: dict) -> str:
    if run["error"]:
        return f"RuntimeError in iteration {run['it']}'s {run['phase']}: {run['error']}"
    return f"{run['it']} iterations, no error"


def built(cls, **ddp_args) -> DDP:
    torch.manual_seed(0)
    return DDP(cls(), **ddp_args)


def unused_branch() -> None:
    title("find_unused_parameters: a layer forward never uses")
    model = built(Branchy)
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    say(f"holds used.* and unused.* ({n} bytes of parameters) and a batch (2, 4) of its own")
    run = train(model, "used.weight")
    say(f"find_unused_parameters=False: {outcome(run)}")
    say(f"  iteration 1 finished silently: used.weight.grad sums to {run['sums'][0]}")
    model = built(Branchy, find_unused_parameters=True)
    run = train(model, "used.weight")
    say(f"find_unused_parameters=True: {outcome(run)}")
    say(
        f"  iteration 1: used.weight.grad sums to {run['sums'][0]}, "
        f"unused.weight.grad is {grad_sum(model.module.unused.weight)}; "
        f"unused parameters: {model._get_ddp_logging_data()['unused_parameter_size']} bytes; "
        f"outputs searched {searches['count']} times in {run['it']} iterations"
    )
    title(
        "Lesson: unused parameters need find_unused_parameters=True: a graph search per iteration"
    )


def static_graph() -> None:
    title("static_graph: a layer used twice under reentrant checkpointing; an unused layer")
    say("holds l1.*, l2.* (l2 applied twice, each inside checkpoint(use_reentrant=True))")
    for flag in (False, True):
        run = train(built(CheckpointTwice, static_graph=flag), "l2.weight")
        grads = f"; l2.weight.grad sums to {run['sums'][-1]}" if run["sums"] else ""
        say(f"static_graph={flag}: {outcome(run)}{grads}")
    model = built(Branchy, static_graph=True)
    run = train(model, "used.weight")
    say(
        f"static_graph=True on the unused-layer model, find_unused_parameters=False: "
        f"{outcome(run)}; iteration 1: used.weight.grad sums to {run['sums'][0]}; "
        f"unused parameters: {model._get_ddp_logging_data()['unused_parameter_size']} bytes; "
        f"outputs searched {searches['count']} times"
    )
    title(
        "Lesson: static_graph=True fixes the graph in iteration 1: no search, reentrant reuse works"
    )


def record_bucket(buckets, bucket):  # no annotations: DDP inspects a hook's signature
    """Comm hook: note where the bucket's flat buffer lives, then DDP's own averaging hook."""
    flat = bucket.buffer()  # all the bucket's gradients, one 1-D tensor
    buckets.append((flat.data_ptr(), flat.numel() * flat.element_size()))
    return allreduce_hook(None, bucket)  # None: the default group


def where_gradients_live(view: bool) -> dict:
    """Two steps of a small MLP with gradient_as_bucket_view=view; where its gradients are."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    model, buckets = DDP(net, gradient_as_bucket_view=view), []
    model.register_comm_hook(buckets, record_bucket)
    opt, data = torch.optim.SGD(model.parameters(), lr=0.1), torch.Generator().manual_seed(0)
    for _ in range(2):  # iteration 1 rebuilds the buckets; iteration 2 shows the steady state
        buckets.clear()
        opt.zero_grad()
        model(torch.randn(4, 64, generator=data)).sum().backward()
        opt.step()
    grads = [p.grad for p in net.parameters()]
    inside = [
        next((ptr for ptr, n in buckets if ptr <= g.data_ptr() < ptr + n), None) for g in grads
    ]
    own = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads}
    in_buckets = {ptr for ptr in inside if ptr is not None}
    return {
        "inside": sum(ptr is not None for ptr in inside),
        "offsets": [g.data_ptr() - ptr for g, ptr in zip(grads, inside) if ptr is not None],
        "grad_bytes": sum(n for ptr, n in own.items() if ptr not in in_buckets),
        "bucket_bytes": sum(n for _, n in buckets),
        "count": len(grads),
        "floats": sum(g.numel() for g in grads),
    }


def bucket_view() -> None:
    title("gradient_as_bucket_view: where param.grad lives after backward")
    runs = {view: where_gradients_live(view) for view in (False, True)}
    say(
        f"holds Linear(64, 64) + Linear(64, 8): {runs[False]['count']} parameter tensors, "
        f"{runs[False]['floats']} floats ({4 * runs[False]['floats']} bytes of fp32 gradients)"
    )
    for view, w in runs.items():
        say(
            f"gradient_as_bucket_view={view}: {w['inside']}/{w['count']} gradients inside a "
            f"bucket (byte offsets {w['offsets']}); memory: gradients {w['grad_bytes']} + "
            f"buckets {w['bucket_bytes']} = {w['grad_bytes'] + w['bucket_bytes']} bytes"
        )
    title(
        "Lesson: gradient_as_bucket_view=True makes param.grad a view into the bucket: a copy less"
    )


if __name__ == "__main__":
    init()
    unused_branch()
    static_graph()
    bucket_view()
    finish()
