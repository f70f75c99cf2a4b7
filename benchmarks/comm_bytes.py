"""Payload bytes each rank hands to the collectives and point-to-point ops, counted as they run.

    python benchmarks/comm_bytes.py [NPROC]     # the demo: starts torchrun (2 ranks) on itself
    with CountBytes() as counter:               # the tool, on any rank
        loss.backward()
    counter.ops["allreduce_"].input_bytes, counter.sent_bytes("all_reduce")

How: a TorchDispatchMode watching the c10d ops. Every ProcessGroup method reaches its backend
through the dispatcher as an op such as c10d::allreduce_ (torch/include/torch/csrc/distributed/
c10d/ProcessGroup.hpp: findSchemaOrThrow), whether Python or C++ calls it. Seen, on 2 gloo ranks
under torch 2.13.0+cpu: (a) dist.all_reduce, send, recv, isend, irecv, broadcast, all_gather_single,
reduce_scatter_single, all_to_all_single: an op per call, batch_isend_irecv one per P2POp;
(b) DDP's C++ reducer: an allreduce_ per gradient bucket in backward (autograd runs the graph
under the caller's thread-local state, dispatch modes included: graph_task.h's thread_locals_),
and 2 broadcast_ in the 2nd step's forward (the bucket rebuild); (c) FSDP2: an _allgather_base_
per parameter group in forward and again in backward (not the root's, which stays unsharded),
a _reduce_scatter_base_ per group; (d) pipelining: a send / recv_ per microbatch, and in the
first step a shape exchange (send_object_list). The alternatives: a wrapper over the Python
ProcessGroup methods sees (a), (c), (d), none of (b), whose reducer calls C++ directly; DDP's
register_comm_hook sees (b)'s buckets only; CommDebugMode counts calls, not sizes nor send/recv.
Functional collectives (DTensor, torch.compile) count as their _c10d_functional op: the c10d op
under it runs inside the mode's handler, where the mode is off. The mode is thread-local (ops on
a thread that never entered it go unseen) and costs a Python call per aten op: count bytes
under it, never time.

Recorded per op: calls, input bytes S (the tensors this rank hands the op: the whole tensor for
all_reduce, broadcast, send, recv; its own shard s for all_gather; the whole input for
reduce_scatter and all_to_all), and bytes sent: S converted by ring_sent_bytes() with the
group's size N and whether this rank is the root (the planner's traffic.ring_sent):
  all_reduce 2(N-1)/N S   all_gather (N-1) s   reduce_scatter (N-1)/N S   all_to_all (N-1)/N S
  broadcast S from the root; gather, reduce S from each non-root; scatter (N-1)/N S from the root;
  send S; recv 0; barrier 0. An all_to_all with uneven splits (expert parallelism's) sends its
  input less the rows it keeps: S - S x split[own rank] / sum(splits).
The ring is the bandwidth-optimal algorithm, not necessarily the backend's (NCCL picks rings or
trees); broadcast, reduce and gather count as direct sends (a chain broadcast has every rank but
the last send S, a binomial tree the root S log2 N). At N = 2 they all agree.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# The ring's bytes per op and FSDP's padding: the planner's formulas, one copy for both.
from mingpt_ddp.planner.traffic import fsdp, padded  # noqa: E402
from mingpt_ddp.planner.traffic import ring_sent as ring_sent_bytes  # noqa: E402

# namespace, kind, argument holding this rank's tensors, argument naming the root (- for none), ops.
# Schema names (torch.ops.c10d.send.default._schema), so an argument moved later still binds.
_TABLE = """
c10d  all_reduce     tensors        -          allreduce_ allreduce_coalesced_
c10d  all_gather     input_tensors  -          allgather_
c10d  all_gather     input_tensor   -          _allgather_base_
c10d  all_gather     input_list     -          allgather_coalesced_
c10d  all_gather     inputs         -          allgather_into_tensor_coalesced_
c10d  reduce_scatter input_tensors  -          reduce_scatter_
c10d  reduce_scatter input_tensor   -          _reduce_scatter_base_
c10d  reduce_scatter inputs         -          reduce_scatter_tensor_coalesced_
c10d  all_to_all     input_tensors  -          alltoall_
c10d  all_to_all     input          -          alltoall_base_
c10d  broadcast      tensors        root_rank  broadcast_
c10d  reduce         tensors        root_rank  reduce_
c10d  gather         input_tensors  root_rank  gather_
c10d  scatter        input_tensors  root_rank  scatter_
c10d  send           tensors        -          send
c10d  recv           tensors        -          recv_ recv_any_source_
c10d  barrier        -              -          barrier monitored_barrier_
_c10d_functional  all_reduce      input   -    all_reduce all_reduce_
_c10d_functional  all_reduce      inputs  -    all_reduce_coalesced all_reduce_coalesced_
_c10d_functional  all_gather      input   -    all_gather_into_tensor all_gather_into_tensor_out
_c10d_functional  all_gather      inputs  -    all_gather_into_tensor_coalesced
_c10d_functional  reduce_scatter  input   -    reduce_scatter_tensor reduce_scatter_tensor_out
_c10d_functional  reduce_scatter  inputs  -    reduce_scatter_tensor_coalesced
_c10d_functional  all_to_all      input   -    all_to_all_single
_c10d_functional  broadcast       input   src  broadcast broadcast_
_c10d_functional  send            tensor  -    isend
_c10d_functional  recv            tensor  -    irecv
"""
OPS = {
    f"{ns}::{op}": (kind, None if arg == "-" else arg, None if root == "-" else root)
    for ns, kind, arg, root, *ops in map(str.split, _TABLE.strip().splitlines())
    for op in ops
}


def tensor_bytes(value) -> int:
    """Bytes of every tensor in value, through nested lists (allgather_'s Tensor[][])."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def _process_group(bound: dict) -> dist.ProcessGroup:
    """The op's group: c10d ops carry it boxed as a ScriptObject, functional ones by name."""
    if "process_group" in bound:
        return dist.ProcessGroup.unbox(bound["process_group"])
    group = bound["group_name"]
    return dist.distributed_c10d._resolve_process_group(group) if isinstance(group, str) else group


@dataclass
class OpCount:
    kind: str
    calls: int = 0
    input_bytes: int = 0  # S summed over calls
    sent_bytes: float = 0.0  # ring_sent_bytes summed over calls (N and root per call)
    sizes: list[int] = field(default_factory=list)  # S of each call: DDP's buckets, in order


class CountBytes(TorchDispatchMode):
    """Per op (schema name less "c10d::"; "_c10d_functional::all_reduce"...): calls, input bytes,
    bytes sent under the ring (module docstring). counter.ops, counter.input_bytes(kind),
    counter.sent_bytes(kind) (kind None: all), counter.rows()."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, OpCount] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in OPS:
            self._record(name, func._schema, args, kwargs)
        return func(*args, **kwargs)

    def _record(self, name: str, schema, args, kwargs) -> None:
        kind, tensor_arg, root_arg = OPS[name]
        bound = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
        bound.update(zip((a.name for a in schema.arguments), args))
        bound.update(kwargs)
        group = _process_group(bound)
        nbytes = tensor_bytes(bound[tensor_arg]) if tensor_arg else 0
        is_root = root_arg is not None and bound[root_arg] == group.rank()
        key = name.removeprefix("c10d::")
        count = self.ops.setdefault(key, OpCount(kind))
        count.calls += 1
        count.input_bytes += nbytes
        if kind == "all_to_all" and bound.get("input_split_sizes"):  # uneven: what leaves
            splits = bound["input_split_sizes"]
            own = splits[group.rank()] * nbytes // max(1, sum(splits))  # kept, never sent
            count.sent_bytes += nbytes - own
        else:
            count.sent_bytes += ring_sent_bytes(kind, nbytes, group.size(), is_root)
        count.sizes.append(nbytes)

    def input_bytes(self, kind: str | None = None) -> int:
        return sum(c.input_bytes for c in self.ops.values() if kind in (None, c.kind))

    def sent_bytes(self, kind: str | None = None) -> float:
        return sum(c.sent_bytes for c in self.ops.values() if kind in (None, c.kind))

    def rows(self) -> list[tuple[str, str, int, int, float]]:
        """(op, kind, calls, input bytes, sent bytes) per op, sorted by op."""
        return [
            (k, c.kind, c.calls, c.input_bytes, c.sent_bytes) for k, c in sorted(self.ops.items())
        ]


def report(title: str, counter: CountBytes, formula: list[str]) -> None:
    """The demo's output: rank 0 prints every rank's rows, then the formula lines (its own)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, counter.rows())  # outside any counter: not counted
    if dist.get_rank() != 0:
        return
    print(f"== {title}")
    print(f"  {'rank':<5}{'op':<24}{'kind':<16}{'calls':>6}{'input B':>12}{'sent B':>12}")
    for rank, rows in enumerate(everyone):
        for op, kind, calls, nbytes, sent in rows:
            print(f"  {rank:<5}{op:<24}{kind:<16}{calls:>6}{nbytes:>12}{sent:>12.0f}")
    print("".join(f"  {line}\n" for line in formula), flush=True)


