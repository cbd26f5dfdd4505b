"""ForwardBatch construction from scheduler decisions: exact tensors for chunked prefill and decode."""

from __future__ import annotations

import torch

from engine.batch_builder import BatchBuilder, PageTableRows
from engine.scheduler_output import SchedulerOutput

from .conftest_engine import make_request, tiny_kv, tiny_scheduler


def ints(t: torch.Tensor) -> list:
    return t.tolist()


def test_chunked_prefill_then_decode_batches() -> None:
    kv = tiny_kv(num_pages=33, page_size=4, reuse_policy="none")
    sched = tiny_scheduler(kv, max_num_batched_tokens=8, prefill_chunk_size=6)
    builder = BatchBuilder(page_size=4, max_pages_per_seq=sched.config.max_pages_per_seq)
    a, b = make_request("a", list(range(100, 110))), make_request("b", [200, 201, 202])
    sched.add_request(a)
    sched.add_request(b)

    out = sched.schedule()  # a: [0, 6), b: [0, 2)
    batch = builder.build(out)
    assert a.page_ids == {"full": [1, 2]} and b.page_ids == {"full": [3]}
    assert ints(batch.input_ids) == list(range(100, 106)) + [200, 201]
    assert ints(batch.positions) == [0, 1, 2, 3, 4, 5, 0, 1]
    assert ints(batch.slot_mappings["full"]) == [4, 5, 6, 7, 8, 9, 12, 13]
    assert ints(batch.page_tables["full"]) == [[1, 2], [3, 0]]
    assert ints(batch.seq_lens) == [6, 2] and ints(batch.cu_seqlens_q) == [0, 6, 8]
    assert (
        batch.max_query_len == 6 and ints(batch.logits_indices) == [] and not batch.is_decode_only
    )
    assert batch.input_ids.dtype == torch.int64 and batch.slot_mappings["full"].dtype == torch.int64
    assert batch.page_tables["full"].dtype == torch.int32 and batch.seq_lens.dtype == torch.int32
    assert batch.cu_seqlens_q.dtype == torch.int32 and batch.logits_indices.dtype == torch.int64
    sched.update(out, [])

    out = (
        sched.schedule()
    )  # a: [6, 10) into a new third page, b: [2, 3); both complete their prompt
    batch = builder.build(out)
    assert a.page_ids == {"full": [1, 2, 4]}
    assert ints(batch.input_ids) == [106, 107, 108, 109, 202]
    assert ints(batch.positions) == [6, 7, 8, 9, 2]
    assert ints(batch.slot_mappings["full"]) == [10, 11, 16, 17, 14]
    assert ints(batch.page_tables["full"]) == [[1, 2, 4], [3, 0, 0]]
    assert ints(batch.seq_lens) == [10, 3] and ints(batch.cu_seqlens_q) == [0, 4, 5]
    assert ints(batch.logits_indices) == [3, 4]
    sched.update(out, [71, 72])

    out = sched.schedule()  # decode: one token each, at positions 10 and 3
    batch = builder.build(out)
    assert ints(batch.input_ids) == [71, 72] and ints(batch.positions) == [10, 3]
    assert ints(batch.slot_mappings["full"]) == [18, 15]
    assert ints(batch.page_tables["full"]) == [[1, 2, 4], [3, 0, 0]]
    assert ints(batch.seq_lens) == [11, 4] and ints(batch.cu_seqlens_q) == [0, 1, 2]
    assert ints(batch.logits_indices) == [0, 1] and batch.is_decode_only


def test_only_requests_completing_their_tokens_are_sampled() -> None:
    kv = tiny_kv(page_size=4, reuse_policy="none")
    sched = tiny_scheduler(kv, prefill_chunk_size=4)
    builder = BatchBuilder(4, sched.config.max_pages_per_seq)
    long, short = make_request("long", 9), make_request("short", 2)
    sched.add_request(long)
    sched.add_request(short)
    out = sched.schedule()
    assert out.sample == [False, True]
    assert ints(builder.build(out).logits_indices) == [5]  # the last row of "short"


