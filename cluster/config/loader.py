"""Reading a cluster YAML: every problem becomes one ConfigError that lists each bad field path.

A validation message reads ``prefill.replicas: must be >= 0, got -1``; an unknown key names the
allowed ones (``server.prot: unknown key (did you mean 'port'?); allowed: api_key, host, ...``).
"""

from __future__ import annotations

import difflib
import os
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import yaml
from pydantic import BaseModel, SecretStr, ValidationError

from cluster.config.base import FieldErrors
from cluster.config.cluster_config import ClusterConfig
from cluster.config.overrides import OverrideError, apply_overrides
from worker_common.config_error import ConfigError

__all__ = ["ConfigError", "config_from_dict", "load_config"]


def load_config(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> ClusterConfig:
    """Read and validate a cluster YAML file, with ``overrides`` (``--set PATH=VALUE``, see
    cluster/config/overrides.py) set on it first; raise ConfigError listing every problem."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        hint = ""
        if not os.path.exists(source) and not source.endswith((".yaml", ".yml")):
            # (a model id or checkpoint where the cluster YAML goes, as `vllm serve MODEL` has it)
            hint = (
                "; a cluster YAML goes here (e.g. configs/local.yaml), and a model in its "
                "model.source (or --set model.source=...)"
            )
        raise ConfigError(source, [f"cannot read file: {e.strerror or e}{hint}"]) from e
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigError(source, [_describe_yaml_error(e)]) from e
    data = {} if data is None else data
    if overrides:
        if not isinstance(data, Mapping):
            return config_from_dict(data, source)  # (its error: the top level is no mapping)
        try:
            data = apply_overrides(data, overrides)
        except OverrideError as e:
            raise ConfigError(source, [str(e)]) from e
        source = f"{source} with --set {' '.join(_shown_override(o) for o in overrides)}"
    return config_from_dict(data, source)


def _secret_fields(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """The paths of the SecretStr fields under ``model``: their values are never printed."""
    found: set[tuple[str, ...]] = set()
    for name, field in model.model_fields.items():
        if field.annotation is SecretStr or SecretStr in typing.get_args(field.annotation):
            found.add((*prefix, name))
        nested = _section_at(model, (name,))
        if nested is not None:
            found |= _secret_fields(nested, (*prefix, name))
    return found


def _is_secret(loc: tuple[str, ...]) -> bool:
    return any(loc[: len(path)] == path for path in _SECRET_FIELDS)


def _shown_override(text: str) -> str:
    """An override as an error repeats it: a secret's value hidden."""
    path, sep, _ = text.partition("=")
    keys = tuple(k.strip() for k in path.split("."))
    return f"{path}=<hidden>" if sep and _is_secret(keys) else text


def config_from_dict(data: Any, source: str = "<dict>") -> ClusterConfig:
    """Validate already-parsed config data (e.g. from a test or an API) into a ClusterConfig."""
    if not isinstance(data, Mapping):
        raise ConfigError(
            source, [f"the top level must be a mapping of sections, got {_kind(data)}"]
        )
    try:
        return ClusterConfig.model_validate(dict(data))
    except ValidationError as e:
        raise ConfigError(source, format_validation_error(e)) from e


def format_validation_error(error: ValidationError) -> list[str]:
    """One ``path: message`` line per problem, in the order pydantic found them."""
    issues: list[str] = []
    for detail in error.errors(include_url=False):
        loc = tuple(str(part) for part in detail["loc"])
        cause = detail.get("ctx", {}).get("error")
        if isinstance(cause, FieldErrors):
            issues.extend(f"{_path(loc + (field,))}: {message}" for field, message in cause.issues)
        else:
            issues.append(f"{_path(loc)}: {_message(detail, loc)}")
    return issues


def _message(detail: Mapping[str, Any], loc: tuple[str, ...]) -> str:
    kind, ctx, value = detail["type"], detail.get("ctx", {}), detail.get("input")
    # (a secret's value is not repeated, only its kind: a number YAML read from an unquoted key)
    got = f", got {_kind(value) if _is_secret(loc) else repr(value)}"
    bounds = {
        "greater_than": ">",
        "greater_than_equal": ">=",
        "less_than": "<",
        "less_than_equal": "<=",
    }
    if kind in bounds:
        limit = next(iter(ctx.values()))
        if isinstance(limit, float) and limit.is_integer():
            limit = int(limit)  # "must be > 0", not "> 0.0", for a float field
        return f"must be {bounds[kind]} {limit}{got}"
    if kind == "literal_error":
        return f"must be one of {ctx['expected'].replace(' or ', ', ')}{got}"
    if kind == "extra_forbidden":
        return _unknown_key(loc)
    if kind == "missing":
        return "required"
    if kind == "value_error":
        return str(ctx.get("error", detail["msg"]))
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"must be an integer{got}"
    if kind in ("float_type", "float_parsing"):
        return f"must be a number{got}"
    if kind in ("bool_type", "bool_parsing"):
        return f"must be true or false{got}"
    if kind == "string_type":
        return f"must be a string{got}"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"must be a mapping, got {_kind(value)}"
    if kind in ("list_type", "tuple_type"):
        return f"must be a list, got {_kind(value)}"
    if kind == "byte_size":
        return f"must be a byte count (an integer, or a number with a unit like '512MiB'){got}"
    if kind == "string_too_short":
        return f"must not be empty{got}"
    return f"{detail['msg']}{got}"


def _unknown_key(loc: tuple[str, ...]) -> str:
    section = _section_at(ClusterConfig, loc[:-1])
    if section is None:
        return "unknown key"
    allowed = sorted(section.model_fields)
    close = difflib.get_close_matches(loc[-1], allowed, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"unknown key{hint}; allowed: {', '.join(allowed)}"


def _section_at(model: type[BaseModel], loc: tuple[str, ...]) -> type[BaseModel] | None:
    """The model class at a path of field names, looking through ``X | None``."""
    for name in loc:
        field = model.model_fields.get(name)
        if field is None:
            return None
        candidates = [field.annotation]
        if (
            isinstance(field.annotation, types.UnionType)
            or typing.get_origin(field.annotation) is typing.Union
        ):
            candidates = list(typing.get_args(field.annotation))
        nested = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if not nested:
            return None
        model = nested[0]
    return model


def _path(loc: tuple[str, ...]) -> str:
    return ".".join(loc) if loc else "(top level)"


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


def _describe_yaml_error(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    where = "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
    return f"invalid YAML{where}: {problem}"


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key repeated in one mapping (plain YAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, typing.Hashable):
                continue  # SafeLoader itself reports unhashable keys
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _UniqueKeyLoader.construct_mapping
)


_SECRET_FIELDS = _secret_fields(ClusterConfig)
