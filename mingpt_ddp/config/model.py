"""The network's shape and regularisation (config section `gpt_config`), and the named sizes
(the `model=` group). model.py builds the network from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mingpt_ddp.errors import ConfigError

ACTIVATION_NAMES = ("gelu", "relu2")  # model.ACTIVATIONS implements each

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
    """The MLP's nonlinearity: gelu, or relu2 (ReLU squared, max(0, x)^2: Primer's and the
    speedrun's)."""
    zero_init_proj: bool = False
    """Start the projections that write into the residual stream (and an untied head) at zero, so
    each block starts as the identity."""
    tie_embeddings: bool = True
    """The output head reuses the token embedding matrix (GPT-2); false: the head has its own
    matrix."""
    logit_softcap: float = 0.0
    """Squash logits smoothly into (-cap, cap) with cap * tanh(logits / cap); 0: off."""

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
    )
