"""Failures that must end in a clear error within their deadline, leak no page, and leave the next
transfer working: lease expiry, another compatibility hash, malformed messages (to P and from P),
and a prefill worker restarting on the same port."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import struct
import threading
import time
from collections.abc import Iterator

import msgpack
import pytest
import torch

import transfer.pull
import transfer.receiver
import transfer.sender
import transfer.serve
from tests.transfer.conftest import MODEL, UCX_ENV, KVSide, config, specs
from tests.transfer.test_transfer_local import Pair, cancel_pull, wait_until
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


class Sides:
    """P and D with configs of their own, for failures that need them to differ."""

    def __init__(self, p_cfg, d_cfg, scramble: bool = True) -> None:
        self.p, self.d = KVSide(specs(), seed=7), KVSide(specs(), seed=8)
        if scramble:  # else requests get one run of pages: chunks go straight from / into pools
            self.p.scramble_free_queue()
            self.d.scramble_free_queue()
        self.sender = KVSender(self.p.kv.buffers, self.p.specs, MODEL, p_cfg, self.p.release)
        self.receiver = KVReceiver(self.d.kv.buffers, self.d.specs, MODEL, d_cfg)
        self.held: list = []

    def hold_p_staging(self) -> None:
        """Take every staging buffer of P: its staged chunks cannot start until released."""

        async def grab():
            return [
                await self.sender.staging.acquire() for _ in range(self.sender.staging.max_buffers)
            ]

        self.held = self.sender.runtime.run(grab(), timeout=5)

    def release_p_staging(self) -> None:
        for buf in self.held:
            self.sender.runtime.loop.call_soon_threadsafe(self.sender.staging.release, buf)
        self.held = []

    def close(self) -> None:
        self.release_p_staging()
        self.receiver.close()
        self.sender.close()
        self.p.assert_clean()
        self.d.assert_clean()


def test_chunks_p_gave_up_on_fail_the_pull_and_never_pass_for_data() -> None:
    """P completes the receives of chunks it gives up on with empty messages, which D cannot tell
    from data: so P sends TransferDone only once every chunk has begun, and a pull whose chunks
    P could not start fails on D instead of completing with the bytes D had before."""
    sides = Sides(
        config(zero_copy=False, chunk_deadline_s=1.0, staging_tokens=32),  # P stages its chunk
        config(zero_copy=True, staging_tokens=32),  # D receives it straight into its pool
        scramble=False,
    )
    try:
        sides.hold_p_staging()
        ticket = sides.sender.publish("victim", sides.p.allocate("victim", 16), 16)
        dst = sides.d.allocate("victim", 16)
        result = sides.receiver.pull_blocking(ticket, dst, 0, 16)
        assert not result.ok and "no progress" in result.error
        sides.d.free("victim")
        wait_until(lambda: "victim" in sides.p.released)
        sides.release_p_staging()
        ticket = sides.sender.publish("next", sides.p.allocate("next", 16), 16)
        dst = sides.d.allocate("next", 16)
        assert sides.receiver.pull_blocking(ticket, dst, 0, 16).ok
        assert torch.equal(sides.d.pages_of(dst)["full"], sides.p.pages_of(ticket.page_ids)["full"])
        sides.d.free("next")
        wait_until(lambda: "next" in sides.p.released)
    finally:
        sides.close()


def test_a_refused_pull_longer_than_d_staging_keeps_the_link(monkeypatch) -> None:
    """D posts receives for as many chunks as it has staging buffers; when P refuses, the drained
    receives free those buffers and D may credit more chunks before it reads the refusal. P
    completes those late credits too, so D ends the pull at once and the link stays up."""
    real_drain = transfer.sender.drain

    async def drain_then_pause(link, pull_id, chunks) -> None:
        await real_drain(link, pull_id, chunks)
        await asyncio.sleep(0.5)  # D credits the chunks the drained receives made room for

    monkeypatch.setattr(transfer.sender, "drain", drain_then_pause)
    sides = Sides(config(zero_copy=False, lease_s=0.4), config(zero_copy=False))
    try:
        pages = sides.p.allocate("late", 32)  # 8 pages: 4 chunks, against 2 staging buffers
        ticket = sides.sender.publish("late", pages, 32)
        wait_until(lambda: "late" in sides.p.released, timeout=5.0)  # expired
        result = sides.receiver.pull_blocking(ticket, sides.d.allocate("late", 32), 0, 32)
        assert not result.ok and "(expired)" in result.error
        sides.d.free("late")
        assert sides.receiver.stats()["reconnects"] == 0
        ticket = sides.sender.publish("next", sides.p.allocate("next", 32), 32)
        dst = sides.d.allocate("next", 32)
        assert sides.receiver.pull_blocking(ticket, dst, 0, 32).ok
        assert torch.equal(sides.d.pages_of(dst)["full"], sides.p.pages_of(ticket.page_ids)["full"])
        assert sides.receiver.stats()["reconnects"] == 0  # no link was aborted
        sides.d.free("next")
        wait_until(lambda: "next" in sides.p.released)
    finally:
        sides.close()


def test_a_cancelled_pull_returns_only_once_nothing_writes_its_pages() -> None:
    """The caller frees its pages when an awaited pull is cancelled: the pull fails (ending its
    receives) before the cancel reaches the caller, so chunks P sends later land nowhere. P
    completes the receives it never started, so another pull on the link goes on."""
    sides = Sides(
        config(zero_copy=False, staging_buffers=1), config(zero_copy=False, staging_buffers=1)
    )
    try:
        sides.hold_p_staging()
        ticket = sides.sender.publish("victim", sides.p.allocate("victim", 16), 16)  # 2 chunks
        dst = sides.d.allocate("victim", 16)
        other = sides.sender.publish("other", sides.p.allocate("other", 8), 8)
        other_dst = sides.d.allocate("other", 8)
        results = {}

        def pull_other() -> None:
            time.sleep(0.1)  # after the victim took D's staging buffer
            results["other"] = sides.receiver.pull_blocking(other, other_dst, 0, 8)

        bystander = threading.Thread(target=pull_other)
        bystander.start()

        cancel_pull(sides.receiver, ticket, dst, 16, after_s=0.3)
        assert "victim" not in [s.ticket.request_id for s in sides.receiver.sessions.values()]
        for g, ids in dst.items():  # the caller reuses the pages
            sides.d.kv.buffers[g][ids] = 0
        sides.release_p_staging()  # P could send the chunks now
        wait_until(lambda: "victim" in sides.p.released)  # D's negative ack or P's failure
        bystander.join(30)
        assert results["other"].ok, results["other"].error
        assert torch.equal(
            sides.d.pages_of(other_dst)["full"], sides.p.pages_of(other.page_ids)["full"]
        )
        assert bool((sides.d.pages_of(dst)["full"] == 0).all())
        assert sides.receiver.stats()["reconnects"] == 0  # the cancel did not cost the link
        sides.d.free("victim")
        sides.d.free("other")
        wait_until(lambda: "other" in sides.p.released)
        assert sides.receiver.stats()["failures"] == 1
    finally:
        sides.close()


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
    (link,) = pair.receiver._links.values()
    ticket, _ = pair.publish("old", 8)
    stale = dataclasses.replace(ticket, instance_id="instance-before-restart")
    result = pair.receiver.pull_blocking(stale, pair.d.allocate("old", 8), 0, 8)
    assert not result.ok and "stale ticket" in result.error
    pair.d.free("old")
    assert not link.closed and pair.receiver.stats()["reconnects"] == 0
    assert pair.sender.cancel("old")
    pull_next_ok(pair, "after-stale")
    assert pair.receiver._links[(pair.sender.host, pair.sender.port)] is link


def test_a_pull_cancelled_while_connecting_returns_at_once(pair: Pair) -> None:
    """Before a pull has posted a receive nothing of it can write the caller's pages, so a cancel
    then reaches the caller at once; the session still ends by its own deadline."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # connections are queued, never answered
    try:
        ticket, _ = pair.publish("unreachable", 8)
        ticket = dataclasses.replace(ticket, port=silent.getsockname()[1])
        dst = pair.d.allocate("unreachable", 8)

        cancel_pull(pair.receiver, ticket, dst, 8, after_s=0.2)
        assert pair.receiver.stats()["failures"] == 0  # the session is still connecting
        wait_until(lambda: pair.receiver.stats()["failures"] == 1)  # its connect deadline
        pair.d.free("unreachable")
        wait_until(lambda: "unreachable" in pair.p.released)  # its lease expired meanwhile
    finally:
        silent.close()
    pull_next_ok(pair, "after-unreachable")


