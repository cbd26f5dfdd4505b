"""The control channel after the handshake: a malformed message is rejected with the reason and
counted, and the connection stays usable; a malformed answer from P fails that pull at once; a P
that never sends the pages ends the pull at its deadline (and receives that outlive their link's
abort hold the pull and call on_wedged when they may write its pages); a decode worker that never
confirms a direct read gets no more than the read's window, and one whose grant's send failed
after it was written still gets the whole window; a message too large for a frame is never sent."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Iterator

import msgpack
import pytest
import torch

from tests.transfer.conftest import (
    SECRET,
    Pair,
    checked_pair,
    joined_raw_peer,
    staged_pull_request,
    wait_until,
)
from tests.transfer.raw_peer import RawPeer, RawServer
from transfer.control import MAX_FRAME_BYTES, FrameTooLarge, frame
from transfer.link import Link
from transfer.messages import (
    Message,
    PullError,
    PullRequest,
    ReadGrant,
    Reject,
    TransferAck,
    Welcome,
)
from transfer.paths import staging
from transfer.runtime import UcxRuntime
from transfer.serve import ServeSession
from transfer.version import PROTOCOL_VERSION

pytestmark = pytest.mark.timeout(60)


def test_malformed_messages_to_p_are_rejected_and_the_connection_stays_usable(
    pair: Pair, ucx_runtime
) -> None:
    bad_version = msgpack.packb({"v": 99, "type": "ChunkReady", "body": {}})
    wrong_type = msgpack.packb(
        {"v": PROTOCOL_VERSION, "type": "PullRequest", "body": {"request_id": "x", "pull_id": "1"}}
    )
    with joined_raw_peer(pair, ucx_runtime) as peer:
        for payload, reason in [
            (b"\xc1 definitely not msgpack", "not a msgpack message"),
            (bad_version, f"unsupported protocol version int 99, expected {PROTOCOL_VERSION}"),
            (wrong_type, "PullRequest: expected fields"),
        ]:
            peer.send_raw(payload)
            reply = peer.recv()
            assert isinstance(reply, Reject) and reason in reply.reason
        # Still usable: a well-formed notice for a ticket nobody has is dropped, not fatal.
        peer.send(TransferAck("nobody", 1, 1, False, "test"))
        peer.send_raw(b"\xc1")
        assert isinstance(peer.recv(), Reject)
    assert pair.sender.stats()["rejected_messages"] == 4
    pair.pull_ok("after")


@pytest.mark.parametrize("how", ["no MAC", "altered", "replayed"])
def test_a_frame_that_fails_authentication_closes_the_connection(
    pair: Pair, ucx_runtime, how: str
) -> None:
    """After the handshake every frame carries a MAC (frame_seal.py): one injected without it,
    changed in transit or played again is counted and ends the connection (nothing after it could
    be trusted); P holds nothing for it and serving goes on."""
    peer = RawPeer(pair.sender.host, pair.sender.port)
    try:
        answer = peer.handshake(
            SECRET.encode(), pair.receiver.page_table, ucx_runtime.worker_address
        )
        assert isinstance(answer, Welcome) and peer.seal is not None
        ack = TransferAck("nobody", 1, 1, False, "test")
        if how == "no MAC":
            peer.sock.sendall(frame(ack))
        else:
            sealed = frame(ack, peer.seal)
            peer.sock.sendall(sealed)  # (well formed: dropped, the connection stays)
            if how == "altered":
                peer.sock.sendall(sealed[:-1] + bytes([sealed[-1] ^ 1]))
            else:
                peer.sock.sendall(sealed)
        assert peer.closed_by_peer()
    finally:
        peer.close()
    wait_until(lambda: pair.sender.stats()["peers"] == 0)
    assert pair.sender.stats()["rejected_messages"] == 1
    pair.pull_ok("after")


@pytest.fixture
def ucx_pair() -> Iterator[Pair]:
    """A pair on the UCX path with a short pull deadline (the rogue prefill workers below offer
    no pools, so every path would be UCX)."""
    with checked_pair("ucx", pull_deadline_s=2.0, chunk_deadline_s=0.5) as made:
        yield made


def test_a_malformed_answer_from_p_fails_the_pull_at_once(ucx_pair: Pair, ucx_runtime) -> None:
    """A rogue prefill worker (it knows the secret) answers the pull with a TransferDone whose
    length is a string: D rejects it, fails the pull without waiting for a deadline, and tells
    P."""
    pair = ucx_pair
    rogue = RawServer()
    seen: list[object] = []

    def serve() -> None:
        rogue.accept(SECRET.encode(), pair.sender.page_table, ucx_runtime.worker_address)
        req = rogue.recv()
        assert isinstance(req, PullRequest)
        body = {
            "request_id": req.request_id,
            "pull_id": req.pull_id,
            "declared_prompt_len": "eight",
            "total_bytes": 0,
            "num_chunks": 0,
        }
        rogue.send_raw(msgpack.packb({"v": PROTOCOL_VERSION, "type": "TransferDone", "body": body}))
        seen.append(rogue.recv())  # D's Reject
        seen.append(rogue.recv())  # D's negative notice

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        ticket, _ = pair.publish("rogue-req", 8)
        forged = dataclasses.replace(ticket, port=rogue.port, instance_id="rogue")
        dst = pair.d.allocate("rogue-req", 8)
        started = time.monotonic()
        result = pair.receiver.pull_blocking(forged, dst, 0, 8)
        assert not result.ok
        assert "TransferDone.declared_prompt_len: expected a non-negative int64" in result.error
        assert time.monotonic() - started < pair.receiver.config.pull_deadline_s
        thread.join(timeout=10)
        assert isinstance(seen[0], Reject) and isinstance(seen[1], TransferAck)
        assert not seen[1].ok
        assert pair.receiver.stats()["rejected_messages"] == 1
        pair.d.free("rogue-req")
        assert pair.sender.cancel("rogue-req")
    finally:
        rogue.close()
    pair.pull_ok("after")


def test_a_fill_stall_ends_at_the_pull_deadline(ucx_pair: Pair, ucx_runtime) -> None:
    """P takes the pull and never sends a page: the pull fails when its deadline passes (the link
    is aborted, ending the receives), not later, and the next pull to a good P succeeds."""
    pair = ucx_pair
    rogue = RawServer()
    stalled = threading.Event()

    def serve() -> None:
        rogue.accept(SECRET.encode(), pair.sender.page_table, ucx_runtime.worker_address)
        assert isinstance(rogue.recv(), PullRequest)
        stalled.wait(30)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        ticket, _ = pair.publish("stall", 16)
        forged = dataclasses.replace(ticket, port=rogue.port, instance_id="rogue")
        dst = pair.d.allocate("stall", 16)
        started = time.monotonic()
        result = pair.receiver.pull_blocking(forged, dst, 0, 16)
        took = time.monotonic() - started
        cfg = pair.receiver.config
        assert not result.ok
        assert f"timed out after {cfg.pull_deadline_s}s waiting for the first chunk" in result.error
        assert cfg.pull_deadline_s <= took < cfg.pull_deadline_s + cfg.chunk_deadline_s + 5
        pair.d.free("stall")
        assert pair.sender.cancel("stall")
    finally:
        stalled.set()
        rogue.close()
    pair.pull_ok("after")


@pytest.mark.parametrize("where", ["staged", "in_place"])
def test_receives_that_outlive_the_links_abort(
    where: str, ucx_runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A P that never sends, over a transport whose receives do not end when their link is
    aborted (each real UCX receive here is held after it ends, until the test lets it go).
    Received in place, they could still write the pull's pages: the pull does not return while
    they wait, and the receiver's on_wedged hears of it once (a worker's process goes down
    there). Staged, they hold only their buffers: the pull fails without them, on_wedged is not
    called, and the buffers come back when they end. Both are counted."""
    if where == "in_place":
        monkeypatch.setattr(staging, "RUN_PAGE_BYTES", 0)
    let_go = threading.Event()
    real_recv = Link.recv_data

    async def held_recv(self: Link, buf: torch.Tensor, tag: int) -> None:
        try:
            await real_recv(self, buf, tag)
        finally:
            while not let_go.is_set():
                await asyncio.sleep(0.01)

    monkeypatch.setattr(Link, "recv_data", held_recv)
    wedged: list[str] = []
    with checked_pair("ucx", pull_deadline_s=1.0, chunk_deadline_s=0.3) as pair:
        pair.receiver.on_wedged = wedged.append
        rogue = RawServer()

        def serve() -> None:
            rogue.accept(SECRET.encode(), pair.sender.page_table, ucx_runtime.worker_address)
            assert isinstance(rogue.recv(), PullRequest)
            let_go.wait(30)

        threading.Thread(target=serve, daemon=True).start()
        ticket, _ = pair.publish("wedged", 16)
        forged = dataclasses.replace(ticket, port=rogue.port, instance_id="rogue")
        dst = pair.d.allocate("wedged", 16)
        pulled: list = []
        puller = threading.Thread(
            target=lambda: pulled.append(pair.receiver.pull_blocking(forged, dst, 0, 16))
        )
        puller.start()
        staged = pair.receiver.staging
        try:
            if where == "in_place":
                wait_until(lambda: bool(wedged))
                assert "outlived the abort of their link, some into its pages" in wedged[0]
                time.sleep(1.0)  # past more chunk deadlines: still waiting, heard of once
                assert puller.is_alive() and not pulled and len(wedged) == 1
            else:
                puller.join(10)
                assert pulled and not pulled[0].ok and not wedged
                assert staged._free.qsize() < staged._made  # the held receives keep theirs
            assert pair.receiver.stats()["wedged_messages"] > 0
        finally:
            let_go.set()
            puller.join(10)
            rogue.close()
        assert pulled and not pulled[0].ok
        wait_until(lambda: staged._free.qsize() == staged._made)
        pair.d.free("wedged")
        assert pair.sender.cancel("wedged")


