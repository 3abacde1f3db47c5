"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``), a thin translation for ``endpoint.py``.

The body becomes a ``request.Request`` (``parse``); the ``Output`` events
become Anthropic's content blocks (``Blocks``): ``thinking`` for the model's
reasoning, ``text`` for its answer, ``tool_use`` for each call, whole or as
Anthropic's SSE events (``message_start``, ``content_block_start`` /
``_delta`` / ``_stop``, ``message_delta`` with the ``stop_reason``,
``message_stop``).

Mapped:

- ``system`` (a string or text blocks) is a system message; ``messages``
  alternate ``user`` and ``assistant``, their content a string or blocks:
  ``text``; ``tool_use`` (an assistant's call: ``id``, ``name``, ``input``)
  and ``tool_result`` (a user's answer to one: ``tool_use_id``, ``content``,
  ``is_error``, which prefixes the content with "Error: "), which become the
  template's ``tool_calls`` and ``tool`` messages; ``thinking`` blocks, whose
  text is the assistant turn's ``reasoning_content`` (templates that render
  past thinking see it); ``redacted_thinking`` is dropped (only Anthropic can
  read it). ``image`` blocks of a user message (``source``: base64 of a PNG,
  JPEG, WebP or GIF) are the request's images (``images.py``), each an
  ``{"type": "image"}`` part of its turn's content where it came; a URL source
  is refused (ringd fetches nothing from the web), and so are images in a
  tool_result, documents and the other blocks ringd cannot read. Consecutive
  turns of one role are joined, as Anthropic joins them.
- A final ``assistant`` message is a prefill: the answer continues its text.
- ``tools`` (custom tools: ``name``, ``description``, ``input_schema``,
  ``strict``; Anthropic's server tools such as web search are refused, naming
  the type), ``tool_choice`` (``auto``, ``any``, ``tool`` with a ``name``,
  ``none``; ``disable_parallel_tool_use``).
- ``thinking``: ``{"type": "enabled", "budget_tokens"}``, ``"adaptive"`` or
  ``"between_tools"`` turns the template's thinking on, ``"disabled"`` off
  (``enable_thinking``); the budget is checked but not a separate cap:
  ``max_tokens`` bounds thinking and answer together. ``display: "omitted"``
  sends thinking blocks without their text.
- ``output_config``: ``format`` ``{"type": "json_schema", "schema"}`` (or the
  beta's top-level ``output_format``): the answer follows the schema (strict, as
  Anthropic's structured outputs are); ``effort`` goes to the template as
  ``reasoning_effort`` (gpt-oss reads it; "xhigh" and "max" as "high").
- ``max_tokens`` (required, as in Anthropic's API), ``stop_sequences`` (the one
  that matched comes back as ``stop_sequence``), ``temperature``, ``top_p``,
  ``top_k`` (read from the body: the SDK's 2.x releases send them as extra body
  fields), ringd's ``seed``, ``min_p`` and penalties, and ``chat_template_kwargs``.
- ``metadata``, ``service_tier`` and Anthropic's cache hints (``cache_control``
  on blocks) are accepted and ignored; ``mcp_servers`` and ``container`` ask
  for what ringd does not run, and are refused.

``stop_reason``: ``end_turn``, ``stop_sequence``, ``max_tokens`` or
``tool_use``. Usage: ``input_tokens`` are the prompt's tokens not read from
ringd's prefix cache, ``cache_read_input_tokens`` those that were.

Errors have Anthropic's shape (``{"type": "error", "error": {"type",
"message"}}``), before a stream and inside one (an ``error`` event).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ringd.http.errors import ApiError
from ringd.http.fields import (
    MAX_MESSAGES, MAX_STOP_CHARS, MAX_STOP_SEQUENCES, asks_nothing, bad, check_schema, check_tool_name, chosen_tool,
    declared_tool, is_bool, is_int, model_name, optional, sampling_fields, sampling_params, template_kwargs,
    tool_list, valid_text,
)
from ringd.http.framing import NamedEvents
from ringd.http.images import ImageError, ImagePart, from_base64, from_web, is_web_url
from ringd.http.segments import Segments
from ringd.http.request import CallOpened, CallPiece, Output, Request, ResponseFormat, Tool, Usage, given_fields
from ringd.ring.media import MAX_IMAGES
from ringd.ring.sampling import brief_repr

