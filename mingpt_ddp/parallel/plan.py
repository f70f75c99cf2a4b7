"""How the model is spread over the ranks (DDP or FSDP) and in which precision it computes (AMP).

- DDP (DistributedDataParallel): every rank holds the whole model, gradients are
  all-reduced during backward. Memory per rank: all parameters, gradients and
  optimizer state.
- FSDP (FSDP2, `fully_shard`): every rank holds 1/N of each parameter, gradient
  and optimizer state. Before a block runs forward or backward its parameters are
  all-gathered, and afterwards freed again; gradients are reduce-scattered, so
  each rank keeps only its shard. Memory per rank falls roughly as 1/N, for more
  communication.
- DeepSpeed ZeRO (mingpt_ddp/parallel/deepspeed.py): optimizer state, then gradients, then parameters split over
  the ranks, by DeepSpeed's engine; the Trainer hands it the model and optimizer.
- AMP (automatic mixed precision): under DDP or one process, torch.autocast runs each
  op in the precision it assigns (matmuls in bf16 or fp16) while the parameters and the
  optimizer state stay fp32; under FSDP, a MixedPrecisionPolicy runs whole blocks in
  bf16/fp16 over fp32 shards. fp16 has a narrow range, so its loss is scaled up before
  backward and the gradients unscaled before clipping and the optimizer step
  (GradScaler); bf16 has fp32's range and needs no scaler.

Every function here takes one Plan: the parallelism and precision settings of the run.
Wrapping lives here, not in model.py: the model stays a plain nn.Module.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mingpt_ddp.errors import ConfigError
from mingpt_ddp.runtime.distributed import DistContext

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Plan:
    """How the model is spread over the ranks and in which precision it computes (trainer_config's keys)."""

    parallel: str = "ddp"  # ddp | fsdp | deepspeed | none
    grad_reduce: str = "all_reduce"  # DDP: all_reduce | via_rank0
    use_amp: bool = False  # resolved: "auto" is decided by choose_precision before a Plan is made
    amp_dtype: str = "bf16"
    reshard_after_forward: bool = True  # FSDP
    cpu_offload: bool = False  # FSDP
    compile: bool = False
    tf32: bool = True

    @classmethod
    def of(cls, c, device: torch.device) -> Plan:
        """The plan a TrainerConfig describes on this device ("auto" precision decided here)."""
        use_amp, amp_dtype, _ = choose_precision(c.use_amp, c.amp_dtype, device)
        return cls(c.parallel, c.grad_reduce, use_amp, amp_dtype, c.fsdp_reshard_after_forward,
                   c.fsdp_cpu_offload, c.compile, c.tf32)


def choose_precision(use_amp: bool | str, amp_dtype: str, device: torch.device,
                     flags: set[str] | None = None) -> tuple[bool, str, str]:
    """Resolve trainer_config's "auto" precision for a device: (use_amp, amp_dtype, why, in words).

    Mixed precision pays only where the hardware multiplies in 16 bits: bf16 on GPUs that have bf16
    units and CPUs with AVX-512 BF16 or AMX; fp16 tensor cores on older GPUs. A CPU without them
    converts bf16 to fp32 and back around every multiply, slower than fp32 itself, so auto stays in
    fp32 there. flags: CPU flags to decide from instead of this machine's (tests inject them)."""
    native, evidence = bf16_native(device, flags)
    dtype = amp_dtype if amp_dtype != "auto" else "bf16" if native or device.type != "cuda" else "fp16"
    if use_amp != "auto":
        return bool(use_amp), dtype, f"trainer_config.use_amp={str(bool(use_amp)).lower()}"
    if device.type == "cuda":
        return True, dtype, f"auto: {evidence}" + ("" if native else ", fp16 tensor cores")
    if dtype == "bf16" and native:
        return True, dtype, f"auto: {evidence}"
    return False, dtype, f"auto: {evidence}, so {dtype} would be emulated, slower than fp32"


def check_supported(plan: Plan, ctx: DistContext) -> None:
    """Refuse combinations this project does not run, with the setting to change. (Its own rules:
    FSDP here wants a process group; fp16 and bf16 both run on CPU and GPU.)"""
    parallel, grad_reduce, cpu_offload = plan.parallel, plan.grad_reduce, plan.cpu_offload
    if parallel == "none" and ctx.world_size > 1:
        raise ConfigError("trainer_config.parallel=none with several ranks would train diverging copies; "
                          "use ddp or fsdp")
    if parallel == "fsdp" and not ctx.distributed:
        raise ConfigError("trainer_config.parallel=fsdp needs a process group: launch with torchrun "
                          "(--nproc_per_node=1 for one process) or use parallel=ddp")
    if cpu_offload and (parallel != "fsdp" or ctx.device.type != "cuda"):
        raise ConfigError("trainer_config.fsdp_cpu_offload=true keeps FSDP's shards in CPU memory instead of GPU "
                          "memory: it needs parallel=fsdp on GPUs; set fsdp_cpu_offload=false")
    if grad_reduce == "via_rank0" and parallel != "ddp":
        raise ConfigError("trainer_config.grad_reduce=via_rank0 is a DDP communication hook; use parallel=ddp")
    if parallel == "deepspeed":
        if not ctx.distributed:
            raise ConfigError("trainer_config.parallel=deepspeed needs a process group: launch with torchrun or the "
                              "deepspeed launcher (--nproc_per_node=1 for one process)")
        if plan.compile:
            raise ConfigError("trainer_config.compile=true is not tried with parallel=deepspeed here; set compile=false")
        if plan.use_amp and plan.amp_dtype == "fp16" and ctx.device.type != "cuda":
            raise ConfigError("DeepSpeed's fp16 (with its loss scaler) is for GPUs; on CPUs use "
                              "trainer_config.amp_dtype=bf16")


# No type annotations on the hook: DDP checks them, and `from __future__ import annotations`
# would turn them into strings. process_group: dist.ProcessGroup | None; bucket: dist.GradBucket.
def reduce_through_rank0(process_group, bucket):
    """A DDP communication hook that averages gradients through rank 0: a star all-reduce (the parameter-server pattern).

    Every rank sends its gradient bucket to rank 0; rank 0 adds them up, divides, and
    sends the mean back to each rank, one message at a time, while backward waits.
    Rank 0's link carries (N-1) x the gradients in and (N-1) x out, where DDP's ring
    all-reduce moves 2(N-1)/N x through every link and overlaps with backward: the
    teaching baseline that shows why DDP does what it does (benchmarks/bench.py).
    Plain send/recv, not dist.reduce/broadcast, whose backends use rings and trees.
    """
    if process_group is not None:
        raise ValueError("reduce_through_rank0 works on the default process group only")
    grads = bucket.buffer()  # this bucket's gradients, flattened into one tensor
    world = dist.get_world_size()
    if dist.get_rank() == 0:
        incoming = torch.empty_like(grads)
        for src in range(1, world):
            dist.recv(incoming, src=src)
            grads += incoming
        grads /= world
        for dst in range(1, world):
            dist.send(grads, dst=dst)
    else:
        dist.send(grads, dst=0)
        dist.recv(grads, src=0)  # the mean, from rank 0
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(grads)
    return done


def wrap_model(model: nn.Module, plan: Plan, ctx: DistContext) -> nn.Module:
    """Return the module to call for training: DDP(model), the FSDP-sharded model, or model itself."""
    if plan.compile:
        # In place (Module.compile), so parameter names do not change: no "_orig_mod." prefixes
        # in snapshots. Under FSDP block by block (torchtitan's way), since each block is also a
        # unit that fully_shard gathers and frees around its forward; otherwise the whole model,
        # embeddings to loss, as one graph: inductor then fuses the casts, LayerNorms and the loss
        # between the blocks too (on a 2-core CPU 17.2 -> 15.3 ms/step, blocks vs whole, gpt-micro).
        if plan.parallel == "fsdp":
            for block in model.blocks:
                block.compile()
        else:
            model.compile()
    if plan.parallel == "fsdp":
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        # bf16 compute copies of the parameters, fp32 gradient reduction (summing
        # many small bf16 numbers loses precision), fp32 sharded master weights.
        mp = MixedPrecisionPolicy(param_dtype=AMP_DTYPES[plan.amp_dtype], reduce_dtype=torch.float32) \
            if plan.use_amp else MixedPrecisionPolicy()
        offload = CPUOffloadPolicy() if plan.cpu_offload else OffloadPolicy()
        reshard_after_forward = plan.reshard_after_forward
        # Shard block by block, then the root (embeddings, final norm, head): each
        # block's parameters are gathered just before it runs and freed after.
        for block in model.blocks:
            fully_shard(block, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard_after_forward)
        return model
    if plan.parallel == "ddp" and ctx.distributed:
        # DDP registers autograd hooks that all-reduce gradients bucket by bucket
        # while backward is still running, overlapping communication with compute.
        ddp = DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None)
        if plan.grad_reduce == "via_rank0":
            ddp.register_comm_hook(None, reduce_through_rank0)
        return ddp
    return model


