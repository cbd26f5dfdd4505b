"""The GPU paths between two processes: cuda_ipc (D opens P's pools through CUDA IPC and reads
pages with the page-copy kernel) and, with direct_copy off, ucx (staged chunks gathered and
scattered by the Triton kernels). Both run on ONE GPU too (two processes on one device can use
CUDA IPC); with two GPUs, P and D take one each.

Both workers run in spawned processes: the UCX context of this test process is a CPU one
(tests/transfer/conftest.py). Run by scripts/gpu_check.sh (step ``tests``)."""

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
    pytest.mark.timeout(300),
]

UCX_ENV = {"UCX_TLS": "tcp,cuda_copy,cuda_ipc", "UCX_NET_DEVICES": "lo"}


def _spec() -> Any:
    from kvcache.spec import PoolGroupSpec

    # 4 layers x 2 KV heads x 64 x 16 tokens, bf16: 32 KiB pages, 600 of them.
    return PoolGroupSpec("full", (0, 1, 2, 3), 600, 16, 2, 64, torch.bfloat16)


def _config(direct: bool) -> Any:
    from transfer import TransceiverConfig

    return TransceiverConfig(
        secret="gpu-test", staging_tokens=256, direct_copy=direct, ucx_env=UCX_ENV
    )


def _digest(rows: torch.Tensor, pages: list[int]) -> str:
    data = rows[torch.tensor(pages, device=rows.device)].cpu().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def _rows(buf: torch.Tensor, page_bytes: int) -> torch.Tensor:
    return buf.view(-1).view(torch.uint8).view(-1, page_bytes)


def prefill_proc(conn: Connection, device: str, direct: bool) -> None:
    from transfer import KVSender

    torch.cuda.set_device(device)
    spec = _spec()
    buf = torch.randint(-30000, 30000, spec.buffer_shape, dtype=torch.int16, device=device).view(
        torch.bfloat16
    )
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
        elif cmd == "digest":
            conn.send(_digest(_rows(buf, spec.page_bytes), args[0]))
        elif cmd == "cancel":
            conn.send(sender.cancel(args[0]))
        elif cmd == "state":
            conn.send((list(released), [s.path for s in sender.drain_transfer_stats()]))
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
            tickets, skip = args
            free = (torch.randperm(spec.num_pages - 1, generator=gen) + 1).tolist()
            dsts = []
            for t in tickets:
                n = len(t.page_ids["full"]) - skip
                dsts.append(free[:n])
                free = free[n:]
            with ThreadPoolExecutor(len(tickets)) as pool:
                results = list(
                    pool.map(
                        lambda t, d, skip=skip: receiver.pull_blocking(
                            t, {"full": d}, skip, t.declared_prompt_len
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
        elif cmd == "busy_model":  # the model's stream busy for about a second from now
            torch.cuda._sleep(2_000_000_000)
            conn.send("busy")
        elif cmd == "deadlines":
            receiver.config = dataclasses.replace(
                receiver.config, chunk_deadline_s=args[0], ack_deadline_s=args[0]
            )
            conn.send("set")
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


def _devices() -> tuple[str, str]:
    """P on GPU 0; D on GPU 1 when there is one, else on GPU 0 too."""
    return "cuda:0", "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"


def _wait_released(p: Proc, names: set[str]) -> list[str]:
    deadline = time.monotonic() + 30
    released, paths = p.ask("state")
    while not names <= set(released) and time.monotonic() < deadline:
        time.sleep(0.05)
        released, more = p.ask("state")
        paths += more
    assert names <= set(released), (names, released)
    return paths


@pytest.mark.parametrize("direct", [True, False], ids=["cuda_ipc", "ucx"])
def test_scattered_pages_arrive_exact_and_bad_tickets_fail(direct: bool) -> None:
    p_device, d_device = _devices()
    p = Proc(prefill_proc, p_device, direct)
    d = Proc(decode_proc, d_device, direct)
    path = "cuda_ipc" if direct else "ucx"
    try:
        done: set[str] = set()
        # 1 page, a staging chunk's worth, several chunks, and eight at once.
        for batch in ([1], [16], [100], [3, 7, 16, 20, 31, 40, 2, 9]):
            published = [p.ask("publish", f"r{len(batch)}-{i}-{n}", n) for i, n in enumerate(batch)]
            results = d.ask("pull", [t for t, _ in published], 0)
            for (ok, error, got_path, nbytes, digest), (ticket, want), n in zip(
                results, published, batch
            ):
                assert ok, error
                assert got_path == path and nbytes == n * _spec().page_bytes
                assert digest == want, f"{ticket.request_id}: bytes differ"
                done.add(ticket.request_id)
        assert set(_wait_released(p, done)) == {path}  # every pull's notice freed P's pages
        # A lease P ended is refused, and its pages are untouched.
        ticket, _ = p.ask("publish", "gone", 5)
        assert p.ask("cancel", "gone")
        [(ok, error, _, nbytes, _)] = d.ask("pull", [ticket], 0)
        assert not ok and nbytes == 0 and "ended (cancelled)" in error, error
        # A ticket naming a page outside P's pool fails before any copy; P frees its pages.
        ticket, _ = p.ask("publish", "forged", 4)
        forged = dataclasses.replace(
            ticket, page_ids={"full": [10**6] + ticket.page_ids["full"][1:]}
        )
        [(ok, error, _, nbytes, _)] = d.ask("pull", [forged], 0)
        assert not ok and nbytes == 0 and "outside" in error, error
        # Another prompt length than P declares fails the pull; P frees its pages.
        ticket, _ = p.ask("publish", "declared", 6)
        longer = dataclasses.replace(ticket, declared_prompt_len=ticket.declared_prompt_len + 1)
        [(ok, error, _, nbytes, _)] = d.ask("pull", [longer], 0)
        assert not ok and nbytes == 0 and "declared history mismatch" in error, error
        # Pages D already has (a prefix cache hit) are skipped: only the rest moves.
        ticket, _ = p.ask("publish", "skipped", 12)
        [(ok, error, _, nbytes, digest)] = d.ask("pull", [ticket], 5)
        assert ok, error
        assert nbytes == 7 * _spec().page_bytes
        assert digest == p.ask("digest", ticket.page_ids["full"][5:])
        _wait_released(p, {"forged", "declared", "skipped"})
    finally:
        d.close()
        p.close()


def test_a_copy_past_its_deadline_is_fenced_and_p_gets_its_pages() -> None:
    """D's copy waits for its model stream; with that stream busy, the copy cannot end within the
    read's deadline: the pull fails, the model stream waits for the copy, P gets its pages back
    from D's notice, and the next read works."""
    p_device, d_device = _devices()
    p = Proc(prefill_proc, p_device, True)
    d = Proc(decode_proc, d_device, True)
    try:
        warm, want = p.ask("publish", "warm", 16)
        [(ok, error, _, _, digest)] = d.ask("pull", [warm], 0)
        assert ok and digest == want, error
        assert d.ask("deadlines", 0.05) == "set"
        assert d.ask("busy_model") == "busy"
        late, _ = p.ask("publish", "late", 16)
        [(ok, error, path, nbytes, _)] = d.ask("pull", [late], 0)
        assert not ok and nbytes == 0 and path == "cuda_ipc"
        assert "did not end within the read's deadline" in error, error
        _wait_released(p, {"late"})  # by D's notice: P's lease would last 30 s
        assert d.ask("deadlines", 10.0) == "set"
        again, want = p.ask("publish", "again", 16)
        [(ok, error, _, _, digest)] = d.ask("pull", [again], 0)
        assert ok and digest == want, error
    finally:
        d.close()
        p.close()
