"""The pages a decode worker takes for a prefilled request before its KV arrives, and the ones the
pull must fill (DESIGN section 3, gen-init): pages for the prompt plus the next token, allocated
as if the prompt were computed (so a sliding-window group holds only its last window), less what
D's own prefix hit (device or host tier) already covers."""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.manager import KVCacheManager
from kvcache.spec import NULL_PAGE


@dataclass(frozen=True)
class ReceivePlan:
    """What one receive takes: page counts are of the prompt's pages, by pool group name."""

    hit_pages: int  # the prompt pages D's own prefix hit covers
    host_hit_tokens: int  # the tokens of that hit loaded back from D's host tier
    # Per group: the request's first pages that the pull skips (D holds them, or a window
    # group does not need them), and the pages that the pull fills (the rest of the prompt's).
    skip_pages: dict[str, int]
    dst_page_ids: dict[str, list[int]]


def plan_receive(
    kv: KVCacheManager, rid: str, prompt: list[int], queued: int = 0
) -> ReceivePlan | None:
    """Allocate request ``rid``'s pages in ``kv`` (on the engine thread) and say what the pull
    fills; None when the pages are not free now (nothing is taken). A request that holds pages
    here already (a second call for it while the first still receives or runs) is refused: its
    pages would be shared by two pulls and freed under one of them.

    ``queued``: requests already waiting in the engine for pages (preempted ones, or ones being
    prefilled here after a failed transfer). A receive waits behind them (None), first come
    first served as vLLM's one waiting queue serves them: receives took the pages each
    finished request freed before the scheduler's next admission, and under a steady stream of
    transfers a preempted request waited until its token deadline."""
    if kv.has_request(rid):
        raise ValueError(f"request {rid!r} already holds pages on this decode worker")
    if queued:
        return None
    n = len(prompt)
    prefix = kv.match_prefix(prompt)  # D's own hit: device or host tier
    if not kv.allocate_slots(rid, n + 1, prefix, num_computed_tokens=n):
        return None
    # The pull writes the pages outside the model's stream: no offload of a page this
    # allocation evicted may still be reading it (a no-op without a GPU host tier).
    kv.wait_offloads()
    n_hit = prefix.num_tokens // kv.page_size
    n_prompt_pages = -(-n // kv.page_size)
    skips, dst = {}, {}
    for g, pages in kv.page_ids(rid).items():
        first_held = next((i for i, p in enumerate(pages) if p != NULL_PAGE), len(pages))
        skips[g] = min(max(n_hit, first_held), n_prompt_pages)
        dst[g] = pages[skips[g] : n_prompt_pages]
    return ReceivePlan(n_hit, prefix.host_tokens_taken(kv.page_ids(rid)), skips, dst)
