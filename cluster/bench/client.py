"""The async OpenAI-compatible client: one streamed request -> one RequestRecord.

It speaks `/v1/completions` and `/v1/chat/completions` with ``stream: true`` (server-sent events)
and stamps every chunk that carries generated tokens with ``time.perf_counter()`` as it arrives
(``_generated``). It asks for `stream_options.include_usage`, and uses the server's token counts
when it gets them.
A request succeeds only if the server answered 200, streamed at least one token and ended the stream
with ``data: [DONE]``; anything else is recorded as a failure with its error, never raised.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

import httpx

from cluster.bench.errors import BenchError
from cluster.bench.records import BenchRequest, RequestRecord

Endpoint = Literal["completions", "chat"]
_PATHS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def normalize_base_url(url: str) -> str:
    """ "http://h:8000/v1/" (or an endpoint's whole URL) -> "http://h:8000": the server root that
    the API paths hang from."""
    url = url.rstrip("/")
    for tail in (*_PATHS.values(), "/v1"):
        if url.endswith(tail):
            return url[: -len(tail)]
    return url


# The body fields the driver sets itself: an --extra-body naming one would change what is measured.
DRIVER_FIELDS = ("model", "prompt", "messages", "max_tokens", "stream", "stream_options")


@dataclass(frozen=True)
class ClientSettings:
    """How requests are sent. ``ignore_eos`` asks the server (a vLLM extension that Duet accepts)
    to generate exactly ``max_tokens`` tokens; turn it off for servers that reject unknown fields.
    ``headers`` go with every request to the server (its API key); ``extra_body`` joins every
    request's body (sampling settings and the like; none of ``DRIVER_FIELDS``)."""

    base_url: str
    model: str
    endpoint: Endpoint = "completions"
    request_timeout_s: float = 300.0
    ignore_eos: bool = True
    temperature: float = 0.0
    headers: Mapping[str, str] = field(default_factory=dict)
    extra_body: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        owned = sorted(set(self.extra_body) & set(DRIVER_FIELDS))
        if owned:
            raise ValueError(f"the extra body may not set {', '.join(owned)}: the driver does")


def request_payload(settings: ClientSettings, request: BenchRequest) -> dict[str, Any]:
    """The JSON body of one streamed request."""
    body: dict[str, Any] = {
        "model": settings.model,
        "max_tokens": request.output_len,
        "temperature": settings.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.ignore_eos:
        body["ignore_eos"] = True
    body.update(settings.extra_body)
    if settings.endpoint == "chat":
        if not isinstance(request.prompt, str):
            raise ValueError(
                "the chat endpoint needs text prompts; give a tokenizer or use the completions endpoint"
            )
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    return body


class StreamingClient:
    """One connection pool for a run; ``send`` may be awaited concurrently."""

    def __init__(self, settings: ClientSettings) -> None:
        self.settings = settings
        self._http: httpx.AsyncClient | None = None

    async def __aenter__(self) -> StreamingClient:
        timeout = httpx.Timeout(
            self.settings.request_timeout_s, connect=min(10.0, self.settings.request_timeout_s)
        )
        # No pool limit: a request waiting for a free connection would add client time to its TTFT.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._http = httpx.AsyncClient(
            base_url=self.settings.base_url,
            timeout=timeout,
            limits=limits,
            headers=dict(self.settings.headers),
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def send(self, index: int, request: BenchRequest) -> RequestRecord:
        """Send one request and read its stream to the end; failures come back in the record."""
        if self._http is None:
            raise RuntimeError("StreamingClient.send outside `async with`")
        record = RequestRecord(
            index=index, prompt_len=request.prompt_len, max_tokens=request.output_len
        )
        payload = request_payload(self.settings, request)
        record.start = time.perf_counter()
        try:
            # The whole request, not each read (httpx's timeout: a stream that trickles would
            # never end it).
            async with asyncio.timeout(self.settings.request_timeout_s):
                async with self._http.stream(
                    "POST", _PATHS[self.settings.endpoint], json=payload
                ) as response:
                    if response.status_code != 200:
                        body = (await response.aread()).decode("utf-8", errors="replace")
                        record.error = f"HTTP {response.status_code}: {body[:300]}"
                    else:
                        await self._read_stream(response, record)
        except httpx.ConnectError as exc:
            record.error = f"cannot connect to {self.settings.base_url}: {exc}"
        except (httpx.TimeoutException, TimeoutError):
            record.error = f"no complete response within {self.settings.request_timeout_s} s"
        except httpx.HTTPError as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        record.end = time.perf_counter()
        return record

    async def _read_stream(self, response: httpx.Response, record: RequestRecord) -> None:
        texts: list[str] = []
        usage_tokens: int | None = None
        tokens_seen = 0  # without usage: the chunks' token ids where given, else one per chunk
        done = False
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments (":"), event names
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                done = True
                break
            arrival = time.perf_counter()
            try:
                event = json.loads(data)
            except json.JSONDecodeError:
                record.error = f"bad SSE data from the server: {data[:200]!r}"
                return
            if not isinstance(event, dict):
                record.error = f"bad SSE event (not an object): {data[:200]!r}"
                return
            if "error" in event:
                record.error = f"server error in stream: {json.dumps(event['error'])[:300]}"
                return
            record.response_id = record.response_id or str(event.get("id", ""))
            usage = event.get("usage")
            if isinstance(usage, dict):  # (a count that is not a number is not taken)
                if isinstance(completion := usage.get("completion_tokens"), int):
                    usage_tokens = completion
                # The workload's own count where it has one, as vLLM counts input tokens (the
                # server's includes a chat template's); the server's only where it has none.
                prompt = usage.get("prompt_tokens")
                if isinstance(prompt, int) and record.prompt_len is None:
                    record.prompt_len = prompt
            if event.get("choices"):
                record.last_choice_at = arrival
            for choice in event.get("choices") or []:
                if not isinstance(choice, dict):
                    record.error = f"bad SSE choice (not an object): {data[:200]!r}"
                    return
                text, tokens = _generated(choice, self.settings.endpoint)
                if tokens:
                    record.chunk_times.append(arrival)
                    texts.append(text)
                    tokens_seen += tokens
        record.generated_text = "".join(texts)
        record.output_tokens = usage_tokens if usage_tokens is not None else tokens_seen
        if not done:
            record.error = "the stream ended before data: [DONE]"
        elif not record.chunk_times:
            record.error = "the stream ended without any generated text"
        else:
            record.success = True


def _generated(choice: dict[str, Any], endpoint: Endpoint) -> tuple[str, int]:
    """(its text, the generated tokens it carries) of one streamed choice: its token ids', else
    one for a chunk with text.

    A server that sends token ids (Duet, vLLM with return_token_ids) says which chunks carry
    tokens: those with ids, text or not (text held back for a stop string or an incomplete
    character). Without ids every chunk with a text field counts, empty or not, as
    `vllm bench serve` counts it: a token whose text is empty (a special token, part of a
    character) is still a token, and a reasoning model's thinking is streamed apart from the
    content. A chat chunk that only names the role carries none.
    """
    if endpoint == "completions":
        text = choice.get("text")
        has_text = isinstance(text, str)
    else:
        delta = choice.get("delta") or {}
        text = delta.get("content")
        thinking = delta.get("reasoning_content") or delta.get("reasoning")
        has_text = bool(text or thinking) or (isinstance(text, str) and "role" not in delta)
    text = text if isinstance(text, str) else ""
    ids = choice.get("token_ids")
    return text, len(ids) if isinstance(ids, list) else int(has_text)


async def probe_models(
    base_url: str, timeout_s: float = 10.0, headers: Mapping[str, str] | None = None
) -> list[str]:
    """The model ids the server lists at /v1/models, or [] if it lists none.

    Raises BenchError when nothing answers at ``base_url``: the first thing a user should hear.
    """
    try:
        async with httpx.AsyncClient(
            base_url=base_url, timeout=timeout_s, headers=dict(headers or {})
        ) as http:
            response = await http.get("/v1/models")
    except httpx.ConnectError as exc:
        raise BenchError(
            f"cannot reach the server at {base_url} ({exc}); is it running, and is the URL "
            "right? (--ready-check-timeout-sec waits for one still starting)",
            unreachable=True,
        ) from None
    except httpx.TimeoutException:
        raise BenchError(
            f"the server at {base_url} did not answer GET /v1/models within {timeout_s} s",
            unreachable=True,
        ) from None
    except httpx.HTTPError as exc:
        raise BenchError(f"GET {base_url}/v1/models failed: {type(exc).__name__}: {exc}") from None
    if response.status_code in (401, 403):
        keyed = any(k.lower() == "authorization" for k in headers or {})
        said = "the API key given" if keyed else "a request without an API key"
        raise BenchError(
            f"the server at {base_url} refused {said} (HTTP {response.status_code} on "
            "GET /v1/models): give --api-key (or OPENAI_API_KEY)"
        )
    if response.status_code != 200:
        return []
    try:
        return [str(m["id"]) for m in response.json().get("data", [])]
    except (ValueError, KeyError, TypeError, AttributeError):
        return []
