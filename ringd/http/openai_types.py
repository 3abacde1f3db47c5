"""OpenAI request parsing and response shapes, as pure functions.

Bodies of ``/v1/chat/completions`` and ``/v1/completions`` become a
``CompletionRequest``; anything malformed becomes an ``ApiError`` carrying the
HTTP status and OpenAI's error shape (``{"error": {"message", "type",
"param", "code"}}``), naming the field at fault. Fields the API documents but
ringd cannot honour (``n`` > 1, ``best_of``, ``echo``, ``suffix``, the old
``functions``, audio: ``UNSUPPORTED_FIELDS``) are refused, not ignored;
unknown fields are ignored, as clients send many. Nothing a client sends makes
these functions raise anything but ``ApiError``.

No HTTP, no tokenizer: ``openai_api.py`` translates, ``endpoint.py`` does the
I/O, this module the shapes (the checks every API shares are ``fields.py``'s).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ringd.http.fields import (
    MAX_MESSAGES, MAX_STOP_CHARS, MAX_STOP_SEQUENCES, asks_nothing, bad, chosen_tool, check_schema, function_tools,
    is_bool, is_int, is_object, listed, model_name, optional, sampling_fields, sampling_params, template_kwargs,
    valid_text,
)
from ringd.http.images import ImageError, ImagePart, from_data_url, from_web, is_web_url
from ringd.http.request import Request, ResponseFormat, Tool, given_fields
from ringd.ring.media import MAX_IMAGES
from ringd.ring.sampling import MAX_TOP_LOGPROBS, SamplingParams, brief_repr

# Legacy completions take logprobs as a count, at most 5 (OpenAI's limit).
MAX_COMPLETION_LOGPROBS = 5
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# Fields of OpenAI's API that change what an answer means, which ringd does not
# do yet: a client that sends one must hear so, not get an answer that ignored
# it. Each maps to the values that ask for nothing beyond what ringd does anyway
# (those are accepted); null, [] and {} count as absent, since clients send them.
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "functions": (),
    "function_call": ("none",),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
}



@dataclass
class CompletionRequest:
    chat: bool
    model: str
    messages: list[dict] | None  # chat
    prompt: str | list[int] | None  # completions: text or token ids
    max_tokens: int | None
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    # vLLM's extension: logprobs name tokens "token_id:123", exact where text is not.
    tokens_as_ids: bool = False
    # vLLM's extension: end-of-sequence does not end the answer (a benchmark's fixed length).
    ignore_eos: bool = False
    tools: list[Tool] = field(default_factory=list)
    tool_choice: str = "auto"
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    template_kwargs: dict = field(default_factory=dict)
    given: frozenset[str] = frozenset()  # Request.given: what the client set
    images: list[ImagePart] = field(default_factory=list)  # a chat's, in order

    def to_request(self) -> Request:
        """The internal request (``request.py``) that every API becomes."""
        return Request(
            model=self.model, params=self.params, max_tokens=self.max_tokens, messages=self.messages, prompt=self.prompt,
            stop=self.stop, tools=self.tools, tool_choice=self.tool_choice, tool_name=self.tool_name,
            parallel_tool_calls=self.parallel_tool_calls, response_format=self.response_format,
            template_kwargs=self.template_kwargs, ignore_eos=self.ignore_eos, given=self.given, images=self.images,
        )  # fmt: skip


def _content(content: Any, where: str, images: list[ImagePart]) -> str | list[dict]:
    """A message's content as a template takes it: its text, or where it holds images, its parts
    in order (``{"type": "text", "text"}``, ``{"type": "image"}``), each image added to ``images``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return valid_text(content, where)
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of text and image parts", where)
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": valid_text(part["text"], f"{where}[{i}].text")})
        elif kind == "image_url":
            images.append(image_url(part.get("image_url"), f"{where}[{i}].image_url"))
            parts.append({"type": "image"})
        else:
            raise bad(
                f"{where}[{i}] must be a text part {{'type': 'text', 'text': ...}} or an image part "
                "{'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,...'}}",
                f"{where}[{i}]",
            )  # fmt: skip
    if any(part["type"] == "image" for part in parts):
        return parts
    return "".join(part["text"] for part in parts)


