"""Strict YAML loading into frozen dataclasses.

Each component owns a frozen dataclass for its settings and receives only that. Loading
is strict: an unknown key is a ``ConfigError`` that names the key, the file and the line,
and lists the keys that are allowed. Line numbers come from a YAML loader that records
the position of every mapping key.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from edge_rtgi.errors import ConfigError

T = TypeVar("T")


class _Located(dict):
    """A dict that remembers the source line of each key (1-based)."""

    key_lines: dict[str, int]
    source: str


class _LineLoader(yaml.SafeLoader):
    pass


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode, deep: bool = False) -> _Located:
    loader.flatten_mapping(node)
    mapping = _Located()
    mapping.key_lines = {}
    mapping.source = getattr(loader, "_source_name", "<string>")
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        mapping[key] = loader.construct_object(value_node, deep=True)
        mapping.key_lines[key] = key_node.start_mark.line + 1
    return mapping


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(path: str | Path) -> Any:
    """Parse a YAML file, keeping key line numbers. Errors name the file and line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    return parse_yaml(text, str(path))


def parse_yaml(text: str, source: str = "<string>") -> Any:
    """Parse YAML text; ``source`` is used in error messages."""

    class Loader(_LineLoader):
        _source_name = source

    try:
        return yaml.load(text, Loader=Loader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None


def where(data: Any, key: str | None = None) -> str:
    """'file:line' for ``key`` in a mapping loaded by this module, or just the file."""
    source = getattr(data, "source", "<config>")
    line = getattr(data, "key_lines", {}).get(key) if key is not None else None
    return f"{source}:{line}" if line else source


def _strip_optional(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _coerce(value: Any, tp: Any, name: str, loc: str) -> Any:
    """Convert ``value`` to type ``tp``; ``name`` is the dotted key path, ``loc`` its file:line."""
    ctx = f"{loc}: {name}"
    tp = _strip_optional(tp)
    if value is None:
        return None
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return from_dict(tp, value, name)
    origin = typing.get_origin(tp)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{ctx}: expected a list, got {type(value).__name__}")
        args = typing.get_args(tp)
        item_tp = args[0] if args else Any
        return tuple(_coerce(v, item_tp, name, loc) for v in value)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{ctx}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and not isinstance(value, tp):
        raise ConfigError(f"{ctx}: expected {tp.__name__}, got {value!r}")
    if isinstance(tp, type) and tp is int and isinstance(value, bool):
        raise ConfigError(f"{ctx}: expected int, got {value!r}")
    return value


def from_dict(cls: type[T], data: Any, context: str | None = None) -> T:
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys with file and line.

    Nested dataclass fields are built recursively, as the class their default is built with
    where that is a subclass of the field's type (a section keeps the defaults its owner gives
    it: the daemon's engine section is a ``DaemonEngineConfig``), and an empty such section is
    that class's defaults; ``tuple[X, ...]`` fields accept lists.
    """
    ctx = context or cls.__name__
    if not dataclasses.is_dataclass(cls):  # a caller's bug, not a config error
        raise TypeError(f"from_dict needs a dataclass type, got {cls!r}")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where(data)}: {ctx} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(
                f"{where(data, key)}: unknown key {key!r} in {ctx}",
                hint=f"allowed keys: {', '.join(sorted(fields))}",
            )
        tp = _strip_optional(hints[key])
        factory = fields[key].default_factory
        if dataclasses.is_dataclass(factory) and isinstance(factory, type):
            if isinstance(tp, type) and dataclasses.is_dataclass(tp) and issubclass(factory, tp):
                tp = factory
            if value is None:  # an empty section (every key commented out): the defaults
                value = {}
        kwargs[key] = _coerce(value, tp, f"{ctx}.{key}", where(data, key))
    try:
        obj = cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where(data)}: {ctx}: {exc}") from None
    except ValueError as exc:  # __post_init__ validation
        raise ConfigError(f"{where(data)}: {ctx}: {exc}") from None
    return obj


def load_config(cls: type[T], path: str | Path) -> T:
    """Load a YAML file into dataclass ``cls`` strictly."""
    return from_dict(cls, load_yaml(path), cls.__name__)
