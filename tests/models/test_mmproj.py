"""ringd.models.gguf.mmproj: a GGUF model and its projector file (llama.cpp's mmproj, written here as
llama.cpp's converter writes them) see as the mlx-vlm checkpoint they were converted from, and a
projector ringd cannot read is refused in one line that names what is wrong."""

from __future__ import annotations

import shutil

import gguf
import mlx.core as mx
import pytest

from devkit.pictures import gradient, png
from ringd.models.errors import ModelError
from ringd.models.gguf.mmproj import Mmproj, beside
from ringd.models.source import model_info
from ringd.ring.media import Media
from ringd.stage.shard import Shard
from ringd.stage.vision import Vision

PROMPT = "Describe the image."
TOKENS = 8


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl"])
def test_a_gguf_and_its_projector_split_in_two_answer_as_mlx_vlm_does_on_the_checkpoint(tiny_vision_model, tiny_vision_gguf, family):
    """Gemma 3 (mlx-lm's text path; a pooled SigLIP tower), Qwen2.5-VL (mlx-vlm's language model, its
    positions by time, row and column; q, k and v and the patch convolution's two frames put back)."""
    from mlx_vlm import apply_chat_template, generate, load

    checkpoint, gguf_file = tiny_vision_model(family), tiny_vision_gguf(family)
    model, processor = load(str(checkpoint))
    info = model_info(str(gguf_file))
    assert info.mmproj == gguf_file.parent / f"mmproj-tiny-{family}-F32.gguf"
    cut = info.num_layers // 2
    first, last = Shard.load(str(gguf_file), 0, cut), Shard.load(str(gguf_file), cut, info.num_layers)
    vision = Vision.load(info, first)
    answers = []
    for picture in (gradient(), gradient(48, 80, turn=1)):
        prompt = apply_chat_template(processor, model.config, PROMPT, num_images=1)
        expected = list(generate(model, processor, prompt, image=[picture], max_tokens=TOKENS, temperature=0.0).token_ids)
        seen = vision.prompt(Media(1, 1, prompt, (png(picture),)))
        caches = [first.make_cache(), last.make_cache()]

        def step(tokens: list[int], offset: int) -> int:
            embeddings = seen.chunk(offset, tokens, vision.embed) if offset < len(seen.ids) else None
            positions = None if seen.positions is None else mx.array(seen.rope(offset, len(tokens)))[:, None, :]
            h = first(mx.array([tokens]), None, caches[0], embeddings=embeddings, positions=positions)
            return last(mx.array([tokens]), h, caches[1], positions=positions)[0, -1].argmax().item()

        ids = seen.ids
        step(ids[:20], 0)
        got = [step(ids[20:], 20)]
        while len(got) < len(expected):
            got.append(step([got[-1]], len(ids) + len(got) - 1))
        assert got == expected
        answers.append(expected)
    assert answers[0] != answers[1] and len(set(answers[0])) > 2  # the picture decides: the test could fail


