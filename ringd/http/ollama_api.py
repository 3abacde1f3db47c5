"""Ollama's REST API, as a thin translation for ``endpoint.py``: what the official ``ollama``
clients and the desktop apps built on them call.

``POST /api/chat`` and ``POST /api/generate`` become a ``request.Request``
(``parse``); the ``Output`` events become Ollama's answer: one JSON object, or
(Ollama's default) NDJSON, one object a line, the last with ``done: true``,
``done_reason`` and the counts and durations (nanoseconds, as Ollama reports
them). Thinking goes to ``thinking``, tool calls to ``tool_calls`` with their
arguments as objects. ``GET /api/tags``, ``POST /api/show``, ``GET /api/ps``
and ``GET /api/version`` describe the one model the ring serves (``Models``;
``/api/show``'s parameters and system are the model's defaults, an ``ollama:``
model's params and system layers);
any node answers them, and a follower forwards what generates to the leader.

Ollama's request, mapped:

- ``options``: temperature, top_p, top_k, min_p, seed (negative: random),
  stop, repeat_penalty, presence_penalty, frequency_penalty are sampled as
  every API samples them; num_predict is max tokens (-1, -2 and 0, Ollama's
  "unset": until the context ends); num_ctx is the context this request's
  prompt and answer may take (above the model's context it is refused: the
  ring's KV cache is sized by the model's). Options not given take the
  model's defaults, as every API's requests do (an ``ollama:`` model's params
  layer: ``serving.py`` applies them), else ringd's, not Ollama's built-in ones
  (temperature 0.8, top_k 40, top_p 0.9). Sampling ringd
  does not do (mirostat, typical_p) is refused; Ollama's other options (load
  time settings, num_keep, repeat_last_n, tfs_z, penalize_newline) are
  type-checked as Ollama checks them (``models/ollama/params.py``, which a
  model's params layer is checked with too) and have no effect: a ring loads its
  model its own way. Unknown options are ignored, as Ollama ignores them.
- ``format``: "json" is any JSON object, a schema is that schema.
- ``think``: true or "low"/"medium"/"high" turns the template's thinking on
  (``enable_thinking``; the level goes along as ``reasoning_effort``), false
  off; true on a model that does not think is refused, as Ollama refuses it.
- ``tools``: OpenAI-style function tools; Ollama has no way to force a call,
  so the model decides (tool_choice "auto").
- ``images``: a user message's list of base64 images (chat), or generate's
  with its prompt, become the request's images (``images.py``), each an
  ``{"type": "image"}`` part of the message's content before its text, as
  Ollama's own templates place them; generate's images go in the one user
  message its prompt makes, so a ``raw`` prompt cannot carry them. null and
  [] are no images, as clients send them.
- Refused: generate's ``suffix`` and
  ``template`` (no fill-in-the-middle, no Go templates), and its ``context``
  (the old token memory: ringd never hands one out, so a client that sends one
  is keeping a conversation ringd cannot continue; send messages to /api/chat).
  ``keep_alive`` is ignored: the ring keeps its model loaded while it runs.
- An empty prompt (generate) or no messages (chat) is Ollama's "load the model"
  call, answered ``done_reason: "load"`` without generating.

Every refusal is Ollama's ``{"error": "..."}`` with its HTTP status (``api.py``
renders every ApiError under /api/ with ``error_body``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ringd.http import models_list
from ringd.http.errors import ApiError
from ringd.http.fields import (
    MAX_MESSAGES,
    MAX_MODEL_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    bad,
    check_schema,
    function_tools,
    optional,
    valid_text,
)
from ringd.http.framing import NDJSON
from ringd.http.images import ImageError, ImagePart, from_base64
from ringd.http.request import Output, Request, ResponseFormat, ToolCall, given_fields
from ringd.models.naming import ollama_spelling, same_model, tagged
from ringd.models.catalogue import Entry, gguf_quant, mlx_quant
from ringd.models.checkpoint import load_tokenizer, text_config
from ringd.models.ollama.params import (
    OPTION_TYPES,
    SAMPLED_OPTIONS,
    UNSUPPORTED_OPTIONS,
    UNTIL_CONTEXT_ENDS,
    OptionError,
    checked_option,
    integral,
    sampling_of,
)
from ringd.models.vision import sees
from ringd.ring.media import MAX_IMAGES
from ringd.ring.sampling import MAX_TOP_LOGPROBS, SamplingError, SamplingParams, brief_repr
from ringd.models.ollama.keepalive import KeepAliveError, parse_keep_alive

if TYPE_CHECKING:
    from ringd.http.intake import Intake
    from ringd.http.node import ApiNode, Served
    from ringd.http.serving import Generation
    from ringd.models.checkpoint import ModelInfo

log = logging.getLogger(__name__)

# What /api/version answers: clients check for features by Ollama's version
# (tools, structured output and thinking need >= 0.5; think levels 0.12), so
# ringd names the Ollama release whose API it speaks. Its own version goes in
# VERSION_HEADER.
OLLAMA_VERSION = "0.12.0"
VERSION_HEADER = "X-Ringd-Version"
# /api/ps: when the model would be unloaded. Never: the ring holds it while it runs.
NEVER_EXPIRES = "9999-12-31T23:59:59Z"
# Models described at once (each a header read, kept): the pool's instances and the configured one.
MAX_DESCRIBED = 64
# Ollama's roles; "tool" carries a result back.
ROLES = ("system", "user", "assistant", "tool")
# think levels (gpt-oss's reasoning efforts); each also means "think".
THINK_LEVELS = ("low", "medium", "high")
# The API's names for the internal request's fields, for errors.
NAMES = {
    "max_tokens": "options.num_predict",
    "response_format": "format",
    "tool_choice": "tools",
    "stop": "options.stop",
    **{field: f"options.{name}" for name, field in SAMPLED_OPTIONS.items()},
}


def error_body(e: ApiError) -> dict:
    """Ollama's error: ``{"error": "message"}``; the status says the rest."""
    return {"error": e.message}


