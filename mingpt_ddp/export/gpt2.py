"""This project's GPT and transformers' GPT2LMHeadModel: one architecture (learned positions,
pre-LayerNorm blocks, GELU, a tied head), so the weights map one to one. What differs:

- names: wte -> transformer.wte, blocks.i -> transformer.h.i, qkv -> c_attn, fc -> c_fc,
  proj -> c_proj;
- GPT-2's projections are Conv1D modules, whose weight is a Linear's transposed: (in, out);
- the nonlinearity: this project's gelu is the exact one (erf), GPT-2's gelu_new the tanh
  approximation, up to 4.7e-4 apart: an export says "gelu" (transformers' exact one), and an
  import of gelu_new sets gpt_config.activation=gelu_tanh;
- GPT-2 always has biases: bias=false exports zeros (the same function), an import keeps them.

What GPT-2 cannot compute is refused in one line each: rotary positions, QK norm, logit
soft-capping, experts.
"""

from __future__ import annotations

import torch

from mingpt_ddp.errors import ConfigError
from mingpt_ddp.export.tokenizer import end_of_text

BLOCK = {  # a block's modules: this project's -> GPT-2's
    "ln_1": "ln_1",
    "ln_2": "ln_2",
    "attn.qkv": "attn.c_attn",
    "attn.proj": "attn.c_proj",
    "mlp.fc": "mlp.c_fc",
    "mlp.proj": "mlp.c_proj",
}
CONV1D = {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}  # weights stored (in, out)
TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu2": "relu2"}
FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
FROM_HF["relu2"] = "relu2"
UNMAPPABLE = {
    "rotary": "GPT-2 adds learned positions, it does not rotate queries and keys",
    "qk_norm": "GPT-2 does not normalise queries and keys",
    "logit_softcap": "GPT-2 does not cap its logits",
    "n_experts": "GPT-2's blocks have one MLP, not experts",
}
EPS = 1e-5  # this project's LayerNorm epsilon (nn.LayerNorm's default), and GPT-2's


def hf_name(name: str) -> str:
    """A parameter's name in GPT2LMHeadModel."""
    if name.startswith("blocks."):
        _, i, rest = name.split(".", 2)
        module, param = rest.rsplit(".", 1)
        return f"transformer.h.{i}.{BLOCK[module]}.{param}"
    return name if name == "lm_head.weight" else f"transformer.{name}"


def project_name(name: str) -> str:
    """A GPT2LMHeadModel parameter's name here."""
    if name.startswith("transformer.h."):
        i, rest = name.removeprefix("transformer.h.").split(".", 1)
        module, param = rest.rsplit(".", 1)
        return f"blocks.{i}.{next(k for k, v in BLOCK.items() if v == module)}.{param}"
    return name.removeprefix("transformer.")


def conv1d(hf: str) -> bool:
    return (
        hf.startswith("transformer.h.")
        and hf.endswith(".weight")
        and any(f".{module}." in hf for module in CONV1D)
    )


def hf_config(cfg: dict, chars: str):
    """GPT2Config for a gpt_config (a dict, as snapshots keep it); refuses what GPT-2 lacks."""
    from transformers import GPT2Config

    for key, why in UNMAPPABLE.items():
        if cfg.get(key):
            raise ConfigError(f"gpt_config.{key}={cfg[key]}: {why}; GPT-2's format cannot hold it")
    eos = chars.index(end_of_text(chars))
    return GPT2Config(
        vocab_size=len(chars),
        n_positions=cfg["block_size"],  # the learned position table's rows
        n_embd=cfg["n_embd"],
        n_layer=cfg["n_layer"],
        n_head=cfg["n_head"],
        activation_function=TO_HF[cfg.get("activation", "gelu")],
        resid_pdrop=cfg.get("dropout", 0.0),
        embd_pdrop=cfg.get("dropout", 0.0),
        attn_pdrop=cfg.get("attn_dropout", 0.0),
        layer_norm_epsilon=EPS,
        bos_token_id=eos,  # inside the vocabulary: GPT-2's own 50256 is not
        eos_token_id=eos,
        tie_word_embeddings=cfg.get("tie_embeddings", True),
    )


def to_hf(model_state: dict, cfg: dict, chars: str):
    """A GPT2LMHeadModel holding a snapshot's weights (fp32)."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(hf_config(cfg, chars))
    tied = cfg.get("tie_embeddings", True)
    mapped = {
        hf_name(name): tensor.detach().float().cpu()
        for name, tensor in model_state.items()
        if not (tied and name == "lm_head.weight")  # one matrix, held by wte
    }
    mapped = {name: t.t() if conv1d(name) else t for name, t in mapped.items()}
    for name, tensor in model.state_dict().items():
        if name.endswith(".bias") and name not in mapped and not cfg.get("bias", True):
            mapped[name] = torch.zeros_like(tensor)  # bias=false: zero biases compute the same
    missing, unexpected = model.load_state_dict(mapped, strict=False)
    missing = [name for name in missing if not (tied and name == "lm_head.weight")]
    if missing or unexpected:
        raise ConfigError(f"the snapshot's weights do not fit GPT-2: {missing or unexpected}")
    return model


def from_hf(folder: str) -> tuple[dict, dict, str]:
    """A GPT-2 folder (config.json, weights, tokenizer.json) as (this project's state dict,
    gpt_config, the character vocabulary). Read from disk only: nothing is downloaded."""
    from transformers import GPT2LMHeadModel

    from mingpt_ddp.export.tokenizer import chars_of

    chars = chars_of(folder)
    model = GPT2LMHeadModel.from_pretrained(folder, local_files_only=True).float()
    config = model.config
    check_gpt2(config, len(chars))
    cfg = {
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_embd": config.n_embd,
        "vocab_size": config.vocab_size,
        "block_size": config.n_positions,
        "dropout": config.resid_pdrop,
        "attn_dropout": config.attn_pdrop,
        "bias": True,
        "activation": FROM_HF[config.activation_function],
        "tie_embeddings": config.tie_word_embeddings,
    }
    state = {
        project_name(name): (tensor.t() if conv1d(name) else tensor).contiguous()
        for name, tensor in model.state_dict().items()
    }
    if cfg["tie_embeddings"]:  # one matrix: the head's name holds wte's, as GPT's state_dict does
        state["lm_head.weight"] = state["wte.weight"]
    return state, cfg, chars


def check_gpt2(config, vocab: int) -> None:
    """Refuse, in one line, a GPT-2 variant this project's GPT does not compute."""
    why = ""
    if config.model_type != "gpt2":
        why = f"model_type {config.model_type!r}, not gpt2"
    elif config.activation_function not in FROM_HF:
        why = f"activation_function {config.activation_function!r} (known: {', '.join(FROM_HF)})"
    elif config.n_inner not in (None, 4 * config.n_embd):
        why = f"n_inner={config.n_inner}: this project's MLP is 4 x n_embd wide"
    elif abs(config.layer_norm_epsilon - EPS) > 1e-12:
        why = f"layer_norm_epsilon={config.layer_norm_epsilon}: this project's LayerNorm uses {EPS}"
    elif not config.scale_attn_weights or config.scale_attn_by_inverse_layer_idx:
        why = "attention scaled otherwise than by 1/sqrt(head size)"
    elif config.vocab_size != vocab:
        why = f"vocab_size {config.vocab_size}, but its tokenizer has {vocab} characters"
    if why:
        raise ConfigError(f"not importable as this project's GPT: {why}")
