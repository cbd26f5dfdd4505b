"""The handshake: a peer must prove the cluster secret before it sees a page table, an address or
a pool export; every refusal is counted and serving goes on. Also: another compatibility hash,
a UCX address UCX would crash on, and garbage in place of a handshake."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest

from tests.transfer.conftest import MODEL, SECRET, KVSide, Pair, checked_pair, config, specs
from tests.transfer.raw_peer import RawPeer
from transfer import KVReceiver, KVSender
from transfer.control import frame, frame_bytes
from transfer.frame_seal import MAC_BYTES, FrameSeal, link_key
from transfer.handshake import proof, transcript
from transfer.messages import Challenge, Hello, Join, Refused, Welcome

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("secret", [b"", b"not-the-cluster-secret"])
def test_a_peer_without_the_secret_gets_no_page_table_and_no_pages(
    pair: Pair, ucx_runtime, secret: bytes
) -> None:
    """Right compatibility hash, no secret: P closes the connection on the Join (its MAC and proof
    fail), sends nothing about itself, and no pull can follow; the refusal is counted and a real
    decode worker still pulls."""
    ticket, _ = pair.publish("secret", 8)
    peer = RawPeer(pair.sender.host, pair.sender.port)
    try:
        answer = peer.handshake(secret, pair.receiver.page_table, ucx_runtime.worker_address)
        assert answer is None and peer.closed_by_peer()
        # P sent the Challenge and nothing else: nothing that names its model, pools, UCX
        # address or pool files.
        assert [type(m).__name__ for m in map(_decode, peer.received)] == ["Challenge"]
        assert not any(MODEL.encode() in data for data in peer.received)
    finally:
        peer.close()
    assert pair.sender.stats()["refused_peers"] == 1 and pair.sender.stats()["peers"] == 0
    dst = pair.d.allocate("secret", 8)
    assert pair.receiver.pull_blocking(ticket, dst, 0, 8).ok  # the ticket still works for D
    pair.d.free("secret")


def _decode(data: bytes):  # noqa: ANN202
    from transfer.messages import decode_message

    return decode_message(data)


def test_the_right_secret_is_welcomed(pair: Pair, ucx_runtime) -> None:
    peer = RawPeer(pair.sender.host, pair.sender.port)
    try:
        answer = peer.handshake(
            SECRET.encode(), pair.receiver.page_table, ucx_runtime.worker_address
        )
        assert isinstance(answer, Welcome) and answer.page_table == pair.sender.page_table
    finally:
        peer.close()


def test_a_replayed_join_is_refused(pair: Pair, ucx_runtime) -> None:
    """A Join seen on one connection (its proof and its MAC) does not open another: P's nonce is
    fresh each time."""
    first = RawPeer(pair.sender.host, pair.sender.port)
    first.send(Hello("eavesdropped", b"n" * 32))
    challenge = first.recv()
    assert isinstance(challenge, Challenge)
    said = transcript("eavesdropped", b"n" * 32, challenge.instance_id, challenge.nonce)
    seal = FrameSeal(link_key(SECRET.encode(), b"control", said), b"D", b"P")
    stolen = proof(SECRET.encode(), b"D", said)
    sealed_join = frame(Join(stolen, pair.receiver.page_table, ucx_runtime.worker_address), seal)
    first.close()
    second = RawPeer(pair.sender.host, pair.sender.port)
    try:
        second.send(Hello("eavesdropped", b"n" * 32))
        assert isinstance(second.recv(), Challenge)
        second.sock.sendall(sealed_join)
        assert second.closed_by_peer()
    finally:
        second.close()
    assert pair.sender.stats()["refused_peers"] == 2  # (the first never finished either)


def test_a_join_changed_in_transit_is_refused(pair: Pair, ucx_runtime) -> None:
    """Someone between D and P lets the proofs through and swaps D's UCX address in the Join for
    their own (P would send them the prompt's KV): the Join's MAC no longer checks, P sends
    nothing more and closes the connection."""
    peer = RawPeer(pair.sender.host, pair.sender.port)
    try:
        peer.send(Hello("d", b"n" * 32))
        challenge = peer.recv()
        assert isinstance(challenge, Challenge)
        secret = SECRET.encode()
        said = transcript("d", b"n" * 32, challenge.instance_id, challenge.nonce)
        seal = FrameSeal(link_key(secret, b"control", said), b"D", b"P")
        mine = proof(secret, b"D", said)
        honest = frame(Join(mine, pair.receiver.page_table, ucx_runtime.worker_address), seal)
        theirs = bytearray(ucx_runtime.worker_address)
        theirs[-1] ^= 1
        swapped = frame(Join(mine, pair.receiver.page_table, bytes(theirs)))
        mac = honest[-MAC_BYTES:]
        peer.sock.sendall(frame_bytes(swapped[4:] + mac))
        assert peer.closed_by_peer()  # (nothing sent first: a Welcome would be a byte here)
    finally:
        peer.close()
    assert pair.sender.stats()["refused_peers"] == 1 and pair.sender.stats()["peers"] == 0
    pair.pull_ok("after")
    pair.pull_ok("after")


@pytest.mark.parametrize("path", ["ucx", "host_shm"])
def test_a_prefill_worker_with_another_secret_is_refused_by_d(path: str) -> None:
    with checked_pair(path) as made:
        other = KVSide(specs(), seed=4)
        rogue = KVSender(
            other.kv.buffers, other.specs, MODEL, config(path, secret="wrong"), other.release
        )
        try:
            ticket = rogue.publish("r", other.allocate("r", 8), 8)
            dst = made.d.allocate("r", 8)
            result = made.receiver.pull_blocking(ticket, dst, 0, 8)
            assert not result.ok and "did not prove the cluster secret" in result.error
            assert made.receiver.stats()["refused_peers"] == 1
            made.d.free("r")
            assert rogue.cancel("r")
        finally:
            rogue.close()
        other.assert_clean()
        made.pull_ok("after")


def test_a_prefill_worker_renamed_in_transit_is_refused_by_d(ucx_runtime) -> None:
    """Someone in the middle splices D's connection to one prefill worker onto another member of
    the cluster (it holds the secret and proves it) and renames it in the Challenge to the one D
    asked for: the proof covers the instance id it was made for, so D refuses the link (else D
    filed that worker under the other's id and sent it the other's pulls)."""
    import threading

    from tests.transfer.raw_peer import RawServer

    with checked_pair("ucx", pull_deadline_s=2.0) as pair:
        other = RawServer()

        def serve() -> None:
            with contextlib.suppress(ConnectionError):  # (D closes on the Challenge)
                other.accept(
                    SECRET.encode(), pair.sender.page_table, ucx_runtime.worker_address, "p1"
                )

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        try:
            ticket, _ = pair.publish("spliced", 8)
            renamed = dataclasses.replace(ticket, port=other.port, instance_id="p1")
            dst = pair.d.allocate("spliced", 8)
            result = pair.receiver.pull_blocking(renamed, dst, 0, 8)
            assert not result.ok and "did not prove the cluster secret" in result.error
            assert pair.receiver.stats()["refused_peers"] == 1
            pair.d.free("spliced")
            assert pair.sender.cancel("spliced")
        finally:
            # (D's close ends the serving thread: closed under its read, the socket raised
            # EBADF in it)
            server.join(10)
            other.close()


def test_a_peer_with_another_compat_hash_is_refused_in_the_handshake(pair: Pair) -> None:
    other = KVSide(specs(), seed=4)
    sender = KVSender(other.kv.buffers, other.specs, "another-model", config(), other.release)
    try:
        ticket = sender.publish("forged", other.allocate("forged", 8), 8)
        # A ticket whose hash was rewritten on the way: the handshake still catches it.
        ticket = dataclasses.replace(ticket, compat_hash=pair.receiver.page_table.compat_hash)
        dst = pair.d.allocate("forged", 8)
        result = pair.receiver.pull_blocking(ticket, dst, 0, 8)
        assert not result.ok
        assert "compatibility hash mismatch" in result.error and "another-model" in result.error
        assert sender.stats()["refused_peers"] == 1
        pair.d.free("forged")
        assert sender.cancel("forged")
    finally:
        sender.close()
    other.assert_clean()


@pytest.mark.parametrize(
    "address, refused",
    [
        (b"\xff", "too short"),  # UCX would abort the process on this header (an assertion)
        (b"\xff" * 64, "has format 15"),
        (b"\x00" * 64, "UCX endpoint to the peer failed"),  # read, then refused by UCX: an error
    ],
)
def test_a_bad_ucx_address_is_refused_and_p_lives_on(
    pair: Pair, address: bytes, refused: str
) -> None:
    peer = RawPeer(pair.sender.host, pair.sender.port)
    try:
        answer = peer.handshake(SECRET.encode(), pair.receiver.page_table, address)
        if isinstance(answer, Refused):
            assert refused in answer.reason
        assert peer.closed_by_peer()
    finally:
        peer.close()
    assert pair.sender.stats()["peers"] == 0 and pair.sender.stats()["refused_peers"] == 1
    pair.pull_ok("after")


@pytest.mark.parametrize("garbage", [b"\xc1 not msgpack", b"", b"\x00" * 100])
def test_garbage_instead_of_a_handshake_is_refused_and_counted(pair: Pair, garbage: bytes) -> None:
    peer = RawPeer(pair.sender.host, pair.sender.port)
    try:
        peer.send_raw(garbage)
        assert peer.closed_by_peer()
    finally:
        peer.close()
    assert pair.sender.stats()["refused_peers"] == 1
    pair.pull_ok("after")


def test_a_large_frame_before_the_secret_is_proven_is_not_read(pair: Pair, caplog) -> None:
    """Until a peer proves the secret its frames are capped (HANDSHAKE_FRAME_BYTES): a peer
    without it made P read and decode 16 MiB frames on the worker's loop (seconds, a GiB)."""
    import struct

    peer = RawPeer(pair.sender.host, pair.sender.port)
    try:
        peer.sock.sendall(struct.pack("!I", 1 << 20))  # a 1 MiB Hello announced, never sent
        assert peer.closed_by_peer() and peer.received == []
    finally:
        peer.close()
    assert "1048576-byte frame (limit 262144)" in caplog.text
    assert pair.sender.stats()["refused_peers"] == 1
    pair.pull_ok("after")


def test_a_hello_with_a_short_nonce_gets_no_proof(pair: Pair) -> None:
    """P's proof covers D's nonce: a peer choosing an empty one would get a proof over P's nonce
    alone to guess the secret against offline. Refused before the Challenge."""
    peer = RawPeer(pair.sender.host, pair.sender.port)
    try:
        peer.send(Hello("short", b""))
        assert peer.closed_by_peer() and peer.received == []
    finally:
        peer.close()
    assert pair.sender.stats()["refused_peers"] == 1


def test_a_receiver_needs_the_secret() -> None:
    with pytest.raises(ValueError, match="cluster's secret"):
        config(secret="")
    side = KVSide(specs(), seed=1)
    with pytest.raises(TypeError):
        KVReceiver(side.kv.buffers, side.specs, MODEL)  # type: ignore[call-arg]