def test_a_message_too_large_for_a_frame_is_not_sent() -> None:
    ids = list(range(1, 2_000_001))  # 2M pages a side: past 16 MiB
    big = PullRequest("r", 1, 1, {"full": ids}, {"full": ids}, {"full": 0}, 1, [], 1, [])
    with pytest.raises(FrameTooLarge, match="frame limit"):
        frame(big)
    small = dataclasses.replace(big, src_page_ids={"full": [1]}, dst_page_ids={"full": [2]})
    assert len(frame(small)) < MAX_FRAME_BYTES


def ask_direct_read(pair: Pair, peer: RawPeer, ucx_runtime: UcxRuntime, rid: str) -> object:
    """Publish 8 tokens of ``rid`` on P, ask for them as a direct read from ``peer`` (a decode
    side that says only what the test makes it say); P's answer."""
    ticket, src = pair.publish(rid, 8)
    answer = peer.handshake(
        SECRET.encode(), pair.receiver.page_table, ucx_runtime.worker_address, "host_shm"
    )
    assert isinstance(answer, Welcome)
    dst = {g: list(range(1, 1 + len(ids))) for g, ids in src.items()}
    skip = {g: 0 for g in src}
    nbytes = sum(pair.p.specs[0].page_bytes * len(ids) for ids in src.values())
    peer.send(PullRequest(rid, 1, ticket.lease_gen, src, dst, skip, 8, [], nbytes, []))
    return peer.recv()  # (a direct read: no chunks, no credits)


