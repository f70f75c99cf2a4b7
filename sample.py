"""Generate text from a snapshot: no training data needed, the snapshot carries the vocabulary.

python sample.py                                   # newest snapshot of the default run
python sample.py --snapshot runs/shakespeare_char/snapshots --prompt "ROMEO:" --chars 500
python sample.py --snapshot s3://bucket/run/snapshots --device cuda --top-k 40 --seed 7
python sample.py --snapshot model.pt               # a file from
                                                   # `python -m mingpt_ddp.snapshots consolidate`
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from char_dataset import CharTokenizer
from mingpt_ddp.config.trainer import TrainerConfig
from mingpt_ddp.export.weights import read_snapshot
from mingpt_ddp.snapshots.store import SnapshotError, SnapshotStore
from model import GPT, GPTConfig


def load_model(snapshot: str, device: str) -> tuple[GPT, CharTokenizer, int]:
    """The model and tokenizer of the newest usable snapshot under a directory/URL (any kind:
    single-file or sharded, from any world size), or of one .pt file; and its step."""
    if snapshot.endswith(".pt"):  # one file: consolidate's, or the export's --from-hf
        state = read_snapshot(snapshot)
        model = _model_for(state)
    else:
        with SnapshotStore(snapshot).open_latest(map_location="cpu") as opened:
            if opened is None:
                raise SnapshotError(
                    f"no snapshot under {snapshot!r}; "
                    "train first or pass --snapshot <dir, URL or .pt>"
                )
            model = _model_for(opened.meta)
            # DCP shards load straight into this model's tensors (no optimizer needed).
            into = {"model": get_model_state_dict(model)} if opened.reshardable else None
            state = {**opened.meta, **opened.tensors(into=into)}
    set_model_state_dict(model, state["model"])
    return model.to(device).eval(), CharTokenizer(state["vocab"]), state["step"]


def _model_for(meta: dict) -> GPT:
    """A GPT of the snapshot's shape (keys its version saved that GPTConfig no longer has are left
    out)."""
    saved = meta["config"]["gpt_config"]
    return GPT(GPTConfig(**{f.name: saved[f.name] for f in fields(GPTConfig) if f.name in saved}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Generate text from a trained snapshot.")
    p.add_argument(
        "--snapshot", default=TrainerConfig().snapshot_url, help="snapshot directory or URL"
    )
    p.add_argument(
        "--prompt", default="\n", help="text to continue (its characters must be in the vocabulary)"
    )
    p.add_argument("--chars", type=int, default=500, help="characters to generate")
    p.add_argument(
        "--temperature", type=float, default=0.8, help="<1 is more conservative, >1 more random"
    )
    p.add_argument(
        "--top-k", type=int, default=None, help="sample only among the k most likely characters"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    try:
        model, tokenizer, step = load_model(args.snapshot, args.device)
        prompt = tokenizer.encode(args.prompt)[None].to(args.device)  # (1, len(prompt))
    except (SnapshotError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    generator = torch.Generator(args.device).manual_seed(args.seed)
    out = model.generate(prompt, args.chars, args.temperature, args.top_k, generator)
    print(
        f"# step {step} snapshot, seed {args.seed}, temperature {args.temperature}", file=sys.stderr
    )
    print(tokenizer.decode(out[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
