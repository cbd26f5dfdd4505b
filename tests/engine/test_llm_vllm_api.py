"""The offline API as code written for vLLM's ``LLM`` calls it: outputs[0], prompt dicts, use_tqdm,
chat's arguments in vLLM's order, SamplingParams fields Duet takes only at their no-op value, and
vLLM's constructor names. (tiny random Llama-3 with its tokenizer and chat template.)"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.hf_tokenizer_view import HFTokenizerView
from engine.llm import LLM
from engine.loaders import LoadedModel
from engine.sampling_params import SamplingParams, SamplingParamsError

from .conftest_engine import assert_no_leak

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
CONV = [{"role": "user", "content": "hello there"}]


@pytest.fixture
def tiny_llm(tiny_llama3_loaded: LoadedModel) -> LLM:
    return LLM.from_loaded(tiny_llama3_loaded, page_size=4, num_pages=64, max_model_len=64)


def test_outputs_holds_the_completion_as_in_vllm(tiny_llm: LLM) -> None:
    out = tiny_llm.generate("hello", GREEDY, use_tqdm=False)[0]
    (completion,) = out.outputs
    assert (completion.index, completion.text, completion.token_ids) == (0, out.text, out.token_ids)
    assert (completion.finish_reason, completion.stop_reason) == ("length", None)
    assert completion.logprobs is None and completion.cumulative_logprob is None


def test_outputs_edited_in_place_stay_edited(tiny_llm: LLM) -> None:
    """vLLM's outputs are a plain list of mutable completions: a best-of-n rerank sorts them in
    place, post-processing edits their text. A fresh list at every read dropped the sort."""
    params = SamplingParams(temperature=1.0, max_tokens=3, n=4, seed=1, logprobs=0)
    out = tiny_llm.generate("hello", params, use_tqdm=False)[0]
    out.outputs.sort(key=lambda c: c.cumulative_logprob, reverse=True)
    again = tiny_llm.generate(["a", "b"], GREEDY, use_tqdm=False)  # (vLLM's ids: "0", "1", ...)
    assert int(again[1].request_id) == int(again[0].request_id) + 1 == int(out.request_id) + 2
    ranked = [c.cumulative_logprob for c in out.outputs]
    assert ranked == sorted(ranked, reverse=True) and len(ranked) == 4
    out.outputs[0].text = "edited"
    assert out.outputs[0].text == "edited"
    del out.outputs[1:]
    assert len(out.outputs) == 1
    single = tiny_llm.generate("hello", GREEDY, use_tqdm=False)[0]
    single.outputs[0].text = single.outputs[0].text.strip() + "!"
    assert single.outputs[0].text.endswith("!")


def test_prompt_dicts_are_the_same_prompts(tiny_llm: LLM) -> None:
    ids = tiny_llm.tokenizer.encode("hello world")
    plain = tiny_llm.generate(["hello world", ids], GREEDY, use_tqdm=False)
    dicts = tiny_llm.generate(
        [{"prompt": "hello world"}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False
    )
    assert [o.token_ids for o in dicts] == [o.token_ids for o in plain]
    assert dicts[0].prompt == "hello world" and dicts[1].prompt is None
    one = tiny_llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in one] == [plain[1].token_ids]
    assert tiny_llm.generate([], GREEDY) == []
    assert_no_leak(tiny_llm.engine.kv)


def test_use_tqdm_counts_finished_requests(tiny_llm: LLM) -> None:
    bars: list[Any] = []

    class Bar:
        def __init__(self, total: int, **_: Any) -> None:
            self.total, self.done, self.closed = total, 0, False
            bars.append(self)

        def update(self, n: int) -> None:
            self.done += n

        def close(self) -> None:
            self.closed = True

    tiny_llm.generate(["a", "b", "c"], GREEDY, use_tqdm=Bar)
    tiny_llm.chat(CONV, GREEDY, Bar)  # (chat's third argument is use_tqdm, as in vLLM)
    assert [(b.total, b.done, b.closed) for b in bars] == [(3, 3, True), (1, 1, True)]
    with pytest.raises(ValueError, match="use_tqdm must be a bool or a tqdm-like class"):
        tiny_llm.generate("a", GREEDY, use_tqdm="yes")  # type: ignore[arg-type]


def test_chat_takes_vllms_arguments(tiny_llm: LLM) -> None:
    tok = tiny_llm.tokenizer
    with_prompt = tok.apply_chat_template(CONV, True)
    out = tiny_llm.chat(CONV, GREEDY, False)[0]  # use_tqdm=False: still a generation prompt
    assert out.prompt == with_prompt
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert tiny_llm.chat(parts, GREEDY, False)[0].prompt == tok.apply_chat_template(
        [{"role": "user", "content": "a\nb"}], True
    )
    template = "{% for m in messages %}[{{ m.content }}]{% endfor %}{{ tools | tojson }}{{ flag }}"
    out = tiny_llm.chat(
        CONV,
        GREEDY,
        False,
        chat_template=template,
        chat_template_kwargs={"flag": "!"},
        tools=[{"type": "function"}],
    )[0]
    assert out.prompt == '[hello there][{"type": "function"}]!'
    # vLLM's positions: lora_request (None only), chat_template, chat_template_content_format
    reads_parts = (
        "{% for m in messages %}{% for p in m.content %}<{{ p.text }}>{% endfor %}{% endfor %}"
    )
    as_parts = tiny_llm.chat(parts, GREEDY, False, None, reads_parts, "openai")[0].prompt
    assert as_parts == "<a><b>"
    as_text = tiny_llm.chat(parts, GREEDY, False, None, reads_parts, "string")[0].prompt
    assert as_text == "<><><>"  # ("a\nb", a string, iterated)
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        tiny_llm.chat(parts, GREEDY, False, None, None, "text")
    with pytest.raises(ValueError, match="no LoRA adapters"):
        tiny_llm.chat(CONV, GREEDY, False, object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="only text content parts"):
        tiny_llm.chat([{"role": "user", "content": [{"type": "image_url"}]}], GREEDY, False)
    assert_no_leak(tiny_llm.engine.kv)


def test_continue_final_message_renders_as_transformers(
    tiny_llm: LLM, tiny_hf_checkpoints: dict[str, Path]
) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_hf_checkpoints["llama3"])
    conv = CONV + [{"role": "assistant", "content": "The answer is "}]
    want = hf.apply_chat_template(
        conv, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    out = tiny_llm.chat(
        conv, GREEDY, False, add_generation_prompt=False, continue_final_message=True
    )
    assert out[0].prompt == want and want.endswith("The answer is")
    with pytest.raises(ValueError, match="cannot both be true"):
        tiny_llm.chat(conv, GREEDY, False, continue_final_message=True)


@pytest.mark.parametrize("final", ["t", "", "  ", "eot_id", "wait  "])
def test_continue_final_message_ends_where_transformers_ends_it(
    tiny_llm: LLM, tiny_hf_checkpoints: dict[str, Path], final: object
) -> None:
    """A last message whose text the template writes again after it ("t" in "<|eot_id|>"): the
    prompt was cut there, inside the special token; an empty one was refused."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_hf_checkpoints["llama3"])
    conv = CONV + [{"role": "assistant", "content": final}]
    want = hf.apply_chat_template(
        conv, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    out = tiny_llm.chat(
        conv, GREEDY, False, add_generation_prompt=False, continue_final_message=True
    )
    assert out[0].prompt == want


def test_n_completions_are_n_requests_seeded_seed_plus_i(tiny_llm: LLM) -> None:
    sampled = SamplingParams(temperature=1.0, max_tokens=6, seed=5, ignore_eos=True)
    three = SamplingParams(**{**_fields(sampled), "n": 3})
    outs = tiny_llm.generate([[1, 2, 3], [4, 5]], [three, GREEDY], use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [3, 1]
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    for i, completion in enumerate(outs[0].outputs):
        alone = SamplingParams(**{**_fields(sampled), "seed": 5 + i})
        assert (
            completion.token_ids == tiny_llm.generate([1, 2, 3], alone, use_tqdm=False)[0].token_ids
        )
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1  # the seeds differ
    assert outs[0].token_ids == outs[0].outputs[0].token_ids  # the fields are the first's
    greedy = tiny_llm.generate(
        [1, 2, 3], SamplingParams(**{**_fields(GREEDY), "n": 2}), use_tqdm=False
    )
    assert greedy[0].outputs[0].token_ids == greedy[0].outputs[1].token_ids
    with pytest.raises(ValueError, match="one engine request is one completion"):
        tiny_llm.engine.make_request("x", [1, 2], three)
    assert_no_leak(tiny_llm.engine.kv)


def _fields(params: SamplingParams) -> dict[str, Any]:
    return {f: getattr(params, f) for f in params.__dataclass_fields__}


def test_sampling_params_change_as_vllms_do_and_stay_valid(tiny_llm: LLM) -> None:
    params = tiny_llm.get_default_sampling_params()
    params.max_tokens = 2  # (vLLM's examples/offline_inference/basic/generate.py does this)
    params.temperature = 0.0
    params.stop = "x"
    assert params.stop == ("x",)
    assert len(tiny_llm.generate([1, 2, 3], params, use_tqdm=False)[0].token_ids) <= 2
    with pytest.raises(SamplingParamsError, match="temperature must be in"):
        params.temperature = 3.0
    assert params.temperature == 0.0
    with pytest.raises(AttributeError, match="no field 'max_new_tokens'"):
        params.max_new_tokens = 5  # type: ignore[attr-defined]
    request = tiny_llm.engine.make_request("r", [1, 2], params)
    params.max_tokens = 7  # a request made before keeps what it was made with
    assert request.sampling_params.max_tokens == 2


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(tiny_llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = [5, 17, 42, 99, 3, 8]
    cut = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, truncate_prompt_tokens=3)
    (out,) = tiny_llm.generate([prompt], cut, use_tqdm=False)
    (want,) = tiny_llm.generate([prompt[-3:]], greedy, use_tqdm=False)
    assert out.prompt_token_ids == prompt[-3:] and out.token_ids == want.token_ids
    # a prompt too long for the model runs once cut (max_model_len here: 64)
    long = [7] * 70
    with pytest.raises(ValueError, match="prompts\\[0\\]: the prompt has 70 tokens"):
        tiny_llm.generate([long], greedy, use_tqdm=False)
    cut.truncate_prompt_tokens = 60
    assert len(tiny_llm.generate([long], cut, use_tqdm=False)[0].prompt_token_ids) == 60
    for k in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be None, -1 or"):
            SamplingParams(truncate_prompt_tokens=k)  # type: ignore[arg-type]


def test_sampling_params_take_vllms_fields_and_refuse_what_duet_lacks_by_name() -> None:
    assert SamplingParams(seed=-1).seed is None  # (vLLM: -1 is no seed)
    with pytest.raises(SamplingParamsError, match="temperature must be in \\[0, 2\\]"):
        SamplingParams(temperature=2.5)
    for n in (0, True, 1.0):
        with pytest.raises(SamplingParamsError, match="n must be an integer >= 1"):
            SamplingParams(n=n)
    for field, value, rule in (
        ("presence_penalty", 2.5, "in \\[-2, 2\\]"),
        ("frequency_penalty", -3, "in \\[-2, 2\\]"),
        ("repetition_penalty", 0.0, "a number > 0"),
        ("min_p", 1.5, "in \\[0, 1\\]"),
        ("logprobs", True, "None or an integer in \\[0, 20\\]"),
    ):
        with pytest.raises(SamplingParamsError, match=f"{field} must be {rule}"):
            SamplingParams(**{field: value})


def test_vllms_constructor_names_and_the_generation_configs_penalty(
    tiny_hf_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_hf_checkpoints["llama3"], ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.3}))
    llm = LLM(str(ckpt), enable_prefix_caching=False, enforce_eager=True, num_pages=32)
    assert llm.engine.kv.reuse_policy.value == "none"
    assert llm.get_default_sampling_params().repetition_penalty == 1.3  # (as vLLM applies it)
    # (vLLM hands out transformers' tokenizer: engine/hf_tokenizer_view.py, tested there)
    assert isinstance(llm.get_tokenizer(), HFTokenizerView)
    assert llm.get_tokenizer().tokenizer is llm.tokenizer
    with pytest.raises(ValueError, match="give enable_prefix_caching or reuse_policy, not both"):
        LLM(str(ckpt), enable_prefix_caching=True, reuse_policy="none")
    with pytest.raises(ValueError, match="enforce_eager must be a bool"):
        LLM(str(ckpt), enforce_eager="yes")