def test_a_direct_read_never_confirmed_gives_p_its_pages_back_after_the_window(
    ucx_runtime,
) -> None:
    """A decode worker granted a direct read that never sends its final notice (it hung, or
    lost its notice): P holds the pages for the read's window (chunk_deadline_s +
    ack_deadline_s), then gives them back and counts the pull as served without a notice."""
    with checked_pair("host_shm", chunk_deadline_s=0.3, ack_deadline_s=0.3) as pair:
        peer = RawPeer(pair.sender.host, pair.sender.port)
        try:
            grant = ask_direct_read(pair, peer, ucx_runtime, "silent")
            assert isinstance(grant, ReadGrant) and grant.declared_prompt_len == 8
            assert "silent" not in pair.p.released  # held for our read
            wait_until(lambda: pair.p.released == ["silent"])  # no notice: the window ended it
            served = pair.sender.drain_transfer_stats()[-1]
            assert served.ok and served.request_id == "silent"
            assert pair.sender.stats()["expired_leases"] == 0  # (not an expiry: a pull ended)
        finally:
            peer.close()
        pair.pull_ok("after")


def test_a_grant_whose_send_fails_still_holds_the_pages_for_the_read(
    ucx_runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P's send of a direct read's grant fails after its bytes were written (a send that timed
    out with the grant in the socket's buffer): D may get it and read, so P holds the pages for
    the read's window before it gives them back, not from the failure on."""
    real_send = ServeSession.send

    async def grant_fails(self: ServeSession, msg: Message) -> None:
        await real_send(self, msg)
        if isinstance(msg, ReadGrant):
            raise TimeoutError("the grant's send stalled (test)")

    monkeypatch.setattr(ServeSession, "send", grant_fails)
    with checked_pair("host_shm", chunk_deadline_s=0.5, ack_deadline_s=0.5) as pair:
        peer = RawPeer(pair.sender.host, pair.sender.port)
        try:
            assert isinstance(ask_direct_read(pair, peer, ucx_runtime, "stalled"), ReadGrant)
            time.sleep(0.2)  # (well inside the read's window of 1 s)
            assert "stalled" not in pair.p.released  # held for a read that may be under way
            wait_until(lambda: "stalled" in pair.p.released)
        finally:
            peer.close()


def test_a_refusal_naming_another_request_does_not_end_a_pull(ucx_pair: Pair, ucx_runtime) -> None:
    """A PullError with the pull's id but another request's name (what P answers a second pull
    with that id) is dropped: the pull ends on the refusal of its own request."""
    pair = ucx_pair
    rogue = RawServer()

    def serve() -> None:
        rogue.accept(SECRET.encode(), pair.sender.page_table, ucx_runtime.worker_address)
        req = rogue.recv()
        assert isinstance(req, PullRequest)
        rogue.send(PullError("someone-else", req.pull_id, "mismatch", "pull id in use"))
        rogue.send(PullError(req.request_id, req.pull_id, "expired", "its own refusal"))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        ticket, _ = pair.publish("mine", 8)
        forged = dataclasses.replace(ticket, port=rogue.port, instance_id="rogue")
        dst = pair.d.allocate("mine", 8)
        result = pair.receiver.pull_blocking(forged, dst, 0, 8)
        assert not result.ok and "its own refusal" in result.error
        thread.join(timeout=10)
        pair.d.free("mine")
        assert pair.sender.cancel("mine")
    finally:
        rogue.close()
    pair.pull_ok("after")


def test_a_malformed_message_naming_a_pull_being_served_fails_it_at_once(ucx_runtime) -> None:
    """D's ChunkReady whose credits are not a list: P rejects it and fails the pull it names at
    once (its pages back), rather than at the chunk deadline."""
    with checked_pair("ucx", chunk_deadline_s=30.0) as pair:
        with joined_raw_peer(pair, ucx_runtime) as peer:
            peer.send(staged_pull_request(pair, "served", 3, []))
            wait_until(lambda: pair.sender.stats()["pulls_in_flight"] == 1)
            body = {"request_id": "served", "pull_id": 3, "chunks": "all of them"}
            peer.send_raw(
                msgpack.packb({"v": PROTOCOL_VERSION, "type": "ChunkReady", "body": body})
            )
            wait_until(lambda: "served" in pair.p.released, timeout=5.0)
            assert pair.sender.stats()["rejected_messages"] == 1
        pair.pull_ok("after")
