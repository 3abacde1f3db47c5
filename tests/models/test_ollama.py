"""ringd.models.ollama.store: ``ollama:NAME[:TAG]`` found as its GGUF blob in an Ollama store, with
the params, system and template layers beside it applied as Ollama applies them.

The stores are built in tmp_path as Ollama lays them out (``manifests/<host>/
<namespace>/<model>/<tag>`` holding the manifest JSON Ollama writes, blobs named by
their digest), with a small file starting with the GGUF magic as the model, and
the real SmolLM2 GGUF, linked in, read through ``checkpoint`` as a model is and
served in-process (stages of this process, the real engine and ``serving.py``)
with its layers. The params parser and the Go templates' translations (rendered
by transformers' own Jinja environment) are checked with Hypothesis.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringd.models.ollama import gotemplates
from ringd.models.ollama import store as ollama
from ringd.models.checkpoint import load_tokenizer
from ringd.models.gguf.reader import GgufFile
from ringd.models.gguf.vocab import adds_bos
from ringd.models.source import model_info
from ringd.http.request import Request, with_model_defaults
from ringd.models.defaults import SAMPLED, ModelDefaults
from ringd.models.errors import ModelError
from ringd.models.ollama.store import MAX_MANIFEST_BYTES, MODEL_MEDIA_TYPE, is_ollama_ref, parse_name, resolve
from ringd.models.ollama.params import OPTION_TYPES, UNSUPPORTED_OPTIONS, layer_options, params_defaults
from ringd.ring.sampling import SamplingParams

FAKE_GGUF = b"GGUF" + (3).to_bytes(4, "little") + bytes(56)


def blob(store: Path, data: bytes, *, legacy_name: bool = False) -> dict:
    """Write ``data`` as a blob; its descriptor (digest and size) as a manifest lists it."""
    digest = hashlib.sha256(data).hexdigest()
    (store / "blobs").mkdir(parents=True, exist_ok=True)
    (store / "blobs" / (f"sha256:{digest}" if legacy_name else f"sha256-{digest}")).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def pull(store: Path, path: str, model: dict | None) -> Path:
    """Write a manifest at manifests/<path> as `ollama pull` does: a config, the model
    layer (``model``: its blob's descriptor; None: a manifest without one), a template."""
    layers = [] if model is None else [{"mediaType": MODEL_MEDIA_TYPE, **model}]
    layers.append({"mediaType": "application/vnd.ollama.image.template", **blob(store, b"{{ .Prompt }}")})
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", **blob(store, b'{"model_format":"gguf"}')},
        "layers": layers,
    }
    file = store / "manifests" / path
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(manifest))
    return file


@pytest.fixture
def store(tmp_path, monkeypatch) -> Path:
    """An Ollama store named by OLLAMA_MODELS, as the default for resolve()."""
    models = tmp_path / "ollama-models"
    models.mkdir()
    monkeypatch.setenv("OLLAMA_MODELS", str(models))
    return models


def test_an_ollama_ref_starts_with_ollama():
    assert is_ollama_ref("ollama:smollm2") and is_ollama_ref("ollama:user/model:tag")
    assert not is_ollama_ref("smollm2") and not is_ollama_ref("./ollama:x.gguf") and not is_ollama_ref("Qwen/Qwen3-0.6B")


@pytest.mark.parametrize(
    "ref, manifest",
    [
        ("ollama:smollm2", "registry.ollama.ai/library/smollm2/latest"),
        ("ollama:smollm2:135m", "registry.ollama.ai/library/smollm2/135m"),
        ("ollama:user/model:tag", "registry.ollama.ai/user/model/tag"),
        ("ollama:user/model", "registry.ollama.ai/user/model/latest"),
        # `ollama run hf.co/OWNER/REPO:QUANT`: host hf.co, namespace OWNER, model REPO, tag QUANT (as typed)
        ("ollama:hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_0", "hf.co/bartowski/SmolLM2-135M-Instruct-GGUF/Q4_0"),
        ("ollama:hf.co/bartowski/SmolLM2-135M-Instruct-GGUF", "hf.co/bartowski/SmolLM2-135M-Instruct-GGUF/latest"),
        ("ollama:localhost:5000/team/model:v1.2", "localhost:5000/team/model/v1.2"),  # a host with a port
        ("ollama:https://example.com/team/model", "example.com/team/model/latest"),  # the scheme is dropped
    ],
)
def test_names_resolve_to_the_blob_of_their_model_layer(store, ref, manifest):
    model = blob(store, FAKE_GGUF)
    pull(store, manifest, model)
    path = resolve(ref)
    assert path == store / "blobs" / f"sha256-{model['digest'].removeprefix('sha256:')}"
    assert path.read_bytes() == FAKE_GGUF