def test_a_projector_ringd_cannot_read_is_refused_naming_what_is_wrong(tiny_vision_gguf, tmp_path):
    text = tiny_vision_gguf("gemma3")
    projector = text.parent / "mmproj-tiny-gemma3-F32.gguf"
    here = tmp_path / "model.gguf"
    shutil.copy(text, here)
    assert beside(here) is None  # no projector: a model that reads text
    shutil.copy(projector, tmp_path / "mmproj-a.gguf")
    shutil.copy(projector, tmp_path / "mmproj-b.gguf")
    with pytest.raises(ModelError, match="several projector files .mmproj-a.gguf, mmproj-b.gguf. beside model.gguf"):
        beside(here)

    def rewritten(name: str, **changes) -> Mmproj:
        """The projector file with some of its metadata changed (or removed: None), or without some tensors."""
        reader = gguf.GGUFReader(projector)
        out = tmp_path / name
        writer = gguf.GGUFWriter(str(out), "clip")
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            value = changes.get(key, field.contents())
            if value is not None:
                writer.add_key_value(key, value, field.types[0], field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
        for t in reader.tensors:
            if changes.get("drop") is None or changes["drop"] not in t.name:
                writer.add_tensor(t.name, t.data, raw_shape=list(reversed(t.shape)), raw_dtype=t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return out

    with pytest.raises(ModelError, match="a projector of type 'pixtral'; ringd reads gemma3, qwen2.5vl_merger's"):
        Mmproj.open(rewritten("pixtral.gguf", **{"clip.projector_type": "pixtral"}))
    with pytest.raises(ModelError, match="not a projector file with a vision tower"):
        Mmproj.open(rewritten("audio.gguf", **{"clip.has_vision_encoder": None}))
    info = model_info(str(text))
    with pytest.raises(ModelError, match="projects to 48 wide; the model's text is 64: not its projector"):
        Mmproj.open(rewritten("narrow.gguf", **{"clip.vision.projection_dim": 48})).config(info.config, {})
    with pytest.raises(ModelError, match="the model's vocabulary has no <start_of_image>, <image_soft_token>, <end_of_image>"):
        Mmproj.open(projector).config(info.config, {"<bos>": 2})
    lacking = Mmproj.open(rewritten("lacking.gguf", drop="v.blk.1.attn_q"))
    first = Shard.load(str(text), 0, 3)
    with pytest.raises(ModelError, match=r"lacks 2 tensors of the vision tower, e.g. v.blk.1.attn_q.weight \(vision_tower.vision_model.encoder.layers.1.self_attn.q_proj.weight\)"):
        Vision.load(info.__class__(**{**info.__dict__, "mmproj": lacking.path}), first)


def test_an_ollama_model_s_projector_layer_is_its_projector_file(tiny_vision_gguf, tmp_path, monkeypatch):
    """Ollama keeps a vision model's mmproj as a layer of it (application/vnd.ollama.image.projector):
    its blob is the projector ringd reads, and the model sees as it does from the files."""
    import hashlib
    import json

    from ringd.models.ollama.store import MODEL_MEDIA_TYPE, PROJECTOR_MEDIA_TYPE

    store = tmp_path / "ollama"
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    (store / "blobs").mkdir(parents=True)

    def blob(path) -> dict:
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        (store / "blobs" / f"sha256-{digest}").write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    text = tiny_vision_gguf("gemma3")
    layers = [{"mediaType": MODEL_MEDIA_TYPE, **blob(text)}, {"mediaType": PROJECTOR_MEDIA_TYPE, **blob(text.parent / "mmproj-tiny-gemma3-F32.gguf")}]
    manifest = store / "manifests/registry.ollama.ai/library/tinysee/latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    info = model_info("ollama:tinysee")
    assert info.mmproj is not None and info.mmproj.name == "sha256-" + layers[1]["digest"].removeprefix("sha256:")
    first = Shard.load("ollama:tinysee", 0, 3)
    seen = Vision.load(info, first).prompt(Media(1, 1, "<bos><start_of_turn>user\nHi<start_of_image><end_of_turn>\n<start_of_turn>model\n", (png(gradient()),)))
    assert seen.embeddings.shape == (1, len(seen.ids), info.hidden_size) and len(seen.ids) > 20


def test_the_first_stage_counts_the_vision_tower_in_its_memory(tiny_vision_model, tiny_vision_gguf):
    """Placement gives the first stage room for the tower it runs: a checkpoint's vision tensors, a
    GGUF model's projector file."""
    text = tiny_vision_gguf("gemma3")
    for info, vision in ((model_info(str(tiny_vision_model("gemma3"))), None), (model_info(str(text)), text.parent / "mmproj-tiny-gemma3-F32.gguf")):
        w = info.weights
        assert w.vision > 0 and (vision is None or w.vision == vision.stat().st_size)
        assert w.stage(0, 3) == sum(w.layers[:3]) + w.embed + w.vision and w.stage(3, 6) == sum(w.layers[3:]) + w.norm + (w.head or w.embed)
