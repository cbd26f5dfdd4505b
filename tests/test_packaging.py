"""Duet's top-level packages share no name with another installed distribution.

Python has one module namespace: a top-level package of ours named like another distribution's
shadows it (or is shadowed) for every import in the environment. transformers 5 installs and
imports Hugging Face's ``kernels`` on start, and our package of that name broke every transformers
import; this keeps the next such clash from reaching users.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def _top_level_packages() -> list[str]:
    """Our top-level packages, as pyproject's package discovery names them."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted(p.rstrip("*") for p in patterns)


def test_no_top_level_package_is_also_another_distributions() -> None:
    owners = importlib.metadata.packages_distributions()
    clashes = {
        name: sorted(set(owners[name]) - {"duet"})
        for name in _top_level_packages()
        if set(owners.get(name, ())) - {"duet"}
    }
    assert not clashes, f"top-level names also installed by other distributions: {clashes}"


def test_each_top_level_package_imports_from_this_checkout() -> None:
    for name in _top_level_packages():
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, name
        assert Path(spec.origin).resolve().is_relative_to(ROOT), (name, spec.origin)
