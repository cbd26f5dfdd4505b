"""Our tokenizers (from GGUF metadata and from tokenizer.json) against transformers' on the same files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.chat_template import ChatTemplateError
from engine.loaders import LoadedModel, load_model
from engine.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew lines\r\n\n\nend",
    "numbers 1234567890 3.14159 -42 1,000,000 v2.0.1",
    "I'm sure they'll say we've done it; DON'T SHOUT.",
    "naïve café, Grüße, señor, Ελληνικά, русский",
    "日本語のテキスト 中文字符 한국어",
    "emoji 😀👍🏽🇫🇷 and ZWJ 👩‍💻",
    "def f(x):\n    return {'k': x ** 2}  # comment",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more <reponame> tags",
]

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "  Tell me about 日本 😀  "},
    ],
]


def _gguf_tokenizer(model: LoadedModel) -> Tokenizer:
    assert model.tokenizer is not None
    return model.tokenizer


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_gguf_ids_match_transformers(
    default_model: LoadedModel, hf_gguf_tokenizer: Any, add_special_tokens: bool
) -> None:
    tok = _gguf_tokenizer(default_model)
    for text in TEXTS:
        expected = hf_gguf_tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        assert tok.encode(text, add_special_tokens=add_special_tokens) == expected, text


def test_gguf_decode_matches_transformers(
    default_model: LoadedModel, hf_gguf_tokenizer: Any
) -> None:
    tok = _gguf_tokenizer(default_model)
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=True) == hf_gguf_tokenizer.decode(
            ids, skip_special_tokens=True
        )


def test_gguf_chat_template_matches_transformers(
    default_model: LoadedModel, hf_gguf_tokenizer: Any
) -> None:
    tok = _gguf_tokenizer(default_model)
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            expected = hf_gguf_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
            assert text == expected
            assert tok.encode_chat(messages, add_generation_prompt) == hf_gguf_tokenizer.encode(
                expected, add_special_tokens=False
            )


def test_gguf_special_tokens(default_model: LoadedModel, hf_gguf_tokenizer: Any) -> None:
    tok = _gguf_tokenizer(default_model)
    assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) == (
        hf_gguf_tokenizer.bos_token,
        hf_gguf_tokenizer.eos_token,
        hf_gguf_tokenizer.unk_token,
        hf_gguf_tokenizer.pad_token,
    )
    assert (tok.bos_token_id, tok.eos_token_id, tok.stop_token_ids) == (1, 2, (2,))
    assert tok.special_token_ids == frozenset(range(17))  # the file's 17 control tokens
    assert tok.vocab_size == default_model.config.vocab_size


def test_hf_dir_tokenizer_matches_transformers(tiny_llama3_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(tiny_llama3_dir)
    tok = load_model(str(tiny_llama3_dir)).tokenizer
    assert tok is not None
    for text in TEXTS:
        assert tok.encode(text) == hf_tok(text)["input_ids"], text
        assert tok.encode(text)[0] == 0  # the post-processor's BOS
    for messages in CONVERSATIONS:
        expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok.apply_chat_template(messages) == expected
    assert (tok.bos_token_id, tok.eos_token_id, tok.stop_token_ids) == (0, 1, (1, 4))


@pytest.mark.parametrize(
    "flags",
    [{"add_bos_token": False}, {"add_bos_token": True, "add_eos_token": True}],
)
def test_add_bos_and_eos_flags_count_as_in_transformers(
    tiny_llama3_dir: Path, tmp_path: Path, flags: dict[str, bool]
) -> None:
    """tokenizer_config.json's add_bos_token / add_eos_token next to a tokenizer.json whose
    post-processor adds BOS: the ids are transformers' (5.x keeps the post-processor)."""
    import json
    import shutil

    from transformers import AutoTokenizer

    checkpoint = Path(shutil.copytree(tiny_llama3_dir, tmp_path / "ckpt"))
    config_file = checkpoint / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **flags}))
    hf_tok = AutoTokenizer.from_pretrained(checkpoint)
    tok = load_model(str(checkpoint)).tokenizer
    assert tok is not None
    for text in TEXTS:
        assert tok.encode(text) == hf_tok(text)["input_ids"], text


