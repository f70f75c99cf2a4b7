"""Does the data path scale? Prepare time, start-up, step time and per-rank memory from 1 MB to 1 GB
of text.

    python benchmarks/data_scale.py  # 1 MB, 100 MB, 1 GB ASCII + 100 MB CJK, 4 ranks (~5 min)
    python benchmarks/data_scale.py --smoke  # seconds: what CI runs

For each generated corpus (tiny Shakespeare repeated; a CJK text of 5,000 distinct
characters drawn with Zipf-like frequencies) it:
1. prepares it with prepare.py in a fresh process: seconds, MB/s and that process's peak RSS;
2. trains `torchrun --standalone --nproc_per_node=4 main.py` on it (the default model, the
   corpus already prepared) and measures launch -> first step printed, the first step's
   time, the median step and the median time of the step's data path (reading its batch,
   "data_ms"), from the metrics file (log_every=1); and for every worker its
   peak RSS (VmHWM) and peak PSS (proportional set size: pages shared by the 4 ranks count
   1/4 each), sampled from /proc every 0.1 s;
3. once, for the largest corpus: reads 20,000 random windows through a memory map and through
   pread (what char_dataset.TokenFile does) and reports how much each grew the process's RSS.

Prints a table and writes JSON (default benchmarks/results/data_scale.json). Corpora and
prepared copies go to --work (default: a temporary directory, removed afterwards).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from common import REPO, TINY_MODEL, main_command, start

sys.path.insert(0, REPO)

from mingpt_ddp.metrics import MetricsLog  # noqa: E402

SHAKESPEARE = os.path.join(REPO, "data", "tinyshakespeare", "input.txt")


def make_corpus(path: str, kind: str, size: int, shakespeare: str) -> None:
    """Write a generated corpus of about `size` bytes (deterministic: the same file every time)."""
    if os.path.exists(path) and os.path.getsize(path) >= size * 0.99:
        return
    with open(path + ".tmp", "wb") as f:
        if kind == "ascii":
            text = open(shakespeare, "rb").read()
            for _ in range(size // len(text)):
                f.write(text)
            f.write(text[: size % len(text)])
        else:  # 5,000 CJK characters plus punctuation, Zipf-like frequencies, 3 bytes each in UTF-8
            rng = random.Random(0)
            chars = [chr(0x4E00 + i) for i in range(5000)] + list("，。！？\n")
            weights = [1.0 / (i + 1) for i in range(len(chars))]
            written = 0
            while written < size:
                piece = "".join(
                    rng.choices(chars, weights, k=min(1_000_000, (size - written) // 3 + 1))
                ).encode()
                f.write(piece)
                written += len(piece)
    os.replace(path + ".tmp", path)


def prepare(corpus: str, cache: str) -> dict:
    """prepare.py in a fresh process; it reports its own time and peak RSS."""
    code = (
        "import json, resource, sys, time; sys.path.insert(0, sys.argv[1]); "
        "from mingpt_ddp.corpus import prepare; t0 = time.perf_counter(); "
        "p = prepare.ensure_prepared(sys.argv[2], sys.argv[3], log=lambda _: None); "
        "print(json.dumps({'seconds': time.perf_counter() - t0, 'peak_rss_mb': resource.getrusage("
        "resource.RUSAGE_SELF).ru_maxrss / 1024, 'tokens': p.meta['num_tokens'], "
        "'dtype': p.meta['dtype'], 'vocab': p.meta['vocab_size']}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, REPO, corpus, cache],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def memory(pid: int) -> tuple[int, int]:
    """(VmHWM, Pss) of a process, in kB: its peak resident set so far, and its proportional set
    now."""
    with open(f"/proc/{pid}/status") as f:
        hwm = int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1))
    with open(f"/proc/{pid}/smaps_rollup") as f:
        pss = int(re.search(r"^Pss:\s+(\d+)", f.read(), re.M).group(1))
    return hwm, pss


def workers(launcher_pid: int) -> list[int]:
    """The training processes under torchrun (its children running main.py)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == launcher_pid and b"main.py" in cmd:
            found.append(int(entry))
    return found


