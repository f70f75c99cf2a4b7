"""The rows of benchmarks/gpu_check.py: every mode a GPU user can run, each a Row that names the
words of MODES it exercises, planned for a machine's device and GPU count (--plan lists them);
and what the check reads of the machine: what it lacks for a row, its hardware, the corpus.

Rows of several ranks are of two kinds:
- NCCL rows (DDP and FSDP at N ranks, SIGTERM, a killed worker, fp16 and accumulation, FSDP +
  compile, ZeRO-3 and its offload, Horovod): a GPU per rank; where there are fewer, skipped,
  naming how many they need;
- layout rows (pipeline, tensor, sequence and context parallelism, torchft, the stall report):
  their point is the ranks' logic, which gloo shows as well, so where there are fewer GPUs than
  ranks they run on the host's CPU ("device=cpu on the GPU host: ..."), as the DDP and FSDP x2
  rows over gloo do on every GPU machine.
Row overrides are Hydra overrides of main.py; the check adds the model, data and cadence.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODES = (
    "ddp", "fsdp", "zero2", "zero3", "pipeline", "tensor", "sequence", "context", "torchft",
    "horovod", "stall", "checkpointing", "sampling", "compile", "bf16", "fp16", "accumulation",
)  # fmt: skip
GPU_MODEL = [  # a small model that still gives a GPU some work
    "gpt_config.n_layer=4", "gpt_config.n_head=4", "gpt_config.n_embd=128",
    "data_config.block_size=128", "trainer_config.batch_size=16",
]  # fmt: skip
LEARN = ["optimizer_config.learning_rate=1e-2", "optimizer_config.warmup_steps=5"]
DDP, FSDP = "trainer_config.parallel=ddp", "trainer_config.parallel=fsdp"
COMPILE, ACCUM = "trainer_config.compile=true", "trainer_config.grad_accum_steps=4"
OFFLOAD, VIA_RANK0 = "trainer_config.fsdp_cpu_offload=true", "trainer_config.grad_reduce=via_rank0"
AC, SAMPLE = "trainer_config.activation_checkpointing=full", "trainer_config.sample_chars=64"
DS2 = ("trainer_config.parallel=deepspeed", "deepspeed_config.zero_stage=2")
DS3 = ("trainer_config.parallel=deepspeed", "deepspeed_config.zero_stage=3")
DS_OFFLOAD = ("deepspeed_config.offload_optimizer=true", "deepspeed_config.offload_params=true")
TP2 = "mesh_config.tp=2"
PRECISION = {
    "fp32": ["trainer_config.use_amp=false"],
    "bf16": ["trainer_config.use_amp=true", "trainer_config.amp_dtype=bf16"],
    "fp16": ["trainer_config.use_amp=true", "trainer_config.amp_dtype=fp16"],
}
ON_CPU = "device=cpu on the GPU host: "


@dataclass(frozen=True)
class Row:
    """One check: a run of main.py, how it is launched, and what is done to it."""

    name: str
    precision: str  # fp32 | bf16 | fp16 ("" for a row that is a command, not a training run)
    overrides: tuple[str, ...] = ()
    ranks: int = 1  # the world size (torchft: replica groups of one rank each; 0: not a job)
    launcher: str = "torchrun"  # torchrun | python | horovodrun
    # resume | world_size | sigterm | restart | train | stall | torchft; a command row: tests |
    # cross_format | sample | bench | suite
    check: str = "resume"
    device: str = ""  # "" the check's device; "cpu": the host's CPU even on a GPU machine
    skip: str = ""  # why it cannot run here ("" it can)
    modes: tuple[str, ...] = ()  # the words of MODES it exercises
    expect: tuple[str, ...] = ()  # what its (first) run prints when it does what the row says
    conditional: str = ""  # runs only where this holds, decided when it runs (Horovod's build)

    def __post_init__(self):
        unknown = set(self.modes) - set(MODES)
        assert not unknown, f"{self.name}: {sorted(unknown)} not in MODES"


def row(name: str, precision: str, overrides=(), modes: str = "", **kw) -> Row:
    """A Row with its modes as words in one string."""
    return Row(name, precision, tuple(overrides), modes=tuple(modes.split()), **kw)


def needs(ranks: int, gpus: int, gpu: bool) -> str:
    """Why an NCCL row of `ranks` ranks cannot run here ("" where it can)."""
    return "" if not gpu or gpus >= ranks else f"skipped: needs {ranks} GPUs (NCCL: one per rank)"


def pipe(schedule: str, *more: str) -> tuple[str, ...]:
    schedule = f"pipeline_config.schedule={schedule}"
    return ("mesh_config.pp=2", schedule, "pipeline_config.microbatches=4", *more)


# The tables: (name, precision, overrides, modes, Row's other fields), where {half} is the 16-bit
# type the machine multiplies in, {n} the NCCL rows' ranks, {offload} why offload cannot run here.
PY, ONE = dict(launcher="python"), dict(check="train")  # ONE: one run, not a run and its resume
SINGLE = [
    ("one process fp32", "fp32", (), "", PY),
    ("one process {half} autocast", "{half}", (), "{half}", PY),
    ("one process fp16 + GradScaler", "fp16", (), "fp16", PY),
    ("one process compile + {half}", "{half}", (COMPILE,), "compile {half}", PY),
    ("one process Muon", "fp32", ("optimizer_config.optimizer=muon",), "", PY),
    ("one process async saves", "fp32", ("trainer_config.async_save=true",), "", PY),
    ("torchrun x1 DDP", "fp32", (DDP,), "ddp", {}),
    ("torchrun x1 DDP + compile + {half}", "{half}", (DDP, COMPILE), "ddp compile {half}", {}),
    ("torchrun x1 DDP, 4 micro-steps", "fp32", (DDP, ACCUM), "ddp accumulation", {}),
    ("torchrun x1 FSDP + {half}", "{half}", (FSDP,), "fsdp {half}", {}),
    ("torchrun x1 FSDP fp16 + GradScaler", "fp16", (FSDP,), "fsdp fp16", {}),
    ("torchrun x1 FSDP fp16 + CPU offload", "fp16", (FSDP, OFFLOAD), "fsdp fp16",
     dict(skip="{offload}")),
    ("torchrun x1 DeepSpeed ZeRO-2 {half}", "{half}", DS2, "zero2 {half}", {}),
    ("torchrun x1 DeepSpeed ZeRO-3 {half}", "{half}", DS3, "zero3 {half}", {}),
    ("torchrun x1 DeepSpeed ZeRO-3 + offload {half}", "{half}", DS3 + DS_OFFLOAD, "zero3 {half}",
     dict(skip="{offload}")),
    ("one process activation checkpointing + {half}", "{half}", (AC,), "checkpointing {half}", PY),
    ("torchrun x1 FSDP + activation checkpointing + compile + {half}", "{half}",
     (FSDP, AC, COMPILE), "fsdp checkpointing compile {half}", {}),
    ("one process sampling during training", "fp32", (SAMPLE,), "sampling", PY),
]  # fmt: skip
NCCL = [  # n ranks, a GPU each: n = the GPUs, or 2 (CPU processes; on one GPU, skipped)
    ("torchrun x{n} DDP", "fp32", (DDP,), "ddp", {}),
    ("torchrun x{n} DDP, gradients via rank 0", "fp32", (DDP, VIA_RANK0), "ddp", {}),
    ("torchrun x{n} FSDP + {half}", "{half}", (FSDP,), "fsdp {half}", {}),
    ("torchrun x{n} FSDP, resumed at x1", "{half}", (FSDP,), "fsdp {half}",
     dict(check="world_size")),
    ("torchrun x{n} SIGTERM: saves its step, resumes", "fp32", (DDP,), "ddp",
     dict(check="sigterm")),
    ("torchrun x{n} worker killed: restart, finish", "fp32", (DDP,), "ddp", dict(check="restart")),
    ("torchrun x{n} DDP fp16 + GradScaler, 4 micro-steps", "fp16", (DDP, ACCUM),
     "ddp fp16 accumulation", dict(ONE, expect=("fp16 autocast + GradScaler",))),
    ("torchrun x{n} FSDP + compile + {half}", "{half}", (FSDP, COMPILE), "fsdp compile {half}",
     dict(ONE, expect=("+ compile",))),
    ("torchrun x{n} DeepSpeed ZeRO-3 {half}", "{half}", DS3, "zero3 {half}",
     dict(ONE, expect=("deepspeed ZeRO-3",))),
    ("torchrun x{n} DeepSpeed ZeRO-3 + offload {half}", "{half}", DS3 + DS_OFFLOAD, "zero3 {half}",
     dict(ONE, skip="{offload}")),
    ("horovodrun x{n} Horovod", "fp32", ("trainer_config.parallel=horovod",), "horovod",
     dict(ONE, launcher="horovodrun", conditional="{horovod}", expect=("| horovod |",))),
]  # fmt: skip
LAYOUT = [  # the ranks' logic: on GPUs where there are enough, else on the host's CPU
    ("torchrun x2 pipeline GPipe + activation checkpointing + sampling", "fp32",
     pipe("gpipe", AC, SAMPLE), "pipeline checkpointing sampling", dict(ONE, ranks=2, expect=(
         "pipeline 2 stages (gpipe,", "+ activation checkpointing", "sample:"))),
    ("torchrun x2 pipeline interleaved 1F1B, 2 stages a rank", "fp32",
     pipe("interleaved1f1b", "gpt_config.n_layer=4"), "pipeline",
     dict(ONE, ranks=2, expect=("pipeline 4 stages (interleaved1f1b,",))),
    ("torchrun x4 pipeline 1F1B x tensor parallel 2", "fp32", pipe("1f1b", TP2), "pipeline tensor",
     dict(ONE, ranks=4, expect=("2 stages (1f1b, 4 microbatches) x tensor parallel 2",))),
    ("torchrun x4 pipeline 1F1B over FSDP x2", "fp32", pipe("1f1b", FSDP), "pipeline fsdp",
     dict(ONE, ranks=4, expect=("2 stages (1f1b, 4 microbatches) x 2 replicas (fsdp)",))),
    ("torchrun x2 tensor parallel + sequence parallel", "fp32",
     (TP2, "tensor_config.sequence_parallel=true"), "tensor sequence",
     dict(ONE, ranks=2, expect=("tensor parallel 2 + sequence parallel",))),
    ("torchrun x2 context parallel (ring attention)", "fp32", ("mesh_config.cp=2",), "context",
     dict(ONE, ranks=2, expect=("context parallel 2 (ring attention)",))),
    ("torchrun x2 stall report names a SIGSTOPped rank", "fp32",
     (DDP, "trainer_config.stall_report_s=3"), "ddp stall", dict(ranks=2, check="stall")),
    ("torchft: 2 replica groups, one killed and healed", "fp32",
     ("torchft_config.groups=2", "torchft_config.timeout_s=120"), "torchft",
     dict(ranks=2, check="torchft")),
]  # fmt: skip


def build(table: list, **fill) -> list[Row]:
    """The rows of a table, its {templates} filled in."""
    f = lambda v: v.format(**fill) if isinstance(v, str) else v
    return [
        row(f(name), f(precision), overrides, f(modes), **{k: f(v) for k, v in kw.items()})
        for name, precision, overrides, modes, kw in table
    ]


def on_cpu(r: Row) -> Row:
    return replace(r, name=ON_CPU + r.name, device="cpu")


def plan_rows(device: str, gpus: int, half: str) -> list[Row]:
    """The training rows for this machine: device cuda|cpu, its GPU count, and half, the 16-bit
    type it multiplies in hardware (bf16 from Ampere on, fp16 before; bf16 on a CPU rehearsal)."""
    gpu = device == "cuda"
    # The multi-rank rows' ranks: a GPU each, or 2 (CPU processes; on one GPU, the rows it skips)
    n = gpus if gpu and gpus >= 2 else 2
    offload = "" if gpu else "skipped: needs a GPU (offload moves shards out of GPU memory)"
    many = needs(n, gpus, gpu)
    built = "Horovod is built with NCCL" if gpu else "Horovod is built (gloo, on the CPU)"
    horovod = f"runs where {built}; skipped otherwise, saying why"
    fill = dict(n=n, half=half, offload=offload, horovod=horovod)
    rows = build(SINGLE, **fill)
    rows += [replace(r, ranks=n, skip=many or r.skip) for r in build(NCCL, **fill)]
    rows += [r if not gpu or gpus >= r.ranks else on_cpu(r) for r in build(LAYOUT, **fill)]
    if gpu:  # the multi-rank logic on any GPU count, and the CPU path of a GPU host
        cpu = dict(ranks=2, device="cpu")
        rows += [
            row(ON_CPU + "DDP x2 over gloo", "fp32", (DDP,), "ddp", **cpu),
            row(ON_CPU + "FSDP x2 over gloo", "fp32", (FSDP,), "fsdp", **cpu),
        ]
    return rows


def every_row(device: str, gpus: int, half: str, cpu_suite: bool = False) -> list[Row]:
    """Every row the check reports, in its order: the training rows, and around them the rows
    that are commands (the CUDA tests, a snapshot through every format, sample.py, bench.py)."""
    gpu, cmd = device == "cuda", dict(launcher="python", ranks=0)
    first = [row("CUDA-only tests", "", check="tests", **cmd)] if gpu else []
    last = [
        row("cross-format: DDP -> FSDP -> consolidate -> one process", half, (), "ddp fsdp",
            check="cross_format"),
        row(f"sample.py on {device}", "", check="sample", **cmd),
    ]  # fmt: skip
    if gpu:  # fp32, {half} and {half} + compile, one process each
        bench = row("bench.py --recipe shakespeare-gpu", "", (), f"{half} compile", check="bench")
        last.append(replace(bench, ranks=0, launcher="python"))
    if cpu_suite:
        last.append(row("CPU suite, GPU hidden", "", check="suite", **cmd))
    return first + plan_rows(device, gpus, half) + last


def plan(device: str, gpus: int, half: str = "bf16", cpu_suite: bool = False) -> dict:
    """What --plan writes: each row's name, world size, modes and device, with its skip reason or
    the condition it runs under; and which words of MODES no row that runs here exercises."""
    rows = every_row(device, gpus, half, cpu_suite)
    out = []
    for r in rows:
        entry = {"name": r.name, "world_size": r.ranks or None, "modes": list(r.modes)}
        entry["device"] = r.device or device
        entry |= {"skip": r.skip} if r.skip else {}
        out.append(entry | ({"conditional": r.conditional} if r.conditional and not r.skip else {}))
    runs = {m for r in rows if not r.skip for m in r.modes}
    missing = [m for m in MODES if m not in runs]
    return {"device": device, "gpus": gpus, "half": half, "modes_not_run": missing, "rows": out}


def missing(r: Row, device: str) -> str:
    """Why this machine cannot run a row that the table lets run ("" where it can): Horovod's
    build (with NCCL on GPUs), torchft's lighthouse."""
    if r.check == "torchft":
        from replica_jobs import lighthouse_program

        try:
            lighthouse_program()
        except SystemExit as e:
            return f"skipped: {e}".replace("error: ", "")
    if "horovod" in r.modes:
        return horovod_missing(device)
    return ""


