"""Configuration: the YAML, strict keys, types and ranges, and how main.py reports mistakes."""

from pathlib import Path

import pytest
import yaml

from char_dataset import DataConfig
from config import ConfigError, build_config, build_section
from conftest import REPO, run_main, tiny_overrides
from main import SCHEMA
from train_config import OptimizerConfig, TrainerConfig


def yaml_sections() -> dict:
    raw = yaml.safe_load((REPO / "gpt2_train_cfg.yaml").read_text())
    return {k: v for k, v in raw.items() if k not in ("hydra", "defaults")}


def test_the_shipped_yaml_builds_every_section():
    cfg = build_config(yaml_sections(), SCHEMA)
    assert set(cfg) == {"data_config", "gpt_config", "optimizer_config", "trainer_config"}
    assert cfg["gpt_config"].n_embd % cfg["gpt_config"].n_head == 0


def test_yaml_defaults_match_the_dataclass_defaults():
    # One source of truth for readers: the YAML shows the defaults the code has.
    sections = yaml_sections()
    for name, cls in SCHEMA.items():
        for key, value in sections[name].items():
            assert getattr(cls(), key) == value, f"{name}.{key}"


def test_unknown_key_is_named_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown config key trainer_config\.max_step .*'max_steps'"):
        build_section(TrainerConfig, {"max_step": 5})


def test_unknown_section_is_named():
    with pytest.raises(ConfigError, match="unknown config section 'trainer_cfg'"):
        build_config({"trainer_cfg": {}}, SCHEMA)


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match="trainer_config.max_steps must be of type int"):
        build_section(TrainerConfig, {"max_steps": "many"})


def test_ints_are_accepted_for_float_fields():
    assert build_section(OptimizerConfig, {"learning_rate": 1}).learning_rate == 1.0


@pytest.mark.parametrize("section, values, needle", [
    (DataConfig, {"train_split": 1.0}, "train_split must be in"),
    (DataConfig, {"block_size": 0}, "block_size must be positive"),
    (TrainerConfig, {"batch_size": 0}, "batch_size must be positive"),
    (OptimizerConfig, {"min_lr": 1.0, "learning_rate": 0.1}, "min_lr"),
])
def test_out_of_range_values_are_config_errors(section, values, needle):
    with pytest.raises(ConfigError, match=needle):
        build_section(section, values)


def test_learning_rate_warms_up_then_decays_to_min_lr():
    cfg = OptimizerConfig(learning_rate=1e-3, min_lr=1e-4, warmup_steps=10)
    assert cfg.lr_at(0, 100) == pytest.approx(1e-4)
    assert cfg.lr_at(9, 100) == pytest.approx(1e-3)
    assert cfg.lr_at(55, 100) == pytest.approx(5.5e-4)
    assert cfg.lr_at(100, 100) == pytest.approx(1e-4)


def test_main_rejects_a_misspelled_key_before_training(shakespeare, tmp_path):
    result = run_main(tiny_overrides(shakespeare, tmp_path) + ["+trainer_config.max_step=5"])
    assert result.returncode == 2
    assert "unknown config key trainer_config.max_step (did you mean 'max_steps'?)" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "snapshots").exists()


def test_main_rejects_an_override_of_a_key_the_yaml_lacks(shakespeare, tmp_path):
    result = run_main(tiny_overrides(shakespeare, tmp_path) + ["trainer_config.max_step=5"])
    assert result.returncode != 0
    assert "trainer_config.max_step" in result.stderr


def test_main_reports_a_missing_dataset_in_one_line(tmp_path):
    result = run_main(tiny_overrides(Path(tmp_path / "missing.txt"), tmp_path))
    assert result.returncode == 1
    assert result.stderr.strip().startswith("error: data_config.path: no file at")
    assert "Traceback" not in result.stderr


def test_main_reports_an_unwritable_snapshot_path_before_training(shakespeare, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    args = tiny_overrides(shakespeare, tmp_path) + [f"trainer_config.snapshot_path={blocker / 'snaps'}"]
    result = run_main(args)
    assert result.returncode == 1
    assert "error: trainer_config.snapshot_path: cannot write to" in result.stderr
    assert "step " not in result.stdout


def test_ci_runs_the_test_command_the_readme_gives():
    readme, ci = (REPO / "README.md").read_text(), (REPO / ".ci" / "run").read_text()
    command = readme.split("## Tests", 1)[1].split("```bash\n", 1)[1].split("\n", 1)[0]
    assert command == "python3 -m pytest -q"
    assert any(line.split("#")[0].strip() == command for line in ci.splitlines())