def test_template_errors(tiny_llama3_dir: Path) -> None:
    tok = load_model(str(tiny_llama3_dir)).tokenizer
    assert tok is not None
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])
    no_template = Tokenizer(tok.backend, eos_token=tok.eos_token)
    with pytest.raises(ValueError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_sandbox_and_helpers(tiny_llama3_dir: Path) -> None:
    tok = load_model(str(tiny_llama3_dir)).tokenizer
    assert tok is not None
    escaping = Tokenizer(tok.backend, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        escaping.apply_chat_template([{"role": "user", "content": "x"}])
    as_json = Tokenizer(tok.backend, chat_template="{{ messages | tojson }}{{ flag }}")
    text = as_json.apply_chat_template(
        [{"role": "user", "content": "日本 <b>"}], variables={"flag": "!"}
    )
    assert text == '[{"role": "user", "content": "日本 <b>"}]!'


def test_the_developer_role_is_a_system_message_for_templates_that_do_not_name_it(
    default_model: LoadedModel, tiny_llama3_dir: Path
) -> None:
    """Newer OpenAI clients send ``developer`` for ``system``. As vLLM, a template that never names
    the role gets it as ``system`` (SmolLM2's would keep its default system prompt and add a
    ``developer`` turn the model never saw), where it stands, as a system message there would
    be; the system messages that open the conversation merge into one."""
    tok = _gguf_tokenizer(default_model)
    user = {"role": "user", "content": "Hi"}
    developer = [{"role": "developer", "content": "Answer in French."}, user]
    system = [{"role": "system", "content": "Answer in French."}, user]
    assert tok.apply_chat_template(developer) == tok.apply_chat_template(system)
    first = [{"role": "developer", "content": "B"}, {"role": "system", "content": "A"}, user]
    merged = [{"role": "system", "content": "B\n\nA"}, user]
    assert tok.apply_chat_template(first) == tok.apply_chat_template(merged)
    late = [user, {"role": "developer", "content": "B"}, {"role": "user", "content": "Then?"}]
    in_place = [user, {"role": "system", "content": "B"}, late[2]]  # (not moved to the start)
    assert tok.apply_chat_template(late) == tok.apply_chat_template(in_place)
    naming = Tokenizer(
        tok.backend, chat_template="{% for m in messages %}{{ m.role }};{% endfor %}"
    )
    assert naming.apply_chat_template(developer) == "system;user;"  # (it does not name it)
    knows = Tokenizer(
        tok.backend,
        chat_template="{% for m in messages %}{% if m.role == 'developer' %}D{% endif %}{% endfor %}",
    )
    assert knows.apply_chat_template(developer) == "D"


def test_a_special_token_the_model_lacks_renders_as_nothing(tiny_llama3_dir: Path) -> None:
    """As transformers: an unset ``bos_token`` is undefined in the template, not the text None."""
    tok = load_model(str(tiny_llama3_dir)).tokenizer
    assert tok is not None
    bare = Tokenizer(tok.backend, eos_token=tok.eos_token, chat_template="[{{ bos_token }}]")
    assert bare.apply_chat_template([{"role": "user", "content": "x"}]) == "[]"


# Gemma 3's way with content: a loop over OpenAI's list of parts (a string passes as is).
PARTS_TEMPLATE = (
    "{%- for message in messages -%}<{{ message['role'] }}>"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}[{{ item['text'] | trim }}]{%- endfor -%}"
    "{%- endif -%}{%- endfor -%}"
)


def test_content_parts_reach_a_template_that_loops_over_them(
    default_model: LoadedModel, tiny_llama3_dir: Path
) -> None:
    """As vLLM's content-format detection and transformers: a template written for content parts
    gets them (a string as one part); any other template gets their text joined by new lines."""
    from transformers import AutoTokenizer

    from engine.chat_template import takes_content_parts

    smol = _gguf_tokenizer(default_model)
    assert smol.chat_template is not None and not takes_content_parts(smol.chat_template)
    assert takes_content_parts(PARTS_TEMPLATE)
    parts = [{"type": "text", "text": "part one"}, {"type": "text", "text": " part two"}]
    conv = [{"role": "user", "content": parts}, {"role": "assistant", "content": "ok"}]
    ours = Tokenizer(smol.backend, chat_template=PARTS_TEMPLATE).apply_chat_template(conv, False)
    hf = AutoTokenizer.from_pretrained(tiny_llama3_dir)
    want = hf.apply_chat_template(
        conv, chat_template=PARTS_TEMPLATE, tokenize=False, add_generation_prompt=False
    )
    assert ours == want == "<user>[part one][part two]<assistant>ok"
    joined = [{"role": "user", "content": "part one\n part two"}, conv[1]]
    assert smol.apply_chat_template(conv) == smol.apply_chat_template(joined)


def test_a_lone_tokens_text_keeps_the_space_sentencepiece_strips() -> None:
    """Logprobs name tokens one by one: Llama 2's decoder strips the leading space of a lone
    "▁world", which token_text puts back (vLLM's convert_ids_list_to_tokens)."""
    import tokenizers
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    backend = tokenizers.Tokenizer(
        models.WordLevel(
            {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "<0xC3>": 4, "<0xA9>": 5},
            unk_token="<unk>",
        )
    )
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok = Tokenizer(backend)
    ids = tok.encode("Hello world")
    assert tok.decode([ids[1]]) == "world"  # (what a lone decode gives)
    assert [tok.token_text(i) for i in ids] == [" Hello", " world"]
    # Byte fallback: "é" as two byte tokens, each U+FFFD alone; their bytes are its own.
    assert tok.decode([4, 5]) == "é" and tok.token_text(4) == "\ufffd"
    assert tok.token_bytes(4) + tok.token_bytes(5) == "é".encode()
    assert tok.token_bytes(2) == b" world"


def test_a_tokens_bytes_are_its_own_where_it_holds_part_of_a_character(
    default_model: LoadedModel,
) -> None:
    """OpenAI's logprobs ``bytes`` let a client join characters split across tokens: a token
    holding part of one is U+FFFD as text, but its bytes are the ones it stands for (they were
    U+FFFD's three), so every text's tokens' bytes join back into the text."""
    tok = _gguf_tokenizer(default_model)
    for text in ("😀 ok", "日本語のテキスト", "naïve café", " Hello"):
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    split = [i for i in tok.encode("😀", add_special_tokens=False)]
    assert len(split) > 1 and "\ufffd" in tok.token_text(split[0])  # (the case in point)


def test_an_assistant_refusal_part_is_its_text(default_model: LoadedModel) -> None:
    """OpenAI's assistant message may carry a ``refusal`` part (a client sends an answer back as
    the model gave it): it is that message's text, as vLLM reads it; other kinds are refused."""
    tok = _gguf_tokenizer(default_model)
    user = {"role": "user", "content": "Hi"}
    parts = [{"type": "refusal", "refusal": "I cannot."}, {"type": "text", "text": "Sorry."}]
    said = tok.apply_chat_template([user, {"role": "assistant", "content": parts}, user])
    plain = {"role": "assistant", "content": "I cannot.\nSorry."}
    assert said == tok.apply_chat_template([user, plain, user])
    with pytest.raises(ChatTemplateError, match="only text content parts"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])
