"""Hugging Face accelerate, the code side: Accelerator, prepare, backward, print, gather, reduce.

    accelerate launch --multi_gpu --num_processes 2 tutorials/accelerate_step.py

(On this CPU-only machine `--multi_gpu` is the mode that starts several ranks: it runs torchrun;
`--cpu --num_processes 2` starts one plain process.) A linear model learns y = 3x + 1 from 64
fixed points; each rank prints what `prepare` turned its model, optimizer and data loader into,
and after training a metric computed on every rank's share is combined two ways (reduce, gather)
and checked against rank 0 computing it alone on all 64 points. What is claimed about
accelerate comes from accelerate 1.15's own source (accelerator.py, data_loader.py, state.py).
"""

import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from torch.utils.data import DataLoader, TensorDataset

N, BATCH, EPOCHS = 64, 8, 10


def points() -> TensorDataset:
    """(index, x, y) rows: the index says which sample a rank got. x, y: (N, 1)."""
    x = torch.linspace(-1, 1, N).unsqueeze(1)
    return TensorDataset(torch.arange(N), x, 3 * x + 1)


def say(accelerator: Accelerator, line: str) -> None:
    """Every rank's line, printed by the main process in rank order (gather_object is a
    collective: every rank calls it)."""
    lines = gather_object([f"[rank {accelerator.process_index}] {line}"])
    accelerator.print("\n".join(lines))


def spans(indices: list[int]) -> str:
    """[0, 1, ..., 7, 16, ..., 23] as '0-7, 16-23'."""
    runs, start = [], indices[0]
    for prev, cur in zip(indices, indices[1:] + [None]):
        if cur != prev + 1:
            runs.append(f"{start}-{prev}")
            start = cur
    return ", ".join(runs)


def show_prepared(accelerator, model, optimizer, loader, batches_before: int) -> None:
    seen = [int(i) for idx, _, _ in loader for i in idx]
    say(
        accelerator,
        f"{accelerator.distributed_type} ({accelerator.state.backend}) on {accelerator.device}: "
        f"model {type(model).__name__}({type(accelerator.unwrap_model(model)).__name__}), "
        f"optimizer {type(optimizer).__name__}, loader {type(loader).__name__} with "
        f"{len(loader)} of the {batches_before} batches: samples {spans(seen)}",
    )


def train(accelerator, model, optimizer, loader) -> None:
    for epoch in range(1, EPOCHS + 1):
        total = torch.zeros(())
        for _, x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)  # loss / gradient_accumulation_steps, then .backward()
            optimizer.step()
            optimizer.zero_grad()
            total += loss.detach()
        mean = accelerator.reduce(total / len(loader), reduction="mean")  # over the ranks
        if epoch in (1, EPOCHS):
            accelerator.print(f"epoch {epoch}: mean loss over ranks {mean.item():.6f}")


@torch.no_grad()
def evaluate(accelerator, model, loader) -> None:
    """Each rank: squared errors on its own share; then the whole set's sum and sample list."""
    sse, indices = torch.zeros(()), []
    for idx, x, y in loader:
        sse += ((model(x) - y) ** 2).sum()
        indices.append(idx)
    total = accelerator.reduce(sse, reduction="sum")  # every rank gets the sum
    everyone = accelerator.gather(torch.cat(indices))  # (N,): every rank's indices, concatenated
    _, x, y = points().tensors
    alone = ((accelerator.unwrap_model(model)(x) - y) ** 2).sum()  # one process, all N points
    say(accelerator, f"own share: {len(torch.cat(indices))} samples, squared error {sse:.6f}")
    w, b = (
        accelerator.unwrap_model(model).weight.item(),
        accelerator.unwrap_model(model).bias.item(),
    )
    say(accelerator, f"weights after training: y = {w:.4f} x + {b:.4f}")
    accelerator.print(
        f"reduce(sum): squared error over all ranks {total:.6f}; "
        f"computed alone on all {N} points {alone:.6f}; equal: {torch.allclose(total, alone)}"
    )
    accelerator.print(
        f"gather: {len(everyone)} sample indices, each of 0..{N - 1} once: "
        f"{sorted(everyone.tolist()) == list(range(N))}"
    )


def main() -> None:
    # Without a GPU, Accelerator() under `--multi_gpu` finds no GPU backend and falls back to
    # DistributedType.NO: each rank trains alone on all the data. cpu=True makes it MULTI_CPU
    # (gloo) whenever LOCAL_RANK is set (accelerate/state.py, PartialState._prepare_backend).
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)  # the same start on every rank (DDP broadcasts rank 0's anyway)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(points(), batch_size=BATCH)  # no shuffle: the shares can be read
    batches_before = len(loader)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    show_prepared(accelerator, model, optimizer, loader, batches_before)
    train(accelerator, model, optimizer, loader)
    evaluate(accelerator, model, loader)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group
    # gloo's exit-time C++ destructors abort some runs after a clean teardown ("terminate called
    # without an active exception": 4 runs in 16 of a plain DDP script here); skip them, as
    # mingpt_ddp/runtime/distributed.py's exit_process does
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
