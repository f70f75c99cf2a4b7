"""tensor_config.degree > 1: tensor parallelism (Megatron's layout, on DTensor) x data parallel.

Each block's matrices are split over the `degree` ranks of a tensor-parallel group, so each rank
holds and computes 1/degree of every block. Attention: the fused QKV matmul column-wise (each rank
its heads' queries, keys and values), the heads attend locally, the output projection row-wise
(each rank its heads' columns), and an all-reduce sums the partial outputs. MLP: the first matmul
column-wise, the activation locally, the second row-wise, an all-reduce. Backward mirrors it: an
all-reduce of the input's gradient before each split matmul. So 4 all-reduces of (B, T, C) per
block per step, and nothing else in the blocks (torch.distributed.tensor.parallel's styles).

The embedding, the final LayerNorm and the head stay whole on every rank: with 65 characters the
head is ~1% of the model's FLOPs, and a vocabulary split would add an all-reduce for the softmax's
sums to save it (GPT-2's 50,257 tokens are where it pays).

sequence_parallel also splits the sequence between the split matmuls: the residual stream,
LayerNorms and dropout hold T / degree positions per rank, an all-gather (of the sequence)
replaces each all-reduce before a split matmul and a reduce-scatter the one after: the same
bytes, 1/degree of the activations there. The LayerNorms' gradients are then partial sums (each
rank saw its positions only) and are summed over the group before clipping.

The data-parallel dimension (world size / degree replicas) runs FSDP2 over the mesh's "dp"
dimension, the documented composition with DTensor TP; DDP x TP is refused (DDP does not take
DTensor parameters through a public API).
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from mingpt_ddp.errors import ConfigError
from mingpt_ddp.optim import check_muon_supported, own_kernels
from mingpt_ddp.parallel.checkpointing import apply_activation_checkpointing
from mingpt_ddp.parallel.fsdp import DCP_FILES, shard_model, write_dcp
from mingpt_ddp.parallel.plan import mesh_shape
from mingpt_ddp.parallel.single import Single, check_no_foreign_options
from mingpt_ddp.parallel.strategy import StrategyArgs, assemble


def heads_first(n_embd: int, degree: int) -> torch.Tensor:
    """The row order of the fused QKV weight (3C, C) that makes a plain split of its rows give
    each rank its own heads' q, k and v. Its rows are (3, nh, hs): split as they are, rank 0 of 2
    would get all of q and half of k. Reordered as (degree, 3, nh / degree, hs), rank r's
    contiguous rows are q, k and v of heads r * nh / degree onwards."""
    return torch.arange(3 * n_embd).view(3, degree, n_embd // degree).transpose(0, 1).flatten()


def block_plan(sequence_parallel: bool) -> dict:
    """Megatron's split of one block, as parallelize_module styles. With sequence parallelism the
    LayerNorms run on sequence shards, the split matmuls' inputs are gathered along the sequence
    and their outputs reduce-scattered back to it (instead of all-reduced)."""
    if not sequence_parallel:
        return {
            "attn.qkv": ColwiseParallel(),  # (B, T, C) -> this rank's heads: (B, T, 3C / tp)
            "attn.proj": RowwiseParallel(),  # (B, T, C / tp) -> all-reduced (B, T, C)
            "mlp.fc": ColwiseParallel(),  # (B, T, C) -> (B, T, 4C / tp)
            "mlp.proj": RowwiseParallel(),  # (B, T, 4C / tp) -> all-reduced (B, T, C)
        }
    gather = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "ln_1": SequenceParallel(),  # (B, T / tp, C) per rank
        "attn": PrepareModuleInput(  # all-gather the sequence: (B, T, C); rope passes as it is
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=Shard(1)),  # reduce-scatter: (B, T / tp, C)
        "ln_2": SequenceParallel(),
        "mlp": PrepareModuleInput(**gather),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
    }


def parallelize(model: nn.Module, mesh, sequence_parallel: bool) -> None:
    """Split every block of model over the 1-D mesh in place (block_plan); with sequence
    parallelism, the embedding's output is cut along the sequence and gathered back before the
    (whole) head."""
    cfg, degree = model.config, mesh.size()
    order = heads_first(cfg.n_embd, degree)
    for block in model.blocks.children():
        qkv = block.attn.qkv
        with torch.no_grad():  # before the split: each rank's rows become its heads'
            qkv.weight.copy_(qkv.weight[order])
            if qkv.bias is not None:
                qkv.bias.copy_(qkv.bias[order])
        parallelize_module(block, mesh, block_plan(sequence_parallel))
    if sequence_parallel:
        cut = dict(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),))
        parallelize_module(
            model,
            mesh,
            {
                "drop": PrepareModuleInput(**cut, use_local_output=True),  # (B, T / tp, C)
                "ln_f": SequenceParallel(),
                "lm_head": PrepareModuleInput(  # all-gather: the head sees every position
                    input_layouts=(Shard(1),),
                    desired_input_layouts=(Replicate(),),
                    use_local_output=True,
                ),
            },
        )


def is_qkv(name: str) -> bool:
    """Whether a state-dict key is (or belongs to) a fused QKV weight or bias."""
    return ".attn.qkv." in f".{name}"


def tensors_in(state: dict, path: tuple = ()):
    """(path, tensor) for every tensor of a state dict, nested (optimizer state) or flat."""
    for key, value in state.items():
        if isinstance(value, dict):
            yield from tensors_in(value, (*path, key))
        elif isinstance(value, torch.Tensor) and value.dim() > 0:
            yield (*path, key), value


def _get(state: dict, path: tuple):
    return state[path[0]] if len(path) == 1 else _get(state[path[0]], path[1:])


def _put(state: dict, path: tuple, value) -> None:
    """Set a value, copying the dicts on its way (get_state_dict hands out the optimizer's own)."""
    if len(path) == 1:
        state[path[0]] = value
    else:
        state[path[0]] = dict(state[path[0]])
        _put(state[path[0]], path[1:], value)


def standard_order(state: dict, order: torch.Tensor) -> dict:
    """state with its QKV rows (and their optimizer state) gathered whole and put back in the
    standard (3, nh, hs) order: a rank's rows are its heads', not a contiguous piece of that
    layout, so DCP could not write them as one; whole, any degree and one process read them.
    Collective."""
    for path, value in list(tensors_in(state)):
        if is_qkv(".".join(map(str, path))):
            full = value.full_tensor() if isinstance(value, DTensor) else value
            _put(state, path, full.index_select(0, torch.argsort(order).to(full.device)))
    return state


def to_layout(state: dict, like: dict, order: torch.Tensor) -> dict:
    """state's whole tensors (one file, or the gathered QKV rows) cut to this rank's layout, as
    `like` (this run's state dict) holds it: QKV rows in heads-first order, then each rank's
    piece (distribute_tensor without communication: every rank holds the whole tensor)."""
    for path, mine in tensors_in(like):
        value = _get(state, path)
        if isinstance(mine, DTensor) and not isinstance(value, DTensor):
            value = value.to(mine.device)
            if is_qkv(".".join(map(str, path))):
                value = value.index_select(0, order.to(value.device))
            value = distribute_tensor(value, mine.device_mesh, mine.placements, src_data_rank=None)
            _put(state, path, value)
    return state


def global_norm(params: list, plain_copies: int) -> torch.Tensor:
    """The gradient norm over the whole model, from any mix of DTensor shards and whole tensors.
    Partial gradients (sequence parallelism's LayerNorms: each rank's positions only) are summed
    first; then each rank adds the squares of what it holds, divided by how many ranks hold the
    same values, and one all-reduce of a number gives the whole model's sum. plain_copies: the
    ranks that hold each parameter (the world; a pipeline stage's ranks); a DTensor cut in k
    pieces has plain_copies / k of each (a 1-D FSDP shard is also whole across tp)."""
    total = torch.zeros((), device=params[0].device if params else None)
    for p in params:
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(placements=p.placements)  # Partial: sum over tp
        grad, copies = p.grad, plain_copies
        if isinstance(grad, DTensor):  # its pieces: the product of its sharded dimensions
            mesh, placements = grad.device_mesh, grad.placements
            pieces = math.prod(
                mesh.size(i) for i, s in enumerate(placements) if not s.is_replicate()
            )
            copies, grad = plain_copies // pieces, grad.to_local()
        total += grad.float().square().sum() / copies
    dist.all_reduce(total)
    return total.sqrt()


def clip_by(params: list, max_norm: float, norm: torch.Tensor) -> None:
    """torch's clip_grads_with_norm_, once per kind of gradient: whole tensors, and DTensors per
    mesh (its foreach kernels take no mix: FSDP x TP holds 2-D and 1-D DTensors)."""
    groups: dict = {}
    for p in params:
        groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)