def test_the_store_is_ollama_models_else_the_users_else_the_system_services(tmp_path, monkeypatch):
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    system = tmp_path / "usr-share-ollama"
    monkeypatch.setattr(ollama, "SYSTEM_STORE", system)
    with pytest.raises(ModelError) as e:
        resolve("ollama:smollm2")
    message = str(e.value)
    assert "OLLAMA_MODELS is not set" in message and str(tmp_path / "home" / ".ollama" / "models") in message
    assert str(system) in message and "`ollama pull smollm2`" in message

    pull(system, "registry.ollama.ai/library/smollm2/latest", blob(system, FAKE_GGUF))
    assert resolve("ollama:smollm2").parent == system / "blobs"
    user = tmp_path / "home" / ".ollama" / "models"
    pull(user, "registry.ollama.ai/library/smollm2/latest", blob(user, FAKE_GGUF))
    assert resolve("ollama:smollm2").parent == user / "blobs"  # the user's, once there is one
    elsewhere = tmp_path / "elsewhere"
    pull(elsewhere, "registry.ollama.ai/library/smollm2/latest", blob(elsewhere, FAKE_GGUF))
    monkeypatch.setenv("OLLAMA_MODELS", str(elsewhere))
    assert resolve("ollama:smollm2").parent == elsewhere / "blobs"
    assert resolve("ollama:smollm2", models_dir=user).parent == user / "blobs"  # an explicit store over all


def test_ollama_models_naming_no_directory_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "missing"))
    with pytest.raises(ModelError, match=f"OLLAMA_MODELS is {tmp_path / 'missing'}, which is not a directory"):
        resolve("ollama:smollm2")


def test_no_manifest_names_the_manifest_the_store_and_the_pull(store):
    pull(store, "registry.ollama.ai/library/smollm2/latest", blob(store, FAKE_GGUF))
    with pytest.raises(ModelError) as e:
        resolve("ollama:smollm2:135m")
    message = str(e.value)
    assert str(store / "manifests" / "registry.ollama.ai" / "library" / "smollm2" / "135m") in message
    assert f"store {store}" in message and "`ollama pull smollm2:135m`" in message


def test_a_manifest_without_a_model_layer_says_what_layers_it_has(store):
    pull(store, "registry.ollama.ai/library/smollm2/latest", None)
    with pytest.raises(ModelError, match=rf"no {MODEL_MEDIA_TYPE} layer \(its layers: application/vnd.ollama.image.template\)"):
        resolve("ollama:smollm2")


def test_a_missing_blob_names_it(store):
    model = blob(store, FAKE_GGUF)
    pull(store, "registry.ollama.ai/library/smollm2/latest", model)
    path = store / "blobs" / f"sha256-{model['digest'].removeprefix('sha256:')}"
    path.unlink()
    with pytest.raises(ModelError, match=f"missing \\(no {path}\\); `ollama pull smollm2` fetches it again"):
        resolve("ollama:smollm2")


def test_a_blob_of_another_size_than_its_manifest_says_is_a_partial_pull(store):
    model = blob(store, FAKE_GGUF)
    pull(store, "registry.ollama.ai/library/smollm2/latest", {**model, "size": len(FAKE_GGUF) + 1000})
    with pytest.raises(ModelError, match=f"is {len(FAKE_GGUF)} bytes, its manifest says {len(FAKE_GGUF) + 1000}"):
        resolve("ollama:smollm2")


def test_a_blob_that_is_not_gguf_is_refused(store):
    pull(store, "registry.ollama.ai/library/smollm2/latest", blob(store, b"PK\x03\x04 a safetensors zip, say"))
    with pytest.raises(ModelError, match="is not a GGUF file"):
        resolve("ollama:smollm2")


