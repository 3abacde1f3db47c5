"""OpenAI's Responses API (``POST /v1/responses``), as a thin, stateless translation for ``endpoint.py``.

The body becomes a ``request.Request`` (``parse``); the ``Output`` events
become Responses' output items (``OutputItems``): a ``reasoning`` item for
thinking, a ``message`` item for the answer, a ``function_call`` item per tool
call, whole or as Responses' SSE events (``event:`` and ``data:`` lines, each
with its ``type`` and ``sequence_number``).

ringd keeps nothing between requests, so the API is used statelessly:

- ``previous_response_id``, ``conversation`` and ``item_reference`` inputs
  name stored state, and are refused (400: send the whole conversation in
  ``input``); so are ``background: true`` (it needs a stored response to poll),
  ``prompt`` (stored prompt templates) and ``truncation: "auto"`` (ringd
  never drops input to fit the context). ``include`` may ask for
  ``reasoning.encrypted_content`` only, as stateless clients (Codex) do to
  keep reasoning across turns: each reasoning item then carries its text,
  base64 behind ``ENCRYPTED_PREFIX`` (not encrypted: the client has the text
  anyway), and that item sent back as input is read again.
- ``store`` is accepted whatever its value (true is OpenAI's default, and
  clients send it), and every response says ``"store": false``: it was not
  stored, and no later request can name it.
- ``metadata`` and ``user`` are echoed and otherwise ignored, as are OpenAI's
  routing and caching hints (``service_tier``, ``prompt_cache_key``, ...).

Mapped:

- ``input``: a string (one user message) or items: messages (user, assistant,
  system, developer; content as a string or ``input_text`` / ``output_text``
  / ``refusal`` parts, and a user message's ``input_image`` parts: a data URL
  in ``image_url``, which becomes one of the request's images (``images.py``)
  and an ``{"type": "image"}`` part where it came; a web URL or a
  ``file_id`` is refused, as are files), ``function_call`` and
  ``function_call_output`` items (a call joins
  the assistant message just before it), and ``reasoning`` items, whose text
  (their ``content``, else their ``summary``) becomes the
  ``reasoning_content`` of the assistant message or call that follows them:
  templates that render past thinking (Qwen3's, within the turn in progress)
  see it, others drop it. So a client may send ``response.output`` back as
  input. ``instructions`` is a system message before them.
- ``tools``: function tools (``strict`` defaults to true, as in Responses);
  any other tool type (web_search, file_search, mcp, ...) is refused naming it.
  ``tool_choice`` "auto" / "none" / "required", ``{"type": "function",
  "name"}``, or ``{"type": "allowed_tools", "mode", "tools"}`` (the tools
  offered are narrowed to those).
- ``text.format``: "text", "json_object", "json_schema" (``schema``,
  ``strict``), as chat's ``response_format``.
- ``reasoning.effort``: "none" and "minimal" turn the template's thinking off
  (``enable_thinking: false``: there is no smaller budget to give); "low" to
  "max" turn it on and go to the template as ``reasoning_effort`` (gpt-oss
  reads it; "xhigh" and "max" as "high"). A model that does not think ignores
  both: clients send an effort with every request, so it is never refused.
- ``max_output_tokens``, ``temperature``, ``top_p``, ``parallel_tool_calls``;
  and, as chat completions takes them, ringd's ``top_k``, ``min_p``, ``seed``,
  penalties and ``chat_template_kwargs``. ``top_logprobs`` is checked and
  echoed: without ``include`` OpenAI returns no logprobs either.
  ``max_tool_calls`` bounds built-in tools, of which ringd has none.

Errors have OpenAI's shape (``api.py``) and name Responses' own fields
(``Request.names``: ``max_output_tokens``, ``input``, ``text.format``).
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ringd.http.errors import ApiError
from ringd.http.fields import (
    MAX_MESSAGES, asks_nothing, bad, check_schema, chosen_tool, declared_tool, is_bool, is_int, is_object,
    model_name, optional, sampling_fields, sampling_params, template_kwargs, tool_list, valid_text,
)
from ringd.http.framing import NamedEvents
from ringd.http.images import ImagePart
from ringd.http.openai_types import image_url
from ringd.http.segments import Segments
from ringd.http.request import CallOpened, Output, Request, ResponseFormat, Tool, Usage, given_fields
from ringd.ring.media import MAX_IMAGES
from ringd.ring.sampling import SamplingParams, brief_repr

if TYPE_CHECKING:
    from ringd.http.node import Served
    from ringd.http.serving import Generation

# Input items in one request: as many as chat completions takes messages.
MAX_INPUT_ITEMS = MAX_MESSAGES
# What Responses calls the internal request's fields, for the errors that name them.
NAMES = {"max_tokens": "max_output_tokens", "messages": "input", "prompt": "input", "response_format": "text.format"}
MESSAGE_ROLES = ("user", "assistant", "system", "developer")
# Input content parts that carry text, and the key that holds it.
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# Efforts past "high" are OpenAI's newer levels; templates that read an effort know three.
TEMPLATE_EFFORT = {"xhigh": "high", "max": "high"}

# Fields that ask for what a stateless ring cannot do: refused, unless they hold
# one of the values that ask for nothing (null, [] and {} count as absent).
REFUSED: dict[str, tuple[tuple, str]] = {
    "previous_response_id": ((), "ringd keeps no responses; send the whole conversation in input"),
    "conversation": ((), "ringd keeps no conversations; send the whole conversation in input"),
    "background": ((False,), "ringd keeps no responses to poll, so it answers in the foreground only; leave background false"),
    "prompt": ((), "ringd keeps no prompt templates; send instructions and input"),
    "truncation": (("disabled",), "ringd never drops input to fit the context; a prompt too long for it is a 400"),
}
# What include may ask for: the one extra output a stateless server can give.
INCLUDES = ("reasoning.encrypted_content",)
# A reasoning item's encrypted_content as ringd writes it: this, then the text in base64.
ENCRYPTED_PREFIX = "ringd-reasoning:"


@dataclass
class ResponsesRequest:
    request: Request
    stream: bool
    # The request's settings as the response object repeats them (the SDK's Response requires several).
    echo: dict
    encrypted_reasoning: bool = False  # include: reasoning items carry encrypted_content


# --- the request -------------------------------------------------------------------


def parse(body: dict) -> ResponsesRequest:
    """A JSON object (``fields.parse_json``) as a request, or a 400 ``ApiError``; nothing else escapes."""

    def opt(name: str, check, rule: str):
        return optional(body, name, check, rule)

    model = model_name(body)
    for name, (accepted, why) in REFUSED.items():
        if not asks_nothing(body.get(name), accepted):
            raise bad(f"{name} is not supported: {why}", name, "unsupported_parameter")

    max_tokens = opt("max_output_tokens", is_int, "an integer")
    if max_tokens is not None and max_tokens < 1:
        raise bad("max_output_tokens must be at least 1", "max_output_tokens")
    stream = opt("stream", is_bool, "a boolean") or False
    opt("store", is_bool, "a boolean")
    top_logprobs = opt("top_logprobs", lambda v: is_int(v) and 0 <= v <= 20, "an integer from 0 to 20")
    # Responses' own temperature and top_p, and ringd's sampling beyond them, as chat completions takes it.
    sampling = sampling_fields(body)
    params = sampling_params(sampling)

    instructions = opt("instructions", lambda v: isinstance(v, str), "a string")
    images: list[ImagePart] = []
    messages = _input(body.get("input"), images)
    if instructions:
        messages.insert(0, {"role": "system", "content": valid_text(instructions, "instructions")})

    declared = _tools(body.get("tools"))
    choice, tool_name, tools = _tool_choice(body.get("tool_choice"), declared)
    parallel = opt("parallel_tool_calls", is_bool, "a boolean")
    text = opt("text", is_object, "an object") or {}
    fmt, fmt_echo = _text_format(text.get("format"))
    kwargs, effort = _reasoning(body.get("reasoning"))
    kwargs = {**template_kwargs(body.get("chat_template_kwargs")), **kwargs}

    req = Request(
        model=model, params=params, max_tokens=max_tokens, messages=messages, tools=tools, tool_choice=choice,
        tool_name=tool_name, parallel_tool_calls=True if parallel is None else parallel, response_format=fmt,
        template_kwargs=kwargs, names=NAMES, given=given_fields(sampling, None), images=images,
    )  # fmt: skip
    metadata = body.get("metadata")
    user = body.get("user")
    echo = {
        "instructions": instructions,
        "max_output_tokens": max_tokens,
        "parallel_tool_calls": req.parallel_tool_calls,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_logprobs": top_logprobs,
        "tools": [
            {"type": "function", "name": t.name, "description": t.description or None, "parameters": t.parameters, "strict": t.strict}
            for t in declared
        ],
        "tool_choice": _choice_echo(body.get("tool_choice"), choice, tool_name, tools),
        "text": {"format": fmt_echo},
        "reasoning": {"effort": effort, "summary": None},
        "truncation": "disabled",
        # Echoed only as OpenAI defines it (strings to strings): the echo holds nothing a client nested.
        "metadata": metadata if isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values()) else {},
        "user": user if isinstance(user, str) else None,
    }
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or not all(isinstance(v, str) for v in include)):
        raise bad(f"include must be a list of strings; got {brief_repr(include)}", "include")
    for v in include or ():
        if v not in INCLUDES:
            raise bad(
                f"include {brief_repr(v)} is not supported: ringd returns no extra output data but {', '.join(INCLUDES)}",
                "include",
                "unsupported_parameter",
            )
    return ResponsesRequest(req, stream, echo, "reasoning.encrypted_content" in (include or ()))


def _input(v: Any, images: list[ImagePart]) -> list[dict]:
    """The conversation in the form templates take; the user messages' images are added to ``images``, in order."""
    if isinstance(v, str):
        return [{"role": "user", "content": valid_text(v, "input")}]
    if not isinstance(v, list) or not v:
        raise bad("input is required: a string, or a non-empty list of items (messages, function calls and their outputs)", "input")
    if len(v) > MAX_INPUT_ITEMS:
        raise bad(f"at most {MAX_INPUT_ITEMS} input items are accepted", "input")
    out: list[dict] = []
    names: dict[str, str] = {}  # call id -> function name, for the outputs that answer them
    reasoning = ""  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(v):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise bad(f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}; got {brief_repr(role)}", f"{where}.role")
            content = _content(item.get("content"), f"{where}.content", images if role == "user" else None)
            msg = {"role": "system" if role == "developer" else role, "content": content}
            if role == "assistant" and reasoning:
                msg["reasoning_content"], reasoning = reasoning, ""
            out.append(msg)
        elif kind == "function_call":
            call_id = _string(item, "call_id", where)
            name = _string(item, "name", where)
            args = item.get("arguments")
            try:  # JSON text, as OpenAI gives it; an object or nothing also reads plainly
                parsed = (json.loads(args) if args.strip() else {}) if isinstance(args, str) else {} if args is None else args
            except (ValueError, RecursionError):  # RecursionError: arrays nested past the interpreter's limit
                parsed = None
            if not isinstance(parsed, dict):
                raise bad(f"{where}.arguments must be a JSON object, as text; got {brief_repr(args)}", f"{where}.arguments")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}}
            names[call_id] = name
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
            if reasoning and "reasoning_content" not in last:
                last["reasoning_content"], reasoning = reasoning, ""
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            output = item.get("output")
            content = output if isinstance(output, str) else _content(output, f"{where}.output") if isinstance(output, list) else None
            if content is None:
                raise bad(f"{where}.output must be a string or a list of input_text parts", f"{where}.output")
            out.append({"role": "tool", "content": valid_text(content, f"{where}.output"), "tool_call_id": call_id, "name": names.get(call_id, "")})
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, where)
        elif kind == "item_reference":
            raise bad(f"{where} refers to a stored item; ringd keeps no items: send the item itself", where, "unsupported_parameter")
        else:
            raise bad(
                f"{where} is a {brief_repr(kind)} item; ringd takes messages, function_call, function_call_output and reasoning items",
                f"{where}.type",
            )
    if not out:
        raise bad("input holds no message: reasoning items alone give the model nothing to answer", "input")
    if len(images) > MAX_IMAGES:
        raise bad(f"{len(images)} images in one request; at most {MAX_IMAGES}", "input")
    return out


