"""Pulls of a head slice (KVSender.publish / KVReceiver.pull with ``heads``), on every CPU data
path: a tp 1 prefill side of 4 KV heads serves a decode rank holding heads [2, 4) (decode tp 2),
byte for byte; a slice the decode rank does not hold fails the pull and leaks no page."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import pytest

from kvcache.spec import PoolGroupSpec
from tests.transfer.conftest import CPU_PATHS, MODEL, KVSide, config, specs, wait_until
from transfer import KVReceiver, KVSender


@contextlib.contextmanager
def sides(
    path: str, p_spec: PoolGroupSpec, d_spec: PoolGroupSpec
) -> Iterator[tuple[KVSide, KVSide, KVSender, KVReceiver]]:
    """P of ``p_spec`` and D of ``d_spec`` (scattered free pages), a sender and a receiver on
    ``path``; closed afterwards, and then every page must be back on both sides."""
    p, d = KVSide([p_spec], seed=1), KVSide([d_spec], seed=2)
    p.scramble_free_queue()
    d.scramble_free_queue()
    cfg = config(path)
    sender = KVSender(p.kv.buffers, p.specs, MODEL, cfg, p.release)
    receiver = KVReceiver(d.kv.buffers, d.specs, MODEL, cfg)
    try:
        yield p, d, sender, receiver
    finally:
        receiver.close()
        sender.close()
    p.assert_clean()
    d.assert_clean()


@pytest.mark.parametrize("path", CPU_PATHS)
def test_a_decode_rank_gets_its_two_heads_of_four(path: str) -> None:
    (whole,) = specs(heads=4)
    half = dataclasses.replace(whole, num_kv_heads=2, head_start=2)
    with sides(path, whole, half) as (p, d, sender, receiver):
        for rid, tokens in (("r1", 13), ("r2", 40)):  # 40 tokens: several chunks over UCX
            src = p.allocate(rid, tokens)
            ticket = sender.publish(rid, src, tokens, heads=(2, 2))
            dst = d.allocate(rid, tokens)
            result = receiver.pull_blocking(ticket, dst, 0, tokens, heads=(2, 2))
            assert result.ok, result.error
            got = d.kv.buffers["full"][dst["full"]]
            want = p.kv.buffers["full"][src["full"]][:, 2:4]  # [pages, heads, ...]: HND
            assert got.equal(want)
            assert result.stats.bytes == len(src["full"]) * d.specs[0].page_bytes
            d.free(rid)
            wait_until(lambda rid=rid: rid in p.released)
        src = p.allocate("bad", 8)
        ticket = sender.publish("bad", src, 8, heads=(1, 2))  # head 1: not the decode rank's
        dst = d.allocate("bad", 8)
        result = receiver.pull_blocking(ticket, dst, 0, 8, heads=(1, 2))
        assert not result.ok and "holds KV heads [2, 4), not all of [1, 3)" in result.error
        d.free("bad")
        wait_until(lambda: "bad" in p.released)
        src = p.allocate("none", 8)
        with pytest.raises(ValueError, match=r"holds KV heads \[0, 4\), not all of \[3, 5\)"):
            sender.publish("none", src, 8, heads=(3, 2))  # P's pools hold 4 heads: no lease
        p.free("none")


@pytest.mark.parametrize("path", CPU_PATHS)
def test_a_decode_side_of_all_heads_pulls_a_prefill_ranks_half(path: str) -> None:
    """Decode tp 1 (4 KV heads a page) from prefill rank 1 of tp 2 (heads [2, 4)): the slice's
    pages are half of D's, so D's chunks must fit P's staging buffers, not its own (a prompt of
    several chunks over UCX was refused as a plan that does not fit)."""
    (whole,) = specs(heads=4)
    half = dataclasses.replace(whole, num_kv_heads=2, head_start=2)
    with sides(path, half, whole) as (p, d, sender, receiver):
        src = p.allocate("r", 40)  # 10 pages: several staging buffers of 8 tokens either side
        ticket = sender.publish("r", src, 40, heads=(2, 2))
        dst = d.allocate("r", 40)
        result = receiver.pull_blocking(ticket, dst, 0, 40, heads=(2, 2))
        assert result.ok, result.error
        got = d.kv.buffers["full"][dst["full"]][:, 2:4]
        assert got.equal(p.kv.buffers["full"][src["full"]])
        d.free("r")
        wait_until(lambda: "r" in p.released)
