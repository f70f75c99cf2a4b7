"""Configuration as a user meets it: one schema (the dataclasses) behind Hydra, config groups,
--help, one kind of message for a wrong key or type wherever it is written, sweeps that run every
job."""

import dataclasses
import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, TINY, kill_tree, run_main, start_main, tiny_overrides, wait_for_line

from main import compose, to_job
from mingpt_ddp.config import schema as config
from mingpt_ddp.config.optimizer import OptimizerConfig
from mingpt_ddp.metrics import MetricsLog
from model import MODEL_SIZES

TYPO = (
    "error: trainer_config.max_step is not a key of this config; did you mean "
    "trainer_config.max_steps? python main.py --help lists every key"
)


def write_config_dir(tmp_path) -> str:
    """A config dir with the same typo in a copy of the primary YAML and in a recipe of one's
    own."""
    conf = tmp_path / "conf"
    (conf / "recipe").mkdir(parents=True)
    yaml = (REPO / "gpt2_train_cfg.yaml").read_text()
    (conf / "ok.yaml").write_text(yaml)
    (conf / "typo.yaml").write_text(yaml + "\ntrainer_config:\n  max_step: 5\n")
    (conf / "recipe" / "mine.yaml").write_text(
        "# @package _global_\ntrainer_config:\n  max_step: 5\n"
    )
    return str(conf)


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("ok", ["trainer_config.max_step=5"]),
        ("ok", ["+trainer_config.max_step=5"]),
        ("ok", ["++trainer_config.max_step=5"]),
        ("typo", []),
        ("ok", ["recipe=mine"]),
    ],
    ids=["key=", "+key=", "++key=", "yaml", "group"],
)
def test_an_unknown_key_is_one_line_naming_it_however_it_is_written(name, overrides, tmp_path):
    # Hydra refuses `key=` and YAML typos itself (cli() turns its report into this line), but it
    # applies +key= and ++key= with its struct check off (the run used to train with the default
    # max_steps): to_job compares the composed keys with the schema. Every spelling reads the same.
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from main import hydra_error_line

    try:
        with initialize_config_dir(config_dir=write_config_dir(tmp_path), version_base=None):
            to_job(hydra_compose(config_name=name, overrides=overrides))
    except config.ConfigError as e:
        line = f"error: {e}"
    except Exception as e:  # noqa: BLE001 - Hydra's composition error, as cli() receives it
        line = hydra_error_line(e)
    else:
        pytest.fail("the typo was accepted")
    assert line == TYPO


@pytest.mark.slow
def test_an_unknown_key_ends_the_run_with_that_one_line_and_exit_1(shakespeare, tmp_path):
    result = run_main(tiny_overrides(shakespeare, tmp_path) + ["+trainer_config.max_step=5"])
    assert result.returncode == 1 and result.stderr.strip() == TYPO
    assert not (tmp_path / "snapshots").exists()


@pytest.mark.slow
def test_an_unknown_section_and_a_sweep_of_typos_are_refused(shakespeare, tmp_path):
    result = run_main(tiny_overrides(shakespeare, tmp_path) + ["+trainer.max_steps=5"])
    assert result.returncode == 1
    assert result.stderr.strip().startswith(
        "error: trainer is not a key of this config; did you mean trainer_config?"
    )
    job = compose(["+gpt_config.n_layers=3"])  # the same check where other entry points compose
    with pytest.raises(config.ConfigError, match="gpt_config.n_layers is not a key"):
        to_job(job)


@pytest.mark.slow
def test_a_value_of_the_wrong_type_is_refused_naming_the_key(shakespeare, tmp_path):
    result = run_main(tiny_overrides(shakespeare, tmp_path) + ["trainer_config.max_steps=many"])
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "Value 'many' of type 'str' could not be converted to Integer" in result.stderr
    assert "full_key: trainer_config.max_steps" in result.stderr


OUT_OF_RANGE = [
    ("data_config.train_split=1.0", "data_config.train_split must be in (0, 1), got 1.0"),
    ("trainer_config.batch_size=0", "trainer_config.batch_size must be positive, got 0"),
    ("gpt_config.n_head=3", "gpt_config.n_embd (32) must be divisible by gpt_config.n_head (3)"),
    (
        "optimizer_config.min_lr=1.0",
        "optimizer_config: need learning_rate > 0 and 0 <= min_lr <= learning_rate",
    ),
]


