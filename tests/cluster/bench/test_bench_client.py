"""The streaming client against a real HTTP server (cluster/bench/client.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cluster.bench.client import (
    ClientSettings,
    StreamingClient,
    normalize_base_url,
    probe_models,
    request_payload,
)
from cluster.bench.errors import BenchError
from cluster.bench.records import BenchRequest, RequestRecord

MODEL = "tiny-echo"  # what the echo server of conftest.py lists


def send(
    url: str, request: BenchRequest, endpoint: Any = "completions", timeout_s: float = 30.0
) -> RequestRecord:
    settings = ClientSettings(
        base_url=url, model=MODEL, endpoint=endpoint, request_timeout_s=timeout_s
    )

    async def go() -> RequestRecord:
        async with StreamingClient(settings) as client:
            return await client.send(0, request)

    return asyncio.run(go())


def test_completions_stream_with_token_ids(duet_server: Any) -> None:
    record = send(duet_server.url, BenchRequest(prompt=[5, 6, 7], prompt_len=3, output_len=4))
    assert record.success, record.error
    assert record.generated_text == " w0 w1 w2 w3"
    assert len(record.chunk_times) == 4 and record.output_tokens == 4
    assert record.prompt_len == 3
    assert record.response_id.startswith("cmpl-")
    assert record.start < record.chunk_times[0] <= record.chunk_times[-1] <= record.end
    assert record.ttft is not None and record.ttft > 0.0
    assert len(record.itls) == 3


def test_chat_stream_counts_usage_prompt_tokens(duet_server: Any) -> None:
    record = send(
        duet_server.url,
        BenchRequest(prompt="w1 w2 w3 w4 w5", prompt_len=None, output_len=2),
        "chat",
    )
    assert record.success, record.error
    assert record.generated_text == " w0 w1"
    assert record.prompt_len == 5  # from usage.prompt_tokens


def test_a_prompt_of_known_length_is_counted_as_the_workload_says(duet_server: Any) -> None:
    """Input tokens are the workload's count, as `vllm bench serve` counts them: a chat server's
    usage.prompt_tokens includes its template's tokens (here the server says 5)."""
    record = send(
        duet_server.url,
        BenchRequest(prompt="w1 w2 w3 w4 w5", prompt_len=4, output_len=2),
        "chat",
    )
    assert record.success, record.error
    assert record.prompt_len == 4


def test_http_error_is_recorded(duet_server: Any) -> None:
    record = send(duet_server.url, BenchRequest(prompt=[1], prompt_len=1, output_len=13))
    assert not record.success
    assert record.error.startswith("HTTP 500: ") and "injected failure" in record.error


def test_stream_cut_before_done_is_a_failure(duet_server: Any) -> None:
    record = send(duet_server.url, BenchRequest(prompt=[1], prompt_len=1, output_len=14))
    assert not record.success
    assert record.error == "the stream ended before data: [DONE]"
    assert len(record.chunk_times) == 14  # what arrived is kept


def test_error_event_in_stream_is_a_failure(duet_server: Any) -> None:
    record = send(duet_server.url, BenchRequest(prompt=[1], prompt_len=1, output_len=15))
    assert not record.success
    assert "injected stream error" in record.error


def test_unreachable_server_is_recorded(free_port: int) -> None:
    url = f"http://127.0.0.1:{free_port}"
    record = send(url, BenchRequest(prompt=[1], prompt_len=1, output_len=2))
    assert not record.success and record.error.startswith(f"cannot connect to {url}")


def test_request_timeout_is_recorded(start_echo: Any) -> None:
    with start_echo(per_token_s=0.5) as slow:
        record = send(slow.url, BenchRequest(prompt=[1], prompt_len=1, output_len=3), timeout_s=0.1)
    assert not record.success and record.error == "no complete response within 0.1 s"