def test_vllms_other_constructor_arguments(tiny_hf_checkpoints: dict[str, Path]) -> None:
    path = str(tiny_hf_checkpoints["llama3"])
    llm = LLM(
        path,
        block_size=8,
        dtype="float",
        trust_remote_code=True,  # (Duet runs no checkpoint code: a leave never used)
        kv_cache_dtype="auto",
        quantization=None,
        tokenizer=path,
        num_pages=32,
        max_model_len=64,
        # asking for nothing Duet lacks
        revision=None,
        download_dir=None,
        tokenizer_mode="auto",
        hf_overrides={},
        cpu_offload_gb=0,
        enable_chunked_prefill=True,
        disable_log_stats=True,
        # lm-evaluation-harness's vLLM backend passes these (LoRA's sizes inert without it)
        enable_lora=False,
        max_lora_rank=16,
        tokenizer_revision=None,
        pipeline_parallel_size=1,
        task="generate",
        compilation_config=None,
        seed=None,  # (vLLM's: a seed from entropy)
    )
    assert llm.engine.scheduler.config.page_size == 8
    out = llm.generate([1, 2, 3], GREEDY, False, None, priority=[0])[0]  # vLLM's positions
    assert out.outputs[0].token_ids and out.num_cached_tokens == out.metrics.num_cached_tokens
    assert GREEDY.clone() == GREEDY and GREEDY.clone() is not GREEDY
    with pytest.raises(ValueError, match="no LoRA adapters"):
        llm.generate([1, 2, 3], GREEDY, False, object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="arrival order"):
        llm.generate([1, 2, 3], GREEDY, False, priority=[1])
    refused = {
        "quantization": ("awq", "takes quantization only as None"),
        "kv_cache_dtype": ("fp8", "takes kv_cache_dtype only as 'auto'"),
        "tokenizer": ("other/tokenizer", "the checkpoint's own tokenizer"),
        "block_size": (0, "page_size must be an integer >= 1"),
        "gpu_memory_utilization": (1.5, "must be in \\(0, 1\\]"),
        "cpu_offload_gb": (4, "takes cpu_offload_gb only as 0"),
        "revision": ("main", "takes revision only as None"),
        "enable_chunked_prefill": (False, "takes enable_chunked_prefill only as None or True"),
        "enable_lora": (True, "takes enable_lora only as False or None"),
        "pipeline_parallel_size": (2, "takes pipeline_parallel_size only as 1"),
        "max_lora_rank": ("16", "max_lora_rank must be an integer"),
        "seed": ("1", "seed must be an integer"),
    }
    for name, (value, message) in refused.items():
        with pytest.raises(ValueError, match=message):
            LLM(path, **{name: value})
    with pytest.raises(ValueError, match="gpu_memory_utilization or gpu_memory_fraction"):
        LLM(path, gpu_memory_utilization=0.5, gpu_memory_fraction=0.5)
    with pytest.raises(ValueError, match="gpu_memory_fraction sizes the KV pools"):
        LLM(path, num_pages=64, gpu_memory_fraction=0.5)
    with pytest.raises(ValueError, match="give block_size or page_size, not both"):
        LLM(path, block_size=8, page_size=8)