def test_page_table_rows_sync_release_and_grow() -> None:
    rows = PageTableRows(["full"], max_pages_per_seq=4, num_rows=2)
    table = lambda: rows.tables["full"]  # noqa: E731 (the table is replaced when it grows)
    reqs = [make_request(f"r{i}", 3) for i in range(3)]
    for i, r in enumerate(reqs):
        r.page_ids = {"full": [10 * i + 1]}
    assert [rows.row(r) for r in reqs] == [0, 1, 2]  # the third row grows the table
    assert table().shape == (4, 4) and len(rows) == 3
    reqs[1].page_ids = {"full": [11, 12, 13]}
    assert rows.row(reqs[1]) == 1
    assert table()[:3].tolist() == [[1, 0, 0, 0], [11, 12, 13, 0], [21, 0, 0, 0]]
    rows.release("r1")
    assert table()[1].tolist() == [0, 0, 0, 0] and len(rows) == 2
    rows.row(reqs[1])
    assert table()[1].tolist() == [11, 12, 13, 0]  # re-added after release: rewritten
    reqs[1].page_ids = {"full": [7]}  # fewer pages than synced: rewritten, not appended to
    rows.row(reqs[1])
    assert table()[1].tolist() == [7, 0, 0, 0]
    rows.release("unknown")  # late releases are a no-op


def test_window_rows_show_released_pages_as_null() -> None:
    rows = PageTableRows(["full", "swa_8"], max_pages_per_seq=6, num_rows=2)
    r = make_request("r", 3)
    r.page_ids = {"full": [1, 2, 3], "swa_8": [4, 5, 6]}
    assert rows.row(r) == 0
    r.page_ids = {"full": [1, 2, 3, 7, 8], "swa_8": [0, 0, 6, 4, 5]}  # two released, reused
    rows.row(r)
    assert rows.tables["full"][0].tolist() == [1, 2, 3, 7, 8, 0]
    assert rows.tables["swa_8"][0].tolist() == [0, 0, 6, 4, 5, 0]
    r.page_ids = {"full": [1, 2, 3, 7, 8], "swa_8": [0, 0, 0, 4, 5]}  # one more released
    rows.row(r)
    assert rows.tables["swa_8"][0].tolist() == [0, 0, 0, 4, 5, 0]
    rows.release("r")
    assert rows.tables["swa_8"][0].tolist() == [0] * 6


def test_batch_has_a_page_table_and_slots_per_group() -> None:
    builder = BatchBuilder(4, 8, groups=["full", "swa_4"])
    r = make_request("r", list(range(12)))
    r.num_computed_tokens = 8  # a chunk of 4 new tokens at positions 8..11
    r.page_ids = {"full": [1, 2, 3], "swa_4": [0, 5, 6]}  # the window's page 0 was released
    out = SchedulerOutput()
    out.add(r, 4)
    batch = builder.build(out)
    assert ints(batch.page_tables["full"]) == [[1, 2, 3]]
    assert ints(batch.page_tables["swa_4"]) == [[0, 5, 6]]
    assert ints(batch.slot_mappings["full"]) == [12, 13, 14, 15]
    assert ints(batch.slot_mappings["swa_4"]) == [24, 25, 26, 27]


def test_released_rows_are_reused_with_fresh_pages() -> None:
    kv = tiny_kv(page_size=4, reuse_policy="none")
    sched = tiny_scheduler(kv)
    builder = BatchBuilder(4, sched.config.max_pages_per_seq)
    first = make_request("first", 8, max_tokens=1)
    sched.add_request(first)
    out = sched.schedule()
    builder.release(out.released_ids)
    builder.build(out)
    sched.update(out, [5])
    second = make_request("second", 3)
    sched.add_request(second)
    out = sched.schedule()
    assert out.released_ids == ["first"]
    builder.release(out.released_ids)
    batch = builder.build(out)
    assert ints(batch.page_tables["full"]) == [second.page_ids["full"]] and len(builder.rows) == 1


def test_empty_output_cannot_be_built() -> None:
    builder = BatchBuilder(4, 8)
    try:
        builder.build(SchedulerOutput())
    except ValueError as e:
        assert "without requests" in str(e)
    else:
        raise AssertionError("expected ValueError")
