"""Failures that must end in a clear error within their deadline, leak no page, and leave the next
transfer working: lease expiry, another compatibility hash, malformed messages (to P and from P),
and a prefill worker restarting on the same port."""

from __future__ import annotations

import dataclasses
import socket
import struct
import threading
import time
from collections.abc import Iterator

import msgpack
import pytest
import torch

from tests.transfer.conftest import MODEL, UCX_ENV, KVSide, config, specs
from tests.transfer.test_transfer_local import Pair, checked_pair, wait_until
from transfer import KVReceiver, KVSender
from transfer.messages import Hello, HelloReply, PullRequest, Reject, decode_message, encode_message
from transfer.runtime import UcxRuntime
from transfer.version import PROTOCOL_VERSION

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pair() -> Iterator[Pair]:
    made = Pair(config(lease_s=0.4))
    yield made
    made.close()
    made.p.assert_clean()
    made.d.assert_clean()


def pull_next_ok(pair: Pair, rid: str) -> None:
    ticket, src = pair.publish(rid, 8)
    dst = pair.d.allocate(rid, 8)
    result = pair.receiver.pull_blocking(ticket, dst, 0, 8)
    assert result.ok, result.error
    assert torch.equal(pair.d.pages_of(dst)["full"], pair.p.pages_of(src)["full"])
    pair.d.free(rid)
    wait_until(lambda: rid in pair.p.released)


def test_lease_expiry_frees_pages_and_a_late_pull_says_expired(pair: Pair) -> None:
    ticket, _ = pair.publish("late", 12)
    wait_until(lambda: pair.p.released == ["late"], timeout=5.0)
    assert pair.sender.stats()["expired_leases"] == 1
    dst = pair.d.allocate("late", 12)
    result = pair.receiver.pull_blocking(ticket, dst, 0, 12)
    assert not result.ok
    assert "(expired)" in result.error and "expired before a pull" in result.error
    pair.d.free("late")
    pull_next_ok(pair, "after-late")
    # P completed the receives D had posted, so the refusal did not cost the link.
    assert pair.receiver.stats()["reconnects"] == 0


def test_ticket_with_another_compat_hash_fails_at_once(pair: Pair) -> None:
    other = KVSide(specs(head_dim=16), seed=3)
    sender = KVSender(other.kv.buffers, other.specs, MODEL, config(lease_s=0.4), other.release)
    try:
        pages = other.allocate("foreign", 8)
        ticket = sender.publish("foreign", pages, 8)
        dst = pair.d.allocate("foreign", 8)
        result = pair.receiver.pull_blocking(ticket, dst, 0, 8)
        assert not result.ok and "compatibility hash mismatch" in result.error
        pair.d.free("foreign")
        wait_until(lambda: other.released == ["foreign"], timeout=5.0)  # P's lease expires
    finally:
        sender.close()
    other.assert_clean()
    pull_next_ok(pair, "after-foreign")


def test_peer_with_another_compat_hash_is_refused_in_the_handshake(pair: Pair) -> None:
    other = KVSide(specs(), seed=4)
    sender = KVSender(
        other.kv.buffers, other.specs, "another-model", config(lease_s=0.4), other.release
    )
    try:
        pages = other.allocate("forged", 8)
        ticket = sender.publish("forged", pages, 8)
        # A ticket whose hash was rewritten on the way: the handshake still catches it.
        ticket = dataclasses.replace(ticket, compat_hash=pair.receiver.page_table.compat_hash)
        dst = pair.d.allocate("forged", 8)
        result = pair.receiver.pull_blocking(ticket, dst, 0, 8)
        assert not result.ok
        assert (
            "peer refused us: compatibility hash mismatch" in result.error
            and "another-model" in result.error
        )
        assert sender.stats()["refused_peers"] == 1 and pair.receiver.stats()["refused_peers"] == 1
        pair.d.free("forged")
        wait_until(lambda: other.released == ["forged"], timeout=5.0)
    finally:
        sender.close()
    other.assert_clean()


def frame(payload: bytes) -> bytes:
    return struct.pack("!I", len(payload)) + payload


def read_frame(sock: socket.socket) -> bytes:
    header = sock.recv(4, socket.MSG_WAITALL)
    (size,) = struct.unpack("!I", header)
    return sock.recv(size, socket.MSG_WAITALL)


