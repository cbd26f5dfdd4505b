"""The handshake that makes a Link: authentication first, then page tables, addresses and pools.

    D -> P  Hello(D's instance, nonce_d)
    P -> D  Challenge(P's instance, nonce_p, proof "P" over the transcript)
            D checks P's proof before it says anything about itself
    D -> P  Join(proof "D" over the transcript, D's page table, D's UCX address)
            P checks the Join's MAC and D's proof, then the compatibility hash and the address
    P -> D  Welcome(P's page table, UCX address, pool export) or Refused(reason)
    D -> P  Ready(the data path D chose: it opened P's pools, or "ucx")

The transcript is both instance ids and both fresh nonces (``transcript``); a proof is an HMAC of
the secret over it with the role in front, so neither can be replayed, reflected, or spliced onto
a connection to another member of the cluster under a changed instance id. From the Join on,
every frame carries a MAC under a key of the link derived from the same transcript
(frame_seal.py): D seals once P has proven the secret, P opens the Join with it and seals once
D's proof checks. A Join that fails ends the connection with nothing more said.

P proves itself to whoever says Hello, so a peer without the secret can test guesses of it
offline against P's proof: the cluster config refuses secrets under 32 characters, and a Hello
nonce must be NONCE_BYTES long (a peer's choice of an empty one would make P prove over its own
nonce alone). Until the peer has proven the secret, its frames are capped at
HANDSHAKE_FRAME_BYTES (control.py). A peer without the cluster secret gets nothing but the
Challenge; each refusal is counted (``refused_peers``) and ends the connection, and serving goes
on.

What this does not do: encrypt (an eavesdropper on the network reads every frame: page tables,
UCX addresses, pool exports, request ids); protect the KV bytes on the data path (UCX payloads
carry no MAC: someone on the data network's path who sees a tag can change the bytes); tell
cluster members apart (every holder of the secret can derive any link's keys from the nonces it
overhears); or keep a link up against someone in the middle (one forged frame closes the link
and fails its pulls; the peer reconnects for the next). Between hosts on an untrusted network,
run the cluster inside a VPN or an encrypted overlay.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import TypeVar

from transfer.control import MAX_FRAME_BYTES, ControlChannel
from transfer.frame_seal import FrameSeal, link_key
from transfer.link import Link
from transfer.mapper import MapperError, match_pools
from transfer.messages import Challenge, Hello, Join, Message, Ready, Refused, Welcome
from transfer.page_table import PageTable
from transfer.paths.base import DataPath
from transfer.runtime import UcxRuntime
from transfer.stats import TransferCounters
from transfer.tp_mapper import HEAD_MAJOR

log = logging.getLogger(__name__)

NONCE_BYTES = 32
T = TypeVar("T")


class PeerRefused(ConnectionError):
    """The peer cannot be used: it failed authentication, serves another model, or broke the
    handshake."""


def transcript(d_instance: str, nonce_d: bytes, p_instance: str, nonce_p: bytes) -> bytes:
    """What both proofs and the link's keys cover: each side's instance id and nonce, each
    length-prefixed (so no two transcripts read alike). With the instance ids in, a man in the
    middle cannot splice D's connection to one prefill worker onto another member of the cluster
    and rename it (D would file that worker's link, and send its pulls, under the first's id)."""
    parts = (d_instance.encode(), nonce_d, p_instance.encode(), nonce_p)
    return b"".join(len(part).to_bytes(4, "big") + part for part in parts)


def proof(secret: bytes, role: bytes, said: bytes) -> bytes:
    """``role``'s proof of the secret over the handshake's ``transcript``."""
    return hmac.new(secret, b"duet proof " + role + b"\0" + said, hashlib.sha256).digest()


def _proven(secret: bytes, role: bytes, said: bytes, given: bytes) -> bool:
    return hmac.compare_digest(proof(secret, role, said), given)


async def connect(
    runtime: UcxRuntime,
    host: str,
    port: int,
    secret: bytes,
    instance_id: str,
    own: PageTable,
    timeout: float,
    counters: TransferCounters,
    choose_path: Callable[[bytes, PageTable], Awaitable[DataPath]],
) -> Link:
    """D side: a link to the prefill worker at ``host:port`` within ``timeout`` in all;
    ``choose_path`` opens P's pool export (or picks UCX). Raises PeerRefused, or OSError /
    TimeoutError when P cannot be reached."""
    name = f"link to {host}:{port}"
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(host, port)
        channel = ControlChannel(reader, writer, name, counters)
        endpoint = None
        try:
            nonce = secrets.token_bytes(NONCE_BYTES)
            await channel.send(Hello(instance_id, nonce), timeout)
            challenge = _expect(await channel.receive(timeout), Challenge)
            said = transcript(instance_id, nonce, challenge.instance_id, challenge.nonce)
            if len(challenge.nonce) != NONCE_BYTES or not _proven(
                secret, b"P", said, challenge.proof
            ):
                counters.refused_peers += 1
                raise PeerRefused(f"{name}: the peer did not prove the cluster secret")
            channel.max_frame_bytes = MAX_FRAME_BYTES
            channel.seal_sends = channel.open_receives = FrameSeal(
                link_key(secret, b"control", said), sends=b"D", receives=b"P"
            )
            mine = proof(secret, b"D", said)
            await channel.send(Join(mine, own, runtime.worker_address), timeout)
            welcome = _expect(await channel.receive(timeout), Welcome)
            problem = check_compatible(own, welcome.page_table) or ucx_address_problem(
                welcome.ucx_address
            )
            if problem:
                counters.refused_peers += 1
                raise PeerRefused(f"{name}: {problem}")
            endpoint = await _endpoint(runtime, welcome.ucx_address, name)
            path = await choose_path(welcome.pool_export, welcome.page_table)
            await channel.send(Ready(path.name), timeout)
        except BaseException:
            channel.close("handshake failed")
            if endpoint is not None:
                endpoint.abort()
            raise
    tags = link_key(secret, b"tags", said)
    return Link(
        channel, endpoint, challenge.instance_id, welcome.page_table, path, name, tags,
        runtime.messages,
    )  # fmt: skip


async def accept(
    runtime: UcxRuntime,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    secret: bytes,
    instance_id: str,
    own: PageTable,
    pool_export: bytes,
    timeout: float,
    counters: TransferCounters,
    path_for: Callable[[str], DataPath | None],
) -> Link | None:
    """P side: authenticate the peer, then welcome it. None (the refusal counted and the connection
    closed) for a peer that fails authentication or anything after it."""
    name = f"link from {writer.get_extra_info('peername')}"
    channel = ControlChannel(reader, writer, name, counters)
    endpoint = None
    try:
        async with asyncio.timeout(timeout):
            hello = _expect(await channel.receive(timeout), Hello)
            if len(hello.nonce) != NONCE_BYTES:  # (a chosen short one eases guessing offline)
                raise PeerRefused(f"a Hello nonce of {len(hello.nonce)} bytes, not {NONCE_BYTES}")
            nonce = secrets.token_bytes(NONCE_BYTES)
            said = transcript(hello.instance_id, hello.nonce, instance_id, nonce)
            mine = proof(secret, b"P", said)
            await channel.send(Challenge(instance_id, nonce, mine), timeout)
            seal = FrameSeal(link_key(secret, b"control", said), b"P", b"D")
            channel.open_receives = seal
            join = _expect(await channel.receive(timeout), Join)
            if not _proven(secret, b"D", said, join.proof):
                raise PeerRefused("the peer did not prove the cluster secret")
            channel.max_frame_bytes = MAX_FRAME_BYTES
            channel.seal_sends = seal
            problem = check_compatible(own, join.page_table) or ucx_address_problem(
                join.ucx_address
            )
            if problem:
                await _refuse(channel, problem, timeout)
                raise PeerRefused(problem)
            try:
                endpoint = await _endpoint(runtime, join.ucx_address, name)
            except PeerRefused as e:
                await _refuse(channel, str(e), timeout)
                raise
            await channel.send(Welcome(own, runtime.worker_address, pool_export), timeout)
            ready = _expect(await channel.receive(timeout), Ready)
            path = path_for(ready.path)
            if path is None:
                raise PeerRefused(f"the peer chose data path {ready.path!r}, which we do not offer")
    except Exception as e:  # refused, malformed, silent, or gone: no link, serving goes on
        counters.refused_peers += 1
        log.warning("%s: handshake refused or failed: %r", name, e)
        channel.close(f"handshake failed: {e!r}")
        if endpoint is not None:
            endpoint.abort()
        return None
    tags = link_key(secret, b"tags", said)
    return Link(
        channel, endpoint, hello.instance_id, join.page_table, path, name, tags, runtime.messages
    )


def _expect(msg: Message, kind: type[T]) -> T:
    if isinstance(msg, Refused):
        raise PeerRefused(f"peer refused us: {msg.reason}")
    if not isinstance(msg, kind):
        raise PeerRefused(f"expected {kind.__name__}, got {type(msg).__name__}")
    return msg


async def _refuse(channel: ControlChannel, reason: str, timeout: float) -> None:
    try:
        await channel.send(Refused(reason), timeout)
    except ConnectionError:
        pass


async def _endpoint(runtime: UcxRuntime, address: bytes, name: str) -> object:
    try:
        return await runtime.create_endpoint(address)
    except (TimeoutError, ConnectionError):
        raise
    except Exception as e:  # ucxx's own errors: an address UCX could not use
        raise PeerRefused(f"{name}: UCX endpoint to the peer failed: {e!r}") from None


def check_compatible(ours: PageTable, theirs: PageTable) -> str:
    """ "" if the two tables may exchange KV, else the reason they may not."""
    if ours.compat_hash != theirs.compat_hash:
        return (
            f"compatibility hash mismatch: ours {ours.compat_hash} (model {ours.model!r}), "
            f"peer {theirs.compat_hash} (model {theirs.model!r})"
            + _window_differences(ours, theirs)
        )
    # Head-major pools of ranks holding other heads are matched by role; each pull's mapper then
    # checks the heads it moves (transfer/tp_mapper.py).
    resplit = all(p.mapper_kind in HEAD_MAJOR for p in (*ours.pools, *theirs.pools))
    try:  # (equal hashes, and still no pull could map: two pools with the same roles, say)
        match_pools(ours, theirs, resplit)
        match_pools(theirs, ours, resplit)
    except MapperError as e:
        return f"the page tables cannot be mapped onto each other: {e}"
    return ""


def _window_differences(ours: PageTable, theirs: PageTable) -> str:
    """The pool groups whose sliding windows differ, for the refusal's text (the likeliest cause
    between two builds of one model: a window setting that differs), or ""."""
    mine = {p.name: p.window for p in ours.pools}
    other = {p.name: p.window for p in theirs.pools}
    names = sorted(set(mine) | set(other))
    diff = [
        f"{g!r}: ours {_window(mine.get(g))}, peer's {_window(other.get(g))}"
        for g in names
        if mine.get(g) != other.get(g)
    ]
    return f"; sliding windows differ: {', '.join(diff)}" if diff else ""


def _window(window: int | None) -> str:
    if window is None:
        return "absent"
    return f"window {window}" if window else "full attention"


_UCX_ADDRESS_MIN_BYTES = 9  # the header byte and the 64-bit worker id that follows it
_UCX_ADDRESS_FORMATS = frozenset({0, 1})  # ucp/wireup/address.c: v1 and v2


def ucx_address_problem(theirs: bytes) -> str:
    """Why a peer's UCX worker address must not be handed to UCX, or "". UCX parses it on trust and
    aborts the whole process on a header it does not expect (an assertion, not an error): the low
    4 bits of the first byte are the address format, v1 (0) or v2 (1)."""
    if len(theirs) < _UCX_ADDRESS_MIN_BYTES:
        return f"the peer's UCX worker address is {len(theirs)} bytes, too short to be one"
    if theirs[0] & 0x0F not in _UCX_ADDRESS_FORMATS:
        return (
            f"the peer's UCX worker address has format {theirs[0] & 0x0F}, which UCX does not read"
        )
    return ""