def test_blobs_of_older_stores_named_sha256_colon_are_found(store):
    model = blob(store, FAKE_GGUF, legacy_name=True)
    pull(store, "registry.ollama.ai/library/smollm2/latest", model)
    assert resolve("ollama:smollm2").name == model["digest"]


def test_a_manifest_that_is_not_json_says_which_file(store):
    file = store / "manifests" / "registry.ollama.ai" / "library" / "smollm2" / "latest"
    file.parent.mkdir(parents=True)
    file.write_text("{not json")
    with pytest.raises(ModelError, match=f"cannot read its manifest {file}"):
        resolve("ollama:smollm2")


@pytest.mark.parametrize(
    "write, why",
    [
        (lambda f: f.write_text("[" * 200_000), "maximum recursion depth"),  # json's own limit, not a traceback
        (lambda f: f.write_bytes(b" " * (MAX_MANIFEST_BYTES + 1)), "over 1048576 bytes"),  # refused unread
    ],
    ids=["nested", "huge"],
)
def test_a_hostile_manifest_is_one_line_not_a_traceback_nor_a_read_of_it_all(store, write, why):
    """Issue 28: 200,000 nested [ made a RecursionError traceback; a 1 GiB manifest was read whole."""
    file = store / "manifests" / "registry.ollama.ai" / "library" / "smollm2" / "latest"
    file.parent.mkdir(parents=True)
    write(file)
    with pytest.raises(ModelError, match=f"cannot read its manifest {file} \\(.*{why}") as e:
        resolve("ollama:smollm2")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "name, part",
    [
        ("", "an empty model"),
        ("smollm2:", "an empty tag"),
        ("/smollm2", "an empty namespace"),
        ("a/b/c/d", "the host 'a/b'"),
        ("smol lm", "the model 'smol lm'"),
        ("my.team/model", "the namespace 'my.team'"),
        ("model:a:b", "the model 'model:a'"),
        ("-model", "the model '-model'"),
        ("m" * 81, f"the model '{'m' * 81}'"),
    ],
)
def test_a_malformed_name_says_which_part_and_what_names_look_like(store, name, part):
    with pytest.raises(ModelError) as e:
        resolve(f"ollama:{name}")
    message = str(e.value)
    assert message.startswith(f"ollama:{name}: not an Ollama model name ({part}")
    assert "NAMESPACE/NAME:TAG" in message


def test_parse_name_fills_the_defaults_as_ollama_does():
    assert parse_name("smollm2") == ollama.OllamaName("registry.ollama.ai", "library", "smollm2", "latest")
    assert str(parse_name("user/model:tag")) == "registry.ollama.ai/user/model:tag"


def test_the_real_smollm2_through_an_ollama_store_is_a_model(store, smollm2_gguf):
    from ringd.models.source import gguf_source, model_info

    # Ollama names a blob by its sha256; the test links the real file under a made-up
    # digest, which is all a store's reader can see (it does not hash blobs).
    digest = "0123456789abcdef" * 4
    (store / "blobs").mkdir()
    (store / "blobs" / f"sha256-{digest}").symlink_to(smollm2_gguf)
    pull(store, "registry.ollama.ai/library/smollm2/135m", {"digest": f"sha256:{digest}", "size": smollm2_gguf.stat().st_size})
    path, label = gguf_source("ollama:smollm2:135m")
    assert path == store / "blobs" / f"sha256-{digest}" and label == "smollm2:135m"
    info = model_info("ollama:smollm2:135m")
    assert info.model_type == "llama" and info.num_layers == 30 and info.name == "smollm2:135m"


# --- the layers beside the weights: params, system, template ----------------------------------

PARAMS = "application/vnd.ollama.image.params"
SYSTEM = "application/vnd.ollama.image.system"
TEMPLATE = "application/vnd.ollama.image.template"


def pull_layers(store: Path, path: str, model: dict, layers: list[tuple[str, bytes]]) -> Path:
    """A manifest with the model layer, then ``layers`` (media type, blob bytes) in order."""
    manifest = {
        "schemaVersion": 2,
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", **blob(store, b'{"model_format":"gguf"}')},
        "layers": [{"mediaType": MODEL_MEDIA_TYPE, **model}] + [{"mediaType": kind, **blob(store, data)} for kind, data in layers],
    }
    file = store / "manifests" / path
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(manifest))
    return file


