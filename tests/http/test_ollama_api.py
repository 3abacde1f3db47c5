"""Ollama's API through the official ``ollama`` client, against the same ring as OpenAI's.

A ring of three of the tiny llama that speaks through SmolLM2's tokenizer and
template (``tiny_smollm2``, tests/kit/tinysmol.py, the ring test_openai_api.py
shares): Ollama's chat and generate give the greedy answer OpenAI's chat
completions and completions give, plain and streamed (NDJSON); options map onto
the same sampling (a seeded sample too); a tool's result, the generic way
(``render.py``), reaches the prompt; formats validate; followers forward what
generates and answer the rest. The real SmolLM2's GGUF file (the ring
test_smollm2.py shares) is listed, shown and reported as loaded with its
metadata. The tiny qwen3 trained to think and call (``think_model``) shows
reasoning and a call that comes back parsed, in Ollama's shape.

The first part needs no ring: the body -> Request translation, property-tested
(any JSON body is a Request or a 4xx ApiError, never anything else), and images
(a real, tiny PNG) as the request's images and image parts before their
message's text. On the ring, an image to this model, which has no vision tower,
is an Ollama 400.
"""

from __future__ import annotations

import base64
import io
import json
import string

import httpx
import jsonschema
import ollama
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from ringd.http.errors import ApiError
from ringd.http.ollama_api import describe, error_body, parameter_size, parse
from ringd.ring.media import MAX_IMAGES

MODEL_ID = "tiny-smollm2"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather of a city", "parameters": WEATHER_SCHEMA}}
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]
# A call in Ollama's form (no id) and its result naming its tool.
CALLED = [
    *PARIS,
    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "18 C and sunny", "tool_name": "get_weather"},
]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"type": "string", "enum": ["French", "English", "German"]}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
DESCRIBE = [{"role": "user", "content": "Describe a French person as JSON with name, age and languages."}]


def png_base64() -> str:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(out, "PNG")
    return base64.b64encode(out.getvalue()).decode()


PNG = png_base64()


# --- the translation, without a ring ----------------------------------------------------


def chat_body(**kw) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


def parsed(body: dict, chat: bool = True, thinks: bool = False):
    return parse(body, chat, "m", 8192, thinks)


def refused(body: dict, chat: bool = True, thinks: bool = False) -> str:
    with pytest.raises(ApiError) as e:
        parsed(body, chat, thinks)
    assert e.value.status == 400
    return e.value.message


def test_options_become_the_sampling_every_api_uses():
    p = parsed(
        chat_body(options={"temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.1, "seed": 7, "repeat_penalty": 1.1,
                           "presence_penalty": 0.5, "frequency_penalty": 0.25, "num_predict": 12, "stop": ["\n"], "num_ctx": 4096,
                           "num_gpu": 99, "repeat_last_n": 64, "unknown": "ignored"})
    )  # fmt: skip
    r, s = p.request, p.request.params
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.5, 0.9, 40, 0.1, 7)
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.1, 0.5, 0.25)
    assert r.max_tokens == 12 and r.stop == ["\n"] and p.stream is True  # Ollama streams unless told not to
    for until_the_end in (-1, -2, 0):
        assert parsed(chat_body(options={"num_predict": until_the_end})).request.max_tokens is None
    assert parsed(chat_body(options={"seed": -1})).request.params.seed is None  # Ollama's random seed
    assert parsed(chat_body(options={"num_predict": 5.0, "temperature": 1})).request.max_tokens == 5  # Go reads numbers as floats


@pytest.mark.parametrize(
    "options, says",
    [
        ({"temperature": "hot"}, 'option "temperature" must be of type float'),
        ({"num_predict": 1.5}, 'option "num_predict" must be of type integer'),
        ({"use_mmap": 1}, 'option "use_mmap" must be of type boolean'),
        ({"stop": [1]}, 'option "stop"'),
        ({"temperature": 5}, "options.temperature must be between 0 and 2"),
        ({"repeat_penalty": 50}, "options.repeat_penalty must be between 0 and 10"),
        ({"num_ctx": 8193}, "above the model's context of 8192"),
        ({"num_predict": -3}, "options.num_predict"),
        ({"mirostat": 2}, "mirostat"),
        ("fast", "options must be an object"),
    ],
)
def test_bad_options_are_400s_that_name_them(options, says):
    assert says in refused(chat_body(options=options))


