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

from devkit.pictures import base64_png, bomb, data_url, gradient, png

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


def chat(client, image=None, stream=False, family: str = "gemma3", model: str = "see") -> list[int]:
    """The ring's greedy token ids for PROMPT (with ``image``), through the official openai client."""
    content: str | list = PROMPT
    if image is not None:
        content = [{"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
        content = content[::-1] if IMAGE_FIRST[family] else content
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=TOKENS, temperature=0, logprobs=True,
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


@pytest.fixture(scope="module")
def reference_text(vision_ring):
    """mlx-vlm in one process, its greedy text for PROMPT with a picture, the picture before the
    text (``first``) or after, in the chat template's prompt: each API places it its own way."""
    from mlx_vlm import generate, load

    model, processor = load(str(vision_ring.model))
    tokenizer = processor.tokenizer

    def text(image, first: bool) -> str:
        parts = [{"type": "image"}, {"type": "text", "text": PROMPT}]
        messages = [{"role": "user", "content": parts if first else parts[::-1]}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = generate(model, processor, prompt, image=[image], max_tokens=TOKENS, temperature=0.0).token_ids
        ends = set(model.config.eos_token_id if isinstance(model.config.eos_token_id, list) else [model.config.eos_token_id])
        return tokenizer.decode([t for t in ids if t not in ends])  # the end token is no text; other special tokens are

    return text


def test_every_api_answers_with_images_as_mlx_vlm_plain_streamed_and_beside_text(vision_ring, reference_text):
    """Anthropic's image blocks, Ollama's images (chat and generate), Responses' input_image: each
    plain and streamed, all at once and beside text-only chats (their rows share micro-batches)."""
    import anthropic
    import ollama

    picture, first = gradient(48, 80, turn=2), IMAGE_FIRST[vision_ring.family]
    b64 = base64_png(picture)
    claude = anthropic.Anthropic(base_url=vision_ring.url, api_key="not-needed", max_retries=0, timeout=120)
    llama = ollama.Client(host=vision_ring.url, timeout=120)
    openai_client = vision_ring.client()
    options = {"temperature": 0, "num_predict": TOKENS}

    def ordered(image: dict, text: dict, image_first: bool) -> list:
        return [image, text] if image_first else [text, image]

    def messages_api(stream: bool) -> str:
        content = ordered({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}, {"type": "text", "text": PROMPT}, first)
        kwargs = {"model": "see", "max_tokens": TOKENS, "extra_body": {"temperature": 0}, "messages": [{"role": "user", "content": content}]}  # the SDK sends sampling as extra fields
        if not stream:
            return "".join(b.text for b in claude.messages.create(**kwargs).content if b.type == "text")
        with claude.messages.stream(**kwargs) as s:
            return "".join(s.text_stream)

    def responses_api(stream: bool) -> str:
        content = ordered({"type": "input_image", "image_url": data_url(picture)}, {"type": "input_text", "text": PROMPT}, first)
        kwargs = {"model": "see", "max_output_tokens": TOKENS, "temperature": 0, "input": [{"role": "user", "content": content}]}
        if not stream:
            return openai_client.responses.create(**kwargs).output_text
        return "".join(e.delta for e in openai_client.responses.create(stream=True, **kwargs) if e.type == "response.output_text.delta")

    def ollama_chat(stream: bool) -> str:
        out = llama.chat(model="see", messages=[{"role": "user", "content": PROMPT, "images": [b64]}], options=options, stream=stream)
        return "".join(c.message.content for c in out) if stream else out.message.content

    def ollama_generate(stream: bool) -> str:
        out = llama.generate(model="see", prompt=PROMPT, images=[b64], options=options, stream=stream)
        return "".join(c.response for c in out) if stream else out.response

    assert "vision" in llama.show("see").capabilities  # Ollama's clients offer images by it
    asks = [(f, s) for f in (messages_api, responses_api, ollama_chat, ollama_generate) for s in (False, True)]
    asks += [(lambda s: chat(openai_client, stream=s, family=vision_ring.family), s) for s in (False, True)]
    with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(lambda a: a[0](a[1]), asks))
    # Ollama puts a message's images before its text, as its own templates do.
    expected = [reference_text(picture, first)] * 4 + [reference_text(picture, True)] * 4
    assert len(set(expected[0])) > 2 and expected[0] != reference_text(gradient(), first)
    assert got[:8] == expected, list(zip(asks, got))


def test_an_image_counts_in_usage_and_a_prefix_is_reused_through_it_only_for_the_same_picture(vision_ring, reference):
    client, family = vision_ring.client(), vision_ring.family

    def ask(image) -> tuple[list[int], object]:
        parts = [{"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
        r = client.chat.completions.create(
            model="see", messages=[{"role": "user", "content": parts[::-1] if IMAGE_FIRST[family] else parts}], max_tokens=TOKENS,
            temperature=0, logprobs=True, extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        return [int(t.token.removeprefix("token_id:")) for t in r.choices[0].logprobs.content], r.usage

    first, usage = ask(gradient())
    assert usage.prompt_tokens_details.image_tokens == {"gemma3": 4, "qwen2_5_vl": 4, "mistral3": 4}[family]
    again, reused = ask(gradient())
    other, fresh = ask(gradient(turn=1))
    assert again == first and other != first
    if family == "gemma3":  # its sliding window cannot be cut back to a prefix once it has wrapped: nothing is reused
        assert reused.prompt_tokens_details.cached_tokens == 0
        return
    # The same picture: the whole prompt but its last token comes from the cache; another picture:
    # at most the text before it (nothing, where the image comes first).
    assert reused.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    assert fresh.prompt_tokens_details.cached_tokens < 10


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


def test_a_gguf_and_its_projector_file_answer_through_a_ring_as_mlx_vlm_on_the_checkpoint(vision_gguf_ring, tiny_vision_model):
    """llama.cpp's layout (a text GGUF, an mmproj file beside it): the leader's processor and the first
    stage's vision tower come from the projector file, and the answers are mlx-vlm's on the checkpoint
    the two files were converted from."""
    from mlx_vlm import apply_chat_template, generate, load

    family = vision_gguf_ring.family
    model, processor = load(str(tiny_vision_model(family)))
    prompt = apply_chat_template(processor, model.config, PROMPT, num_images=1)
    client = vision_gguf_ring.client()
    for picture, stream in ((gradient(), False), (gradient(48, 80, turn=1), True)):
        expected = list(generate(model, processor, prompt, image=[picture], max_tokens=TOKENS, temperature=0.0).token_ids)
        got = chat(client, picture, stream, family, model="see-gguf")
        assert same(got, expected), (got, expected)


def test_speculative_decoding_with_an_image_answers_as_mlx_vlm(tiny_vision_model):
    """A draft model (the checkpoint's own text path, on the leader, which sees no image) proposes;
    the ring, which sees it, keeps what it would have sampled: the answer is mlx-vlm's."""
    from mlx_vlm import apply_chat_template, generate, load

    from devkit.rings import Ring

    path = tiny_vision_model("mistral3")  # no sliding window: its proposals can be cut back
    model, processor = load(str(path))
    prompt = apply_chat_template(processor, model.config, PROMPT, num_images=1)
    picture = gradient(turn=3)
    expected = list(generate(model, processor, prompt, image=[picture], max_tokens=24, temperature=0.0).token_ids)
    ring = Ring(path, 2, model_id="see", extra=["--draft-model", str(path)])
    try:
        content = [{"type": "image_url", "image_url": {"url": data_url(picture)}}, {"type": "text", "text": PROMPT}]
        # No logprobs: the ring sends none for the proposals it keeps, so a request that asks for them is not speculated.
        answer = ring.client().chat.completions.create(
            model="see", messages=[{"role": "user", "content": content}], max_tokens=24, temperature=0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        ends = {model.config.eos_token_id} if isinstance(model.config.eos_token_id, int) else set(model.config.eos_token_id)
        want = processor.tokenizer.decode([t for t in expected if t not in ends])
        assert len(expected) >= 8 and answer.choices[0].message.content.startswith(want), (answer.choices[0].message.content, want)
        # The last stage counts the proposals it verified.
        nodes = [n["http"] for n in json.load(urllib.request.urlopen(ring.url + "/cluster/status", timeout=30))["nodes"]]
        metrics = "".join(urllib.request.urlopen(f"http://{n}/metrics", timeout=30).read().decode() for n in nodes)
        verified = [line for line in metrics.splitlines() if line.startswith("ringd_draft_tokens_total") and not line.endswith(" 0.0")]
        assert verified, "no proposal was verified: the draft did not run"
    finally:
        ring.stop()
