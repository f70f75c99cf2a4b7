"""Generate text from a snapshot: no training data needed, the snapshot carries the vocabulary.

    python sample.py                                   # newest snapshot of the default run
    python sample.py --snapshot runs/shakespeare_char/snapshots --prompt "ROMEO:" --chars 500
    python sample.py --snapshot s3://bucket/run/snapshots --device cuda --top-k 40 --seed 7
    python sample.py --snapshot model.pt               # a file from `python snapshot.py consolidate`
"""

from __future__ import annotations

import argparse
import sys

import fsspec
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from char_dataset import CharTokenizer
from config import build_section
from model import GPT, GPTConfig
from snapshot import SnapshotError, SnapshotStore
from train_config import TrainerConfig


def load_model(snapshot: str, device: str) -> tuple[GPT, CharTokenizer, int]:
    """The model and tokenizer of the newest usable snapshot under a directory/URL (any kind:
    single-file or sharded, from any world size), or of one .pt file; and its step."""
    models: list[GPT] = []

    def template(meta: dict) -> dict | None:
        models.append(GPT(build_section(GPTConfig, meta["config"]["gpt_config"])))
        # A sharded snapshot is loaded straight into this model's tensors (no optimizer needed).
        return None if "model" in meta else {"model": get_model_state_dict(models[-1])}

    if snapshot.endswith(".pt"):  # a single file, e.g. from `python snapshot.py consolidate`
        with fsspec.open(snapshot, "rb") as f:
            state = torch.load(f, map_location="cpu", weights_only=True)
        template(state)
    else:
        state = SnapshotStore(snapshot).load_latest(map_location="cpu", template=template)
    if state is None:
        raise SnapshotError(f"no snapshot under {snapshot!r}; train first or pass --snapshot <dir, URL or .pt>")
    set_model_state_dict(models[-1], state["model"])
    return models[-1].to(device).eval(), CharTokenizer(state["vocab"]), state["step"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Generate text from a trained snapshot.")
    p.add_argument("--snapshot", default=TrainerConfig.snapshot_path, help="snapshot directory or URL")
    p.add_argument("--prompt", default="\n", help="text to continue (its characters must be in the vocabulary)")
    p.add_argument("--chars", type=int, default=500, help="characters to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="<1 is more conservative, >1 more random")
    p.add_argument("--top-k", type=int, default=None, help="sample only among the k most likely characters")
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
    print(f"# step {step} snapshot, seed {args.seed}, temperature {args.temperature}", file=sys.stderr)
    print(tokenizer.decode(out[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
