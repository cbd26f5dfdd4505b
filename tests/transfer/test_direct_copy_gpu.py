"""DirectCopier (transfer/direct_copy.py) on a GPU, in one process: copies from pinned id slots are
exact, slots are reused only once their pull has ended and their copy has completed, and a pull that
finds no free slot still copies exactly through the upload path. Cross-process reads are in
test_direct_read_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PAGE = 64 << 10


def _pools() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    # P's pool on GPU 0 and ours on the last GPU: over NVLink when there are two.
    gen = torch.Generator(device="cuda:0").manual_seed(3)
    src = torch.randint(0, 256, (300, PAGE), dtype=torch.uint8, device="cuda:0", generator=gen)
    dst_device = f"cuda:{torch.cuda.device_count() - 1}"
    dst = torch.zeros((300, PAGE), dtype=torch.uint8, device=dst_device)
    # Peer access both ways, as opening IPC pools gives (our GPU's kernel reads P's memory); through
    # scratch tensors, so that the pools' null page stays untouched.
    a, b = torch.zeros(1, device=src.device), torch.zeros(1, device=dst_device)
    b.copy_(a)
    a.copy_(b)
    return {"full": src}, {"full": dst}


def _plan(n: int, rng: np.random.Generator, taken: set[int] | None = None):
    """A plan of ``n`` scattered pages; with ``taken``, onto destination pages no other plan of the
    test writes (copies in flight together must not overwrite each other's pages)."""
    from transfer.plan import DirectPlan

    s = rng.permutation(299)[:n].astype(np.int64) + 1
    free = np.array(sorted(set(range(1, 300)) - (taken or set())), dtype=np.int64)
    d = rng.permutation(free)[:n]
    if taken is not None:
        taken.update(d.tolist())
    return DirectPlan((("full", "full", s, d),), n * PAGE), s, d


def _exact(src: dict, dst: dict, s: np.ndarray, d: np.ndarray) -> bool:
    got = dst["full"][torch.from_numpy(d).to(dst["full"].device)]
    return torch.equal(got.cpu(), src["full"][torch.from_numpy(s).cuda(0)].cpu())


def test_copies_are_exact_and_slots_wait_for_their_pulls() -> None:
    from transfer.direct_copy import DirectCopier

    src, dst = _pools()
    device = dst["full"].device
    copier = DirectCopier(device, capacity=300, slots=2)
    copies: dict = {}
    rng = np.random.default_rng(4)
    held = []
    taken: set[int] = set()
    for n in (5, 120):  # both slots held by pulls that have not ended
        plan, s, d = _plan(n, rng, taken)
        queued = copier.start(plan, copies, src, dst)
        held.append((queued, s, d))
    plan, s, d = _plan(33, rng, taken)
    fallback = copier.start(plan, copies, src, dst)  # no slot free: ids are uploaded
    fallback.event.synchronize()
    assert _exact(src, dst, s, d)
    for queued, s, d in held:
        queued.event.synchronize()
        assert _exact(src, dst, s, d)
    assert copier._take(1) is None  # done copying, but their pulls have not ended
    first = held[0][0]._slot
    held[0][0].release()
    slot = copier._take(1)
    assert slot is not None and slot is first
    slot.held = False
    for n in (1, 7, 299):  # slots reused, the prepared launch called directly
        plan, s, d = _plan(n, rng)
        queued = copier.start(plan, copies, src, dst)
        queued.event.synchronize()
        queued.release()
        assert _exact(src, dst, s, d)
    assert set(copies) == {("full", "full")}
    assert int(dst["full"][0].count_nonzero()) == 0  # the null page was never written


def test_a_launch_that_fails_midway_releases_its_slot() -> None:
    from transfer.direct_copy import DirectCopier
    from transfer.plan import DirectPlan

    src, dst = _pools()
    other = torch.zeros((10, PAGE // 2), dtype=torch.uint8, device=dst["full"].device)
    rows_d = {"full": dst["full"], "half": other}
    copier = DirectCopier(dst["full"].device, capacity=400, slots=1)
    rng = np.random.default_rng(5)
    plan, s, d = _plan(12, rng)
    # The second pair's pools differ in page size: preparing its launch fails after the first
    # pair's copy was queued.
    bad = DirectPlan(plan.pairs + (("full", "half", s[:2], d[:2] % 10),), plan.total_bytes)
    with pytest.raises(ValueError):
        copier.start(bad, {}, src, rows_d)
    torch.cuda.synchronize(dst["full"].device)  # the model stream was ordered after the copy
    assert _exact(src, dst, s, d)
    slot = copier._take(1)
    assert slot is not None  # released, and its copy done


def _access(src: dict[str, torch.Tensor]):
    """P's side of a link as D holds it (no lease board: start_pages does not read it), and both
    page tables (a 64 KiB-page pool of 300 pages per pool in ``src``)."""
    from kvcache.spec import PoolGroupSpec
    from transfer.page_table import PageTable
    from transfer.peer import DirectAccess

    # 4 layers x K,V x 16 tokens x 2 heads x 64 x 4 bytes = 64 KiB a page.
    specs = [
        PoolGroupSpec(
            name,
            (4 * k, 4 * k + 1, 4 * k + 2, 4 * k + 3),
            300,
            16,
            2,
            64,
            torch.float32,
            pool_role=frozenset({f"key_{name}", f"value_{name}"}),
        )
        for k, name in enumerate(src)
    ]
    table = PageTable.from_specs("m", specs)
    assert {p.page_bytes for p in table.pools} == {PAGE}
    return DirectAccess("cuda_ipc", src, None), table  # type: ignore[arg-type]


def test_start_pages_copies_from_lists_and_arrays_through_the_c_launcher() -> None:
    from kernels import native_launch
    from transfer.direct_copy import DirectCopier

    assert native_launch.module() is not None, "the C launcher must build on the GPU machine"
    src, dst = _pools()
    access, table = _access(src)
    copier = DirectCopier(dst["full"].device, capacity=300, slots=2)
    rng = np.random.default_rng(6)
    for n, skip, as_list in ((1, 0, True), (64, 3, False), (298, 1, True), (17, 0, False)):
        _, s, d = _plan(n, rng)
        s_given = np.concatenate([np.arange(1, skip + 1), s])  # the ticket's first pages skipped
        s_arg = s_given.tolist() if as_list else s_given
        d_arg = d.tolist() if as_list else d
        queued = copier.start_pages(
            access, table, table, {"full": s_arg}, {"full": d_arg}, skip, dst
        )
        assert queued is not None and queued._slot is not None
        ids = queued.ids()[("full", "full")]
        assert ids[0].tolist() == s.tolist() and ids[1].tolist() == d.tolist()
        queued.event.synchronize()
        assert queued.query()  # the same event, through the C launcher's query
        queued.release()
        assert _exact(src, dst, s, d)
    assert access.route and len(access.route.pairs) == 1
    assert int(dst["full"][0].count_nonzero()) == 0


def test_start_pages_declines_what_it_cannot_serve_and_skips_bad_ids() -> None:
    from transfer.direct_copy import DirectCopier

    src, dst = _pools()
    access, table = _access(src)
    copier = DirectCopier(dst["full"].device, capacity=300, slots=1)
    start = lambda s, d, skip=0, pools="full": copier.start_pages(  # noqa: E731
        access, table, table, {pools: s}, {"full": d}, skip, dst
    )
    assert start([1, 2, 3], [4, 5]) is None  # counts differ
    assert start([1, 2], [4, 5], skip=1) is None
    assert start([1, "x"], [4, 5]) is None  # not ints: the caller's checks say why
    assert start([1, 2], [4, 5], pools="other") is None  # pools that do not line up
    assert copier._take(1) is not None  # every refusal gave its slot back
    copier._slots[0].held = False
    before = dst["full"].clone()
    # Out of either pool, or the null page: skipped by the kernel; the good pair is copied.
    queued = start([1, 5000, 7, -3, 0], [9, 10, 300, 11, 12])
    assert queued is not None
    queued.event.synchronize()
    queued.release()
    changed = (dst["full"] != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [9]
    assert torch.equal(dst["full"][9].cpu(), src["full"][1].cpu())


def test_start_pages_pairs_several_pools_with_odd_counts() -> None:
    """Two pool pairs in one read, each longer than the first launched part (HEAD_PAGES): each
    pair's ids start at an even slot index, both parts of both pairs copy exactly, and the stats
    come back per pair."""
    from transfer.direct_copy import DirectCopier

    src, dst = _pools()
    src["other"] = torch.flip(src["full"], dims=(0,)).contiguous()
    dst["other"] = torch.zeros_like(dst["full"])
    access, table = _access(src)
    copier = DirectCopier(dst["full"].device, capacity=700, slots=1)
    rng = np.random.default_rng(8)
    _, s1, d1 = _plan(151, rng)
    _, s2, d2 = _plan(71, rng)
    d2[1] = d2[3]  # a repeated destination page: copied twice, reported by the stats
    queued = copier.start_pages(
        access,
        table,
        table,
        {"full": s1, "other": s2.tolist()},
        {"full": d1.tolist(), "other": d2},
        0,
        dst,
    )
    assert queued is not None
    queued.event.synchronize()
    ids = queued.ids()
    a, b = ids[("full", "full")], ids[("other", "other")]
    assert a.src.tolist() == s1.tolist() and a.dst.tolist() == d1.tolist() and a.repeats == 0
    assert b.src.tolist() == s2.tolist() and b.dst.tolist() == d2.tolist() and b.repeats == 1
    assert (a.src_low, a.src_high, a.dst_low, a.dst_high) == (
        s1.min(),
        s1.max(),
        d1.min(),
        d1.max(),
    )
    queued.release()
    assert _exact(src, dst, s1, d1)
    kept = [i for i in range(71) if i not in (1, 3)]  # page d2[1] == d2[3] got one of two
    got = dst["other"][torch.from_numpy(d2[kept]).to(dst["other"].device)].cpu()
    assert torch.equal(got, src["other"][torch.from_numpy(s2[kept]).cuda(0)].cpu())


def test_an_id_that_is_not_an_int_after_the_first_part_fails_the_launch_fenced() -> None:
    """The first HEAD_PAGES pages are launched before the rest's ids are read: a bad id among the
    rest raises RuntimeError (the pull fails), the slot stays fenced behind what was queued, and
    D's model stream waits for it."""
    from transfer.direct_copy import DirectCopier

    src, dst = _pools()
    access, table = _access(src)
    copier = DirectCopier(dst["full"].device, capacity=300, slots=1)
    rng = np.random.default_rng(9)
    _, s, d = _plan(100, rng)
    bad = s.tolist()
    bad[80] = "x"
    with pytest.raises(RuntimeError, match="not an int64"):
        copier.start_pages(access, table, table, {"full": bad}, {"full": d.tolist()}, 0, dst)
    slot = copier._slots[0]
    assert slot.busy and not slot.held
    slot.event.synchronize()
    assert _exact(src, dst, s[:64], d[:64])  # the first part was copied


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize(
    "page,rows,word",
    [((1 << 20) + 1, 2100, 1), ((1 << 20) + 4, 8200, 4), (1 << 21, 8200, 8)],
    ids=["bytes-2.2GB", "int32-past-2^31-elements", "int64-past-2^31-elements"],
)
def test_the_last_pages_of_pools_past_2_31_copy_exactly(page: int, rows: int, word: int) -> None:
    # Pools of 2.2-17 GB, copied in byte, int32 and int64 rows: the row offsets of the last pages
    # exceed 32 bits, and nothing but the pages asked for may be written.
    from transfer.direct_copy import DirectCopier
    from transfer.plan import DirectPlan
    from transfer.staging import word_rows

    src = torch.zeros((rows, page), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros((rows, page), dtype=torch.uint8, device="cuda:1")
    a, b = torch.zeros(1, device="cuda:0"), torch.zeros(1, device="cuda:1")
    b.copy_(a)
    a.copy_(b)
    assert word_rows(src).element_size() == (8 if word == 8 else 1)
    s = np.array([rows - 1, rows - 2, 5, rows - 3], dtype=np.int64)
    d = np.array([rows - 2, 3, rows - 1, rows - 3], dtype=np.int64)
    gen = torch.Generator(device="cuda:0").manual_seed(1)
    for i in s:
        src[int(i)] = torch.randint(
            1, 256, (page,), dtype=torch.uint8, device="cuda:0", generator=gen
        )
    torch.cuda.synchronize(0)
    copier = DirectCopier(torch.device("cuda:1"), capacity=16, slots=2)
    copies: dict = {}
    for _ in range(2):  # the first launch compiles; the second goes through the prepared launch
        queued = copier.start(
            DirectPlan((("full", "full", s, d),), 0), copies, {"full": src}, {"full": dst}
        )
        queued.event.synchronize()
        queued.release()
    for i, j in zip(s, d):
        assert torch.equal(dst[int(j)].cpu(), src[int(i)].cpu()), (i, j)
    written = set(torch.nonzero(dst.amax(dim=1)).flatten().tolist())  # (no pool-sized temporary)
    assert written == set(d.tolist())