def _string(item: dict, key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str) or not v:
        raise bad(f"{where}.{key} is required and must be a string", f"{where}.{key}")
    return valid_text(v, f"{where}.{key}")


def _content(content: Any, where: str, images: list[ImagePart] | None = None) -> str | list[dict]:
    """Content as a template takes it: its text, or where it holds images, its parts in order
    (``{"type": "text", "text"}``, ``{"type": "image"}``), each image added to ``images``. Only a
    user message's content (``images`` given) may hold images."""
    if content is None:
        return ""
    if isinstance(content, str):
        return valid_text(content, where)
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of content parts", where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            if images is None:
                raise bad(f"{where}[{j}] is an input_image part: ringd takes images in user messages only", f"{where}[{j}]")
            images.append(_image(part, f"{where}[{j}]"))
            parts.append({"type": "image"})
            continue
        key = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None or not isinstance(part.get(key), str):
            raise bad(
                f"{where}[{j}] must be a text part ({', '.join(TEXT_PARTS)}) or an input_image part; got {brief_repr(kind)}",
                f"{where}[{j}]",
            )
        parts.append({"type": "text", "text": valid_text(part[key], f"{where}[{j}].{key}")})
    if any(part["type"] == "image" for part in parts):
        return parts
    return "".join(part["text"] for part in parts)


