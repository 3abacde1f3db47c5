"""The one request every API becomes, and the one stream of outputs it gets back.

OpenAI's chat completions, completions and Responses, Anthropic's Messages and
Ollama's chat and generate each parse their own body into a ``Request`` and turn
``Output`` events back into their own wire format; nothing in between knows
which API a request came by (``endpoint.py`` drives it, ``serving.py`` runs it,
``render.py`` makes its prompt and grammar, ``reader.py`` splits what the model
writes).

Messages are kept in the form chat templates take (Hugging Face's convention,
as mlx-lm's server passes them): ``{"role", "content": str}``; an assistant's
``tool_calls`` as ``[{"id", "type": "function", "function": {"name",
"arguments": dict}}]`` and its ``reasoning_content``; a tool result as
``{"role": "tool", "content", "tool_call_id", "name"}``.

What a request leaves unset takes the model's default (``with_model_defaults``,
called once, by ``serving.py``, whatever the API: an Ollama model's params and
system layers); each API says which of those fields its client set
(``Request.given``), so an explicit value that equals ringd's own default stays.

No HTTP, no tokenizer.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field

from ringd.models.defaults import SAMPLED, ModelDefaults
from ringd.ring.sampling import SamplingParams

# How a request may use its tools (OpenAI's tool_choice; the other APIs map onto it).
TOOL_CHOICES = ("auto", "none", "required", "function")
# Tools one request may declare: each is described in the prompt, and a forced
# call's grammar has a branch per tool.
MAX_TOOLS = 128


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, and a JSON schema of its arguments."""

    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    # OpenAI's strict: arguments have exactly the properties the schema names.
    strict: bool = False

    def as_template_tool(self) -> dict:
        """The form chat templates (and mlx-lm's tool parsers) take: OpenAI's function tool."""
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass(frozen=True)
class ResponseFormat:
    """Structured output: ``json_object`` (any JSON object) or ``json_schema`` (``schema``)."""

    kind: str  # "json_object" | "json_schema"
    schema: dict | None = None
    name: str | None = None  # the API's name for the schema, for error messages
    strict: bool = False  # objects have exactly the properties the schema names


@dataclass
class Request:
    model: str
    params: SamplingParams
    max_tokens: int | None
    messages: list[dict] | None = None  # a chat, in the form templates take
    prompt: str | list[int] | None = None  # a raw completion: text or token ids
    stop: list[str] = field(default_factory=list)
    tools: list[Tool] = field(default_factory=list)
    tool_choice: str = "auto"  # one of TOOL_CHOICES
    tool_name: str | None = None  # with tool_choice "function": the one to call
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    # The last message is the assistant's, and the answer continues its text (Anthropic's prefill).
    prefill: bool = False
    # Passed to the chat template (mlx-lm's server's chat_template_kwargs), e.g. enable_thinking.
    template_kwargs: dict = field(default_factory=dict)
    # The end-of-sequence token does not end the answer (vLLM's ignore_eos): max_tokens or a stop does.
    ignore_eos: bool = False
    # The API's own names for fields an error may point at ("messages", "max_tokens", ...).
    names: dict[str, str] = field(default_factory=dict)
    # Which of DEFAULTED the client set: the rest take the model's defaults (with_model_defaults).
    given: frozenset[str] = frozenset()
    # Tokens prompt and answer may take together, as the client asked (Ollama's options.num_ctx);
    # None: the model's default context.
    context: int | None = None
    # The images of a chat, in the order their parts come (images.ImagePart: where in the body,
    # still encoded); each is an {"type": "image"} part of its message's content for the template.
    images: list = field(default_factory=list)

    @property
    def chat(self) -> bool:
        return self.messages is not None

    def name(self, field_: str) -> str:
        """What the client's API calls the internal field ``field_``."""
        return self.names.get(field_, field_)

    def prompt_chars(self, limit: int) -> int:
        """How much the tokenizer may be fed: characters of text, or token ids; counted up to a
        little past ``limit`` (the work stops there, whatever the request holds).

        For a chat, every string a template may render counts: the messages' every field (a tool
        call's id and arguments, a tool result's name), the tools' names, descriptions and schemas,
        the template's variables. A template adds text of its own and may leave some out; counting
        what the client sent is the rule a client can check, and it costs no tokenizing: 15 MB of
        tool descriptions went to the tokenizer, seconds and a gigabyte, before this counted them.
        """
        if self.messages is None:
            return len(self.prompt or ())
        n = 0
        stack: list = [self.messages, self.template_kwargs, [(t.name, t.description, t.parameters) for t in self.tools]]
        while stack and n <= limit:
            v = stack.pop()
            if isinstance(v, str):
                n += len(v)
            elif isinstance(v, dict):
                n += sum(len(k) for k in v if isinstance(k, str))
                stack.extend(v.values())
            elif isinstance(v, (list, tuple)):
                stack.extend(v)
            elif v is not None:
                n += 1  # a number or a boolean: a character at least
        return n


