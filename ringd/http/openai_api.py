"""OpenAI's chat completions and completions, as a thin layer over ``serving.py``.

The body becomes a ``request.Request`` (``openai_types.parse_request``); the
``Output`` events become OpenAI's response or its SSE chunks: answer text in
``content``, thinking in ``reasoning_content``, tool calls in ``tool_calls``
(streamed as OpenAI streams them: a call's id and name first, then its
arguments in pieces) with ``finish_reason: "tool_calls"``.

A follower forwards these requests to the leader (``proxy.py``); for a
forwarded stream each token's id rides in an SSE comment beside its chunk, so
the follower can carry the stream over to another leader.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING

from aiohttp import web

from ringd.http.errors import ApiError
from ringd.http.openai_types import CompletionRequest, envelope, new_id, now, parse_request
from ringd.http.proxy import RESUME_FIELD, TOKEN_COMMENT
from ringd.http.request import Output, ToolCall, Usage

if TYPE_CHECKING:
    from ringd.http.api import Api

log = logging.getLogger(__name__)

# A follower's resumed stream names at most this many tokens already streamed:
# no stream is longer than a context.
MAX_RESUME_TOKENS = 1 << 20
# A streamed call's arguments go out in pieces of about this many characters.
ARGUMENT_PIECE_CHARS = 32


def usage(u: Usage) -> dict:
    out = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }
    if u.reasoning_tokens:
        out["completion_tokens_details"] = {"reasoning_tokens": u.reasoning_tokens}
    return out


def tool_calls(calls: list[ToolCall]) -> list[dict]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def call_pieces(call: ToolCall, index: int) -> list[dict]:
    """A call as streamed deltas: its id and name, then its arguments in pieces."""
    pieces = [{"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}]
    args = call.arguments
    for i in range(0, len(args), ARGUMENT_PIECE_CHARS):
        pieces.append({"index": index, "function": {"arguments": args[i : i + ARGUMENT_PIECE_CHARS]}})
    return pieces


class OpenAiApi:
    def __init__(self, api: "Api"):
        self.api = api

    def routes(self) -> list:
        return [web.post("/v1/chat/completions", self.chat), web.post("/v1/completions", self.completions)]

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def _complete(self, request: web.Request, chat: bool) -> web.StreamResponse:
        api = self.api
        api.need_key(request)
        raw = await api.read(request)
        forwarded = await api.forwarded_by(request, raw) is not None
        body = await api.json(raw)
        if api.d.engine is None:
            return await api.proxy.forward(request, raw, body.get("stream") is True)
        req = parse_request(body, chat)
        resume = None
        if forwarded and body.get(RESUME_FIELD) is not None:
            if not req.stream:  # followers carry streams over; anything else is sent again whole
                raise ApiError(400, f"{RESUME_FIELD} carries a stream over; this request does not stream", RESUME_FIELD)
            # Up to MAX_RESUME_TOKENS ids, each checked: tens of milliseconds, not on the loop.
            resume = await asyncio.get_running_loop().run_in_executor(None, _resume, body[RESUME_FIELD], api.d.info.vocab_size)
        gen = await api.serving.open(req.to_request(), api.request_id(request), resume["tokens"] if resume else ())
        try:
            if req.stream:
                return await self._stream(request, req, gen, forwarded, resume)
            return await self._whole(req, gen)
        finally:
            await gen.aclose()

    async def _whole(self, req: CompletionRequest, gen) -> web.Response:
        text, reasoning, calls, logprobs, finish = [], [], [], _Logprobs(self.api.d.tokenizer, req), None
        async for out in gen:
            text.append(out.text)
            reasoning.append(out.reasoning)
            calls += out.calls
            logprobs.add(out)
            finish = out.finish_reason
        self.api.d.metrics.completion_tokens.inc(gen.usage.completion_tokens)
        content = "".join(text)
        choice = {"index": 0, "logprobs": logprobs.whole(), "finish_reason": finish}
        if req.chat:
            message = {"role": "assistant", "content": content if content or not calls else None}
            if any(reasoning):
                message["reasoning_content"] = "".join(reasoning)
            if calls:
                message["tool_calls"] = tool_calls(calls)
            choice["message"] = message
        else:
            choice["text"] = content
        body = envelope(req, new_id(req.chat), gen.created, self.api.d.model_id, chunk=False)
        body.update(choices=[choice], usage=usage(gen.usage))
        return web.json_response(body)

    async def _stream(self, request: web.Request, req: CompletionRequest, gen, forwarded: bool, resume: dict | None) -> web.StreamResponse:
        events = aiter(gen)
        # Pull the first event before answering 200, so a ring that fails at once
        # still gets a proper error status.
        first = await anext(events, None)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        head = envelope(req, new_id(req.chat), now(), self.api.d.model_id, chunk=True)
        if resume is not None:  # the same response, carried over: keep its id
            head.update({k: resume[k] for k in ("id", "created") if resume.get(k) is not None})
        lp = _Logprobs(self.api.d.tokenizer, req)
        resumed = len(resume["tokens"]) if resume else 0
        calls_sent = 0

        async def send(chunks: list[dict], token: int | None = None) -> None:
            data = b"".join(b"data: " + json.dumps(c, separators=(",", ":")).encode() + b"\n\n" for c in chunks)
            if forwarded and token is not None:
                # For the follower that proxies this stream: the token's id, so it can
                # carry the stream over to another leader (proxy.py strips the line).
                data = TOKEN_COMMENT + str(token).encode() + b"\n" + data
            await resp.write(data)

        def chunks_of(out: Output) -> list[dict]:
            nonlocal calls_sent
            finish, logprobs = out.finish_reason, lp.chunk(out)
            # One chunk a token at least (empty while text is held back or a call is read):
            # clients count chunks as tokens, and a follower needs each token's id.
            if not req.chat:
                return [{**head, "choices": [{"index": 0, "text": out.text, "logprobs": logprobs, "finish_reason": finish}]}]
            deltas = []
            if out.reasoning:
                deltas.append({"reasoning_content": out.reasoning})
            if out.text or not (out.reasoning or out.calls):
                deltas.append({"content": out.text})
            for call in out.calls:
                deltas += [{"tool_calls": [piece]} for piece in call_pieces(call, calls_sent)]
                calls_sent += 1
            chunks = [{**head, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": None}]} for d in deltas]
            if chunks:
                chunks[-1]["choices"][0]["finish_reason"] = finish
                if logprobs is not None:
                    chunks[0]["choices"][0]["logprobs"] = logprobs
            return chunks

        try:
            if req.chat and resume is None:
                await send([{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}])
            out = first
            while out is not None:
                await send(chunks_of(out), out.token)
                out = await anext(events, None)
            if req.include_usage:
                await send([{**head, "choices": [], "usage": usage(gen.usage)}])
            await resp.write(b"data: [DONE]\n\n")
        except ApiError as e:
            # The stream has started: report the failure in-band, as OpenAI does, and end it properly.
            await send([e.body()])
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:  # aiohttp's "Cannot write to closing transport"
            log.debug("the client closed the stream after %d token(s)", gen.usage.completion_tokens)
            return resp  # the caller's gen.aclose() frees the ring
        finally:
            self.api.d.metrics.completion_tokens.inc(gen.usage.completion_tokens - resumed)
        try:
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client closed once it had data: [DONE], before the last empty chunk: done all the same
        return resp


def _resume(v, vocab_size: int) -> dict | None:
    """A follower's RESUME_FIELD: the ids a stream already carried, and its id and time."""
    if v is None:
        return None
    if not isinstance(v, dict) or set(v) != {"tokens", "id", "created"}:
        raise ApiError(400, f"{RESUME_FIELD} must hold tokens, id and created", RESUME_FIELD)
    tokens, rid, created = v["tokens"], v["id"], v["created"]
    if not isinstance(tokens, list) or len(tokens) > MAX_RESUME_TOKENS or not all(type(t) is int and 0 <= t < vocab_size for t in tokens):
        raise ApiError(400, f"{RESUME_FIELD}.tokens must be token ids below {vocab_size}", RESUME_FIELD)
    if not (rid is None or isinstance(rid, str) and len(rid) <= 64) or not (created is None or type(created) is int):
        raise ApiError(400, f"{RESUME_FIELD}.id must be a short string and created an integer", RESUME_FIELD)
    return v


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