# --- the request ------------------------------------------------------------------


@dataclass
class Parsed:
    model: str
    stream: bool
    request: Request | None  # None: the "load the model" call
    logprobs: bool = False


def parse(body: dict, chat: bool, model_id: str, context_length: int, thinks: bool) -> Parsed:
    """A body of /api/chat (``chat``) or /api/generate as the internal request, or a 400.

    ``model_id`` is the served model's name (``NAME:latest`` names it too, as Ollama
    tags an untagged name), ``context_length`` its context and ``thinks`` whether its
    template can think. Pure: nothing a client sends makes it raise anything but ApiError.
    """
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model is required")
    if len(model) > MAX_MODEL_CHARS:
        raise bad(f"model must be a name of at most {MAX_MODEL_CHARS} characters; GET /api/tags lists it")
    valid_text(model, "model")
    # The answers name the model as the client did (Ollama's do); the engine knows one name.
    served = model_id if model == tagged(model_id) else model
    stream = _optional(body, "stream", bool, True)
    images: list[ImagePart] = []
    if chat:
        messages, prompt, raw = _messages(body.get("messages"), images), None, False
        if not messages:
            return Parsed(model, stream, None)
    else:
        prompt, raw, messages = _generate_input(body, images)
        if not prompt:
            return Parsed(model, stream, None)

    tools = function_tools(body.get("tools")) if chat else []
    response_format = _format(body.get("format"))
    if tools and response_format is not None:
        raise bad("format and tools cannot be combined: the answer is either a call or text of the format")
    template_kwargs = _think(body.get("think"), model, thinks)
    if template_kwargs and not chat and raw:
        raise bad("think needs the model's template; a raw prompt goes to the model as it is")
    options = _options(body.get("options"), context_length)
    logprobs, top = _logprobs(body)
    try:
        params = SamplingParams(**options.sampling, logprobs=logprobs, top_logprobs=top)
    except SamplingError as e:
        # SamplingParams names its own fields; the client named Ollama's options.
        option = next((name for name, field in SAMPLED_OPTIONS.items() if field == e.field), None)
        raise bad(f"options.{str(e).replace(e.field, option, 1)}" if option else str(e)) from None
    req = Request(
        model=served, params=params, max_tokens=options.max_tokens, messages=messages,
        prompt=prompt if raw else None, stop=options.stop, tools=tools, tool_choice="auto",
        response_format=response_format, template_kwargs=template_kwargs, names=dict(NAMES),
        given=given_fields(options.sampling, options.stop if options.stop_given else None), context=options.context,
        images=images,
    )  # fmt: skip
    return Parsed(model, stream, req, logprobs)


def _optional(body: dict, name: str, kind: type, default: Any) -> Any:
    """A field of ``kind``; absent or null is ``default``, as Go reads a missing field."""
    v = optional(body, name, lambda v: isinstance(v, kind), "a boolean" if kind is bool else "a string")
    return default if v is None else v


