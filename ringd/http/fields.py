"""A request body and the checks of its fields that every API's translation shares.

``parse_json`` reads a body as a JSON object; the rest check one field each
and raise a 400 ``ApiError`` that names it (``bad``), or return what the
field holds: a model name, text every character of which a tokenizer can
take, the sampling fields every API reads by OpenAI's names, a JSON schema
that is not nested to attack the grammar compiler, a tool's name, template
variables, OpenAI-style function tools (chat completions' and Ollama's).

Limits that bound a body's work are here, named once, whichever API reads
them. What a field means to one API (its roles, its content blocks, its own
refusals and wording) stays in that API's module.

Pure: no HTTP, no tokenizer; nothing a client sends makes these raise anything
but ``ApiError``.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from ringd.http.errors import ApiError
from ringd.http.request import MAX_TOOLS, Tool
from ringd.models.ollama.keepalive import KeepAliveError, parse_keep_alive
from ringd.ring.sampling import SamplingError, SamplingParams, brief_repr
from ringd.stage.patterns import too_costly

# OpenAI accepts up to 4 stop sequences; a few more costs nothing here.
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
# JSON values a body may hold, counted before it is parsed: json.loads holds the GIL for a whole
# parse, so the event loop stands still meanwhile whatever thread parses (1.5M empty objects: 1.7 s,
# and the ring re-elected). Each bounds a parse to about 0.2 s on a slow core (an object member
# costs ~0.8 µs, an item ~0.08 µs), and leaves room for what is legitimate: 4,096 messages, 128
# tools' schemas, a prompt or 2,048 embedding inputs of token ids, a million of them.
MAX_JSON_CONTAINERS = 100_000
MAX_JSON_MEMBERS = 200_000
MAX_JSON_ITEMS = 2_000_000
# Messages in one chat request; beyond this the body is an attack or a bug.
MAX_MESSAGES = 4096
# Model names are Hugging Face repo ids (at most 96 characters there) or
# directory names; the name is quoted back in a 404, so a longer one is refused.
MAX_MODEL_CHARS = 256
# OpenAI's rule for function names: what templates and parsers can carry.
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]+")
MAX_TOOL_NAME_CHARS = 64  # Anthropic's tools take 128
# A JSON schema (a tool's parameters, a response format) nested deeper than
# this is an attack on the grammar compiler, not a schema.
MAX_SCHEMA_DEPTH = 64
# Values in one schema: the largest tool schemas people send (MCP servers') hold hundreds; a
# grammar is at most MAX_GRAMMAR_BYTES (32 KiB), which no schema of more values could fit. Checked
# before anything else walks the schema: 15 MiB of tiny nodes took 7.4 s to check whole.
MAX_SCHEMA_NODES = 16_384
# Sampling every API takes by these names (Anthropic and Responses as ringd's
# extensions): numbers, then integers, checked in this order.
SAMPLED_NUMBERS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
SAMPLED_INTEGERS = ("top_k", "seed")

# A surrogate code point can only be alone in a str that came from JSON (the
# decoder joins a valid \ud83d\ude00 pair into one character), and no tokenizer
# can encode it: UTF-8 has no bytes for it.
_SURROGATE = re.compile("[\ud800-\udfff]")


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 naming the field at fault (``param``), in the API's words (``message``)."""
    return ApiError(400, message, param, code)


# --- the body ---------------------------------------------------------------------


class _NotJson(ValueError):
    pass