def horovod_missing(device: str) -> str:
    """Horovod loaded in a child process (its extension against this torch), and on GPUs built
    with NCCL; horovodrun beside this interpreter or on PATH."""
    probe = "import horovod.torch as hvd; print(int(bool(hvd.nccl_built())))"
    got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if got.returncode != 0:
        return "skipped: Horovod is not built for this torch (tools/build_horovod.sh)"
    if device == "cuda" and got.stdout.strip() != "1":
        return (
            "skipped: Horovod is built without NCCL (tools/build_horovod.sh builds CPU only; "
            "HOROVOD_GPU_OPERATIONS=NCCL for GPUs)"
        )
    return "" if horovodrun() else "skipped: horovodrun is not beside this interpreter nor on PATH"


def horovodrun() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    return beside if os.access(beside, os.X_OK) else shutil.which("horovodrun")


def command_of(row: Row, data: str, work: str, device: str, steps: int) -> tuple:
    """A command row's command, what it prints when it passes, and its environment."""
    py, pytest = sys.executable, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if row.check == "tests":  # given the corpus: without it they skip, and skips check nothing
        test_cuda = os.path.join(REPO, "tests", "test_cuda.py")
        return pytest + [test_cuda], " passed", {"TINYSHAKESPEARE_PATH": data}
    if row.check == "sample":  # cross-format's consolidated snapshot, in one process
        snapshot = ["--snapshot", os.path.join(work, "cross", "one.pt")]
        cmd = [py, os.path.join(REPO, "sample.py"), *snapshot, "--device", device, "--chars", "50"]
        return cmd, f"# step {2 * steps}", None
    if row.check == "bench":
        bench = [py, os.path.join(REPO, "benchmarks", "bench.py"), "--data", data]
        out = ["--out", os.path.join(work, "bench.json")]
        return bench + ["--recipe", "shakespeare-gpu", *out], "| mode |", None
    assert row.check == "suite", row
    return pytest + [os.path.join(REPO, "tests")], " passed", {"CUDA_VISIBLE_DEVICES": ""}