def _image(part: dict, where: str) -> ImagePart:
    """An input_image part's picture: its ``image_url``, a data URL (chat's rule: ``openai_types.image_url``)."""
    if part.get("file_id") is not None:
        raise bad(f"{where}.file_id: ringd keeps no files; send the image as a data URL in image_url (data:image/png;base64,...)", f"{where}.file_id")
    url = part.get("image_url")
    if not isinstance(url, str):
        raise bad(f"{where}.image_url is required: the image as a data URL (data:image/png;base64,...)", f"{where}.image_url")
    return image_url(url, f"{where}.image_url")


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: ringd's encrypted_content, else its content (reasoning_text parts), else its summary."""
    sealed = item.get("encrypted_content")
    if isinstance(sealed, str) and sealed.startswith(ENCRYPTED_PREFIX):
        try:
            return valid_text(base64.b64decode(sealed[len(ENCRYPTED_PREFIX) :], validate=True).decode(), f"{where}.encrypted_content")
        except (ValueError, UnicodeDecodeError):  # binascii.Error is a ValueError
            raise bad(f"{where}.encrypted_content is not reasoning ringd wrote; send it back as it came", f"{where}.encrypted_content") from None
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts in (None, []):
            continue
        if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
            raise bad(f"{where}.{key} must be a list of {{'type', 'text'}} parts", f"{where}.{key}")
        return valid_text("\n".join(p["text"] for p in parts), f"{where}.{key}")
    return ""  # another server's encrypted_content only (OpenAI's): nothing here can read it


