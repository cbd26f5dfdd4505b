"""KV transceiver: page tables and mappers, the wire protocol, leases, and the UCX data path.

Prefill side: ``KVSender.publish`` -> TransferTicket (the router carries it to a decode worker).
Decode side: ``KVReceiver.pull(ticket, dst_page_ids, skip_pages, expected_prompt_len)`` -> TransferResult.
``Transceiver`` bundles both roles of one worker. See docs/structure.md for the module map.
"""

from transfer.config import TransceiverConfig
from transfer.mapper import Fragment, MapperError, map_pages
from transfer.messages import TransferProtocolError, TransferTicket
from transfer.page_table import PageTable, PoolDescriptor, compat_hash
from transfer.plan import Chunk, TransferPlan, build_plan
from transfer.receiver import KVReceiver
from transfer.sender import KVSender
from transfer.stats import TransferResult, TransferStats
from transfer.transceiver import Transceiver

__all__ = [
    "Chunk",
    "Fragment",
    "KVReceiver",
    "KVSender",
    "MapperError",
    "PageTable",
    "PoolDescriptor",
    "TransceiverConfig",
    "Transceiver",
    "TransferPlan",
    "TransferProtocolError",
    "TransferResult",
    "TransferStats",
    "TransferTicket",
    "build_plan",
    "compat_hash",
    "map_pages",
]
