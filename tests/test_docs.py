"""Docs that cannot rot: the README's commands run, its code links name what their files define.

Every ```bash block in README.md carries a marker comment on the line before it:
- <!-- runnable -->: each command is run here, in order, in one scratch directory, with a
  tiny model, step counts divided by 50 and at most 2 ranks (so a renamed flag or key fails CI);
- <!-- syntax-only -->: cannot run here (GPUs, several machines): `bash -n`, and every
  config override must name a real key;
- <!-- test-command --> / <!-- slurm-command -->: checked by test_config.py / test_slurm.py.
README.zh-CN.md must carry the same blocks, in the same order, and the same sections.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from conftest import RANKS, REPO, TINY_MODEL, free_port, run_python

from mingpt_ddp.config.schema import sections

READMES = [REPO / "README.md", REPO / "README.zh-CN.md"]
DOCS = sorted((REPO / "docs").glob("*.md")) + sorted((REPO / "docs" / "zh-CN").glob("*.md"))
# Reference pages a learner needs in Chinese too: docs/zh-CN/<name> mirrors docs/<name>.
TRANSLATED = [
    "configuration.md",
    "fault-tolerance.md",
    "from-the-notes.md",
    "snapshots.md",
    "fsdp-amp.md",
    "measured.md",
    "speedrun.md",
    "architecture.md",
    "pipeline.md",
    "tensor-context.md",
    "horovod.md",
    "ddp-in-practice.md",
    "tutorials.md",
    "experts.md",
    "build-it-yourself.md",
    "gallery.md",
    "planner.md",
]
MARKERS = ("runnable", "syntax-only", "test-command", "slurm-command")
BLOCK = re.compile(r"(?:<!-- ([\w-]+) -->\n)?```bash\n(.*?)```", re.S)
CODE_LINK = re.compile(r"\[`([^`]+)`\]\(([\w./-]+\.py)\)")
# Scripts the README runs that have tests of their own (test_tutorials.py, test_ddp_buckets.py,
# test_benchmarks.py run each with its checks): not run a second time here.
COVERED = {
    "collectives.py",
    "ring_allreduce.py",
    "parameter_server.py",
    "ddp_buckets.py",
    "single_to_ddp.py",
    "sampler_order.py",
    "ddp_options.py",
    "barrier_every_step.py",
    "accelerate_step.py",
    "bench.py",
    "time_to_quality.py",
}
# Tiny stand-ins for the run's size (the tests' tiny model; its device and precision are the
# command's own), sampling a little so the sample step runs; step counts are scaled (see scaled()).
TINY = {
    **TINY_MODEL,
    "trainer_config.sample_chars": "20",
    "trainer_config.eval_every": "5",
    "trainer_config.save_every": "5",
    "trainer_config.log_every": "5",
}


def blocks(path: Path) -> list[tuple[str, str]]:
    return [(marker or "", body) for marker, body in BLOCK.findall(path.read_text())]


def commands(body: str) -> list[list[str]]:
    """Shell commands of a block: continuation lines joined, comments dropped, split like a
    shell."""
    joined = body.replace("\\\n", " ")
    return [words for line in joined.splitlines() if (words := shlex.split(line, comments=True))]


def overrides_of(words: list[str]) -> dict[str, str]:
    return dict(w.split("=", 1) for w in words if re.match(r"^\w+\.\w+=", w))


def check_keys(overrides: dict[str, str]) -> None:
    for key in overrides:
        section, name = key.split(".", 1)
        assert section in sections(), f"{key}: no config section {section!r}"
        assert name in {f.name for f in fields(sections()[section])}, (
            f"{key}: {section} has no key {name!r}"
        )


def scaled(words: list[str]) -> list[str]:
    """A main.py-style command's overrides made tiny: sizes replaced, max_steps divided by 50."""
    given = overrides_of(words)
    check_keys(given)
    steps = max(4, int(given.get("trainer_config.max_steps", "2000")) // 50)
    merged = {**given, **TINY, "trainer_config.max_steps": str(steps)}
    return [w for w in words if not re.match(r"^\w+\.\w+=", w)] + [
        f"{k}={v}" for k, v in merged.items()
    ]


def at_most_two_ranks(word: str) -> str:
    """--nproc_per_node=N as at most 2: on CI's 2 cores more ranks prove nothing more about a
    command."""
    return re.sub(r"^(--nproc_per_node=)(\d+)$", lambda m: f"{m[1]}{min(2, int(m[2]))}", word)


def rewrite(words: list[str], workdir: Path) -> list[str] | None:
    """The command as this test runs it (scripts from the repository, tiny sizes), or None to skip
    it."""
    if words[0] == "pip":  # installing is CI's job; the extras it names must exist
        extras = re.findall(r"\[([\w,]+)\]", " ".join(words))
        pyproject = (REPO / "pyproject.toml").read_text()
        assert all(f"\n{e} = [" in pyproject for x in extras for e in x.split(",")), words
        return None
    words = [str(REPO / w) if (REPO / w).is_file() and w.endswith(".py") else w for w in words]
    if words[0] == "python":
        words[0] = sys.executable
    elif words[0] == "torchrun":
        words = [sys.executable, "-m", "torch.distributed.run", *map(at_most_two_ranks, words[1:])]
        if "--standalone" not in words:
            words.insert(3, f"--master_port={free_port()}")
    script = next((Path(w).name for w in words if w.endswith(".py")), "")
    if script in COVERED:  # its own tests run it; here: the command names a script that exists
        assert any(Path(w).is_file() for w in words if w.endswith(".py")), words
        return None
    if script in ("main.py", "spawn_launch.py"):
        return scaled(words)
    if script == "fetch_shakespeare.py":
        return words + ["--dest", str(workdir / "data" / "tinyshakespeare" / "input.txt")]
    return words


def without_agent(command: list[str]) -> list[str]:
    """A `torchrun --standalone --nproc_per_node=N SCRIPT ARGS` command with its ranks started by
    benchmarks/ranks.py as torchrun would start them, without its agent process (a torch import
    per command; the launcher is tested by its own tests); any other command as it is."""
    if command[1:3] != ["-m", "torch.distributed.run"]:
        return command
    script = next(i for i, w in enumerate(command) if w.endswith(".py"))
    flags = command[3:script]
    nproc = [f.split("=")[1] for f in flags if f.startswith("--nproc_per_node=")]
    if set(flags) - {"--standalone", f"--nproc_per_node={nproc[0] if nproc else ''}"}:
        return command  # flags torchrun acts on (restarts, rendezvous): torchrun itself
    return [sys.executable, RANKS, nproc[0], *command[script:]]


# The README is a path a learner reads in one sitting: what comes next (pipeline, tensor and
# context parallelism, experts, torchft, the bug zoo, Horovod) gets about 30 lines each here and
# its depth in docs/, so the whole stays under this many lines in either language (900 before
# the experts' subsection, 920 before the traced pictures in sections 4, 5 and 9, 930 before
# the planner's paragraph, 937 before sharing the model in section 7).
README_LINES = 952


def test_the_readmes_stay_within_their_line_budget():
    for readme in READMES:
        lines = readme.read_text().count("\n")
        assert lines <= README_LINES, f"{readme.name}: {lines} lines; move depth into docs/"


def test_every_bash_block_in_the_readmes_is_marked():
    for readme in READMES:
        for marker, body in blocks(readme):
            assert marker in MARKERS, f"{readme.name}: unmarked bash block:\n{body}"


def test_the_chinese_readme_has_the_same_commands_and_sections_as_the_english_one():
    english, chinese = READMES
    assert blocks(chinese) == blocks(english)
    heading = re.compile(r"^## (\d+)\.", re.M)
    assert heading.findall(chinese.read_text()) == heading.findall(english.read_text())
    assert chinese.read_text().count("\n## ") == english.read_text().count("\n## ")


def code_names(path: Path) -> set[str]:
    """What a link may name in a Python file: what it defines (functions, classes, methods as
    Class.method, module-level names) and what it calls (torch.manual_seed, DDP, no_sync)."""
    names: set[str] = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.update({child.name, prefix + child.name})
                visit(child, prefix + child.name + ".")
            else:
                if isinstance(child, ast.Call):
                    names.add(ast.unparse(child.func))
                    names.add(ast.unparse(child.func).split(".")[-1])
                elif isinstance(child, (ast.Assign, ast.AnnAssign)):
                    targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                    names.update(t.id for t in targets if isinstance(t, ast.Name))
                visit(child, prefix)

    visit(ast.parse(path.read_text()), "")
    return names


def test_code_links_name_what_their_file_defines_or_calls():
    # Links name a symbol and point at its file, never at a line number: moving code cannot
    # break a link silently, and renaming or moving a symbol fails here until the docs follow.
    for readme in READMES:
        assert len(CODE_LINK.findall(readme.read_text())) >= 20, (
            f"{readme.name}: expected the concepts to link to code"
        )
    for page in [*READMES, *DOCS]:
        text = page.read_text()
        assert not re.search(r"\.py#L\d+", text), f"{page.relative_to(REPO)}: a link by line number"
        for name, path in CODE_LINK.findall(text):
            target = page.parent / path
            if name.endswith(".py"):  # a link to a file as a whole: it exists
                assert target.is_file(), f"{page.relative_to(REPO)}: no file {path}"
                continue
            symbol = name.split("(")[0].strip()
            assert symbol in code_names(target), (
                f"{page.relative_to(REPO)}: {path} has no {symbol!r}"
            )


def test_relative_links_lead_to_files_that_exist():
    for readme in [*READMES, *DOCS]:
        for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", readme.read_text()):
            assert (readme.parent / target).exists(), f"{readme.name} links to missing {target}"


def test_syntax_only_commands_parse_and_name_real_config_keys():
    checked = 0
    for marker, body in blocks(READMES[0]):
        if marker != "syntax-only":
            continue
        assert subprocess.run(["bash", "-n"], input=body, text=True).returncode == 0, body
        for words in commands(body):
            check_keys(overrides_of(words))
            if "--config-name" in words:
                assert (REPO / f"{words[words.index('--config-name') + 1]}.yaml").is_file()
            checked += 1
    assert checked >= 4


SAMPLE = re.compile(r"```\n(job \| .*?)```", re.S)  # the README's "what you will see" block


def signature(line: str) -> tuple[str, ...]:
    """What a log line says, without its values: the first word of each ' | ' field, numbers as #,
    paths as PATH, the precision as PRECISION (it differs by machine)."""
    line = re.sub(r"'[^']*'|\"[^\"]*\"", "TEXT", line)  # the text sample
    words = [field.split()[0] if field.split() else "" for field in line.split(" | ")]
    words = ["PATH" if "/" in w and not w.endswith("/s") else w for w in words]
    words = ["PRECISION" if w in ("fp32", "bf16", "fp16") else w for w in words]
    return tuple(re.sub(r"\d[\d.,]*", "#", w) for w in words)


def sample_output_differences(readme: Path, output: str) -> set:
    """The line shapes the README's sample output shows and a real run did not print, and the
    other way round."""
    shown = {signature(line) for line in SAMPLE.search(readme.read_text())[1].splitlines()}
    shown.discard(("...",))
    printed = {signature(line) for line in output.splitlines() if " | " in line}
    # A straggler line reports this machine at that moment (a rank slowed by other work on a
    # shared CPU), not the program: shown or not, it is no difference.
    return {shape for shape in shown ^ printed if shape[0] != "straggler"}


@pytest.mark.slow
def test_runnable_readme_commands_run_in_order(shakespeare, tmp_path):
    (tmp_path / "my_novel.txt").write_text(shakespeare.read_text()[:200_000])  # "your own text"
    env = {"TINYSHAKESPEARE_URL": str(shakespeare)}
    ran = 0
    for marker, body in blocks(READMES[0]):
        if marker != "runnable":
            continue
        for words in commands(body):
            command = rewrite(words, tmp_path)
            if command is None:
                continue
            if ran != 1:  # the quick start runs under torchrun as written; the rest may not
                command = without_agent(command)
            # `python ...` forked from a server that imported torch once (forkserver.py)
            result = run_python(command, env=env, cwd=tmp_path, timeout=300)
            assert result.returncode == 0, (
                f"{' '.join(words)}\n{result.stdout[-1500:]}\n{result.stderr[-3000:]}"
            )
            if ran == 1:  # the quick start's training run: what the README says it prints
                for readme in READMES:
                    assert not sample_output_differences(readme, result.stdout), readme.name
            ran += 1
    assert ran >= 15
    assert (tmp_path / "loss.png").is_file() and (tmp_path / "demo.pt").is_file()


@pytest.mark.parametrize("name", TRANSLATED)
def test_the_chinese_reference_pages_mirror_the_english_ones(name):
    english, chinese = REPO / "docs" / name, REPO / "docs" / "zh-CN" / name
    assert chinese.is_file(), f"docs/zh-CN/{name} is missing"
    fence = re.compile(r"```\w*\n(.*?)```", re.S)
    assert fence.findall(chinese.read_text()) == fence.findall(
        english.read_text()
    )  # the same commands
    assert (
        chinese.read_text().count("\n| ") >= english.read_text().count("\n| ") - 2
    )  # the same tables, roughly


def test_the_chinese_pages_use_the_terms_a_reader_of_the_notes_knows():
    # rank（进程序号）, local rank（节点内序号）, world size（总进程数）, reduce = 归约
    # (the notes' words).
    for page in [READMES[1], *sorted((REPO / "docs" / "zh-CN").glob("*.md"))]:
        text = page.read_text()
        for wrong in ("秩", "世界大小", "规约"):
            assert wrong not in text, f"{page.relative_to(REPO)} says {wrong!r}"
    glossary = READMES[1].read_text().split("### 术语对照表", 1)[1].split("\n## ", 1)[0]
    for term in (
        "进程序号",
        "节点内序号",
        "总进程数",
        "all-reduce",
        "归约",
        "微批次",
        "自动混合精度",
        "rendezvous",
        "bucket",
    ):
        assert term in glossary, f"the glossary lacks {term}"


def test_the_pages_quote_one_recorded_quick_start():
    """The READMEs' sample output and numbers, measured.md's row and loss.png are one run's:
    benchmarks/results/quickstart.json, which benchmarks/quickstart_record.py writes with the
    picture and these quotes. A page quoting another run, or a number typed by hand, fails here."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import quickstart_record as record_script

    record = json.loads(Path(record_script.RECORD).read_text())
    block = record_script.sample_block(record["log"])
    for readme in READMES:
        assert SAMPLE.search(readme.read_text())[1] == block + "\n", readme.name
    pages = {name: REPO / name for name in ("README.md", "README.zh-CN.md")}
    pages |= {name: REPO / "docs" / name for name in ("measured.md", "zh-CN/measured.md")}
    for name, page in pages.items():
        text = page.read_text()
        assert record_script.requote(text, name, record) == text, f"{name} quotes another run"
    # The record is of the quick start's own command, and says the machine it ran on.
    assert record["command"] == "torchrun --standalone --nproc_per_node=4 main.py"
    assert record["hardware"]["device"] and record["numbers"]["val_loss_2000"] < 2.0
