"""What updates the weights: the optimizers, which parameters each one owns, and the learning-rate
schedule.

Two choices (optimizer_config.optimizer):
- adamw: AdamW for every parameter (GPT-2, nanoGPT), weight decay on matrices only.
- muon: Muon (torch.optim.Muon, Jordan et al. 2024, the GPT-2 speedrun's optimizer) for the 2-D
  weight matrices inside the transformer blocks, AdamW for the rest. Muon keeps a momentum of each
  matrix's gradient and replaces it by the nearest semi-orthogonal matrix (a few Newton-Schulz
  iterations: U V^T of its SVD, without computing an SVD), so the update moves the matrix the same
  amount in every direction instead of mostly along the gradient's few dominant ones.
  Embeddings are lookups (a row per token, not a linear map), and the head and the 1-D gains and
  biases are not hidden matrices either: they stay with AdamW, as in the speedrun.

Distributed: under DDP, gradients are all-reduced before the step, so every replica orthogonalises
the same full gradient and takes the same update. Under FSDP a rank holds a slice of each matrix,
and Newton-Schulz needs the whole matrix, so Muon with FSDP (and inside DeepSpeed's engine, which
takes one torch optimizer) is refused at start with the setting to change.

The schedule is a pure function of the step (resuming at step s continues it exactly): linear
warmup, then cosine decay to min_lr (nanoGPT), or warmup-stable-decay (the speedrun's trapezoid:
hold the peak, then a straight line down to min_lr over the last decay_frac of the steps).
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager

import torch
import torch.nn as nn

from mingpt_ddp.config.optimizer import OptimizerConfig
from mingpt_ddp.errors import ConfigError


class Muon(torch.optim.Muon):
    """torch.optim.Muon with one change: the Newton-Schulz iterations of all matrices of one shape
    run together, as batched matrix products. The math, the state ("momentum_buffer") and the
    snapshot format are torch's; on a small model the per-matrix loop is mostly call overhead (this
    model's 16 matrices: 16 ms a step one by one on a 2-core CPU, 8 ms batched by shape)."""

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("this Muon does not take a closure")
        for group in self.param_groups:
            if group["adjust_lr_fn"] not in (None, "original"):
                raise ValueError(
                    "this Muon scales the learning rate as torch's default (adjust_lr_fn=None) only"
                )
            momentum, lr, decay = group["momentum"], group["lr"], group["weight_decay"]
            by_shape: dict[torch.Size, list[tuple[torch.Tensor, torch.Tensor]]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)  # B = mu B + (1 - mu) g
                update = (
                    p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                )  # Nesterov: look ahead
                by_shape.setdefault(p.shape, []).append((p, update))
            for (rows, cols), pairs in by_shape.items():
                ortho = newton_schulz(
                    torch.stack([u for _, u in pairs]),
                    group["ns_coefficients"],
                    group["ns_steps"],
                    group["eps"],
                )  # (N, rows, cols)
                # torch's default scale: a tall matrix (rows > cols) moves sqrt(rows / cols) faster.
                scaled_lr = lr * math.sqrt(max(1.0, rows / cols))
                for (p, _), o in zip(pairs, ortho):
                    p.mul_(1 - lr * decay)  # decoupled weight decay
                    p.add_(o.to(p.dtype), alpha=-scaled_lr)
        return None


def newton_schulz(
    G: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """Approximately orthogonalise each matrix of a (N, rows, cols) stack (torch.optim.Muon's
    quintic iteration, in bf16): X <- a X + (b A + c A^2) X with A = X X^T, starting from X / |X|,
    pushes every singular value towards 1 (to within about 0.7-1.2) without computing an SVD."""
    a, b, c = coefficients
    X = G.bfloat16()
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT  # iterate on the wide orientation: A = X X^T is then the smaller square
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        A = X @ X.mT  # (N, r, r), r = min(rows, cols)
        X = torch.baddbmm(X, torch.baddbmm(A, A, A, beta=b, alpha=c), X, beta=a)
    return X.mT if tall else X


def update_kernel(params: list, device_type: str) -> dict:
    """AdamW's kernel: the fused one updates all parameters in one pass (CUDA and CPU), but takes
    no mix of DTensors and tensors (tensor parallelism's blocks beside whole embeddings); then
    the plain loop, one parameter at a time."""
    if len({hasattr(p, "to_local") for p in params}) > 1:  # DTensors and tensors
        return {"fused": False, "foreach": False}
    return {"fused": device_type in ("cuda", "cpu")}


@contextmanager
def own_kernels(optimizers: list[torch.optim.Optimizer]):
    """Around loading optimizer state: load_state_dict sets every param group's settings from the
    saved run, its update kernel too (fused, foreach); keep this run's, which update_kernel chose
    for these parameters (a fused AdamW cannot take a tensor-parallel mix)."""
    groups = [g for o in optimizers for g in o.param_groups]
    kept = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in groups]
    yield
    for group, flags in zip([g for o in optimizers for g in o.param_groups], kept):
        group.update(flags)