def test_formats_and_think():
    assert parsed(chat_body(format="json")).request.response_format.kind == "json_object"
    fmt = parsed(chat_body(format=PERSON)).request.response_format
    assert fmt.kind == "json_schema" and fmt.schema == PERSON
    assert parsed(chat_body(format="")).request.response_format is None
    assert "format" in refused(chat_body(format="xml"))
    assert "format and tools" in refused(chat_body(format="json", tools=[WEATHER]))
    assert parsed(chat_body(think=False)).request.template_kwargs == {"enable_thinking": False}
    assert parsed(chat_body(think=True), thinks=True).request.template_kwargs == {"enable_thinking": True}
    assert parsed(chat_body(think="high"), thinks=True).request.template_kwargs == {"enable_thinking": True, "reasoning_effort": "high"}
    assert refused(chat_body(think=True)) == '"m" does not support thinking'  # as Ollama says it
    assert "think must be" in refused(chat_body(think="very"), thinks=True)


def test_ollamas_calls_and_results_get_the_ids_templates_take():
    messages = parsed(chat_body(messages=CALLED)).request.messages
    call = messages[1]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}} and call["id"]
    assert messages[2] == {"role": "tool", "content": "18 C and sunny", "tool_call_id": call["id"], "name": "get_weather"}
    thinking = parsed(chat_body(messages=[*FRANCE, {"role": "assistant", "content": "Paris.", "thinking": "Easy."}])).request.messages
    assert thinking[-1]["reasoning_content"] == "Easy."


def test_generate_is_a_chat_of_one_user_message_unless_raw():
    r = parsed({"model": "m", "prompt": "Hi", "system": "Be brief."}, chat=False).request
    assert r.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}] and r.prompt is None
    r = parsed({"model": "m", "prompt": "Hi", "raw": True}, chat=False).request
    assert r.prompt == "Hi" and r.messages is None
    assert parsed({"model": "m:latest", "prompt": ""}, chat=False).request is None  # the load call, for m:latest too
    # NAME:latest is the served NAME to the engine, and stays NAME:latest in the answer.
    tagged = parsed({"model": "m:latest", "prompt": "Hi"}, chat=False)
    assert tagged.model == "m:latest" and tagged.request.model == "m"
    assert parsed({"model": "m:7b", "prompt": "Hi"}, chat=False).request.model == "m:7b"  # another tag: not served
    assert parsed({"model": "m"}).request is None


@pytest.mark.parametrize(
    "body, says",
    [
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "context": [1, 2, 3]}, "/api/chat"),
        ({"prompt": "x", "raw": True, "images": [PNG]}, "a raw prompt goes to the model as it is and cannot carry them"),
        ({"prompt": "x", "images": [""]}, "images[0]: the image is empty"),
        ({"prompt": "x", "images": [PNG, 3]}, "images[1]: an image is base64 text"),
        ({"prompt": "x", "images": PNG}, "images must be a list"),
        ({"prompt": "x", "images": [PNG] * (MAX_IMAGES + 1)}, f"{MAX_IMAGES + 1} images in one request; at most {MAX_IMAGES}"),
        ({"prompt": "x", "template": "{{ .Prompt }}"}, "template"),
        ({"prompt": "x", "raw": True, "system": "s"}, "raw"),
        ({"prompt": 3}, "prompt must be a string"),
        ({"prompt": "x", "stream": "yes"}, "stream must be a boolean"),
    ],
)
def test_what_generate_cannot_do_is_refused(body, says):
    assert says in refused({"model": "m", **body}, chat=False)


