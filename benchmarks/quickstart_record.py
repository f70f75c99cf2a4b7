"""The quick start's run, recorded: what README.md, README.zh-CN.md and docs/measured.md quote.

    python benchmarks/quickstart_record.py      # about 3 minutes on 2 cores; a quiet machine

It runs the quick start's training command as written (`torchrun --standalone --nproc_per_node=4
main.py`, the default config) in a scratch folder holding a copy of the corpus, so the paths it
prints are the ones a reader sees, and writes:
- benchmarks/results/quickstart.json: the machine, the command, every line rank 0 printed, and
  the numbers the pages quote (the validation loss at steps 250 and 2000, the first evaluation
  below 2.0, the wall time from launch to exit);
- docs/images/loss.png, drawn by plot.py from that run's metrics;
- the "what you will see" block of both READMEs: the lines of that log it shows.
tests/test_docs.py holds the pages to the record: the block's lines are the log's lines, and the
numbers in the prose are the record's. So a page cannot quote one run and picture another.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from common import REPO, hardware

RECORD = os.path.join(REPO, "benchmarks", "results", "quickstart.json")
PICTURE = os.path.join(REPO, "docs", "images", "loss.png")
READMES = [os.path.join(REPO, name) for name in ("README.md", "README.zh-CN.md")]
MEASURED = [os.path.join(REPO, "docs", name) for name in ("measured.md", "zh-CN/measured.md")]
COMMAND = ["torchrun", "--standalone", "--nproc_per_node=4", "main.py"]
BLOCK = re.compile(r"(```\n)(job \| .*?)(```)", re.S)  # the READMEs' sample output
SHOWN = ("job", "data", "lease", "resume", "train", "memory")  # every line of these, then:
STEPS = ("step    250/", "eval | step 250 ", "snapshot | step 250 ")  # the first save's lines
LAST = ("eval | step 2000 ", "done | ")  # and the end


def corpus() -> str:
    path = os.path.join(os.path.dirname(REPO), "shared", "data", "tinyshakespeare", "input.txt")
    path = os.environ.get("TINYSHAKESPEARE_PATH", path)
    if not os.path.isfile(path):
        sys.exit(
            "error: no corpus: set TINYSHAKESPEARE_PATH or run python data/fetch_shakespeare.py"
        )
    return path


def run_quick_start(work: str) -> tuple[list[str], float]:
    """The rank-0 lines of the quick start's training run in work/, and its seconds to exit."""
    os.makedirs(os.path.join(work, "data", "tinyshakespeare"))
    shutil.copy(corpus(), os.path.join(work, "data", "tinyshakespeare", "input.txt"))
    # torchrun as the module (no PATH needed), main.py from the checkout, run from work/
    cmd = [sys.executable, "-m", "torch.distributed.run", *COMMAND[1:3]]
    t0 = time.perf_counter()
    result = subprocess.run(
        cmd + [os.path.join(REPO, "main.py")], cwd=work, capture_output=True, text=True
    )
    seconds = time.perf_counter() - t0
    if result.returncode:
        sys.exit(f"error: the quick start failed (exit {result.returncode}):\n{result.stderr}")
    lines = [line for line in result.stdout.splitlines() if " | " in line]
    return lines, seconds


def numbers(lines: list[str], seconds: float) -> dict:
    """What the pages quote, read from the log."""
    evals = {int(s): float(v) for s, v in (re.findall(r"^eval \| step (\d+) \| val loss ([\d.]+)",
                                                       "\n".join(lines), re.M))}  # fmt: skip
    below = min((s for s, v in evals.items() if v < 2.0), default=None)
    return {
        "val_loss_250": evals.get(250),
        "val_loss_2000": evals.get(2000),
        "first_eval_below_2": below,
        "launch_to_exit_s": round(seconds, 1),
    }


def shortened(line: str) -> str:
    """An eval line's sample cut to its first 45 characters, as the pages print it."""
    return re.sub(r'sample: ("|\')(.{45}).*$', r'sample: "\2 ..."', line)


