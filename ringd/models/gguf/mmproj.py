"""A GGUF model's projector file (llama.cpp's mmproj): the vision tower and projector of a model that
sees, beside its text GGUF, as mlx-vlm's model holds them.

llama.cpp keeps a vision-language model in two files: the text decoder (``reader.py``) and an
``mmproj-*.gguf`` (arch ``clip``) holding the vision tower, the projector and the image
settings (``clip.vision.*``, ``clip.projector_type``), which llama.cpp's converter writes
with ``--mmproj`` and LM Studio and Hugging Face repositories keep beside the model. Here it
becomes what mlx-vlm reads: the family's config (its ``vision_config`` and the keys its
model and processor take: image token ids, tokens an image), its tensors under mlx-vlm's
names (gguf-py's TensorNameMap read backwards, the converter's own changes undone), and the
processor's files. Projector types ringd reads are PROJECTORS; another is a refusal that
names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from ringd.models.errors import ModelError
from ringd.models.gguf.blocks import GROUP_SIZE
from ringd.models.gguf.reader import Tensor, _parse, read_tensor

# What llama.cpp's converter calls each family's projector (clip.projector_type) and ringd reads.
PROJECTORS = ("gemma3",)
# Gemma 3's markers of an image in its vocabulary: where it starts, each of its tokens, where it ends.
GEMMA3_MARKERS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}


def beside(model: Path) -> Path | None:
    """The projector file beside a GGUF model (``mmproj*.gguf`` in its folder, as llama.cpp's
    converter names it and LM Studio keeps it); None if there is none. Two or more is a
    ModelError: which goes with the model cannot be told."""
    found = sorted(p for p in model.parent.glob("*.gguf") if p.name.lower().startswith("mmproj") and p != model)
    if len(found) > 1:
        raise ModelError(f"{model.parent}: several projector files ({', '.join(p.name for p in found)}) beside {model.name}; keep the one that goes with it")
    return found[0] if found else None


@dataclass
class Mmproj:
    """A parsed projector file: its metadata and tensor table (nothing of the tensors read yet)."""

    path: Path
    meta: dict[str, Any]
    tensors: dict[str, Tensor]

    @classmethod
    def open(cls, path: Path) -> "Mmproj":
        try:
            meta, tensors, _ = _parse(path, path.stat().st_size)
        except OSError as e:
            raise ModelError(f"{path}: cannot read the projector file: {e.strerror}") from None
        if meta.get("general.architecture") != "clip" or not meta.get("clip.has_vision_encoder"):
            raise ModelError(f"{path}: not a projector file with a vision tower (llama.cpp's mmproj, arch clip)")
        projector = meta.get("clip.projector_type")
        if projector not in PROJECTORS:
            raise ModelError(f"{path}: a projector of type {projector!r}; ringd reads {', '.join(PROJECTORS)}'s")
        return cls(path, meta, tensors)

    def _int(self, key: str) -> int:
        v = self.meta.get(key)
        if type(v) is not int or v <= 0:
            raise ModelError(f"{self.path}: {key} must be a positive integer, got {v!r:.40}")
        return v

    def config(self, text: dict, vocab: dict[str, int]) -> dict:
        """mlx-vlm's config of the model: the text decoder's settings (``text``, as the GGUF's reader
        made them) and the vision tower's from this file; the markers' ids from ``vocab``."""
        if text.get("hidden_size") != self._int("clip.vision.projection_dim"):
            raise ModelError(f"{self.path}: projects to {self.meta.get('clip.vision.projection_dim')} wide; the model's text is {text.get('hidden_size')}: not its projector")
        missing = [t for t in GEMMA3_MARKERS.values() if t not in vocab]
        if missing:
            raise ModelError(f"{self.path}: a Gemma 3 projector, but the model's vocabulary has no {', '.join(missing)}")
        image, patch = self._int("clip.vision.image_size"), self._int("clip.vision.patch_size")
        scale = self.meta.get("clip.vision.projector.scale_factor", 4)  # the converter writes it where it is not 4
        tokens = (image // patch // scale) ** 2
        return {
            "model_type": "gemma3",
            "architectures": ["Gemma3ForConditionalGeneration"],
            # mlx-vlm's projector pools by the text config's tokens an image.
            "text_config": {**text, "model_type": "gemma3_text", "mm_tokens_per_image": tokens},
            "vision_config": {
                "model_type": "siglip_vision_model",
                "hidden_size": self._int("clip.vision.embedding_length"),
                "intermediate_size": self._int("clip.vision.feed_forward_length"),
                "num_hidden_layers": self._int("clip.vision.block_count"),
                "num_attention_heads": self._int("clip.vision.attention.head_count"),
                "patch_size": patch,
                "image_size": image,
                "num_channels": 3,
                "layer_norm_eps": float(self.meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
            },
            "mm_tokens_per_image": tokens,
            "hidden_size": text["hidden_size"],  # mlx-vlm scales the image features by it
            "vocab_size": text["vocab_size"],
            "image_token_index": vocab[GEMMA3_MARKERS["image_token"]],
            "boi_token_index": vocab[GEMMA3_MARKERS["boi_token"]],
            "eoi_token_index": vocab[GEMMA3_MARKERS["eoi_token"]],
            "pad_token_id": text.get("pad_token_id", 0),
            "eos_token_id": text.get("eos_token_id"),
        }

    def processor_files(self, config: dict) -> dict[str, dict]:
        """The processor's files mlx-vlm reads (its image processor's settings from this file; the
        tokenizer's markers named as Gemma 3's processor looks them up)."""
        image = config["vision_config"]["image_size"]
        return {
            "preprocessor_config.json": {
                "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
                "size": {"height": image, "width": image}, "resample": 2, "do_resize": True, "do_rescale": True,
                "rescale_factor": 1 / 255, "do_normalize": True,
                "image_mean": list(self.meta.get("clip.vision.image_mean", [0.5] * 3)),
                "image_std": list(self.meta.get("clip.vision.image_std", [0.5] * 3)),
            },
            "processor_config.json": {"processor_class": "Gemma3Processor", "image_seq_length": config["mm_tokens_per_image"]},
        }  # fmt: skip

    def weights(self, model, dtype: mx.Dtype) -> list[tuple[str, mx.array]]:
        """The vision tower's and projector's parameters of mlx-vlm's ``model``, read from this file
        in ``dtype``: each name as llama.cpp's converter names it (``_weight`` made ``.weight``,
        gguf-py's TensorNameMap for MMPROJ), the soft-embedding norm's +1 taken back, the patch
        convolution turned channels-last; a ModelError naming what the file lacks."""
        from gguf import MODEL_ARCH, get_tensor_name_map

        names = [n for n, _ in tree_flatten(model.parameters()) if n.startswith(("vision_tower.", "multi_modal_projector."))]
        tensor_map = get_tensor_name_map(MODEL_ARCH.MMPROJ, self._int("clip.vision.block_count"))
        out, missing = [], []
        for name in names:
            hf = name.replace("_weight", ".weight")
            gguf_name = tensor_map.get_name(hf, try_suffixes=(".weight", ".bias"))
            t = self.tensors.get(gguf_name) if gguf_name else None
            if t is None:
                missing.append(f"{gguf_name or hf} ({name})")
                continue
            x = _float(t)
            if "soft_emb_norm.weight" in hf:
                x = x - 1
            if name.endswith("patch_embedding.weight"):
                x = x.transpose(0, 2, 3, 1)  # torch's [out, in, kh, kw] as MLX's convolution takes it
            out.append((name, x.astype(dtype)))
        if missing:
            raise ModelError(f"{self.path}: the projector file lacks {len(missing)} tensors of the vision tower, e.g. {', '.join(missing[:3])}")
        return out


def _float(t: Tensor) -> mx.array:
    """A tensor of the file as float32 values: a quantized one (some projector files are Q8_0)
    dequantized from MLX's form of its blocks."""
    parts = read_tensor(t.file, t)
    if "scales" not in parts:
        return parts[""].astype(mx.float32)
    form = t.form
    x = mx.dequantize(parts[""], parts["scales"], parts.get("biases"), group_size=GROUP_SIZE, bits=form.bits, mode=form.mode)
    return x.astype(mx.float32)
