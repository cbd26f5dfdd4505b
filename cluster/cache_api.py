"""vLLM's ``POST /reset_prefix_cache``: every worker forgets its cached prefixes, for a cold-cache
measurement (``duet bench --reset-prefix-cache``) or after new weights."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from cluster.http_errors import BadRequest, error_response


def add_cache_routes(app: FastAPI, backend: Any) -> None:
    """``/reset_prefix_cache`` on ``app`` (backend: server.ServingBackend)."""

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(
        reset_running_requests: bool = False, reset_external: bool = False
    ) -> JSONResponse:
        """vLLM's: every worker forgets its cached prefixes (a cold-cache measurement, new
        weights); ``reset_external``: the host tier's too. All or nothing on each worker: one
        where a request holds pages keeps its cache (409 names it)."""
        if reset_running_requests:
            raise BadRequest(
                "reset_running_requests is not supported: a worker resets only while no request "
                "holds pages there (retry once they have finished)",
                "reset_running_requests",
            )
        workers = await backend.reset_prefix_cache(reset_external)
        busy = sorted(w for w, a in workers.items() if a is False)
        lost = "; ".join(f"{w}: {a}" for w, a in sorted(workers.items()) if isinstance(a, str))
        unanswered = f" (no reset on {lost})" if lost else ""
        if busy:
            message = f"requests hold pages on {', '.join(busy)}: their caches were kept"
            return error_response(message + unanswered, 409)
        if lost:
            return error_response(f"not every worker reset its cache{unanswered}", 503)
        return JSONResponse({"reset": True, "workers": sorted(workers)})