def test_without_usage_the_tokens_are_counted_from_the_chunks_token_ids(
    duet_server: Any,
) -> None:
    record = send(duet_server.url, BenchRequest(prompt=[1], prompt_len=1, output_len=16))
    assert record.success, record.error
    assert len(record.chunk_times) == 8 and record.output_tokens == 16  # (not 8: the chunks)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_without_token_ids_a_chunk_of_empty_text_is_a_token(start_echo: Any, endpoint: str) -> None:
    """vLLM streams one chunk per token without ids unless asked; a special token's text is
    empty. Each such chunk is a token, as `vllm bench serve` counts it (they were dropped: TTFT
    came late, TPOT low and gaps merged), and a chat stream's role chunk is none."""
    with start_echo(per_token_s=0.01) as server:
        prompt: Any = "w1 w2" if endpoint == "chat" else [1, 2]
        record = send(
            server.url, BenchRequest(prompt=prompt, prompt_len=2, output_len=17), endpoint
        )
    assert record.success, record.error
    assert len(record.chunk_times) == 17 and record.output_tokens == 17
    assert record.generated_text == "".join(f" w{i}" for i in range(17) if i % 3)


def test_with_token_ids_a_chunk_without_ids_is_no_token(duet_server: Any) -> None:
    """Duet's last chunk carries only the finish reason: it is not a token."""
    record = send(duet_server.url, BenchRequest(prompt=[1], prompt_len=1, output_len=18))
    assert record.success, record.error
    assert len(record.chunk_times) == 18 and len(record.itls) == 17


def test_the_request_timeout_bounds_the_whole_request_not_each_read(start_echo: Any) -> None:
    with start_echo(per_token_s=0.3) as slow:  # each read 0.3 s, the whole stream 1.5 s
        record = send(slow.url, BenchRequest(prompt=[1], prompt_len=1, output_len=5), timeout_s=1.0)
    assert not record.success and record.error == "no complete response within 1.0 s"


def test_probe_models(duet_server: Any, free_port: int) -> None:
    assert asyncio.run(probe_models(duet_server.url)) == [MODEL]
    with pytest.raises(
        BenchError, match=f"cannot reach the server at http://127.0.0.1:{free_port}"
    ):
        asyncio.run(probe_models(f"http://127.0.0.1:{free_port}"))


def test_payloads() -> None:
    settings = ClientSettings(base_url="http://x", model="m")
    body = request_payload(settings, BenchRequest(prompt=[1, 2], prompt_len=2, output_len=3))
    assert body == {
        "model": "m",
        "max_tokens": 3,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "prompt": [1, 2],
    }
    chat = ClientSettings(base_url="http://x", model="m", endpoint="chat", ignore_eos=False)
    body = request_payload(chat, BenchRequest(prompt="hi", prompt_len=None, output_len=3))
    assert body["messages"] == [{"role": "user", "content": "hi"}] and "ignore_eos" not in body
    with pytest.raises(ValueError, match="text prompts"):
        request_payload(chat, BenchRequest(prompt=[1], prompt_len=1, output_len=3))


def test_normalize_base_url() -> None:
    assert normalize_base_url("http://h:1/v1/") == "http://h:1"
    assert normalize_base_url("http://h:1") == "http://h:1"
    assert normalize_base_url("http://h:1/v1/chat/completions") == "http://h:1"
    assert normalize_base_url("http://h:1/v1/completions/") == "http://h:1"


def test_e2el_ends_at_the_last_chunk_with_a_choice_not_at_done(start_echo: Any) -> None:
    """As `vllm bench serve` measures it: the usage chunk and [DONE] that come after are no
    latency of the answer (the server here sends them half a second late)."""
    with start_echo(per_token_s=0.001) as server:
        record = send(server.url, BenchRequest(prompt=[1], prompt_len=1, output_len=19))
    assert record.success, record.error
    assert record.last_choice_at == record.chunk_times[-1]
    assert record.e2el == record.last_choice_at - record.start
    assert record.end - record.last_choice_at >= 0.5  # (the tail the server slept)