SMOL = "registry.ollama.ai/library/smollm2/latest"


def test_params_system_and_template_layers_are_read_as_ollama_reads_them(store):
    """Params layers merge in order (later keys win); the last system and template layer win."""
    pull_layers(store, SMOL, blob(store, FAKE_GGUF), [
        (PARAMS, json.dumps({"temperature": 0.2, "stop": ["<|im_end|>"], "num_ctx": 4096}).encode()),
        (SYSTEM, b"first"),
        (PARAMS, json.dumps({"temperature": 0.7, "top_k": 20, "seed": -1, "num_predict": -1, "repeat_penalty": 1.1}).encode()),
        (SYSTEM, "You are a pirate. ☠".encode()),
        (TEMPLATE, b"{{ .Prompt }}"),
    ])  # fmt: skip
    model = ollama.find("ollama:smollm2")
    assert model.options == {"temperature": 0.7, "stop": ["<|im_end|>"], "num_ctx": 4096, "top_k": 20, "seed": -1, "num_predict": -1, "repeat_penalty": 1.1}
    assert model.system == "You are a pirate. ☠" and model.template == "{{ .Prompt }}"
    defaults, warnings = model.defaults()
    assert warnings == []
    # seed -1 is Ollama's random (no seed); num_predict -1 until the context ends (no max_tokens)
    assert defaults.sampling == {"temperature": 0.7, "top_k": 20, "repetition_penalty": 1.1}
    assert defaults.stop == ("<|im_end|>",) and defaults.context == 4096 and defaults.max_tokens is None
    assert defaults.system == "You are a pirate. ☠" and defaults.source == "ollama:smollm2"


def test_a_model_without_those_layers_has_no_defaults(store):
    pull_layers(store, SMOL, blob(store, FAKE_GGUF), [])
    model = ollama.find("ollama:smollm2")
    assert (model.options, model.system, model.template) == (None, None, None)
    assert not model.defaults()[0] and model.defaults()[1] == []


@pytest.mark.parametrize(
    "kind, data, says",
    [
        (PARAMS, b"{not json", "its params layer is not JSON"),
        (PARAMS, b"[1, 2]", "its params layer must be a JSON object of options"),
        (PARAMS, b" " * (64 * 1024 + 1), "its params layer: its blob .* is over 65536 bytes"),
        (PARAMS, b'{"num_ctx": "big"}', 'its params layer: option "num_ctx" must be of type integer'),
        (PARAMS, b'{"stop": 5}', 'its params layer: option "stop" must be of type array'),
        (PARAMS, b'{"stop": ["ok", ""]}', 'its params layer: option "stop" must be a list of non-empty strings'),
        (PARAMS, b'{"temperature": 7}', "its params layer: option 'temperature': temperature must be between 0 and 2"),
        (PARAMS, b'{"num_predict": -3}', 'its params layer: option "num_predict" must be a number of tokens'),
        (SYSTEM, b"\xff\xfe", "its system layer: not UTF-8 text"),
        (SYSTEM, b"x" * ((1 << 20) + 1), "its system layer: its blob .* is over 1048576 bytes"),
        (TEMPLATE, b"\xc3", "its template layer: not UTF-8 text"),
    ],
    ids=["not-json", "not-object", "huge-params", "wrong-type", "stop-not-list", "empty-stop", "temperature", "num_predict", "system-bytes", "huge-system", "template-bytes"],
)
def test_a_bad_layer_is_one_line_naming_the_model_and_the_layer(store, kind, data, says):
    pull_layers(store, SMOL, blob(store, FAKE_GGUF), [(kind, data)])
    with pytest.raises(ModelError) as e:
        ollama.find("ollama:smollm2").defaults()
    assert re.match(f"ollama:smollm2: {says}", str(e.value)), str(e.value)
    assert "\n" not in str(e.value)


def test_a_missing_layer_blob_names_the_layer(store):
    pull_layers(store, SMOL, blob(store, FAKE_GGUF), [(SYSTEM, b"hello")])
    (store / "blobs" / f"sha256-{hashlib.sha256(b'hello').hexdigest()}").unlink()
    with pytest.raises(ModelError, match="ollama:smollm2: its system layer: its blob is missing .*`ollama pull smollm2` fetches it again"):
        ollama.find("ollama:smollm2")


