"""Where weights come from for export and for trainer_config.init_from: a snapshot (any layout,
its newest), a single .pt file (consolidate's, or --from-hf's), or a GPT-2 folder."""

from __future__ import annotations

import os

import fsspec
import torch

from mingpt_ddp.config.model import GPTConfig
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.snapshots.store import SnapshotError, SnapshotStore

HF_EXTRA = 'pip install -e ".[hf]"'


def require_hf() -> None:
    """transformers and tokenizers, or a one-line error naming the extra. Their progress bars and
    notices off: the command's own line says what it wrote."""
    try:
        import tokenizers  # noqa: F401
        import transformers
    except ImportError as e:
        raise ConfigError(
            f"the Hugging Face format needs transformers and tokenizers: {HF_EXTRA} ({e})"
        ) from None
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def read_snapshot(path: str) -> dict:
    """A snapshot as one dict of full tensors and its metadata (as sample.py --snapshot reads:
    a directory or URL, its newest usable snapshot whatever the layout; or one .pt file)."""
    if path.endswith(".pt"):
        with fsspec.open(path, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    state = SnapshotStore(path).load_latest()
    if state is None:
        raise SnapshotError(
            f"no snapshot under {path!r}; train first or pass a directory, URL or .pt"
        )
    return state


def weights_of(path: str) -> tuple[dict, dict, str]:
    """(model state dict, gpt_config as a dict, the character vocabulary) of a GPT-2 folder (one
    with config.json), a .pt file, or a snapshot."""
    if os.path.isfile(os.path.join(path, "config.json")):
        require_hf()
        from mingpt_ddp.export.gpt2 import from_hf

        return from_hf(path)
    state = read_snapshot(path)
    return state["model"], state["config"]["gpt_config"], state["vocab"]


def initial_state(path: str, cfg: GPTConfig, chars: str) -> dict:
    """trainer_config.init_from's weights for a model of cfg trained on chars: the run starts
    from them (a snapshot of the run itself, once there is one, is resumed instead). Refused in
    one line when the vocabulary or the shape differs, naming the settings to change."""
    state, saved, vocab = weights_of(path)
    if vocab != chars:
        raise ConfigError(
            f"trainer_config.init_from={path}: its vocabulary ({len(vocab)} characters) is not "
            f"this corpus's ({len(chars)}): train on the text it was trained on"
        )
    differ = [f for f in GPTConfig.SHAPE_FIELDS if f in saved and saved[f] != getattr(cfg, f)]
    if differ:
        fix = " ".join(
            "data_config.block_size=" + str(saved[f])
            if f == "block_size"
            else f"gpt_config.{f}={saved[f]}"
            for f in differ
        )
        raise ConfigError(f"trainer_config.init_from={path} is a model of another shape: set {fix}")
    return state
