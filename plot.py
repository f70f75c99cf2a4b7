"""Pictures of training runs: loss curves and throughput from metrics files, and the benchmark
chart.

    python plot.py runs/shakespeare_char/metrics.jsonl                       # -> metrics.png
                                                                             #    beside it
    python plot.py runs/a/metrics.jsonl runs/b/metrics.jsonl -o compare.png  # several runs,
                                                                             # one figure

Each metrics file is the JSON-lines history a run writes (trainer_config.metrics_path):
one record per logged step with train_loss, tokens_per_sec and, at evaluations,
val_loss. matplotlib is an optional extra (pip install -e ".[plot]"); without it, plot.py prints
the validation loss as a text chart instead of drawing a PNG.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from mingpt_ddp.metrics import MetricsLog


def pyplot():
    """matplotlib's pyplot drawing to files (no display needed), or a one-line error naming the
    fix."""
    try:
        import matplotlib
    except ImportError:
        sys.exit(
            'error: plotting needs matplotlib: pip install -e ".[plot]" (or pip install matplotlib)'
        )
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_run(ax_loss, ax_speed, path: str, labelled: bool, color: str) -> None:
    """One run's curves in one colour: train and val loss on the left panel, tokens/s on the right.
    Kept out of plot_runs so that it reads as the figure's layout alone, however many runs there
    are. labelled: several runs share the figure, so each curve is named after its run's directory.
    """
    records = MetricsLog.read(path)
    if not records:
        sys.exit(
            f"error: {path} has no logged steps; "
            "point plot.py at a trainer_config.metrics_path file"
        )
    label = os.path.basename(os.path.dirname(os.path.abspath(path))) if labelled else ""
    steps = [r["step"] for r in records]
    ax_loss.plot(
        steps,
        [r["train_loss"] for r in records],
        color=color,
        alpha=0.5,
        label=f"{label} train".strip(),
    )
    evals = [r for r in records if "val_loss" in r]
    ax_loss.plot(
        [r["step"] for r in evals],
        [r["val_loss"] for r in evals],
        color=color,
        marker="o",
        markersize=3,
        label=f"{label} val".strip(),
    )
    ax_speed.plot(
        steps, [r["tokens_per_sec"] / 1e3 for r in records], color=color, label=label or None
    )


def plot_runs(paths: list[str], out: str, title: str = "") -> str:
    """Train/val loss against tokens seen (left) and tokens/s against step (right), one colour per
    run."""
    plt = pyplot()
    fig, (ax_loss, ax_speed) = plt.subplots(1, 2, figsize=(11, 4))
    for i, path in enumerate(paths):
        _plot_run(ax_loss, ax_speed, path, len(paths) > 1, f"C{i}")
    ax_loss.set(xlabel="step", ylabel="cross-entropy loss (nats/char)", title="loss")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_speed.set(xlabel="step", ylabel="thousand tokens/s (all ranks)", title="throughput")
    ax_speed.grid(alpha=0.3)
    if len(paths) > 1:
        ax_speed.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_benchmark(rows: list[dict], out: str, title: str) -> str:
    """bench.py's chart: tokens/s per mode (bars, labelled with ms/step and MFU)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.5))
    names = [r["mode"] for r in rows][::-1]
    values = [r["tokens_per_sec"] / 1e3 for r in rows][::-1]
    bars = ax.barh(names, values, color="C0")
    for bar, r in zip(bars, rows[::-1]):
        ax.text(
            bar.get_width(),
            bar.get_y() + bar.get_height() / 2,
            f" {r['ms_per_step']:.1f} ms/step, MFU {100 * r['mfu']:.0f}%"
            + ("" if r.get("precision", "fp32") == "fp32" else f" of {r['precision']} peak"),
            va="center",
            fontsize=8,
        )
    ax.set(xlabel="thousand tokens/s (higher is better)", title=title)
    ax.set_xlim(0, max(values) * 1.45)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Plot loss curves and tokens/s from metrics files."
    )
    parser.add_argument(
        "metrics", nargs="+", help="metrics.jsonl files (trainer_config.metrics_path)"
    )
    parser.add_argument(
        "-o", "--out", default="", help="PNG to write (default: metrics.png beside the first file)"
    )
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    for path in args.metrics:
        if not os.path.exists(path):
            sys.exit(
                f"error: no metrics file at {path}; "
                "train first or pass trainer_config.metrics_path's value"
            )
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.metrics[0])), "metrics.png")
    if importlib.util.find_spec("matplotlib") is None:  # the light install: a chart in the terminal
        print(text_chart(args.metrics))
        print('plot | no PNG: matplotlib is not installed (pip install -e ".[plot]")')
        return 0
    print(f"plot | {plot_runs(args.metrics, out, args.title)}")
    return 0


def text_chart(paths: list[str], width: int = 50) -> str:
    """The validation loss of each run at each evaluation, as bars of '#' (lower is better)."""
    lines = []
    for path in paths:
        evals = [r for r in MetricsLog.read(path) if "val_loss" in r]
        if not evals:
            sys.exit(
                f"error: {path} has no evaluations yet; "
                "point plot.py at a trainer_config.metrics_path file"
            )
        top = max(r["val_loss"] for r in evals)
        lines.append(f"val loss | {path}")
        lines += [
            f"step {r['step']:>7} | {r['val_loss']:.4f} | "
            f"{'#' * max(1, round(width * r['val_loss'] / top))}"
            for r in evals
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