def _tools(v: Any) -> list[Tool]:
    out, seen = [], set()
    for i, t in enumerate(tool_list(v)):
        where = f"tools[{i}]"
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise bad(
                f"{where} is a {brief_repr(kind)} tool; ringd runs no tools of its own, so only function tools "
                '({"type": "function", "name", "description", "parameters"}) are supported',
                where,
                "unsupported_tool",
            )
        name, description = declared_tool(t, where, seen)
        params = t.get("parameters")
        params = {"type": "object", "properties": {}} if params is None else check_schema(params, f"{where}.parameters")
        strict = t.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad(f"{where}.strict must be a boolean", f"{where}.strict")
        # Responses' default is strict: arguments have exactly the properties the schema names.
        out.append(Tool(name, description, params, strict is not False))
    return out


def _tool_choice(v: Any, tools: list[Tool]) -> tuple[str, str | None, list[Tool]]:
    if v is None:
        return "auto", None, tools
    if v in ("auto", "none", "required"):
        return v, None, tools
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "function":
        return "function", chosen_tool(v.get("name"), tools, "tool_choice"), tools
    if kind == "allowed_tools":
        mode, allowed = v.get("mode"), v.get("tools")
        if mode not in ("auto", "required") or not isinstance(allowed, list):
            raise bad('tool_choice allowed_tools takes {"mode": "auto" | "required", "tools": [{"type": "function", "name"}]}', "tool_choice")
        names = {chosen_tool(a.get("name"), tools, "tool_choice.tools") for a in allowed if isinstance(a, dict) and a.get("type") == "function"}
        if len(names) != len(allowed):
            raise bad("tool_choice.tools must name function tools among the tools, each once", "tool_choice.tools")
        return mode, None, [t for t in tools if t.name in names]
    raise bad(
        'tool_choice must be "auto", "none", "required", {"type": "function", "name"} or {"type": "allowed_tools", ...}; '
        f"got {brief_repr(v)}",
        "tool_choice",
    )


