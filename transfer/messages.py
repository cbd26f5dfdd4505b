"""Every message of the KV transfer protocol, and the ticket the router carries from P to D.

Control messages travel as msgpack maps ``{"v": PROTOCOL_VERSION, "type": name, "body": {...}}`` in
length-prefixed frames (control.py). ``decode_message`` is strict: an unknown version or type, a
missing or extra field, or a field of the wrong type raises TransferProtocolError, and so does
anything that is not msgpack at all; nothing else ever escapes it.

Conversation (D = decode worker, which pulls; P = prefill worker, which serves):

  Handshake, once per link (handshake.py); nothing about either worker before both proved the
  cluster secret, and every frame from Join on carries a MAC (frame_seal.py):
    D -> P  Hello        D's instance id and a fresh nonce
    P -> D  Challenge    P's instance id, its nonce, and its proof over both nonces
    D -> P  Join         D's proof, then its page table and UCX worker address
    P -> D  Welcome      P's page table, UCX address and pool export (or Refused, and P closes)
    D -> P  Ready        the data path D chose for the link: "ucx", "host_shm" or "cuda_ipc"
  A pull (pull.py on D, serve.py on P):
    D -> P  PullRequest  the ticket's lease and pages, D's pages, the expected prompt length;
                         over UCX also D's chunk plan and the chunks D posted receives for
    P -> D  PullError    P refuses (after answering each credited chunk with an empty message)
    UCX path (paths/ucx.py):
      P -> D  data chunks   tag = frame_seal.data_tag(link key, pull_id, chunk), only chunks D credited
      D -> P  ChunkReady    more credits, as D's staging buffers free up
      P -> D  TransferDone  every chunk sent with its bytes, and the declared prompt length
    Direct paths (paths/direct.py):
      P -> D  ReadGrant     P holds the lease for the read: it cannot expire until D's notice
    D -> P  TransferAck   the final notice: ok, or why D failed; P releases the lease. Also sent
                          with pull_id 0 for a ticket D gave up before asking (P then ends that
                          lease if no pull has it).
    either  Reject        a message of the peer could not be decoded
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

import msgpack

from transfer.page_table import PageTable
from transfer.version import PROTOCOL_VERSION

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
    Ray actor boundaries. ``page_ids`` are the pages P holds per pool group, in token order, from
    the request's page ``first_page[g]`` to its last: a full-attention group all of them, a
    sliding-window group those its window still reads (groups list different numbers of pages);
    ``lease_gen`` names this lease of the request (a later publish of the same id has another);
    ``lease_expires_at`` is wall-clock time (time.time())."""

    request_id: str
    host: str
    port: int
    instance_id: str
    page_ids: dict[str, list[int]]
    first_page: dict[str, int]
    declared_prompt_len: int
    compat_hash: str
    lease_gen: int
    lease_expires_at: float
    # Tensor-parallel workers (either side): one pull per (decode rank, prefill rank) pair, each
    # under a lease of its own on that prefill rank (worker_common/tp_transfer.py); empty otherwise.
    parts: tuple[TicketPart, ...] = ()


@dataclass(frozen=True)
class TicketPart:
    """Decode rank ``decode_rank`` reads KV heads ``[head_start, head_start + head_count)`` of
    every page from the prefill rank that published ``ticket``."""

    decode_rank: int
    head_start: int
    head_count: int
    ticket: TransferTicket


@dataclass(frozen=True)
class Hello:
    instance_id: str
    nonce: bytes


@dataclass(frozen=True)
class Challenge:
    instance_id: str
    nonce: bytes
    proof: bytes


@dataclass(frozen=True)
class Join:
    proof: bytes
    page_table: PageTable
    ucx_address: bytes


@dataclass(frozen=True)
class Welcome:
    page_table: PageTable
    ucx_address: bytes
    pool_export: bytes  # paths.offer(): b"" when P offers no direct reads


@dataclass(frozen=True)
class Refused:
    reason: str


@dataclass(frozen=True)
class Ready:
    path: str


@dataclass(frozen=True)
class PullRequest:
    """``src_page_ids`` are the ticket's pages (P checks them against its lease); ``dst_page_ids[g]``
    are D's pages for ``src_page_ids[g][skip_pages[g]:]``. ``chunk_sizes`` (the bytes of each
    chunk, in order: whole pages, each within a staging buffer) and ``total_bytes`` are D's plan
    (P cuts the same chunks; a direct read has none); ``credits`` the chunks D already posted
    receives for."""

    request_id: str
    pull_id: int
    lease_gen: int
    src_page_ids: dict[str, list[int]]
    dst_page_ids: dict[str, list[int]]
    skip_pages: dict[str, int]
    expected_prompt_len: int
    chunk_sizes: list[int]
    total_bytes: int
    credits: list[int]


@dataclass(frozen=True)
class ChunkReady:
    request_id: str
    pull_id: int
    chunks: list[int]


@dataclass(frozen=True)
class PullError:
    """``code``: expired, unknown, busy, mismatch, or failed."""

    request_id: str
    pull_id: int
    code: str
    reason: str


@dataclass(frozen=True)
class TransferDone:
    request_id: str
    pull_id: int
    declared_prompt_len: int
    total_bytes: int
    num_chunks: int


@dataclass(frozen=True)
class ReadGrant:
    request_id: str
    pull_id: int
    declared_prompt_len: int


@dataclass(frozen=True)
class TransferAck:
    request_id: str
    pull_id: int
    lease_gen: int
    ok: bool
    error: str


@dataclass(frozen=True)
class Reject:
    request_id: str  # "" when the rejected message named none
    reason: str


Message = (
    Hello
    | Challenge
    | Join
    | Welcome
    | Refused
    | Ready
    | PullRequest
    | ChunkReady
    | PullError
    | TransferDone
    | ReadGrant
    | TransferAck
    | Reject
)
MESSAGE_TYPES: dict[str, type] = {cls.__name__: cls for cls in typing.get_args(Message)}
_HINTS: dict[type, dict[str, Any]] = {
    cls: typing.get_type_hints(cls) for cls in MESSAGE_TYPES.values()
}


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
        # type() is int, not isinstance: a bool is not a page id. (map/set/min/max run in C:
        # page lists run to thousands of ints.)
        if not isinstance(value, list) or (value and set(map(type, value)) != {int}):
            raise TypeError(f"expected a list of ints, got {_describe(value)}")
        if value and (min(value) < 0 or max(value) > _INT64_MAX):
            raise TypeError(f"expected non-negative int64 values, got {_describe(value)}")
        return value
    if kind in (dict[str, list[int]], dict[str, int]):
        inner = typing.get_args(kind)[1]
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise TypeError(f"expected a map of string to {inner}, got {_describe(value)}")
        return {k: _check(v, inner) for k, v in value.items()}
    raise TypeError(f"no wire rule for {kind}")  # a bug in this module, not in the peer


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"