def test_options_ollama_ignores_or_ringd_cannot_sample_are_ignored_with_a_warning():
    defaults, warnings = params_defaults(
        {"temperature": 0.5, "flash": True, "mirostat": 2, "typical_p": 0.9, "num_gpu": 99, "use_mmap": False, "tfs_z": None}, "m: its params layer"
    )
    assert defaults.sampling == {"temperature": 0.5}
    assert len(warnings) == 3
    assert "option 'flash' is not one Ollama knows; ignored, as Ollama ignores it" in warnings[0]
    assert all(w.startswith("m: its params layer: option ") for w in warnings)
    assert "'mirostat' asks for sampling ringd does not do" in warnings[1] and "'typical_p'" in warnings[2]


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(OPTION_TYPES)) | st.text(max_size=6), JSON_VALUES, max_size=6))
def test_any_options_become_defaults_every_request_can_take_or_one_line_naming_the_layer(options):
    try:
        defaults, warnings = params_defaults(options, "m: its params layer")
    except ModelError as e:
        assert str(e).startswith("m: its params layer: ") and "\n" not in str(e)
        return
    SamplingParams(**defaults.sampling)  # what a request without its own samples with
    assert set(defaults.sampling) <= set(SAMPLED)
    assert defaults.stop is None or all(isinstance(s, str) and s for s in defaults.stop)
    assert defaults.max_tokens is None or defaults.max_tokens > 0
    assert defaults.context is None or defaults.context > 0
    assert len(warnings) == sum(k not in OPTION_TYPES for k in options) + sum(
        options.get(k) is not None and options[k] != off for k, off in UNSUPPORTED_OPTIONS.items()
    )


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=64) | JSON_VALUES.map(lambda v: json.dumps(v).encode()))
def test_any_bytes_are_an_options_object_or_one_line(raw):
    try:
        options = layer_options(raw, "m: its params layer")
    except ModelError as e:
        assert str(e).startswith("m: its params layer ") and "\n" not in str(e)
        return
    assert isinstance(options, dict)


# --- Go templates: the known ones translated, the rest refused where they would be needed -------

CHAT = [
    {"role": "system", "content": "S"},
    {"role": "system", "content": "S2"},
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": "A"},
    {"role": "user", "content": "U2"},
    {"role": "user", "content": "U3"},
]
# What Ollama's template.Execute writes for CHAT with each (worked out by hand from the Go
# template: consecutive messages of a role collated with a blank line, then the template run once).
OLLAMA_RENDERS = {
    "chatml": "<|im_start|>system\nS\n\nS2<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
    "<|im_start|>user\nU2\n\nU3<|im_end|>\n<|im_start|>assistant\n",
    "llama3-instruct": "<|start_header_id|>system<|end_header_id|>\n\nS\n\nS2<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nA<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nU2\n\nU3<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "gemma-instruct": "<start_of_turn>user\nS\n\nS2\nU<end_of_turn>\n<start_of_turn>model\nA<end_of_turn>\n<start_of_turn>user\nU2\n\nU3<end_of_turn>\n"
    "<start_of_turn>model\n",
    "mistral-instruct": "[INST] S\n\nS2\n\nU[/INST] A</s>[INST] U2\n\nU3[/INST]",
    "phi-3": "<|system|>\nS\n\nS2<|end|>\n<|user|>\nU<|end|>\n<|assistant|>\nA<|end|>\n<|user|>\nU2\n\nU3<|end|>\n<|assistant|>\n",
    "zephyr": "<|system|>\nS\n\nS2</s>\n<|user|>\nU</s>\n<|assistant|>\nA</s>\n<|user|>\nU2\n\nU3</s>\n<|assistant|>\n",
    "prompt": "UU2\n\nU3",
}