if TYPE_CHECKING:
    from ringd.http.node import Served
    from ringd.http.serving import Generation

# Anthropic's error types, by status.
_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
}  # fmt: skip
# Anthropic's rule for tool names: longer than OpenAI's.
MAX_TOOL_NAME_CHARS = 128
# A tool_use block's id, as a client sends it back: Anthropic's are ~30 characters.
MAX_TOOL_USE_ID_CHARS = 256
# What Anthropic calls the internal request's fields, for the errors that name them.
NAMES = {"stop": "stop_sequences"}
THINKING = ("enabled", "disabled", "adaptive", "between_tools")
DISPLAYS = ("summarized", "omitted")
EFFORTS = ("low", "medium", "high", "xhigh", "max")
# Efforts past "high" are Anthropic's newer levels; templates that read an effort (gpt-oss's) know three.
TEMPLATE_EFFORT = {"xhigh": "high", "max": "high"}
# Fields that ask for what ringd does not run: refused unless empty.
REFUSED = {
    "mcp_servers": "ringd connects to no MCP servers; run the tools yourself and send their results as tool_result blocks",
    "container": "ringd runs no code containers",
}
# Blocks that carry what ringd does not read (it reads text and images), and what to send instead.
UNREAD_BLOCKS = {
    "document": "send the document's text in a text block",
    "search_result": "send the result's text in a text block",
    "container_upload": "ringd runs no code containers",
}
# An image source's media types, as Anthropic's API takes them (the file's own header decides how
# it is decoded: images.py).
MEDIA_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")


def error_body(e: ApiError) -> dict:
    return {
        "type": "error",
        "error": {"type": _TYPES.get(e.status, "api_error"), "message": e.message},
    }


@dataclass
class MessagesRequest:
    request: Request
    stream: bool
    show_thinking: bool = True  # thinking.display "omitted": thinking blocks come back empty


# --- the request -------------------------------------------------------------------


def parse(body: dict, count_only: bool = False) -> MessagesRequest:
    """A JSON object as a request, or a 400 ``ApiError``; nothing else escapes.

    ``count_only``: a count_tokens body, which has no ``max_tokens`` nor sampling.
    """
    model = model_name(body)
    for name, why in REFUSED.items():
        if not asks_nothing(body.get(name)):
            raise bad(f"{name} is not supported: {why}", name)

    max_tokens = None
    if not count_only:
        max_tokens = body.get("max_tokens")
        if not is_int(max_tokens) or max_tokens < 1:
            raise bad(
                f"max_tokens is required: an integer of at least 1; got {brief_repr(max_tokens)}",
                "max_tokens",
            )
    stream = optional(body, "stream", is_bool, "a boolean") or False
    # Anthropic's temperature, top_p and top_k, and ringd's sampling beyond them, as chat
    # completions takes it; a negative top_k is a 400 here (-1 for "off" is OpenAI clients' habit).
    sampling = sampling_fields(body)
    params = sampling_params(sampling, negative_top_k_is_off=False)

    images: list[ImagePart] = []
    messages, prefill = _messages(body.get("messages"), images)
    system = _system(body.get("system"))
    if system:
        messages.insert(0, {"role": "system", "content": system})
    tools = _tools(body.get("tools"))
    choice, tool_name, parallel = _tool_choice(body.get("tool_choice"), tools)
    thinking, show_thinking = _thinking(body.get("thinking"), max_tokens)
    fmt, fmt_field, effort = _output_config(body)
    kwargs = {**template_kwargs(body.get("chat_template_kwargs")), **thinking, **effort}
    req = Request(
        model=model, params=params, max_tokens=max_tokens, messages=messages, stop=_stop_sequences(body.get("stop_sequences")),
        tools=tools, tool_choice=choice, tool_name=tool_name, parallel_tool_calls=parallel, response_format=fmt,
        prefill=prefill, template_kwargs=kwargs, names={**NAMES, "response_format": fmt_field},
        given=given_fields(sampling, body.get("stop_sequences")), images=images,
    )  # fmt: skip
    return MessagesRequest(req, stream, show_thinking)


