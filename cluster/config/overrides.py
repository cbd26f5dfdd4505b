"""`--set PATH=VALUE` overrides of a cluster YAML on the command line (``duet serve``, ``duet config
validate``): a port or a replica count changed without editing the file.

``PATH`` is a dotted field path (``server.port``, ``decode.scheduler.max_num_seqs``); ``VALUE`` is
read as YAML, as the file's own values are (``8001`` a number, ``true`` a bool, ``null`` nothing,
``[a, b]`` a list, ``512MiB`` a string the field parses). The overrides apply to the file's data
before validation, so a mistyped path or a bad value is refused with the same message as in the
file (``server.prot: unknown key (did you mean 'port'?)``), naming the file and the override.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import yaml


class OverrideError(ValueError):
    """An override that is not PATH=VALUE, or whose path runs through a value that is no mapping."""


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """``"server.port=8001"`` -> (("server", "port"), 8001)."""
    path, sep, raw = text.partition("=")
    keys = tuple(path.strip().split("."))
    if not sep or not all(k.strip() for k in keys):
        raise OverrideError(f"--set {text!r}: expected PATH=VALUE, e.g. server.port=8001")
    keys = tuple(k.strip() for k in keys)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        # (the value is not repeated: it may be a secret)
        problem = getattr(e, "problem", None) or type(e).__name__
        raise OverrideError(
            f"--set {'.'.join(keys)}=...: the value is not YAML ({problem})"
        ) from None
    return keys, value


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of a config's ``data`` with every override set, in order (a later one wins); the
    sections an override names are made when the file leaves them out."""
    out = copy.deepcopy(dict(data))
    for text in overrides:
        keys, value = parse_override(text)
        node = out
        for depth, key in enumerate(keys[:-1]):
            child = node.setdefault(key, {})
            if child is None:  # (a section left null in the file: filled by the override)
                child = node[key] = {}
            if not isinstance(child, dict):
                where = ".".join(keys[: depth + 1])
                raise OverrideError(
                    f"--set {'.'.join(keys)}=...: {where} is {child!r}, not a section with fields"
                )
            node = child
        node[keys[-1]] = value
    return out
