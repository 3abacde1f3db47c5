"""OpenAI request parsing and response shapes, as pure functions.

Bodies of ``/v1/chat/completions`` and ``/v1/completions`` become a
``CompletionRequest``; anything malformed becomes an ``ApiError`` carrying the
HTTP status and OpenAI's error shape (``{"error": {"message", "type",
"param", "code"}}``), naming the field at fault. Fields the API documents but
ringd cannot honour (``n`` > 1, ``best_of``, ``echo``, ``suffix``, the old
``functions``, audio: ``UNSUPPORTED_FIELDS``) are refused, not ignored;
unknown fields are ignored, as clients send many. Nothing a client sends makes
these functions raise anything but ``ApiError``.

No HTTP, no tokenizer: ``api.py`` does the I/O, this module the shapes.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ringd.http.errors import ApiError
from ringd.http.request import MAX_TOOLS, Request, ResponseFormat, Tool
from ringd.ring.sampling import MAX_TOP_LOGPROBS, SamplingError, SamplingParams, brief_repr

# OpenAI accepts up to 4 stop sequences; a few more costs nothing here.
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
# Legacy completions take logprobs as a count, at most 5 (OpenAI's limit).
MAX_COMPLETION_LOGPROBS = 5
# Messages in one chat request; beyond this the body is an attack or a bug.
MAX_MESSAGES = 4096
# Model names are Hugging Face repo ids (at most 96 characters there) or
# directory names; the name is quoted back in a 404, so a longer one is refused.
MAX_MODEL_CHARS = 256
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

# OpenAI's rule for function names: what templates and parsers can carry.
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]+")
MAX_TOOL_NAME_CHARS = 64  # Anthropic's tools take 128
# A JSON schema (a tool's parameters, a response format) nested deeper than
# this is an attack on the grammar compiler, not a schema.
MAX_SCHEMA_DEPTH = 64

# A surrogate code point can only be alone in a str that came from JSON (the
# decoder joins a valid \ud83d\ude00 pair into one character), and no tokenizer
# can encode it: UTF-8 has no bytes for it.
_SURROGATE = re.compile("[\ud800-\udfff]")


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

    def to_request(self) -> Request:
        """The internal request (``request.py``) that every API becomes."""
        return Request(
            model=self.model, params=self.params, max_tokens=self.max_tokens, messages=self.messages, prompt=self.prompt,
            stop=self.stop, tools=self.tools, tool_choice=self.tool_choice, tool_name=self.tool_name,
            parallel_tool_calls=self.parallel_tool_calls, response_format=self.response_format,
            template_kwargs=self.template_kwargs, ignore_eos=self.ignore_eos,
        )  # fmt: skip


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _NotJson(ValueError):
    pass


def _refuse_constant(name: str) -> float:
    # Python's json reads NaN and Infinity; JSON has no such numbers, and
    # downstream arithmetic should never meet them.
    raise _NotJson(f"{name} is not a JSON value")


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 ``ApiError``; nothing else escapes.

    Pure and thread-safe (it reads and changes no global state), so ``api.py``
    may run it in an executor on bodies up to its 16 MiB cap. What ``json``
    raises on hostile bodies becomes a 400: bytes that are not UTF-8 (or -16/-32),
    syntax errors, nesting deeper than the interpreter's recursion limit
    (``RecursionError``), an integer longer than Python's 4,300-digit
    conversion limit, and NaN / Infinity.
    """
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise _bad("the request body nests arrays or objects too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError, _NotJson) as e:
        raise _bad(f"the request body is not valid JSON: {e}") from None
    except ValueError:
        # The only other ValueError json.loads raises: int() refusing a number
        # of more digits than sys.get_int_max_str_digits() (4,300 by default),
        # whose own message tells the reader to raise that limit.
        raise _bad("the request body holds a number with too many digits to read") from None
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    return body


def _valid_text(s: str, where: str, param: str | None = None) -> str:
    """s, if every character of it can reach a tokenizer."""
    if s.isascii():  # the common case, and O(1): CPython records it with the string
        return s
    m = _SURROGATE.search(s)
    if m:
        raise _bad(f"{where} contains a lone surrogate (U+{ord(m.group()):04X}); send valid Unicode", param or where)
    return s


def _text_content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return _valid_text(content, where)
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"{where}[{i}] must be a text part {{'type': 'text', 'text': ...}}; only text is supported", where)
            parts.append(_valid_text(part["text"], f"{where}[{i}].text"))
        return "".join(parts)
    raise _bad(f"{where} must be a string or a list of text parts", where)


