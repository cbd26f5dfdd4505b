"""Logprobs at the HTTP edge (cluster/openai_logprobs.py) over a real decode worker: the
completions endpoint's shape and the chat endpoint's, whole and streamed, and what a body may ask."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.cluster.worker_backend import CHAT, MODEL, events

PROMPT = {"model": MODEL, "prompt": "The capital of France is", "temperature": 0}


def streamed_logprobs(chunks: list[dict[str, Any]]) -> dict[str, list[Any]]:
    joined: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for c in chunks:
        for choice in c["choices"]:
            for key in joined:
                joined[key] += choice["logprobs"][key]
    return joined


def test_completions_logprobs_whole_and_streamed(http) -> None:
    body = PROMPT | {"max_tokens": 5, "ignore_eos": True, "logprobs": 2}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(choice["token_ids"]) == 5
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        # greedy: the sampled token is the most likely one, among the two asked for
        assert value <= 0 and top[token] == value == max(top.values()) and len(top) == 2
    chunks = events(http.post("/v1/completions", json=body | {"stream": True}).text)
    assert streamed_logprobs(chunks) == {
        k: lp[k] for k in ("tokens", "token_logprobs", "text_offset")
    }
    plain = http.post("/v1/completions", json=PROMPT | {"max_tokens": 2}).json()
    assert plain["choices"][0]["logprobs"] is None


def test_chat_logprobs_whole_and_streamed(http) -> None:
    body = CHAT | {"max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 4
    assert "".join(c["token"] for c in content) == choice["message"]["content"]
    for c in content:
        assert c["bytes"] == list(c["token"].encode()) and len(c["top_logprobs"]) == 3
        assert c["top_logprobs"][0]["logprob"] == c["logprob"]  # (greedy)
    chunks = events(http.post("/v1/chat/completions", json=body | {"stream": True}).text)
    streamed = [
        c
        for chunk in chunks
        for ch in chunk["choices"]
        if ch["logprobs"]
        for c in ch["logprobs"]["content"]
    ]
    assert streamed == content
    # top_logprobs 0 asks nothing, with or without logprobs (vLLM's rule)
    assert (
        http.post(
            "/v1/chat/completions", json=CHAT | {"max_tokens": 1, "top_logprobs": 0}
        ).status_code
        == 200
    )
    only = http.post("/v1/chat/completions", json=CHAT | {"max_tokens": 2, "logprobs": True})
    assert all(c["top_logprobs"] == [] for c in only.json()["choices"][0]["logprobs"]["content"])


def test_return_tokens_as_token_ids_names_tokens_by_id(http, backend) -> None:
    """vLLM's return_tokens_as_token_ids: "token_id:<id>" wherever logprobs name a token."""
    body = PROMPT | {"max_tokens": 2, "logprobs": 1, "echo": True}
    body |= {"return_tokens_as_token_ids": True}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    ids = backend.encode(PROMPT["prompt"]) + choice["token_ids"]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    assert all(
        k.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"][1:] for k in top
    )
    chat = CHAT | {"max_tokens": 2, "logprobs": True, "top_logprobs": 1}
    chat |= {"return_tokens_as_token_ids": True}
    content = http.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]
    assert all(c["token"].startswith("token_id:") for c in content["content"])


