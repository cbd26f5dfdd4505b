"""What a benchmark measures: a server at a URL, or a Duet cluster the driver starts from a config.

Expected contract of the cluster package (imported lazily, so `duet bench URL` needs neither):

    cluster.config.load_config(path) -> ClusterConfig      (raises cluster.config.ConfigError)
    cluster.serve.start_cluster(config, port=0, worker_log_level=...) -> handle
                                                           starts local Ray, the workers and the server
        handle.url: str     the HTTP server's root, e.g. "http://127.0.0.1:8000"
        handle.stop()       shuts the server, its actors and the Ray it started down

The aggregated baseline is a config of its own (``prefill.replicas: 0``: decode workers prefill
locally) with the same model and hardware, kept next to the disaggregated one as
``<name>_aggregated.yaml`` (configs/local.yaml -> configs/local_aggregated.yaml).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from pathlib import Path
from types import TracebackType
from typing import Any

from cluster.bench.client import normalize_base_url
from cluster.bench.errors import BenchError


class Target(ABC):
    """A server to benchmark. Use as a context manager: ``with target as url: ...``."""

    def __init__(self, label: str) -> None:
        self.label = label  # how the report names it: "disaggregated", "aggregated", or the URL

    @abstractmethod
    def start(self) -> str:
        """Make the server ready and return its root URL."""

    @abstractmethod
    def stop(self) -> None:
        """Release what ``start`` acquired; a no-op when nothing was started."""

    @property
    def is_duet(self) -> bool:
        """Whether the target is known to be Duet (then /perf_metrics is expected)."""
        return False

    @property
    def stats_interval_s(self) -> float | None:
        """How often the server hears from its workers (its /metrics lag), when known."""
        return None

    @property
    def api_key(self) -> str | None:
        """The API key the server wants, when known (a cluster the driver starts)."""
        return None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class UrlTarget(Target):
    """Any OpenAI-compatible server that is already running (Duet, or a peer to compare with)."""

    def __init__(self, url: str, label: str | None = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"target URL must start with http:// or https://, got {url!r}")
        self.url = normalize_base_url(url)
        super().__init__(label or self.url)

    def start(self) -> str:
        return self.url

    def stop(self) -> None:
        pass


class ConfigTarget(Target):
    """A Duet cluster started from a YAML config on a local Ray cluster, and stopped afterwards."""

    def __init__(
        self, config_path: str | Path, label: str, expect_aggregated: bool | None = None
    ) -> None:
        super().__init__(label)
        self.config_path = Path(config_path)
        self.config = load_cluster_config(self.config_path)  # fail before any run on a bad file
        aggregated = getattr(self.config, "aggregated", None)
        if (
            expect_aggregated is not None
            and aggregated is not None
            and aggregated != expect_aggregated
        ):
            want = (
                "an aggregated config (prefill.replicas: 0)"
                if expect_aggregated
                else "a disaggregated config"
            )
            raise BenchError(f"the {label} target {self.config_path} must be {want}")
        self._handle: Any = None

    @property
    def is_duet(self) -> bool:
        return True

    @property
    def stats_interval_s(self) -> float | None:
        stats = getattr(self.config, "stats", None)
        return float(stats.interval_s) if stats is not None else None

    @property
    def api_key(self) -> str | None:
        key = getattr(getattr(self.config, "server", None), "api_key", None)
        return key.get_secret_value() if key is not None else None

    def start(self) -> str:
        try:
            serve_module = importlib.import_module("cluster.serve")
        except ImportError as exc:
            raise BenchError(
                f"cannot start a cluster from {self.config_path}: {exc}. "
                "Start the server yourself (duet serve CONFIG) and pass its URL instead."
            ) from None
        try:
            # The workers' INFO lines would land in the middle of the progress bars and the
            # report; their warnings and errors still show. On a free port, not server.port: the
            # driver reads the URL back, and a `duet serve` of the same config (port 8000) may
            # be running beside it.
            self._handle = serve_module.start_cluster(
                self.config, port=0, worker_log_level="WARNING"
            )
        except Exception as exc:
            raise BenchError(
                f"starting the {self.label} cluster from {self.config_path} failed: {exc}"
            ) from exc
        return normalize_base_url(str(self._handle.url))

    def stop(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.stop()


def load_cluster_config(path: Path) -> Any:
    """``cluster.config.load_config(path)``, its errors turned into a BenchError."""
    if not path.is_file():
        raise BenchError(f"config file {path} does not exist")
    config_module = importlib.import_module("cluster.config")
    try:
        return config_module.load_config(path)
    except config_module.ConfigError as exc:
        raise BenchError(str(exc)) from None


def is_url(text: str) -> bool:
    """Whether a target is a URL (otherwise it is a config path)."""
    return text.startswith(("http://", "https://"))


def aggregated_sibling(config_path: str | Path) -> Path:
    """The aggregated baseline kept next to a config: configs/local.yaml -> configs/local_aggregated.yaml."""
    path = Path(config_path)
    return path.with_name(f"{path.stem}_aggregated{path.suffix}")


def _make(target: str, label: str, expect_aggregated: bool | None) -> Target:
    if is_url(target):
        return UrlTarget(target, label)
    return ConfigTarget(target, label, expect_aggregated)


def build_targets(target: str, compare: str | None, compare_target: str | None) -> list[Target]:
    """The targets of one `duet bench` command, in the order they run; configs are loaded (and so
    checked) here, before anything runs.

    ``compare="aggregated"`` adds the aggregated baseline: ``compare_target`` (a URL or a config),
    or by default, for a config target, its ``aggregated_sibling``. A URL target needs
    ``compare_target``: the driver cannot switch a running server's mode.
    """
    if compare not in (None, "aggregated"):
        raise ValueError(f"--compare accepts only 'aggregated', got {compare!r}")
    if compare is None:
        if compare_target is not None:
            raise ValueError("--compare-target is only used with --compare aggregated")
        return [
            _make(target, normalize_base_url(target) if is_url(target) else Path(target).name, None)
        ]
    if compare_target is None:
        if is_url(target):
            raise ValueError(
                "--compare aggregated against a URL needs --compare-target (the aggregated server's URL)"
            )
        compare_target = str(aggregated_sibling(target))
        if not Path(compare_target).is_file():
            raise ValueError(
                f"--compare aggregated: no {compare_target} next to {target}; pass --compare-target"
            )
    return [_make(target, "disaggregated", False), _make(compare_target, "aggregated", True)]
