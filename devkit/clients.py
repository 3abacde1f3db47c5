"""Requests as a client sends them to a node's API: plain posts, and streamed chat completions."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request


def post(url: str, body: dict, timeout: float = 30) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError as e:
        return 0, {"error": str(e)}


def chat(url: str, text: str = "Tell me about rings.", max_tokens: int = 20, timeout: float = 30) -> tuple[int, dict]:
    return post(url + "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0}, timeout)


def stream_text(base_url: str, messages: list, max_tokens: int, on_chunk=None, model: str = "tiny", **extra) -> tuple[str, str | None]:
    """A greedy streamed chat completion through the real openai client: (text, finish_reason).

    ``on_chunk(i)`` runs after the i-th chunk arrives (to kill a node mid-stream, say);
    ``extra``: more fields of the request (response_format, ...).
    """
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="not-needed", max_retries=0, timeout=120)
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True, **extra)
    parts, finish = [], None
    for i, chunk in enumerate(stream):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if on_chunk:
            on_chunk(i)
    return "".join(parts), finish


class Stream:
    """A streamed chat completion read in a thread of its own, as a client would, recording how it ended.

    ``text`` is what the client saw; it ended cleanly when ``done`` (``data:
    [DONE]`` arrived, after the last token or after an OpenAI error event, which
    ``error`` holds) and ``broken`` (a connection or chunking error, a stall
    past ``read_timeout``) is None.
    """

    def __init__(self, url: str, messages: list, max_tokens: int, read_timeout: float = 90.0, headers: dict | None = None):
        import http.client
        import json
        import threading
        from urllib.parse import urlsplit

        self.text, self.chunks, self.finish, self.error, self.done, self.broken, self.status = "", 0, None, None, False, None, None
        self.ended_at: float | None = None
        self._started = threading.Event()
        u = urlsplit(url)
        body = json.dumps({"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True})

        def run():
            try:
                conn = http.client.HTTPConnection(u.hostname, u.port, timeout=read_timeout)
                conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json", **(headers or {})})
                resp = conn.getresponse()
                self.status = resp.status
                if resp.status != 200:
                    self.error = json.loads(resp.read()).get("error")
                    self.done = True
                    return
                while True:
                    line = resp.readline()
                    if not line:
                        break
                    line = line.strip()
                    if not line.startswith(b"data: "):
                        continue
                    if line == b"data: [DONE]":
                        self.done = True
                        continue
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        self.error = obj["error"]
                        continue
                    for choice in obj.get("choices", []):
                        self.text += (choice.get("delta") or {}).get("content") or ""
                        self.finish = choice.get("finish_reason") or self.finish
                    self.chunks += 1
                    self._started.set()
                if not self.done:
                    self.broken = "the stream ended without data: [DONE]"
            except Exception as e:  # what a client would see: a broken stream
                self.broken = f"{type(e).__name__}: {e}"
            finally:
                self.ended_at = time.monotonic()
                self._started.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def wait_started(self, chunks: int = 3, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.chunks < chunks and self.ended_at is None:
            assert time.monotonic() < deadline, "the stream did not start"
            time.sleep(0.02)

    def join(self, timeout: float) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()

    @property
    def clean(self) -> bool:
        return self.done and self.broken is None

    def __repr__(self) -> str:
        return f"<Stream chunks={self.chunks} finish={self.finish} done={self.done} error={self.error} broken={self.broken}>"
