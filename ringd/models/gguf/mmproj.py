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

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from ringd.models.errors import ModelError
from ringd.models.gguf.blocks import GROUP_SIZE
from ringd.models.gguf.reader import Tensor, _parse, read_tensor

# What llama.cpp's converter calls each family's projector (clip.projector_type) and ringd reads.
PROJECTORS = ("gemma3", "qwen2.5vl_merger")
# Gemma 3's markers of an image in its vocabulary: where it starts, each of its tokens, where it ends.
GEMMA3_MARKERS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
# Qwen2.5-VL's, by the config key mlx-vlm reads each from.
QWEN_MARKERS = {
    "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>", "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>", "vision_token_id": "<|vision_pad|>",
}  # fmt: skip
# What Qwen2.5-VL's vision tower has that its projector file does not keep (llama.cpp fixes the same):
# patches merged 2 x 2, two frames a patch in time, attention windows of 112 pixels; and the bounds
# on an image's pixels of its own preprocessor_config.json (llama.cpp's default bounds differ).
QWEN_FIXED = {"spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112, "tokens_per_second": 2}
QWEN_PIXELS = (3136, 12845056)
_QWEN_MERGER = re.compile(r"^visual\.merger\.mlp\.(\d+)\.(weight|bias)$")


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

    @property
    def projector(self) -> str:
        return self.meta["clip.projector_type"]

    def config(self, text: dict, vocab: dict[str, int]) -> dict:
        """mlx-vlm's config of the model: the text decoder's settings (``text``, as the GGUF's reader
        made them) and the vision tower's from this file; the markers' ids from ``vocab``."""
        if text.get("hidden_size") != self._int("clip.vision.projection_dim"):
            raise ModelError(f"{self.path}: projects to {self.meta.get('clip.vision.projection_dim')} wide; the model's text is {text.get('hidden_size')}: not its projector")
        markers = QWEN_MARKERS if self.projector == "qwen2.5vl_merger" else GEMMA3_MARKERS
        missing = [t for t in markers.values() if t not in vocab]
        if missing:
            family = "Qwen2.5-VL" if markers is QWEN_MARKERS else "Gemma 3"
            raise ModelError(f"{self.path}: a {family} projector, but the model's vocabulary has no {', '.join(missing)}")
        if markers is QWEN_MARKERS:
            return self._qwen_config(text, vocab)
        image, patch = self._int("clip.vision.image_size"), self._int("clip.vision.patch_size")
        # The converter writes the pooling factor where it is not 4.
        scale = self._int("clip.vision.projector.scale_factor") if "clip.vision.projector.scale_factor" in self.meta else 4
        tokens = (image // patch // scale) ** 2
        if not tokens:
            raise ModelError(f"{self.path}: {image}-pixel images in patches of {patch} pooled by {scale} leave no token")
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

    def _qwen_config(self, text: dict, vocab: dict[str, int]) -> dict:
        """Qwen2.5-VL's: mlx-vlm reads the decoder's settings at the top level (Hugging Face's older
        layout) and in text_config; the tower's full-attention blocks from llama.cpp's pattern
        (every ``n_wa_pattern``-th block); what the file does not keep, QWEN_FIXED."""
        depth, pattern = self._int("clip.vision.block_count"), self._int("clip.vision.n_wa_pattern")
        decoder = {**text, "model_type": "qwen2_5_vl"}
        return {
            **decoder,
            "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "text_config": decoder,
            "vision_config": {
                "model_type": "qwen2_5_vl",
                "depth": depth,
                "hidden_size": self._int("clip.vision.embedding_length"),
                "intermediate_size": self._int("clip.vision.feed_forward_length"),
                "num_heads": self._int("clip.vision.attention.head_count"),
                "out_hidden_size": self._int("clip.vision.projection_dim"),
                "patch_size": self._int("clip.vision.patch_size"),
                "spatial_patch_size": self._int("clip.vision.patch_size"),
                "in_channels": 3,
                "fullatt_block_indexes": [i for i in range(depth) if (i + 1) % pattern == 0],
                **QWEN_FIXED,
            },
            **{key: vocab[token] for key, token in QWEN_MARKERS.items()},
        }

    def processor_files(self, config: dict) -> dict[str, dict]:
        """The processor's files mlx-vlm reads (its image processor's settings from this file; the
        tokenizer's markers named as Gemma 3's processor looks them up)."""
        mean = list(self.meta.get("clip.vision.image_mean", [0.5] * 3))
        std = list(self.meta.get("clip.vision.image_std", [0.5] * 3))
        if self.projector == "qwen2.5vl_merger":
            vision = config["vision_config"]
            return {
                "preprocessor_config.json": {
                    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
                    "patch_size": vision["patch_size"], "temporal_patch_size": vision["temporal_patch_size"],
                    "merge_size": vision["spatial_merge_size"], "min_pixels": QWEN_PIXELS[0], "max_pixels": QWEN_PIXELS[1],
                    "image_mean": mean, "image_std": std, "do_rescale": True, "rescale_factor": 1 / 255,
                    "do_normalize": True, "do_convert_rgb": True,
                },
                "processor_config.json": {"processor_class": "Qwen2_5_VLProcessor"},
            }  # fmt: skip
        image = config["vision_config"]["image_size"]
        return {
            "preprocessor_config.json": {
                "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
                "size": {"height": image, "width": image}, "resample": 2, "do_resize": True, "do_rescale": True,
                "rescale_factor": 1 / 255, "do_normalize": True,
                "image_mean": mean,
                "image_std": std,
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
        if self.projector == "qwen2.5vl_merger":
            return self._qwen_weights(names, tensor_map, dtype)
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


    def _qwen_weights(self, names: list[str], tensor_map, dtype: mx.Dtype) -> list[tuple[str, mx.array]]:
        """Qwen2.5-VL's tower as llama.cpp's Qwen2VLVisionModel wrote it, put back: q, k and v joined
        into mlx-vlm's fused qkv (rows q, then k, then v), the two frames of the patch convolution
        (``v.patch_embd.weight`` and ``.weight.1``, torch's [out, in, kh, kw] each) stacked in time
        and turned channels-last, the merger's MLP ``mm.N``."""
        out, missing = [], []

        def read(gguf_name: str | None, name: str) -> mx.array | None:
            t = self.tensors.get(gguf_name) if gguf_name else None
            if t is None:
                missing.append(f"{gguf_name} ({name})")
                return None
            return _float(t)

        for name in names:
            hf = "visual." + name.removeprefix("vision_tower.")
            if hf.endswith("patch_embed.proj.weight"):
                frames = [read(f"v.patch_embd.weight{suffix}", name) for suffix in ("", ".1")]
                x = None if any(f is None for f in frames) else mx.stack(frames, axis=2).transpose(0, 2, 3, 4, 1)
            elif ".qkv." in hf:
                parts = [read(tensor_map.get_name(hf.replace("qkv", p), try_suffixes=(".weight", ".bias")), name) for p in "qkv"]
                x = None if any(q is None for q in parts) else mx.concatenate(parts, axis=0)
            elif m := _QWEN_MERGER.match(hf):
                x = read(f"mm.{m[1]}.{m[2]}", name)
            else:
                x = read(tensor_map.get_name(hf, try_suffixes=(".weight", ".bias")), name)
            if x is not None:
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
