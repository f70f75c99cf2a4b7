"""The kinds of multi-file snapshot this version reads and writes, and their file rules.

    sharded    DCP shards (torch.distributed.checkpoint), every rank its pieces, each written
               once, keyed by the whole model's names: what every split layout writes (FSDP,
               HSDP, tensor and context parallel, pipelines); resharded into any layout on load
    pipeline   the same DCP files, as pipelines wrote them before one format served every layout
               (read only; the optimizer's groups were keyed per name)
    deepspeed  DeepSpeed's engine files, partitioned per rank, as DeepSpeed runs wrote them
               before they joined the one format (read only): they resume with DeepSpeed at the
               ZeRO stage and world size that wrote them; their weights read anywhere

The store is handed these (SnapshotReader's default). Nothing here imports the parallelisms: the
files are torch's and DeepSpeed's formats, read by their own functions.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import tempfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from mingpt_ddp.snapshots.layout import FileLayout

DEEPSPEED_TAG = "zero"  # DeepSpeed's checkpoint tag: the folder its files go in


def _full_tensors(folder: str) -> dict:
    """The shards put back together on the CPU, without a process group (DCP's own converter).
    The whole file goes to a folder of this process's: the staged one may be a node's, shared."""
    with tempfile.TemporaryDirectory(prefix="dcp-full-") as scratch:
        full = os.path.join(scratch, "full.pt")
        dcp_to_torch_save(folder, full)
        return torch.load(full, map_location="cpu", weights_only=True)


def _load_into(folder: str, state: dict) -> dict:
    """Collective: DCP reads the pieces each rank's state dicts hold (resharding to them)."""
    dcp.load(state, storage_reader=dcp.FileSystemReader(folder))
    return state


SHARDED = FileLayout(
    kind="sharded",
    extension="dcp",
    file_names=re.compile(r"^(\.metadata|__\d+_\d+\.distcp)$"),
    full_tensors=_full_tensors,
    load_into=_load_into,
)
PIPELINE = FileLayout(
    kind="pipeline",
    extension="pipeline",
    file_names=SHARDED.file_names,
    full_tensors=_full_tensors,
    load_into=_load_into,
)


def deepspeed_safe_globals() -> list:
    """The classes DeepSpeed pickles into its checkpoint files besides tensors and builtins."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, fragment_address]


def check_weights_only(directory: str) -> None:
    """DeepSpeed reads its files with torch.load(weights_only=False), which runs any code a crafted
    file carries. Before it does, each file must load with weights_only=True, allowing only the few
    DeepSpeed classes it is known to hold (their sha256 already matched the manifest)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # only reading: no accelerator needed
    with torch.serialization.safe_globals(deepspeed_safe_globals()):
        for name in sorted(os.listdir(directory)):
            try:
                torch.load(os.path.join(directory, name), map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - reported as one line
                raise RuntimeError(
                    f"{name} holds more than DeepSpeed's checkpoint data "
                    f"({type(e).__name__}: {str(e).splitlines()[0]}); not loading it"
                ) from None


def deepspeed_weights(stage: str) -> dict[str, torch.Tensor]:
    """Full fp32 weights, keyed like the model's own state_dict, from a staged (and checked)
    DeepSpeed snapshot (its fp32 optimizer partitions, put back together on the CPU; no process
    group needed)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        state = get_fp32_state_dict_from_zero_checkpoint(stage, tag=DEEPSPEED_TAG)  # its progress
    return {k: v.contiguous() for k, v in state.items()}


def _deepspeed_refusal(meta: dict) -> str:
    stage = meta["deepspeed"]["zero_stage"]
    return (
        f"holds DeepSpeed ZeRO-{stage}'s own per-rank files; resume it once with "
        f"trainer_config.parallel=deepspeed deepspeed_config.zero_stage={stage} and the ranks that "
        "wrote it (its next snapshot any layout resumes), or export its weights with python -m "
        "mingpt_ddp.snapshots consolidate"
    )


DEEPSPEED = FileLayout(
    kind="deepspeed",
    extension="zero",
    subdir=DEEPSPEED_TAG,
    check=check_weights_only,
    file_names=re.compile(
        r"^(mp_rank_\d\d_model_states\.pt|"
        r"(bf16_)?zero_pp_rank_\d+_mp_rank_\d\d_(optim|model)_states\.pt)$"
    ),
    full_tensors=lambda stage: {"model": deepspeed_weights(stage)},  # the optimizer stays split
    refusal=_deepspeed_refusal,
)

LAYOUTS = {layout.kind: layout for layout in (SHARDED, PIPELINE, DEEPSPEED)}