def test_stale_tickets_of_one_instance_cost_one_probe(pair: Pair, monkeypatch) -> None:
    """A router may hold many tickets of a restarted worker: the first one's probe finds the open
    link's instance at the address, and the others fail without another handshake."""
    pull_next_ok(pair, "first")
    connects = []
    real_connect = pair.receiver._connect

    async def counted(ticket, direct=True):
        connects.append(direct)
        return await real_connect(ticket, direct)

    monkeypatch.setattr(pair.receiver, "_connect", counted)
    for i in range(3):
        ticket, _ = pair.publish(f"old{i}", 8)
        stale = dataclasses.replace(ticket, instance_id="instance-before-restart")
        result = pair.receiver.pull_blocking(stale, pair.d.allocate(f"old{i}", 8), 0, 8)
        assert not result.ok and "stale ticket" in result.error
        pair.d.free(f"old{i}")
        assert pair.sender.cancel(f"old{i}")
    assert connects == [False]  # one bare probe, no pools opened
    pull_next_ok(pair, "after-stale")


def test_an_unexpected_error_after_receives_are_posted_still_ends_them(monkeypatch) -> None:
    """A bug or a device error in the middle of a pull fails that pull like any failure: its
    receives end (D's staging buffers come back), P is told, and the next pull works."""
    sides = Sides(config(zero_copy=False), config(zero_copy=False))

    def broken(self, ready):
        raise RuntimeError("boom")

    try:
        ticket = sides.sender.publish("victim", sides.p.allocate("victim", 16), 16)
        with monkeypatch.context() as patch:
            patch.setattr(transfer.pull.PullSession, "_pull_request", broken)
            result = sides.receiver.pull_blocking(ticket, sides.d.allocate("victim", 16), 0, 16)
        assert not result.ok and "internal error" in result.error and "boom" in result.error
        assert sides.receiver.staging.in_use == 0
        sides.d.free("victim")
        wait_until(lambda: "victim" in sides.p.released, timeout=2.0)  # the negative ack
        ticket = sides.sender.publish("next", sides.p.allocate("next", 16), 16)
        dst = sides.d.allocate("next", 16)
        assert sides.receiver.pull_blocking(ticket, dst, 0, 16).ok
        sides.d.free("next")
        wait_until(lambda: "next" in sides.p.released)
    finally:
        sides.close()