def test_what_a_body_may_ask_of_logprobs(http) -> None:
    for path, body, param in (
        ("/v1/chat/completions", CHAT | {"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ("/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/completions", PROMPT | {"logprobs": 21}, "logprobs"),
        ("/v1/completions", PROMPT | {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/completions", PROMPT | {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/chat/completions", CHAT | {"prompt_logprobs": -1}, "prompt_logprobs"),
    ):
        r = http.post(path, json=body | {"max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text


def test_echo_puts_the_prompt_and_its_logprobs_first(http, backend) -> None:
    """vLLM's echo: the prompt's text before the choice's, with logprobs the prompt tokens'
    entries before the choice's tokens' (the first null); streamed as whole; max_tokens 0 is the
    prompt alone; ``prompt_logprobs`` gives the same numbers in vLLM's per-token dicts."""
    ids = backend.encode(PROMPT["prompt"])
    body = PROMPT | {"max_tokens": 3, "ignore_eos": True, "logprobs": 1, "echo": True}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    plain = http.post("/v1/completions", json=body | {"echo": False}).json()["choices"][0]
    assert choice["text"] == PROMPT["prompt"] + plain["text"]
    assert choice["token_ids"] == plain["token_ids"]  # (the generated ones, as without echo)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["tokens"] == [backend.token_text(t) for t in ids + choice["token_ids"]]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][len(ids) :] == plain["logprobs"]["token_logprobs"]
    assert choice["prompt_logprobs"] is not None and plain["prompt_logprobs"] is None
    # each echoed prompt token with the logprobs (1) most likely of its position and its own,
    # even when prompt_logprobs asks for more
    wider = http.post("/v1/completions", json=body | {"prompt_logprobs": 3}).json()["choices"][0]
    assert wider["logprobs"] == lp
    assert all(len(e) in (3, 4) for e in wider["prompt_logprobs"][1:])
    chunks = events(http.post("/v1/completions", json=body | {"stream": True}).text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert streamed_logprobs(chunks) == {
        k: lp[k] for k in ("tokens", "token_logprobs", "text_offset")
    }
    # max_tokens 0: the prompt alone, scored
    alone = http.post("/v1/completions", json=body | {"max_tokens": 0}).json()["choices"][0]
    assert alone["text"] == PROMPT["prompt"] and alone["token_ids"] == []
    assert alone["logprobs"]["token_logprobs"] == lp["token_logprobs"][: len(ids)]
    r = http.post("/v1/completions", json=PROMPT | {"max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    # (named as the body names it, not as the engine's SamplingParams)
    assert r.json()["error"]["message"].startswith("max_tokens must be an integer >= 1")
    # vLLM's prompt_logprobs: per prompt token, its own and the k most likely
    asked = PROMPT | {"max_tokens": 1, "prompt_logprobs": 2}
    scored = http.post("/v1/completions", json=asked).json()["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for pos, (token, entry) in enumerate(zip(ids[1:], scored[1:]), start=1):
        assert entry[str(token)]["logprob"] == lp["token_logprobs"][pos]
        assert sum(e["rank"] <= 2 for e in entry.values()) == 2
        assert entry[str(token)]["decoded_token"] == backend.token_text(token)
    chat = http.post("/v1/chat/completions", json=CHAT | {"max_tokens": 1, "prompt_logprobs": 0})
    assert chat.json()["prompt_logprobs"][0] is None
    assert len(chat.json()["prompt_logprobs"]) == chat.json()["usage"]["prompt_tokens"]


def test_a_batch_of_prompts_has_n_choices_each_in_order(http, backend) -> None:
    """OpenAI's batch: prompt k's choices are k * n .. k * n + n - 1; with echo each carries its
    own prompt (the first choice of a prompt scores it for the others); usage counts each prompt
    once; streamed as whole."""
    prompts = ["The capital of France is", "One, two,"]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 2, "temperature": 0, "n": 2}
    body |= {"ignore_eos": True, "echo": True, "logprobs": 0}
    start = len(backend.requests)
    r = http.post("/v1/completions", json=body).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    alone = [
        http.post("/v1/completions", json=body | {"prompt": p, "n": 1}).json()["choices"][0]
        for p in prompts
    ]
    for i, c in enumerate(r["choices"]):
        want = alone[i // 2]
        assert c["text"] == want["text"]  # (greedy)
        assert c["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        got, ref = c["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"]
        assert got[0] is None and ref[0] is None  # (batched otherwise: equal to float32's noise)
        assert got[1:] == pytest.approx(ref[1:], abs=1e-4)
    ids = [backend.encode(p) for p in prompts]
    assert r["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
    assert r["usage"]["completion_tokens"] == 8
    made = {q.request_id for q in backend.requests[start : start + 4]}
    assert made == {f"{r['id']}-{k}-{i}" for k in range(2) for i in range(2)}  # prompt k, choice i
    usage = {"include_usage": True}
    streamed = body | {"stream": True, "stream_options": usage}
    chunks = events(http.post("/v1/completions", json=streamed).text)
    assert chunks[-1]["usage"] == r["usage"]
    chunks = chunks[:-1]
    for i, c in enumerate(r["choices"]):
        parts = [ch for chunk in chunks for ch in chunk["choices"] if ch["index"] == i]
        assert "".join(p["text"] for p in parts) == c["text"]
        assert (
            sum((p["logprobs"]["token_logprobs"] for p in parts), [])
            == (c["logprobs"]["token_logprobs"])
        )
    token_batch = body | {"prompt": ids, "echo": False, "logprobs": None, "n": 1}
    texts = [c["text"] for c in http.post("/v1/completions", json=token_batch).json()["choices"]]
    assert texts == [a["text"][len(p) :] for a, p in zip(alone, prompts, strict=True)]
    # a batch is refused whole, naming the prompt, before any of it runs
    before = len(backend.requests)
    too_long = http.post("/v1/completions", json=body | {"prompt": [ids[0], [5] * 600]})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt"
    assert too_long.json()["error"]["message"].startswith("prompt[1]: ")
    too_many = http.post("/v1/completions", json=body | {"prompt": [[5]] * 9, "n": 128})
    assert too_many.status_code == 400 and "at most 1024" in too_many.json()["error"]["message"]
    assert too_many.json()["error"]["param"] == "n"
    assert len(backend.requests) == before


def test_a_prompts_choices_share_its_prompt_logprobs_whole_and_streamed(http, backend) -> None:
    """echo with logprobs and n: only the first choice asks the worker for the prompt's logprobs
    (each other one would score the whole prompt again, reading nothing from the prefix cache);
    every choice still echoes them, streamed as whole."""
    n_prompt = len(backend.encode(PROMPT["prompt"]))
    body = PROMPT | {"max_tokens": 3, "ignore_eos": True, "echo": True, "logprobs": 1, "n": 3}
    start = len(backend.requests)
    whole = http.post("/v1/completions", json=body).json()["choices"]
    chunks = events(http.post("/v1/completions", json=body | {"stream": True}).text)
    asked = [q.sampling.prompt_logprobs for q in backend.requests[start:]]
    assert asked == [1, None, None] * 2
    streamed = []
    for i, c in enumerate(whole):
        parts = [ch for chunk in chunks for ch in chunk["choices"] if ch["index"] == i]
        assert "".join(p["text"] for p in parts) == c["text"]
        assert c["text"].startswith(PROMPT["prompt"])
        joined = streamed_logprobs([{"choices": [p]} for p in parts])
        assert joined["tokens"] == c["logprobs"]["tokens"]
        assert joined["text_offset"] == c["logprobs"]["text_offset"]
        got, want = joined["token_logprobs"], c["logprobs"]["token_logprobs"]
        assert got[0] is None and want[0] is None
        assert got[1:] == pytest.approx(want[1:], abs=1e-4)  # (two runs: float32's noise)
        streamed.append(got)
    # the prompt's entries are its first choice's: the same numbers in every choice
    for answer in ([c["logprobs"]["token_logprobs"] for c in whole], streamed):
        assert all(lp[:n_prompt] == answer[0][:n_prompt] for lp in answer)


def test_a_logprob_json_cannot_carry_is_minus_9999() -> None:
    """-inf (a token ruled out) and NaN are no JSON numbers: both are sent as -9999.0."""
    from cluster.openai_logprobs import ContextNames, chat_logprobs, completion_logprobs
    from engine.logprobs import TokenLogprobs

    entries = [TokenLogprobs(5, float("-inf"), 9, ((6, float("nan")),))]
    done = completion_logprobs([5], entries, ContextNames(str, None))
    assert done["token_logprobs"] == [-9999.0] and done["top_logprobs"] == [
        {"6": -9999.0, "5": -9999.0}
    ]
    content = chat_logprobs(entries, str, lambda t: str(t).encode())["content"][0]
    assert content["logprob"] == content["top_logprobs"][0]["logprob"] == -9999.0


def test_chat_logprobs_bytes_join_into_characters_tokens_split(backend) -> None:
    """A token holding part of a character is named U+FFFD; its ``bytes`` are its own, so that
    the answer's bytes join into the text (OpenAI's purpose for them)."""
    from cluster.openai_logprobs import chat_logprobs
    from engine.logprobs import TokenLogprobs

    ids = backend.encode("😀 ok", add_special_tokens=False)
    entries = [TokenLogprobs(t, -1.0, 1, ((t, -1.0),)) for t in ids]
    content = chat_logprobs(entries, backend.token_text, backend.token_bytes)["content"]
    assert "\ufffd" in content[0]["token"]
    assert bytes(b for c in content for b in c["bytes"]) == "😀 ok".encode()
    assert [c["top_logprobs"][0]["bytes"] for c in content] == [c["bytes"] for c in content]


def test_an_answer_of_too_many_prompt_logprobs_is_refused(http) -> None:
    """Each choice repeats its prompt's logprobs: a small request asked for hundreds of MB (4
    prompts x n=128 x 400 tokens x 21 entries). Refused before anything runs; an eval's echo of
    its prompts with a few logprobs is served."""
    prompts = [list(range(1, 401))] * 4
    big = {"model": MODEL, "prompt": prompts, "n": 128, "echo": True, "logprobs": 20,
           "max_tokens": 1, "temperature": 1.0}  # fmt: skip
    r = http.post("/v1/completions", json=big)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "prompt logprob entries (1600 prompt tokens x n=128 x 21 per token)" in r.text
    asked = big | {"n": 1, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    r = http.post("/v1/completions", json=asked)
    assert r.status_code == 200
    assert all(len(c["logprobs"]["tokens"]) == 401 for c in r.json()["choices"])


@pytest.mark.parametrize("echo", [False, True])
def test_tokens_that_split_a_character_join_into_the_text(http, echo: bool) -> None:
    """A token holding part of a character is named by what it adds in its context (vLLM
    corrects them too): "" until the character is whole, then the character. Named alone, each
    was "\ufffd": the tokens did not join into the text, and the offsets of an answer of 3 emoji
    ran to 7. Whole and streamed (a character split across chunks), with echo the prompt's
    tokens too."""
    prompt = "😀" * 12
    body = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 9, "logprobs": 1}
    body |= {"echo": echo}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    text = choice["text"]
    assert text == (prompt if echo else "") + "😀😀😀", text  # (the model repeats its prompt)
    assert "".join(lp["tokens"]) == text and "" in lp["tokens"]
    assert not any("\ufffd" in t for t in lp["tokens"])
    assert lp["text_offset"] == [
        sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))
    ]
    assert all(token in top for token, top in zip(lp["tokens"], lp["top_logprobs"]) if top)
    chunks = events(http.post("/v1/completions", json=body | {"stream": True}).text)
    assert streamed_logprobs(chunks) == {
        k: lp[k] for k in ("tokens", "token_logprobs", "text_offset")
    }


def test_top_tokens_holding_part_of_a_character_are_named_by_their_bytes(http) -> None:
    """Top tokens other than the one taken that add no whole character where they stand are
    named as OpenAI names them, ``bytes:\\xNN...``: named "" by their context, several collided in
    one ``top_logprobs`` key and the entry kept the last one's logprob, not the likeliest's."""
    body = {"model": MODEL, "prompt": "😀" * 12, "temperature": 0, "max_tokens": 6, "logprobs": 5}
    lp = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert all(len(top) >= 5 for top in lp["top_logprobs"])  # none lost to a shared name
    by_bytes = [n for top in lp["top_logprobs"] for n in top if n.startswith("bytes:")]
    assert by_bytes and all(re.fullmatch(r"bytes:(\\x[0-9a-f]{2})+", n) for n in by_bytes)
    assert all(token in top for token, top in zip(lp["tokens"], lp["top_logprobs"], strict=True))


def test_a_chat_stream_chunk_of_part_of_a_character_has_empty_content(http, backend) -> None:
    """A token that holds part of a character adds no text yet: its chunk's delta still has
    ``content`` (""), as vLLM's, for clients that join every chunk's content; only the last
    chunk's delta may be empty (OpenAI's)."""
    lead = next(t for t in range(4096) if backend.token_bytes(t) == b"\xf0")  # (a 4-byte start)
    body = CHAT | {"max_tokens": 4, "stream": True, "logit_bias": {str(lead): 100}}
    chunks = events(http.post("/v1/chat/completions", json=body).text)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    going_on = [
        c["choices"][0] for c in chunks if c["choices"] and not c["choices"][0]["finish_reason"]
    ]
    assert len(going_on) >= 4 and all(
        isinstance(ch["delta"].get("content"), str) for ch in going_on
    )
    assert "".join(d.get("content") or "" for d in deltas) == "\ufffd" * 4  # (flushed at the end)