def known_ops(n: int) -> None:
    """Ops of known sizes, so that each counted row can be checked by hand."""
    with CountBytes() as counter:
        dist.all_reduce(torch.ones(1000))  # 4000 B
        if dist.get_rank() == 0:
            dist.send(torch.ones(300), 1)  # 1200 B to rank 1
        elif dist.get_rank() == 1:
            dist.recv(torch.empty(300), 0)
        dist.all_gather_single(torch.empty(250 * n), torch.ones(250))  # shard 1000 B
        dist.reduce_scatter_single(torch.empty(125), torch.ones(125 * n))  # input 500 N B
        dist.broadcast(torch.ones(100), src=n - 1)  # 400 B from the last rank
    ring = {k: ring_sent_bytes(k, s, n) for k, s in [("all_reduce", 4000), ("all_gather", 1000)]}
    report(
        "known ops: all_reduce 1000 fp32, send 300 fp32 0 -> 1, all_gather shard 250 fp32, "
        "reduce_scatter 125 N fp32, broadcast 100 fp32 from rank N-1",
        counter,
        [
            f"formula: all_reduce 2(N-1)/N x 4000 = {ring['all_reduce']:.0f}; send 1200; recv 0; "
            f"all_gather (N-1) x 1000 = {ring['all_gather']:.0f}; reduce_scatter (N-1)/N x "
            f"{500 * n} = {(n - 1) * 500}; broadcast 400 from the root",
        ],
    )