def render(jinja: str, messages: list[dict]) -> str:
    """As the tokenizer renders a chat (transformers' Jinja environment: trim_blocks, lstrip_blocks)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    out, _ = render_jinja_template(conversations=[messages], chat_template=jinja, add_generation_prompt=True, bos_token="<s>")
    return out[0]


@pytest.mark.parametrize("name", sorted(gotemplates.KNOWN))
def test_each_known_go_template_becomes_jinja_that_renders_what_ollama_renders(name):
    go = gotemplates.KNOWN[name][0]
    assert gotemplates.known_name(go.replace("\n", "\r\n")) == name  # Ollama reads CRLF as LF
    assert render(gotemplates.jinja_for(go, bos=False), CHAT) == OLLAMA_RENDERS[name]
    assert render(gotemplates.jinja_for(go, bos=True), CHAT) == "<s>" + OLLAMA_RENDERS[name]


ROLES = st.sampled_from(["system", "user", "assistant", "tool"])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(ROLES, st.text("ab \n<|>", max_size=4)), max_size=6))
def test_chatml_renders_any_conversation_as_ollama_collates_and_runs_it(turns):
    """Ollama's collate, by hand: consecutive messages of a role (not tool) joined by a blank line."""
    collated: list[list[str]] = []
    for role, content in turns:
        if collated and collated[-1][0] == role and role != "tool":
            collated[-1][1] += "\n\n" + content
        else:
            collated.append([role, content])
    want = "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in collated) + "<|im_start|>assistant\n"
    jinja = gotemplates.jinja_for(gotemplates.KNOWN["chatml"][0], bos=False)
    assert render(jinja, [{"role": r, "content": c} for r, c in turns]) == want


def test_the_ggufs_own_template_wins_and_an_unknown_go_template_is_refused_only_where_needed():
    chatml = gotemplates.KNOWN["chatml"][0]
    model = ollama.OllamaModel("ollama:m", Path("blob"), template=chatml)
    assert model.chat_template("{{ messages }}", bos=lambda: True) is None  # the GGUF has one: it is rendered
    assert model.chat_template(None, bos=lambda: True) == gotemplates.jinja_for(chatml, bos=True)
    assert ollama.OllamaModel("ollama:m", Path("blob")).chat_template(None, bos=lambda: True) is None  # neither has one
    custom = ollama.OllamaModel("ollama:m", Path("blob"), template='{{ if .System }}<|sys|>{{ .System }}{{ end }}\n{{ .Prompt }}')
    assert custom.chat_template("{{ messages }}", bos=lambda: False) is None
    with pytest.raises(ModelError) as e:
        custom.chat_template(None, bos=lambda: False)
    message = str(e.value)
    assert message.startswith("ollama:m: its GGUF has no chat template (tokenizer.chat_template) and its template layer is a Go template ringd does not know ('{{ if .System }}<|sys|>")
    assert "chatml, llama3-instruct, gemma-instruct" in message and "\n" not in message


# --- applied: one place, every API -------------------------------------------------------------

LAYER_DEFAULTS = ModelDefaults(
    sampling={"temperature": 0.0, "top_k": 20}, stop=("capital",), max_tokens=20, context=2048, system="You are a helpful assistant."
)


def test_what_a_request_leaves_unset_takes_the_models_default_and_what_it_sets_stays():
    bare = Request(model="m", params=SamplingParams(), max_tokens=None, messages=[{"role": "user", "content": "hi"}])
    got = with_model_defaults(bare, LAYER_DEFAULTS)
    assert got.params == SamplingParams(temperature=0.0, top_k=20) and got.stop == ["capital"]
    assert got.max_tokens == 20 and got.context == 2048
    assert got.messages == [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "hi"}]
    assert bare.messages == [{"role": "user", "content": "hi"}]  # the request itself is left as it was
    own = Request(
        model="m", params=SamplingParams(temperature=1.0, seed=3), max_tokens=5, stop=[], given=frozenset({"temperature", "seed", "stop"}),
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], context=512,
    )  # fmt: skip
    got = with_model_defaults(own, LAYER_DEFAULTS)
    assert got.params == SamplingParams(temperature=1.0, seed=3, top_k=20)  # an explicit 1.0 stays 1.0
    assert got.stop == [] and got.max_tokens == 5 and got.context == 512 and got.messages == own.messages
    raw = Request(model="m", params=SamplingParams(), max_tokens=None, prompt="Once upon")
    assert with_model_defaults(raw, LAYER_DEFAULTS).prompt == "Once upon"  # a raw prompt gets no system message
    assert with_model_defaults(bare, ModelDefaults()) is bare


