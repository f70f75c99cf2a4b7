"""The shape of the code: the story at the top (main.py, trainer.py, model.py, char_dataset.py and
the commands), the machinery in one package, mingpt_ddp, that never imports the story; no import
cycles; and a non-editable install that adds that one package name and works outside the checkout."""

import ast
import os
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
                pytest.fail("import cycle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_config_imports_no_other_part_of_the_package():
    modules = project_modules()
    for name, path in modules.items():
        if name.startswith("mingpt_ddp.config"):
            deps = imports_of(path, modules)
            assert all(d.startswith(("mingpt_ddp.config", "mingpt_ddp.errors")) for d in deps), (name, deps)


@pytest.mark.slow
def test_a_plain_install_adds_one_package_that_builds_the_schema_outside_the_checkout(tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(REPO)], check=True, capture_output=True, timeout=300)
    installed = sorted(p.name for p in target.iterdir() if not p.name.endswith((".dist-info", ".egg-info")))
    assert installed == ["mingpt_ddp"], installed
    code = ("from mingpt_ddp.config.schema import job_schema, sections; import mingpt_ddp, dataclasses; "
            "print(mingpt_ddp.__file__); print(sorted(f.name for f in dataclasses.fields(job_schema())))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(target)!r}); {code}"],
                            cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    where, fields = result.stdout.splitlines()
    assert where.startswith(str(target))  # not the checkout's copy
    assert fields == str(["data_config", "deepspeed_config", "gpt_config", "optimizer_config", "trainer_config"])
