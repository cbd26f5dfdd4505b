"""DataPath: how the pages of a pull move between one pair of workers.

The path is chosen once per link, in the handshake: P offers its pools (``paths.offer``), D opens
them if it can (``paths.choose``) and tells P which path it took. Three implementations:

- ``ucx`` (paths/ucx.py): staged chunks as UCX tag messages; any two hosts.
- ``host_shm`` (paths/host_shm.py): D reads P's memfd pools, mapped read-only; CPU workers of a host.
- ``cuda_ipc`` (paths/cuda_ipc.py): D reads P's GPU pools through CUDA IPC with the page-copy
  kernel; GPUs of one host.

Everything else of a pull is common (pull.py on D, serve.py on P): the ticket's checks, the
lease, the declared-history check, the final notice, stats, failure policy and fault injection.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from transfer.pull import PullSession
    from transfer.serve import ServeSession


class PullFailed(Exception):
    """D's pull cannot complete; the message says why (it becomes the result's error)."""


class ServeFailed(Exception):
    """P gives up serving a pull; the message says why (D gets it in a PullError)."""


class PoolsUnavailable(Exception):
    """P's pools cannot be shared, or opened by this peer: the link uses UCX."""


class DataPath(ABC):
    name: ClassVar[str]

    @abstractmethod
    async def fetch(self, pull: PullSession) -> int:
        """D side: ask P for the pull's segments (``pull.segments``) and move them into D's pages;
        return the bytes moved. Raises PullFailed. Returns, or raises, only once nothing of the
        pull can still write D's pages (a GPU copy past its deadline is fenced: D's model stream
        waits for it)."""

    @abstractmethod
    async def serve(self, pull: ServeSession) -> None:
        """P side: serve an admitted pull (its lease is held) until its pages may be released: D's
        final notice came, or its deadline passed with nothing of the pull still reading them.
        Raises ServeFailed after cleaning up."""

    def close(self) -> None:  # noqa: B027 (most paths hold nothing)
        """The link closed: let go of whatever the path holds (opened pools)."""
