"""Direct reads over CUDA IPC between two processes (two GPUs when there are two): D opens P's pools
and lease board from the handshake and reads P's pages with one kernel; the bytes arrive exact, P
gets its pages back on ReadDone, a lease P has ended is refused by D from the board alone, and
with direct_copy off the same pulls go through UCX (first chunks prestaged on the GPU).

Both workers run in spawned processes: the UCX context of this test process is a CPU one
(tests/transfer/conftest.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import multiprocessing
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(180),
]

UCX_ENV = {"UCX_TLS": "tcp,cuda_copy,cuda_ipc", "UCX_NET_DEVICES": "lo"}


def _spec() -> Any:
    from kvcache.spec import PoolGroupSpec

    # 4 layers x 2 KV heads x 64 x 16 tokens, bf16: 32 KiB pages, 600 of them.
    return PoolGroupSpec("full", (0, 1, 2, 3), 600, 16, 2, 64, torch.bfloat16)


def _config(direct: bool) -> Any:
    from transfer import TransceiverConfig

    return TransceiverConfig(staging_tokens=256, direct_copy=direct, ucx_env=UCX_ENV)


def _digest(rows: torch.Tensor, pages: list[int]) -> str:
    data = rows[torch.tensor(pages, device=rows.device)].cpu().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def _rows(buf: torch.Tensor, page_bytes: int) -> torch.Tensor:
    return buf.view(-1).view(torch.uint8).view(-1, page_bytes)


def prefill_proc(conn: Connection, device: str, direct: bool) -> None:
    from transfer import KVSender

    torch.cuda.set_device(device)
    spec = _spec()
    buf = torch.randint(-30000, 30000, spec.buffer_shape, dtype=torch.int16, device=device)
    buf = buf.view(torch.bfloat16)
    released: list[str] = []
    sender = KVSender({"full": buf}, [spec], "m", _config(direct), released.append)
    conn.send(sender.port)
    gen = torch.Generator().manual_seed(1)
    while True:
        cmd, *args = conn.recv()
        if cmd == "publish":
            rid, n = args
            pages = (torch.randperm(spec.num_pages - 1, generator=gen)[:n] + 1).tolist()
            ticket = sender.publish(rid, {"full": pages}, n * spec.page_size)
            conn.send((ticket, _digest(_rows(buf, spec.page_bytes), pages)))
        elif cmd == "publish_run":  # pages first .. first + n - 1: one run
            rid, first, n = args
            pages = list(range(first, first + n))
            ticket = sender.publish(rid, {"full": pages}, n * spec.page_size)
            conn.send((ticket, _digest(_rows(buf, spec.page_bytes), pages)))
        elif cmd == "digest":  # of some of P's pages, in order
            conn.send(_digest(_rows(buf, spec.page_bytes), args[0]))
        elif cmd == "cancel":
            conn.send(sender.cancel(args[0]))
        elif cmd == "state":
            conn.send((list(released), [s.path for s in sender.drain_transfer_stats()]))
        elif cmd == "prestaged":
            conn.send(sender.stats()["prestaged_chunks"])
        elif cmd == "close":
            sender.close()
            conn.send("closed")
            return


def decode_proc(conn: Connection, device: str, direct: bool) -> None:
    from transfer import KVReceiver

    torch.cuda.set_device(device)
    spec = _spec()
    buf = torch.zeros(spec.buffer_shape, dtype=spec.dtype, device=device)
    receiver = KVReceiver({"full": buf}, [spec], "m", _config(direct))
    conn.send("ready")
    gen = torch.Generator().manual_seed(2)
    while True:
        cmd, *args = conn.recv()
        if cmd == "pull":  # several tickets, pulled concurrently (past their first skip pages)
            tickets = args[0]
            skip = args[1] if len(args) > 1 else 0
            dsts = []
            free = (torch.randperm(spec.num_pages - 1, generator=gen) + 1).tolist()
            for t in tickets:
                n = len(t.page_ids["full"]) - skip
                dsts.append(free[:n])
                free = free[n:]
            with ThreadPoolExecutor(len(tickets)) as pool:
                results = list(
                    pool.map(
                        lambda t, dst, skip=skip: receiver.pull_blocking(
                            t, {"full": dst}, skip, t.declared_prompt_len
                        ),
                        tickets,
                        dsts,
                    )
                )
            rows = _rows(buf, spec.page_bytes)
            conn.send(
                [
                    (r.ok, r.error, r.stats.path, r.bytes, _digest(rows, d))
                    for r, d in zip(results, dsts)
                ]
            )
        elif cmd == "pull_run":  # into pages first .. first + n - 1, after a late copy into them
            ticket, first, late = args
            n = len(ticket.page_ids["full"])
            rows = _rows(buf, spec.page_bytes)
            if late:
                # A copy into those pages that outlived its pull (as a direct read past its
                # deadline does): it writes them once a ~1 s sleep on another stream ends, and is
                # fenced as DirectRead fences it.
                stream = torch.cuda.Stream(device)
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(2_000_000_000)
                    rows[first : first + n].fill_(0xAB)
                    event = torch.cuda.Event()
                    event.record(stream)
                receiver.fence_late_copy(event)
            dst = list(range(first, first + n))
            r = receiver.pull_blocking(ticket, {"full": dst}, 0, n * spec.page_size)
            waits = receiver.stats()["late_copy_waits"]
            conn.send((r.ok, r.error, r.stats.path, _digest(rows, dst), waits))
        elif cmd == "busy_model":  # the model's stream busy for about a second from now
            torch.cuda._sleep(2_000_000_000)
            conn.send("busy")
        elif cmd == "chunk_deadline_s":
            receiver.config = dataclasses.replace(receiver.config, chunk_deadline_s=args[0])
            conn.send("set")
        elif cmd == "stats":
            conn.send(receiver.stats())
        elif cmd == "close":
            receiver.close()
            conn.send("closed")
            return


class Proc:
    def __init__(self, target: Any, device: str, direct: bool) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, device, direct), daemon=True)
        self.proc.start()
        assert self.conn.poll(120), "worker process did not start"
        self.first = self.conn.recv()

    def ask(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        assert self.conn.poll(120), f"no answer to {cmd[0]}"
        return self.conn.recv()

    def close(self) -> None:
        self.ask("close")
        self.proc.join(30)


@pytest.mark.parametrize("direct", [True, False], ids=["cuda_ipc", "ucx"])
def test_scattered_pages_arrive_exact_between_gpus(direct: bool) -> None:
    d_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    p = Proc(prefill_proc, "cuda:0", direct)
    d = Proc(decode_proc, d_device, direct)
    try:
        # 1 page, a staging chunk's worth, several chunks, and eight at once.
        for batch in ([1], [16], [100], [3, 7, 16, 20, 31, 40, 2, 9]):
            published = [p.ask("publish", f"r{len(batch)}-{i}-{n}", n) for i, n in enumerate(batch)]
            results = d.ask("pull", [t for t, _ in published])
            for (ok, error, path, nbytes, digest), (ticket, want), n in zip(
                results, published, batch
            ):
                assert ok, error
                assert path == ("cuda_ipc" if direct else "ucx")
                assert nbytes == n * _spec().page_bytes
                assert digest == want, f"{ticket.request_id}: bytes differ"
        deadline = time.monotonic() + 30
        released, paths = p.ask("state")
        while len(released) < 11 and time.monotonic() < deadline:  # the last acks are in flight
            time.sleep(0.05)
            more, new_paths = p.ask("state")
            released, paths = more, paths + new_paths
        assert len(released) == 11  # every pull acked: P has all its pages back
        assert set(paths) == {"cuda_ipc" if direct else "ucx"}
        # Over UCX, P gathered first chunks at publish time once D had pulled (prestage.py).
        assert (p.ask("prestaged") > 0) != direct
        # A lease P ended (cancelled here) is refused; D knows it from the board (direct) or
        # from P's answer (UCX), and its pages are untouched either way.
        ticket, _ = p.ask("publish", "gone", 5)
        assert p.ask("cancel", "gone")
        [(ok, error, path, nbytes, _)] = d.ask("pull", [ticket])
        assert not ok and nbytes == 0
        assert ("ended (expired, or released) before the read" if direct else "unknown") in error
        # A ticket naming a page outside P's pool: the direct copy, queued before the ids are
        # checked, skips that page and the pull fails on the check; P gets its pages back.
        ticket, _ = p.ask("publish", "forged", 4)
        forged = dataclasses.replace(
            ticket, page_ids={"full": [10**6] + ticket.page_ids["full"][1:]}
        )
        [(ok, error, _, nbytes, _)] = d.ask("pull", [forged])
        assert not ok and nbytes == 0
        assert "outside" in error, error
        # Another prompt length than P declares fails the pull (on the direct path from the
        # board), and so does a ticket naming P's leased pages in another order; P gets its
        # pages back.
        ticket, _ = p.ask("publish", "declared", 6)
        longer = dataclasses.replace(ticket, declared_prompt_len=ticket.declared_prompt_len + 1)
        [(ok, error, _, nbytes, _)] = d.ask("pull", [longer])
        assert not ok and nbytes == 0
        assert "declared history mismatch" in error, error
        if direct:
            ticket, _ = p.ask("publish", "reordered", 6)
            reordered = dataclasses.replace(
                ticket, page_ids={"full": ticket.page_ids["full"][::-1]}
            )
            [(ok, error, _, nbytes, _)] = d.ask("pull", [reordered])
            assert not ok and nbytes == 0
            assert "differ from the ones the prefill worker leased" in error, error
        # Pages D already has (a prefix cache hit) are skipped: only the rest moves.
        ticket, _ = p.ask("publish", "skipped", 12)
        [(ok, error, _, nbytes, digest)] = d.ask("pull", [ticket], 5)
        assert ok, error
        assert nbytes == 7 * _spec().page_bytes
        assert digest == p.ask("digest", ticket.page_ids["full"][5:])
        deadline = time.monotonic() + 30
        ended = (
            ("forged", "declared", "reordered", "skipped") if direct else ("declared", "skipped")
        )
        while not set(ended) <= set(p.ask("state")[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(ended) <= set(p.ask("state")[0])
    finally:
        d.close()
        p.close()


def test_ucx_writing_straight_into_pages_waits_for_a_late_copy_into_them() -> None:
    """A direct copy that outlived its pull writes pages the caller got back; UCX writes a chunk
    straight into pool memory outside our streams, so the next pull into those pages that lets it
    do so waits for that copy first (receiver.late_copies): the pull's bytes are the last."""
    d_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    p = Proc(prefill_proc, "cuda:0", False)
    d = Proc(decode_proc, d_device, False)
    try:
        # One run of 8 pages on both sides: one chunk, which UCX moves from P's pool straight
        # into ours. The first pull makes the link and UCX's mappings of both pools.
        for rid, first, late in (("warm", 40, False), ("straight", 50, True)):
            ticket, want = p.ask("publish_run", rid, first, 8)
            ok, error, path, digest, waits = d.ask("pull_run", ticket, 100, late)
            assert ok, error
            assert path == "ucx"
            assert waits == int(late)  # the chunk went straight into the pool, after the copy
            assert digest == want, f"{rid}: the pulled pages differ from P's"
    finally:
        d.close()
        p.close()


