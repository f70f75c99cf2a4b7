"""How a run is configured: one schema, registered with Hydra, with the groups users switch between.

Each section of the config is a dataclass in this package (config/): DataConfig (data.py),
GPTConfig (model.py), OptimizerConfig (optimizer.py), TrainerConfig (trainer.py), DeepSpeedConfig
(deepspeed.py), PipelineConfig (pipeline.py), TensorConfig (tensor.py), ContextConfig
(context.py), TorchftConfig (replica_groups.py), MeshConfig (mesh.py: every degree); they import
nothing but the error types, so any part of the project can import its section without importing
the others. They are the only place a
key, its type, its default and its meaning are written. This module puts them together as the
job's schema and registers it with Hydra's ConfigStore; gpt2_train_cfg.yaml composes it through
its defaults list.
Hydra (OmegaConf) then refuses an unknown key or a value of the wrong type, on the
command line and in YAML alike, with the same message naming the key; ranges and
combinations are each dataclass's __post_init__'s job (ConfigError).

Config groups (python main.py model=gpt-mini parallel=fsdp recipe=shakespeare-gpu):
    model     a named size (MODEL_SIZES in config/model.py)
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

from mingpt_ddp.config.context import ContextConfig
from mingpt_ddp.config.data import DataConfig
from mingpt_ddp.config.deepspeed import DeepSpeedConfig
from mingpt_ddp.config.groups import PARALLEL, RECIPES
from mingpt_ddp.config.mesh import MeshConfig
from mingpt_ddp.config.model import MODEL_SIZES, GPTConfig
from mingpt_ddp.config.optimizer import OptimizerConfig
from mingpt_ddp.config.pipeline import PipelineConfig
from mingpt_ddp.config.replica_groups import TorchftConfig
from mingpt_ddp.config.tensor import TensorConfig
from mingpt_ddp.config.trainer import TrainerConfig
from mingpt_ddp.errors import ConfigError


def sections() -> dict[str, type]:
    """The config's sections, each a dataclass beside the code it configures."""

    return {
        "data_config": DataConfig,
        "gpt_config": GPTConfig,
        "optimizer_config": OptimizerConfig,
        "trainer_config": TrainerConfig,
        "deepspeed_config": DeepSpeedConfig,
        "pipeline_config": PipelineConfig,
        "tensor_config": TensorConfig,
        "context_config": ContextConfig,
        "torchft_config": TorchftConfig,
        "mesh_config": MeshConfig,
    }


def job_schema() -> type:
    """The whole config as one dataclass: a field per section."""
    return dataclasses.make_dataclass(
        "JobConfig",
        [(name, cls, dataclasses.field(default_factory=cls)) for name, cls in sections().items()],
    )


PARALLELISMS = ("pipeline", "tensor", "context", "torchft", "mesh")


def modes(job: Any) -> dict[str, Any]:
    """A job's sections of the parallelisms, by the names Plan.of and the Trainer take them."""
    return {name: getattr(job, f"{name}_config") for name in PARALLELISMS}


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
    known = [
        f"{name}.{f.name}" for name, cls in sections().items() for f in dataclasses.fields(cls)
    ]
    close = difflib.get_close_matches(key, known + list(sections()), n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return ConfigError(
        f"{key} is not a key of this config; {hint}python main.py --help lists every key"
    )


def field_docs(cls: type) -> dict[str, str]:
    """A dataclass's field docstrings (the string literal under each field), read from its
    source."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for field, doc in zip(body, body[1:]):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
        ):
            docs[field.target.id] = " ".join(str(doc.value.value).split())
    return docs


def help_text() -> str:
    """What `python main.py --help` prints: the groups, every key with its type, default and
    meaning."""

    models = ", ".join(
        f"{name} ({layers}x{heads}x{width})" for name, (layers, heads, width) in MODEL_SIZES.items()
    )
    lines = [
        "Train a character-level GPT: python main.py [group=option ...] [section.key=value ...]",
        "Under torchrun every rank runs this same command. "
        "--multirun a=1,2 runs a sweep (one process).",
        "",
        "== Config groups (group=option; default first) ==",
        f"model: {models}",
    ]
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


def help_page(config_dir: str, config_name: str, args: list[str]) -> str:
    """help_text() with this command line's composed config: what Hydra's own --help prints,
    without its listing of every config group, which deep-copies the whole config store once per
    group (15 s here, where composing the config once takes 0.3 s)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    overrides = [a for a in args if not a.startswith("-")]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name=config_name, overrides=overrides)
    return help_text().replace("$\\{", "${").replace("$CONFIG", OmegaConf.to_yaml(cfg))


def path_safe(overrides: str, limit: int = 120) -> str:
    """A sweep job's directory name from its overrides: a '/' in a value must not nest it, and a
    long list (paths in values) must not pass the 255-byte file-name limit, so past `limit`
    characters the tail becomes a hash of the whole (the same overrides always give the same
    name)."""
    name = overrides.replace("/", "_")
    if len(name) <= limit:
        return name
    return f"{name[: limit - 13]}~{hashlib.sha1(name.encode()).hexdigest()[:12]}"


def register() -> None:
    """Register the schema, the config groups and the help page with Hydra's ConfigStore."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("path_safe", path_safe, replace=True)
    store = ConfigStore.instance()
    store.store(name="job_schema", node=job_schema())
    for name, (n_layer, n_head, n_embd) in MODEL_SIZES.items():
        store.store(
            group="model",
            name=name,
            package="_global_",
            node={"gpt_config": {"n_layer": n_layer, "n_head": n_head, "n_embd": n_embd}},
        )
    for name, (values, _) in PARALLEL.items():
        node = {"trainer_config": values}
        if name.startswith("zero"):
            node["deepspeed_config"] = {"zero_stage": int(name[-1])}
        store.store(group="parallel", name=name, package="_global_", node=node)
    for name, (values, _) in RECIPES.items():
        node = {k: v for k, v in values.items() if k != "model"}
        # A recipe may pick the model; model=... on the command line still wins.
        if "model" in values:
            node["defaults"] = [{"override /model": values["model"]}]
        store.store(group="recipe", name=name, package="_global_", node=node)
    store.store(
        group="hydra/help",
        name="mingpt",
        node={"app_name": "mingpt-ddp", "header": "", "footer": "", "template": help_text()},
    )


def to_dict(obj: Any) -> dict[str, Any]:
    """A dataclass as plain builtins (what snapshots and the metrics file store)."""
    return dataclasses.asdict(obj)