def image_url(v: Any, where: str) -> ImagePart:
    """An ``image_url`` (``{"url": ...}``, or the URL itself as some clients send it): a data URL, or
    a web URL, which is fetched only where the leader's config allows it (``images.decode_all``)."""
    url = v.get("url") if isinstance(v, dict) else v
    if not isinstance(url, str):
        raise bad(f"{where} must be {{'url': 'data:image/png;base64,...'}}", where)
    try:
        return from_web(url, where) if is_web_url(url) else from_data_url(url, where)
    except ImageError as e:
        raise bad(str(e), where) from None


def _messages(v: Any, images: list[ImagePart]) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise bad("messages must be a non-empty list", "messages")
    if len(v) > MAX_MESSAGES:
        raise bad(f"at most {MAX_MESSAGES} messages are accepted", "messages")
    out = []
    names: dict[str, str] = {}  # tool call id -> function name, for the results that answer them
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"{where}.role must be one of {', '.join(CHAT_ROLES)}; got {brief_repr(role)}", f"{where}.role")
        # Chat templates know "system"; "developer" is OpenAI's newer name for it.
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": _content(m.get("content"), f"{where}.content", images)}
        if role == "assistant":
            calls = m.get("tool_calls")
            if calls:
                msg["tool_calls"] = [_past_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(listed(calls, f"{where}.tool_calls"))]
                names.update((c["id"], c["function"]["name"]) for c in msg["tool_calls"])
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if isinstance(reasoning, str) and reasoning:
                msg["reasoning_content"] = valid_text(reasoning, f"{where}.reasoning_content")
        elif role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad(f"{where}.tool_call_id is required: the id of the call this result answers", f"{where}.tool_call_id")
            msg["tool_call_id"] = call_id
            msg["name"] = m.get("name") if isinstance(m.get("name"), str) else names.get(call_id, "")
        out.append(msg)
    if len(images) > MAX_IMAGES:
        raise bad(f"{len(images)} images in one request; at most {MAX_IMAGES}", "messages")
    return out


def _past_call(c: Any, where: str) -> dict:
    """An assistant's earlier tool call, with its arguments as the object templates take."""
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}", where)
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            raise bad(f"{where}.function.arguments must be a JSON object (as text); got {brief_repr(args)}", f"{where}.function.arguments") from None
    if not isinstance(args, dict):
        raise bad(f"{where}.function.arguments must be a JSON object", f"{where}.function.arguments")
    call_id = c.get("id") if isinstance(c.get("id"), str) else ""
    return {"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": args}}


def _tool_choice(v: Any, tools: list[Tool]) -> tuple[str, str | None]:
    if v is None:
        return "auto", None
    if v in ("auto", "none", "required"):
        return v, None
    if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict):
        return "function", chosen_tool(v["function"].get("name"), tools, "tool_choice")
    raise bad('tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}', "tool_choice")


def _response_format(v: Any) -> ResponseFormat | None:
    if v is None or v == {} or v == {"type": "text"}:
        return None
    if not isinstance(v, dict):
        raise bad("response_format must be an object", "response_format")
    kind = v.get("type")
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind == "json_schema":
        spec = v.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad("response_format.json_schema must be {name, schema, strict?}", "response_format.json_schema")
        name = spec.get("name")
        schema = check_schema(spec["schema"], "response_format.json_schema.schema")
        return ResponseFormat("json_schema", schema, name if isinstance(name, str) else None, spec.get("strict") is True)
    raise bad(f'response_format.type must be "text", "json_object" or "json_schema"; got {brief_repr(kind)}', "response_format.type")


def _prompt(v: Any) -> str | list[int]:
    # A string, token ids, or a batch of one of either.
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]
    if isinstance(v, str):
        if not v:
            raise bad("prompt must not be empty", "prompt")
        return valid_text(v, "prompt")
    if isinstance(v, list) and v and all(is_int(t) and t >= 0 for t in v):
        return v
    if isinstance(v, list) and len(v) > 1 and all(isinstance(p, (str, list)) for p in v):
        raise bad("only one prompt per request is supported", "prompt")
    raise bad("prompt must be a non-empty string or a list of token ids", "prompt")


def _stop(v: Any) -> list[str]:
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise bad(f"stop must be a string or a list of non-empty strings of at most {MAX_STOP_CHARS} characters", "stop")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise bad(f"at most {MAX_STOP_SEQUENCES} stop sequences are supported", "stop")
    for i, s in enumerate(stops):
        valid_text(s, "stop" if isinstance(v, str) else f"stop[{i}]", "stop")
    return stops


