"""ConfigError: settings the user must fix, one line per problem, each naming its cluster field.

Raised by the cluster config loader (cluster/config/loader.py) and by a worker whose settings turn
out not to work with its model (worker_common/engine_setup.py); defined here, below cluster/, so
that workers need not import the cluster config to name its fields.
"""

from __future__ import annotations


class ConfigError(Exception):
    """A cluster config the user must fix. ``issues`` holds one line per problem."""

    def __init__(self, source: str, issues: list[str]) -> None:
        self.source = source
        self.issues = issues
        lines = "\n".join(f"  {issue}" for issue in issues)
        super().__init__(f"invalid config {source}:\n{lines}")

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, list[str]]]:
        # Pickled with its own arguments, so it survives a trip through Ray as itself.
        return (type(self), (self.source, self.issues))
