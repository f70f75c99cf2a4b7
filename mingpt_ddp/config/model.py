"""The network's shape and regularisation (config section `gpt_config`), and the named sizes
(the `model=` group). model.py builds the network from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mingpt_ddp.errors import ConfigError

ACTIVATION_NAMES = ("gelu", "gelu_tanh", "relu2")  # model.ACTIVATIONS implements each

MODEL_SIZES: dict[str, tuple[int, int, int]] = {
    "gpt-micro": (4, 4, 128),
    "tiny": (2, 2, 32),
    "gpt-nano": (3, 3, 48),
    "gpt-mini": (6, 6, 192),
    "baby-gpt": (6, 6, 384),
    "gopher-44m": (8, 16, 512),
    "gpt2": (12, 12, 768),
    "gpt2-medium": (24, 16, 1024),
    "gpt2-large": (36, 20, 1280),
    "gpt2-xl": (48, 25, 1600),
}


@dataclass
class GPTConfig:
    """Shape and regularisation of the network (config section `gpt_config`; sizes: model=...)."""

    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 128
    """Width of the residual stream (C)."""
    dropout: float = 0.0
    """Dropout on embeddings and on each residual branch (0 for small data and short runs)."""
    attn_dropout: float = 0.0
    """Dropout on the attention probabilities inside scaled_dot_product_attention."""
    bias: bool = True
    """Bias terms in Linear and LayerNorm layers."""
    vocab_size: int = 0
    """Set from the dataset's vocabulary at run time (a value given here is replaced)."""
    block_size: int = 0
    """Context length; set from data_config.block_size at run time (a value given here is
    replaced)."""
    # The speedrun's switches (modded-nanogpt); each off is nanoGPT's model. The ablation table in
    # the README (benchmarks/time_to_quality.py --ablation) measures what each one buys.
    rotary: bool = False
    """Rotary position embeddings (queries and keys rotated by position) instead of a learned
    position table."""
    qk_norm: bool = False
    """RMS-normalise each head's queries and keys before attention (keeps attention logits
    bounded)."""
    activation: str = "gelu"
    """The MLP's nonlinearity: gelu (exact, erf), gelu_tanh (GPT-2's tanh approximation: what
    imported GPT-2 weights were trained with; 4.7e-4 from gelu at most), or relu2 (ReLU squared,
    max(0, x)^2: Primer's and the speedrun's)."""
    zero_init_proj: bool = False
    """Start the projections that write into the residual stream (and an untied head) at zero, so
    each block starts as the identity."""
    tie_embeddings: bool = True
    """The output head reuses the token embedding matrix (GPT-2); false: the head has its own
    matrix."""
    logit_softcap: float = 0.0
    """Squash logits smoothly into (-cap, cap) with cap * tanh(logits / cap); 0: off."""
    # Mixture of experts (mingpt_ddp/moe.py): each block's MLP becomes n_experts smaller MLPs and
    # a router that sends every token to top_k of them. 0 experts: the dense MLP.
    n_experts: int = 0
    """Experts per block (0: the dense MLP). Expert parallelism splits them: mesh_config.ep."""
    top_k: int = 2
    """Experts each token is sent to (1: Switch Transformer; 2: Mixtral; 8 of 256: DeepSeek-V3)."""
    expert_hidden: int = 0
    """Each expert's hidden width; 0: 4 x n_embd / (top_k + shared_expert), so a token meets
    as many MLP weights as the dense model's (the same active parameters per token)."""
    shared_expert: bool = False
    """One more expert that every token goes through, beside its routed ones (DeepSeek-V3)."""
    router: str = "softmax"
    """Router scores: softmax over the experts (Switch, Mixtral: the chosen scores weight the
    outputs as they are) or sigmoid (DeepSeek-V3: the chosen scores normalised to sum to 1)."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (Switch's E x sum_e f_e P_e, per sequence as
    DeepSeek-V3's); 0: off."""
    bias_update_rate: float = 0.0
    """DeepSeek-V3's loss-free balance: after each step every expert's routing bias moves by this
    rate towards balance (down if it got more than its share of tokens); 0: off."""
    capacity_factor: float = 0.0
    """Tokens an expert takes per batch, as a multiple of its fair share (top_k x tokens /
    n_experts); the rest are dropped (their MLP output is 0). 0: dropless, every token kept."""

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"gpt_config.{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"gpt_config.n_embd ({self.n_embd}) must be divisible by "
                f"gpt_config.n_head ({self.n_head})"
            )
        for name in ("dropout", "attn_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"gpt_config.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.activation not in ACTIVATION_NAMES:
            raise ConfigError(
                f"gpt_config.activation must be one of {', '.join(ACTIVATION_NAMES)}, "
                f"got {self.activation!r}"
            )
        if self.logit_softcap < 0:
            raise ConfigError(
                f"gpt_config.logit_softcap must be >= 0 (0: off), got {self.logit_softcap}"
            )
        check_experts(self)
        if self.rotary and (self.n_embd // self.n_head) % 2:
            raise ConfigError(
                f"gpt_config.rotary=true needs an even head size; n_embd / n_head = "
                f"{self.n_embd // self.n_head}"
            )

    # The fields a snapshot must agree on to be loadable into this model: its shape, and what the
    # weights were trained to compute (the same tensors under another activation would load, and be
    # wrong).
    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = (
        "n_layer",
        "n_head",
        "n_embd",
        "vocab_size",
        "block_size",
        "bias",
        "rotary",
        "qk_norm",
        "activation",
        "tie_embeddings",
        "logit_softcap",
        "n_experts",
        "expert_hidden",
        "shared_expert",
    )

    @property
    def hidden(self) -> int:
        """An expert's hidden width (expert_hidden, or the dense MLP's 4C shared out)."""
        return self.expert_hidden or 4 * self.n_embd // (self.top_k + self.shared_expert)


ROUTERS = ("softmax", "sigmoid")


def check_experts(cfg: GPTConfig) -> None:
    """Refuse mixture-of-experts settings that cannot route, naming the key."""
    if cfg.n_experts < 0 or cfg.n_experts == 1:
        raise ConfigError(
            f"gpt_config.n_experts must be 0 (the dense MLP) or 2 or more, got {cfg.n_experts}"
        )
    if cfg.n_experts and not 1 <= cfg.top_k <= cfg.n_experts:
        raise ConfigError(
            f"gpt_config.top_k={cfg.top_k} must be between 1 and gpt_config.n_experts="
            f"{cfg.n_experts}: each token goes to top_k different experts"
        )
    if cfg.router not in ROUTERS:
        raise ConfigError(f"gpt_config.router must be softmax or sigmoid, got {cfg.router!r}")
    for name in ("aux_loss_coef", "bias_update_rate", "capacity_factor", "expert_hidden"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"gpt_config.{name} must be >= 0, got {getattr(cfg, name)}")