def test_malformed_messages_to_p_are_rejected_and_the_connection_stays_usable(pair: Pair) -> None:
    bad_version = msgpack.packb({"v": 99, "type": "Hello", "body": {}})
    wrong_type = msgpack.packb(
        {
            "v": PROTOCOL_VERSION,
            "type": "PullRequest",
            "body": {"request_id": "x", "pull_id": "not an int"},
        }
    )
    with socket.create_connection((pair.sender.host, pair.sender.port), timeout=5) as sock:
        for payload, reason in [
            (b"\xc1 definitely not msgpack", "not a msgpack message"),
            (bad_version, f"unsupported protocol version int 99, expected {PROTOCOL_VERSION}"),
            (wrong_type, "PullRequest: expected fields"),
        ]:
            sock.sendall(frame(payload))
            reply = decode_message(read_frame(sock))
            assert isinstance(reply, Reject) and reason in reply.reason
        runtime = UcxRuntime.acquire(UCX_ENV)
        hello = Hello("raw-client", pair.receiver.page_table, runtime.worker_address, 1 << 20)
        runtime.release()
        sock.sendall(frame(encode_message(hello)))
        reply = decode_message(read_frame(sock))
        assert isinstance(reply, HelloReply) and reply.error == ""
    assert pair.sender.stats()["rejected_messages"] == 3
    pull_next_ok(pair, "after-malformed")


def test_malformed_transfer_done_from_p_fails_the_pull_at_once(pair: Pair) -> None:
    """A rogue prefill worker answers the pull with a TransferDone whose length is a string."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    runtime = UcxRuntime.acquire(UCX_ENV)
    seen: list[object] = []

    def rogue() -> None:
        conn, _ = server.accept()
        with conn:
            hello = decode_message(read_frame(conn))
            assert isinstance(hello, Hello)
            conn.sendall(
                frame(
                    encode_message(
                        HelloReply(
                            "rogue",
                            pair.receiver.page_table,
                            runtime.worker_address,
                            hello.chunk_bytes,
                            "",
                            b"",
                            "",
                        )
                    )
                )
            )
            req = decode_message(read_frame(conn))
            assert isinstance(req, PullRequest)
            body = {
                "request_id": req.request_id,
                "pull_id": req.pull_id,
                "declared_prompt_len": "eight",
                "total_bytes": 0,
                "num_chunks": 0,
            }
            conn.sendall(
                frame(msgpack.packb({"v": PROTOCOL_VERSION, "type": "TransferDone", "body": body}))
            )
            seen.append(decode_message(read_frame(conn)))  # D's Reject
            seen.append(decode_message(read_frame(conn)))  # D's negative ack

    thread = threading.Thread(target=rogue, daemon=True)
    thread.start()
    try:
        ticket, _ = pair.publish("rogue-req", 8)
        forged = dataclasses.replace(ticket, port=port, instance_id="rogue")
        dst = pair.d.allocate("rogue-req", 8)
        started = time.monotonic()
        result = pair.receiver.pull_blocking(forged, dst, 0, 8)
        assert not result.ok
        assert (
            "malformed message: TransferDone.declared_prompt_len: expected a non-negative int64"
            in result.error
        )
        assert (
            time.monotonic() - started < pair.receiver.config.pull_deadline_s
        )  # no deadline needed
        thread.join(timeout=10)
        assert isinstance(seen[0], Reject) and "TransferDone.declared_prompt_len" in seen[0].reason
        assert pair.receiver.stats()["rejected_messages"] == 1
        pair.d.free("rogue-req")
        assert pair.sender.cancel("rogue-req")
    finally:
        runtime.release()
        server.close()
    pull_next_ok(pair, "after-rogue")


def test_prefill_worker_restart_on_the_same_port() -> None:
    p, d = KVSide(specs(), seed=5), KVSide(specs(), seed=6)
    receiver = KVReceiver(d.kv.buffers, d.specs, MODEL, config())
    first = KVSender(p.kv.buffers, p.specs, MODEL, config(), p.release)
    port = first.port
    try:
        ticket = first.publish("before", p.allocate("before", 8), 8)
        assert receiver.pull_blocking(ticket, d.allocate("before", 8), 0, 8).ok
        d.free("before")
        stale = first.publish("stale", p.allocate("stale", 8), 8)
        first.close()  # releases "stale" too: its pages are gone with the old instance
        second = KVSender(p.kv.buffers, p.specs, MODEL, config(port=port), p.release)
        try:
            result = receiver.pull_blocking(stale, d.allocate("stale", 8), 0, 8)
            assert not result.ok and "stale ticket" in result.error
            d.free("stale")
            ticket = second.publish("after", p.allocate("after", 8), 8)
            dst = d.allocate("after", 8)
            assert receiver.pull_blocking(ticket, dst, 0, 8).ok
            assert torch.equal(d.pages_of(dst)["full"], p.pages_of(ticket.page_ids)["full"])
            d.free("after")
            wait_until(lambda: "after" in p.released)
        finally:
            second.close()
    finally:
        receiver.close()
    assert sorted(p.released) == ["after", "before", "stale"]
    p.assert_clean()
    d.assert_clean()


@pytest.mark.parametrize(
    "address, refused",
    [
        (b"\xff", "too short"),  # UCX would abort the process on this header (an assertion)
        (b"\xff" * 64, "has format 15"),
        (b"\x00" * 64, ""),  # a header UCX reads, then fails to use: an error, not a crash
    ],
)
def test_a_hello_with_a_bad_ucx_address_is_refused_and_p_lives_on(
    pair: Pair, address: bytes, refused: str
) -> None:
    hello = Hello("hostile", pair.receiver.page_table, address, 1 << 20)
    with socket.create_connection((pair.sender.host, pair.sender.port), timeout=5) as sock:
        sock.settimeout(10)
        sock.sendall(frame(encode_message(hello)))
        if refused:
            reply = decode_message(read_frame(sock))
            assert isinstance(reply, HelloReply) and refused in reply.error
        else:  # P closes the connection without a link
            assert sock.recv(4, socket.MSG_WAITALL) == b""
    assert pair.sender.stats()["peers"] == 0
    pull_next_ok(pair, "after-bad-address")


def test_a_stale_ticket_fails_alone_and_leaves_the_open_link_up(pair: Pair) -> None:
    """After a prefill worker restarts, the router may still hold tickets of the old instance.
    Such a ticket fails as stale; the open link to the current instance, which reads in flight
    may be using, stays up."""
    pull_next_ok(pair, "first")
    (link,) = pair.receiver.links.open.values()
    ticket, _ = pair.publish("old", 8)
    stale = dataclasses.replace(ticket, instance_id="instance-before-restart")
    result = pair.receiver.pull_blocking(stale, pair.d.allocate("old", 8), 0, 8)
    assert not result.ok and "stale ticket" in result.error
    pair.d.free("old")
    assert not link.closed and pair.receiver.stats()["reconnects"] == 0
    assert pair.sender.cancel("old")
    pull_next_ok(pair, "after-stale")
    assert pair.receiver.links.open[(pair.sender.host, pair.sender.port)] is link


def test_stale_tickets_of_one_instance_cost_one_probe(pair: Pair, monkeypatch) -> None:
    """A router may hold many tickets of a restarted worker: the first one's probe finds the open
    link's instance at the address, and the others fail without another handshake."""
    pull_next_ok(pair, "first")
    connects = []
    real_connect = pair.receiver.links.connect

    async def counted(ticket, direct=True):
        connects.append(direct)
        return await real_connect(ticket, direct)

    monkeypatch.setattr(pair.receiver.links, "connect", counted)
    for i in range(3):
        ticket, _ = pair.publish(f"old{i}", 8)
        stale = dataclasses.replace(ticket, instance_id="instance-before-restart")
        result = pair.receiver.pull_blocking(stale, pair.d.allocate(f"old{i}", 8), 0, 8)
        assert not result.ok and "stale ticket" in result.error
        pair.d.free(f"old{i}")
        assert pair.sender.cancel(f"old{i}")
    assert connects == [False]  # one bare probe, no pools opened
    pull_next_ok(pair, "after-stale")