def _refuse_constant(name: str) -> float:
    # Python's json reads NaN and Infinity; JSON has no such numbers, and
    # downstream arithmetic should never meet them.
    raise _NotJson(f"{name} is not a JSON value")


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 ``ApiError``; nothing else escapes.

    Pure and thread-safe (it reads and changes no global state), so ``intake.py``
    may run it in an executor on bodies up to its 16 MiB cap. What ``json``
    raises on hostile bodies becomes a 400: bytes that are not UTF-8 (or -16/-32),
    syntax errors, nesting deeper than the interpreter's recursion limit
    (``RecursionError``), an integer longer than Python's 4,300-digit
    conversion limit, and NaN / Infinity.
    """
    too_many = _too_many_values(raw)
    if too_many:
        raise bad(too_many)
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise bad("the request body nests arrays or objects too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError, _NotJson) as e:
        raise bad(f"the request body is not valid JSON: {e}") from None
    except ValueError:
        # The only other ValueError json.loads raises: int() refusing a number
        # of more digits than sys.get_int_max_str_digits() (4,300 by default),
        # whose own message tells the reader to raise that limit.
        raise bad("the request body holds a number with too many digits to read") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return body


def _too_many_values(raw: bytes) -> str | None:
    """Why ``raw`` holds more JSON values than a body may (before it is parsed), or None.

    Counted by the bytes that make them (``{`` and ``[``, ``:``, ``,``), which strings holding
    those characters inflate: the safe side, and text holds few of them. Milliseconds for 16 MiB.
    """
    for what, count, limit in (
        ("objects and lists", raw.count(b"{") + raw.count(b"["), MAX_JSON_CONTAINERS),
        ("object members", raw.count(b":"), MAX_JSON_MEMBERS),
        ("values", raw.count(b","), MAX_JSON_ITEMS),
    ):
        if count > limit:
            return f"the request body holds up to {count} JSON {what}; at most {limit} are read"
    return None


# --- one field --------------------------------------------------------------------


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def is_object(v: Any) -> bool:
    return isinstance(v, dict)


def optional(body: dict, name: str, check: Callable[[Any], bool], rule: str) -> Any:
    """``body[name]`` when ``check`` holds for it, None when absent or null; else a 400 saying ``rule``."""
    v = body.get(name)
    if v is not None and not check(v):
        raise bad(f"{name} must be {rule}; got {brief_repr(v)}", name)
    return v


def asks_nothing(v: Any, accepted: tuple = ()) -> bool:
    """A field that asks for nothing: absent (null, [] and {} count as absent, since clients
    send them) or one of the ``accepted`` values, of the same JSON type."""
    return v is None or v == [] or v == {} or any(v == a and type(v) is type(a) for a in accepted)


def valid_text(s: str, where: str, param: str | None = None) -> str:
    """s, if every character of it can reach a tokenizer."""
    if s.isascii():  # the common case, and O(1): CPython records it with the string
        return s
    m = _SURROGATE.search(s)
    if m:
        raise bad(f"{where} contains a lone surrogate (U+{ord(m.group()):04X}); send valid Unicode", param or where)
    return s


def model_name(body: dict) -> str:
    """The ``model`` field as OpenAI's and Anthropic's APIs take it: a name of a served model."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model is required and must be a string", "model")
    if len(model) > MAX_MODEL_CHARS:
        raise bad(f"model must be a name of at most {MAX_MODEL_CHARS} characters; GET /v1/models lists it", "model")
    return valid_text(model, "model")


# A body that leaves keep_alive out (or null, which Go reads as absent): the model's keep_alive stays.
KEEP_ALIVE_UNSET = False


def keep_alive_field(body: dict) -> float | None | bool:
    """Ollama's ``keep_alive`` of ``body``: seconds, None (forever), or KEEP_ALIVE_UNSET; a 400 if malformed."""
    if body.get("keep_alive") is None:
        return KEEP_ALIVE_UNSET
    try:
        return parse_keep_alive(body["keep_alive"])
    except KeepAliveError as e:
        raise ApiError(400, str(e), "keep_alive") from None


def sampling_fields(body: dict) -> dict[str, Any]:
    """The sampling fields ``body`` sets (``SAMPLED_NUMBERS``, ``SAMPLED_INTEGERS``), type-checked."""
    sampling: dict[str, Any] = {}
    for name in SAMPLED_NUMBERS:
        v = optional(body, name, is_number, "a number")
        if v is not None:
            sampling[name] = v
    for name in SAMPLED_INTEGERS:
        v = optional(body, name, is_int, "an integer")
        if v is not None:
            sampling[name] = v
    return sampling


def sampling_params(sampling: dict[str, Any], negative_top_k_is_off: bool = True) -> SamplingParams:
    """``SamplingParams`` of checked fields, or a 400 naming the one out of range.

    A negative seed is taken modulo 2^63 (clients send any integer); a negative
    top_k means "off" where OpenAI-style clients send -1 for it.
    """
    if negative_top_k_is_off and sampling.get("top_k", 0) < 0:
        sampling = {**sampling, "top_k": 0}
    if "seed" in sampling and sampling["seed"] < 0:
        sampling = {**sampling, "seed": sampling["seed"] % 2**63}
    try:
        return SamplingParams(**sampling)
    except SamplingError as e:
        raise bad(str(e), e.field) from None


def listed(v: Any, where: str) -> list:
    if not isinstance(v, list):
        raise bad(f"{where} must be a list", where)
    return v


def _shape(v: Any) -> tuple[int, int]:
    """(depth, nodes) of ``v``, each counted until it passes its limit (MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_NODES): iterative, so a hostile schema can neither recurse us out nor keep us walking."""
    deepest, nodes, stack = 0, 0, [(v, 0)]
    while stack:
        node, d = stack.pop()
        deepest, nodes = max(deepest, d), nodes + 1
        if d > MAX_SCHEMA_DEPTH or nodes > MAX_SCHEMA_NODES:
            break
        if isinstance(node, dict):
            stack.extend((x, d + 1) for x in node.values())
        elif isinstance(node, list):
            stack.extend((x, d + 1) for x in node)
    return deepest, nodes


def check_schema(schema: Any, where: str) -> dict:
    if not isinstance(schema, dict):
        raise bad(f"{where} must be a JSON schema object; got {brief_repr(schema)}", where)
    depth, nodes = _shape(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise bad(f"{where} nests deeper than {MAX_SCHEMA_DEPTH} levels", where)
    if nodes > MAX_SCHEMA_NODES:
        raise bad(f"{where} holds more than {MAX_SCHEMA_NODES} values (keys' values and list items); send a smaller schema", where)
    # Refused now, before any token: compiled, it would fail mid-answer.
    if (why := too_costly(schema)) is not None:
        raise bad(f"{where}: {why}", where)
    return schema


def check_tool_name(name: Any, where: str, max_chars: int = MAX_TOOL_NAME_CHARS) -> str:
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name) or len(name) > max_chars:
        raise bad(f"{where} must be 1 to {max_chars} letters, digits, '_', '-' or '.'; got {brief_repr(name)}", where)
    return name


def chosen_tool(name: Any, tools: list[Tool], where: str, what: str = "function") -> str:
    """``name``, a tool_choice's, if it is a string naming one of ``tools``; else a 400 naming
    ``where`` (a list or an object there is a client's mistake, not a lookup that fails)."""
    if not isinstance(name, str) or name not in {t.name for t in tools}:
        raise bad(f"tool_choice names the {what} {brief_repr(name)}, which is not among the tools", where)
    return name


def declared_tool(t: dict, where: str, seen: set[str], max_name_chars: int = MAX_TOOL_NAME_CHARS) -> tuple[str, str]:
    """A declared tool's name (valid, and not declared before: ``seen`` keeps the names) and its
    description (text, empty when absent), as every API's tool declaration has them under ``where``."""
    name = check_tool_name(t.get("name"), f"{where}.name", max_name_chars)
    if name in seen:
        raise bad(f"{where}.name {name!r} is declared twice", f"{where}.name")
    seen.add(name)
    description = t.get("description") or ""
    if not isinstance(description, str):
        raise bad(f"{where}.description must be a string", f"{where}.description")
    return name, valid_text(description, f"{where}.description")


def template_kwargs(v: Any, where: str = "chat_template_kwargs") -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise bad(f'{where} must be an object of template variables, e.g. {{"enable_thinking": false}}', where)
    depth, nodes = _shape(v)
    if depth > MAX_SCHEMA_DEPTH or nodes > MAX_SCHEMA_NODES:
        raise bad(f"{where} nests too deeply or holds too many values", where)
    return v


def tool_list(v: Any) -> list:
    """A request's ``tools``, any API's: a list of at most MAX_TOOLS (none given: an empty one)."""
    if v is None or v == []:
        return []
    tools = listed(v, "tools")
    if len(tools) > MAX_TOOLS:
        raise bad(f"at most {MAX_TOOLS} tools are accepted", "tools")
    return tools


def function_tools(v: Any) -> list[Tool]:
    """OpenAI's function tools (``{"type": "function", "function": {name, description, parameters,
    strict}}``), as chat completions and Ollama take them."""
    tools = tool_list(v)
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise bad(f"{where} must be {{'type': 'function', 'function': {{'name', 'description', 'parameters'}}}}; only function tools are supported", where)
        fn = t["function"]
        name, description = declared_tool(fn, f"{where}.function", seen)
        params = fn.get("parameters")
        params = {"type": "object", "properties": {}} if params is None else check_schema(params, f"{where}.function.parameters")
        out.append(Tool(name, description, params, fn.get("strict") is True))
    return out
