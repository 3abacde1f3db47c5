"""ringd.stage.vision: the first stage starts a prompt with images from mlx-vlm's input embeddings,
and a model split anywhere answers as mlx-vlm's own generate in one process."""

from __future__ import annotations

import mlx.core as mx
import pytest

from devkit.pictures import gradient, png
from tests.conftest import VISION_FAMILIES
from ringd.models.source import model_info
from ringd.ring.media import Media
from ringd.stage.shard import Shard
from ringd.stage.vision import Vision, VisionError

PROMPT = "Describe the image."
TOKENS = 8


@pytest.fixture(scope="module", params=VISION_FAMILIES)
def family(request, tiny_vision_model):
    """A tiny checkpoint of each family: Gemma 3 and Mistral Small 3.1 (mlx-lm's text path), Qwen2.5-VL
    (mlx-vlm's, three-axis positions)."""
    return tiny_vision_model(request.param)


def reference(path, image) -> tuple[str, list[int]]:
    """mlx-vlm in one process: the prompt its own chat template writes, and its greedy tokens."""
    from mlx_vlm import apply_chat_template, generate, load

    model, processor = load(str(path))
    prompt = apply_chat_template(processor, model.config, PROMPT, num_images=1)
    return prompt, list(generate(model, processor, prompt, image=[image], max_tokens=TOKENS, temperature=0.0).token_ids)


def ring_tokens(stages: list[Shard], vision: Vision, media: Media, chunk: int, replay: int = 0) -> list[int]:
    """Greedy tokens of ``stages`` run in turn, the prompt in chunks of ``chunk`` positions; with
    ``replay``, the prompt and the first ``replay`` answers computed again from scratch in one
    chunk that crosses the prompt's end (as a replay on a new ring is), then the rest."""
    prompt = vision.prompt(media)
    caches = [s.make_cache() for s in stages]

    def step(tokens: list[int], offset: int) -> int:
        h = None
        # A three-axis decoder's positions: the prompt's, past it each index plus its shift (every stage's the same).
        positions = None if prompt.positions is None else mx.array(prompt.rope(offset, len(tokens)))[:, None, :]
        for stage, cache in zip(stages, caches):
            embeddings = prompt.chunk(offset, tokens, vision.embed) if stage.is_first and offset < len(prompt.ids) else None
            h = stage(mx.array([tokens]), h, cache, embeddings=embeddings, positions=positions)
        return h[0, -1].argmax().item()

    ids = prompt.ids
    for at in range(0, len(ids), chunk):
        token = step(ids[at : at + chunk], at)
    out = [token]
    while len(out) < TOKENS:
        out.append(step([out[-1]], len(ids) + len(out) - 1))
    if not replay:
        return out
    caches = [s.make_cache() for s in stages]  # the next ring: its caches start empty
    again = [step((ids + out)[: len(ids) + replay], 0)]
    while len(again) < TOKENS - replay:
        again.append(step([again[-1]], len(ids) + replay + len(again) - 1))
    return out[:replay] + again


def test_a_model_that_sees_split_anywhere_answers_as_mlx_vlm_generate(family):
    # Not square: Qwen's image takes a grid of 3 x 2 tokens, its rows and columns apart in its positions.
    image, other = gradient(48, 80), gradient(turn=1)
    text, expected = reference(family, image)
    assert expected != reference(family, other)[1]  # the picture decides the answer: a test that could fail
    assert len(set(expected)) > 2
    info = model_info(str(family))
    for cut in range(1, info.num_layers):
        first, last = Shard.load(str(family), 0, cut), Shard.load(str(family), cut, info.num_layers)
        vision = Vision.load(info, first)
        media = Media(1, 1, text, (png(image),))
        # Chunks of 3 cut the image's tokens (4 or more, in a row) between chunks.
        assert ring_tokens([first, last], vision, media, chunk=3) == expected, f"cut at layer {cut}"
    assert ring_tokens([first, last], vision, media, chunk=64, replay=3) == expected
    assert ring_tokens([first, last], vision, Media(1, 1, text, (png(other),)), chunk=64) != expected


def test_a_prompt_s_embeddings_hold_only_its_own_ids_and_damaged_images_are_its_own_failure(tiny_vision_model):
    gemma3 = tiny_vision_model("gemma3")
    info = model_info(str(gemma3))
    first = Shard.load(str(gemma3), 0, 2)
    vision = Vision.load(info, first)
    text, _ = reference(gemma3, gradient())
    prompt = vision.prompt(Media(1, 1, text, (png(gradient()),)))
    with pytest.raises(VisionError, match=r"positions \[3, 6\) of the prompt are not those"):
        prompt.chunk(3, [7, 7, 7], vision.embed)
    with pytest.raises(VisionError, match="image 0: not an image"):
        vision.prompt(Media(1, 1, text, (b"GIF89a but not really",)))
    whole = png(gradient())
    with pytest.raises(VisionError, match="image 1: the image is damaged or cut short"):
        vision.prompt(Media(1, 1, text, (whole, whole[: len(whole) // 2])))


_HUB_SEE = """
import json, sys
import mlx.core as mx
from ringd.models.source import model_info
from ringd.ring.media import Media
from ringd.stage.shard import Shard
from ringd.stage.vision import Vision
repo, text, picture = sys.argv[1], sys.argv[2], bytes.fromhex(sys.stdin.read())
info = model_info(repo)
first = Shard.load(repo, 0, 2)
seen = Vision.load(info, first).prompt(Media(1, 1, text, (picture,)))
print(json.dumps({"ids": seen.ids, "embeddings": mx.array(seen.embeddings).astype(mx.float32).tolist()}))
"""


def test_a_model_that_sees_from_the_hub_sees_as_from_its_directory(tiny_vision_model, tmp_path):
    """The Hub path (``--model OWNER/REPO``, here a local fake of the Hub): the first stage fetches the
    processor's files and the vision tower with its layers, and a prompt's embeddings are the ones
    the same checkpoint in a directory gives."""
    import json
    import subprocess
    import sys

    from devkit.fakehub import FakeHub

    path = tiny_vision_model("gemma3")
    text, _ = reference(path, gradient())
    picture = png(gradient())
    info = model_info(str(path))
    local = Vision.load(info, Shard.load(str(path), 0, 2)).prompt(Media(1, 1, text, (picture,)))
    with FakeHub({"ringd-test/see": path}) as hub:
        r = subprocess.run(
            [sys.executable, "-c", _HUB_SEE, "ringd-test/see", text], input=picture.hex(),
            env=hub.env(tmp_path / "hf"), capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-4000:]
        fetched = hub.fetched()
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["ids"] == local.ids
    assert mx.array_equal(mx.array(got["embeddings"]), local.embeddings.astype(mx.float32))
    assert {"preprocessor_config.json", "processor_config.json", "model.safetensors"} <= set(fetched)