def test_a_direct_copy_past_its_deadline_is_fenced_and_p_gets_its_pages() -> None:
    """D's direct copies wait for its model stream; with that stream busy, a read's copy cannot
    end within its deadline: the pull fails, the copy is fenced as a late copy (the model stream
    and later UCX writes wait for it), P gets its pages back at once, and the next read works."""
    d_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    p = Proc(prefill_proc, "cuda:0", True)
    d = Proc(decode_proc, d_device, True)
    try:
        warm, want = p.ask("publish", "warm", 16)
        [(ok, error, _, _, digest)] = d.ask("pull", [warm])
        assert ok and digest == want, error
        assert d.ask("chunk_deadline_s", 0.05) == "set"
        assert d.ask("busy_model") == "busy"
        late, _ = p.ask("publish", "late", 16)
        [(ok, error, path, nbytes, _)] = d.ask("pull", [late])
        assert not ok and nbytes == 0 and path == "cuda_ipc"
        assert "did not end within" in error, error
        assert d.ask("stats")["late_copies"] == 1
        deadline = time.monotonic() + 10
        while "late" not in p.ask("state")[0] and time.monotonic() < deadline:
            time.sleep(0.05)  # by ReadDone(ok=False): P's lease would last 30 s
        assert "late" in p.ask("state")[0]
        assert d.ask("chunk_deadline_s", 10.0) == "set"
        again, want = p.ask("publish", "again", 16)
        [(ok, error, _, _, digest)] = d.ask("pull", [again])
        assert ok and digest == want, error
    finally:
        d.close()
        p.close()