def _system(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, str):
        return valid_text(v, "system")
    if isinstance(v, list):
        return "\n\n".join(_text_block(b, f"system[{i}]") for i, b in enumerate(v))
    raise bad("system must be a string or a list of text blocks", "system")


def _text_block(b: Any, where: str) -> str:
    if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
        kind = b.get("type") if isinstance(b, dict) else b
        raise bad(
            f"{where} must be a text block {{'type': 'text', 'text'}}; got {brief_repr(kind)}",
            where,
        )
    return valid_text(b["text"], f"{where}.text")


def _messages(v: Any, images: list[ImagePart]) -> tuple[list[dict], bool]:
    """The conversation in the form templates take, and whether it ends in a prefill; the user
    turns' images are added to ``images``, in order."""
    if not isinstance(v, list) or not v:
        raise bad("messages is required: a non-empty list of {role, content}", "messages")
    if len(v) > MAX_MESSAGES:
        raise bad(f"at most {MAX_MESSAGES} messages are accepted", "messages")
    out: list[dict] = []
    names: dict[str, str] = {}  # tool_use id -> tool name, for the results that answer them
    pending: set[str] = set()  # calls of the last assistant turn, not answered yet
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object {{role, content}}", where)
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise bad(
                f'{where}.role must be "user" or "assistant"; got {brief_repr(role)} (the system prompt goes in system)',
                f"{where}.role",
            )
        content = m.get("content")
        if isinstance(content, str):
            blocks = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            blocks = content
        else:
            raise bad(
                f"{where}.content must be a string or a list of content blocks",
                f"{where}.content",
            )
        if role == "user":
            _user(blocks, where, out, names, pending, images)
        else:
            _assistant(blocks, where, out, names, pending)
    if len(images) > MAX_IMAGES:
        raise bad(f"{len(images)} images in one request; at most {MAX_IMAGES}", "messages")
    last = _joined(out)[-1]
    prefill = last["role"] == "assistant"
    if prefill and last.get("tool_calls"):
        raise bad(
            "the last message holds tool_use blocks: send their tool_result blocks in a user message after it",
            f"messages[{len(v) - 1}]",
        )
    return out, prefill


# Where a turn joined of several messages keeps their texts until they are joined once.
PARTS = "_parts"
# How the texts of joined turns are joined: paragraphs; thinking runs on.
JOINED_BY = {"content": "\n\n", "reasoning_content": ""}


def _append(out: list[dict], msg: dict) -> None:
    """Add a turn, joined to the one before if it has the same role (as Anthropic joins them).

    A joined turn keeps its texts as parts (PARTS) until ``_joined`` makes them one string: joining
    at each step copied the turn so far every time, quadratic in a run of same-role messages
    (4,096 of them, 16 MB, held the event loop for seconds)."""
    last = out[-1] if out else None
    if last is not None and last["role"] == msg["role"] and msg["role"] in ("user", "assistant") and not last.get("tool_calls"):
        for key in JOINED_BY:
            if msg.get(key):
                last.setdefault(PARTS, {}).setdefault(key, [last[key]] if last.get(key) else []).append(msg[key])
        if "tool_calls" in msg:
            last["tool_calls"] = last.get("tool_calls", []) + msg["tool_calls"]  # once per turn: it ends the joining
        return
    out.append(msg)


def _joined(out: list[dict]) -> list[dict]:
    """The turns ``_append`` joined, each text one string again (a turn with images: its parts, in order)."""
    for m in out:
        for key, parts in m.pop(PARTS, {}).items():
            if all(isinstance(p, str) for p in parts):
                m[key] = JOINED_BY[key].join(parts)
            else:  # a user turn with images
                m[key] = _turn([q for p in parts for q in ([{"type": "text", "text": p}] if isinstance(p, str) else p)])
    return out