@pytest.mark.parametrize(
    "api, body, given",
    [
        ("openai", {"temperature": 0.5, "top_k": 3, "stop": "x"}, {"temperature", "top_k", "stop"}),
        ("openai", {"stop": None, "seed": None}, set()),
        ("anthropic", {"top_p": 0.5, "stop_sequences": ["x"]}, {"top_p", "stop"}),
        ("responses", {"temperature": 0.5, "min_p": 0.1}, {"temperature", "min_p"}),
        ("ollama", {"options": {"repeat_penalty": 1.2, "seed": -1, "stop": ["x"], "num_ctx": 99}}, {"repetition_penalty", "stop"}),
    ],
)
def test_every_api_says_which_defaulted_fields_its_client_set(api, body, given):
    from ringd.http import anthropic_api, ollama_api, openai_types, responses_api

    messages = [{"role": "user", "content": "hi"}]
    if api == "openai":
        req = openai_types.parse_request({"model": "m", "messages": messages, **body}, chat=True).to_request()
    elif api == "anthropic":
        req = anthropic_api.parse({"model": "m", "messages": messages, "max_tokens": 5, **body}).request
    elif api == "responses":
        req = responses_api.parse({"model": "m", "input": "hi", **body}).request
    else:
        req = ollama_api.parse({"model": "m", "messages": messages, **body}, True, "m", 4096, False).request
        assert req.context == 99
    assert req.given == given


def test_the_real_smollm2_served_in_process_takes_its_layers_unless_a_request_says_otherwise(store, smollm2_gguf):
    """Stages of this process (tests/kit/stagering.py), the real engine and serving.py, the requests parsed
    by Ollama's and OpenAI's own translations: what the layers set reaches the ring."""
    import asyncio
    from types import SimpleNamespace

    from ringd.http import ollama_api, openai_types
    from ringd.http.errors import ApiError
    from ringd.http.serving import Serving
    from ringd.leader.engine import Engine, EngineSettings
    from ringd.base.metrics import Metrics
    from devkit.stagering import StageRing

    digest = "0123456789abcdef" * 4
    (store / "blobs").mkdir()
    (store / "blobs" / f"sha256-{digest}").symlink_to(smollm2_gguf)
    options = {"temperature": 0, "top_k": 20, "stop": ["capital"], "num_predict": 20, "num_ctx": 2048}
    pull_layers(store, SMOL, {"digest": f"sha256:{digest}", "size": smollm2_gguf.stat().st_size}, [
        (PARAMS, json.dumps(options).encode()), (SYSTEM, b"You are a helpful assistant."),
    ])  # fmt: skip
    info = model_info("ollama:smollm2")
    assert info.defaults == dataclasses.replace(LAYER_DEFAULTS, source="ollama:smollm2") and info.chat_template is None
    # What /api/show lists of them, and /api/ps's context
    assert ollama_api.parameters(info) == [("num_ctx", "2048"), ("num_predict", "20"), ("temperature", "0"), ("top_k", "20"), ("stop", '"capital"')]
    assert ollama_api.default_context(info) == 2048 < info.context_length
    tokenizer = load_tokenizer(info)
    question = [{"role": "user", "content": "What is the capital of France?"}]

    async def main():
        ring = StageRing(info.path, [], tokenizer)  # one stage: the ring's cuts are other tests' matter
        engine = ring.lead(Engine("node0", tokenizer, None, EngineSettings(prefix_cache_entries=0)))
        generate = engine.generate

        def recorded(prompt, params, max_tokens, stop, *args, **kwargs):  # what reaches the engine, passed on to it
            reached.append((params, max_tokens, stop))
            return generate(prompt, params, max_tokens, stop, *args, **kwargs)

        engine.generate = recorded
        node = SimpleNamespace(
            info=info, tokenizer=tokenizer, model_id="smollm2", engine=engine, leading=True, readiness=lambda: (True, ""),
            failover_wait_s=0.0, metrics=Metrics("node0"), chat_template_kwargs={},
        )  # fmt: skip
        serving = Serving(node)

        async def run(req):
            gen = await serving.open(req, node, None)
            outs = [o async for o in gen]
            return gen, "".join(o.text for o in outs), outs[-1]

        try:
            bare = ollama_api.parse({"model": "smollm2", "messages": question}, True, "smollm2", info.context_length, False).request
            own = openai_types.parse_request(
                {"model": "smollm2", "messages": [{"role": "system", "content": "You are a poet."}, *question],
                 "temperature": 1.5, "seed": 7, "stop": ["zzz"], "max_tokens": 3}, chat=True,
            ).to_request()  # fmt: skip
            results = [await run(bare)]
            gen = await serving.open(own, node, None)  # what it sets is what reaches the engine: no need to run it
            await gen.aclose()
            results.append(gen)
            tight = ollama_api.parse({"model": "smollm2", "messages": question, "options": {"num_ctx": 16}}, True, "smollm2", info.context_length, False)
            with pytest.raises(ApiError) as refused:
                await serving.open(tight.request, node, None)
            return results, refused.value
        finally:
            await ring.stop()

    reached = []
    [(bare, bare_text, bare_last), own], refused = asyncio.run(asyncio.wait_for(main(), 300))
    bare_prompt = tokenizer.decode(bare.prompt)
    (bare_params, bare_max, bare_stop), (own_params, own_max, own_stop) = reached
    assert bare_params.temperature == 0 and bare_params.top_k == 20 and bare_stop == ["capital"] and bare_max == 20
    assert bare_prompt.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")
    # Greedy (the layer's temperature 0), the answer is "The capital of France is Paris.": the layer's stop word ends it.
    assert bare_last.finish_reason == "stop" and bare_last.stop_sequence == "capital" and bare_text == "The ", bare_text
    own_prompt = tokenizer.decode(own.prompt)
    assert own_params.temperature == 1.5 and own_params.seed == 7 and own_params.top_k == 20  # top_k: the layer's
    assert own_stop == ["zzz"] and own_max == 3
    assert "You are a poet." in own_prompt and "helpful" not in own_prompt
    assert refused.status == 400 and "the context asked for (num_ctx) is 16" in refused.message


