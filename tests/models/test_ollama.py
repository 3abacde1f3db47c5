"""ringd.models.ollama: ``ollama:NAME[:TAG]`` found as its GGUF blob in an Ollama store.

The stores are built in tmp_path as Ollama lays them out (``manifests/<host>/
<namespace>/<model>/<tag>`` holding the manifest JSON Ollama writes, blobs named by
their digest), with a small file starting with the GGUF magic as the model, and once
the real SmolLM2 GGUF, linked in, read through ``checkpoint`` as a model is.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from ringd.models import ollama
from ringd.models.errors import ModelError
from ringd.models.ollama import MAX_MANIFEST_BYTES, MODEL_MEDIA_TYPE, is_ollama_ref, parse_name, resolve

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
        ("ollama:hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_0", "hf.co/bartowski/SmolLM2-135M-Instruct-GGUF/Q4_0"),
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