def _generate_input(body: dict, images: list[ImagePart]) -> tuple[str, bool, list[dict] | None]:
    """/api/generate's prompt, whether it is raw, and the chat it makes unless raw ("" is the load call);
    its images are added to ``images`` (they go in the chat's user message, as Ollama puts them)."""
    for name, why in (("suffix", "fill-in-the-middle is not supported"), ("template", "ringd renders prompts with the model's own chat template")):
        if body.get(name) not in (None, ""):
            raise bad(f"{name} is not supported: {why}")
    if body.get("context") not in (None, []):
        raise bad("context (the token memory of an earlier answer) is not supported: send the conversation as messages to /api/chat")
    given = _image_list(body.get("images"), "images")
    _count(len(given))
    prompt = valid_text(_optional(body, "prompt", str, ""), "prompt")
    raw = _optional(body, "raw", bool, False)
    system = valid_text(_optional(body, "system", str, ""), "system")
    if raw:
        if system:
            raise bad("system has no place in a raw prompt, which goes to the model as it is; put it in the prompt")
        if given:
            raise bad("images need the model's template to place them; a raw prompt goes to the model as it is and cannot carry them: leave raw false")
        return prompt, True, None
    user = {"role": "user", "content": _with_images(prompt, given, "images", images)}
    return prompt, False, ([{"role": "system", "content": system}] if system else []) + [user]


def _image_list(v: Any, where: str) -> list:
    """A field of images: a list (null or [] when there are none)."""
    if v is None:
        return []
    if not isinstance(v, list):
        raise bad(f"{where} must be a list of base64 images; got {brief_repr(v)}")
    return v


def _count(n: int) -> None:
    """Refused before a part is made: each costs little, but a body of one-character images holds millions."""
    if n > MAX_IMAGES:
        raise bad(f"{n} images in one request; at most {MAX_IMAGES}")


def _with_images(text: str, given: list, where: str, images: list[ImagePart]) -> str | list[dict]:
    """A message's content as a template takes it: its text, or with images, an ``{"type": "image"}``
    part for each (added to ``images``) before its text, as Ollama's own templates place them."""
    if not given:
        return text
    for j, data in enumerate(given):
        try:
            images.append(from_base64(data, f"{where}[{j}]"))
        except ImageError as e:
            raise bad(str(e)) from None
    return [{"type": "image"} for _ in given] + ([{"type": "text", "text": text}] if text else [])


def _messages(v: Any, images: list[ImagePart]) -> list[dict]:
    """Ollama's messages in the form templates take (``request.py``): calls get ids, results name
    their call, a user message's images are parts of its content (and added to ``images``)."""
    if v is None:
        return []
    if not isinstance(v, list):
        raise bad("messages must be a list")
    if len(v) > MAX_MESSAGES:
        raise bad(f"at most {MAX_MESSAGES} messages are accepted")
    _count(sum(len(m["images"]) for m in v if isinstance(m, dict) and isinstance(m.get("images"), list)))
    out: list[dict] = []
    unanswered: list[tuple[str, str]] = []  # (call id, name) of calls no result has answered yet
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}; got {brief_repr(role)}")
        content = m.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad(f"{where}.content must be a string; got {brief_repr(content)}")
        given = _image_list(m.get("images"), f"{where}.images")
        if given and role != "user":
            raise bad(f"{where}.images: images go in user messages, not in a {role} message")
        msg: dict[str, Any] = {"role": role, "content": _with_images(valid_text(content, f"{where}.content"), given, f"{where}.images", images)}
        if role == "assistant":
            thinking = m.get("thinking")
            if thinking not in (None, ""):
                if not isinstance(thinking, str):
                    raise bad(f"{where}.thinking must be a string")
                msg["reasoning_content"] = valid_text(thinking, f"{where}.thinking")
            calls = m.get("tool_calls")
            if calls not in (None, []):
                if not isinstance(calls, list):
                    raise bad(f"{where}.tool_calls must be a list")
                msg["tool_calls"] = [_past_call(c, f"{where}.tool_calls[{j}]", f"call_{i}_{j}") for j, c in enumerate(calls)]
                unanswered += [(c["id"], c["function"]["name"]) for c in msg["tool_calls"]]
        elif role == "tool":
            name = m.get("tool_name", m.get("name"))
            if name is not None and not isinstance(name, str):
                raise bad(f"{where}.tool_name must be a string")
            call_id = m.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise bad(f"{where}.tool_call_id must be a string")
            # Ollama's results name their tool, not their call: they answer the
            # earliest call of that tool not yet answered (or the earliest call).
            match = next((c for c in unanswered if c[0] == call_id), None) or next(
                (c for c in unanswered if not name or c[1] == name), None
            )
            if match is not None:
                unanswered.remove(match)
            msg["tool_call_id"] = call_id or (match[0] if match else "")
            msg["name"] = name or (match[1] if match else "")
        out.append(msg)
    return out


