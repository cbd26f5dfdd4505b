"""Every message of the KV transfer protocol, and the ticket the router carries from P to D.

Control messages travel as msgpack maps ``{"v": PROTOCOL_VERSION, "type": name, "body": {...}}`` in
length-prefixed frames (control.py). ``decode_message`` is strict: an unknown version or type, a
missing or extra field, or a field of the wrong type raises TransferProtocolError, and so does
anything that is not msgpack at all; nothing else ever escapes it.

Conversation (D = decode worker, which pulls; P = prefill worker, which serves):
    D -> P  Hello            page table, UCX worker address, chunk size, D's done board, and
                             when D lists host pages its piece chunk size and primer (primer.py)
    P -> D  primer           over UCX, when asked and P lists host pages: one contiguous message
    P -> D  HelloReply       the same from P, plus P's pool export and lease board (ipc.py,
                             lease_board.py) for a same-host peer and whether it opened D's done
                             board (done_board.py), or an error (compatibility hash)
  A pull over UCX:
    D -> P  PullRequest      request id, pull id, page ids on both sides, D's plan (chunks, bytes),
                             and the chunks D has already posted receives for (credits)
    P -> D  data chunks      over UCX, tag = data_tag(pull_id, chunk index); only credited chunks
    D -> P  ChunkReady       more credits, as D's staging buffers free up
    P -> D  TransferDone     declared prompt length, bytes, chunks (once every send is posted)
    P -> D  PullError        instead, when P refuses or gives up the pull
    D -> P  TransferAck      ok, or the reason D failed the transfer; P releases that pull's lease
                             (also sent for a ticket D gave up before its PullRequest: then P
                             releases the lease the ticket's generation names, if no pull has it)
  A direct read (D opened P's pools, direct_read.py): D checks the lease on P's board, copies P's
  pages into its own and checks the board again; no message until then.
    (no message)             a read that succeeded is a record on D's done board, which P polls
    D -> P  ReadDone         a read that failed, with the reason (or any read, when P did not
                             open the done board); P releases the pages
  Either way:
    either  Reject           a message of the peer could not be decoded
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

import msgpack

from transfer.page_table import PageTable
from transfer.version import PROTOCOL_VERSION

_MASK64 = (1 << 64) - 1
_INT64_MAX = (1 << 63) - 1


class TransferProtocolError(ValueError):
    """A control message could not be decoded. ``request_id``/``pull_id`` are filled in when the
    malformed message still named them, so the receiver can fail that one transfer at once."""

    def __init__(
        self, reason: str, request_id: str | None = None, pull_id: int | None = None
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.request_id = request_id
        self.pull_id = pull_id


@dataclass(frozen=True)
class TransferTicket:
    """What P hands the router (and the router D) for one prefilled request. Plain data: it crosses
    Ray actor boundaries. ``page_ids`` are P's pages per pool group, in token order;
    ``lease_expires_at`` is wall-clock time (time.time()) when P frees them unless pulled."""

    request_id: str
    host: str
    port: int
    instance_id: str
    page_ids: dict[str, list[int]]
    declared_prompt_len: int
    compat_hash: str
    lease_expires_at: float
    # The lease's slot and generation on P's lease board (lease_board.py); -1 when it has none,
    # and then it is pulled over UCX whatever the link.
    lease_slot: int = -1
    lease_gen: int = 0


@dataclass(frozen=True)
class Hello:
    instance_id: str
    page_table: PageTable
    ucx_address: bytes
    chunk_bytes: int
    # The path of D's done board for this link (done_board.py), or "" (D then sends ReadDone).
    done_board: str = ""
    # D receives host pages as piece lists (ucp_iov.py): the chunk size it takes for pulls whose
    # chunks both sides list, or 0. With it, the tag and size of the primer D has posted a receive
    # for: one contiguous message P sends on its new endpoint so that piece lists work there from
    # the start (primer.py).
    piece_chunk_bytes: int = 0
    primer_tag: int = 0
    primer_bytes: int = 0


@dataclass(frozen=True)
class HelloReply:
    instance_id: str
    page_table: PageTable
    ucx_address: bytes
    chunk_bytes: int
    error: str  # "" when P accepts the peer
    pool_export: bytes  # ipc.IpcExport.to_wire(), or b"" when P offers no direct reads
    lease_board: str  # the path of P's lease board, or "" (with pool_export)
    # P mapped D's done board (Hello.done_board) and reads direct reads' ends from it.
    done_board_open: bool = False
    # P sent D's primer and lists its host pages from the first chunk on: the chunk size it takes
    # for pulls whose chunks both sides list (the link uses the smaller of the two), or 0.
    piece_chunk_bytes: int = 0


@dataclass(frozen=True)
class PullRequest:
    """``src_page_ids`` are the ticket's pages (P checks them against what it published);
    ``dst_page_ids`` are D's pages for ``src_page_ids[g][skip_pages:]``. ``num_chunks`` and
    ``total_bytes`` are D's plan, which P must reproduce exactly. ``lease_gen`` is the ticket's:
    P serves only that lease, never a later publish of the request."""

    request_id: str
    pull_id: int
    src_page_ids: dict[str, list[int]]
    dst_page_ids: dict[str, list[int]]
    skip_pages: int
    chunk_bytes: int
    num_chunks: int
    total_bytes: int
    ready_chunks: list[int]
    lease_gen: int


@dataclass(frozen=True)
class ChunkReady:
    request_id: str
    pull_id: int
    chunks: list[int]


@dataclass(frozen=True)
class PullError:
    """P refuses or gives up a pull. ``code``: expired, unknown, busy, mismatch, failed, or conflict
    (the pull id or the credits are unusable; nothing drained).
    ``drained``: P completed every credited chunk it will not send with an empty message, so D's
    receives have all ended (otherwise D must abort the link to cancel them)."""

    request_id: str
    pull_id: int
    code: str
    reason: str
    drained: bool


@dataclass(frozen=True)
class TransferDone:
    request_id: str
    pull_id: int
    declared_prompt_len: int
    total_bytes: int
    num_chunks: int


@dataclass(frozen=True)
class TransferAck:
    """D is done with a ticket: ``ok`` after a complete pull, else why it gave up (also when it
    never sent the PullRequest). ``lease_gen`` is the ticket's: P releases only that lease."""

    request_id: str
    pull_id: int
    ok: bool
    error: str
    lease_gen: int


