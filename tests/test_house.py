"""The shape of the code: the story at the top (main.py, trainer.py, model.py, char_dataset.py and
the commands), the machinery in one package, mingpt_ddp, that never imports the story; no import
cycles; and a non-editable install that adds that one package name and works outside the
checkout."""

import ast
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

STORY = {"main", "trainer", "model", "char_dataset", "prepare", "sample", "plot"}


def module_name(path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def project_modules() -> dict[str, object]:
    found = {name: REPO / f"{name}.py" for name in STORY}
    for path in (REPO / "mingpt_ddp").rglob("*.py"):
        found[module_name(path)] = path
    return found


def imports_of(path, modules) -> set[str]:
    """The project modules a file imports, anywhere in it (inside functions too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        out |= {n for n in names if n in modules}
    return out


def test_the_package_never_imports_the_story_and_nothing_imports_in_a_cycle():
    modules = project_modules()
    graph = {name: imports_of(path, modules) - {name} for name, path in modules.items()}
    for name, deps in graph.items():
        if name.startswith("mingpt_ddp"):
            assert not deps & STORY, f"{name} imports the story: {sorted(deps & STORY)}"
    # Depth-first search for a cycle, reporting it as a path.
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(dep) :] + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_only_the_planner_loads_the_story_and_only_by_name():
    # The planner traces the real model and step (mingpt_ddp/planner/memory.py: story()); no
    # other part of the package reaches the story, by import or by name.
    for path in (REPO / "mingpt_ddp").rglob("*.py"):
        text = path.read_text()
        loads = re.findall(r"import_module\((?:name|\"(\w+)\")", text)
        if path.name == "memory.py" and path.parent.name == "planner":
            assert '("model", "trainer")' in text
        else:
            assert not loads or not set(loads) & STORY, path


def test_config_imports_no_other_part_of_the_package():
    modules = project_modules()
    for name, path in modules.items():
        if name.startswith("mingpt_ddp.config"):
            deps = imports_of(path, modules)
            assert all(d.startswith(("mingpt_ddp.config", "mingpt_ddp.errors")) for d in deps), (
                name,
                deps,
            )


@pytest.mark.slow
def test_a_plain_install_adds_one_package_that_builds_the_schema_outside_the_checkout(tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    installed = sorted(
        p.name for p in target.iterdir() if not p.name.endswith((".dist-info", ".egg-info"))
    )
    assert installed == ["mingpt_ddp"], installed
    code = (
        "from mingpt_ddp.config.schema import job_schema, sections; "
        "import mingpt_ddp, dataclasses; "
        "print(mingpt_ddp.__file__); "
        "print(sorted(f.name for f in dataclasses.fields(job_schema())))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(target)!r}); {code}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    where, fields = result.stdout.splitlines()
    assert where.startswith(str(target))  # not the checkout's copy
    assert fields == str(
        [
            "context_config",
            "data_config",
            "deepspeed_config",
            "gpt_config",
            "mesh_config",
            "optimizer_config",
            "pipeline_config",
            "tensor_config",
            "torchft_config",
            "trainer_config",
        ]
    )


# ------------------------------------------------------------ one grid, one ladder, one step
def strategy_modules() -> dict[str, str]:
    from mingpt_ddp.parallel.registry import STRATEGIES

    return {mode: path.split(":")[0] for mode, path in STRATEGIES.items()}


# The parallelisms: one small module each (an apply_... function), and what composes them.
PARALLELISMS = [
    "tensor",
    "context",
    "ring",
    "fsdp",
    "ddp",
    "pipeline",
    "stages",
    "checkpointing",
    "expert",
]


def strings_in(path) -> set[str]:
    """Every string constant of a file (importlib.import_module("...") names a module so)."""
    return {
        node.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


def package_files(package: str) -> list:
    return sorted((REPO / "mingpt_ddp" / package).rglob("*.py"))


@pytest.mark.parametrize("file", ["trainer.py", "mingpt_ddp/snapshots/protocol.py"])
def test_the_trainer_and_the_snapshot_protocol_never_ask_which_parallel_mode_runs(file):
    """They import no strategy module and compare nothing with a layout's name or a degree: a new
    parallelism is a module, a degree and a line of the ladder, not another branch here. The
    trainer's one branch is the pipeline's (its schedule runs forward and backward); an engine
    that brings its own step (DeepSpeed) is strategy.own_step, not a name."""
    tree = ast.parse((REPO / file).read_text())
    imported = imports_of(REPO / file, project_modules())
    modes, modules = set(strategy_modules()), set(strategy_modules().values())
    assert not imported & modules, f"{file} imports {sorted(imported & modules)}"
    assert "trainer" not in imported or file == "trainer.py"
    # The layout's name is read once, to look its strategy up in the registry; nowhere else.
    lookups = {
        id(call.args[0])
        for call in ast.walk(tree)
        if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "build_strategy"
    }
    words = modes | {"zero", "sharded", "ddp", "fsdp", "none", "pipeline", "hsdp"}
    degrees = {"degree", "dp", "dp_replicate", "dp_shard", "tp", "cp", "pp", "dims", "mesh"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            names = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant)}
            assert not names & words, f"{file}:{node.lineno} compares a layout"
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            read = {a.attr for a in ast.walk(node.test) if isinstance(a, ast.Attribute)}
            assert not read & (degrees | {"parallel", "tensor", "context"}), (
                f"{file}:{node.lineno} branches on a degree or a layout"
            )
        if isinstance(node, ast.Attribute) and node.attr in {"parallel", "zero", "sharded"}:
            assert id(node) in lookups, f"{file}:{node.lineno} reads which layout runs"


def test_one_mesh_is_built_in_one_place():
    """The grid of ranks is one DeviceMesh, built once (parallel/mesh.py); every parallelism asks
    it for its dimension instead of building a mesh of its own."""
    calls = []
    for path in sorted((REPO / "mingpt_ddp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and "init_device_mesh" in ast.unparse(node.func):
                calls.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert calls == ["mingpt_ddp/parallel/mesh.py:" + calls[0].split(":")[1]], calls


def test_each_parallelism_is_one_small_module():
    for name in PARALLELISMS + ["mesh", "parallelize"]:
        lines = len((REPO / "mingpt_ddp" / "parallel" / f"{name}.py").read_text().splitlines())
        assert lines <= 300, f"mingpt_ddp/parallel/{name}.py: {lines} lines (at most 300)"


@pytest.mark.parametrize(
    "package, never",
    [("snapshots", "parallel"), ("parallel", "snapshots"), ("corpus", "snapshots")],
)
def test_snapshots_and_parallelisms_never_import_each_other(package, never):
    """The snapshot code takes plain dicts and objects with state_dict-like methods; the
    parallelisms hand them over; neither imports the other, anywhere in a file (functions and
    importlib strings too). The corpus reads URLs through what lies below both (mingpt_ddp/urls
    or the like), not through the snapshot store."""
    modules = project_modules()
    for path in package_files(package):
        banned = f"mingpt_ddp.{never}"
        found = {m for m in imports_of(path, modules) if m.startswith(banned)}
        found |= {s for s in strings_in(path) if s.startswith(banned)}
        assert not found, f"{path.relative_to(REPO)} imports {sorted(found)}"


def test_every_registered_layout_implements_the_strategy_contract():
    from mingpt_ddp.parallel.registry import STRATEGIES, _load
    from mingpt_ddp.parallel.strategy import Strategy
    from mingpt_ddp.snapshots.layouts import LAYOUTS

    contract = ["grad_norm", "optimizer_state_bytes", "tensor_state", "load_tensor_state"]
    for mode, path in STRATEGIES.items():
        cls = _load(path)
        assert issubclass(cls, Strategy), mode
        missing = [m for m in contract if getattr(cls, m) is getattr(Strategy, m)]
        assert (
            not missing or mode == "deepspeed" and missing == ["tensor_state", "load_tensor_state"]
        ), (mode, missing)  # DeepSpeed's engine saves and loads its own files (write/read_tensors)
        assert cls.files is None or cls.files in LAYOUTS, mode
    assert {k: v.extension for k, v in LAYOUTS.items()} == {
        "sharded": "dcp",
        "deepspeed": "zero",
        "pipeline": "pipeline",
    }


# ------------------------------------------------------------------------------ sizes
PRAGMA = r"\s*#" + r" noqa\b.*$"  # (written in two pieces, or ruff would read it as a pragma)


def story_and_package_files():
    return [REPO / f"{name}.py" for name in sorted(STORY)] + sorted(
        (REPO / "mingpt_ddp").rglob("*.py")
    )


def test_no_module_over_350_lines_no_function_over_40_and_no_line_over_100_columns():
    problems = []
    for path in story_and_package_files():
        text = path.read_text()
        name = path.relative_to(REPO)
        if len(text.splitlines()) > 350:
            problems.append(f"{name}: {len(text.splitlines())} lines")
        # As ruff counts: a trailing pragma (a `noqa: ...` comment) is not part of the line's
        # length.
        lines = [re.sub(PRAGMA, "", line) for line in text.splitlines()]
        problems += [
            f"{name}:{i}: {len(line)} columns" for i, line in enumerate(lines, 1) if len(line) > 100
        ]
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 40:
                    problems.append(f"{name}:{node.lineno}: {node.name} has {length} lines")
    assert not problems, "\n".join(problems)