def _refuse_unsupported(body: dict) -> None:
    for name, accepted in UNSUPPORTED_FIELDS.items():
        v = body.get(name)
        if asks_nothing(v, accepted):
            continue
        also = f" (only {' or '.join(json.dumps(a) for a in accepted)} is accepted)" if accepted else ""
        raise bad(f"{name} is not supported by ringd yet{also}", name, "unsupported_parameter")


def parse_request(body: dict, chat: bool) -> CompletionRequest:
    """A JSON object (from ``fields.parse_json``) as a request of either endpoint, or a 400."""

    def opt(name: str, check, rule: str):
        return optional(body, name, check, rule)

    model = model_name(body)
    _refuse_unsupported(body)
    n = opt("n", is_int, "an integer")
    if n is not None and n != 1:
        raise bad("only n=1 is supported", "n")
    for name, default in (("best_of", 1), ("echo", False), ("suffix", None)):
        if not chat and body.get(name) not in (None, default):
            raise bad(f"{name} is not supported", name)

    max_tokens = opt("max_completion_tokens", is_int, "an integer")
    if max_tokens is None:
        max_tokens = opt("max_tokens", is_int, "an integer")
    if max_tokens is not None and max_tokens < 1:
        raise bad("max_tokens must be at least 1", "max_tokens")

    stream = opt("stream", is_bool, "a boolean") or False
    stream_options = opt("stream_options", is_object, "an object") or {}
    include_usage = stream_options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad("stream_options.include_usage must be a boolean", "stream_options.include_usage")

    if chat:
        logprobs = opt("logprobs", is_bool, "a boolean") or False
        top = opt("top_logprobs", is_int, "an integer")
        if top is not None and not logprobs:  # OpenAI: "logprobs must be set to true if this parameter is used"
            raise bad("top_logprobs needs logprobs: true (without it no logprobs are returned)", "top_logprobs")
        top = top or 0
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad(f"top_logprobs must be from 0 to {MAX_TOP_LOGPROBS}", "top_logprobs")
    else:
        count = opt("logprobs", is_int, "an integer")
        if count is not None and not 0 <= count <= MAX_COMPLETION_LOGPROBS:
            raise bad(f"logprobs must be from 0 to {MAX_COMPLETION_LOGPROBS}", "logprobs")
        logprobs, top = count is not None, count or 0

    sampling: dict[str, Any] = {"logprobs": logprobs, "top_logprobs": top, **sampling_fields(body)}
    bias = opt("logit_bias", is_object, "an object mapping token ids to biases")
    if bias:
        try:
            sampling["logit_bias"] = {int(k): v for k, v in bias.items()}
        except ValueError:
            raise bad("logit_bias keys must be token ids", "logit_bias") from None
    params = sampling_params(sampling)

    if not chat and body.get("tools"):
        raise bad("tools are for /v1/chat/completions; completions take a prompt only", "tools")
    tools = function_tools(body.get("tools")) if chat else []
    tool_choice, tool_name = _tool_choice(body.get("tool_choice"), tools) if chat else ("auto", None)
    parallel = opt("parallel_tool_calls", is_bool, "a boolean")
    images: list[ImagePart] = []
    return CompletionRequest(
        tools=tools,
        tool_choice=tool_choice,
        tool_name=tool_name,
        parallel_tool_calls=True if parallel is None else parallel,
        response_format=_response_format(body.get("response_format")),
        template_kwargs=template_kwargs(body.get("chat_template_kwargs")) if chat else {},
        chat=chat,
        model=model,
        messages=_messages(body.get("messages"), images) if chat else None,
        images=images,
        prompt=None if chat else _prompt(body.get("prompt")),
        max_tokens=max_tokens,
        params=params,
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=include_usage and stream,
        tokens_as_ids=opt("return_tokens_as_token_ids", is_bool, "a boolean") or False,
        ignore_eos=opt("ignore_eos", is_bool, "a boolean") or False,
        given=given_fields(sampling, body.get("stop")),
    )


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def envelope(req: CompletionRequest, rid: str, created: int, model: str, chunk: bool) -> dict:
    obj = ("chat.completion" if req.chat else "text_completion") + (".chunk" if chunk and req.chat else "")
    return {"id": rid, "object": obj, "created": created, "model": model}


def now() -> int:
    return int(time.time())
