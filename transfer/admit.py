"""How the prefill side answers a PullRequest before serving it: ``admit`` checks it against the
request's lease and builds the plan (the lease is SERVING afterwards), or returns the PullError to
refuse it with (the lease unchanged); ``refuse`` sends that answer, first completing the receives D
posted for its first chunks."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from transfer.config import TransceiverConfig
from transfer.leases import Lease, LeaseTable
from transfer.mapper import MapperError
from transfer.messages import PullError, PullRequest
from transfer.page_table import PageTable
from transfer.peer import PeerLink
from transfer.plan import TransferPlan, build_plan
from transfer.serve import drain
from transfer.stats import TransferCounters

log = logging.getLogger(__name__)


def admit(
    leases: LeaseTable,
    page_table: PageTable,
    counters: TransferCounters,
    link: PeerLink,
    req: PullRequest,
    pull_id_in_use: bool,
) -> tuple[TransferPlan, Lease] | PullError:
    """(the plan for ``req``, its lease, now SERVING), or the PullError to answer with."""
    rid = req.request_id

    def error(code: str, reason: str) -> PullError:
        return PullError(rid, req.pull_id, code, reason, False)

    # The credits first, whatever the lease: a refusal completes every credited receive, so a
    # list of repeated or made-up chunks would have P send that many messages.
    if len(set(req.ready_chunks)) != len(req.ready_chunks) or any(
        not 0 <= i < req.num_chunks for i in req.ready_chunks
    ):
        return error(
            "conflict", f"invalid credits {req.ready_chunks[:8]} for {req.num_chunks} chunks"
        )
    pages = sum(len(p) for p in req.dst_page_ids.values())
    if req.num_chunks > pages:
        return error(
            "conflict", f"{req.num_chunks} chunks for {pages} pages (a chunk holds a page at least)"
        )
    counters.expired_leases += len(leases.expire_due())
    lease = leases.get(rid)
    if lease is None:
        return error(*leases.why_missing(rid))
    if lease.gen != req.lease_gen:  # a stale ticket: serving it would leave its ack unheard
        return error(
            "unknown",
            f"the ticket's lease of {rid!r} (generation {req.lease_gen}) ended; the request was "
            f"published again since (generation {lease.gen})",
        )
    if pull_id_in_use:
        return error("conflict", f"pull id {req.pull_id} is already in use")
    if req.src_page_ids != lease.page_ids:
        return error("mismatch", f"the ticket's pages of {rid!r} differ from the published ones")
    if not 0 <= req.skip_pages or any(req.skip_pages > len(p) for p in lease.page_ids.values()):
        return error(
            "mismatch", f"skip_pages {req.skip_pages} exceeds the published pages of {rid!r}"
        )
    # (with piece chunks agreed, P primed its endpoint: it sends every chunk of such a pull as a
    # piece list, never staged, so no staging buffer bounds them)
    agreed = link.info.pull_chunk_bytes
    if req.chunk_bytes != agreed:
        return error("mismatch", f"chunk size {req.chunk_bytes} differs from the agreed {agreed}")
    try:
        src = {g: p[req.skip_pages :] for g, p in lease.page_ids.items()}
        plan = build_plan(page_table, link.info.page_table, src, req.dst_page_ids, req.chunk_bytes)
    except (MapperError, ValueError) as e:
        return error("mismatch", f"cannot map the pages of {rid!r}: {e}")
    if (plan.num_chunks, plan.total_bytes) != (req.num_chunks, req.total_bytes):
        return error(
            "mismatch",
            f"plans differ: ours {plan.num_chunks} chunks / {plan.total_bytes} bytes, "
            f"D's {req.num_chunks} / {req.total_bytes}",
        )
    try:
        leases.begin_serving(rid, lease)
    except (KeyError, ValueError) as e:
        return error("busy", str(e))
    return plan, lease


async def refuse(
    link: PeerLink, req: PullRequest, err: PullError, config: TransceiverConfig
) -> None:
    """Answer a refused pull. D posted receives for its first chunks before asking: complete
    them with empty messages, unless the pull id is taken (they would hit the other pull's)."""
    log.info("pull of %s refused: %s", err.request_id, err.reason)
    try:
        if err.code == "conflict":
            await link.send(err, config.done_deadline_s)
            return
        await asyncio.wait_for(drain(link, req.pull_id, req.ready_chunks), config.chunk_deadline_s)
        await link.send(dataclasses.replace(err, drained=True), config.done_deadline_s)
    except Exception as e:  # ucxx errors are not all ConnectionErrors
        link.abort(f"refusing the pull of {err.request_id} failed: {e!r}")