def _past_call(c: Any, where: str, default_id: str) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad(f"{where} must be {{'function': {{'name', 'arguments'}}}}")
    args = fn.get("arguments")
    if args is None:
        args = {}
    if isinstance(args, str):  # some clients send OpenAI's JSON text
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise bad(f"{where}.function.arguments must be an object; got {brief_repr(args)}") from None
    if not isinstance(args, dict):
        raise bad(f"{where}.function.arguments must be an object; got {brief_repr(args)}")
    call_id = c.get("id") if isinstance(c.get("id"), str) and c.get("id") else default_id
    return {"id": call_id, "type": "function", "function": {"name": valid_text(fn["name"], f"{where}.function.name"), "arguments": args}}


def _format(v: Any) -> ResponseFormat | None:
    if v is None or v == "":
        return None
    if v == "json":
        return ResponseFormat("json_object")
    if isinstance(v, dict):
        return ResponseFormat("json_schema", check_schema(v, "format"), "format")
    raise bad(f'format must be "json" or a JSON schema object; got {brief_repr(v)}')


def _think(v: Any, model: str, thinks: bool) -> dict:
    if v is None:
        return {}
    if v is False:
        return {"enable_thinking": False}
    if v is not True and v not in THINK_LEVELS:
        raise bad(f'think must be true, false or one of "low", "medium", "high"; got {brief_repr(v)}')
    if not thinks:
        raise bad(f'"{model}" does not support thinking')
    return {"enable_thinking": True} if v is True else {"enable_thinking": True, "reasoning_effort": v}