def test_images_are_parts_before_their_messages_text():
    garbage = "not base64, but a decoder's to refuse, not the parser's"
    body = chat_body(
        messages=[
            {"role": "system", "content": "Be brief.", "images": None},
            {"role": "user", "content": "What differs?", "images": [PNG, garbage]},
            {"role": "assistant", "content": "The colour.", "images": []},
            {"role": "user", "content": "", "images": [PNG]},
            {"role": "user", "content": "And now?", "images": None},
        ]
    )
    r = parsed(body).request
    assert [p.where for p in r.images] == ["messages[1].images[0]", "messages[1].images[1]", "messages[3].images[0]"]
    assert [p.data for p in r.images] == [PNG, garbage, PNG]
    assert r.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "What differs?"}]},
        {"role": "assistant", "content": "The colour."},
        {"role": "user", "content": [{"type": "image"}]},
        {"role": "user", "content": "And now?"},
    ]
    # Generate's images go in the user message its prompt makes.
    r = parsed({"model": "m", "prompt": "What is it?", "system": "Be brief.", "images": [PNG]}, chat=False).request
    assert [p.where for p in r.images] == ["images[0]"] and r.prompt is None
    assert r.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    for none in (None, []):
        r = parsed({"model": "m", "prompt": "Hi", "images": none}, chat=False).request
        assert r.images == [] and r.messages == [{"role": "user", "content": "Hi"}]
        assert parsed({"model": "m", "prompt": "Hi", "raw": True, "images": none}, chat=False).request.prompt == "Hi"


def test_chat_refuses_strange_images_and_messages():
    assert "messages[1].images[0]: the image is empty" in refused(chat_body(messages=[{"role": "user", "content": "x"}, {"role": "user", "content": "x", "images": [""]}]))
    assert "messages[0].images must be a list" in refused(chat_body(messages=[{"role": "user", "content": "x", "images": {"a": 1}}]))
    assert "images go in user messages" in refused(chat_body(messages=[{"role": "assistant", "content": "x", "images": [PNG]}]))
    many = [{"role": "user", "content": "x", "images": [PNG] * (MAX_IMAGES // 2 + 1)}] * 2
    assert f"{2 * (MAX_IMAGES // 2 + 1)} images in one request; at most {MAX_IMAGES}" in refused(chat_body(messages=many))
    assert "role" in refused(chat_body(messages=[{"role": "robot", "content": "x"}]))
    assert "content must be a string" in refused(chat_body(messages=[{"role": "user", "content": ["x"]}]))
    assert "model is required" == refused({"messages": FRANCE})


def test_the_error_shape_is_ollamas():
    assert error_body(ApiError(404, "model 'x' not found")) == {"error": "model 'x' not found"}


def test_the_model_is_described_as_ollama_lists_models(smollm2_gguf):
    from ringd.models.source import model_info

    d = describe(model_info(str(smollm2_gguf)))
    assert d["details"] == {
        "parent_model": "", "format": "gguf", "family": "llama", "families": ["llama"],
        "parameter_size": "134.52M", "quantization_level": "Q4_1",
    }  # fmt: skip  # what `ollama list` says of smollm2:135m-instruct-q4_1
    assert d["model_info"]["llama.context_length"] == 8192 and d["size"] > 90_000_000
    assert parameter_size(8_030_261_248) == "8.0B"


def test_a_gguf_s_quant_has_one_answer_its_file_type_in_the_model_list_and_in_ollama_s_description(tiny_model, tmp_path):
    """A Q8_0 file most of whose matrices were written Q4_0 (as llama.cpp's mixes keep some
    tensors apart): the model list and /api/tags' description both say Q8_0, its file type."""
    from devkit.ggufmake import write_gguf
    from ringd.models.catalogue import Catalogue
    from ringd.models.source import model_info

    model = tiny_model(arch="llama", layers=2)
    types = {f"blk.{i}.{t}.weight": "q4_0" for i in range(2) for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")}
    path = write_gguf(model, tmp_path / "mixed.gguf", qtype="q8_0", types=types)
    (entry,) = Catalogue(tmp_path, hf_cache=tmp_path / "no-hf", ollama_store=tmp_path / "no-ollama").scan().entries
    assert entry.facts.quant == "Q8_0"
    assert describe(model_info(str(path)))["details"]["quantization_level"] == "Q8_0"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12,
)
KEYS = ["model", "messages", "prompt", "system", "raw", "format", "options", "think", "stream", "tools", "suffix", "images",
        "context", "template", "keep_alive", "logprobs", "top_logprobs"]  # fmt: skip
OPTION_KEYS = ["temperature", "num_predict", "top_p", "top_k", "min_p", "seed", "stop", "repeat_penalty", "num_ctx", "mirostat", "use_mmap"]
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "x"]) | json_values},
    optional={
        "content": st.text(alphabet=string.printable + "\ud800é", max_size=8) | json_values,
        "thinking": json_values,
        "images": json_values,
        "tool_name": json_values,
        "tool_calls": st.lists(st.fixed_dictionaries({"function": st.fixed_dictionaries({"name": st.text(max_size=4) | json_values}, optional={"arguments": json_values})}) | json_values, max_size=2),
    },
)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "generate"])
@given(
    body=st.fixed_dictionaries(
        {"model": st.sampled_from(["m", "m:latest", "other", ""]) | json_values},
        optional={
            **{k: json_values for k in KEYS if k != "model"},
            "messages": st.lists(message, max_size=4),
            "prompt": st.text(max_size=8),
            "format": st.sampled_from(["json", "", {"type": "object"}]) | json_values,
            "think": st.sampled_from([True, False, "low", "x"]) | json_values,
            "options": st.dictionaries(st.sampled_from(OPTION_KEYS), json_values, max_size=4) | json_values,
        },
    )
    | st.dictionaries(st.sampled_from(KEYS), json_values, max_size=6)
)
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
def test_any_json_body_is_a_request_or_a_4xx(chat, body):
    try:
        p = parse(body, chat, "m", 8192, thinks=True)
    except ApiError as e:
        assert 400 <= e.status < 500 and e.message
        json.dumps(error_body(e))
        return
    if p.request is not None:
        assert p.request.prompt_chars(1 << 30) >= 0
        for m in p.request.messages or ():
            parts = [m["content"]] if isinstance(m["content"], str) else m["content"]
            for part in parts:  # valid Unicode only reaches the tokenizer
                (part if isinstance(part, str) else part.get("text", "")).encode("utf-8")


