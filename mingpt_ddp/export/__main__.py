"""python -m mingpt_ddp.export: a snapshot as a Hugging Face GPT-2 folder, or back.

    python -m mingpt_ddp.export --snapshot runs/shakespeare_char/snapshots --out gpt2-shakespeare
    python -m mingpt_ddp.export --from-hf gpt2-shakespeare --out model.pt

--snapshot takes what sample.py --snapshot takes (a directory or URL: its newest snapshot, of any
layout; or one .pt file) and writes config.json, model.safetensors and a character tokenizer,
which transformers' GPT2LMHeadModel.from_pretrained and AutoTokenizer.from_pretrained load.
--from-hf turns such a folder (or any GPT-2 of a character vocabulary saved by transformers) into
one .pt file that sample.py reads; training starts from either with trainer_config.init_from.
"""

from __future__ import annotations

import argparse
import sys

import torch

from mingpt_ddp.errors import ConfigError
from mingpt_ddp.export.weights import read_snapshot, require_hf, weights_of
from mingpt_ddp.snapshots.store import SnapshotError


def export(snapshot: str, out: str) -> str:
    """The snapshot's model and vocabulary as a GPT-2 folder at out; the line to print."""
    require_hf()
    from mingpt_ddp.export.gpt2 import to_hf
    from mingpt_ddp.export.tokenizer import tokenizer_for

    state = read_snapshot(snapshot)
    cfg, chars = state["config"]["gpt_config"], state["vocab"]
    model = to_hf(state["model"], cfg, chars)
    model.save_pretrained(out)  # config.json, model.safetensors (the tied matrix once)
    tokenizer_for(chars, cfg["block_size"]).save_pretrained(out)
    return (
        f"export | step {state['step']} | {model.num_parameters() / 1e6:.2f}M parameters | "
        f"activation {model.config.activation_function} | {out}: "
        f"transformers.GPT2LMHeadModel.from_pretrained({out!r}) and AutoTokenizer load it"
    )


def import_hf(folder: str, out: str) -> str:
    """A GPT-2 folder as one .pt file (sample.py's, and trainer_config.init_from's); the line."""
    state, cfg, chars = weights_of(folder)
    torch.save({"step": 0, "model": state, "config": {"gpt_config": cfg}, "vocab": chars}, out)
    return (
        f"import | {folder} -> {out} | {cfg['n_layer']} layers, width {cfg['n_embd']}, "
        f"{len(chars)} characters, activation {cfg['activation']} | python sample.py --snapshot "
        f"{out}; train from it with trainer_config.init_from={out}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--snapshot", help="a snapshot directory or URL, or a .pt file")
    source.add_argument("--from-hf", help="a GPT-2 folder (config.json, weights, tokenizer.json)")
    p.add_argument("--out", required=True, help="the folder (--snapshot) or .pt file (--from-hf)")
    args = p.parse_args(argv)
    try:
        line = (
            export(args.snapshot, args.out) if args.snapshot else import_hf(args.from_hf, args.out)
        )
    except (ConfigError, SnapshotError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
