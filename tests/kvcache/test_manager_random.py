"""Random admit/receive/grow/commit/free sequences against the real manager, checked after every step,
over mixed pool groups (full attention, sliding windows, both), with and without scratch reuse, with
and without a host tier beneath the groups (both tiers checked: a hit on a host page finds the
prompt's tokens there, and the page loaded back holds them).

Besides ``check_integrity``, the test plays the model: each computed token writes a value of its whole
prefix (``kv_value``: the KV of position i depends on tokens 0..i, as a model's does) into its KV slot
(layer 0's keys of each group). Then a prefix hit must find exactly the prompt's prefixes in the
matched pages, and every live request must still read its own back wherever its group holds them,
which must include everything its window reads: no page is reused while held, a hash never points
at other content (not even the same tokens after another context), and a window never loses a page
it still needs.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcache.manager import KVCacheManager
from kvcache.prefix_match import PrefixMatch
from kvcache.reuse_policy import ReusePolicy
from kvcache.sliding_window import first_needed_page
from kvcache.spec import NULL_PAGE, PoolGroupSpec

PAGE_SIZE = 2
# Prompts share stems, so prefix hits, duplicates and evictions of cached pages all happen often.
STEMS = [[], [1, 1, 1, 1], [1, 1, 2, 2, 2], [2, 2, 2, 2, 2, 2], [1, 1, 2, 2, 2, 2, 1, 1, 2, 2]]
TOKENS = st.builds(
    lambda stem, tail: stem + tail,
    st.sampled_from(STEMS),
    st.lists(st.integers(min_value=0, max_value=2), min_size=1, max_size=8),
)
# name -> (window, pages); layer ids are assigned in order.
LAYOUTS: dict[str, list[tuple[str, int | None, int]]] = {
    "full": [("full", None, 11)],
    "two_full": [("a", None, 11), ("b", None, 9)],
    "hybrid": [("full", None, 14), ("swa_3", 3, 7)],
    "window_only": [("swa_4", 4, 7)],
    "two_windows": [("full", None, 14), ("swa_2", 2, 6), ("swa_5", 5, 8)],
    # Small device pools: prefixes leave the device soon, so host hits are frequent with a tier.
    "small_full": [("full", None, 7)],
    "small_hybrid": [("full", None, 8), ("swa_3", 3, 7)],
}


def kv_value(tokens: list[int], i: int) -> int:
    """What the "model" writes at position ``i``: a function of tokens 0..i (not of token i
    alone), exact in float32."""
    return hash(tuple(tokens[: i + 1])) % (1 << 23) + 1


def make_specs(layout: str) -> list[PoolGroupSpec]:
    return [
        PoolGroupSpec(name, (i,), pages, PAGE_SIZE, 1, 1, torch.float32, sliding_window=window)
        for i, (name, window, pages) in enumerate(LAYOUTS[layout])
    ]


class ManagerMachine(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(list(ReusePolicy)),
        layout=st.sampled_from(sorted(LAYOUTS)),
        scratch=st.booleans(),
        host_pages=st.sampled_from([None, 1, 3, 8]),
    )
    def setup(
        self, policy: ReusePolicy, layout: str, scratch: bool, host_pages: int | None
    ) -> None:
        specs = make_specs(layout)
        tier = None if host_pages is None else {s.name: host_pages for s in specs}
        if tier is not None and not policy.reuses:
            tier = None  # nothing is ever reusable: engines refuse a tier without reuse
        self.m = KVCacheManager(specs, policy, "cpu", scratch, tier)
        self.m.enable_events()
        # What the events say each tier can find, per group (a router's view of this manager).
        self.seen: dict[tuple[str, str], set[int]] = {}
        self.tokens: dict[str, list[int]] = {}  # live request -> its sequence so far
        self.computed: dict[str, int] = {}
        self.read_from: dict[str, int] = {}  # computed tokens at its last allocation
        self.history: list[list[int]] = [[1, 1, 2, 2]]  # sequences admitted so far (to extend)
        self.next_id = 0

    # ---- the "model": KV content of a slot is kv_value of its prefix ----
    def _cache(self, g: str) -> torch.Tensor:
        return self.m.layer_cache(self.m.specs[g].layer_ids[0])[0]

    def _held_values(self, rid: str, g: str, start: int, end: int) -> dict[int, int]:
        """position -> value of the positions in [start, end) that group ``g`` holds for ``rid``."""
        pages, k = self.m.page_ids(rid)[g], self._cache(g)
        return {
            i: int(k[pages[i // PAGE_SIZE], i % PAGE_SIZE, 0, 0])
            for i in range(start, end)
            if pages[i // PAGE_SIZE] != NULL_PAGE
        }

    def _write(self, rid: str, start: int, end: int) -> None:
        for g, pages in self.m.page_ids(rid).items():
            k = self._cache(g)
            for i in range(start, end):
                if pages[i // PAGE_SIZE] != NULL_PAGE:
                    k[pages[i // PAGE_SIZE], i % PAGE_SIZE, 0, 0] = kv_value(self.tokens[rid], i)

    def _snapshot(self) -> tuple:
        tier = self.m.host_tier
        host = {g: p.drop_order() for g, p in tier.pools.items()} if tier is not None else {}
        return self.m.stats(), {g: p.free_order() for g, p in self.m._pools.items()}, host

    def _check_hit(self, tokens: list[int], match: PrefixMatch) -> None:
        hit = match.num_tokens
        for g, ids in match.page_ids.items():
            window = self.m.windows[g]
            start = 0 if window is None else max(0, hit - window + 1)
            k = self._cache(g)
            hosted = match.host_pages.get(g, {})
            for i in range(start, hit):  # everything the query at `hit` reads is there
                page = ids[i // PAGE_SIZE]
                if i // PAGE_SIZE in hosted:
                    assert page == NULL_PAGE and self.m.host_tier is not None
                    # [pages, Hkv, layers, 2, ps, D]: head 0, the group's first layer, K
                    host_k = self.m.host_tier.buffers[g][:, 0, 0, 0]
                    value = int(host_k[hosted[i // PAGE_SIZE], i % PAGE_SIZE, 0])
                else:
                    assert page != NULL_PAGE, (g, i, ids)
                    value = int(k[page, i % PAGE_SIZE, 0, 0])
                assert value == kv_value(tokens, i), (g, i, hosted)

    def _new(self, tokens: list[int]) -> tuple[str, object]:
        rid = f"r{self.next_id}"
        self.next_id += 1
        match = self.m.match_prefix(tokens)
        assert match.num_tokens % PAGE_SIZE == 0 and match.num_tokens < len(tokens)
        if not self.m.reuse_policy.reuses:
            assert match.num_tokens == 0
        self._check_hit(tokens, match)
        return rid, match

    # ---- rules ----
    @rule(tokens=TOKENS, chunk=st.integers(min_value=1, max_value=9))
    def admit(self, tokens: list[int], chunk: int) -> None:
        self._admit(tokens, chunk)

    @rule(
        data=st.data(),
        tail=st.lists(st.integers(0, 2), min_size=1, max_size=10),
        chunk=st.integers(min_value=1, max_value=6),
    )
    def extend(self, data: st.DataObject, tail: list[int], chunk: int) -> None:
        """A later turn of an earlier conversation: its whole sequence plus more (prefix hits)."""
        self._admit(data.draw(st.sampled_from(self.history)) + tail, chunk)

    @rule(
        data=st.data(),
        tail=st.lists(st.integers(0, 2), min_size=1, max_size=4),
        chunk=st.integers(min_value=1, max_value=6),
    )
    def revisit(self, data: st.DataObject, tail: list[int], chunk: int) -> None:
        """A later turn of one of the oldest conversations: its pages most likely left the device
        (a host-tier hit, when there is a tier)."""
        oldest = self.history[: max(1, len(self.history) // 4)]
        self._admit(data.draw(st.sampled_from(oldest)) + tail, chunk)

    def _admit(self, tokens: list[int], chunk: int) -> None:
        self.history.append(tokens)
        rid, match = self._new(tokens)
        end = min(len(tokens), match.num_tokens + chunk)
        before = self._snapshot()
        if not self.m.allocate_slots(rid, end, match, num_computed_tokens=match.num_tokens):
            assert self._snapshot() == before and not self.m.has_request(rid)
            return
        self.tokens[rid], self.computed[rid] = list(tokens), match.num_tokens
        self.read_from[rid] = match.num_tokens
        self._write(rid, match.num_tokens, end)
        self.computed[rid] = end
        self.m.commit(rid, tokens, end, prompt_done=end == len(tokens))

    @rule(tokens=TOKENS)
    def receive(self, tokens: list[int]) -> None:
        """A decode worker's entry: a whole prompt arrives (filled as a transfer would) plus one
        page position for the next token; only what the windows read is allocated."""
        rid, match = self._new(tokens)
        n = len(tokens)
        if not self.m.allocate_slots(rid, n + 1, match, num_computed_tokens=n):
            assert not self.m.has_request(rid)
            return
        self.tokens[rid], self.read_from[rid] = list(tokens), n
        self._write(rid, match.num_tokens, n)
        self.computed[rid] = n
        self.m.commit(rid, tokens, n, prompt_done=True)
        self.tokens[rid].append(0)  # its first output token, to be computed next

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data(), chunk=st.integers(min_value=1, max_value=4), new_token=st.integers(0, 2))
    def grow(self, data: st.DataObject, chunk: int, new_token: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        if self.computed[rid] == len(self.tokens[rid]):
            self.tokens[rid].append(new_token)  # decode: one generated token
        done = self.computed[rid]
        end = min(len(self.tokens[rid]), done + chunk)
        before = self._snapshot()
        held = self.m.page_ids(rid)
        if not self.m.allocate_slots(rid, end, num_computed_tokens=done):
            assert self._snapshot() == before and self.m.page_ids(rid) == held
            return
        self.read_from[rid] = done
        self._write(rid, done, end)
        self.computed[rid] = end
        self.m.commit(rid, self.tokens[rid], end, prompt_done=end >= len(self.tokens[rid]))

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.free(rid)
        del self.tokens[rid], self.computed[rid], self.read_from[rid]
        assert not self.m.has_request(rid)

    @rule()
    def late_free(self) -> None:
        before = self._snapshot()
        self.m.free("gone")
        assert self._snapshot() == before

    @rule()
    def reset_peak(self) -> None:
        self.m.reset_peak()

    # ---- invariants ----
    @invariant()
    def integrity(self) -> None:
        self.m.check_integrity()

    @invariant()
    def events_tell_what_each_tier_can_find(self) -> None:
        for event in self.m.drain_events():
            blocks = self.seen.setdefault((event.group, event.medium), set())
            for h in event.block_hashes:
                if event.kind == "stored":
                    assert h not in blocks, event
                    blocks.add(h)
                else:
                    blocks.remove(h)
        for g, by_medium in self.m.cached_blocks().items():
            for medium, hashes in by_medium.items():
                assert self.seen.get((g, medium), set()) == set(hashes), (g, medium)

    @invariant()
    def live_requests_keep_their_kv(self) -> None:
        for rid, tokens in self.tokens.items():
            computed = self.computed[rid]
            for g, pages in self.m.page_ids(rid).items():
                window = self.m.windows[g]
                assert len(pages) >= -(-computed // PAGE_SIZE)
                values = self._held_values(rid, g, 0, computed)
                assert values == {i: kv_value(tokens, i) for i in values}, (rid, g)
                if window is not None:  # it holds everything its last step read, and no more
                    first = first_needed_page(self.read_from[rid], window, PAGE_SIZE)
                    assert pages[:first] == [NULL_PAGE] * first and NULL_PAGE not in pages[first:]
                else:
                    assert len(values) == computed

    @invariant()
    def stats_add_up(self) -> None:
        for g, s in self.m.stats().groups.items():
            distinct = {p for rid in self.tokens for p in self.m.page_ids(rid)[g] if p != NULL_PAGE}
            assert s.used == len(distinct) and s.free + s.used == s.total
            assert s.evictable <= s.free and s.peak_used >= s.used
            assert s.peak_evictable >= s.evictable and s.free_low_water <= s.plain_free
            if s.host is not None:
                h = s.host
                assert h.used + h.free == h.total and h.pinned == 0  # CPU load-backs land at once
                assert h.loaded_back * PAGE_SIZE == h.hit_tokens and h.drops <= h.offloaded


ManagerMachine.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestManagerRandomOps = ManagerMachine.TestCase
