"""vLLM's /tokenize and /detokenize (cluster/tokenize_api.py) over the real app and tokenizer: the
ids are the ones the generation endpoints run for the same prompt or messages."""

from __future__ import annotations

from tests.cluster.worker_backend import CHAT, MODEL


def test_tokenize_gives_the_ids_the_endpoints_run(http, backend) -> None:
    text = "The capital of France is"
    r = http.post("/tokenize", json={"model": MODEL, "prompt": text}).json()
    http.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1})
    assert r["tokens"] == backend.requests[-1].prompt_token_ids.tolist()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == backend.max_model_len
    assert r["token_strs"] is None
    # pieces of the vocabulary, as vLLM's convert_ids_to_tokens ("Ġcapital", not " capital")
    strs = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert strs["token_strs"] == [backend.tokenizer.id_to_token(t) for t in r["tokens"]]
    assert "Ġcapital" in strs["token_strs"]
    # the messages' ids are the chat endpoint's (the same template and options)
    chat = {"messages": CHAT["messages"], "add_generation_prompt": False}
    ids = http.post("/tokenize", json=chat).json()["tokens"]
    http.post("/v1/chat/completions", json=CHAT | {"max_tokens": 1, "add_generation_prompt": False})
    assert ids == backend.requests[-1].prompt_token_ids.tolist()
    opened = http.post("/tokenize", json=chat | {"add_generation_prompt": True}).json()["tokens"]
    assert opened[: len(ids)] == ids and len(opened) > len(ids)


def test_detokenize_is_the_text_of_the_ids(http, backend) -> None:
    ids = backend.encode("Bonjour, le monde")
    r = http.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.json() == {"prompt": "Bonjour, le monde"}


def test_what_tokenize_and_detokenize_refuse(http) -> None:
    for path, body, code, param in (
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
        ("/tokenize", {"prompt": "x", "truncate": 3}, 400, "truncate"),  # (unknown field)
        ("/tokenize", {"prompt": 3}, 400, "prompt"),
        (
            "/tokenize",
            {"messages": CHAT["messages"], "add_special_tokens": True},
            400,
            "add_special_tokens",
        ),
        (
            "/tokenize",
            {"messages": CHAT["messages"], "continue_final_message": True},
            400,
            "continue_final_message",
        ),
        (
            "/tokenize",
            {"messages": [CHAT["messages"][0] | {"tool_call_id": "c1"}]},
            400,
            "messages[0].tool_call_id",
        ),
        ("/detokenize", {"tokens": [49152]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ):
        r = http.post(path, json=body)
        assert r.status_code == code and r.json()["error"]["param"] == param, (body, r.text)
    r = http.post("/tokenize", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400


def test_the_server_answers_others_while_a_long_prompt_is_encoded(http) -> None:
    """Encoding runs off the event loop, and the tokenizer lets go of the GIL meanwhile: /health
    is answered while a long /tokenize is still being encoded. (On the loop, a 10 MB prompt held
    every client for about 10 s.)"""
    import threading

    order: list[str] = []
    started = threading.Event()
    text = "The capital of France is Paris. " * 40_000  # (1.3 MB: about a second to encode)

    def tokenize() -> None:
        started.set()
        r = http.post("/tokenize", json={"prompt": text})
        assert r.status_code == 200
        order.append("tokenize")

    worker = threading.Thread(target=tokenize)
    worker.start()
    assert started.wait(10)
    for _ in range(100):  # bounded: until the tokenize is under way, then once more
        assert http.get("/health").status_code == 200
        if "tokenize" in order:
            break
        order.append("health")
    worker.join(60)
    assert order[-1] == "tokenize" and order.count("health") >= 2, order[:3]