def _messages(v: Any) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise _bad("messages must be a non-empty list", "messages")
    if len(v) > MAX_MESSAGES:
        raise _bad(f"at most {MAX_MESSAGES} messages are accepted", "messages")
    out = []
    names: dict[str, str] = {}  # tool call id -> function name, for the results that answer them
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where} must be an object", where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise _bad(f"{where}.role must be one of {', '.join(CHAT_ROLES)}; got {brief_repr(role)}", f"{where}.role")
        # Chat templates know "system"; "developer" is OpenAI's newer name for it.
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": _text_content(m.get("content"), f"{where}.content")}
        if role == "assistant":
            calls = m.get("tool_calls")
            if calls:
                msg["tool_calls"] = [_past_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(_list(calls, f"{where}.tool_calls"))]
                names.update((c["id"], c["function"]["name"]) for c in msg["tool_calls"])
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if isinstance(reasoning, str) and reasoning:
                msg["reasoning_content"] = _valid_text(reasoning, f"{where}.reasoning_content")
        elif role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise _bad(f"{where}.tool_call_id is required: the id of the call this result answers", f"{where}.tool_call_id")
            msg["tool_call_id"] = call_id
            msg["name"] = m.get("name") if isinstance(m.get("name"), str) else names.get(call_id, "")
        out.append(msg)
    return out


def _list(v: Any, where: str) -> list:
    if not isinstance(v, list):
        raise _bad(f"{where} must be a list", where)
    return v


def _past_call(c: Any, where: str) -> dict:
    """An assistant's earlier tool call, with its arguments as the object templates take."""
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _bad(f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}", where)
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            raise _bad(f"{where}.function.arguments must be a JSON object (as text); got {brief_repr(args)}", f"{where}.function.arguments") from None
    if not isinstance(args, dict):
        raise _bad(f"{where}.function.arguments must be a JSON object", f"{where}.function.arguments")
    call_id = c.get("id") if isinstance(c.get("id"), str) else ""
    return {"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": args}}


def schema_depth(v: Any, depth: int = 0) -> int:
    """How deeply ``v`` nests (iteratively bounded: a hostile schema cannot recurse us out)."""
    deepest, stack = 0, [(v, 0)]
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        if d > MAX_SCHEMA_DEPTH:
            break
        if isinstance(node, dict):
            stack.extend((x, d + 1) for x in node.values())
        elif isinstance(node, list):
            stack.extend((x, d + 1) for x in node)
    return deepest


def check_schema(schema: Any, where: str) -> dict:
    if not isinstance(schema, dict):
        raise _bad(f"{where} must be a JSON schema object; got {brief_repr(schema)}", where)
    if schema_depth(schema) > MAX_SCHEMA_DEPTH:
        raise _bad(f"{where} nests deeper than {MAX_SCHEMA_DEPTH} levels", where)
    return schema


def check_tool_name(name: Any, where: str, max_chars: int = MAX_TOOL_NAME_CHARS) -> str:
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name) or len(name) > max_chars:
        raise _bad(f"{where} must be 1 to {max_chars} letters, digits, '_', '-' or '.'; got {brief_repr(name)}", where)
    return name


def _tools(v: Any) -> list[Tool]:
    if v is None or v == []:
        return []
    tools = _list(v, "tools")
    if len(tools) > MAX_TOOLS:
        raise _bad(f"at most {MAX_TOOLS} tools are accepted", "tools")
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise _bad(f"{where} must be {{'type': 'function', 'function': {{'name', 'description', 'parameters'}}}}; only function tools are supported", where)
        fn = t["function"]
        name = check_tool_name(fn.get("name"), f"{where}.function.name")
        if name in seen:
            raise _bad(f"{where}.function.name {name!r} is declared twice", f"{where}.function.name")
        seen.add(name)
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise _bad(f"{where}.function.description must be a string", f"{where}.function.description")
        params = fn.get("parameters")
        params = {"type": "object", "properties": {}} if params is None else check_schema(params, f"{where}.function.parameters")
        is_strict = fn.get("strict") is True
        out.append(Tool(name, _valid_text(description, f"{where}.function.description"), params, is_strict))
    return out


