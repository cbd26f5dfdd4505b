"""Every field of the cluster YAML changes what the cluster does, and some test shows it: this walks
the schema and fails for any field whose dotted path (``stats.interval_s``) no other test names.

A test names a field by its full path in a string or comment next to what it asserts; naming it is
the promise that the test would fail if the field stopped doing what its description says.
"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path

from pydantic import BaseModel

from cluster.config import ClusterConfig

TESTS = Path(__file__).resolve().parents[1]


def field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    paths = []
    for name, field in model.model_fields.items():
        path = prefix + name
        args = typing.get_args(field.annotation)
        candidates = args if isinstance(field.annotation, types.UnionType) or args else ()
        nested = [
            c
            for c in (field.annotation, *candidates)
            if isinstance(c, type) and issubclass(c, BaseModel)
        ]
        if nested:
            paths += field_paths(nested[0], path + ".")
        else:
            paths.append(path)
    return paths


def test_the_walk_finds_every_section() -> None:
    paths = field_paths(ClusterConfig)
    assert {p.split(".")[0] for p in paths} == set(ClusterConfig.model_fields)
    assert "model.dummy_config.hidden_size" in paths and "prefill.resources.num_gpus" in paths


def test_every_config_field_is_named_by_a_test() -> None:
    text = "\n".join(
        p.read_text(encoding="utf-8") for p in TESTS.rglob("*.py") if p.name != Path(__file__).name
    )
    unnamed = [
        path
        for path in field_paths(ClusterConfig)
        if not re.search(rf"(?<![\w.]){re.escape(path)}(?![\w])", text)
    ]
    assert unnamed == []