def train(corpus: str, cache: str, run_dir: str, nproc: int, steps: int, model: list[str]) -> dict:
    overrides = [
        f"data_config.path={corpus}",
        f"data_config.cache_dir={cache}",
        f"trainer_config.snapshot_path={run_dir}/snapshots",
        f"trainer_config.metrics_path={run_dir}/metrics.jsonl",
        f"trainer_config.max_steps={steps}",
        "trainer_config.log_every=1",
        f"trainer_config.eval_every={steps}",
        f"trainer_config.save_every={steps}",
        "trainer_config.sample_chars=0",
        *model,
    ]
    t0 = time.perf_counter()
    proc = start(main_command(nproc, overrides), cwd=run_dir)
    lines, first_step = [], []

    def read_output() -> None:  # a thread, so that sampling memory never waits for output
        for line in proc.stdout:
            lines.append(line)
            if not first_step and re.match(r"step +1/", line):
                first_step.append(time.perf_counter() - t0)

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    peaks: dict[int, list[int]] = {}
    while proc.poll() is None:
        for pid in workers(proc.pid) if nproc > 1 else [proc.pid]:
            try:
                hwm, pss = memory(pid)
            except (OSError, AttributeError):  # the process just ended
                continue
            old = peaks.get(pid, [0, 0])
            peaks[pid] = [max(old[0], hwm), max(old[1], pss)]
        time.sleep(0.1)
    reader.join()
    output = "".join(lines)
    if proc.returncode != 0:
        raise RuntimeError(f"training on {corpus} failed:\n{output[-3000:]}")
    records = MetricsLog.read(os.path.join(run_dir, "metrics.jsonl"))
    ms = [r["ms_per_step"] for r in records]
    return {
        "launch_to_first_step_s": round(first_step[0], 2),
        "first_step_ms": ms[0],
        "steady_ms_per_step": round(statistics.median(ms[len(ms) // 4 :]), 1),
        "data_ms_per_step": round(
            statistics.median(r["data_ms"] for r in records[len(ms) // 4 :]), 3
        ),
        "peak_rss_mb_per_rank": round(max(p[0] for p in peaks.values()) / 1024, 1),
        "peak_pss_mb_per_rank": round(max(p[1] for p in peaks.values()) / 1024, 1),
        "ranks_seen": len(peaks),
    }


def reader_growth(tokens_path: str, windows: int = 20_000, length: int = 65) -> dict:
    """RSS growth from reading random windows through a memory map vs through pread (fresh
    processes)."""
    code = """
import mmap, os, random, re, sys
def rss():
    return int(re.search(r"^Rss:\\s+(\\d+)", open("/proc/self/smaps_rollup").read(),
                         re.M).group(1)) / 1024
path, how, n, length = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
size, rng = os.path.getsize(path), random.Random(0)
fd = os.open(path, os.O_RDONLY)
before = rss()
if how == "mmap":
    m = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    m.madvise(mmap.MADV_RANDOM)
    total = sum(m[s:s + length][0] for s in (rng.randrange(size - length) for _ in range(n)))
else:
    total = sum(os.pread(fd, length, s)[0]
                for s in (rng.randrange(size - length) for _ in range(n)))
print(rss() - before)
"""
    out = {}
    for how in ("mmap", "pread"):
        result = subprocess.run(
            [sys.executable, "-c", code, tokens_path, how, str(windows), str(length)],
            capture_output=True,
            text=True,
            check=True,
        )
        out[f"{how}_rss_growth_mb"] = round(float(result.stdout), 1)
    out["windows"] = windows
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--data", default=SHAKESPEARE, help="tiny Shakespeare, repeated to make the ASCII corpora"
    )
    p.add_argument(
        "--work",
        default="",
        help="where corpora and prepared copies go (default: a temporary directory)",
    )
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument(
        "--smoke", action="store_true", help="1 MB corpora (ASCII, CJK), 2 ranks, a tiny model (CI)"
    )
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "data_scale.json"))
    args = p.parse_args()
    if args.smoke:
        corpora = [("ascii", 1_000_000), ("cjk", 1_000_000)]  # uint8 and int16 ids
        nproc, steps = 2, 6
        model = [f"{k}={v}" for k, v in TINY_MODEL.items()]  # the tests' tiny model
    else:
        corpora = [
            ("ascii", 1_000_000),
            ("ascii", 100_000_000),
            ("ascii", 1_000_000_000),
            ("cjk", 100_000_000),
        ]
        nproc, steps, model = args.nproc, args.steps, []
    work = args.work or tempfile.mkdtemp(prefix="data-scale-")
    os.makedirs(work, exist_ok=True)
    rows = []
    try:
        for kind, size in corpora:
            name = f"{kind}-{size // 1_000_000}MB"
            corpus = os.path.join(work, f"{name}.txt")
            make_corpus(corpus, kind, size, args.data)
            cache = os.path.join(work, f"prepared-{name}")
            shutil.rmtree(cache, ignore_errors=True)  # time a real prepare, not a cache hit
            prep = prepare(corpus, cache)
            run_dir = os.path.join(work, f"run-{name}")
            shutil.rmtree(run_dir, ignore_errors=True)
            os.makedirs(run_dir)
            mb = os.path.getsize(corpus) / 1e6
            row = {
                "corpus": name,
                "source_mb": round(mb, 1),
                "tokens": prep["tokens"],
                "dtype": prep["dtype"],
                "vocab": prep["vocab"],
                "prepare_s": round(prep["seconds"], 2),
                "prepare_mb_per_s": round(mb / prep["seconds"], 1),
                "prepare_peak_rss_mb": round(prep["peak_rss_mb"], 1),
                **train(corpus, cache, run_dir, nproc, steps, model),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        largest = max(rows, key=lambda r: r["tokens"])
        cache = os.path.join(work, f"prepared-{largest['corpus']}")
        tokens_path = next(
            os.path.join(d, f) for d, _, fs in os.walk(cache) for f in fs if f.endswith(".bin")
        )
        readers = {"corpus": largest["corpus"], **reader_growth(tokens_path)}
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    columns = [
        "corpus",
        "vocab",
        "dtype",
        "prepare_s",
        "prepare_mb_per_s",
        "prepare_peak_rss_mb",
        "launch_to_first_step_s",
        "first_step_ms",
        "steady_ms_per_step",
        "data_ms_per_step",
        "peak_rss_mb_per_rank",
        "peak_pss_mb_per_rank",
    ]
    print(
        f"\nworld size {nproc}, {steps} steps each, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs\n"
    )
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")
    print(
        f"\nreading {readers['windows']:,} random windows of the {readers['corpus']} token file "
        f"grew RSS by {readers['mmap_rss_growth_mb']} MB through a memory map, "
        f"{readers['pread_rss_growth_mb']} MB through pread"
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "nproc": nproc,
                "steps": steps,
                "cpu": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(),
                "rows": rows,
                "readers": readers,
            },
            f,
            indent=1,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
