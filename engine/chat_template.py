"""Rendering HF chat templates (Jinja) the way transformers does, in a sandbox.

Templates come with checkpoints, so they are untrusted code: an immutable sandboxed environment, no
attribute access to internals, and only the helpers transformers offers (``raise_exception``,
``strftime_now``, a ``tojson`` that keeps non-ASCII text).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A template raised (``raise_exception``) or could not be rendered."""


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; here it
    only renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt text.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile once per distinct template text (a pure function of ``source``)."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


CONTENT_FORMATS = ("auto", "string", "openai")


@lru_cache(maxsize=32)
def takes_content_parts(source: str) -> bool:
    """Whether the template loops over a message's content (Gemma 3's does): it is written for
    OpenAI's list of content parts, and gets them as they are (vLLM's "openai" content format,
    found much as vLLM finds it: a for loop over ``<x>.content``, ``<x>['content']`` or
    ``content``). Other templates get the parts' text joined."""
    try:
        tree = _environment().parse(source)
    except jinja2.TemplateSyntaxError:
        return False
    for loop in tree.find_all(jinja2.nodes.For):
        it = loop.iter
        while isinstance(it, (jinja2.nodes.Filter, jinja2.nodes.Test)) and it.node is not None:
            it = it.node
        if isinstance(it, jinja2.nodes.Getitem) and isinstance(it.arg, jinja2.nodes.Slice):
            it = it.node
        if (
            isinstance(it, jinja2.nodes.Getitem)
            and isinstance(it.arg, jinja2.nodes.Const)
            and it.arg.value == "content"
            or isinstance(it, jinja2.nodes.Getattr)
            and it.attr == "content"
            or isinstance(it, jinja2.nodes.Name)
            and it.name == "content"
        ):
            return True
    return False


def _content_parts(content: Any) -> str | list[dict[str, str]]:
    """A message's content for a template that takes parts: a list as its text parts, a string
    as is (as transformers passes them; vLLM would make it one part, which such templates render
    alike)."""
    if content is None or isinstance(content, str):
        return content or ""
    return [{"type": "text", "text": text} for text in _part_texts(content)]


def content_text(content: Any) -> str:
    """A message's content as text: a string as is, None as "", OpenAI's list of content parts
    as its text parts on lines of their own (as vLLM joins them); other parts are refused."""
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(_part_texts(content))


# Content parts that are text: the key holding it. An assistant message's "refusal" part (OpenAI's
# ChatCompletionAssistantMessageParam; a client sends a refusal back as the model gave it) is its
# text, as vLLM reads it.
_TEXT_PARTS = {"text": "text", "refusal": "refusal"}


def _part_texts(content: Any) -> list[str]:
    """The texts of OpenAI's list of content parts; parts that are not text are refused."""
    if not isinstance(content, list):
        raise ChatTemplateError(
            f"a message's content must be a string or a list of parts, got {type(content).__name__}"
        )
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise ChatTemplateError(f"only text content parts are supported, got {kind!r}")
        text = part.get(_TEXT_PARTS[kind])
        if not isinstance(text, str):
            raise ChatTemplateError(
                f"a {kind} content part needs its {_TEXT_PARTS[kind]} (a string)"
            )
        texts.append(text)
    return texts


# Names the template gets from the call itself: template variables may not replace them.
_RESERVED = frozenset({"messages", "add_generation_prompt"})


def render_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str | None] | None = None,
    continue_final_message: bool = False,
    variables: dict[str, Any] | None = None,
    content_format: str = "auto",
) -> str:
    """Render ``messages`` (dicts with at least ``role`` and ``content``).

    ``special_tokens`` (``bos_token``, ``eos_token``, ...) and ``variables`` (``tools``,
    ``documents``, template-specific flags: vLLM's chat_template_kwargs) become template
    variables, as in transformers' ``apply_chat_template``.
    ``continue_final_message``: the text ends where the last message's content does (what the
    template writes after it, an end-of-turn, is cut), so the model continues that message, as in
    transformers; not with ``add_generation_prompt``.
    ``content_format`` (vLLM's chat_template_content_format): how a content given as OpenAI's
    list of parts reaches the template: "openai" as the parts, "string" as their text joined,
    "auto" as the template reads it (takes_content_parts).
    """
    if content_format not in CONTENT_FORMATS:
        raise ChatTemplateError(
            f"chat_template_content_format must be one of {CONTENT_FORMATS}, got {content_format!r}"
        )
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise ChatTemplateError(
                f"each chat message must be a dict with a 'role', got {message!r}"
            )
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError(
            "continue_final_message and add_generation_prompt cannot both be true: the first "
            "continues the last message, the second opens a new one"
        )
    extra = dict(variables or {})
    clash = _RESERVED & set(extra)
    if clash:
        raise ChatTemplateError(f"template variables may not be named {sorted(clash)}")
    if any(m["role"] == "developer" for m in messages) and not _knows_developer(source):
        messages = _developer_as_system(messages)
    parts = takes_content_parts(source) if content_format == "auto" else content_format == "openai"
    as_content = _content_parts if parts else content_text
    messages = [
        m | {"content": as_content(m["content"])} if "content" in m else m for m in messages
    ]
    if continue_final_message and messages:
        messages[-1] = messages[-1] | {"content": _tagged(messages[-1].get("content"))}
    # (a special token the model lacks is left undefined, which renders as "", as transformers
    # leaves it out; None would render "None")
    specials = {k: v for k, v in (special_tokens or {}).items() if v is not None}
    variables: dict[str, Any] = {"tools": None, "documents": None, **specials, **extra}
    try:
        text = compile_chat_template(source).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
    return _cut_at_tag(text) if continue_final_message else text


@lru_cache(maxsize=32)
def _knows_developer(source: str) -> bool:
    return '"developer"' in source or "'developer'" in source


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's ``developer`` role (newer clients send it for ``system``) as ``system``, for a
    template that does not name it (most templates would drop it, keep a default system prompt
    beside it, or refuse the conversation), each where it stands: a system message later in the
    conversation stays there, as one sent as ``system`` does. The system messages that open the
    conversation merge into one (a developer message beside the system prompt), as templates that
    read one system message first need."""
    converted = [m | {"role": "system"} if m["role"] == "developer" else m for m in messages]
    lead = next((i for i, m in enumerate(converted) if m["role"] != "system"), len(converted))
    if lead <= 1:
        return converted
    texts = (content_text(m.get("content")) for m in converted[:lead])
    return [{"role": "system", "content": "\n\n".join(t for t in texts if t)}, *converted[lead:]]


# Where the last message's content ends, for continue_final_message: written after the content,
# found in the rendered text (transformers' rule, and its tag); a search for the content itself
# found the wrong place where the text after it repeats it ("e" in "<|im_end|>").
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tagged(content: Any) -> str | list[dict[str, str]]:
    """The last message's content with the tag after its (last part's) text."""
    if isinstance(content, list):
        if not content:
            raise ChatTemplateError(
                "continue_final_message: the last message has no text to continue"
            )
        last = content[-1]
        return [*content[:-1], last | {"text": last["text"] + _CONTINUE_TAG}]
    return (content or "") + _CONTINUE_TAG


def _cut_at_tag(text: str) -> str:
    """``text`` up to the end of the last message's content (its trailing spaces kept only where
    the template kept them)."""
    at = text.rfind(_CONTINUE_TAG.strip())
    if at == -1:
        raise ChatTemplateError(
            "continue_final_message: the last message does not appear in the rendered chat "
            "(a template that drops or rewrites it)"
        )
    return text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