# --- through the official client, on the ring ---------------------------------------------


@pytest.fixture(scope="module")
def client(tiny_smollm2_ring):
    return ollama.Client(host=tiny_smollm2_ring.url, timeout=120)


def openai_answer(openai_client, messages, **kw) -> str:
    return openai_client.chat.completions.create(model=MODEL_ID, messages=messages, temperature=0, **kw).choices[0].message.content


GREEDY = {"temperature": 0}


def test_chat_gives_openais_greedy_answer_plain_and_streamed(client, tiny_smollm2_client):
    want = openai_answer(tiny_smollm2_client, FRANCE)
    r = client.chat(model=MODEL_ID, messages=FRANCE, options=GREEDY)
    assert r.message.role == "assistant" and r.message.content == want and r.message.thinking is None
    assert r.done and r.done_reason == "stop" and r.model == MODEL_ID and r.created_at.endswith("Z")
    assert r.prompt_eval_count > 0 and r.eval_count > 0 and r.total_duration >= r.eval_duration > 0
    chunks = list(client.chat(model=MODEL_ID, messages=FRANCE, options=GREEDY, stream=True))
    assert "".join(c.message.content for c in chunks) == want
    assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True]
    last = chunks[-1]
    assert last.done_reason == "stop" and last.eval_count == r.eval_count and last.prompt_eval_count == r.prompt_eval_count
    # As Ollama lists it, with its tag; and answered under the name it was asked by.
    tagged = f"{MODEL_ID}:latest"
    assert client.list().models[0].model == tagged  # the loaded model first; then what else the machine holds
    r = client.chat(model=tagged, messages=FRANCE, options=GREEDY)
    assert r.model == tagged and r.message.content == want
    assert [c.model for c in client.chat(model=tagged, messages=FRANCE, options=GREEDY, stream=True)][-1] == tagged


def test_generate_is_chat_with_one_user_message_and_raw_is_a_completion(client, tiny_smollm2_client):
    question = FRANCE[0]["content"]
    chat = client.chat(model=MODEL_ID, messages=FRANCE, options=GREEDY).message.content
    g = client.generate(model=MODEL_ID, prompt=question, options=GREEDY)
    assert g.response == chat and g.done_reason == "stop" and g.context is None
    assert "".join(c.response for c in client.generate(model=MODEL_ID, prompt=question, options=GREEDY, stream=True)) == chat
    raw = client.generate(model=MODEL_ID, prompt="The capital of France is", raw=True, options={**GREEDY, "num_predict": 12})
    want = tiny_smollm2_client.completions.create(model=MODEL_ID, prompt="The capital of France is", temperature=0, max_tokens=12).choices[0].text
    assert raw.response == want and raw.eval_count == 12


