"""A vision-language checkpoint's processor: its images' tokens in the prompt, and their pixels.

A model that sees (Gemma 3, Qwen2.5-VL, ...) is a text decoder, which the ring runs as
any model's (``stage/shard.py``, mlx-lm's text path of the checkpoint), and a vision
tower with a projector, which runs where the ring starts (``stage/vision.py``). Both
read a prompt the same way: the chat template writes one marker per image, and the
model's processor (mlx-vlm's, as its ``load`` makes it) expands each marker into the
tokens the image's features take and turns the images into the arrays the tower
reads. The leader needs the ids (to count, admit and key a cached prefix); the first
stage needs the arrays, and makes them from the same text and images with the same
code, so the two agree on the ids (the first stage checks).

mlx-vlm is the ``vision`` extra: imported by the first model with a vision tower.
"""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ringd.base.device import default_cache_dir
from ringd.models.checkpoint import ModelInfo
from ringd.models.errors import ModelError
from ringd.models.gguf.mmproj import GEMMA3_MARKERS, Mmproj
from ringd.models.gguf.reader import GgufFile, written_once

# How to get mlx-vlm, in the refusal of a node without it.
INSTALL_HINT = "install ringd's vision extra (uv sync --extra vision, or pip install 'ringd[vision]')"


def sees(info: ModelInfo) -> bool:
    """Whether a model has a vision tower: its config names one (mlx-vlm's and Hugging Face's
    layout), or a GGUF model has its projector file beside it."""
    return info.mmproj is not None or isinstance(info.config.get("vision_config"), dict)


def source(info: ModelInfo, cache_dir: Path | None = None) -> tuple[Path, dict]:
    """Where mlx-vlm finds the model's processor (a directory of its files), and mlx-vlm's config
    of the model: a checkpoint directory's own; for a GGUF model and its projector file, a
    directory written once under ``cache_dir`` (the GGUF's tokenizer files beside the config and
    processor files the projector's settings make: ``gguf/mmproj.py``)."""
    if info.mmproj is None:
        return info.path, info.config
    projector = Mmproj.open(info.mmproj)
    text = GgufFile.open(info.path).sidecar(cache_dir or default_cache_dir())
    tokenizer = json.loads((text / "tokenizer.json").read_text())
    vocab = {**tokenizer["model"]["vocab"], **{t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])}}
    config = projector.config(info.config, vocab)
    st = info.mmproj.stat()

    def write(out: Path) -> None:
        for f in text.iterdir():
            shutil.copy(f, out / f.name)
        files = {"config.json": config, **projector.processor_files(config)}
        if projector.projector == "gemma3":  # Gemma 3's processor finds its markers by these names
            tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
            files["tokenizer_config.json"] = {**tokenizer_config, "extra_special_tokens": GEMMA3_MARKERS}
        for name, content in files.items():
            (out / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")

    return written_once(text.parent / f"{text.name}-vision-{info.mmproj.stem[:40]}-{st.st_size}-{st.st_mtime_ns}", write), config


def model_of(config: dict):
    """mlx-vlm's model of ``config``, built as its ``load_model`` builds one, its weights not read
    (MLX initializes them lazily: what is never evaluated costs nothing)."""
    import importlib

    utils = mlx_vlm().utils
    module = importlib.import_module(f"mlx_vlm.models.{config['model_type']}")
    raw = json.loads(json.dumps(config))  # from_dict changes what it is given
    return module.Model(utils.update_module_configs(module.ModelConfig.from_dict(raw), module, raw, ["text", "vision", "perceiver", "projector", "audio"]))


def image_token_id(config: dict) -> int | None:
    """The id standing for one position of an image's features in a prompt (it repeats once per
    position): Hugging Face configs name it one of two ways."""
    for key in ("image_token_id", "image_token_index"):
        if type(config.get(key)) is int:
            return config[key]
    return None


@functools.cache
def mlx_vlm():
    """mlx-vlm's package, imported once; a ModelError saying how to install it where it is not."""
    try:
        import mlx_vlm.utils
    except ImportError:
        raise ModelError(f"this model sees images, and mlx-vlm is not installed here: {INSTALL_HINT}") from None
    return mlx_vlm


@dataclass(frozen=True)
class Prepared:
    """A prompt with images, as the model reads it: ``ids`` (each image's marker expanded), and
    ``arrays``: what the vision tower and ``get_input_embeddings`` take (mlx arrays by mlx-vlm's
    names: ``pixel_values``, ``attention_mask``, per family more: Qwen's ``image_grid_thw``)."""

    ids: list[int]
    arrays: dict[str, Any]


class Processor:
    """mlx-vlm's processor of one checkpoint (its tokenizer, image processor, chat template)."""

    def __init__(self, processor: Any, config: dict):
        self.processor = processor
        self.config = config

    @classmethod
    def load(cls, path: Path, config: dict) -> "Processor":
        """The processor of the checkpoint in ``path``, as mlx-vlm's ``load`` makes it. Reads files
        and builds tokenizers: off the event loop."""
        utils = mlx_vlm().utils
        try:
            processor = utils.load_processor(path, True, eos_token_ids=config.get("eos_token_id"))
            image_processor = utils.load_image_processor(path)
        except Exception as e:  # a checkpoint whose processor files mlx-vlm cannot read
            raise ModelError(f"{path}: mlx-vlm cannot load the model's image processor: {type(e).__name__}: {e}") from None
        if image_processor is not None:
            processor.image_processor = image_processor
        return cls(processor, config)

    def prepare(self, text: str, images: Sequence[Any]) -> Prepared:
        """The ids and arrays of a prompt's ``text`` (rendered by the chat template, one marker per
        image) and its ``images`` (Pillow, RGB), as mlx-vlm's ``generate`` prepares them. CPU work
        that grows with the images: off the event loop."""
        utils = mlx_vlm().utils
        model_type = self.config.get("model_type", "")
        inputs = utils.prepare_inputs(
            self.processor,
            images=list(images),
            prompts=text,
            image_token_index=self.config.get("image_token_index"),
            add_special_tokens=utils.should_add_special_tokens(model_type, self.processor),
        )
        ids = inputs.pop("input_ids")
        if ids.shape[0] != 1:
            raise ModelError(f"the processor made {ids.shape[0]} prompts of one")
        return Prepared(ids[0].tolist(), inputs)