def test_a_link_a_cancelled_pull_makes_after_close_is_not_kept(monkeypatch) -> None:
    """close() aborts the links it has; a pull cancelled while connecting may finish its
    handshake afterwards, and that link must not outlive the receiver."""
    real_connect = transfer.receiver.connect

    async def slow_connect(*args, **kwargs):
        await asyncio.sleep(0.5)
        return await real_connect(*args, **kwargs)

    monkeypatch.setattr(transfer.receiver, "connect", slow_connect)
    pair = Pair(config())
    try:
        ticket, _ = pair.publish("c1", 8)
        dst = pair.d.allocate("c1", 8)
        cancel_pull(pair.receiver, ticket, dst, 8, after_s=0.1)
        pair.receiver.close()
        wait_until(lambda: pair.sender.stats()["peers"] == 0)
        assert not pair.receiver._links
        pair.d.free("c1")
    finally:
        pair.sender.close()


def test_a_pull_d_gives_up_while_p_gathers_costs_no_link(monkeypatch) -> None:
    """D cancels while P still copies a chunk into staging (nothing of it handed to UCX yet): P
    sends that chunk empty and ends the pull without aborting the link, so another pull on it
    goes on."""
    real_gather = transfer.serve.gather_chunk
    gathers = []

    def slow_first_gather(*args):
        gathers.append(1)
        if len(gathers) == 1:
            time.sleep(0.6)  # the victim's first chunk, still being copied at the cancel
        return real_gather(*args)

    monkeypatch.setattr(transfer.serve, "gather_chunk", slow_first_gather)
    sides = Sides(config(zero_copy=False, staging_buffers=1), config(zero_copy=False))
    try:
        ticket = sides.sender.publish("victim", sides.p.allocate("victim", 16), 16)
        dst = sides.d.allocate("victim", 16)
        other = sides.sender.publish("other", sides.p.allocate("other", 8), 8)
        other_dst = sides.d.allocate("other", 8)
        results = {}

        def pull_other() -> None:
            time.sleep(0.1)
            results["other"] = sides.receiver.pull_blocking(other, other_dst, 0, 8)

        bystander = threading.Thread(target=pull_other)
        bystander.start()
        cancel_pull(sides.receiver, ticket, dst, 16, after_s=0.3)
        bystander.join(30)
        assert results["other"].ok, results["other"].error
        assert sides.receiver.stats()["reconnects"] == 0
        sides.d.free("victim")
        sides.d.free("other")
        wait_until(lambda: {"victim", "other"} <= set(sides.p.released))
    finally:
        sides.close()
