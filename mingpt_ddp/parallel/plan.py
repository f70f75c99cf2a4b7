"""The run's parallelism and precision settings (Plan), and the precision facts of this device.

The parallelisms themselves are one module each (ddp.py, fsdp.py, tensor.py, context.py,
pipeline.py, composed by parallelize.py on the grid of mesh.py; deepspeed.py, horovod.py and
replica_groups.py bring engines of their own). What they share is decided here: whether mixed
precision pays on this device ("auto"), whether it multiplies bf16 in hardware, TF32 on NVIDIA
GPUs, the GradScaler fp16 needs (bf16 has fp32's range and needs none), and how many bytes a rank
holds of a set of tensors.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from mingpt_ddp.config.context import ContextConfig
from mingpt_ddp.config.mesh import MeshConfig, model_degrees
from mingpt_ddp.config.pipeline import PipelineConfig
from mingpt_ddp.config.replica_groups import TorchftConfig
from mingpt_ddp.config.tensor import TensorConfig
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.parallel.mesh import ParallelDims

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Plan:
    """How the model is spread over the ranks and in which precision it computes (trainer_config's
    keys)."""

    parallel: str = "ddp"  # ddp | fsdp | deepspeed | horovod | none
    grad_reduce: str = "all_reduce"  # DDP: all_reduce | via_rank0
    use_amp: bool = False  # resolved: "auto" is decided by choose_precision before a Plan is made
    amp_dtype: str = "bf16"
    reshard_after_forward: bool = True  # FSDP
    cpu_offload: bool = False  # FSDP
    compile: bool = False
    tf32: bool = True
    activation_checkpointing: str = "none"  # none | full | every-K (checkpointing.py)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)  # degree 1: no pipeline
    tensor: TensorConfig = field(default_factory=TensorConfig)  # degree 1: no tensor parallel
    context: ContextConfig = field(default_factory=ContextConfig)  # degree 1: no context parallel
    torchft: TorchftConfig = field(default_factory=TorchftConfig)  # groups 0: no replica groups
    mesh: MeshConfig = field(default_factory=MeshConfig)  # the degrees (tp, cp, pp as above)

    @classmethod
    def of(cls, c, device: torch.device, **sections) -> Plan:
        """The plan a TrainerConfig and the sections of the parallelisms (pipeline, tensor,
        context, torchft, mesh) describe on this device ("auto" precision decided here). The
        degrees are mesh_config's, or their old keys' (tensor_config.degree...): each section
        is given its degree, so its own checks see it."""
        mesh = sections.get("mesh") or MeshConfig()
        pipeline = sections.get("pipeline") or PipelineConfig()
        tensor = sections.get("tensor") or TensorConfig()
        context = sections.get("context") or ContextConfig()
        aliases = {"tp": tensor.degree, "cp": context.degree, "pp": pipeline.degree}
        degrees = model_degrees(mesh, aliases)
        if tensor.sequence_parallel and degrees["tp"] == 1:
            raise ConfigError(
                "tensor_config.sequence_parallel=true splits the sequence between the ranks of "
                "tensor parallelism: set mesh_config.tp to 2 or more"
            )
        plan = cls(
            c.parallel,
            c.grad_reduce,
            False,  # decided below, once the modes that refuse fp16 are known
            "bf16",
            c.fsdp_reshard_after_forward,
            c.fsdp_cpu_offload,
            c.compile,
            c.tf32,
            c.activation_checkpointing,
            dataclasses.replace(pipeline, degree=degrees["pp"]),  # runs its checks again
            dataclasses.replace(tensor, degree=degrees["tp"]),
            dataclasses.replace(context, degree=degrees["cp"]),
            sections.get("torchft") or TorchftConfig(),
            mesh,
        )
        refused = fp16_refused_by(plan)
        use_amp, amp_dtype, _ = choose_precision(c.use_amp, c.amp_dtype, device, None, refused)
        return dataclasses.replace(plan, use_amp=use_amp, amp_dtype=amp_dtype)

    def degrees(self) -> dict[str, int]:
        """The model-parallel degrees: {"tp", "cp", "pp"}."""
        return {"tp": self.tensor.degree, "cp": self.context.degree, "pp": self.pipeline.degree}

    def dims(self, world_size: int) -> ParallelDims:
        """The grid of world_size ranks this plan asks for (refused in one line if it does not
        fit)."""
        return ParallelDims.of(world_size, self.degrees(), self.mesh, self.parallel)


def replica(rank: int, world_size: int, plan: Plan) -> tuple[int, int]:
    """(dp_rank, dp): which replica's share of the data this rank reads, and how many there are.
    The ranks of one replica (its pipeline stages, tensor or context shards) read the same
    windows; with data parallelism alone every rank is a replica of its own."""
    if plan.torchft.groups:  # torchft: each replica group is a job (of one process) of its own
        return plan.torchft.group, plan.torchft.groups
    dims = plan.dims(world_size)
    return dims.coordinates(rank)["dp"], dims.dp


def dropout_streams(plan: Plan, world_size: int) -> list[int]:
    """Each rank's dropout stream (seed + stream): a tensor-parallel group's ranks (tp: the
    innermost dimension) hold the same activations and share one, but not under sequence
    parallelism (dropout on a rank's own positions)."""
    tp = 1 if plan.tensor.sequence_parallel else plan.tensor.degree
    return [r // tp for r in range(world_size)]


def fp16_refused_by(plan: Plan) -> str:
    """The part of this plan that refuses fp16, in words ("" if none): a pipeline or tensor
    parallelism (GradScaler cannot unscale DTensor gradients nor step inside a schedule:
    grid.check_layout) and torchft (its commit vote knows no skipped steps: replica_groups.py)."""
    degrees = plan.degrees()
    if degrees["pp"] > 1:
        return f"the pipeline (mesh_config.pp={degrees['pp']})"
    if degrees["tp"] > 1:
        return f"tensor parallelism (mesh_config.tp={degrees['tp']})"
    return "torchft" if plan.torchft.groups else ""


def choose_precision(
    use_amp: bool | str,
    amp_dtype: str,
    device: torch.device,
    flags: set[str] | None = None,
    fp16_refused: str = "",
) -> tuple[bool, str, str]:
    """Resolve trainer_config's "auto" precision for a device: (use_amp, amp_dtype, why, in words).

    Mixed precision pays only where the hardware multiplies in 16 bits: bf16 on GPUs that have bf16
    units and CPUs with AVX-512 BF16 or AMX; fp16 tensor cores on older GPUs. A CPU without them
    converts bf16 to fp32 and back around every multiply, slower than fp32 itself, so auto stays in
    fp32 there. flags: CPU flags to decide from instead of this machine's (tests inject them).
    fp16_refused: the mode of the run that refuses fp16 (fp16_refused_by), "" if none: on a GPU
    without bf16 units auto is then fp32 (and amp_dtype=auto bf16), not an fp16 it would refuse."""
    native, evidence = bf16_native(device, flags)
    fp16 = device.type == "cuda" and not native and not fp16_refused
    dtype = amp_dtype if amp_dtype != "auto" else "fp16" if fp16 else "bf16"
    if use_amp != "auto":
        return bool(use_amp), dtype, f"trainer_config.use_amp={str(bool(use_amp)).lower()}"
    if device.type == "cuda":  # every CUDA GPU has 16-bit tensor cores or units of some kind
        if native or dtype == "fp16":
            return True, dtype, f"auto: {evidence}" + ("" if native else ", fp16 tensor cores")
        if fp16_refused and amp_dtype == "auto":  # V100, T4: fp16 or nothing, and fp16 refused
            return False, dtype, f"auto: {evidence} and {fp16_refused} refuses fp16, so fp32"
        # amp_dtype=bf16 asked for on a GPU without bf16 units: torch emulates it, in fp32 units
        faster = "" if fp16_refused else " (amp_dtype=fp16 is faster)"
        return True, dtype, f"auto: {evidence}, so bf16 is emulated{faster}"
    if dtype == "bf16" and native:
        return True, dtype, f"auto: {evidence}"
    return False, dtype, f"auto: {evidence}, so {dtype} would be emulated, slower than fp32"


def precision_of(c, device: torch.device, modes: dict) -> tuple[bool, str, str]:
    """choose_precision for a TrainerConfig and the sections of its parallelisms (Plan.of's), with
    its reason in words: what the job line says."""
    refused = fp16_refused_by(Plan.of(c, device, **modes))
    return choose_precision(c.use_amp, c.amp_dtype, device, None, refused)


def tf32_matmuls(device: torch.device) -> bool:
    """Whether fp32 matmuls can run as TF32 on this device: NVIDIA GPUs from Ampere (compute
    capability 8.0) on; V100 and T4 have no TF32, and the setting changes nothing there."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


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
            return next(
                (set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")),
                set(),
            )
    except OSError:
        return set()


def bf16_native(device: torch.device, flags: set[str] | None = None) -> tuple[bool, str]:
    """Whether the device computes bf16 in hardware, and the evidence, in words. On a CPU without
    AVX-512 BF16 or AMX, bf16 is converted to fp32 and back around every multiply (slower than
    fp32)."""
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        return (
            native,
            f"{torch.cuda.get_device_name(device)} {'has' if native else 'lacks'} bf16 units",
        )
    found = sorted((cpu_flags() if flags is None else flags) & {"avx512_bf16", "amx_bf16"})
    return bool(
        found
    ), f"CPU has {' and '.join(found)}" if found else "CPU lacks AVX-512 BF16 and AMX"


def time_attention(
    device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int, int], reps: int = 5
) -> float:
    """Milliseconds for one causal scaled_dot_product_attention forward + backward at shape (B, nh,
    T, hs)."""
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times[1:])[reps // 2]  # the median


def autocast_attention_fp32(
    plan: Plan, device: torch.device, shape: tuple[int, int, int, int]
) -> tuple[bool, str]:
    """Under bf16 autocast, should attention run in fp32? Decided by timing both on this device at
    the model's shape (a few milliseconds at start), not assumed: some CPUs' bf16 attention kernels
    are slower than their fp32 ones. Returns the choice and the two times, in words."""
    if not plan.use_amp or plan.amp_dtype != "bf16":
        return False, ""
    bf16_ms, fp32_ms = (
        time_attention(device, torch.bfloat16, shape),
        time_attention(device, torch.float32, shape),
    )
    return (
        fp32_ms < bf16_ms,
        f"attention {'fp32' if fp32_ms < bf16_ms else 'bf16'} "
        f"(measured here: bf16 {bf16_ms:.2f} ms, fp32 {fp32_ms:.2f} ms)",
    )


def grad_scaler(plan: Plan, device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler that is active only for fp16 (bf16 does not underflow like fp16 does); its
    scale kept in CPU memory where the gradients are (FSDP CPU offload)."""
    enabled = plan.use_amp and plan.amp_dtype == "fp16"
    if plan.cpu_offload:
        return CPUScaleGradScaler(device.type, enabled=enabled)
    return torch.amp.GradScaler(device.type, enabled=enabled)


class CPUScaleGradScaler(torch.amp.GradScaler):
    """fp16's loss scale held in CPU memory, for gradients and optimizer state that live there
    (FSDP CPU offload) while the loss is computed on a GPU.

    torch's GradScaler keeps its scale beside the first loss it scales (on the GPU) and hands each
    other device a copy made with non_blocking=True. To the CPU such a copy lands in pinned memory
    asynchronously, yet the CPU unscale kernel and the fused CPU AdamW read it at once: a stale
    1/scale, or an overflow flag overwritten by the late copy, so overflowed steps are applied
    and the scale never backs off. With the scale on the CPU every copy the CPU side reads is a
    plain one, and the GPU receives the scale when the loss is scaled (a host-to-device copy that
    is safe to overlap)."""

    def scale(self, outputs):
        if self._enabled and self._scale is None:
            self._lazy_init_scale_growth_tracker(torch.device("cpu"))
        return super().scale(outputs)


def local_bytes(tensors) -> int:
    """Bytes this rank holds for a set of tensors (only the local shard of a DTensor)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total