def test_a_gguf_without_a_chat_template_renders_its_known_go_template_and_an_unknown_one_stops_the_start(store, smollm2_gguf, caplog):
    """SmolLM2 (a ChatML model) with its tokenizer.chat_template key renamed away, as a GGUF converted
    before chat templates were kept in the file, under Ollama's chatml template; then under a template
    of a Modelfile's own."""
    data = bytearray(smollm2_gguf.read_bytes())
    at = data.index(b"tokenizer.chat_template")  # in the header, after the vocabulary
    data[at : at + 23] = b"tokenizer.chat_templat_"  # same length: the rest of the header stands
    model = blob(store, bytes(data))
    pull_layers(store, SMOL, model, [(TEMPLATE, gotemplates.KNOWN["chatml"][0].encode()), (PARAMS, b'{"flash_attn": true}')])
    with caplog.at_level("WARNING", logger="ringd.models.source"):
        info = model_info("ollama:smollm2")
    assert [r.getMessage() for r in caplog.records] == [
        "ollama:smollm2: its params layer: option 'flash_attn' is not one Ollama knows; ignored, as Ollama ignores it"
    ]
    assert info.chat_template == gotemplates.jinja_for(gotemplates.KNOWN["chatml"][0], bos=adds_bos(GgufFile.open(info.path).meta))
    tokenizer = load_tokenizer(info)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")

    pull_layers(store, "registry.ollama.ai/library/smollm2/custom", model, [(TEMPLATE, b"<|user|>{{ .Prompt }}<|bot|>")])
    with pytest.raises(ModelError, match=r"^ollama:smollm2:custom: its GGUF has no chat template .* \('<\|user\|>\{\{ \.Prompt \}\}<\|bot\|>'\)"):
        model_info("ollama:smollm2:custom")


def test_responses_echo_the_temperature_and_top_p_a_response_was_sampled_with():
    from ringd.http import responses_api

    p = responses_api.parse({"model": "m", "input": "hi", "top_p": 0.5})
    echoed = responses_api.response_object(p, "resp_1", 1, "m", [], "in_progress", None, with_model_defaults(p.request, LAYER_DEFAULTS).params)
    assert echoed["temperature"] == 0.0 and echoed["top_p"] == 0.5  # the layer's, and the request's own