def test_the_server_streams_ndjson_unless_told_not_to(tiny_smollm2_ring):
    with httpx.stream("POST", tiny_smollm2_ring.url + "/api/chat", json={"model": MODEL_ID, "messages": FRANCE, "options": {**GREEDY, "num_predict": 4}}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert len(lines) == 5 and lines[-1]["done"] is True and lines[-1]["eval_count"] == 4
    assert all(line["message"]["role"] == "assistant" for line in lines)


def test_num_predict_ends_with_length(client):
    r = client.chat(model=MODEL_ID, messages=FRANCE, options={**GREEDY, "num_predict": 3})
    assert r.done_reason == "length" and r.eval_count == 3
    chunks = list(client.generate(model=MODEL_ID, prompt="Count to ten.", options={**GREEDY, "num_predict": 5}, stream=True))
    assert chunks[-1].done_reason == "length" and chunks[-1].eval_count == 5


def test_stop_ends_the_answer_before_the_stop_string(client, tiny_smollm2_client):
    whole = openai_answer(tiny_smollm2_client, FRANCE)
    stop = whole[20:23]  # a piece of what it says when nothing stops it
    want = openai_answer(tiny_smollm2_client, FRANCE, stop=[stop])
    r = client.chat(model=MODEL_ID, messages=FRANCE, options={**GREEDY, "stop": [stop]})
    assert r.message.content == want == whole[: whole.index(stop)] and r.done_reason == "stop"


def test_a_seed_gives_the_same_sample_as_openais(client, tiny_smollm2_client):
    opts = {"temperature": 0.8, "seed": 1234, "num_predict": 24}
    a = client.chat(model=MODEL_ID, messages=FRANCE, options=opts).message.content
    b = client.chat(model=MODEL_ID, messages=FRANCE, options=opts).message.content
    want = tiny_smollm2_client.chat.completions.create(model=MODEL_ID, messages=FRANCE, temperature=0.8, seed=1234, max_tokens=24).choices[0].message.content
    assert a == b == want


def test_num_ctx_above_the_context_is_a_400(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL_ID, messages=FRANCE, options={"num_ctx": 1 << 20})
    assert e.value.status_code == 400 and "8192" in e.value.error
    assert client.chat(model=MODEL_ID, messages=FRANCE, options={**GREEDY, "num_ctx": 2048, "num_predict": 2}).eval_count == 2


def test_a_tool_result_reaches_the_prompt(client):
    """The generic way (SmolLM2's template knows no tools): a result naming its tool is rendered,
    and the answer is words (greedy, this one ends its turn), not another call."""
    r = client.chat(model=MODEL_ID, messages=CALLED, tools=[WEATHER], options={**GREEDY, "num_predict": 60})
    assert r.message.content and not r.message.tool_calls and r.done_reason == "stop"
    other = [*CALLED[:2], {**CALLED[2], "content": "3 C and snowing"}]
    assert client.chat(model=MODEL_ID, messages=other, tools=[WEATHER], options={**GREEDY, "num_predict": 60}).message.content != r.message.content


def test_without_an_example_the_model_may_answer_in_words_well_formed_either_way(client):
    """Ollama has no tool_choice: the model chooses, and greedy, this one answers in words (ending
    them or running to num_predict: the tiny model's text)."""
    r = client.chat(model=MODEL_ID, messages=[{"role": "user", "content": "What is the weather in Paris right now?"}], tools=[WEATHER], options={**GREEDY, "num_predict": 60})
    assert not r.message.tool_calls and r.message.content and not r.message.content.startswith("{") and r.done_reason in ("stop", "length"), r


def test_format_json_parses_and_a_schema_validates(client):
    r = client.chat(model=MODEL_ID, messages=[{"role": "user", "content": "Give the capital of France as JSON with the key capital."}], format="json", options=GREEDY)
    assert r.done_reason == "stop" and isinstance(json.loads(r.message.content), dict)
    r = client.chat(model=MODEL_ID, messages=DESCRIBE, format=PERSON, options={**GREEDY, "num_predict": 120})
    jsonschema.validate(json.loads(r.message.content), PERSON)
    g = client.generate(model=MODEL_ID, prompt=DESCRIBE[0]["content"], format=PERSON, options={"temperature": 0.8, "seed": 3, "num_predict": 160})
    jsonschema.validate(json.loads(g.response), PERSON)


def test_logprobs(client):
    r = client.chat(model=MODEL_ID, messages=FRANCE, options={**GREEDY, "num_predict": 4}, logprobs=True, top_logprobs=2)
    assert len(r.logprobs) == 4 and "".join(lp.token for lp in r.logprobs) == r.message.content
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob >= lp.logprob - 1e-4 for lp in r.logprobs)