def test_detokenize_false_gives_the_same_tokens_and_no_text(tiny_llm: LLM) -> None:
    """vLLM's SamplingParams.detokenize (benchmarks turn it off): the tokens as with text, no
    text made; stop strings, which match text, are refused with it."""
    base = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    with_text = tiny_llm.generate("hello", SamplingParams(**base), use_tqdm=False)[0].outputs[0]
    bare = SamplingParams(**base, detokenize=False)
    without = tiny_llm.generate("hello", bare, use_tqdm=False)[0].outputs[0]
    assert with_text.text and without.text == ""
    assert without.token_ids == with_text.token_ids
    with pytest.raises(SamplingParamsError, match="stop must be empty with detokenize=False"):
        SamplingParams(stop=["x"], detokenize=False)
    assert_no_leak(tiny_llm.engine.kv)


def test_reset_prefix_cache_forgets_cached_prompts(tiny_llm: LLM) -> None:
    """vLLM's reset_prefix_cache: a repeated prompt reads the cache before, nothing after, and
    its tokens do not change."""
    prompt = "hello world, hello there, hello again and again"
    assert len(tiny_llm.tokenizer.encode(prompt)) > 8  # (two whole pages of 4 to reuse)
    first = tiny_llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    again = tiny_llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert tiny_llm.reset_prefix_cache() is True
    after = tiny_llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0
    assert first.token_ids == again.token_ids == after.token_ids
    assert tiny_llm.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    with pytest.raises(ValueError, match="reset_connector must be a bool"):
        tiny_llm.reset_prefix_cache(reset_connector="yes")  # type: ignore[arg-type]
    assert_no_leak(tiny_llm.engine.kv)