def _tool_choice(v: Any, tools: list[Tool]) -> tuple[str, str | None]:
    if v is None:
        return "auto", None
    if v in ("auto", "none", "required"):
        return v, None
    if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict):
        name = v["function"].get("name")
        if name not in {t.name for t in tools}:
            raise _bad(f"tool_choice names the function {brief_repr(name)}, which is not among the tools", "tool_choice")
        return "function", name
    raise _bad('tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}', "tool_choice")


def _response_format(v: Any) -> ResponseFormat | None:
    if v is None or v == {} or v == {"type": "text"}:
        return None
    if not isinstance(v, dict):
        raise _bad("response_format must be an object", "response_format")
    kind = v.get("type")
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind == "json_schema":
        spec = v.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise _bad("response_format.json_schema must be {name, schema, strict?}", "response_format.json_schema")
        name = spec.get("name")
        schema = check_schema(spec["schema"], "response_format.json_schema.schema")
        return ResponseFormat("json_schema", schema, name if isinstance(name, str) else None, spec.get("strict") is True)
    raise _bad(f'response_format.type must be "text", "json_object" or "json_schema"; got {brief_repr(kind)}', "response_format.type")


def template_kwargs(v: Any, where: str = "chat_template_kwargs") -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise _bad(f'{where} must be an object of template variables, e.g. {{"enable_thinking": false}}', where)
    if schema_depth(v) > MAX_SCHEMA_DEPTH:
        raise _bad(f"{where} nests too deeply", where)
    return v


def _prompt(v: Any) -> str | list[int]:
    # A string, token ids, or a batch of one of either.
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]
    if isinstance(v, str):
        if not v:
            raise _bad("prompt must not be empty", "prompt")
        return _valid_text(v, "prompt")
    if isinstance(v, list) and v and all(_is_int(t) and t >= 0 for t in v):
        return v
    if isinstance(v, list) and len(v) > 1 and all(isinstance(p, (str, list)) for p in v):
        raise _bad("only one prompt per request is supported", "prompt")
    raise _bad("prompt must be a non-empty string or a list of token ids", "prompt")


def _stop(v: Any) -> list[str]:
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise _bad(f"stop must be a string or a list of non-empty strings of at most {MAX_STOP_CHARS} characters", "stop")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise _bad(f"at most {MAX_STOP_SEQUENCES} stop sequences are supported", "stop")
    for i, s in enumerate(stops):
        _valid_text(s, "stop" if isinstance(v, str) else f"stop[{i}]", "stop")
    return stops


def _refuse_unsupported(body: dict) -> None:
    for name, accepted in UNSUPPORTED_FIELDS.items():
        v = body.get(name)
        if v is None or v == [] or v == {} or any(v == a and type(v) is type(a) for a in accepted):
            continue
        also = f" (only {' or '.join(json.dumps(a) for a in accepted)} is accepted)" if accepted else ""
        raise _bad(f"{name} is not supported by ringd yet{also}", name, "unsupported_parameter")