def _choice_echo(given: Any, choice: str, name: str | None, tools: list[Tool]) -> str | dict:
    if isinstance(given, dict) and given.get("type") == "allowed_tools":
        return {"type": "allowed_tools", "mode": choice, "tools": [{"type": "function", "name": t.name} for t in tools]}
    return {"type": "function", "name": name} if choice == "function" else choice


def _text_format(v: Any) -> tuple[ResponseFormat | None, dict]:
    if v is None or v == {} or v == {"type": "text"}:
        return None, {"type": "text"}
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "json_object":
        return ResponseFormat("json_object"), {"type": "json_object"}
    if kind == "json_schema":
        if "schema" not in v:
            raise bad("text.format json_schema needs a schema: {type, name, schema, strict?}", "text.format.schema")
        schema = check_schema(v["schema"], "text.format.schema")
        name = v.get("name") if isinstance(v.get("name"), str) else None
        strict = v.get("strict") is True
        return ResponseFormat("json_schema", schema, name, strict), {"type": "json_schema", "name": name or "response", "schema": schema, "strict": strict}
    raise bad(f'text.format.type must be "text", "json_object" or "json_schema"; got {brief_repr(kind)}', "text.format.type")


def _reasoning(v: Any) -> tuple[dict, str | None]:
    """The template variables of ``reasoning``, and its effort as echoed."""
    if v is None:
        return {}, None
    if not isinstance(v, dict):
        raise bad("reasoning must be an object, e.g. {\"effort\": \"low\"}", "reasoning")
    effort = v.get("effort")
    if effort is None:
        return {}, None
    if effort not in EFFORTS:
        raise bad(f"reasoning.effort must be one of {', '.join(EFFORTS)}; got {brief_repr(effort)}", "reasoning.effort")
    if effort in ("none", "minimal"):
        return {"enable_thinking": False}, effort
    return {"enable_thinking": True, "reasoning_effort": TEMPLATE_EFFORT.get(effort, effort)}, effort


# --- the answer --------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(u: Usage) -> dict:
    return {
        "input_tokens": u.prompt_tokens,
        # cache_write_tokens: the SDK's model requires it; ringd's prefix cache is not billed, so 0.
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def response_object(
    p: ResponsesRequest, rid: str, created: int, model: str, output: list[dict], status: str, u: Usage | None, sampled: SamplingParams | None = None
) -> dict:
    """Responses' response object: the answer so far, and the request's settings echoed; ``sampled``,
    what it is sampled with (the model's defaults filled in: ``serving.py``), gives the temperature
    and top_p echoed."""
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model,
        "output": output,
        "previous_response_id": None,
        "store": False,  # stateless: nothing was kept, whatever the request's store said
        **p.echo,
        **({"temperature": sampled.temperature, "top_p": sampled.top_p} if sampled is not None else {}),
        "usage": usage(u) if u is not None else None,
        **({"completed_at": int(time.time())} if status == "completed" else {}),
    }