def test_detokenize_false_leaves_logprobs_tokens_unnamed(tiny_llm: LLM) -> None:
    """vLLM names logprobs' tokens (decoded_token) only for a request it detokenizes."""
    base = dict(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    named, bare = tiny_llm.generate(
        ["hello", "hello"],
        [SamplingParams(**base), SamplingParams(**base, detokenize=False)],
        use_tqdm=False,
    )
    for out, want_names in ((named, True), (bare, False)):
        entries = [lp for pos in out.outputs[0].logprobs for lp in pos.values()]
        entries += [lp for pos in out.prompt_logprobs[1:] for lp in pos.values()]
        assert entries
        assert all((lp.decoded_token is not None) == want_names for lp in entries)
    assert bare.outputs[0].logprobs == [
        {t: dataclasses.replace(lp, decoded_token=None) for t, lp in pos.items()}
        for pos in named.outputs[0].logprobs
    ]
    n2 = tiny_llm.generate("hello", SamplingParams(**base, n=2, detokenize=False), use_tqdm=False)
    assert all(
        lp.decoded_token is None for c in n2[0].outputs for pos in c.logprobs for lp in pos.values()
    )


def test_llm_engine_offers_what_vllm_scripts_read(tiny_llm: LLM) -> None:
    engine = tiny_llm.llm_engine
    tok = engine.get_tokenizer()
    assert isinstance(tok, HFTokenizerView) and isinstance(engine.tokenizer, HFTokenizerView)
    assert tok.encode("hello") == tiny_llm.get_tokenizer().encode("hello")
    config = engine.model_config
    assert engine.get_model_config() is config
    assert config.max_model_len == tiny_llm.engine.max_model_len == 64
    assert config.get_vocab_size() == tiny_llm.engine.model_config.vocab_size
    assert config.get_hidden_size() == tiny_llm.engine.model_config.hidden_size
    assert config.dtype == torch.float32 and config.model == tiny_llm.engine.model_name
    with pytest.raises(AttributeError, match="Duet's own engine is llm.engine"):
        engine.model_executor  # noqa: B018 (vLLM's workers: nothing like them here)
    with pytest.raises(AttributeError, match="llm.engine.model_config"):
        config.hf_config  # noqa: B018
