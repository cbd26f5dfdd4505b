"""KV transceiver: page tables and mappers, the wire protocol, leases, the authenticated control
channel, and three data paths behind one interface (transfer/paths/: ucx, host_shm, cuda_ipc).

Prefill side: ``KVSender.publish`` -> TransferTicket (the router carries it to a decode worker).
Decode side: ``await KVReceiver.pull(ticket, dst_page_ids, skip_pages, expected_prompt_len)`` ->
TransferResult. See docs/structure.md for the module map.
"""

from transfer.config import FaultInjection, TransceiverConfig
from transfer.mapper import MapperError, Segment, map_pages
from transfer.messages import TransferProtocolError, TransferTicket
from transfer.page_table import PageTable, PoolDescriptor, compat_hash
from transfer.receiver import KVReceiver
from transfer.sender import KVSender
from transfer.stats import TransferResult, TransferStats

__all__ = [
    "FaultInjection",
    "KVReceiver",
    "KVSender",
    "MapperError",
    "PageTable",
    "PoolDescriptor",
    "Segment",
    "TransceiverConfig",
    "TransferProtocolError",
    "TransferResult",
    "TransferStats",
    "TransferTicket",
    "compat_hash",
    "map_pages",
]
