"""The JSON results file: written atomically, complete or partial, with infinities as strings."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

DEFAULT_OUTPUT_DIR = "bench_results"  # (--output-dir's: results.json, the plots, saved runs)


def to_jsonable(value: Any) -> Any:
    """``value`` with every non-finite float replaced by "inf", "-inf" or "nan".

    Standard JSON has no infinity, and an infinite request rate ("send everything at once") is a
    normal sweep point; the strings read back with ``float()``.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    return value


def measured(doc: dict[str, Any]) -> bool:
    """Whether a results document holds at least one run."""
    return any(t.get("runs") for t in doc.get("targets") or [])


def save_results(path: Path, doc: dict[str, Any]) -> bool:
    """Write ``doc`` to ``path`` unless it measured nothing (bad settings, no server) and
    ``path`` holds an earlier run's measurements: one typo must not destroy the last
    measurement. Whether it was written."""
    if not measured(doc):
        try:
            if measured(json.loads(path.read_text())):
                return False
        except (OSError, ValueError, AttributeError):
            pass  # (no file, or none of ours: written)
    write_results(path, doc)
    return True


def write_results(path: str | Path, doc: dict[str, Any]) -> Path:
    """Write ``doc`` to ``path`` (parents created) through a temporary file and a rename, so that a
    reader never sees half a file and an interrupted write leaves the previous one intact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(to_jsonable(doc), f, indent=2, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