def autocast(plan: Plan, device: torch.device) -> AbstractContextManager:
    """The forward pass's precision context. FSDP (MixedPrecisionPolicy) and DeepSpeed (a bf16/fp16
    copy of the model) cast the parameters themselves."""
    if not plan.use_amp or plan.parallel in ("fsdp", "deepspeed"):
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=AMP_DTYPES[plan.amp_dtype])


def set_tf32(plan: Plan, device: torch.device) -> None:
    """TF32 for fp32 matmuls on NVIDIA GPUs (Ampere and newer): their tensor cores take fp32 inputs
    rounded to a 10-bit mantissa and accumulate in fp32, several times faster than full-precision
    fp32 matmuls. torch leaves it off by default; nanoGPT and most recipes turn it on."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if plan.tf32 else "highest")


def cpu_flags() -> set[str]:
    """The instruction-set flags of this machine's CPU (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def bf16_native(device: torch.device, flags: set[str] | None = None) -> tuple[bool, str]:
    """Whether the device computes bf16 in hardware, and the evidence, in words. On a CPU without
    AVX-512 BF16 or AMX, bf16 is converted to fp32 and back around every multiply (slower than fp32)."""
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        return native, f"{torch.cuda.get_device_name(device)} {'has' if native else 'lacks'} bf16 units"
    found = sorted((cpu_flags() if flags is None else flags) & {"avx512_bf16", "amx_bf16"})
    return bool(found), f"CPU has {' and '.join(found)}" if found else "CPU lacks AVX-512 BF16 and AMX"


