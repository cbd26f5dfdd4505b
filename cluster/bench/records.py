"""The typed records of a benchmark: what a workload asks and what the client saw of each request."""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.bench.metrics import tpot

# A prompt is text (sent as-is) or token ids (sent as `prompt: list[int]` to /v1/completions, so its
# length in tokens is exact whatever the server's tokenizer does to text).
Prompt = str | list[int]


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload.

    ``prompt_len`` is the prompt's length in tokens when the workload knows it (token-id prompts, or
    text counted with a tokenizer); None when only the server can tell (its `usage.prompt_tokens`).
    ``output_len`` is sent as `max_tokens`. ``after``: the index (in the workload) of the request
    this one follows, a conversation's previous turn: it is sent once that one ended, and not
    before its own arrival time.
    """

    prompt: Prompt
    prompt_len: int | None
    output_len: int
    prefix_group: int | None = None  # shared-prefix: its group; multi-turn: its conversation
    after: int | None = None


@dataclass(frozen=True)
class ServerTimings:
    """Per-request disaggregated timings reported by a Duet server at /perf_metrics.

    Times are seconds, bytes are bytes; a field the server did not report is None.
    """

    prefill_queue_s: float | None = None  # waiting on the prefill worker before its first chunk ran
    prefill_s: float | None = None  # prefill compute, first chunk start to first token
    transfer_s: float | None = None  # KV pull, D's pull request to the checked TransferDone
    transfer_bytes: int | None = None  # KV bytes moved P -> D
    decode_queue_s: float | None = None  # KV landed on D to the first decode step that included it
    prompt_tokens: int | None = None
    # Prompt tokens the prefilling worker found in its prefix cache, by where: its KV pool
    # ("device") or its KV host tier ("host").
    cached_tokens_by_medium: dict[str, int] | None = None
    prefilled_on_decode: bool | None = None  # no prefill worker: D prefilled it (local path)


@dataclass
class RequestRecord:
    """What the client observed of one request.

    All times are ``time.perf_counter()`` seconds of the benchmarking process. ``chunk_times`` holds
    the arrival of every streamed chunk that carried generated text; the first one ends TTFT.
    ``output_tokens`` is the server's `usage.completion_tokens` when it reported usage, otherwise the
    number of such chunks (one token per chunk, as OpenAI-compatible servers stream by default).
    """

    index: int  # position in the workload
    prompt_len: int | None
    max_tokens: int
    start: float = 0.0  # when the request was sent (after any concurrency wait)
    end: float = 0.0  # when the stream ended or the request failed
    last_choice_at: float = 0.0  # the arrival of the last chunk with a choice (0.0: none came)
    success: bool = False
    error: str = ""
    response_id: str = ""  # the `id` of the streamed chunks: the key to join /perf_metrics
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    generated_text: str = ""
    server: ServerTimings | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token in seconds; None for a failed request or one without tokens."""
        if not self.success or not self.chunk_times:
            return None
        return self.chunk_times[0] - self.start

    @property
    def itls(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive chunks, in seconds."""
        if not self.success:
            return []
        times = self.chunk_times
        return [later - earlier for earlier, later in zip(times, times[1:], strict=False)]

    @property
    def e2el(self) -> float | None:
        """End-to-end latency in seconds, send to the last chunk with a choice (the last tokens or
        the finish reason), as `vllm bench serve` measures it: not the usage chunk, the
        ``[DONE]`` or the connection's close after it. None for a failed request."""
        if not self.success:
            return None
        return (self.last_choice_at or self.end) - self.start

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, in seconds (see ``metrics.tpot``): from the first
        token to the end of ``e2el`` (the last chunk with a choice, a finish-only one included), as
        `vllm bench serve`'s (latency - ttft) / (tokens - 1)."""
        if not self.success or not self.chunk_times:
            return None
        last = max(self.last_choice_at, self.chunk_times[-1])
        return tpot(self.chunk_times[0], last, self.output_tokens)
