"""Random admit/grow/commit/free sequences against the real manager, checked after every step.

Besides ``check_integrity``, the test plays the model: each computed token writes ``token + 1`` into its
KV slot (layer 0's keys). Then a prefix hit must find exactly the prompt's tokens in the matched pages,
and every live request must still read its own tokens back: no page is reused while held, and a hash
never points at other content.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcache.manager import KVCacheManager
from kvcache.reuse_policy import ReusePolicy
from kvcache.spec import PoolGroupSpec

PAGE_SIZE = 2
# Prompts share stems, so prefix hits, duplicates and evictions of cached pages all happen often.
STEMS = [[], [1, 1, 1, 1], [1, 1, 2, 2, 2], [2, 2, 2, 2, 2, 2]]
TOKENS = st.builds(
    lambda stem, tail: stem + tail,
    st.sampled_from(STEMS),
    st.lists(st.integers(min_value=0, max_value=2), min_size=1, max_size=4),
)


def make_specs(two_groups: bool) -> list[PoolGroupSpec]:
    def spec(name: str, layers: tuple[int, ...], num_pages: int) -> PoolGroupSpec:
        return PoolGroupSpec(name, layers, num_pages, PAGE_SIZE, 1, 1, torch.float32)

    if two_groups:
        return [spec("a", (0,), 9), spec("b", (1,), 7)]
    return [spec("full", (0, 1), 9)]


class ManagerMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(list(ReusePolicy)), two_groups=st.booleans())
    def setup(self, policy: ReusePolicy, two_groups: bool) -> None:
        self.m = KVCacheManager(make_specs(two_groups), policy, "cpu")
        self.tokens: dict[str, list[int]] = {}  # live request -> its sequence so far
        self.computed: dict[str, int] = {}
        self.next_id = 0

    # ---- the "model": KV content of a slot is token + 1 ----
    def _slot_values(self, rid: str, start: int, end: int) -> list[int]:
        out = []
        for g, pages in self.m.page_ids(rid).items():
            k = self.m.layer_cache(self.m.specs[g].layer_ids[0])[0]
            out.append(
                [int(k[pages[i // PAGE_SIZE], i % PAGE_SIZE, 0, 0]) for i in range(start, end)]
            )
        assert all(vals == out[0] for vals in out), f"groups disagree for {rid}: {out}"
        return out[0]

    def _compute(self, rid: str, end: int) -> None:
        for g, pages in self.m.page_ids(rid).items():
            k = self.m.layer_cache(self.m.specs[g].layer_ids[0])[0]
            for i in range(self.computed[rid], end):
                k[pages[i // PAGE_SIZE], i % PAGE_SIZE, 0, 0] = self.tokens[rid][i] + 1
        self.computed[rid] = end

    def _snapshot(self) -> tuple:
        return self.m.stats(), {g: p.free_order() for g, p in self.m._pools.items()}

    # ---- rules ----
    @rule(tokens=TOKENS, chunk=st.integers(min_value=1, max_value=9))
    def admit(self, tokens: list[int], chunk: int) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        match = self.m.match_prefix(tokens)
        assert match.num_tokens % PAGE_SIZE == 0 and match.num_tokens < len(tokens)
        if not self.m.reuse_policy.reuses:
            assert match.num_tokens == 0
        end = min(len(tokens), match.num_tokens + chunk)
        before = self._snapshot()
        if not self.m.allocate_slots(rid, end, match):
            assert self._snapshot() == before and not self.m.has_request(rid)
            return
        self.tokens[rid], self.computed[rid] = list(tokens), match.num_tokens
        assert self._slot_values(rid, 0, match.num_tokens) == [
            t + 1 for t in tokens[: match.num_tokens]
        ]
        self._compute(rid, end)
        self.m.commit(rid, tokens, end, prompt_done=end == len(tokens))

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data(), chunk=st.integers(min_value=1, max_value=4), new_token=st.integers(0, 2))
    def grow(self, data: st.DataObject, chunk: int, new_token: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        if self.computed[rid] == len(self.tokens[rid]):
            self.tokens[rid].append(new_token)  # decode: one generated token
        end = min(len(self.tokens[rid]), self.computed[rid] + chunk)
        before = self._snapshot()
        held = self.m.page_ids(rid)
        if not self.m.allocate_slots(rid, end):
            assert self._snapshot() == before and self.m.page_ids(rid) == held
            return
        self._compute(rid, end)
        self.m.commit(rid, self.tokens[rid], end, prompt_done=end >= len(self.tokens[rid]))

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.free(rid)
        del self.tokens[rid], self.computed[rid]
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
    def live_requests_keep_their_kv(self) -> None:
        for rid, tokens in self.tokens.items():
            assert self._slot_values(rid, 0, self.computed[rid]) == [
                t + 1 for t in tokens[: self.computed[rid]]
            ]
            num_pages = -(-self.computed[rid] // PAGE_SIZE)  # allocation always runs to `computed`
            assert all(len(p) == num_pages for p in self.m.page_ids(rid).values())

    @invariant()
    def stats_add_up(self) -> None:
        for g, s in self.m.stats().groups.items():
            distinct = {p for rid in self.tokens for p in self.m.page_ids(rid)[g]}
            assert s.used == len(distinct) and s.free + s.used == s.total
            assert s.evictable <= s.free and s.peak_used >= s.used


ManagerMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestManagerRandomOps = ManagerMachine.TestCase