class TensorParallelStrategy(Single):
    """The local step of single.py over DTensor-split blocks, FSDP2 over the replicas."""

    layout = DCP_FILES  # DCP: a tp snapshot resumes at any degree, under fsdp or ddp
    forward_on_all_ranks = True  # every forward needs every rank of the group

    def __init__(self, model: nn.Module, args: StrategyArgs):
        self.check(args)  # before any group is made
        shape = mesh_shape(args.ctx.world_size, args.plan)
        self.mesh = init_device_mesh(
            args.ctx.device.type, (shape["dp"], shape["tp"]), mesh_dim_names=("dp", "tp")
        )
        self.order = heads_first(model.config.n_embd, shape["tp"])
        super().__init__(model, args)

    @classmethod
    def check(cls, args: StrategyArgs) -> None:
        plan = args.plan
        dp = mesh_shape(args.ctx.world_size, plan)["dp"]
        check_no_foreign_options(plan)
        if plan.parallel not in ("ddp", "fsdp"):
            raise ConfigError(
                f"tensor_config.degree > 1 runs under parallel=ddp (one replica) or fsdp (replicas "
                f"over FSDP2), not parallel={plan.parallel}: set trainer_config.parallel=fsdp"
            )
        if plan.parallel == "ddp" and dp > 1:
            raise ConfigError(
                f"tensor_config.degree > 1 with {dp} replicas runs them over FSDP2 on the mesh's "
                "dp dimension (DDP takes no DTensor parameters through a public API): set "
                "trainer_config.parallel=fsdp"
            )
        if plan.use_amp and plan.amp_dtype == "fp16":
            raise ConfigError(
                "fp16's GradScaler cannot unscale a mix of DTensor and whole gradients (tensor "
                "parallelism's blocks and embeddings): use trainer_config.amp_dtype=bf16"
            )
        check_muon_supported(args.optim, "tensor_config.degree > 1")
        if plan.compile:
            raise ConfigError(
                "trainer_config.compile=true is not built with tensor_config.degree > 1 yet; "
                "set compile=false"
            )

    def wrap(self, model: nn.Module) -> nn.Module:
        """Tensor-parallel blocks, activation checkpointing, then FSDP over the replicas
        (torchtitan's order: TP, AC, compile, FSDP)."""
        cfg, degree = model.config, self.plan.tensor.degree
        for n, what in ((cfg.n_head, "gpt_config.n_head"), (4 * cfg.n_embd, "4 x n_embd")):
            if n % degree:
                raise ConfigError(
                    f"tensor_config.degree={degree} must divide {what} ({n}): each rank holds "
                    "whole heads and an equal share of the MLP; pick a degree that divides it"
                )
        parallelize(model, self.mesh["tp"], self.plan.tensor.sequence_parallel)
        self.checkpointed = apply_activation_checkpointing(
            model, self.plan.activation_checkpointing
        )
        if self.mesh["dp"].size() > 1:
            shard_model(model, self.mesh["dp"], self.plan)
        return model

    def autocasts(self) -> bool:
        return self.plan.use_amp and not self.fsdp_replicas  # FSDP casts the parameters

    @property
    def fsdp_replicas(self) -> bool:
        return self.mesh["dp"].size() > 1

    def gradient_sync(self, sync: bool) -> AbstractContextManager:
        if self.fsdp_replicas:
            self.train_model.set_requires_gradient_sync(sync)
        return nullcontext()

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm over the whole model (global_norm: every parameter is whole on each
        rank of a replica or a DTensor)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = global_norm(params, plain_copies=self.ctx.world_size)
        clip_by(params, max_norm, norm)
        return norm

    def describe(self) -> tuple[str, str]:
        tp, dp = self.mesh["tp"].size(), self.mesh["dp"].size()
        sp = " + sequence parallel" if self.plan.tensor.sequence_parallel else ""
        over = "fsdp" if self.fsdp_replicas else "one replica"
        mode = f"tensor parallel {tp}{sp} x {dp} replica{'s' if dp > 1 else ''} ({over})"
        return mode + self.checkpointing_words(), self.precision()

    # ----------------------------------------------------------- snapshots
    def tensor_state(self) -> dict:
        """Model and optimizer state keyed by parameter name: DTensor shards (DCP writes each
        rank's piece once), the QKV rows whole in the standard order (standard_order)."""
        model_sd, optim_sd = get_state_dict(self.train_model, self.optimizers)
        order = self.order
        return {
            "model": standard_order(model_sd, order),
            "optimizer": standard_order(optim_sd, order),
        }

    def sampling_model(self) -> nn.Module | None:
        """Collective: the whole model put together on rank 0 (the eval line's sample; a moment's
        copy of all parameters), None on the other ranks. Sampling runs on windows of every
        length from 1 token, which sequence parallelism cannot cut evenly."""
        state = standard_order(get_model_state_dict(self.train_model), self.order)
        whole = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
        return assemble(self.model, whole, self.device) if self.ctx.is_main else None

    def load_tensor_state(self, state: dict) -> None:
        """Whole tensors cut to this run's layout (to_layout); DTensor shards DCP read for this
        layout go in as they are."""
        model_sd, optim_sd = get_state_dict(self.train_model, self.optimizers)
        with own_kernels(self.optimizers):
            set_state_dict(
                self.train_model,
                self.optimizers,
                model_state_dict=to_layout(state["model"], model_sd, self.order),
                optim_state_dict=to_layout(state["optimizer"], optim_sd, self.order),
            )

    def read_tensors(self, snapshot) -> dict:
        return snapshot.tensors(into=self.tensor_state() if snapshot.reshardable else None)

    def write_files(self, stage: str) -> str:
        return write_dcp(self.tensor_state(), stage)
