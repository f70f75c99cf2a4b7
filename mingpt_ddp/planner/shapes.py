"""What the planner plans for: a model's shapes, a layout of its ranks, and the machine.

The model is this project's GPT (model.py: learned positions, pre-LayerNorm blocks of attention
and a 4x MLP, a head tied to the token embedding), known by its shapes alone: the planner never
needs its weights. A named size takes the project's model.MODEL_SIZES shape; GPT-2's sizes use
GPT-2's vocabulary (50,257 tokens) and context (1,024) by default, since with the character
vocabulary "gpt2" is an 85M-parameter model, not 124M.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from mingpt_ddp.config.model import MODEL_SIZES
from mingpt_ddp.config.pipeline import LOOPED, V_SHAPED
from mingpt_ddp.errors import ConfigError

GPT2_VOCAB, GPT2_CONTEXT = 50257, 1024
# A 7B-class shape in this architecture (LLaMA-7B's depth and width, GPT-2's blocks): 6.6B.
EXTRA_SIZES = {"7b": (32, 32, 4096)}


@dataclass(frozen=True)
class Model:
    n_layer: int
    n_head: int
    n_embd: int
    vocab: int = GPT2_VOCAB
    block: int = GPT2_CONTEXT
    """The context length T (the position embedding's rows)."""
    n_experts: int = 0
    """Experts in every block's MLP (gpt_config.n_experts; 0: the dense MLP)."""
    top_k: int = 2
    """The experts each token goes through (gpt_config.top_k)."""

    @property
    def hidden(self) -> int:
        """An expert's hidden width: the dense MLP's 4C shared out over top_k (GPTConfig.hidden)."""
        return 4 * self.n_embd // self.top_k

    @classmethod
    def named(cls, name: str, **override) -> Model:
        """A size of model.MODEL_SIZES (or "7b"), with any shape given in override."""
        sizes = {**MODEL_SIZES, **EXTRA_SIZES}
        if name not in sizes:
            raise ConfigError(f"--model {name}: pick one of {', '.join(sizes)} (or give shapes)")
        n_layer, n_head, n_embd = sizes[name]
        made = cls(n_layer, n_head, n_embd)
        return dataclasses.replace(made, **{k: v for k, v in override.items() if v})

    def block_tensors(self) -> dict[str, tuple[int, ...]]:
        """One block's parameters, by their names in model.py, and shapes."""
        C = self.n_embd
        return {
            "ln_1.weight": (C,),
            "ln_1.bias": (C,),
            "attn.qkv.weight": (3 * C, C),
            "attn.qkv.bias": (3 * C,),
            "attn.proj.weight": (C, C),
            "attn.proj.bias": (C,),
            "ln_2.weight": (C,),
            "ln_2.bias": (C,),
            **(self.expert_tensors() if self.n_experts else {
                "mlp.fc.weight": (4 * C, C),
                "mlp.fc.bias": (4 * C,),
                "mlp.proj.weight": (C, 4 * C),
                "mlp.proj.bias": (C,),
            }),
        }  # fmt: skip

    def expert_tensors(self) -> dict[str, tuple[int, ...]]:
        """A mixture of experts' parameters (moe.py): the router, and every expert's two
        matrices in one tensor each, expert first (what expert parallelism cuts)."""
        E, C, H = self.n_experts, self.n_embd, self.hidden
        return {"mlp.router.weight": (E, C), "mlp.w1": (E, C, H), "mlp.w2": (E, H, C)}

    def root_tensors(self, first: bool = True, last: bool = True) -> dict[str, tuple[int, ...]]:
        """Outside the blocks: the embeddings (first stage), the final LayerNorm and the tied
        head (last stage; a pipeline's last stage holds its own copy of the tied matrix)."""
        C, found = self.n_embd, {}
        if first:
            found.update({"wte.weight": (self.vocab, C), "wpe.weight": (self.block, C)})
        if last:
            found.update({"ln_f.weight": (C,), "ln_f.bias": (C,)})
            if not first:
                found["lm_head.weight"] = (self.vocab, C)
        return found

    def params(self) -> int:
        """Parameters of the whole model (the tied matrix once)."""
        block = sum(math.prod(s) for s in self.block_tensors().values())
        return self.n_layer * block + sum(math.prod(s) for s in self.root_tensors().values())

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 per parameter met (forward 2, backward 4; the embedding
        lookup is no matmul but the tied head is) plus attention's scores and weighted sum,
        12 L T C (PaLM's appendix B; causal masking's half not subtracted, as there)."""
        matmul = self.params() - self.block * self.n_embd  # the position table multiplies nothing
        # a token meets top_k of the experts (model.active_params)
        matmul -= self.n_layer * max(0, self.n_experts - self.top_k) * 2 * self.n_embd * self.hidden
        return 6 * matmul + 12 * self.n_layer * self.block * self.n_embd


@dataclass(frozen=True)
class Layout:
    """One way to spread the job: the grid's degrees (mesh.py) and a replica's batch."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sp: bool = False
    microbatches: int = 1
    """A pipeline's microbatches per step (1 without one)."""
    schedule: str = "1f1b"
    """A pipeline's schedule (pipeline_config.schedule)."""
    stages_per_rank: int = 1
    """Stages on each rank for the looped schedules (interleaved1f1b, interleavedzb)."""
    batch: int = 8
    """Windows a replica trains on per step (a pipeline cuts them into its microbatches)."""
    ac: str = "none"
    """Activation checkpointing: none | full (each block's input kept, the rest recomputed)."""
    dtype: str = "bf16"
    """Compute precision: bf16 (autocast over fp32 parameters, or FSDP's bf16 copies) | fp32."""
    parallel: str = "fsdp"
    """How the data-parallel ranks hold the model: ddp (replicas) | fsdp (shards)."""
    ep: int = 1
    """Expert parallelism: data-parallel ranks side by side sharing out the experts (mesh.py)."""

    @property
    def stages(self) -> int:
        """A pipeline's stages (PipelineConfig.stages): pp x stages_per_rank for the looped
        schedules, 2 a rank for the V-shaped ones, 1 a rank for GPipe and 1F1B."""
        per_rank = self.stages_per_rank if self.schedule in LOOPED else 1
        return self.pp * (2 if self.schedule in V_SHAPED else per_rank)

    @property
    def micro(self) -> int:
        """Windows in one forward unit: a pipeline's microbatch, else the replica's batch."""
        return self.batch // (self.microbatches if self.pp > 1 else 1)

    @property
    def itemsize(self) -> int:
        """Bytes of an element in the compute precision."""
        return 2 if self.dtype == "bf16" else 4

    @property
    def gpus(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    def degrees(self) -> dict[str, int]:
        keys = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
        return {k: getattr(self, k) for k in keys}

    def name(self) -> str:
        """In the parallelism benchmark's words: "dp4 fsdp x tp2 x pp2 1f1b m=8"."""
        dp = self.dp_replicate * self.dp_shard
        how = "hsdp" if self.parallel == "fsdp" and self.dp_replicate > 1 else self.parallel
        parts = [f"dp{dp} {how}"] if dp > 1 else []
        parts += [f"{k}{v}" for k, v in (("tp", self.tp), ("cp", self.cp)) if v > 1]
        if self.pp > 1:  # "pp2 zbv m=4", "pp2 interleaved1f1b m=4 v=2"
            v = f" v={self.stages_per_rank}" if self.schedule in LOOPED else ""
            parts.append(f"pp{self.pp} {self.schedule} m={self.microbatches}{v}")
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        words = " x ".join(parts) or "one rank"
        if dp == 1 and self.cp > 1:  # cp's ranks hold the same parameters: which wrapper
            words += f" ({self.parallel} over cp)"
        return words + (" sp" if self.sp else "") + (" ac" if self.ac != "none" else "")


@dataclass(frozen=True)
class Machine:
    """The GPUs, with the numbers the step time is estimated from (defaults: an H100 SXM node,
    the figures NVIDIA publishes)."""

    gpus: int = 8
    gpus_per_node: int = 8
    memory_gib: float = 80.0
    peak_tflops: float = 989.0
    """Dense bf16 tensor-core peak (H100 SXM: 989 TFLOP/s without sparsity)."""
    mfu: float = 0.4
    """The share of peak the matmuls reach (nanoGPT-class training: 40-55%)."""
    nvlink_gbs: float = 450.0
    """Per GPU, each direction, inside a node (H100 NVLink 4: 900 GB/s both ways)."""
    network_gbs: float = 50.0
    """Per GPU, each direction, between nodes (one 400 Gb/s InfiniBand NDR link per GPU)."""


# Named machines: each GPU's memory (GiB), dense bf16 peak and links, as NVIDIA and the
# InfiniBand generations publish them (per GPU, each direction).
MACHINES = {
    "h100": dict(memory_gib=80.0, peak_tflops=989.0, nvlink_gbs=450.0, network_gbs=50.0),
    "a100": dict(memory_gib=80.0, peak_tflops=312.0, nvlink_gbs=300.0, network_gbs=25.0),
}
"""h100: H100 SXM, NVLink 4 (900 GB/s both ways), InfiniBand NDR 400 Gb/s a GPU; a100: A100 SXM
80 GB, NVLink 3 (600 GB/s both ways), InfiniBand HDR 200 Gb/s a GPU."""