def gpt(rank: int = 0) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The demo's GPT (2 layers, width 32, 65 characters) and a batch of 4 x 32 tokens."""
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=65, block_size=32))
    x = torch.randint(65, (4, 33), generator=torch.Generator().manual_seed(rank))
    return model, (x[:, :-1], x[:, 1:])


def ddp_step(n: int, bucket_cap_mb: float = 0.025) -> None:
    """Three DDP steps, each counted apart; the third, steady one against the formula."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, batch = gpt(dist.get_rank())
    model = DDP(model, bucket_cap_mb=bucket_cap_mb)  # small buckets: several of them
    steps = [CountBytes() for _ in range(3)]
    for counter in steps:
        with counter:
            model(*batch)[1].backward()
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    rebuilt = model._get_ddp_logging_data().get("rebuilt_bucket_sizes", "?")
    calls = lambda counter: ", ".join(f"{op} x{k}" for op, _, k, _, _ in counter.rows())
    report(
        f"DDP: the GPT, bucket_cap_mb={bucket_cap_mb}, step 3 of 3",
        steps[-1],
        [
            *(f"step {i}: {calls(c)}" for i, c in enumerate(steps, 1)),
            f"buckets counted (B): {steps[-1].ops['allreduce_'].sizes}; DDP's own: [{rebuilt}]",
            f"formula: gradients S = {grads} B -> 2(N-1)/N S = "
            f"{ring_sent_bytes('all_reduce', grads, n):.0f} B sent per rank",
        ],
    )


def padded_bytes(params, n: int) -> int:
    """FSDP2's all-gather input, times N, of these tensors (traffic.padded)."""
    return sum(padded([tuple(p.shape)], n, p.element_size()) for p in params)