@pytest.mark.parametrize("override, needle", OUT_OF_RANGE)
def test_an_out_of_range_value_is_refused_naming_the_key(override, needle):
    # Where main.py's job refuses it (to_job); the test below shows how a run reports that refusal.
    with pytest.raises(config.ConfigError) as refused:
        to_job(compose(TINY + [override]))
    assert str(refused.value) == needle


@pytest.mark.slow
def test_an_out_of_range_value_ends_the_run_with_that_one_line_and_exit_1(shakespeare, tmp_path):
    # main.py turns every refusal of to_job into the same line (train_job): one value shows it.
    override, needle = OUT_OF_RANGE[0]
    result = run_main(tiny_overrides(shakespeare, tmp_path) + [override])
    assert result.returncode == 1 and result.stderr.strip() == f"error: {needle}"


def test_groups_compose_and_the_command_line_wins():
    job = to_job(compose(["model=gpt-mini", "parallel=fsdp"]))
    assert (job.gpt_config.n_layer, job.gpt_config.n_head, job.gpt_config.n_embd) == MODEL_SIZES[
        "gpt-mini"
    ]
    assert job.trainer_config.parallel == "fsdp"
    gpu = to_job(compose(["recipe=shakespeare-gpu"]))  # a recipe picks its model...
    assert gpu.gpt_config.n_embd == MODEL_SIZES["baby-gpt"][2] and gpu.data_config.block_size == 256
    assert (
        gpu.trainer_config.use_amp and gpu.trainer_config.compile and gpu.gpt_config.dropout == 0.2
    )
    mine = to_job(compose(["recipe=shakespeare-gpu", "model=gpt2", "trainer_config.batch_size=8"]))
    assert (
        mine.gpt_config.n_layer == 12 and mine.trainer_config.batch_size == 8
    )  # ...the command line wins
    star = to_job(compose(["parallel=ddp-star"]))
    assert (star.trainer_config.parallel, star.trainer_config.grad_reduce) == ("ddp", "via_rank0")


def test_the_default_run_is_the_dataclass_defaults():
    # One place for defaults: the YAML selects groups, it does not repeat values.
    job, defaults = to_job(compose([])), to_job(compose(["model=gpt-micro"]))
    for name, cls in config.sections().items():
        assert getattr(job, name) == getattr(defaults, name) == cls(), name


@pytest.mark.slow
def test_help_lists_the_groups_and_what_every_key_means():
    out = subprocess.run(
        [sys.executable, str(REPO / "main.py"), "--help"], capture_output=True, text=True
    ).stdout
    assert (
        "parallel=fsdp:" in out and "recipe=shakespeare-gpu:" in out and "gpt-mini (6x6x192)" in out
    )
    for name, cls in config.sections().items():
        for key, doc in config.field_docs(cls).items():
            assert f"{name}.{key} (" in out and doc in out, f"{name}.{key}"
    for cls in config.sections().values():  # every key has its docstring
        assert set(config.field_docs(cls)) == {f.name for f in dataclasses.fields(cls)}, (
            cls.__name__
        )


def test_learning_rate_warms_up_then_decays_to_min_lr():
    cfg = OptimizerConfig(learning_rate=1e-3, min_lr=1e-4, warmup_steps=10)
    assert cfg.lr_at(0, 100) == pytest.approx(1e-4)
    assert cfg.lr_at(9, 100) == pytest.approx(1e-3)
    assert cfg.lr_at(55, 100) == pytest.approx(5.5e-4)
    assert cfg.lr_at(100, 100) == pytest.approx(1e-4)


@pytest.mark.slow
def test_a_resume_that_changes_the_schedule_says_so():
    from mingpt_ddp.optim import schedule_change

    cfg, saved = OptimizerConfig(), {"trainer_config": {"max_steps": 200}}
    longer = schedule_change(saved, cfg, max_steps=250, step=200)
    assert longer.startswith("schedule | learning rate at step 200: 1.00e-04 in the snapshot's")
    assert "3.25e-04 in this run's (max_steps 250)" in longer
    assert schedule_change(saved, cfg, max_steps=200, step=150) == ""  # the same curve
    assert schedule_change({}, cfg, max_steps=250, step=0) == ""  # started fresh
    hotter = {"trainer_config": {"max_steps": 200}, "optimizer_config": {"learning_rate": 3e-3}}
    assert "in this run's (max_steps 200)" in schedule_change(hotter, cfg, 200, step=50)


