"""Snapshot tools: python -m mingpt_ddp.snapshots consolidate <snapshot path> <out.pt>

consolidate turns the newest snapshot of a run, whatever its layout (one file, FSDP's DCP shards,
DeepSpeed's files), into one .pt file of full tensors that sample.py (or anything) can load."""

import argparse
import sys

from mingpt_ddp.snapshots.store import SnapshotError, SnapshotStore

p = argparse.ArgumentParser(description="Snapshot tools.")
sub = p.add_subparsers(dest="command", required=True)
c = sub.add_parser("consolidate", help="turn the newest (sharded) snapshot into one .pt file")
c.add_argument("snapshot", help="snapshot directory or URL (trainer_config.snapshot_path)")
c.add_argument("out", help="the single file to write")
args = p.parse_args()
try:
    state = SnapshotStore(args.snapshot).consolidate(args.out)
except SnapshotError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
print(f"wrote {args.out}: step {state['step']}, {len(state['model'])} model tensors")
