"""vLLM's and OpenAI's request fields at the HTTP edge over a real decode worker: logit_bias and
allowed_token_ids reach the sampler, truncate_prompt_tokens cuts the prompt, and
continuous_usage_stats puts usage in every chunk, usage says the prompt tokens read from the prefix
cache, chat's echo repeats the message the answer goes on with, return_token_ids names the prompt's
ids and each choice's."""

from __future__ import annotations

from tests.cluster.worker_backend import CHAT, MODEL, events


def test_logit_bias_and_allowed_token_ids_reach_the_sampler(http, backend) -> None:
    """OpenAI's logit_bias: JSON keys are strings; +100 on a token makes it every greedy token,
    -100 on the greedy first token makes another first. vLLM's allowed_token_ids."""
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3}
    body |= {"temperature": 0, "ignore_eos": True}
    first = http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"][0]
    forced = http.post("/v1/completions", json=body | {"logit_bias": {"1234": 100}}).json()
    assert forced["choices"][0]["token_ids"] == [1234] * 3
    assert backend.requests[-1].sampling.logit_bias == {1234: 100.0}
    banned = http.post("/v1/completions", json=body | {"logit_bias": {str(first): -100}})
    assert banned.json()["choices"][0]["token_ids"][0] != first
    # vLLM's allowed_token_ids: only these are sampled
    few = http.post("/v1/completions", json=body | {"allowed_token_ids": [11, 1234]}).json()
    assert set(few["choices"][0]["token_ids"]) <= {11, 1234}
    for bad in ([], [49152]):
        r = http.post("/v1/completions", json=body | {"allowed_token_ids": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids"


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(http, backend) -> None:
    """vLLM's truncate_prompt_tokens: the request runs on the prompt's last k tokens (echo shows
    their text); -1 keeps what the model takes; a prompt too long for the model fits after it."""
    text = "one two three four five six seven eight"
    ids = backend.encode(text)
    body = {"model": MODEL, "prompt": text, "max_tokens": 1, "echo": True}
    r = http.post("/v1/completions", json=body | {"truncate_prompt_tokens": 3}).json()
    assert backend.requests[-1].prompt_token_ids.tolist() == ids[-3:]
    assert r["usage"]["prompt_tokens"] == 3
    assert r["choices"][0]["text"].startswith(backend.decode(ids[-3:]))
    chat = CHAT | {"max_tokens": 1, "truncate_prompt_tokens": 2}
    assert http.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens"] == 2
    long = {"model": MODEL, "prompt": [5] * 600, "max_tokens": 1}  # (max_model_len is 512)
    assert http.post("/v1/completions", json=long).status_code == 400
    cut = http.post("/v1/completions", json=long | {"truncate_prompt_tokens": 500})
    assert cut.json()["usage"]["prompt_tokens"] == 500
    for k in (0, -2):
        r = http.post("/v1/completions", json=body | {"truncate_prompt_tokens": k})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(http, backend) -> None:
    """vLLM's continuous_usage_stats (with include_usage): every chunk says its choice's prompt
    and completion tokens so far; the last chunk the whole answer's."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = CHAT | {"max_tokens": 3, "ignore_eos": True, "n": 2, "stream": True}
    chunks = events(http.post("/v1/chat/completions", json=body | {"stream_options": options}).text)
    prompt = chunks[-1]["usage"]["prompt_tokens"]
    seen = {0: 0, 1: 0}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        seen[choice["index"]] += len(choice["token_ids"])
        counts = {k: v for k, v in c["usage"].items() if k != "prompt_tokens_details"}
        assert counts == {
            "prompt_tokens": prompt,
            "completion_tokens": seen[choice["index"]],
            "total_tokens": prompt + seen[choice["index"]],
        }
    assert seen == {0: 3, 1: 3} and chunks[-1]["usage"]["completion_tokens"] == 6
    # without include_usage it asks nothing
    alone = body | {"stream_options": {"continuous_usage_stats": True}}
    assert all("usage" not in c for c in events(http.post("/v1/chat/completions", json=alone).text))


def cached_tokens(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_usage_says_how_many_prompt_tokens_the_prefix_cache_held(http, backend) -> None:
    """OpenAI's prompt_tokens_details.cached_tokens: none for a prompt first seen, its full pages
    (all but its last token's) for the same prompt again; whole and streamed (the usage chunk,
    and with continuous_usage_stats each chunk of a token its choice's), completions and chat;
    summed over a batch's prompts, and a prompt's n choices count it once."""
    page = backend.worker.loop.engine.kv.page_size
    a, b = list(range(1000, 1070)), list(range(2000, 2070))  # (no other test's prompts)
    hit = page * ((len(a) - 1) // page)
    assert hit == 64
    body = {"model": MODEL, "max_tokens": 2, "ignore_eos": True}

    def whole(prompt: list[int] | list[list[int]], **more: object) -> int:
        r = http.post("/v1/completions", json=body | {"prompt": prompt} | more)
        return cached_tokens(r.json()["usage"])

    def streamed(prompt: list[int], **more: object) -> list[dict]:
        options = {"include_usage": True, "continuous_usage_stats": True}
        extra = {"prompt": prompt, "stream": True, "stream_options": options}
        return events(http.post("/v1/completions", json=body | extra | more).text)

    assert (whole(a), whole(a)) == (0, hit)
    first = streamed(b, n=2)  # (one choice may read what the other computed: still none)
    assert cached_tokens(first[-1]["usage"]) == 0
    again = streamed(b, n=2)
    assert cached_tokens(again[-1]["usage"]) == hit  # (once for the prompt, not per choice)
    assert again[-1]["usage"]["prompt_tokens"] == len(b)
    assert all(cached_tokens(c["usage"]) == hit for c in again[:-1])
    assert whole([a, b], n=2) == 2 * hit
    # chat: the whole answer first, then the stream's usage chunk (a system message of its own:
    # the template's default one opens other tests' prompts, cached by then)
    system = {"role": "system", "content": "Zebra quartz umbrella."}
    user = {"role": "user", "content": " ".join(f"word{i}" for i in range(60))}
    chat = {"model": MODEL, "messages": [system, user], "max_tokens": 2}
    r = http.post("/v1/chat/completions", json=chat).json()["usage"]
    assert cached_tokens(r) == 0 and r["prompt_tokens"] > 2 * page
    stream = chat | {"stream": True, "stream_options": {"include_usage": True}}
    last = events(http.post("/v1/chat/completions", json=stream).text)[-1]["usage"]
    assert cached_tokens(last) == page * ((r["prompt_tokens"] - 1) // page)


def test_chat_echo_starts_the_answer_with_the_message_it_continues(http) -> None:
    """vLLM's chat echo: with no new turn opened (add_generation_prompt false) the answer has the
    last message's role and starts with its content, whole and streamed; a new assistant turn
    after a user's message echoes nothing."""
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Bonjour, je"}]
    body = {"model": MODEL, "messages": conv, "max_tokens": 3, "temperature": 0, "n": 2}
    body |= {"ignore_eos": True, "add_generation_prompt": False, "continue_final_message": True}
    plain = http.post("/v1/chat/completions", json=body).json()["choices"]
    echoed = http.post("/v1/chat/completions", json=body | {"echo": True}).json()["choices"]
    for p, e in zip(plain, echoed, strict=True):
        assert (e["message"]["role"], e["message"]["content"]) == (
            "assistant",
            "Bonjour, je" + p["message"]["content"],
        )
    chunks = events(
        http.post("/v1/chat/completions", json=body | {"echo": True, "stream": True}).text
    )
    for i, e in enumerate(echoed):
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"][0]["index"] == i]
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert deltas[1] == {"content": "Bonjour, je"}
        assert "".join(d.get("content", "") for d in deltas) == e["message"]["content"]
    # A new turn (the assistant's, after the user's message): nothing to go on with.
    turn = CHAT | {"max_tokens": 2, "temperature": 0, "ignore_eos": True}
    new = http.post("/v1/chat/completions", json=turn | {"echo": True}).json()["choices"][0]
    assert (
        new["message"]
        == http.post("/v1/chat/completions", json=turn).json()["choices"][0]["message"]
    )
    # The answer goes on with a user's message: it has the user's role.
    user = {"model": MODEL, "messages": [{"role": "user", "content": "Once upon"}], "echo": True}
    user |= {"max_tokens": 2, "add_generation_prompt": False, "continue_final_message": True}
    message = http.post("/v1/chat/completions", json=user).json()["choices"][0]["message"]
    assert message["role"] == "user" and message["content"].startswith("Once upon")
    # Content parts under the Responses API's names are text to the echo as to the template.
    parts = [{"type": "output_text", "text": "Bonjour,"}, {"type": "text", "text": "je"}]
    conv[-1] = {"role": "assistant", "content": parts}
    r = http.post("/v1/chat/completions", json=body | {"echo": True, "messages": conv})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].startswith("Bonjour,\nje")


def test_return_token_ids_names_the_prompts_ids_and_each_choices(http, backend) -> None:
    """vLLM's return_token_ids: completions put the prompt's ids in each choice (a batch: each
    prompt's own), chat beside the choices, with each choice's generated ids; a stream says the
    prompt's once, in each choice's first chunk (chat: the stream's first chunk). Refused as an
    unknown field before."""
    ask = {"max_tokens": 2, "ignore_eos": True, "temperature": 0, "return_token_ids": True}
    prompts = ["one two three", "four five"]
    whole = http.post("/v1/completions", json={"model": MODEL, "prompt": prompts, "n": 2} | ask)
    assert whole.status_code == 200, whole.text
    choices = whole.json()["choices"]
    assert [c["prompt_token_ids"] for c in choices] == [
        backend.encode(p) for p in prompts for _ in "ab"
    ]
    assert all(len(c["token_ids"]) == 2 for c in choices)
    body = {"model": MODEL, "prompt": prompts[0], "n": 2, "stream": True} | ask
    chunks = events(http.post("/v1/completions", json=body).text)
    said: dict[int, list] = {}
    for c in chunks:
        (choice,) = c["choices"]
        if "prompt_token_ids" in choice:
            assert choice["index"] not in said
            said[choice["index"]] = choice["prompt_token_ids"]
    assert said == {0: backend.encode(prompts[0]), 1: backend.encode(prompts[0])}
    plain = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": prompts[0], "max_tokens": 1}
    )
    assert "prompt_token_ids" not in plain.json()["choices"][0]

    chat = http.post("/v1/chat/completions", json=CHAT | ask).json()
    prompt_ids = chat["prompt_token_ids"]
    assert chat["usage"]["prompt_tokens"] == len(prompt_ids) > 0
    assert backend.requests[-1].prompt_token_ids.tolist() == prompt_ids
    (choice,) = chat["choices"]
    assert backend.decode(choice["token_ids"]) == choice["message"]["content"]
    streamed = events(http.post("/v1/chat/completions", json=CHAT | ask | {"stream": True}).text)
    assert streamed[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c for c in streamed[1:])
    assert [t for c in streamed for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    assert "prompt_token_ids" not in http.post("/v1/chat/completions", json=CHAT).json()