def _turn(parts: list[dict]) -> str | list[dict]:
    """A user turn's content: its texts as one, joined as Anthropic joins them (paragraphs); where it
    holds images, its parts in order, each run of texts between them one text part."""
    if not any(p["type"] == "image" for p in parts):
        return "\n\n".join(p["text"] for p in parts)
    out: list[dict] = []
    texts: list[str] = []
    for p in parts:
        if p["type"] == "text":
            texts.append(p["text"])
            continue
        if texts:
            out.append({"type": "text", "text": "\n\n".join(texts)})
            texts = []
        out.append(p)
    if texts:
        out.append({"type": "text", "text": "\n\n".join(texts)})
    return out


def _image(b: dict, at: str) -> ImagePart:
    """An image block's picture: its source's base64, not decoded yet (``images.py``)."""
    source = b.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "url":  # fetched only where the leader's config allows it (images.decode_all)
        url = source.get("url")
        if not isinstance(url, str) or not is_web_url(url):
            raise bad(f"{at}.source.url must be an http(s) URL; got {brief_repr(url)}", f"{at}.source.url")
        try:
            return from_web(url, f"{at}.source.url")
        except ImageError as e:
            raise bad(str(e), f"{at}.source.url") from None
    if kind == "file":
        raise bad(f"{at}.source names a file: ringd keeps no files; send the image itself, as base64", f"{at}.source")
    if not isinstance(source, dict):
        raise bad(f"{at}.source must be {{'type': 'base64', 'media_type', 'data'}}; got {brief_repr(source)}", f"{at}.source")
    if kind != "base64":
        raise bad(f"{at}.source.type must be 'base64' (with media_type and data); got {brief_repr(kind)}", f"{at}.source.type")
    media = source.get("media_type")
    if media not in MEDIA_TYPES:
        raise bad(f"{at}.source.media_type must be one of {', '.join(MEDIA_TYPES)}; got {brief_repr(media)}", f"{at}.source.media_type")
    try:
        return from_base64(source.get("data"), f"{at}.source.data")
    except ImageError as e:
        raise bad(str(e), f"{at}.source.data") from None


def _unread(kind: str, at: str) -> ApiError:
    return bad(f"{at} is a {kind} block, which ringd does not read: {UNREAD_BLOCKS[kind]}", f"{at}.type")


def _user(blocks: list, where: str, out: list[dict], names: dict[str, str], pending: set[str], images: list[ImagePart]) -> None:
    parts: list[dict] = []  # the turn's text and image parts, in order
    for j, b in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _text_block(b, at)})
        elif kind == "image":
            images.append(_image(b, at))
            parts.append({"type": "image"})
        elif kind == "tool_result":
            if parts:  # Anthropic puts results first; what comes before one is its own turn
                _append(out, {"role": "user", "content": _turn(parts)})
                parts = []
            call_id = b.get("tool_use_id")
            if not isinstance(call_id, str) or call_id not in names:
                raise bad(
                    f"{at}.tool_use_id must name a tool_use block of an earlier assistant message; got {brief_repr(call_id)}",
                    f"{at}.tool_use_id",
                )
            pending.discard(call_id)
            result = b.get("content")
            if result is None:
                text = ""
            elif isinstance(result, str):
                text = valid_text(result, f"{at}.content")
            elif isinstance(result, list):
                text = "\n\n".join(_result_text(p, f"{at}.content[{k}]") for k, p in enumerate(result))
            else:
                raise bad(
                    f"{at}.content must be a string or a list of text blocks",
                    f"{at}.content",
                )
            if b.get("is_error") is True:
                text = "Error: " + text
            out.append(
                {
                    "role": "tool",
                    "content": text,
                    "tool_call_id": call_id,
                    "name": names[call_id],
                }
            )
        elif isinstance(kind, str) and kind in UNREAD_BLOCKS:
            raise _unread(kind, at)
        else:
            raise bad(
                f"{at} must be a text, image or tool_result block; got {brief_repr(kind)}",
                f"{at}.type",
            )
    if pending:
        raise bad(
            f"{where} must answer every tool_use of the message before it; missing: {', '.join(sorted(pending))}",
            where,
        )
    if parts or not blocks:
        _append(out, {"role": "user", "content": _turn(parts)})