@dataclass(frozen=True)
class ReadDone:
    """D read a lease's pages directly (or gave up): P may release them. ``lease_gen`` names the
    lease, so a late one cannot release a later lease of the same request id."""

    request_id: str
    lease_gen: int
    ok: bool
    error: str
    total_bytes: int
    micros: int  # the pull as D timed it
    data_path: str  # "cuda_ipc", "host_shm" or "local"


@dataclass(frozen=True)
class Reject:
    request_id: str  # "" when the rejected message named none
    reason: str


Message = (
    Hello
    | HelloReply
    | PullRequest
    | ChunkReady
    | PullError
    | TransferDone
    | TransferAck
    | ReadDone
    | Reject
)
MESSAGE_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        Hello,
        HelloReply,
        PullRequest,
        ChunkReady,
        PullError,
        TransferDone,
        TransferAck,
        ReadDone,
        Reject,
    )
}
_HINTS: dict[type, dict[str, Any]] = {
    cls: typing.get_type_hints(cls) for cls in MESSAGE_TYPES.values()
}


def data_tag(pull_id: int, chunk_index: int) -> int:
    """The 64-bit UCX tag of one data chunk: distinct for every chunk of a pull, and scoped to the
    pull by D's random ``pull_id`` so concurrent transfers never match each other's chunks."""
    x = (pull_id ^ (chunk_index * 0x9E3779B97F4A7C15)) & _MASK64
    return (x * 0xBF58476D1CE4E5B9) & _MASK64


def encode_message(msg: Message) -> bytes:
    body = {}
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        body[f.name] = value.to_wire() if isinstance(value, PageTable) else value
    return msgpack.packb(
        {"v": PROTOCOL_VERSION, "type": type(msg).__name__, "body": body}, use_bin_type=True
    )


def decode_message(data: bytes) -> Message:
    """Decode one frame. Raises TransferProtocolError (and nothing else) for anything malformed."""
    try:
        envelope = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise TransferProtocolError(f"not a msgpack message ({type(e).__name__}: {e})") from None
    if not isinstance(envelope, dict) or set(envelope) != {"v", "type", "body"}:
        raise TransferProtocolError("expected a map with keys 'v', 'type' and 'body'")
    body = envelope["body"]
    request_id = body.get("request_id") if isinstance(body, dict) else None
    pull_id = body.get("pull_id") if isinstance(body, dict) else None
    hint = {
        "request_id": request_id if isinstance(request_id, str) else None,
        "pull_id": pull_id if _is_int(pull_id) else None,
    }
    version = envelope["v"]
    if version != PROTOCOL_VERSION or not _is_int(version):
        raise TransferProtocolError(
            f"unsupported protocol version {_describe(version)}, expected {PROTOCOL_VERSION}",
            **hint,
        )
    cls = MESSAGE_TYPES.get(envelope["type"]) if isinstance(envelope["type"], str) else None
    if cls is None:
        raise TransferProtocolError(f"unknown message type {_describe(envelope['type'])}", **hint)
    if not isinstance(body, dict) or set(body) != set(_HINTS[cls]):
        got = sorted(map(str, body)) if isinstance(body, dict) else type(body).__name__
        raise TransferProtocolError(
            f"{cls.__name__}: expected fields {sorted(_HINTS[cls])}, got {got}", **hint
        )
    values = {}
    for name, kind in _HINTS[cls].items():
        try:
            values[name] = _check(body[name], kind)
        except (TypeError, ValueError) as e:
            raise TransferProtocolError(f"{cls.__name__}.{name}: {e}", **hint) from None
    return cls(**values)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(value: Any, kind: Any) -> Any:
    """Return ``value`` (converted where the wire form differs) if it has type ``kind``."""
    if kind is PageTable:
        return PageTable.from_wire(value)
    if kind is int:
        if not _is_int(value) or not 0 <= value <= _INT64_MAX:
            raise TypeError(f"expected a non-negative int64, got {_describe(value)}")
        return value
    if kind in (str, bool, bytes):
        if type(value) is not kind:
            raise TypeError(f"expected {kind.__name__}, got {_describe(value)}")
        return value
    if kind == list[int]:
        # No Python-level loop (map/set/min/max run in C): page lists run to thousands of ints.
        # type() is int, not isinstance: a bool is not a page id.
        if not isinstance(value, list) or (value and set(map(type, value)) != {int}):
            raise TypeError(f"expected a list of ints, got {_describe(value)}")
        if value and (min(value) < 0 or max(value) > _INT64_MAX):
            raise TypeError(f"expected non-negative int64 values, got {_describe(value)}")
        return value
    if kind == dict[str, list[int]]:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise TypeError(f"expected a map of string to list of ints, got {_describe(value)}")
        return {k: _check(v, list[int]) for k, v in value.items()}
    raise TypeError(f"no wire rule for {kind}")  # a bug in this module, not in the peer


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"