# The fields a model's defaults fill where a request leaves them unset (``Request.given`` names
# those it set): SamplingParams' fields and the stop words. max_tokens and context are unset
# when None, a system message when the chat does not start with one.
DEFAULTED = frozenset({*SAMPLED, "stop"})


def given_fields(sampling: dict, stop: object) -> frozenset[str]:
    """``Request.given`` of a request whose sampling fields are ``sampling`` (SamplingParams' names,
    only those the client sent) and whose stop field holds ``stop`` (None: not sent)."""
    return frozenset(sampling).intersection(DEFAULTED) | ({"stop"} if stop is not None else frozenset())


def with_model_defaults(req: Request, defaults: ModelDefaults) -> Request:
    """``req`` with what it leaves unset taken from ``defaults``, the model's (an Ollama model's
    params and system layers), whichever API it came by: sampling and stop words it did not send
    (``req.given``), max_tokens and context when None, and a system message first in a chat whose
    first message is not one (as Ollama adds its system layer). ``req`` itself is left as it is."""
    if not defaults:
        return req
    sampling = {k: v for k, v in defaults.sampling.items() if k not in req.given}
    changes: dict = {}
    if sampling:
        changes["params"] = dataclasses.replace(req.params, **sampling)
    if defaults.stop is not None and "stop" not in req.given:
        changes["stop"] = list(defaults.stop)
    if req.max_tokens is None and defaults.max_tokens is not None:
        changes["max_tokens"] = defaults.max_tokens
    if req.context is None and defaults.context is not None:
        changes["context"] = defaults.context
    if defaults.system and req.messages and req.messages[0].get("role") != "system":
        changes["messages"] = [{"role": "system", "content": defaults.system}, *req.messages]
    return dataclasses.replace(req, **changes) if changes else req


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (as OpenAI gives it)

    @staticmethod
    def new_id() -> str:
        return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class CallOpened:
    """Call ``index`` (its place in the answer, from 0) is named: its first piece."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    """More of call ``index``'s arguments, as JSON text: a call's pieces join to the whole."""

    index: int
    text: str


@dataclass(frozen=True)
class CallDone:
    """Call ``index`` is complete; ``call.arguments`` is its whole (normalized) JSON."""

    index: int
    call: ToolCall


CallPiece = CallOpened | CallArguments | CallDone


def whole_call(call: ToolCall, index: int) -> list[CallPiece]:
    """A call known only once complete (a native format's parser reads it whole), as its pieces."""
    return [CallOpened(index, call.id, call.name), CallArguments(index, call.arguments), CallDone(index, call)]


@dataclass
class Output:
    """What one generated token adds to the answer, already split by channel.

    ``text`` is answer text, ``reasoning`` thinking text, ``pieces`` the tool
    calls as the model writes them (streams send them so); ``calls`` are the
    calls that this token completed (whole answers keep those). Most tokens add
    to one of them; a marker token (``<think>``) adds to none. The last event
    carries ``finish_reason``: "stop", "length" or "tool_calls". A stream that
    opened a call this answer never completed (max_tokens cut it) has sent a cut
    call: each API ends it as its own cut answer ("length"), where a whole answer
    drops it and keeps "tool_calls".
    """

    token: int
    logprob: float
    top_logprobs: list[tuple[int, float]]
    text: str = ""
    reasoning: str = ""
    pieces: list[CallPiece] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    stop_sequence: str | None = None  # with finish_reason "stop": the stop string that ended it, if one did

    @property
    def calls(self) -> list[ToolCall]:
        return [p.call for p in self.pieces if isinstance(p, CallDone)]


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    image_tokens: int = 0  # of the prompt's: the positions its images' features take