def test_the_load_call_loads_without_generating(client):
    r = client.generate(model=MODEL_ID)
    assert r.done and r.done_reason == "load" and r.response == "" and not r.eval_count
    assert client.chat(model=MODEL_ID, messages=[]).done_reason == "load"


def test_the_model_is_listed_shown_and_loaded(smollm2_ring):
    """What Ollama's clients read of a GGUF file: the real SmolLM2's, on the ring test_smollm2.py shares."""
    ring = smollm2_ring
    client = ollama.Client(host=ring.url, timeout=120)
    MODEL_ID = "smollm2"  # noqa: N806: this ring's
    m = client.list().models[0]  # the loaded model first; then what else the machine holds
    assert m.model == f"{MODEL_ID}:latest" and m.size > 90_000_000 and m.digest and m.details.format == "gguf"
    assert m.details.family == "llama" and m.details.parameter_size == "134.52M" and m.details.quantization_level == "Q4_1"
    s = client.show(MODEL_ID)
    assert s.capabilities == ["completion", "tools"]  # no thinking: SmolLM2's template has none
    assert s.modelinfo["general.architecture"] == "llama" and s.modelinfo["llama.context_length"] == 8192
    assert "<|im_start|>" in s.template and s.details.quantization_level == "Q4_1"
    assert client.show(f"{MODEL_ID}:latest").details == s.details
    with pytest.raises(ollama.ResponseError) as e:
        client.show("llama3")
    assert e.value.status_code == 404
    [p] = client.ps().models
    assert p.model == f"{MODEL_ID}:latest" and p.size == m.size and p.digest == m.digest and p.expires_at.year > 3000
    r = httpx.get(ring.url + "/api/version")
    assert r.status_code == 200 and tuple(map(int, r.json()["version"].split("."))) >= (0, 5, 0)
    assert r.headers["X-Ringd-Version"]


def follower_urls(ring) -> list[str]:
    status = httpx.get(ring.url + "/cluster/status").json()
    return [f"http://{n['http']}" for n in status["nodes"] if n["node"] != status["leader"]]


def test_a_follower_forwards_what_generates_and_answers_the_rest(tiny_smollm2_ring, client):
    want = client.chat(model=MODEL_ID, messages=FRANCE, options=GREEDY).message.content
    url = follower_urls(tiny_smollm2_ring)[0]
    via = ollama.Client(host=url, timeout=120)
    assert via.chat(model=MODEL_ID, messages=FRANCE, options=GREEDY).message.content == want
    chunks = list(via.chat(model=MODEL_ID, messages=FRANCE, options=GREEDY, stream=True))
    assert "".join(c.message.content for c in chunks) == want and chunks[-1].done
    assert via.list().models[0].model == f"{MODEL_ID}:latest"
    with pytest.raises(ollama.ResponseError) as e:
        via.chat(model="nope", messages=FRANCE)
    assert e.value.status_code == 404 and e.value.error.startswith("model 'nope'")