def _result_text(b: Any, at: str) -> str:
    """A part of a tool_result's content: text. An image there is refused: a template that knows
    no tools writes a result as JSON text (``render.py``), where an image has no place."""
    if isinstance(b, dict) and b.get("type") == "image":
        raise bad(
            f"{at} is an image in a tool_result, which ringd does not take; send it as an image block of the "
            "user message, after the tool_result",
            f"{at}.type",
        )  # fmt: skip
    return _text_block(b, at)


def _assistant(blocks: list, where: str, out: list[dict], names: dict[str, str], pending: set[str]) -> None:
    texts, reasoning, calls = [], [], []
    for j, b in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(_text_block(b, at))
        elif kind == "thinking":
            if not isinstance(b.get("thinking"), str):
                raise bad(f"{at}.thinking must be a string", f"{at}.thinking")
            reasoning.append(valid_text(b["thinking"], f"{at}.thinking"))
        elif kind == "redacted_thinking":
            continue  # encrypted by Anthropic for its own models: nothing here can read it
        elif kind == "tool_use":
            call_id = b.get("id")
            if not isinstance(call_id, str) or not call_id or len(call_id) > MAX_TOOL_USE_ID_CHARS:
                raise bad(
                    f"{at}.id must be a string of 1 to {MAX_TOOL_USE_ID_CHARS} characters",
                    f"{at}.id",
                )
            if call_id in names:
                raise bad(f"{at}.id {call_id!r} is used twice", f"{at}.id")
            name = check_tool_name(b.get("name"), f"{at}.name", MAX_TOOL_NAME_CHARS)
            args = b.get("input")
            if not isinstance(args, dict):
                raise bad(
                    f"{at}.input must be an object; got {brief_repr(args)}",
                    f"{at}.input",
                )
            names[call_id] = name
            pending.add(call_id)
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": args},
                }
            )
        elif kind == "image":
            raise bad(f"{at} is an image block: images go in user messages, not the assistant's", f"{at}.type")
        elif isinstance(kind, str) and kind in UNREAD_BLOCKS:
            raise _unread(kind, at)
        else:
            raise bad(
                f"{at} must be a text, thinking or tool_use block; got {brief_repr(kind)}",
                f"{at}.type",
            )
    msg: dict = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        msg["reasoning_content"] = "\n\n".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    _append(out, msg)


def _tools(v: Any) -> list[Tool]:
    out, seen = [], set()
    for i, t in enumerate(tool_list(v)):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad(f"{where} must be an object {{name, description, input_schema}}", where)
        kind = t.get("type")
        if kind not in (None, "custom"):
            raise bad(
                f"{where} is Anthropic's {brief_repr(kind)} tool; ringd runs no tools of its own, so only custom tools "
                "({name, description, input_schema}) are supported",
                f"{where}.type",
            )
        name, description = declared_tool(t, where, seen, MAX_TOOL_NAME_CHARS)
        if "input_schema" not in t:
            raise bad(
                f"{where}.input_schema is required: a JSON schema of the tool's input",
                f"{where}.input_schema",
            )
        schema = check_schema(t["input_schema"], f"{where}.input_schema")
        strict = t.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad(f"{where}.strict must be a boolean", f"{where}.strict")
        out.append(
            Tool(
                name,
                description,
                schema,
                strict is True,
            )
        )
    return out


def _tool_choice(v: Any, tools: list[Tool]) -> tuple[str, str | None, bool]:
    """OpenAI's tool_choice for Anthropic's, its function's name, and whether calls may come in parallel."""
    if v is None:
        return "auto", None, True
    kind = v.get("type") if isinstance(v, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise bad(
            f'tool_choice must be {{"type": "auto" | "any" | "tool" | "none"}}; got {brief_repr(v)}',
            "tool_choice",
        )
    parallel = v.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad(
            "tool_choice.disable_parallel_tool_use must be a boolean",
            "tool_choice.disable_parallel_tool_use",
        )
    if kind in ("any", "tool") and not tools:
        raise bad(f"tool_choice {kind!r} needs tools", "tool_choice")
    name = None
    if kind == "tool":
        name = chosen_tool(v.get("name"), tools, "tool_choice.name", "tool")
    choice = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}[kind]
    return choice, name, parallel is not True