def _logprobs(body: dict) -> tuple[bool, int]:
    on, top = body.get("logprobs"), body.get("top_logprobs")
    if on is not None and not isinstance(on, bool):
        raise bad(f"logprobs must be a boolean; got {brief_repr(on)}")
    if top is not None and (not integral(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise bad(f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}; got {brief_repr(top)}")
    top = int(top or 0)
    return bool(on) or top > 0, top


@dataclass
class _Options:
    sampling: dict
    max_tokens: int | None
    stop: list[str]
    stop_given: bool
    context: int | None


def _options(v: Any, context_length: int) -> _Options:
    if v is None:
        v = {}
    if not isinstance(v, dict):
        raise bad(f"options must be an object; got {brief_repr(v)}")
    checked: dict[str, Any] = {}
    for name, value in v.items():
        if name not in OPTION_TYPES or value is None:
            continue  # Ollama ignores options it does not know, and nulls
        try:
            checked[name] = checked_option(name, value)
        except OptionError as e:
            raise bad(str(e)) from None
    for name, off in UNSUPPORTED_OPTIONS.items():
        if checked.get(name, off) != off:
            raise bad(f"option {name!r} is not supported by ringd (only {off} is accepted)")
    num_ctx = checked.get("num_ctx")
    if num_ctx is not None and not 0 <= num_ctx <= context_length:
        raise bad(f"options.num_ctx {num_ctx} is above the model's context of {context_length} tokens" if num_ctx > 0 else "options.num_ctx must not be negative")
    predict = checked.get("num_predict")
    if predict is not None and predict < -2:
        raise bad(f"options.num_predict must be a number of tokens, or -1 for until the context ends; got {predict}")
    return _Options(
        sampling_of(checked), None if predict is None or predict in UNTIL_CONTEXT_ENDS else predict,
        _stop(checked.get("stop")), "stop" in checked, num_ctx or None,
    )  # fmt: skip


def _stop(v: Any) -> list[str]:
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise bad(f'option "stop" must be a list of non-empty strings of at most {MAX_STOP_CHARS} characters')
    if len(stops) > MAX_STOP_SEQUENCES:
        raise bad(f"at most {MAX_STOP_SEQUENCES} stop sequences are supported")
    return [valid_text(s, "options.stop") for s in stops]


# --- the answer -------------------------------------------------------------------


def created_at() -> str:
    """Now in RFC 3339, as Ollama writes it (UTC, with Z)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def done_reason(finish: str | None) -> str:
    """Ollama knows "stop" and "length": an answer that ends in calls has stopped."""
    return "length" if finish == "length" else "stop"


def tool_calls(calls: list[ToolCall], first: int = 0) -> list[dict]:
    return [{"id": c.id, "function": {"index": first + i, "name": c.name, "arguments": _arguments(c.arguments)}} for i, c in enumerate(calls)]


def _arguments(text: str) -> dict:
    try:
        args = json.loads(text)
    except ValueError:
        return {}
    return args if isinstance(args, dict) else {}


def counts(gen: "Generation") -> dict:
    """Ollama's counts and durations, in nanoseconds: before the generation opened ("load": the
    checks and the template), until the first token (the prompt), and after it."""
    ended = gen.ended_ns if gen.ended_ns is not None else gen.opened_ns
    first = gen.first_ns if gen.first_ns is not None else ended
    return {
        "total_duration": ended - gen.received_ns,
        "load_duration": gen.opened_ns - gen.received_ns,
        "prompt_eval_count": gen.usage.prompt_tokens,
        "prompt_eval_duration": first - gen.opened_ns,
        "eval_count": gen.usage.completion_tokens,
        "eval_duration": ended - first,
    }


def answer_part(chat: bool, text: str, reasoning: str, calls: list[ToolCall], first_call: int = 0) -> dict:
    """The answer part of an object: chat's ``message`` or generate's ``response``."""
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reasoning:
            message["thinking"] = reasoning
        if calls:
            message["tool_calls"] = tool_calls(calls, first_call)
        return {"message": message}
    return {"response": text, **({"thinking": reasoning} if reasoning else {})}


class Generate:
    """``POST /api/chat`` (``chat``) or ``POST /api/generate``."""

    framing = NDJSON
    resumable = False  # a follower relays the lines as they come; a new leader cannot continue them

    keep_alive = True  # Ollama's keep_alive: how long the model stays loaded once idle

    def __init__(self, node: "ApiNode", chat: bool):
        self.d = node
        self.chat = chat

    def streams(self, body: dict) -> bool:
        return body.get("stream") is not False  # Ollama streams unless told not to

    def unloaded(self, body: dict) -> dict | None:
        """Ollama's "unload the model" call: keep_alive 0 and nothing to generate."""
        ka, model = body.get("keep_alive"), body.get("model")
        if ka is None or not isinstance(model, str) or not model:
            return None
        try:
            if parse_keep_alive(ka) != 0:
                return None
        except KeepAliveError:
            return None  # the request's parse says what is wrong with it
        empty = not body.get("messages") if self.chat else body.get("prompt") in (None, "")
        if not empty:
            return None
        answer = {"message": {"role": "assistant", "content": ""}} if self.chat else {"response": ""}
        return {"model": model, "created_at": created_at(), **answer, "done": True, "done_reason": "unload"}

    def parse(self, body: dict, served: "Served") -> "GenerateAnswer | Loaded":
        p = parse(body, self.chat, served.model_id, served.info.context_length, getattr(served.tokenizer, "has_thinking", False))
        if p.request is None:
            # Ollama's "load the model" call: the model was loaded (served) before the parse.
            ready, reason = served.readiness()
            if not ready:
                raise ApiError(503, f"the ring is not ready: {reason}")
            return Loaded(p.model, self.chat)
        return GenerateAnswer(p, self.chat, served.tokenizer)


class Loaded:
    """The answer to Ollama's "load the model" call, which generates nothing."""

    request = None
    stream = False

    def __init__(self, model: str, chat: bool):
        self.model = model
        self.chat = chat

    def whole(self, gen: None) -> dict:
        answer = {"message": {"role": "assistant", "content": ""}} if self.chat else {"response": ""}
        return {"model": self.model, "created_at": created_at(), **answer, "done": True, "done_reason": "load"}


class GenerateAnswer:
    """One answer of chat or generate: one object, or NDJSON lines, the last with the counts."""

    def __init__(self, p: Parsed, chat: bool, tokenizer):
        self.p = p
        self.request = p.request
        self.stream = p.stream
        self.chat = chat
        self.tokenizer = tokenizer
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCall] = []
        self.logprobs: list[dict] = []
        self.finish: str | None = None
        self.calls_sent = 0

    def _logprob(self, out: Output) -> dict:
        decode = self.tokenizer.decode
        entry = {"token": decode([out.token]), "logprob": out.logprob}
        if out.top_logprobs:
            entry["top_logprobs"] = [{"token": decode([t]), "logprob": v} for t, v in out.top_logprobs]
        return entry

    def start(self, gen: "Generation", resume) -> list[dict]:
        return []

    def feed(self, out: Output) -> list[dict]:
        self.finish = out.finish_reason
        p = self.p
        if not self.stream:
            self.text.append(out.text)
            self.reasoning.append(out.reasoning)
            self.calls += out.calls
            if p.logprobs:
                self.logprobs.append(self._logprob(out))
            return []
        if not (out.text or out.reasoning or out.calls or p.logprobs):
            return []
        line = {"model": p.model, "created_at": created_at(), **answer_part(self.chat, out.text, out.reasoning, out.calls, self.calls_sent)}
        if p.logprobs:
            line["logprobs"] = [self._logprob(out)]
        line["done"] = False
        self.calls_sent += len(out.calls)
        return [line]

    def end(self, gen: "Generation") -> list[dict]:
        last = {"model": self.p.model, "created_at": created_at(), **answer_part(self.chat, "", "", []), "done": True, "done_reason": done_reason(self.finish)}
        return [{**last, **counts(gen)}]

    def error(self, e: ApiError) -> list[dict]:
        return [error_body(e)]  # Ollama reports a failure mid-stream as a line of its own

    def whole(self, gen: "Generation") -> dict:
        body = {"model": self.p.model, "created_at": created_at(), **answer_part(self.chat, "".join(self.text), "".join(self.reasoning), self.calls)}
        if self.p.logprobs:
            body["logprobs"] = self.logprobs
        body.update(done=True, done_reason=done_reason(self.finish), **counts(gen))
        return body