@pytest.mark.parametrize(
    "body, status",
    [
        (b"{not json", 400),
        (json.dumps({"messages": FRANCE}).encode(), 400),  # no model
        (json.dumps({"model": "llama3", "messages": FRANCE}).encode(), 404),
        (json.dumps({"model": MODEL_ID, "messages": FRANCE, "options": {"temperature": "hot"}}).encode(), 400),
        (json.dumps({"model": MODEL_ID, "messages": FRANCE, "options": {"top_k": [1]}}).encode(), 400),
        (json.dumps({"model": MODEL_ID, "messages": FRANCE, "think": True}).encode(), 400),
        (json.dumps([1, 2]).encode(), 400),
    ],
)
def test_bad_input_is_an_ollama_error(tiny_smollm2_ring, body, status):
    r = httpx.post(tiny_smollm2_ring.url + "/api/chat", content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status and set(r.json()) == {"error"} and isinstance(r.json()["error"], str)


@pytest.mark.parametrize(
    "route, body",
    [("/api/chat", {"messages": [{"role": "user", "content": "What is it?", "images": [PNG]}]}), ("/api/generate", {"prompt": "What is it?", "images": [PNG]})],
)
def test_an_image_to_a_model_that_does_not_see_is_an_ollama_400(tiny_smollm2_ring, route, body):
    r = httpx.post(tiny_smollm2_ring.url + route, json={"model": MODEL_ID, **body}, timeout=60)
    assert r.status_code == 400 and r.json() == {"error": f"{MODEL_ID} does not take images: it has no vision tower"}


def test_the_client_raises_on_bad_options(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL_ID, messages=FRANCE, options={"temperature": "hot"})
    assert e.value.status_code == 400 and "temperature" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="llama3", prompt="hi")
    assert e.value.status_code == 404


def test_unknown_routes_answer_in_ollamas_shape(tiny_smollm2_ring):
    r = httpx.post(tiny_smollm2_ring.url + "/api/create", json={"model": MODEL_ID, "from": "x"})
    assert r.status_code == 404 and set(r.json()) == {"error"}


# --- reasoning: the tiny qwen3 that thinks ----------------------------------------------


@pytest.fixture(scope="module")
def thinker(think_ring):
    return ollama.Client(host=think_ring.url, timeout=120)


def test_think_true_gives_thinking_apart_from_the_answer(thinker):
    m = thinker.chat(model="think", messages=FRANCE, think=True, options=GREEDY).message
    assert m.thinking and m.thinking.strip() and "<think>" not in m.content and m.content.strip() == "Paris."
    chunks = list(thinker.chat(model="think", messages=FRANCE, think=True, options=GREEDY, stream=True))
    assert "".join(c.message.thinking or "" for c in chunks) == m.thinking and "".join(c.message.content for c in chunks) == m.content
    g = thinker.generate(model="think", prompt=FRANCE[0]["content"], think=True, options=GREEDY)
    assert g.thinking == m.thinking and g.response == m.content
    assert "thinking" in thinker.show("think").capabilities


def test_a_call_comes_back_parsed_and_its_result_gets_an_answer(thinker):
    """The model's own call (Qwen3's format, read by mlx-lm's parser), in Ollama's shape, plain and
    streamed; then its result, naming its tool, gets the answer the model was taught. Sent as JSON
    with the tool's keys in the order the model was taught them (the ollama client reorders them:
    this tiny model knows its prompts by heart), read by the client's own response model."""

    def chat(messages, stream=False) -> list[ollama.ChatResponse]:
        body = {"model": "think", "messages": messages, "tools": [WEATHER], "think": True, "options": GREEDY, "stream": stream}
        r = httpx.post(str(thinker._client.base_url) + "/api/chat", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return [ollama.ChatResponse.model_validate_json(line) for line in r.text.splitlines() if line]

    [r] = chat(PARIS)
    assert r.done_reason == "stop" and not r.message.content.strip() and r.message.thinking
    [call] = r.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    jsonschema.validate(dict(call.function.arguments), WEATHER_SCHEMA)
    streamed = [c for c in chat(PARIS, stream=True) if c.message.tool_calls]
    assert [c.function for c in streamed[0].message.tool_calls] == [call.function]
    [answer] = chat(CALLED)
    assert answer.message.content.strip() == "It is 18 C and sunny in Paris." and not answer.message.tool_calls


def test_think_false_gives_no_thinking(thinker):
    m = thinker.chat(model="think", messages=FRANCE, think=False, options=GREEDY).message
    assert not m.thinking and m.content.strip() == "Paris."
