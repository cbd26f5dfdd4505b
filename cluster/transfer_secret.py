"""The cluster's transfer secret: ``transfer.secret``, the DUET_TRANSFER_SECRET environment
variable, or one `duet serve` makes (and hands to every worker it starts). Imports nothing heavy:
`duet config validate` checks it as `duet serve` would."""

from __future__ import annotations

import os
import secrets

from cluster.config import ClusterConfig, ConfigError
from cluster.config.transfer import SECRET_ENV, secret_problem


def cluster_secret(config: ClusterConfig, make: bool = False) -> str:
    """``transfer.secret``, else the environment variable DUET_TRANSFER_SECRET, else (``make``:
    what `duet serve` does) a fresh random one. Raises ValueError when there is none and none
    may be made, or the environment's is too weak."""
    if config.transfer.secret is not None:
        return config.transfer.secret.get_secret_value()
    if os.environ.get(SECRET_ENV):
        if problem := secret_problem(os.environ[SECRET_ENV]):
            raise ValueError(f"{SECRET_ENV} {problem}")
        return os.environ[SECRET_ENV]
    if make:
        return secrets.token_urlsafe(32)
    raise ValueError(
        f"no transfer secret: set transfer.secret or {SECRET_ENV} for workers started "
        "without `duet serve`"
    )


def secret_of(config: ClusterConfig) -> str:
    """`duet serve`'s secret for ``config`` (made fresh unless given), or a ConfigError naming
    where a bad one came from."""
    try:
        return cluster_secret(config, make=True)
    except ValueError as e:
        raise ConfigError(
            "transfer section or its environment", [f"transfer.secret: {e}"]
        ) from None
