"""What every exhibit of the bug zoo shares: the corpus, a tiny GPT, the project's own training
step (trainer.step over a strategy of mingpt_ddp/parallel, built as the Trainer builds it), and
the row each exhibit reports.

An exhibit is one function that runs the buggy variant and the project's variant of the same
code, measures the symptom on both, and applies one check to both: the check must catch the
bug (caught) and pass the project (project_passes), or the exhibit proves nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import trainer  # noqa: E402 - needs REPO on sys.path first; the step and micro_steps
from char_dataset import CharTokenizer  # noqa: E402
from mingpt_ddp.config.deepspeed import DeepSpeedConfig  # noqa: E402
from mingpt_ddp.config.optimizer import OptimizerConfig  # noqa: E402
from mingpt_ddp.parallel.plan import Plan  # noqa: E402
from mingpt_ddp.parallel.registry import build_strategy  # noqa: E402
from mingpt_ddp.parallel.strategy import Batch, Strategy, StrategyArgs  # noqa: E402
from mingpt_ddp.runtime.distributed import ControlPlane, DistContext  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

BLOCK = 32  # tokens per window (T)
BATCH = 4  # windows per rank per micro-step (B)
TEXT_CHARS = 100_000  # of the corpus: enough windows, and quick to encode
CPU = torch.device("cpu")


@dataclass
class Row:
    """One exhibit's result: the report's row, and the lines the teaching output prints."""

    bug: str
    symptom: str  # what a user would see, measured on the buggy variant against the project's
    check: str  # the test that sees it
    caught: bool  # the check failed on the buggy variant
    project_passes: bool  # the check passed on the project's code
    lines: list[str] = field(default_factory=list)
    avoided_by: str = ""  # the project's code that avoids the bug (bug_zoo.BUGS says)

    def report(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "lines"}


def find_corpus(given: str | None = None) -> Path:
    """The tiny Shakespeare text: the path given, $TINYSHAKESPEARE_PATH, or where the tests and
    data/fetch_shakespeare.py put it."""
    for candidate in (
        given,
        os.environ.get("TINYSHAKESPEARE_PATH"),
        REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt",
        REPO / "data" / "tinyshakespeare" / "input.txt",
    ):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise SystemExit("error: no corpus found; pass --data PATH or run data/fetch_shakespeare.py")


def load_ids(path: str | Path) -> tuple[torch.Tensor, int]:
    """The first TEXT_CHARS characters of the corpus as ids, (N,) int64, and the vocabulary size
    (the characters of that slice, as a prepared corpus has the characters of its text)."""
    text = Path(path).read_text(encoding="utf-8")[:TEXT_CHARS]
    tokenizer = CharTokenizer("".join(sorted(set(text))))
    return tokenizer.encode(text), tokenizer.vocab_size


def windows(ids: torch.Tensor, starts: torch.Tensor) -> Batch:
    """The windows starting at `starts` (B,): inputs and targets, (B, T) each."""
    chunk = torch.stack([ids[s : s + BLOCK + 1] for s in starts.tolist()])  # (B, T+1)
    return chunk[:, :-1], chunk[:, 1:]


def tiny_gpt(vocab: int, dropout: float = 0.0) -> GPT:
    """The project's GPT at 2 layers of 32 wide; the same weights on every rank (seed 0)."""
    torch.manual_seed(0)
    cfg = GPTConfig(
        n_layer=2, n_head=2, n_embd=32, vocab_size=vocab, block_size=BLOCK, dropout=dropout
    )
    return GPT(cfg)


def build(
    model: GPT,
    parallel: str = "none",
    accum: int = 1,
    optim: OptimizerConfig | None = None,
    **plan,
) -> Strategy:
    """The project's strategy for `parallel` around model, as Trainer._build_strategy builds it;
    on the CPU, in this process group (if any)."""
    import torch.distributed as dist

    rank, world = (dist.get_rank(), dist.get_world_size()) if parallel != "none" else (0, 1)
    ctx = DistContext(rank, rank, world, CPU)
    args = StrategyArgs(
        Plan(parallel=parallel, **plan),
        ctx,
        optim or OptimizerConfig(warmup_steps=0),
        BATCH,
        accum,
        ControlPlane(),
        DeepSpeedConfig(),
    )
    return build_strategy(parallel, model, args)


MicroSteps = Callable[[Strategy, Iterator[Batch], int], torch.Tensor]


def train_step(
    strategy: Strategy, batches: Iterator[Batch], n: int, micro_steps: MicroSteps | None = None
) -> tuple[torch.Tensor, bool]:
    """One optimizer step over n micro-batches as the Trainer takes it: trainer.step, clipping at
    the optimizer config's grad_clip. Given micro_steps (a buggy copy of trainer.micro_steps), the
    same step with that copy in its place for this one call: the rest is the project's."""
    grad_clip = strategy.args.optim.grad_clip
    with mock.patch.object(trainer, "micro_steps", micro_steps or trainer.micro_steps):
        return trainer.step(strategy, batches, n, grad_clip)


def close(a: float, b: float) -> bool:
    """Equal up to float32 rounding of a different summation order (torch.allclose's default
    tolerances)."""
    return torch.allclose(torch.tensor(a), torch.tensor(b))