def parse_request(body: dict, chat: bool) -> CompletionRequest:
    """A JSON object (from ``parse_json``) as a request of either endpoint, or a 400."""

    def opt(name: str, check, rule: str):
        v = body.get(name)
        if v is not None and not check(v):
            raise _bad(f"{name} must be {rule}; got {brief_repr(v)}", name)
        return v

    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model is required and must be a string", "model")
    if len(model) > MAX_MODEL_CHARS:
        raise _bad(f"model must be a name of at most {MAX_MODEL_CHARS} characters; GET /v1/models lists it", "model")
    _valid_text(model, "model")
    _refuse_unsupported(body)
    n = opt("n", _is_int, "an integer")
    if n is not None and n != 1:
        raise _bad("only n=1 is supported", "n")
    for name, default in (("best_of", 1), ("echo", False), ("suffix", None)):
        if not chat and body.get(name) not in (None, default):
            raise _bad(f"{name} is not supported", name)

    max_tokens = opt("max_completion_tokens", _is_int, "an integer")
    if max_tokens is None:
        max_tokens = opt("max_tokens", _is_int, "an integer")
    if max_tokens is not None and max_tokens < 1:
        raise _bad("max_tokens must be at least 1", "max_tokens")

    stream = opt("stream", lambda v: isinstance(v, bool), "a boolean") or False
    stream_options = opt("stream_options", lambda v: isinstance(v, dict), "an object") or {}
    include_usage = stream_options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise _bad("stream_options.include_usage must be a boolean", "stream_options.include_usage")

    if chat:
        logprobs = opt("logprobs", lambda v: isinstance(v, bool), "a boolean") or False
        top = opt("top_logprobs", _is_int, "an integer")
        if top is not None and not logprobs:  # OpenAI: "logprobs must be set to true if this parameter is used"
            raise _bad("top_logprobs needs logprobs: true (without it no logprobs are returned)", "top_logprobs")
        top = top or 0
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise _bad(f"top_logprobs must be from 0 to {MAX_TOP_LOGPROBS}", "top_logprobs")
    else:
        count = opt("logprobs", _is_int, "an integer")
        if count is not None and not 0 <= count <= MAX_COMPLETION_LOGPROBS:
            raise _bad(f"logprobs must be from 0 to {MAX_COMPLETION_LOGPROBS}", "logprobs")
        logprobs, top = count is not None, count or 0

    sampling: dict[str, Any] = {"logprobs": logprobs, "top_logprobs": top}
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        v = opt(name, _is_number, "a number")
        if v is not None:
            sampling[name] = v
    for name in ("top_k", "seed"):
        v = opt(name, _is_int, "an integer")
        if v is not None:
            sampling[name] = v
    if sampling.get("top_k", 0) < 0:  # OpenAI-style clients send -1 for "off"
        sampling["top_k"] = 0
    bias = opt("logit_bias", lambda v: isinstance(v, dict), "an object mapping token ids to biases")
    if bias:
        try:
            sampling["logit_bias"] = {int(k): v for k, v in bias.items()}
        except ValueError:
            raise _bad("logit_bias keys must be token ids", "logit_bias") from None
    if "seed" in sampling and sampling["seed"] < 0:
        sampling["seed"] %= 2**63
    try:
        params = SamplingParams(**sampling)
    except SamplingError as e:
        raise _bad(str(e), e.field) from None

    if not chat and body.get("tools"):
        raise _bad("tools are for /v1/chat/completions; completions take a prompt only", "tools")
    tools = _tools(body.get("tools")) if chat else []
    tool_choice, tool_name = _tool_choice(body.get("tool_choice"), tools) if chat else ("auto", None)
    parallel = opt("parallel_tool_calls", lambda v: isinstance(v, bool), "a boolean")
    return CompletionRequest(
        tools=tools,
        tool_choice=tool_choice,
        tool_name=tool_name,
        parallel_tool_calls=True if parallel is None else parallel,
        response_format=_response_format(body.get("response_format")),
        template_kwargs=template_kwargs(body.get("chat_template_kwargs")) if chat else {},
        chat=chat,
        model=model,
        messages=_messages(body.get("messages")) if chat else None,
        prompt=None if chat else _prompt(body.get("prompt")),
        max_tokens=max_tokens,
        params=params,
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=include_usage and stream,
        tokens_as_ids=opt("return_tokens_as_token_ids", lambda v: isinstance(v, bool), "a boolean") or False,
        ignore_eos=opt("ignore_eos", lambda v: isinstance(v, bool), "a boolean") or False,
    )


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def envelope(req: CompletionRequest, rid: str, created: int, model: str, chunk: bool) -> dict:
    obj = ("chat.completion" if req.chat else "text_completion") + (".chunk" if chunk and req.chat else "")
    return {"id": rid, "object": obj, "created": created, "model": model}


def now() -> int:
    return int(time.time())
