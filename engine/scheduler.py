"""Continuous batching with chunked prefill and preemption by recompute (vLLM v1 style).

One step = ``schedule()`` (decide who computes how many tokens, reserving their pages), a forward
pass, then ``update()`` (advance progress, commit pages for reuse, append sampled tokens, check stop
conditions, free finished requests). Page ownership: a request holds its pages from its admission's
``allocate_slots`` until it finishes, is preempted or aborted (``kv.free``); a prefill-only request
keeps them past its first token until ``release()``.

KV host tier: a request admitted from a prefix hit whose pages are being loaded back from host
memory (``kv.loads_pending``, only on CUDA workers) holds its pages but waits aside in ``loading``
until its own copies landed; every other request keeps running meanwhile.
"""

from __future__ import annotations

import time
from collections import deque

from engine.inflight_pages import InFlightPages
from engine.request import Request, RequestStatus
from engine.scheduler_config import SchedulerConfig
from engine.scheduler_output import SchedulerOutput
from engine.stop_checker import check_stop
from kvcache.manager import KVCacheManager


class Scheduler:
    """Decides each step's batch. Plain class, single-threaded: one step loop owns it.

    Per step, running requests go first, in admission order (decodes and continuing prefill chunks);
    if one cannot get a page, the most recently admitted running request is preempted (pages freed,
    back to the front of the waiting queue, recomputed later) until it can. Then, unless someone was
    preempted, waiting requests are admitted in FIFO order while the token budget, ``max_num_seqs``
    and free pages allow; admission starts from the longest cached prefix.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        if kv.page_size != config.page_size:
            raise ValueError(
                f"SchedulerConfig.page_size={config.page_size} differs from the KV cache's {kv.page_size}"
            )
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: list[Request] = []  # admitted, waiting for their host-tier load-backs
        # prefilled elsewhere (their KV in their pages), waiting for a place under max_num_seqs
        self.ready: deque[Request] = deque()
        # every request the scheduler still knows: waiting, running, or prefilled holding pages
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0  # since construction
        self.inflight = InFlightPages(config.page_size)
        self._reuses = kv.reuse_policy.reuses
        self._released: list[str] = []

    # ---- entries ----
    def add_request(self, request: Request) -> None:
        """Queue a new request (FIFO). Raises ValueError for a duplicate id or a prompt that is too long."""
        self._check_new(request)
        if request.num_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt of request {request.request_id!r} has {request.num_tokens} tokens, more than "
                f"max_model_len={self.config.max_model_len}"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_prefilled_request(self, request: Request, first_token_id: int) -> Request:
        """Start a request whose prompt KV was filled from elsewhere (the decode worker's entry).

        The caller has allocated the request's pages in ``kv`` (``allocate_slots`` for at least the
        prompt) and written the prompt's KV into them. This commits those pages for reuse (context
        finalization), appends ``first_token_id`` (sampled by the prefill worker), and starts the
        request RUNNING with ``num_computed_tokens`` = prompt length, so its next step is a decode.
        It may finish at once (the first token met a stop condition): then its pages are freed.
        It joins the running set while fewer than ``max_num_seqs`` requests compute; otherwise it
        waits aside in ``ready``, its pages held, and joins before any waiting request is
        admitted (the caller gates these requests by free pages, the scheduler by places).
        """
        self._check_new(request)
        if not self.kv.has_request(request.request_id):
            raise ValueError(
                f"request {request.request_id!r} holds no pages: allocate and fill them first"
            )
        self.kv.wait_loads(request.request_id)  # its own prefix hit loaded back from host
        self._sync_pages(request)
        if request.kv_capacity < request.num_prompt_tokens:
            raise ValueError(
                f"request {request.request_id!r} holds pages for {request.kv_capacity} tokens, fewer "
                f"than its {request.num_prompt_tokens} prompt tokens need"
            )
        now = time.time()
        request.num_computed_tokens = request.num_prompt_tokens
        request.metrics.first_scheduled_time = now
        self.kv.commit(request.request_id, request.all_token_ids, request.num_computed_tokens, True)
        request.committed_pages = request.num_computed_tokens // self.config.page_size
        request.committed_prompt = True
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        request.append_output_token(first_token_id, now, sampled_here=False)
        status = check_stop(request, first_token_id, self.config.max_model_len)
        if status is not None:
            self._finish(request, status, now)
        elif self.ready or self.num_running >= self.config.max_num_seqs:
            self.ready.append(request)
        else:
            self.running.append(request)
        return request

    def add_recomputed_request(self, request: Request, first_token_id: int) -> Request:
        """Queue a prefilled request whose prompt KV never arrived (the decode worker's
        ``transfer.on_failure: recompute``): it waits with ``first_token_id`` (sampled by the
        prefill worker) as its first output, so its prefill computes the prompt and that token,
        as a preempted request is recomputed, and samples the next one. It may finish at once
        (the first token met a stop condition)."""
        self.add_request(request)
        now = time.time()
        request.append_output_token(first_token_id, now)
        status = check_stop(request, first_token_id, self.config.max_model_len)
        if status is not None:
            self.waiting.remove(request)
            self._finish(request, status, now)
        return request

    def abort(self, request_id: str, keep_prefilled: bool = False) -> Request | None:
        """Finish a request as aborted and free its pages; None when it is unknown or already done
        (with ``keep_prefilled``, also when it is prefilled and holds its pages for a lease)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if keep_prefilled and request.status is RequestStatus.PREFILLED:
            return None
        if request in self.loading:
            self.loading.remove(request)
        elif request in self.ready:
            self.ready.remove(request)
        elif request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED, time.time())
        return request

    def release(self, request_id: str) -> None:
        """Free the pages that a prefill-only request kept after its first token (transfer done)."""
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.PREFILLED:
            raise ValueError(f"release({request_id!r}): not a prefilled request holding pages")
        del self.requests[request_id]
        self.kv.free(request_id)

    # ---- the step ----
    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts; every scheduled request holds its pages."""
        cfg = self.config
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens
        chunk = cfg.prefill_chunk_size
        if self.loading:
            self._land_loads()
        while self.ready and self.num_running < cfg.max_num_seqs:
            joined = self.ready.popleft()
            # Scheduled now, not when it was added: its wait for a place is its queue time.
            joined.metrics.first_scheduled_time = time.time()
            self.running.append(joined)
        running = self.running  # _reserve_running pops from this same list
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            n = min(len(req.all_token_ids) - computed, chunk, budget)
            total = computed + n
            # Most decode steps need no new page and release none: skip the manager call (the hot
            # path, every step).
            if (
                total > req.kv_capacity or computed >= req.kv_release_at
            ) and not self._reserve_running(i, total, out):
                continue  # running[i] left the running set (preempted or failed); i now names the next
            out.add(req, n)
            budget -= n
            i += 1
        if not out.preempted:  # memory is short: let the running requests drain first
            self._admit(out, budget)
        out.released_ids, self._released = self._released, []
        return out

    def _land_loads(self) -> None:
        """Requests whose load-backs landed join the running set (in admission order)."""
        self.kv.poll_loads()
        ready = [r for r in self.loading if not self.kv.loads_pending(r.request_id)]
        if ready:
            self.loading = [r for r in self.loading if r not in ready]
            self.running.extend(ready)

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in FIFO order, each from its longest cached prefix.

        A request whose next uncached page is being computed by a running prefill is passed over
        (it keeps its place in the queue) until that prefill has committed the page: a batch of
        prompts sharing a system prompt computes it once. Admission stops at the first request
        that does not get its pages, so memory is handed out in FIFO order.
        """
        cfg = self.config
        now = time.time()
        passed_over: list[Request] = []
        while (
            self.waiting and budget > 0 and len(self.running) + len(self.loading) < cfg.max_num_seqs
        ):
            req = self.waiting[0]
            if not self.kv.fits_alone(req.num_tokens, cfg.prefill_chunk_size):
                self.waiting.popleft()
                self._finish_never_fits(req, req.num_tokens, now)
                out.finished.append(req)
                continue
            # (a request scoring its prompt computes every position: a cached one has no logits)
            reads_cache = self._reuses and not req.wants_prompt_logits
            prefix = self.kv.match_prefix(req.all_token_ids, read=reads_cache)
            if reads_cache and self.inflight.first_uncached_page_in_flight(req, prefix):
                passed_over.append(self.waiting.popleft())
                continue
            n = min(req.num_tokens - prefix.num_tokens, cfg.prefill_chunk_size, budget)
            if not self.kv.allocate_slots(
                req.request_id,
                prefix.num_tokens + n,
                prefix,
                num_computed_tokens=prefix.num_tokens,
                # (a lookup that may not read is no query of the cache: not in its hit rate)
                count_reuse=req.metrics.num_preemptions == 0 and not req.wants_prompt_logits,
            ):
                break
            self.waiting.popleft()
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
                req.metrics.num_cached_tokens = prefix.num_tokens
                req.metrics.num_cached_host_tokens = prefix.num_host_tokens
            req.num_computed_tokens = prefix.num_tokens
            self._sync_pages(req)
            req.status = RequestStatus.RUNNING
            if self.kv.loads_pending(req.request_id):
                self.loading.append(req)  # computes once its own pages landed
                if self._reuses:
                    self.inflight.add(req, prefix)
                continue
            self.running.append(req)
            out.add(req, n)
            budget -= n
            if self._reuses:
                self.inflight.add(req, prefix)
        self.waiting.extendleft(reversed(passed_over))

    def update(self, out: SchedulerOutput, sampled_token_ids: list[int]) -> list[Request]:
        """Apply a finished forward pass; return the requests that got a token (finished ones too).

        ``sampled_token_ids`` has one token per request with ``out.sample[i]`` True, in batch order.
        """
        now = time.time()
        ps = self.config.page_size
        max_len = self.config.max_model_len
        changed: list[Request] = []
        left_running = False
        j = 0
        # (in a finally: a request that finished here must leave ``running`` even when a later
        # one raises, or the next step would schedule it over pages it has already freed)
        try:
            for req, n, sample in zip(out.requests, out.num_new_tokens, out.sample, strict=True):
                token = sampled_token_ids[j] if sample else -1
                j += sample
                if req.status is not RequestStatus.RUNNING:
                    continue  # aborted after schedule(): its token is dropped
                req.num_computed_tokens += n
                computed = req.num_computed_tokens
                prompt_done = computed >= len(req.prompt_token_ids)
                # commit is idempotent; calling it only when a page filled up keeps decode steps cheap.
                if computed // ps > req.committed_pages or prompt_done != req.committed_prompt:
                    self.kv.commit(req.request_id, req.all_token_ids, computed, prompt_done)
                    req.committed_pages = computed // ps
                    req.committed_prompt = prompt_done
                if not sample:
                    continue
                if req.request_id in self.inflight:
                    self.inflight.drop(req.request_id)  # prefill done: its pages are committed
                req.append_output_token(token, now)
                status = check_stop(req, token, max_len)
                if status is not None:
                    self._finish(req, status, now)
                    left_running = True
                elif req.prefill_only:
                    req.status = RequestStatus.PREFILLED  # keeps its pages until release()
                    self._released.append(req.request_id)
                    left_running = True
                changed.append(req)
            if j != len(sampled_token_ids):
                raise ValueError(
                    f"update got {len(sampled_token_ids)} sampled tokens for {j} sampling requests"
                )
        finally:
            if left_running:
                self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return changed

    # ---- queries ----
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading or self.ready)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a place: to be admitted, or prefilled elsewhere (``ready``)."""
        return len(self.waiting) + len(self.ready)

    @property
    def num_running(self) -> int:
        """Requests holding pages to compute: running, and loading from the host tier."""
        return len(self.running) + len(self.loading)

    # ---- internals ----
    def _check_new(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.status is not RequestStatus.WAITING or request.output_token_ids:
            raise ValueError(
                f"request {request.request_id!r} is not new (status {request.status.name})"
            )

    def _sync_pages(self, req: Request) -> None:
        """Refresh the request's cached view of its pages after an allocation."""
        rid = req.request_id
        req.page_ids = self.kv.page_ids(rid)
        req.kv_capacity = len(next(iter(req.page_ids.values()))) * self.config.page_size
        req.kv_release_at = self.kv.next_release_at(rid)

    def _reserve_running(self, index: int, num_total_tokens: int, out: SchedulerOutput) -> bool:
        """Make ``running[index]`` hold pages for ``num_total_tokens`` (releasing what its windows
        no longer read), preempting the newest running requests as needed. False when the request
        itself left the running set."""
        req = self.running[index]
        chunk = self.config.prefill_chunk_size
        computed = req.num_computed_tokens
        while not self.kv.allocate_slots(
            req.request_id, num_total_tokens, num_computed_tokens=computed
        ):
            if not self.kv.fits_alone(num_total_tokens, chunk):
                self.running.pop(index)
                self._finish_never_fits(req, num_total_tokens, time.time())
                out.finished.append(req)
                return False
            # Prefilled requests waiting for a place go first: idle, and newer than any running.
            victim = self.ready.pop() if self.ready else self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        self._sync_pages(req)
        return True

    def _preempt(self, req: Request) -> None:
        self.inflight.drop(req.request_id)
        self.kv.free(req.request_id)
        req.reset_for_recompute()
        req.status = RequestStatus.PREEMPTED
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self._released.append(req.request_id)

    def _finish_never_fits(self, req: Request, num_tokens: int, now: float) -> None:
        need = self.kv.max_pages_per_request(num_tokens, self.config.prefill_chunk_size)
        have = {g: spec.usable_pages for g, spec in self.kv.specs.items()}
        if len(need) == 1:
            (g,) = need
            need_text, have_text = f"{need[g]} pages", f"{have[g]} pages"
        else:
            need_text, have_text = f"{need} pages per KV pool group", str(have)
        req.error = (
            f"request {req.request_id!r} needs {need_text} for {num_tokens} tokens, but the KV "
            f"cache has only {have_text}"
        )
        self._finish(req, RequestStatus.FINISHED_ERROR, now)

    def _finish(self, req: Request, status: RequestStatus, now: float) -> None:
        """Mark finished and free pages; the caller removes it from running/waiting."""
        req.status = status
        req.metrics.finished_time = now
        self.inflight.drop(req.request_id)
        self.requests.pop(req.request_id, None)
        self.kv.free(req.request_id)
        self._released.append(req.request_id)
