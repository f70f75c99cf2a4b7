"""Strict configuration: turns the Hydra YAML into typed, validated dataclasses.

Each YAML section is backed by a dataclass that lives next to the code it
configures (GPTConfig in model.py, DataConfig in char_dataset.py, OptimizerConfig
and TrainerConfig in trainer.py). This module owns only the rules shared by all of
them: a misspelled or unknown key is an error that names it (with the closest
known key), values must have the field's type, and each dataclass validates its
own ranges in __post_init__, raising ConfigError.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A user-fixable configuration problem; the message names the setting to change."""


def _suggest(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else f" (known keys: {', '.join(known)})"


def _coerce(section: str, name: str, value: Any, annotation: Any) -> Any:
    """Check a YAML value against a field's type; ints are accepted where floats are expected."""
    expected = annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        expected = tuple(a for a in typing.get_args(annotation) if a is not type(None))
        if value is None:
            return value
        expected = expected[0] if len(expected) == 1 else expected
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is bool and not isinstance(value, bool):
        raise ConfigError(f"{section}.{name} must be true or false, got {value!r}")
    if expected in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{section}.{name} must be a number, got {value!r}")
    if isinstance(expected, type) and not isinstance(value, expected):
        if expected is str and value is None:
            return ""
        raise ConfigError(f"{section}.{name} must be of type {expected.__name__}, got {value!r}")
    return value


def build_section(cls: type[T], values: dict[str, Any] | None, section: str | None = None) -> T:
    """Build one config dataclass from a plain dict, rejecting unknown keys and wrong types."""
    section = section or getattr(cls, "section", cls.__name__)
    values = dict(values or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in values:
        if key not in fields:
            raise ConfigError(f"unknown config key {section}.{key}{_suggest(key, sorted(fields))}")
    kwargs = {k: _coerce(section, k, v, hints[k]) for k, v in values.items()}
    return cls(**kwargs)


def build_config(raw: dict[str, Any], schema: dict[str, type]) -> dict[str, Any]:
    """Build every section of `schema` from the raw YAML dict; unknown sections are errors."""
    for key in raw:
        if key not in schema:
            raise ConfigError(f"unknown config section {key!r}{_suggest(key, sorted(schema))}")
    return {name: build_section(cls, raw.get(name), name) for name, cls in schema.items()}


def to_dict(obj: Any) -> dict[str, Any]:
    """A dataclass as plain builtins (what snapshots and the metrics file store)."""
    return dataclasses.asdict(obj)
