"""``--reset-prefix-cache``: a cold prefix cache before every run (SGLang's bench ``--flush-cache``).

Before each rate's run the driver asks the server to forget its cached prefixes, host tier too
(``POST /reset_prefix_cache?reset_external=true``: Duet's, and vLLM's when it runs with
``VLLM_SERVER_DEV_MODE=1``), so that a run's prompts find nothing an earlier run or the warm-up
left: rates of one workload compare, and a repeated prompt is computed, not read. A server that
does not offer it, or never gets idle, is the benchmark's error, not a warm run passed off as cold.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import httpx

from cluster.bench.errors import BenchError

# A worker resets only while no request holds pages there (409): the last run's requests may
# still be giving theirs back (a prefill worker's lease ends after the decode worker's notice).
BUSY_RETRY_S = 30.0
BUSY_PAUSE_S = 0.5


async def reset_prefix_cache(
    base_url: str, headers: Mapping[str, str] | None = None, busy_retry_s: float = BUSY_RETRY_S
) -> None:
    """Reset the server's prefix cache; BenchError if it cannot within ``busy_retry_s``."""
    deadline = time.monotonic() + busy_retry_s
    async with httpx.AsyncClient(base_url=base_url, timeout=60.0, headers=dict(headers or {})) as h:
        while True:
            try:
                r = await h.post("/reset_prefix_cache", params={"reset_external": "true"})
            except httpx.HTTPError as exc:
                raise BenchError(
                    f"POST {base_url}/reset_prefix_cache failed: {type(exc).__name__}: {exc}"
                ) from None
            if r.status_code == 200:
                return
            if r.status_code == 409 and time.monotonic() + BUSY_PAUSE_S < deadline:
                await asyncio.sleep(BUSY_PAUSE_S)
                continue
            if r.status_code in (404, 405):
                raise BenchError(
                    f"the server at {base_url} does not offer POST /reset_prefix_cache (vLLM "
                    "serves it only with VLLM_SERVER_DEV_MODE=1); run without --reset-prefix-cache"
                )
            raise BenchError(
                f"the server at {base_url} did not reset its prefix cache (HTTP {r.status_code}): "
                f"{r.text[:300]}"
            )