def time_attention(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int, int], reps: int = 5) -> float:
    """Milliseconds for one causal scaled_dot_product_attention forward + backward at shape (B, nh, T, hs)."""
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times[1:])[reps // 2]  # the median


def autocast_attention_fp32(plan: Plan, device: torch.device, shape: tuple[int, int, int, int]) -> tuple[bool, str]:
    """Under bf16 autocast, should attention run in fp32? Decided by timing both on this device at the
    model's shape (a few milliseconds at start), not assumed: some CPUs' bf16 attention kernels are
    slower than their fp32 ones. Returns the choice and the two times, in words."""
    if not plan.use_amp or plan.amp_dtype != "bf16" or plan.parallel in ("fsdp", "deepspeed"):
        return False, ""
    bf16_ms, fp32_ms = time_attention(device, torch.bfloat16, shape), time_attention(device, torch.float32, shape)
    return fp32_ms < bf16_ms, f"attention {'fp32' if fp32_ms < bf16_ms else 'bf16'} " \
                              f"(measured here: bf16 {bf16_ms:.2f} ms, fp32 {fp32_ms:.2f} ms)"


def grad_scaler(plan: Plan, device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler that is active only for fp16 (bf16 does not underflow like fp16 does)."""
    return torch.amp.GradScaler(device.type, enabled=plan.use_amp and plan.amp_dtype == "fp16")


def local_bytes(tensors) -> int:
    """Bytes this rank holds for a set of tensors (only the local shard of a DTensor)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total
