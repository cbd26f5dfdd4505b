"""From the cluster config's ``transfer`` section to the TransceiverConfig every worker gets, with
the cluster's transfer secret (cluster/transfer_secret.py).

What only a worker's own node can settle (the address of ``transfer.interface``) is settled there
(worker_common/transfer_setup.py).
"""

from __future__ import annotations

from cluster.config import ClusterConfig
from cluster.transfer_secret import cluster_secret
from transfer import FaultInjection, TransceiverConfig


def transceiver_config(config: ClusterConfig, secret: str | None = None) -> TransceiverConfig:
    """The transceiver settings of ``config``; ``secret`` as made by `duet serve`, else
    ``cluster_secret(config)``."""
    t = config.transfer
    faults = t.fault_injection
    return TransceiverConfig(
        secret=secret or cluster_secret(config),
        host=t.host,  # replaced on the worker's node when t.interface is set
        port=t.port,
        staging_tokens=t.staging_tokens,
        staging_buffers=t.staging_buffers,
        direct_copy=t.direct_copy,
        lease_s=t.lease_s,
        connect_deadline_s=t.connect_deadline_s,
        pull_deadline_s=t.pull_deadline_s,
        chunk_deadline_s=t.chunk_deadline_s,
        done_deadline_s=t.done_deadline_s,
        ack_deadline_s=t.ack_deadline_s,
        ucx_env=t.ucx_environment,
        progress_mode=t.progress_mode,
        # The server's stats poller drains the transfer records every stats.interval_s.
        max_stats_len=config.stats.max_stats_len,
        fault_injection=FaultInjection(faults.fraction, tuple(faults.points), faults.seed),
    )