def build_optimizers(
    model: nn.Module, cfg: OptimizerConfig, device_type: str
) -> list[torch.optim.Optimizer]:
    """The optimizers for a model's parameters: [AdamW] or [AdamW, Muon]. Build them after FSDP has
    sharded the model, so that they hold the sharded parameters."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]  # tied: once
    hidden = [
        p
        for name, p in named
        if cfg.optimizer == "muon" and p.dim() == 2 and name.startswith("blocks.")
    ]
    hidden_ids = {id(p) for p in hidden}
    rest = [p for _, p in named if id(p) not in hidden_ids]
    # Biases and LayerNorm gains are 1-D: decaying them towards zero only hurts.
    groups = [
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizers: list[torch.optim.Optimizer] = [
        torch.optim.AdamW(
            groups,
            lr=cfg.learning_rate,
            betas=(cfg.beta1, cfg.beta2),
            **update_kernel([p for _, p in named], device_type),
        )
    ]
    if hidden:
        optimizers.append(
            Muon(
                hidden,
                lr=cfg.muon_lr,
                weight_decay=cfg.weight_decay,
                momentum=cfg.muon_momentum,
                nesterov=True,
            )
        )
    return optimizers


def splitter(parallel: str) -> str:
    """The setting that splits the matrices, as a user writes it: "parallel=fsdp", or a key."""
    return parallel if "=" in parallel else f"parallel={parallel}"


def check_muon_supported(cfg: OptimizerConfig, parallel: str) -> None:
    """Muon orthogonalises whole matrices: the modes that split them over the ranks (FSDP,
    DeepSpeed ZeRO) refuse it through this check, naming themselves."""
    if cfg.optimizer == "muon":
        raise ConfigError(
            "optimizer_config.optimizer=muon needs each weight matrix whole on every rank "
            f"(Newton-Schulz works on the full matrix), and {splitter(parallel)} splits them; "
            "use parallel=ddp without tensor parallelism, or optimizer_config.optimizer=adamw"
        )


def set_learning_rates(
    optimizers: list[torch.optim.Optimizer], cfg: OptimizerConfig, step: int, max_steps: int
) -> None:
    """Set every group's learning rate for this step: each optimizer's peak times the schedule."""
    scale = cfg.lr_scale(step, max_steps)
    for optimizer in optimizers:
        peak = cfg.muon_lr if isinstance(optimizer, torch.optim.Muon) else cfg.learning_rate
        for group in optimizer.param_groups:
            group["lr"] = peak * scale


def state_tensors(optimizers: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The per-parameter state the optimizers hold (AdamW's two moments, Muon's momentum)."""
    return [
        t
        for opt in optimizers
        for state in opt.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim()
    ]


def schedule_change(saved: dict, cfg: OptimizerConfig, max_steps: int, step: int) -> str:
    """A resumed run's schedule is computed afresh from this run's settings, not carried in the
    snapshot: a larger max_steps stretches the decay, so the learning rate jumps back up at the
    step resumed (the defaults: 1.00e-04 at step 200 of 200, then 3.25e-04 at step 200 of 250,
    against a curve it never warmed into). That may be what
    you want (train longer) but it is no continuation: say so, in one line ("" if unchanged)."""
    if not saved:  # started fresh
        return ""
    known = {
        f.name for f in dataclasses.fields(cfg)
    }  # an old snapshot may name fewer, or gone ones
    before = dataclasses.replace(
        cfg, **{k: v for k, v in saved.get("optimizer_config", {}).items() if k in known}
    )
    was = saved.get("trainer_config", {}).get("max_steps", max_steps)
    old, new = before.lr_at(step, was), cfg.lr_at(step, max_steps)
    if math.isclose(old, new, rel_tol=1e-6):
        return ""
    return (
        f"schedule | learning rate at step {step}: {old:.2e} in the snapshot's schedule "
        f"(max_steps {was}), {new:.2e} in this run's (max_steps {max_steps}): the schedule is "
        "this run's settings, not the snapshot's; keep them to continue the same curve"
    )