def _thinking(v: Any, max_tokens: int | None) -> tuple[dict, bool]:
    """The template variables of ``thinking``, and whether its text is shown."""
    if v is None:
        return {}, True
    kind = v.get("type") if isinstance(v, dict) else None
    if kind not in THINKING:
        raise bad(
            f"thinking.type must be one of {', '.join(THINKING)}; got {brief_repr(v)}",
            "thinking",
        )
    if kind == "disabled":
        return {"enable_thinking": False}, True
    budget = v.get("budget_tokens")
    if kind == "enabled" and (not is_int(budget) or budget < 1):
        raise bad(
            f"thinking.budget_tokens must be a positive integer; got {brief_repr(budget)}",
            "thinking.budget_tokens",
        )
    if budget is not None and max_tokens is not None and budget >= max_tokens:
        raise bad(
            f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})",
            "thinking.budget_tokens",
        )
    display = v.get("display")
    if display is not None and display not in DISPLAYS:
        raise bad(
            f"thinking.display must be one of {', '.join(DISPLAYS)}; got {brief_repr(display)}",
            "thinking.display",
        )
    return {"enable_thinking": True}, display != "omitted"


def _output_config(body: dict) -> tuple[ResponseFormat | None, str, dict]:
    """The answer's format and the field that gave it; the template variables of an effort."""
    config = body.get("output_config")
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise bad("output_config must be an object {format?, effort?}", "output_config")
    effort = config.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise bad(
            f"output_config.effort must be one of {', '.join(EFFORTS)}; got {brief_repr(effort)}",
            "output_config.effort",
        )
    kwargs = {"reasoning_effort": TEMPLATE_EFFORT.get(effort, effort)} if effort else {}
    # output_format: the structured-outputs beta's name for it, before output_config.
    if config.get("format") is not None:
        where, v = "output_config.format", config["format"]
    else:
        where, v = "output_format", body.get("output_format")
    if v is None:
        return None, where, kwargs
    kind = v.get("type") if isinstance(v, dict) else None
    if kind != "json_schema" or "schema" not in v:
        raise bad(
            f'{where} must be {{"type": "json_schema", "schema"}}; got {brief_repr(v)}',
            where,
        )
    # Anthropic's structured outputs are strict: no properties beyond those the schema names.
    return (
        ResponseFormat("json_schema", check_schema(v["schema"], f"{where}.schema"), None, True),
        where,
        kwargs,
    )


def _stop_sequences(v: Any) -> list[str]:
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in v):
        raise bad(
            f"stop_sequences must be a list of non-empty strings of at most {MAX_STOP_CHARS} characters",
            "stop_sequences",
        )
    if len(v) > MAX_STOP_SEQUENCES:
        raise bad(
            f"at most {MAX_STOP_SEQUENCES} stop_sequences are supported",
            "stop_sequences",
        )
    return [valid_text(s, f"stop_sequences[{i}]") for i, s in enumerate(v)]


# --- the answer --------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def usage(u: Usage) -> dict:
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens": u.completion_tokens,
    }


def stop_reason(finish: str | None, stop_sequence: str | None) -> str | None:
    if finish == "tool_calls":
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    if finish == "stop":
        return "stop_sequence" if stop_sequence is not None else "end_turn"
    return None


def message(
    rid: str,
    model: str,
    content: list[dict],
    finish: str | None,
    stop_sequence: str | None,
    u: Usage,
) -> dict:
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(finish, stop_sequence),
        "stop_sequence": stop_sequence if finish == "stop" else None,
        "usage": usage(u),
    }