def write_plan(device: str, gpus: int, cpu_suite: bool, out: str) -> int:
    """--plan: the rows for `gpus` GPUs (0: the CPU rehearsal), one line each, and the JSON."""
    device = "cpu" if device == "cpu" or gpus == 0 else "cuda"
    planned = plan(device, gpus, cpu_suite=cpu_suite)
    for r in planned["rows"]:
        said = r.get("skip") or (
            "conditional: " + r["conditional"] if "conditional" in r else "runs"
        )
        modes = " ".join(r["modes"]) or "-"
        print(f"plan | {r['name']} | x{r['world_size'] or '-'} | {modes} | {said}")
    print(f"plan | {device}, {gpus} GPUs | modes no running row exercises: "
          f"{' '.join(planned['modes_not_run']) or 'none'}")  # fmt: skip
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(planned, f, indent=1)
    return 0


def report_hardware(device: str) -> dict:
    """What the report says of the machine; every key present, null where it does not apply."""
    import torch
    from common import hardware

    info = {**hardware(), "name": None, "capability": None, "arch_list": None, "driver": None}
    info |= {"cuda": torch.version.cuda, "nccl": None, "bf16_units": None, "memory_gib": None}
    info["built_for_this_gpu"] = None
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {"name": props.name, "capability": f"{props.major}.{props.minor}"}
        info["arch_list"] = torch.cuda.get_arch_list()
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        info["bf16_units"] = torch.cuda.is_bf16_supported(including_emulation=False)
        info["memory_gib"] = round(props.total_memory / 2**30, 1)
        # A CUDA build compiles kernels for a list of architectures; a GPU outside it (sm_70 in
        # a build without it) fails at the first kernel, or runs slower PTX.
        sm = f"sm_{props.major}{props.minor}"
        info["built_for_this_gpu"] = sm in info["arch_list"]
        if shutil.which("nvidia-smi"):
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            smi = subprocess.run(query, capture_output=True, text=True)
            info["driver"] = (smi.stdout.strip().splitlines() or [None])[0]
    else:
        info["name"] = info["device"]
    return info


def find_corpus(given: str) -> str:
    """The corpus to train on, found without the network: --data, $TINYSHAKESPEARE_PATH, the
    shared copy beside the checkout, or the checkout's data/; else a one-line error."""
    candidates = [
        given,
        os.environ.get("TINYSHAKESPEARE_PATH", ""),
        os.path.join(os.path.dirname(REPO), "shared", "data", "tinyshakespeare", "input.txt"),
        os.path.join(REPO, "data", "tinyshakespeare", "input.txt"),
    ]
    found = next((os.path.abspath(p) for p in candidates if p and os.path.isfile(p)), None)
    if given and not os.path.isfile(given):
        found = None  # a corpus asked for by name that is not there is an error, not a fallback
    if found is None:
        sys.exit(
            f"error: no corpus at {given or 'data/tinyshakespeare/input.txt'}; pass --data FILE "
            "or run python data/fetch_shakespeare.py where there is a network"
        )
    return found
