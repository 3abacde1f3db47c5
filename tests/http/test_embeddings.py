"""ringd/http/embeddings.py: OpenAI's /v1/embeddings and Ollama's /api/embed and /api/embeddings.

The parsers' refusals in process; then the official openai and ollama clients against a
3-node ring of the tiny SmolLM2 (the ring test_openai_api and test_ollama_api share),
each vector compared with mlx-lm's in one process: the decoder's final hidden states over
the input, mean-pooled, normalized (the engine's own test, tests/leader/test_engine.py,
shows every pooling through one stage and three).
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import ollama
import openai
import pytest

from ringd.http.embeddings import MAX_INPUTS, OllamaEmbed, OpenAIEmbeddings
from ringd.http.errors import ApiError

MODEL_ID = "tiny-smollm2"
TEXTS = ["The ring passes hidden states from Mac to Mac.", "Paris is the capital of France.", "rings " * 40]

# What a parser reads of the model a request named (http/node.py's Served): its name and sizes.
NODE = SimpleNamespace(model_id="m", info=SimpleNamespace(hidden_size=64, vocab_size=100))


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": "hi"}, 400, "model"),
        ({"model": "other", "input": "hi"}, 404, "model"),
        ({"model": "m"}, 400, "input"),
        ({"model": "m", "input": []}, 400, "input"),
        ({"model": "m", "input": ["hi", 3]}, 400, "input"),
        ({"model": "m", "input": [[1, 2], []]}, 400, "input"),
        ({"model": "m", "input": [1, 100]}, 400, "input[0]"),
        ({"model": "m", "input": ["x"] * (MAX_INPUTS + 1)}, 400, "input"),
        ({"model": "m", "input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"model": "m", "input": "hi", "dimensions": 32}, 400, "dimensions"),
        ({"model": "m", "input": "hi", "dimensions": "64"}, 400, "dimensions"),
        ({"model": "m", "input": "hi", "dimensions": True}, 400, "dimensions"),
        ({"model": "m", "input": "hi", "user": 7}, 400, "user"),
    ],
)
def test_openai_refuses_what_it_cannot_embed_by_field(body, status, param):
    with pytest.raises(ApiError) as e:
        OpenAIEmbeddings().parse(body, NODE)
    assert (e.value.status, e.value.param) == (status, param), e.value.message


def test_openai_takes_strings_and_token_ids_and_its_own_width():
    api = OpenAIEmbeddings()
    assert api.parse({"model": "m", "input": "hi"}, NODE).inputs == ["hi"]
    assert api.parse({"model": "m", "input": [5, 6]}, NODE).inputs == [[5, 6]]
    req = api.parse({"model": "m", "input": [[5], [6, 7]], "dimensions": 64, "encoding_format": "base64"}, NODE)
    assert req.inputs == [[5], [6, 7]] and req.encoding == "base64" and req.normalize
    # null is as good as left out, for either field (OpenAI's SDKs send both as null when not set).
    assert api.parse({"model": "m", "input": "hi", "dimensions": None, "encoding_format": None}, NODE).encoding == "float"
    with pytest.raises(ApiError, match="whole number") as e:
        api.parse({"model": "m", "input": "hi", "dimensions": "64"}, NODE)
    assert "cannot be shortened" not in e.value.message


def test_ollama_names_and_inputs_as_ollama_takes_them():
    embed, legacy = OllamaEmbed(), OllamaEmbed(legacy=True)
    req = embed.parse({"model": "m:latest", "input": ["a", "b"]}, NODE)
    assert req.inputs == ["a", "b"] and req.truncate and req.normalize and req.model == "m:latest"
    assert not embed.parse({"model": "m", "input": "a", "truncate": False}, NODE).truncate
    old = legacy.parse({"model": "m", "prompt": "a"}, NODE)
    assert old.inputs == ["a"] and not old.normalize
    assert legacy.parse({"model": "m", "prompt": ""}, NODE).inputs == []  # Ollama answers an empty embedding
    for body in ({"model": "n", "input": "a"}, {"model": "m", "input": [1]}, {"model": "m", "input": "a", "truncate": "no"}):
        with pytest.raises(ApiError):
            embed.parse(body, NODE)


# --- a ring of the tiny SmolLM2 ----------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tiny_smollm2):
    """mlx-lm in one process: each text's mean-pooled final hidden states, as tokenized by the server."""
    from mlx_lm import load

    model, tokenizer = load(str(tiny_smollm2))

    def embed(text: str) -> tuple[np.ndarray, int]:
        tokens = tokenizer.encode(text)
        h = model.model(mx.array(tokens)[None])[0].astype(mx.float32)
        return np.array(h.mean(axis=0)), len(tokens)

    return embed


def unit(v) -> np.ndarray:
    v = np.asarray(v, dtype=np.float32)
    return v / np.linalg.norm(v)


def test_openais_client_gets_mlx_lms_vectors_as_floats_and_base64(tiny_smollm2_ring, reference):
    client = tiny_smollm2_ring.client()
    want = [reference(t) for t in TEXTS]
    got = client.embeddings.create(model=MODEL_ID, input=TEXTS)  # the SDK asks for base64 unless told
    assert [d.index for d in got.data] == [0, 1, 2] and got.model == MODEL_ID
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(n for _, n in want)
    for d, (vector, _) in zip(got.data, want):
        assert np.linalg.norm(d.embedding) == pytest.approx(1, abs=1e-5)
        assert np.allclose(d.embedding, unit(vector), atol=1e-4)
    floats = client.embeddings.create(model=MODEL_ID, input=TEXTS[1], encoding_format="float")
    assert np.allclose(floats.data[0].embedding, got.data[1].embedding, atol=1e-6)
    with pytest.raises(openai.BadRequestError, match="cannot be shortened"):
        client.embeddings.create(model=MODEL_ID, input="hi", dimensions=8)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="hi")


def test_ollamas_client_gets_them_normalized_and_the_older_route_as_they_are(tiny_smollm2_ring, reference):
    client = ollama.Client(host=tiny_smollm2_ring.url, timeout=120)
    got = client.embed(model=MODEL_ID + ":latest", input=TEXTS[:2])
    assert got.model == MODEL_ID + ":latest" and got.prompt_eval_count == sum(reference(t)[1] for t in TEXTS[:2])
    for vector, text in zip(got.embeddings, TEXTS):
        assert np.allclose(vector, unit(reference(text)[0]), atol=1e-4)
    raw = client.embeddings(model=MODEL_ID, prompt=TEXTS[0]).embedding
    assert np.allclose(raw, reference(TEXTS[0])[0], atol=1e-3, rtol=1e-4)  # not normalized, as Ollama's
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="nope", input="hi")
    assert e.value.status_code == 404
