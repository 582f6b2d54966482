"""Building a settings tree from TOML data and ``INFER_WORKER_*`` variables.

Generic over the dataclass tree: each field's type says how a TOML value or an
environment string converts, and unknown keys are errors.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NewType, TypeVar, get_args, get_origin, get_type_hints

from worker.config.checks import as_written
from worker.config.secret import MASK, Secret
from worker.flow.errors import ConfigError

ENV_PREFIX = "INFER_WORKER_"

TomlValue = NewType("TomlValue", object)
"""A setting that takes a TOML number, boolean or (nested) list of them as it is
(a constant input's value); kept as nested tuples, so settings stay hashable."""

_T = TypeVar("_T")


def load_tree(
    root: type[_T],
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    complete: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> _T:
    """Defaults, then the TOML file (if any), then ``INFER_WORKER_*`` variables.
    ``complete``: given the root's converted fields before the root is made (and
    checks itself whole), returns them with what only they lead to (the models
    of a ``[repository]``)."""
    data: dict[str, Any] = {}
    if path is not None:
        data = read_toml(path, f"config file not found: {path}")
    _apply_env(data, env if env is not None else _os_environ())
    kwargs = _fields(root, data, "")
    tree: _T = _construct(root, complete(kwargs) if complete else kwargs, "")
    return tree


def read_toml(path: str | Path, missing: str) -> dict[str, Any]:
    """A TOML file's tables; ``missing``: the error when there is no such file."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError as exc:
        raise ConfigError(missing) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc


def build_table(cls: type[_T], data: Mapping[str, Any], prefix: str = "") -> _T:
    """One section built from a table read elsewhere (a repository model's
    settings file), converted and checked as the same section of the file is."""
    built: _T = _build(cls, data, prefix)
    return built


def _os_environ() -> Mapping[str, str]:
    import os

    return os.environ


def _apply_env(data: dict[str, Any], env: Mapping[str, str]) -> None:
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        parts = [p.lower() for p in name[len(ENV_PREFIX) :].split("__")]
        if len(parts) < 2 or not all(parts):
            raise ConfigError(
                f"{name}: expected {ENV_PREFIX}<SECTION>__<KEY> (e.g. "
                f"{ENV_PREFIX}KAFKA__BOOTSTRAP_SERVERS)"
            )
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{name}: {part} is not a section")
            node = child
        node[parts[-1]] = _EnvValue(raw)


@dataclass(frozen=True)
class _EnvValue:
    """A raw environment string; converted once the target field's type is known."""

    raw: str


def _build(cls: type[Any], data: Mapping[str, Any], prefix: str) -> Any:
    return _construct(cls, _fields(cls, data, prefix), prefix)


def _fields(cls: type[Any], data: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a table")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown key {prefix}{unknown[0]} (known: {', '.join(sorted(names))})")
    return {key: _convert(hints[key], value, f"{prefix}{key}") for key, value in data.items()}


def _construct(cls: type[Any], kwargs: Mapping[str, Any], prefix: str) -> Any:
    try:
        return cls(**kwargs)
    except TypeError as exc:  # defensive: a shape we did not convert
        raise ConfigError(f"{prefix.rstrip('.')}: {exc}") from exc


def _convert(tp: Any, value: Any, name: str) -> Any:
    if tp is TomlValue:
        return _toml_value(value, name)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, _EnvValue):
            raise ConfigError(f"{name}: is a section; set its keys instead")
        return _build(typing.cast(type[Any], tp), value, f"{name}.")
    if isinstance(value, _EnvValue):
        value = _parse_env(tp, value.raw)
    origin = get_origin(tp)
    args = get_args(tp)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, name)
    if origin is Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{name}: {value!r} is not one of {choices}")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{name}: expected a list, got {type(value).__name__}")
        item_tp = args[0]
        if len(args) != 2 or args[1] is not Ellipsis:  # fixed-length tuple
            if len(value) != len(args):
                raise ConfigError(f"{name}: expected {len(args)} items, got {len(value)}")
            return tuple(
                _convert(a, v, f"{name}[{i}]")
                for i, (a, v) in enumerate(zip(args, value, strict=True))
            )
        return tuple(_convert(item_tp, v, f"{name}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{name}: expected a table, got {type(value).__name__}")
        value_tp = args[1] if len(args) == 2 else Any
        if _tables(value_tp):
            return {str(k): _tagged(value_tp, v, f"{name}.{k}") for k, v in value.items()}
        return {str(k): _option(v, f"{name}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        return float(value)
    if tp is str or tp is Secret:
        if not isinstance(value, str):
            # A secret's value is not echoed, even when it is the wrong type.
            shown = type(value).__name__ if tp is Secret else repr(value)
            raise ConfigError(f"{name}: expected a string, got {shown}")
        return value if tp is str else Secret(value)
    raise ConfigError(f"{name}: unsupported setting type {tp!r}")  # pragma: no cover


def _tables(tp: Any) -> tuple[type[Any], ...]:
    """The dataclasses a dict's values may be: one, or a union told apart by ``kind``."""
    members = get_args(tp) if get_origin(tp) in (types.UnionType, typing.Union) else (tp,)
    if all(dataclasses.is_dataclass(m) for m in members):
        return tuple(typing.cast(type[Any], m) for m in members)
    return ()


def _tagged(tp: Any, value: Any, name: str) -> Any:
    """One table of a dict of sections (``[model.inputs.NAME]``): the member of a
    union whose ``kind`` the table names (the first member's by default). Messages
    of the section's own checks say ``<dict>.*``; they are given the table's name."""
    members = _tables(tp)
    if isinstance(value, _EnvValue) or not isinstance(value, Mapping):
        raise ConfigError(f"{name}: is a section; set its keys instead")
    cls = members[0]
    if len(members) > 1:
        kinds = {get_type_hints(m)["kind"]: m for m in members}
        by_kind = {get_args(k)[0]: m for k, m in kinds.items()}
        if "kind" in value:
            raw = value["kind"]
            kind = raw.raw if isinstance(raw, _EnvValue) else raw
            if kind not in by_kind:
                choices = ", ".join(repr(k) for k in by_kind)
                raise ConfigError(f"{name}.kind: {kind!r} is not one of {choices}")
            cls = by_kind[kind]
        else:
            # No kind: the first member that has every key given (a table with
            # ``value`` is a constant; anything else, the first member's kind).
            keys = set(value)
            cls = next(
                (m for m in members if keys <= {f.name for f in dataclasses.fields(m)}),
                members[0],
            )
    parent = name.rsplit(".", 1)[0]
    try:
        return _build(cls, value, f"{name}.")
    except ConfigError as exc:
        message = str(exc).replace(f"{parent}.*", name)
        if parent == "models":  # a [model] section's checks name it model.KEY
            message = as_written(message, name)
        raise ConfigError(message) from None


def _toml_value(value: Any, name: str) -> TomlValue:
    """A number, a boolean, or a (nested) list of them, kept as nested tuples;
    from the environment, a TOML literal."""
    if isinstance(value, _EnvValue):
        try:
            value = tomllib.loads(f"v = {value.raw}")["v"]
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{name}: {value.raw!r} is not a TOML number or list") from exc

    def frozen(v: Any) -> Any:
        if isinstance(v, bool | int | float):
            return v
        if isinstance(v, list | tuple) and v:
            return tuple(frozen(item) for item in v)
        raise ConfigError(f"{name}: expected a number, a boolean or a list of them, got {value!r}")

    return TomlValue(frozen(value))


def _option(value: Any, name: str) -> str | int | float | bool:
    """A passed-through client argument: a TOML scalar as written; from the
    environment, a TOML literal where one parses (``true``, ``5``), else the text."""
    if isinstance(value, _EnvValue):
        try:
            value = tomllib.loads(f"v = {value.raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = value.raw
    if not isinstance(value, str | int | float | bool):
        raise ConfigError(f"{name}: expected a string, number or boolean, got {value!r}")
    return value


def _parse_env(tp: Any, raw: str) -> Any:
    """Environment values are TOML literals where that parses (``true``, ``[8, 8]``,
    ``5``); strings may be given bare, and string lists as ``a,b,c``."""
    try:
        parsed = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = None
    else:
        if get_origin(tp) is tuple and _accepts_str(get_args(tp)[0]):
            if isinstance(parsed, list):
                return parsed
            # A scalar for a list of strings names one or more items: ``2024`` and
            # ``true`` are valid topic names, not an integer or a boolean.
            text = parsed if isinstance(parsed, str) else raw
            return [part.strip() for part in text.split(",") if part.strip()]
        if isinstance(parsed, str) or not _accepts_str(tp):
            return parsed
    if _accepts_str(tp):
        return raw
    if get_origin(tp) is tuple:
        return [part.strip() for part in raw.split(",") if part.strip()]
    return raw


def _accepts_str(tp: Any) -> bool:
    if tp is str or tp is Secret:
        return True
    args = get_args(tp)
    if get_origin(tp) is Literal:
        return all(isinstance(a, str) for a in args)
    if get_origin(tp) in (types.UnionType, typing.Union):
        return any(_accepts_str(a) for a in args)
    return False


def redacted_tree(settings: object) -> dict[str, Any]:
    """The settings as a dict for start-up logs and ``config``, every ``Secret``
    (the type says which settings are) shown as ``***``. The *_file keys name
    files, which are not secret; what the files hold never reaches a log."""
    assert dataclasses.is_dataclass(settings) and not isinstance(settings, type)
    out: dict[str, Any] = dataclasses.asdict(settings, dict_factory=_masked)
    return out


def _masked(items: list[tuple[str, Any]]) -> dict[str, Any]:
    return {k: MASK if isinstance(v, Secret) else v for k, v in items}