def test_a_refused_pull_leaves_the_request_for_its_right_ticket(pair: Pair) -> None:
    """P refuses a ticket whose pages differ from the published ones (a stale or forged ticket
    of that request id): it has nothing to give back for it, so D sends no negative ack, which
    could only find the lease by request id and end the right ticket's lease."""
    pull_next_ok(pair, "first")
    ticket, src = pair.publish("r", 8)
    forged = dataclasses.replace(ticket, page_ids={"full": list(reversed(src["full"]))})
    refused_then_right(pair, forged, ticket, src, "differ from the published ones")
    wait_until(lambda: pair.p.released[-1:] == ["r"])
    pair.d.free("r")


def refused_then_right(pair: Pair, bad, ticket, src, why: str) -> None:
    """``bad`` (a ticket of request "r") is refused for ``why``; then ``ticket``, the right one,
    pulls "r" exactly into the same pages of D."""
    dst = pair.d.allocate("r", 8)
    result = pair.receiver.pull_blocking(bad, dst, 0, 8)
    assert not result.ok and why in result.error
    result = pair.receiver.pull_blocking(ticket, dst, 0, 8)
    assert result.ok, result.error
    assert torch.equal(pair.d.pages_of(dst)["full"], pair.p.pages_of(src)["full"])


def test_a_ticket_of_an_ended_lease_is_refused_once_the_request_is_published_again() -> None:
    """A request published again (a cached prefix may give it the very same pages) has a lease of
    another generation. P refuses the old ticket instead of serving the new lease to it: that
    pull's ack would name the old lease and go unheard, and the new lease would stay pinned (its
    own ticket refused as busy) until the ack deadline."""
    with checked_pair(config(lease_s=30.0, ack_deadline_s=30.0)) as pair:
        pull_next_ok(pair, "first")
        old, _ = pair.publish("r", 8)
        assert pair.sender.cancel("r")
        ticket, src = pair.publish("r", 8)
        stale = dataclasses.replace(ticket, lease_gen=old.lease_gen)  # the old ticket's lease
        refused_then_right(pair, stale, ticket, src, "published again since")
        wait_until(lambda: pair.p.released.count("r") == 2)  # cancelled, then acked
        assert pair.sender.stats()["expired_leases"] == 0
        pair.d.free("r")