class OutputItems(Segments):
    """``Output`` events in, Responses' output items and the stream events that build them out
    (``segments.py``: the machine; ``output`` holds the items; events go without their
    ``sequence_number``, which the sender numbers). Thinking is a ``reasoning`` item, answer
    text a ``message`` item, each tool call a ``function_call`` item."""

    TEXT, THINKING, CALL = "message", "reasoning", "function_call"

    def __init__(self, encrypted_reasoning: bool = False):
        super().__init__()
        self.output = self.segments
        self.encrypted_reasoning = encrypted_reasoning
        self._text: list[str] = []  # the open item's text (or a call's arguments) so far
        self.status = "in_progress"  # then "completed", or "incomplete" when max_output_tokens cut it off

    def finish(self, finish_reason: str | None, streamed: bool) -> list[dict]:
        """The events that end the answer; ``output`` and ``status`` are then final (a call cut
        short ends the stream as a cut answer does, the call ``incomplete``)."""
        events = []
        if self._cut_call(streamed):
            finish_reason = "length"
            events += self._close("incomplete")
        status = self.status = "incomplete" if finish_reason == "length" else "completed"
        if not self._answered() and (self._blank or status == "completed"):
            # Every answer has a message (an empty one if need be), unless it was cut off while thinking.
            events += self._begin(self.TEXT)
            if self._blank:
                events += self._write(self.TEXT, self._blank)
        events += self._close(status)
        return events

    def _where(self) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self.output) - 1, "content_index": 0}

    def _begin(self, kind: str) -> list[dict]:
        if kind == self.TEXT:
            item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
        else:
            item = {"id": new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self._text = []
        index = self._opened(item)
        return [
            {"type": "response.output_item.added", "output_index": index, "item": {**item, "content": []}},
            {"type": "response.content_part.added", **self._where(), "part": part},
        ]

    def _grow(self, kind: str, text: str) -> list[dict]:
        self._text.append(text)
        delta = {"type": f"response.{'output_text' if kind == self.TEXT else 'reasoning_text'}.delta", **self._where(), "delta": text}
        if kind == self.TEXT:
            delta["logprobs"] = []
        return [delta]

    def _close(self, status: str = "completed") -> list[dict]:
        item = self._open
        if item is None:
            return []
        text = "".join(self._text)
        self._open, self._text = None, []
        if item["type"] == self.CALL:
            where = {"item_id": item["id"], "output_index": len(self.output) - 1}
            item.update(status=status, arguments=text)
            return [
                {"type": "response.function_call_arguments.done", **where, "arguments": text},
                {"type": "response.output_item.done", "output_index": where["output_index"], "item": dict(item)},
            ]
        where = {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0}
        if item["type"] == self.TEXT:
            part = {"type": "output_text", "text": text, "annotations": []}
            done = {"type": "response.output_text.done", **where, "text": text, "logprobs": []}
        else:
            part = {"type": "reasoning_text", "text": text}
            done = {"type": "response.reasoning_text.done", **where, "text": text}
        item.update(status=status, content=[part])
        if item["type"] == self.THINKING and self.encrypted_reasoning:
            item["encrypted_content"] = ENCRYPTED_PREFIX + base64.b64encode(text.encode()).decode()
        return [
            done,
            {"type": "response.content_part.done", **where, "part": dict(part)},
            {"type": "response.output_item.done", "output_index": where["output_index"], "item": {**item, "content": [dict(part)]}},
        ]

    def _begin_call(self, piece: CallOpened) -> list[dict]:
        item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": piece.id, "name": piece.name, "arguments": ""}
        self._text = []
        return [{"type": "response.output_item.added", "output_index": self._opened(item), "item": dict(item)}]

    def _arguments(self, text: str) -> list[dict]:
        self._text.append(text)
        return [{"type": "response.function_call_arguments.delta", "item_id": self._open["id"], "output_index": len(self.output) - 1, "delta": text}]


class Responses(NamedEvents):
    """``POST /v1/responses``."""

    def parse(self, body: dict, served: "Served") -> "ResponseAnswer":
        return ResponseAnswer(parse(body), served.model_id)


class ResponseAnswer:
    """One response: the response object, or Responses' stream events, each numbered in order."""

    def __init__(self, p: ResponsesRequest, model_id: str):
        self.p = p
        self.request = p.request
        self.stream = p.stream
        self.model_id = model_id
        self.id = new_id("resp")
        self.items = OutputItems(p.encrypted_reasoning)
        self.finish: str | None = None
        self._sequence = 0

    def _numbered(self, events: list[dict]) -> list[dict]:
        for ev in events:
            ev["sequence_number"] = self._sequence
            self._sequence += 1
        return events

    def start(self, gen: "Generation", resume) -> list[dict]:
        start = response_object(self.p, self.id, gen.created, self.model_id, [], "in_progress", None, gen.req.params)
        return self._numbered([{"type": "response.created", "response": start}, {"type": "response.in_progress", "response": start}])

    def feed(self, out: Output) -> list[dict]:
        self.finish = out.finish_reason
        return self._numbered(self.items.feed(out))

    def end(self, gen: "Generation") -> list[dict]:
        events = self.items.finish(self.finish, streamed=True)
        whole = response_object(self.p, self.id, gen.created, self.model_id, self.items.output, self.items.status, gen.usage, gen.req.params)
        return self._numbered([*events, {"type": f"response.{whole['status']}", "response": whole}])

    def error(self, e: ApiError) -> list[dict]:
        # In-band, as OpenAI reports a failure mid-stream.
        return self._numbered([{"type": "error", "code": e.code or e.type, "message": e.message, "param": e.param}])

    def whole(self, gen: "Generation") -> dict:
        self.items.finish(self.finish, streamed=False)
        return response_object(self.p, self.id, gen.created, self.model_id, self.items.output, self.items.status, gen.usage, gen.req.params)
