"""The first token's text across the handoff: the prefill worker streams it with the end that a
stop string could still claim held back, and the decode worker streams or drops that end. A stop
string that starts in the first token (sampled on P) and ends in a later one (sampled on D) never
reaches the client, whether D received the KV or recomputed it. (P used to stream the first
token's whole text, so the start of such a stop string leaked.)"""

from __future__ import annotations

import asyncio
import time

import pytest
import tokenizers

from decode_worker.worker import DecodeWorker
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from prefill_worker.worker import PrefillWorker
from tests.decode_worker.worker_helpers import wait_until_no_page_held
from tests.tiny_engine import TINY, greedy, tiny_engine
from transfer import KVReceiver, KVSender, TransceiverConfig
from worker_common.messages import GenerateRequest


def word_tokenizer() -> Tokenizer:
    """One word per token id of the tiny model's vocabulary ("w0" ... "w127")."""
    words = {f"w{i}": i for i in range(TINY["vocab_size"])}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="w0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("on_failure", ["fail", "recompute"])
def test_a_stop_string_from_the_first_token_into_the_next_never_reaches_the_client(
    on_failure: str,
) -> None:
    cfg = TransceiverConfig(secret="test-secret", lease_s=30.0)
    pe, de = tiny_engine(64), tiny_engine(64)
    pe.tokenizer = de.tokenizer = word_tokenizer()
    specs = list(pe.kv.specs.values())
    prefill = PrefillWorker("p0", pe, lambda rel: KVSender(pe.kv.buffers, specs, "tiny", cfg, rel))
    receiver = KVReceiver(de.kv.buffers, list(de.kv.specs.values()), "tiny", cfg)
    worker = DecodeWorker("d0", de, receiver, on_failure=on_failure)
    prompt = list(range(1, 12))

    async def local(rid: str, params: SamplingParams) -> tuple[str, str | None]:
        deltas = [d async for d in worker.generate(GenerateRequest(rid, prompt, params, 0.0))]
        return "".join(d.text for d in deltas), deltas[-1].finish_reason

    async def main() -> None:
        text, _ = await local("ref", greedy(6))
        first, second = text.split()[:2]  # (the words of the first two tokens)
        stop = f"{first} {second[:2]}"  # from the first token into the second
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, stop=[stop])
        want = await local("local", params)
        assert want[1] == "stop" and stop not in want[0] and not want[0].strip()

        req = GenerateRequest("x", prompt, params, time.time())
        pre = await prefill.prefill(req)
        assert pre.ticket is not None and first not in pre.first_token_text
        if on_failure == "recompute":
            await prefill.cancel("x")  # the lease ends before the pull: D prefills it itself
        deltas = [d async for d in worker.decode(req, pre)]
        assert all(d.error is None for d in deltas)
        assert (
            pre.first_token_text + "".join(d.text for d in deltas),
            deltas[-1].finish_reason,
        ) == want
        assert worker.stats().transfer.recomputed == (on_failure == "recompute")
        # (the first delta of a recomputed request tells the router to give P's lease up)
        assert [d.kv_recomputed for d in deltas[:1]] == [on_failure == "recompute"]
        await wait_until_no_page_held(worker)

    try:
        asyncio.run(main())
    finally:
        worker.close()
        prefill.close()