def test_main_reports_a_missing_dataset_in_one_line(tmp_path):
    result = run_main(tiny_overrides(tmp_path / "missing.txt", tmp_path))
    assert result.returncode == 1
    assert result.stderr.strip().startswith("error: data_config.path: no file at")
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_main_reports_an_unwritable_snapshot_path_before_training(shakespeare, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    args = tiny_overrides(shakespeare, tmp_path) + [
        f"trainer_config.snapshot_path={blocker / 'snaps'}"
    ]
    result = run_main(args)
    assert result.returncode == 1
    assert "error: trainer_config.snapshot_path: cannot write to" in result.stderr
    assert "step " not in result.stdout


SWEEP = [
    "--multirun",
    "optimizer_config.learning_rate=1e-3,3e-3",
    "model=tiny,gpt-nano",
    "trainer_config.save_every=5",
    "trainer_config.eval_every=10",
    "trainer_config.sample_chars=0",
]


def test_a_sweep_job_directory_name_stays_one_short_name_and_is_the_same_on_a_rerun():
    short = "model=tiny,optimizer_config.learning_rate=0.001"
    assert config.path_safe(short) == short
    assert (
        config.path_safe("data_config.path=/data/a.txt") == "data_config.path=_data_a.txt"
    )  # no nesting
    long_a = "data_config.path=/" + "d" * 300 + ",optimizer_config.learning_rate=0.001"
    long_b = long_a.replace("0.001", "0.003")  # differs only past the cut
    name_a = config.path_safe(long_a)
    assert len(name_a) <= 120 and "/" not in name_a  # well under the 255-byte file-name limit
    assert name_a == config.path_safe(long_a) != config.path_safe(long_b)


@pytest.mark.slow
def test_a_sweep_runs_every_job_in_its_own_directory_and_a_rerun_resumes_each(
    shakespeare, tmp_path
):
    args = SWEEP + [
        f"data_config.path={shakespeare}",
        f"data_config.cache_dir={tmp_path / 'prepared'}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "trainer_config.max_steps=10",
        "trainer_config.device=cpu",
    ]
    first = run_main(args)
    assert first.returncode == 0, first.stderr[-2000:]
    jobs = sorted(
        p.parent for p in (tmp_path / "sweep").glob("*/metrics.jsonl")
    )  # one level: no nested names
    assert len(jobs) == 4 and first.stdout.count("done | step 10") == 4
    assert all(
        [r["step"] for r in MetricsLog.read(str(job / "metrics.jsonl"))] == [10] for job in jobs
    )
    # Rerun with more steps (max_steps does not name the job): each job resumes from its own
    # snapshot.
    second = run_main(args[:-2] + ["trainer_config.max_steps=20", "trainer_config.device=cpu"])
    assert second.returncode == 0, second.stderr[-2000:]
    assert (
        second.stdout.count("resume | step 10 |") == 4
        and second.stdout.count("done | step 20") == 4
    )
    assert sorted(p.parent for p in (tmp_path / "sweep").glob("*/metrics.jsonl")) == jobs
    assert all(
        [r["step"] for r in MetricsLog.read(str(job / "metrics.jsonl"))] == [10, 20] for job in jobs
    )


@pytest.mark.slow
def test_a_sweep_killed_in_its_second_job_resumes_that_job_and_keeps_the_first(
    shakespeare, tmp_path
):
    args = SWEEP + [
        f"data_config.path={shakespeare}",
        f"data_config.cache_dir={tmp_path / 'prepared'}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "trainer_config.max_steps=30",
        "trainer_config.device=cpu",
    ]
    job = start_main(args)
    lines = wait_for_line(job, "done | step 30")  # the first job finished...
    lines += wait_for_line(
        job, "snapshot | step 10"
    )  # ...and the second has a snapshot: kill it now
    kill_tree(job)
    second_job_dir = [line for line in lines if line.startswith("resume | no snapshot under")][
        1
    ].split(" under ")[1]
    rerun = run_main(args)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    out = rerun.stdout
    assert out.count("nothing to do") == 1  # the finished job is not trained again
    assert (
        f"from {second_job_dir.split(' | ')[0]}" in out and "resume | step 10 |" in out
    )  # the killed one resumes
    assert out.count("starting fresh at step 0") == 2 and out.count("done | step 30") == 3


@pytest.mark.slow
def test_a_sweep_with_a_failing_job_runs_the_others_and_exits_non_zero(shakespeare, tmp_path):
    args = [
        "--multirun",
        "data_config.block_size=32,200000",
        f"data_config.path={shakespeare}",
        f"data_config.cache_dir={tmp_path / 'prepared'}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "model=tiny",
        "trainer_config.max_steps=2",
        "trainer_config.sample_chars=0",
        "trainer_config.device=cpu",
    ]
    result = run_main(args)
    assert result.returncode == 1
    assert "done | step 2" in result.stdout and "error: data_config.train_split" in result.stderr


@pytest.mark.slow
def test_a_sweep_refuses_a_snapshot_path_every_job_would_share(shakespeare, tmp_path):
    args = [
        "--multirun",
        "optimizer_config.learning_rate=1e-3,3e-3",
        f"data_config.path={shakespeare}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        f"trainer_config.snapshot_path={tmp_path / 'shared'}",
    ]
    result = run_main(args)
    assert result.returncode == 1 and "would be shared by every job of this sweep" in result.stderr
    assert not (tmp_path / "shared").exists()


@pytest.mark.slow
def test_multirun_under_torchrun_is_refused_in_one_line(shakespeare, tmp_path):
    result = run_main(
        [
            "--multirun",
            *tiny_overrides(shakespeare, tmp_path),
            "optimizer_config.learning_rate=1e-3,3e-3",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        nproc=2,
    )
    assert result.returncode != 0
    assert "error: --multirun under torchrun" in result.stderr
    assert not list(tmp_path.glob("sweep/*/snapshots"))


def test_a_refusal_is_said_once_per_node_by_whichever_rank_fails_first(tmp_path):
    """Under torchrun, rank 0 may be stopped before it prints when another rank exits first: the
    first rank of a node to fail says it, and only once (each rank here is its own process)."""
    code = (
        "import os, sys; sys.path.insert(0, sys.argv[1]); os.environ['RANK'] = sys.argv[2]; "
        "from mingpt_ddp.runtime.error_line import print_error; print_error('error: refused')"
    )
    env = {
        **os.environ,
        "LOCAL_RANK": "0",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TMPDIR": str(tmp_path),
    }
    said = [
        subprocess.run(
            [sys.executable, "-c", code, str(REPO), rank], env=env, capture_output=True, text=True
        ).stderr
        for rank in ("1", "0")  # rank 1 first: its line is the one printed
    ]
    assert said == ["error: refused\n", ""]
    env["TORCHELASTIC_RESTART_COUNT"] = "1"  # the next attempt says it again
    again = subprocess.run(
        [sys.executable, "-c", code, str(REPO), "0"], env=env, text=True, capture_output=True
    )
    assert again.stderr == "error: refused\n"


def test_ci_runs_the_test_command_the_readme_gives():
    readme, ci = (REPO / "README.md").read_text(), (REPO / ".ci" / "run").read_text()
    commands = (
        readme.split("## Tests", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    )
    assert commands == [
        'python3 -m pip install -q -e ".[test]"',
        "python3 -m ruff format --check . && python3 -m ruff check .",
        "python3 -m pytest -q -n 3 --dist loadfile",
    ]
    ci_lines = [line.split("#")[0].strip() for line in ci.splitlines()]
    assert [ci_lines.index(command) for command in commands] == sorted(
        ci_lines.index(c) for c in commands
    )


def test_no_stray_config_file_beside_the_main_one():
    # One top-level config; GPU settings, model sizes and recipes are config groups.
    assert sorted(p.name for p in REPO.glob("*.yaml")) == ["gpt2_train_cfg.yaml"]
    assert (
        shutil.which("git") is None
        or "gpt2_train_cfg_gpu.yaml"
        not in subprocess.run(
            ["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True
        ).stdout
    )


def test_the_configuration_reference_names_every_key():
    rows = [
        line
        for line in (REPO / "docs" / "configuration.md").read_text().splitlines()
        if line.startswith("| `")
    ]
    for section, cls in config.sections().items():
        for key in (f.name for f in dataclasses.fields(cls)):
            assert any(
                f"`{section}." in row and (f".{key}`" in row or f"`{key}`" in row) for row in rows
            ), f"docs/configuration.md does not describe {section}.{key}"
