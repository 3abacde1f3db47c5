"""OpenAI's chat completions and completions, as a thin translation for ``endpoint.py``.

The body becomes a ``request.Request`` (``openai_types.parse_request``); the
``Output`` events become OpenAI's response or its SSE chunks: answer text in
``content``, thinking in ``reasoning_content``, tool calls in ``tool_calls``
(streamed as they are generated, as OpenAI streams them: a call's id and name
first, then its arguments in pieces) with ``finish_reason: "tool_calls"``.

These streams are resumable: a follower that forwards one (``proxy.py``) gets
each token's id beside its chunk and can carry the stream over to another
leader, which continues the same response (its id and creation time, no second
role chunk). The driver does the carrying; ``start`` keeps the response's identity.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ringd.http.errors import ApiError
from ringd.http.framing import OPENAI_SSE
from ringd.http.openai_types import CompletionRequest, envelope, new_id, now, parse_request
from ringd.http.request import CallArguments, CallDone, CallOpened, CallPiece, Output, ToolCall, Usage

if TYPE_CHECKING:
    from ringd.http.node import Served
    from ringd.http.proxy import Resume
    from ringd.http.serving import Generation

def usage(u: Usage) -> dict:
    out = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens, **({"image_tokens": u.image_tokens} if u.image_tokens else {})},
    }
    if u.reasoning_tokens:
        out["completion_tokens_details"] = {"reasoning_tokens": u.reasoning_tokens}
    return out


def tool_calls(calls: list[ToolCall]) -> list[dict]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def call_delta(piece: CallPiece) -> dict | None:
    """A call's piece as OpenAI streams it: its id and name first, then its arguments in pieces."""
    if isinstance(piece, CallOpened):
        return {"tool_calls": [{"index": piece.index, "id": piece.id, "type": "function", "function": {"name": piece.name, "arguments": ""}}]}
    if isinstance(piece, CallArguments):
        return {"tool_calls": [{"index": piece.index, "function": {"arguments": piece.text}}]}
    return None  # the call is complete: OpenAI's stream says nothing more of it


class Completions:
    """``POST /v1/chat/completions`` (``chat``) or ``POST /v1/completions``."""

    framing = OPENAI_SSE
    resumable = True
    keep_alive = False

    def __init__(self, chat: bool):
        self.chat = chat

    def streams(self, body: dict) -> bool:
        return body.get("stream") is True

    def unloaded(self, body: dict) -> None:
        return None

    def parse(self, body: dict, served: "Served") -> "CompletionAnswer":
        return CompletionAnswer(parse_request(body, self.chat), served.tokenizer, served.model_id)


class CompletionAnswer:
    """One completion's answer: OpenAI's response, or its chunks one token at a time."""

    def __init__(self, req: CompletionRequest, tokenizer, model_id: str):
        self.req = req
        self.request = req.to_request()
        self.stream = req.stream
        self.model_id = model_id
        self.logprobs = _Logprobs(tokenizer, req)
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCall] = []
        self.finish: str | None = None
        self.head: dict = {}  # what every chunk repeats: id, object, created, model
        self.open_call: int | None = None  # a streamed call not complete yet

    def start(self, gen: "Generation", resume: "Resume | None") -> list[dict]:
        self.head = envelope(self.req, new_id(self.req.chat), now(), self.model_id, chunk=True)
        if resume is not None:  # the same response, carried over: keep its id
            self.head.update({k: v for k, v in (("id", resume.id), ("created", resume.created)) if v is not None})
        if not self.req.chat or resume is not None:
            return []
        return [{**self.head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}]

    def feed(self, out: Output) -> list[dict]:
        if self.stream:
            return self._chunks(out)
        self.text.append(out.text)
        self.reasoning.append(out.reasoning)
        self.calls += out.calls
        self.logprobs.add(out)
        self.finish = out.finish_reason
        return []

    def _chunks(self, out: Output) -> list[dict]:
        finish, logprobs, head = out.finish_reason, self.logprobs.chunk(out), self.head
        if not self.req.chat:
            # One chunk a token (empty while text is held back): clients count chunks as tokens.
            return [{**head, "choices": [{"index": 0, "text": out.text, "logprobs": logprobs, "finish_reason": finish}]}]
        deltas = []
        if out.reasoning:
            deltas.append({"reasoning_content": out.reasoning})
        if out.text:
            deltas.append({"content": out.text})
        for piece in out.pieces:
            # By index, not id: a stream carried over to another leader goes on with a call begun
            # before (the reader, replayed, numbers calls as it did).
            self.open_call = None if isinstance(piece, CallDone) else piece.index
            if (delta := call_delta(piece)) is not None:
                deltas.append(delta)
        if finish is not None and self.open_call is not None:
            finish = "length"  # max_tokens cut the call this stream has begun: it ends as OpenAI's cut answers do
        if not deltas and (finish is not None or logprobs is not None):
            # A token that adds nothing has no chunk (no empty content before a call), unless it ends
            # the answer or brings the logprobs asked for.
            deltas.append({} if logprobs is None else {"content": ""})
        chunks = [{**head, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": None}]} for d in deltas]
        if chunks:
            chunks[-1]["choices"][0]["finish_reason"] = finish
            if logprobs is not None:
                chunks[0]["choices"][0]["logprobs"] = logprobs
        return chunks

    def end(self, gen: "Generation") -> list[dict]:
        return [{**self.head, "choices": [], "usage": usage(gen.usage)}] if self.req.include_usage else []

    def error(self, e: ApiError) -> list[dict]:
        return [e.body()]  # in-band, as OpenAI reports a failure mid-stream

    def whole(self, gen: "Generation") -> dict:
        content, calls = "".join(self.text), self.calls
        choice = {"index": 0, "logprobs": self.logprobs.whole(), "finish_reason": self.finish}
        if self.req.chat:
            message = {"role": "assistant", "content": content if content or not calls else None}
            if any(self.reasoning):
                message["reasoning_content"] = "".join(self.reasoning)
            if calls:
                message["tool_calls"] = tool_calls(calls)
            choice["message"] = message
        else:
            choice["text"] = content
        body = envelope(self.req, new_id(self.req.chat), gen.created, self.model_id, chunk=False)
        body.update(choices=[choice], usage=usage(gen.usage))
        return body


class _Logprobs:
    """OpenAI's logprobs objects: chat's ``content`` list or completions' parallel lists."""

    def __init__(self, tokenizer, req: CompletionRequest):
        self.tok = tokenizer
        self.req = req
        self.on = req.params.logprobs
        self.entries: list = []

    def _text(self, token: int) -> str:
        return f"token_id:{token}" if self.req.tokens_as_ids else self.tok.decode([token])

    def _entry(self, ev) -> dict:
        text = self._text(ev.token)
        if self.req.chat:
            return {
                "token": text,
                "logprob": ev.logprob,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": self._text(t), "logprob": v, "bytes": list(self._text(t).encode())} for t, v in ev.top_logprobs
                ],
            }
        return {"token": text, "logprob": ev.logprob, "top": {self._text(t): v for t, v in ev.top_logprobs}}

    def add(self, ev) -> None:
        if self.on:
            self.entries.append(self._entry(ev))

    def _shape(self, entries: list) -> dict:
        if self.req.chat:
            return {"content": entries}
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [e["top"] for e in entries],
        }

    def whole(self) -> dict | None:
        return self._shape(self.entries) if self.on else None

    def chunk(self, ev) -> dict | None:
        return self._shape([self._entry(ev)]) if self.on and ev is not None else None
