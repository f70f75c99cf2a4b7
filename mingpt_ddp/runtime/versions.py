"""Which torch this project runs on, checked before anything imports what older versions lack.

The minimum is the oldest release that runs all of this project correctly, found by
running the tests against each (.ci/torch_range.sh; November 2026):
- 2.4, 2.5: no public torch.distributed.tensor / fsdp.fully_shard: `import trainer` fails;
- 2.6: FSDP2 on CPU (gloo) fails in its all-gather ('Stream' has no attribute 'record_event');
- 2.7: gloo has no reduce_scatter (the collectives tutorial), the ring tutorial hangs, and
  FSDP2 on gloo sums gradients instead of averaging them (twice DDP's norm at 2 ranks);
- 2.8: that last one still (FSDP2 asks gloo for ReduceOp.AVG, which gloo then sums);
- 2.9.1 and later: FSDP2 matches DDP, and the whole suite passes.
Cluster images often carry an older torch, and pip keeps it when the declared range
allows it, so pyproject.toml declares the same minimum.
"""

from __future__ import annotations

import re
import sys

MIN_TORCH = "2.9"


def torch_version_problem(version: str) -> str | None:
    """A one-line explanation if `version` (torch.__version__) is too old, else None."""
    found = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", version).groups())
    if found >= tuple(int(x) for x in MIN_TORCH.split(".")):
        return None
    return (
        f"torch {version} is installed; this project needs torch >= {MIN_TORCH} "
        f"(pip install 'torch>={MIN_TORCH}')"
    )


def require_supported_torch() -> None:
    """Exit with that line (status 1) instead of an ImportError traceback from deep inside a
    module."""
    import torch

    if problem := torch_version_problem(torch.__version__):
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(1)