def check_model(name: Any, served: str) -> None:
    """``name`` is the served model (``NAME:latest`` too, as Ollama tags an untagged name, and as
    /api/tags spells it), or a 404."""
    if name not in (served, tagged(served), ollama_spelling(served)):
        raise ApiError(404, f"model {brief_repr(name)} not found; this ring serves {served!r}")


def servable(name: str, found: Entry) -> "ModelInfo":
    """What the model list's ``found`` (which ``name`` names) is, or a 400 saying why ringd cannot serve it."""
    if found.facts.info is None:
        raise ApiError(400, f"{name!r} is in the model list, but ringd cannot serve it: {found.facts.error}")
    return found.facts.info


class Models:
    """Ollama's descriptions of the one model the ring serves: ``GET /api/tags``, ``POST /api/show``,
    ``GET /api/ps``, ``GET /api/version``. Any node answers them, about the model it serves."""

    def __init__(self, node: "ApiNode", intake: "Intake", forward=None):
        self.d = node
        self.intake = intake
        self.forward = forward  # a follower's way to ask its leader (proxy.Proxy.forward)
        self._described: dict[str, dict] = {}  # by model fingerprint

    async def _description(self, info: "ModelInfo | None" = None) -> dict:
        """What Ollama lists of a model (``/api/tags``, ``/api/ps``), worked out once off the loop."""
        info = info or self.d.info
        found = self._described.get(info.fingerprint)
        if found is None:
            found = await asyncio.get_running_loop().run_in_executor(None, describe, info)
            if len(self._described) >= MAX_DESCRIBED:
                self._described.clear()
            self._described[info.fingerprint] = found
        return found

    async def tags(self, request: web.Request) -> web.Response:
        """The loaded model as ``describe`` has it, then every other model the node could serve
        (``models_list.py``), each with its size, quant, architecture and fit."""
        self.intake.need_key(request)
        d = await self._description()
        rows, _ = await models_list.rows(self.d)
        models = models_list.ollama_models(rows)
        first = models[0]  # the served model, as it was read
        first |= {"modified_at": d["modified_at"], "size": d["size"], "digest": d["digest"], "details": d["details"]}
        return web.json_response({"models": models})

    async def ps(self, request: web.Request) -> web.Response:
        """The models loaded now: the leader's instances (a follower asks its leader), each with
        Ollama's fields and ringd's own (its ring, state, requests, load progress)."""
        self.intake.need_key(request)
        if not self.d.leading and self.forward is not None:
            return await self.forward(request, b"", False, resumable=False)
        profile = getattr(self.d, "profile", None)
        models = []
        for row in self.d.instances() or [self._configured()]:
            served = self.d.find(row["instance"]) if row["instance"] else None
            info = served.info if served is not None else self.d.info
            d = await self._description(info)
            # Apple silicon's memory is the GPU's: on a Mac the whole model is "in VRAM".
            vram = d["size"] if getattr(profile, "gpu_cores", None) else 0
            name = ollama_spelling(row["model"] or self.d.model_id)
            expires = row.get("expires_at")
            models.append({
                "name": name, "model": name, "size": d["size"], "digest": d["digest"], "details": d["details"],
                "expires_at": models_list.iso(expires) if expires is not None else NEVER_EXPIRES, "size_vram": vram,
                "context_length": default_context(info), "ringd": row,
            })  # fmt: skip
        return web.json_response({"models": models})

    def _configured(self) -> dict:
        """The configured model's row where no pool lists it (a node that does not lead)."""
        return {"instance": "", "model": "", "expires_at": None}

    async def show(self, request: web.Request) -> web.Response:
        self.intake.need_key(request)
        body = await self.intake.json(await self.intake.read(request))
        name = body.get("model", body.get("name"))  # "name": Ollama's older field
        if not isinstance(name, str) or not name:
            raise bad("model is required")
        served = self.d.loaded(name)
        if served is not None:
            info, tokenizer, shown = served.info, served.tokenizer, served.model_id
        elif same_model(name, self.d.model_id):
            info, tokenizer, shown = self.d.info, self.d.tokenizer, self.d.model_id
        else:  # a model of the list, not loaded: described from its files, as a request would load it
            found = await self.d.catalogue.lookup(name) if self.d.catalogue is not None else None
            if found is None:
                check_model(name, self.d.model_id)  # a 404 that names what is served
            info, shown = servable(name, found), found.name
            tokenizer = await asyncio.get_running_loop().run_in_executor(None, load_tokenizer, info)
        d = await self._description(info)
        template = getattr(tokenizer, "chat_template", None)
        capabilities = ["completion", "tools"]  # ringd calls tools with any model (render.py)
        if getattr(tokenizer, "has_thinking", False):
            capabilities.append("thinking")
        if sees(info):  # as Ollama says it, which clients read to offer images (Open WebUI)
            capabilities.append("vision")
        params = parameters(info)
        system = info.defaults.system
        modelfile = f"# Modelfile of the model ringd serves as {shown}\nFROM {info.name}\n"
        modelfile += "".join(f"PARAMETER {name} {value}\n" for name, value in params)
        if system:
            modelfile += f'SYSTEM """{system}"""\n'
        return web.json_response(
            {
                "modelfile": modelfile,
                "parameters": "\n".join(f"{name} {value}" for name, value in params),
                **({"system": system} if system else {}),
                "template": template if isinstance(template, str) else "",
                "details": d["details"],
                "model_info": d["model_info"],
                "capabilities": capabilities,
                "modified_at": d["modified_at"],
            }
        )

    async def pull(self, request: web.Request) -> web.StreamResponse:
        """``POST /api/pull``: ringd downloads nothing from Ollama's registry; a model this node's
        list holds (the Ollama store, the Hugging Face cache, models_dir) is there already, and
        the first request that names it loads it."""
        self.intake.need_key(request)
        body = await self.intake.json(await self.intake.read(request))
        name = body.get("model", body.get("name"))  # "name": Ollama's older field
        if not isinstance(name, str) or not name or len(name) > MAX_MODEL_CHARS:
            raise bad("model is required")
        done = {"status": "success"}
        if same_model(name, self.d.model_id) or self.d.loaded(name) is not None:
            status = f"{name} is served already"  # by the name /api/tags gives it: nothing to fetch
        else:
            found = await self.d.catalogue.lookup(name) if self.d.catalogue is not None else None
            if found is None:
                raise ApiError(
                    404,
                    f"ringd does not download models from Ollama's registry, and {name!r} is not in this node's model list "
                    f"(the Ollama store, the Hugging Face cache, models_dir): `ollama pull {name}` on every node, or copy it "
                    "into models_dir on every node; then name it in a request (GET /api/tags lists what is there)",
                )  # fmt: skip
            servable(name, found)
            status = f"{name} is in the model list as {found.name}"
        if body.get("stream") is False:
            return web.json_response(done)
        return web.Response(body=NDJSON.frame({"status": status}) + NDJSON.frame(done), content_type=NDJSON.content_type)

    async def version(self, request: web.Request) -> web.Response:
        self.intake.need_key(request)
        return web.json_response({"version": OLLAMA_VERSION}, headers={VERSION_HEADER: ringd_version()})