class Blocks(Segments):
    """``Output`` events in, Anthropic's content blocks and the stream events that build them out
    (``segments.py``: the machine; ``content`` holds the blocks). Thinking is a ``thinking``
    block, answer text a ``text`` block, each call a ``tool_use`` block."""

    TEXT, THINKING, CALL = "text", "thinking", "tool_use"

    def __init__(self, show_thinking: bool = True):
        super().__init__()
        self.content = self.segments
        self.show_thinking = show_thinking
        self.cut = False  # a call max_tokens cut was stopped where it was cut

    def finish(self, streamed: bool) -> list[dict]:
        """The events that end the content; ``content`` is then final (a call cut short: ``cut``)."""
        self.cut = self._cut_call(streamed)
        events = []
        if self._blank and not self._answered():
            events += self._write(self.TEXT, self._blank)
        return events + self._close()

    def _begin(self, kind: str) -> list[dict]:
        block = {"type": "text", "text": ""} if kind == self.TEXT else {"type": "thinking", "thinking": "", "signature": ""}
        return [{"type": "content_block_start", "index": self._opened(block), "content_block": dict(block)}]

    def _grow(self, kind: str, text: str) -> list[dict]:
        if kind == self.THINKING and not self.show_thinking:
            return []  # omitted thinking: the block, without its text
        self._open[kind] += text
        delta = {"type": "text_delta", "text": text} if kind == self.TEXT else {"type": "thinking_delta", "thinking": text}
        return [{"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}]

    def _close(self, status: str = "completed") -> list[dict]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def _begin_call(self, piece: CallOpened) -> list[dict]:
        block = {"type": "tool_use", "id": "toolu_" + piece.id.removeprefix("call_"), "name": piece.name, "input": {}}
        return [{"type": "content_block_start", "index": self._opened(block), "content_block": dict(block)}]

    def _arguments(self, text: str) -> list[dict]:
        delta = {"type": "input_json_delta", "partial_json": text}
        return [{"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}]

    def _call_done(self, piece: CallPiece) -> list[dict]:
        self._open["input"] = json.loads(piece.call.arguments)
        return self._close()


class Messages(NamedEvents):
    """``POST /v1/messages``."""

    def parse(self, body: dict, served: "Served") -> "MessageAnswer":
        return MessageAnswer(parse(body), served.model_id)


class CountTokens:
    """``POST /v1/messages/count_tokens``: the prompt tokens a Messages body would take."""

    def parse(self, body: dict) -> Request:
        return parse(body, count_only=True).request

    def counted(self, tokens: int) -> dict:
        return {"input_tokens": tokens}


class MessageAnswer:
    """One message: Anthropic's message object, or its stream events."""

    def __init__(self, p: MessagesRequest, model_id: str):
        self.request = p.request
        self.stream = p.stream
        self.model_id = model_id
        self.id = new_id("msg")
        self.blocks = Blocks(p.show_thinking)
        self.last: Output | None = None

    def _ending(self) -> tuple[str | None, str | None]:
        last = self.last
        return (last.finish_reason, last.stop_sequence) if last is not None else (None, None)

    def start(self, gen: "Generation", resume) -> list[dict]:
        start = message(self.id, self.model_id, [], None, None, gen.usage)
        start["usage"]["output_tokens"] = 0
        return [{"type": "message_start", "message": start}, {"type": "ping"}]

    def feed(self, out: Output) -> list[dict]:
        self.last = out
        return self.blocks.feed(out)

    def end(self, gen: "Generation") -> list[dict]:
        finish, stop = self._ending()
        blocks = self.blocks.finish(streamed=True)
        if self.blocks.cut:
            finish = "length"  # max_tokens cut the call this stream has begun
        delta = {"stop_reason": stop_reason(finish, stop), "stop_sequence": stop if finish == "stop" else None}
        return [
            *blocks,
            {"type": "message_delta", "delta": delta, "usage": {"output_tokens": gen.usage.completion_tokens}},
            {"type": "message_stop"},
        ]

    def error(self, e: ApiError) -> list[dict]:
        return [error_body(e)]  # in-band, as Anthropic reports a failure mid-stream

    def whole(self, gen: "Generation") -> dict:
        self.blocks.finish(streamed=False)
        finish, stop = self._ending()
        return message(self.id, self.model_id, self.blocks.content, finish, stop, gen.usage)