def fsdp_groups(model, local=lambda p: p) -> list[list[tuple]]:
    """FSDP2's parameter groups of model (apply_fsdp's units: each block, then the root, what
    remains), as the shapes of what FSDP shards of each parameter (local(p): a tensor-parallel
    rank's piece)."""
    blocks = list(model.blocks.children())  # a ModuleList, or a pipeline stage's ModuleDict
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    shape = lambda p: tuple(local(p).shape)  # noqa: E731
    groups = [[shape(p) for p in b.parameters()] for b in blocks]
    return groups + [[shape(p) for p in model.parameters() if id(p) not in in_blocks]]


def fsdp_formula(
    model, n: int, local=lambda p: p, times: int = 1, resharded: bool = True
) -> tuple[float, float]:
    """(all-gather, reduce-scatter) bytes sent per rank by one FSDP2 step of model: traffic.fsdp
    on its groups. times: forwards per step (a pipeline's microbatches); resharded:
    reshard_after_forward."""
    return fsdp(fsdp_groups(model, local), n, times, resharded)


def fsdp_step(n: int) -> None:
    """One FSDP2 step, each block and the root sharded (as mingpt_ddp/parallel/fsdp.py does)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, batch = gpt(dist.get_rank())
    gather, scatter = fsdp_formula(model, n)  # from the unsharded shapes
    padded = padded_bytes(model.parameters(), n)
    mesh = init_device_mesh("cpu", (n,))  # cpu: on a GPU host the default mesh would be cuda
    for module in [*model.blocks, model]:
        fully_shard(module, mesh=mesh)
    with CountBytes() as counter:
        model(*batch)[1].backward()
    report(
        f"FSDP2: the GPT, blocks + root sharded, one step; parameters padded to N rows: {padded} B",
        counter,
        [
            f"formula: all_gather {gather:.0f} B (blocks fwd + bwd, root fwd), counted "
            f"{counter.sent_bytes('all_gather'):.0f} B",
            f"formula: reduce_scatter {scatter:.0f} B (every group's gradients), counted "
            f"{counter.sent_bytes('reduce_scatter'):.0f} B",
        ],
    )


def pipeline_step(n: int, width: int = 64, rows: int = 8, microbatches: int = 4) -> None:
    """GPipe over N Linear stages, one per rank: a warm-up step, then one counted."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rank = dist.get_rank()
    torch.manual_seed(rank)
    stage = PipelineStage(torch.nn.Linear(width, width), rank, n, torch.device("cpu"))
    loss = lambda out, target: (out - target).square().mean()
    schedule = ScheduleGPipe(stage, n_microbatches=microbatches, loss_fn=loss)
    x, target = torch.randn(rows, width), torch.randn(rows, width)
    run = lambda: schedule.step(x, target=target) if rank == 0 else schedule.step(target=target)
    run()  # the first step also exchanges shapes (send_object_list)
    with CountBytes() as counter:
        run()
    act = rows * width * 4
    report(
        f"pipeline: GPipe, {n} Linear({width}, {width}) stages, {microbatches} microbatches of "
        f"{rows // microbatches}, step 2",
        counter,
        [
            f"formula: every stage but the last sends {act} B of activations forward,",
            f"every stage but the first {act} B of input gradients back; recv 0",
        ],
    )


def main() -> None:
    from mingpt_ddp.runtime.distributed import exit_process

    dist.init_process_group("gloo")
    n = dist.get_world_size()
    if dist.get_rank() == 0:
        print(f"comm_bytes: {n} ranks, gloo, torch {torch.__version__}, bytes per rank\n")
    try:
        for demo in (known_ops, ddp_step, fsdp_step, pipeline_step):
            demo(n)
    finally:
        dist.destroy_process_group()
    exit_process(0)  # skips gloo's exit-time destructors, which abort now and then


def launch(nproc: int) -> int:
    """`python benchmarks/comm_bytes.py`: run this file under torchrun with nproc ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return subprocess.run([*cmd, f"--nproc_per_node={nproc}", __file__], cwd=REPO).returncode


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        main()
    else:
        sys.exit(launch(int(sys.argv[1]) if len(sys.argv) > 1 else 2))