def default_context(info: "ModelInfo") -> int:
    """The context a request that does not ask for one gets: the model's, or less where its
    defaults (an Ollama params layer's num_ctx) say so."""
    return min(info.context_length, info.defaults.context or info.context_length)


def parameters(info: "ModelInfo") -> list[tuple[str, str]]:
    """The model's PARAMETER lines as ``/api/show`` lists them (Ollama's names, values as a
    Modelfile spells them): num_ctx, then what its defaults set (an Ollama params layer's)."""
    d = info.defaults
    out = [("num_ctx", str(default_context(info)))]
    if d.max_tokens is not None:
        out.append(("num_predict", str(d.max_tokens)))
    names = {field: name for name, field in SAMPLED_OPTIONS.items()}
    out += [(names[field], str(value)) for field, value in d.sampling.items()]
    out += [("stop", json.dumps(stop, ensure_ascii=False)) for stop in d.stop or ()]
    return out


def ringd_version() -> str:
    try:
        return metadata.version("ringd")
    except metadata.PackageNotFoundError:
        return "unknown"


def describe(info: "ModelInfo") -> dict:
    """The model as Ollama describes one: size, digest, details, model_info. Reads a GGUF's
    header (cached by ``gguf/reader.py``) for its quantization and parameter count; a checkpoint
    directory's count is worked out from its config."""
    config = text_config(info.config)
    w = info.weights
    size = sum(w.layers) + w.embed + w.norm + w.head
    params, quant = None, mlx_quant(config)
    if info.is_gguf:
        try:
            from ringd.models.gguf.reader import CONFIG_TENSORS, GgufFile

            g = GgufFile.open(info.path)
            tensors = [t for t in g.tensors.values() if t.name not in CONFIG_TENSORS]
            params = sum(math.prod(t.shape) for t in tensors)
            quant = gguf_quant(g)  # the model list's answer (its file type), as Ollama's
        except (OSError, ValueError) as e:
            log.warning("cannot read %s for /api/tags: %s", info.path, e)
    if params is None:
        params = parameter_count(config)
    try:
        modified = datetime.fromtimestamp(os.stat(info.path).st_mtime, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    except OSError:
        modified = created_at()
    arch = info.model_type
    details = {
        "parent_model": "",
        "format": "gguf" if info.is_gguf else "safetensors",
        "family": arch,
        "families": [arch],
        "parameter_size": parameter_size(params) if params else "",
        "quantization_level": quant,
    }
    model_info = {
        "general.architecture": arch,
        "general.basename": info.name,
        **({"general.parameter_count": params} if params else {}),
        f"{arch}.context_length": info.context_length,
        f"{arch}.embedding_length": info.hidden_size,
        f"{arch}.block_count": info.num_layers,
        f"{arch}.vocab_size": info.vocab_size,
    }
    for key, name in (("num_attention_heads", "attention.head_count"), ("num_key_value_heads", "attention.head_count_kv"), ("intermediate_size", "feed_forward_length")):
        if isinstance(config.get(key), int):
            model_info[f"{arch}.{name}"] = config[key]
    return {"size": size, "digest": info.fingerprint, "modified_at": modified, "details": details, "model_info": model_info}


def parameter_count(c: dict) -> int | None:
    """The weights a dense or mixture-of-experts decoder holds, from its config (an
    estimate: biases and architecture-specific extras are left out)."""
    try:
        h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
        heads = c.get("num_attention_heads") or 1
        kv = c.get("num_key_value_heads") or heads
        head_dim = c.get("head_dim") or h // heads
        attention = 2 * h * heads * head_dim + 2 * h * kv * head_dim
        experts = c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts") or 0
        if experts:
            inner = c.get("moe_intermediate_size") or c["intermediate_size"]
            mlp = experts * 3 * h * inner + h * experts
        else:
            mlp = 3 * h * c["intermediate_size"]
        head = 0 if c.get("tie_word_embeddings", True) else vocab * h
        return int(vocab * h + layers * (attention + mlp + 2 * h) + h + head)
    except (KeyError, TypeError):
        return None


def parameter_size(n: int) -> str:
    """As Ollama prints it: 134.52M, 8.0B."""
    if n >= 1_000_000_000:
        return f"{n / 1e9:.1f}B"
    if n >= 1_000_000:
        return f"{n / 1e6:.2f}M"
    return f"{n / 1e3:.2f}K"
