"""Images through a ring of real daemons: a model that sees answers as mlx-vlm's own generate does
in one process, plain and streamed, beside text-only requests in the same micro-batches."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import threading
import time
import urllib.request

import pytest

from devkit.pictures import bomb, data_url, gradient, png

PROMPT = "Describe the image."
TOKENS = 8


# Where mlx-vlm's chat template puts an image: before the prompt's text (Qwen) or after it (Gemma).
IMAGE_FIRST = {"gemma3": False, "qwen2_5_vl": True, "mistral3": True}


@pytest.fixture(scope="module")
def reference(vision_ring):
    """mlx-vlm in one process: its greedy tokens for PROMPT with a picture (None: text alone), up
    to TOKENS or its end-of-sequence token."""
    from mlx_vlm import apply_chat_template, generate, load

    model, processor = load(str(vision_ring.model))

    def tokens(image=None) -> list[int]:
        prompt = apply_chat_template(processor, model.config, PROMPT, num_images=0 if image is None else 1)
        return list(generate(model, processor, prompt, image=[image] if image else None, max_tokens=TOKENS, temperature=0.0).token_ids)

    return tokens


def same(got: list[int], expected: list[int]) -> bool:
    """The ring's tokens (it ignores the end token, to give TOKENS) begin with mlx-vlm's."""
    return len(expected) >= 4 and got[: len(expected)] == expected


def chat(client, image=None, stream=False, family: str = "gemma3") -> list[int]:
    """The ring's greedy token ids for PROMPT (with ``image``), through the official openai client."""
    content: str | list = PROMPT
    if image is not None:
        content = [{"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
        content = content[::-1] if IMAGE_FIRST[family] else content
    answer = client.chat.completions.create(
        model="see", messages=[{"role": "user", "content": content}], max_tokens=TOKENS, temperature=0, logprobs=True,
        stream=stream, extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    chunks = list(answer) if stream else [answer]
    return [int(t.token.removeprefix("token_id:")) for c in chunks for choice in c.choices if choice.logprobs for t in choice.logprobs.content]


def test_a_ring_that_sees_answers_as_mlx_vlm_plain_streamed_and_beside_text(vision_ring, reference):
    client, family = vision_ring.client(), vision_ring.family
    pictures = [gradient(), gradient(turn=1), gradient(48, 80, turn=2)]  # the last not square: Qwen takes it as 3 x 2 tokens
    expected = [reference(p) for p in pictures]
    assert len({tuple(e) for e in expected}) == 3  # each picture its own answer: the test could fail
    assert same(chat(client, pictures[0], family=family), expected[0])
    assert same(chat(client, pictures[1], stream=True, family=family), expected[1])
    # Image and text-only requests at once: their rows share the ring's micro-batches.
    asks = [(pictures[2], False), (None, True), (pictures[0], True), (None, False)]
    with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(lambda a: chat(client, *a, family=family), asks))
    for g, e in zip(got, [expected[2], reference(), expected[0], reference()]):
        assert same(g, e), (g, e)


def test_bad_images_are_refused_saying_which_part_while_every_node_stays_healthy(vision_ring):
    """A web URL, a decompression bomb, 50,000 x 50,000 pixels, a damaged file, a data URL of text,
    100 images: each a 400 naming the part, with every node's /health polled throughout."""
    import openai

    client = vision_ring.client()
    nodes = [n["http"] for n in json.load(urllib.request.urlopen(vision_ring.url + "/cluster/status", timeout=30))["nodes"]]
    assert len(nodes) == 3
    polls, failures, done = [], [], threading.Event()

    def poll() -> None:
        while not done.is_set():
            for node in nodes:
                started = time.monotonic()
                try:
                    with urllib.request.urlopen(f"http://{node}/health", timeout=30) as r:
                        r.read()
                    polls.append(time.monotonic() - started)
                except Exception as e:  # every way a node can fail to answer counts
                    failures.append(f"{node}: {e}")

    def refusal(*parts) -> tuple[str, str]:
        content = [{"type": "text", "text": PROMPT}, *({"type": "image_url", "image_url": {"url": url}} for url in parts)]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="see", messages=[{"role": "user", "content": content}], max_tokens=2)
        return e.value.body["param"], e.value.body["message"]

    def url(raw: bytes, kind: str = "image/png") -> str:
        return f"data:{kind};base64," + base64.b64encode(raw).decode()

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        whole = png(gradient())
        cases = [
            (("http://192.168.1.1/admin.png",), "messages[0].content[1].image_url", "ringd does not fetch images from the web"),
            ((url(bomb(6000, 6000)),), "messages[0].content[1].image_url", "6000 x 6000 pixels; at most 34,000,000"),
            ((url(whole), url(bomb(50_000, 50_000, whole=False))), "messages[0].content[2].image_url", "far over 34,000,000 pixels"),
            ((url(whole[: len(whole) // 2]),), "messages[0].content[1].image_url", "damaged or cut short"),
            ((url(b"hello", "text/plain"),), "messages[0].content[1].image_url", "a data URL of 'text/plain', not an image"),
            ((url(whole),) * 100, "messages", "100 images in one request; at most 16"),
        ]
        for parts, param, said in cases:
            got = refusal(*parts)
            assert got[0] == param and said in got[1], got
        assert same(chat(client, family=vision_ring.family), chat(client, family=vision_ring.family))  # the ring serves on
    finally:
        done.set()
        poller.join(timeout=60)
    assert not failures and len(polls) >= 3, (failures, len(polls))
