"""How a run is configured: one schema, registered with Hydra, and the config groups users switch between.

Each section of the config is a dataclass next to the code it configures: DataConfig
(char_dataset.py), GPTConfig (model.py), OptimizerConfig (optim.py), TrainerConfig
(train_config.py), DeepSpeedConfig (zero.py). They are the only place a key, its type, its default and its
meaning are written. This module puts them together as the job's schema and registers
it with Hydra's ConfigStore; gpt2_train_cfg.yaml composes it through its defaults list.
Hydra (OmegaConf) then refuses an unknown key or a value of the wrong type, on the
command line and in YAML alike, with the same message naming the key; ranges and
combinations are each dataclass's __post_init__'s job (ConfigError).

Config groups (python main.py model=gpt-mini parallel=fsdp recipe=shakespeare-gpu):
    model     a named size (MODEL_SIZES in model.py)
    parallel  how the model is spread over the ranks
    recipe    settings that go together for some hardware or goal; may pick a model too
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import hashlib
import inspect
import textwrap
from typing import Any


class ConfigError(ValueError):
    """A user-fixable configuration problem; the message names the setting to change."""


PARALLEL = {
    "ddp": ({"parallel": "ddp", "grad_reduce": "all_reduce"}, "DDP: a full replica per rank, gradients all-reduced"),
    "fsdp": ({"parallel": "fsdp"}, "FSDP2: every rank holds 1/N of parameters, gradients, optimizer state"),
    "none": ({"parallel": "none"}, "one process, no wrapping"),
    "ddp-star": ({"parallel": "ddp", "grad_reduce": "via_rank0"},
                 "DDP with gradients averaged through rank 0 (a star: the parameter-server pattern)"),
    **{f"zero{stage}": ({"parallel": "deepspeed"}, f"DeepSpeed ZeRO-{stage}: {what} split over the ranks "
                        "(pip install -e \".[deepspeed]\")")
       for stage, what in ((1, "optimizer state"), (2, "optimizer state and gradients"),
                           (3, "optimizer state, gradients and parameters"))},
}

RECIPES: dict[str, tuple[dict[str, Any], str]] = {
    "shakespeare-cpu": ({}, "the default: tiny Shakespeare on CPUs, the gpt-micro model"),
    "shakespeare-gpu": ({"model": "baby-gpt", "data_config": {"block_size": 256}, "gpt_config": {"dropout": 0.2, "bias": False},
                         "trainer_config": {"batch_size": 64, "max_steps": 5000, "eval_every": 500, "save_every": 500,
                                            "use_amp": True, "compile": True, "run_dir": "runs/shakespeare_char_gpu"}},
                        "nanoGPT's shakespeare_char on a GPU: baby-gpt, context 256, 64 windows per GPU, bf16 + compile"),
    "nanogpt-cpu": ({"gpt_config": {"bias": False},
                     "trainer_config": {"batch_size": 12, "eval_every": 50, "eval_iters": 20, "run_dir": "runs/nanogpt_cpu"}},
                    "nanoGPT's CPU recipe: gpt-micro without biases (nanoGPT's bias=False), context 64, batch 12, "
                    "2000 steps, lr 1e-3 -> 1e-4"),
    "fast-cpu": ({"gpt_config": {"bias": False},
                  "trainer_config": {"batch_size": 24, "max_steps": 700, "eval_every": 50, "eval_iters": 10,
                                     "run_dir": "runs/fast_cpu"},
                  "optimizer_config": {"learning_rate": 6e-3, "warmup_steps": 50}},
                 "to val loss 1.88 fast on 2 CPU cores with AdamW: no biases, batch 24, lr 6e-3, a 700-step cosine"),
    "speedrun-cpu": ({"gpt_config": {"rotary": True, "qk_norm": True, "bias": False},
                      "trainer_config": {"batch_size": 24, "max_steps": 300, "eval_every": 25, "eval_iters": 10,
                                         "run_dir": "runs/speedrun_cpu"},
                      "optimizer_config": {"optimizer": "muon", "muon_lr": 0.05, "learning_rate": 6e-3,
                                           "warmup_steps": 50}},
                     "this project's record to val loss 1.88 on CPUs: fast-cpu + Muon, rotary, QK-norm, a 300-step "
                     "cosine (benchmarks/time_to_quality.py --ablation)"),
    "gpt2-gpu": ({"model": "gpt2", "data_config": {"block_size": 1024},
                  "trainer_config": {"batch_size": 16, "use_amp": True, "compile": True, "run_dir": "runs/gpt2"}},
                 "GPT-2 small's shape (124M parameters with a GPT-2 vocabulary), context 1024, bf16 + compile"),
}

def sections() -> dict[str, type]:
    """The config's sections, each a dataclass beside the code it configures."""
    from char_dataset import DataConfig
    from model import GPTConfig
    from optim import OptimizerConfig
    from train_config import TrainerConfig
    from zero import DeepSpeedConfig

    return {"data_config": DataConfig, "gpt_config": GPTConfig, "optimizer_config": OptimizerConfig,
            "trainer_config": TrainerConfig, "deepspeed_config": DeepSpeedConfig}