def sample_block(lines: list[str]) -> str:
    """The log lines the READMEs show: start-up, the first snapshot's step, "...", the end."""
    first = [line for line in lines if line.split(" | ")[0] in SHOWN]
    middle = [next(line for line in lines if line.startswith(s)) for s in STEPS]
    last = [next(line for line in lines if line.startswith(s)) for s in LAST]
    return "\n".join(
        first + [shortened(m) for m in middle] + ["..."] + [shortened(x) for x in last]
    )


NUMBER, WHOLE = r"[\d.]+", r"\d+"
# The sentences that quote the record, per page: each a template whose {} take the numbers (for
# the pattern: what any earlier record may have put there). The English one has a line of its own.
QUOTED = {
    "README.md": [
        "to {} at step 250, below 2.0 by step {}, and to {} at step 2000, "
        "{} m {} s from launch to exit",
        "*The run quoted above: {}, {} cores, drawn by `plot.py`.*",
    ],
    "README.zh-CN.md": [
        "降到第 250 步的 {}，第 {} 步之前降到 2.0 以下，第 2000 步降到 {}，"
        "从启动到退出 {} 分 {} 秒",
        "*上面引用的那次运行：{}，{} 个核，由 `plot.py` 绘制。*",
    ],
    "measured.md": [
        "val loss {} at step 250, < 2.0 by step {}, **{} at step 2000**; {} min {} s end to end",
        "the quick start's run the README quotes, on {} ({} cores)",
    ],
    "zh-CN/measured.md": [
        "第 250 步验证损失 {}，第 {} 步前 < 2.0，**第 2000 步 {}**；端到端 {} 分 {} 秒",
        "README 引用的那次快速上手运行，机器是 {}（{} 个核）",
    ],
}


def quoted(record: dict) -> list[list[str]]:
    """What fills the {} of each page's two sentences, for this record."""
    n, hw = record["numbers"], record["hardware"]
    minutes, seconds = divmod(round(n["launch_to_exit_s"]), 60)
    loss = [f"{n['val_loss_250']:.2f}", n["first_eval_below_2"], f"{n['val_loss_2000']:.2f}"]
    return [[*loss, minutes, seconds], [hw["device"], hw.get("cores")]]


def requote(text: str, page: str, record: dict) -> str:
    """text with the page's sentences filled from record (each must be there once)."""
    patterns = [NUMBER, WHOLE, NUMBER, WHOLE, WHOLE], [r".+?", WHOLE]
    for template, fill, kinds in zip(QUOTED[page], quoted(record), patterns):
        pieces = [re.escape(piece) for piece in template.split("{}")]
        pattern = "".join(p + k for p, k in zip(pieces, kinds)) + pieces[-1]
        filled = template.format(*fill)
        text, found = re.subn(pattern, lambda _, filled=filled: filled, text)
        if found != 1:
            sys.exit(f"error: {page} quotes the quick start {found} times, not once: {template!r}")
    return text


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="quickstart-") as work:
        lines, seconds = run_quick_start(work)
        metrics = os.path.join(work, "runs", "shakespeare_char", "metrics.jsonl")
        plot = [sys.executable, os.path.join(REPO, "plot.py"), metrics, "-o", PICTURE]
        subprocess.run(plot, check=True, capture_output=True)
    record = {
        "hardware": hardware(),
        "command": " ".join(COMMAND),
        "numbers": numbers(lines, seconds),
        "load_average_after": round(os.getloadavg()[0], 2),  # a busy machine's wall time is longer
        "log": lines,
    }
    # Every page's new text first, then the writes: a page that no longer quotes the run stops
    # the script before the record or any page is touched.
    block, texts = sample_block(lines), {}
    for page in READMES + MEASURED:
        with open(page, encoding="utf-8") as f:
            text = BLOCK.sub(lambda m: m[1] + block + "\n" + m[3], f.read(), count=1)
        name = os.path.relpath(page, os.path.join(REPO, "docs" if page in MEASURED else ""))
        texts[page] = requote(text, name, record)
    with open(RECORD, "w") as f:
        json.dump(record, f, indent=1)
    for page, text in texts.items():
        with open(page, "w", encoding="utf-8") as f:
            f.write(text)
    print(f"quickstart | {record['hardware']['device']} | {json.dumps(record['numbers'])}")
    print(f"quickstart | wrote {RECORD}, {PICTURE} and the READMEs' sample output")
    return 0


if __name__ == "__main__":
    sys.exit(main())