def job_schema() -> type:
    """The whole config as one dataclass: a field per section."""
    return dataclasses.make_dataclass(
        "JobConfig", [(name, cls, dataclasses.field(default_factory=cls)) for name, cls in sections().items()])


def unknown_keys(cfg: Any) -> list[str]:
    """The keys of a composed config that the schema lacks (`hydra.*` is Hydra's own), in order."""
    from omegaconf import OmegaConf

    schema, found = sections(), []
    for name in cfg:
        if name == "hydra":
            continue
        if name not in schema or not OmegaConf.is_dict(cfg[name]):
            found.append(str(name))
            continue
        known = {f.name for f in dataclasses.fields(schema[name])}
        found += [f"{name}.{key}" for key in cfg[name] if key not in known]
    return found


def unknown_key_error(key: str) -> ConfigError:
    """The one message for an unknown key, however it was written (key=, +key=, ++key=, YAML)."""
    known = [f"{name}.{f.name}" for name, cls in sections().items() for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(key, known + list(sections()), n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return ConfigError(f"{key} is not a key of this config; {hint}python main.py --help lists every key")


def field_docs(cls: type) -> dict[str, str]:
    """A dataclass's field docstrings (the string literal under each field), read from its source."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for field, doc in zip(body, body[1:]):
        if isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
            docs[field.target.id] = " ".join(str(doc.value.value).split())
    return docs


def help_text() -> str:
    """What `python main.py --help` prints: the groups, every key with its type, default and meaning."""
    from model import MODEL_SIZES

    models = ", ".join(f"{name} ({l}x{h}x{e})" for name, (l, h, e) in MODEL_SIZES.items())
    lines = ["Train a character-level GPT: python main.py [group=option ...] [section.key=value ...]",
             "Under torchrun every rank runs this same command. --multirun a=1,2 runs a sweep (one process).", "",
             "== Config groups (group=option; default first) ==", f"model: {models}"]
    lines += [f"parallel={name}: {doc}" for name, (_, doc) in PARALLEL.items()]
    lines += [f"recipe={name}: {doc}" for name, (_, doc) in RECIPES.items()]
    lines += ["", "== Keys (section.key=value) =="]
    for section, cls in sections().items():
        docs, hints = field_docs(cls), {f.name: f for f in dataclasses.fields(cls)}
        for name, f in hints.items():
            kind = f.type if isinstance(f.type, str) else f.type.__name__
            lines.append(f"{section}.{name} ({kind}, default {f.default!r}): {docs.get(name, '')}")
    lines += ["", "== This run's config ==", "$CONFIG"]
    return "\n".join(lines).replace("${", "$\\{")  # no interpolation in the help text


def path_safe(overrides: str, limit: int = 120) -> str:
    """A sweep job's directory name from its overrides: a '/' in a value must not nest it, and a
    long list (paths in values) must not pass the 255-byte file-name limit, so past `limit`
    characters the tail becomes a hash of the whole (the same overrides always give the same name)."""
    name = overrides.replace("/", "_")
    if len(name) <= limit:
        return name
    return f"{name[:limit - 13]}~{hashlib.sha1(name.encode()).hexdigest()[:12]}"


def register() -> None:
    """Register the schema, the config groups and the help page with Hydra's ConfigStore."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from model import MODEL_SIZES

    OmegaConf.register_new_resolver("path_safe", path_safe, replace=True)
    store = ConfigStore.instance()
    store.store(name="job_schema", node=job_schema())
    for name, (n_layer, n_head, n_embd) in MODEL_SIZES.items():
        store.store(group="model", name=name, package="_global_",
                    node={"gpt_config": {"n_layer": n_layer, "n_head": n_head, "n_embd": n_embd}})
    for name, (values, _) in PARALLEL.items():
        node = {"trainer_config": values}
        if name.startswith("zero"):
            node["deepspeed_config"] = {"zero_stage": int(name[-1])}
        store.store(group="parallel", name=name, package="_global_", node=node)
    for name, (values, _) in RECIPES.items():
        node = {k: v for k, v in values.items() if k != "model"}
        if "model" in values:  # a recipe may pick the model; model=... on the command line still wins
            node["defaults"] = [{"override /model": values["model"]}]
        store.store(group="recipe", name=name, package="_global_", node=node)
    store.store(group="hydra/help", name="mingpt", node={"app_name": "mingpt-ddp", "header": "", "footer": "",
                                                         "template": help_text()})


def to_dict(obj: Any) -> dict[str, Any]:
    """A dataclass as plain builtins (what snapshots and the metrics file store)."""
    return dataclasses.asdict(obj)
