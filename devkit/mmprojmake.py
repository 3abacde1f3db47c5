"""Projector files (llama.cpp's mmproj) written from tiny mlx-vlm checkpoints the way llama.cpp's
``convert_hf_to_gguf.py --mmproj`` writes them (``MmprojModel``, and the family's own class:
``Gemma3VisionModel``, ``Qwen2VLVisionModel``), for the tests of ringd's reader
(``ringd/models/gguf/mmproj.py``); the text decoder's file is devkit/ggufmake.py's ``write_gguf``.

The checkpoints are mlx-vlm's (its names, which for Gemma 3 are Hugging Face's and for Qwen2.5-VL
its sanitize's; its convolutions channels-last): each step first turns a tensor back into what the
converter reads (Hugging Face's name, torch's layout). Where this departs from llama.cpp it says so.
Followed: convert_hf_to_gguf.py of ggml-org/llama.cpp (Qwen's classes at commit 0024aa74).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
from gguf import MODEL_ARCH, MODEL_TENSOR, LlamaFileType
from gguf import GGMLQuantizationType as Q

from devkit.ggufmake import QTYPES, _encode, _source_tensors


def write_mmproj(model_dir: Path, out: Path, *, qtype: str = "f16") -> Path:
    """The projector file of the mlx-vlm checkpoint in ``model_dir`` (Gemma 3 or Qwen2.5-VL), at ``out``."""
    model_dir, out = Path(model_dir), Path(out)
    hparams = json.loads((model_dir / "config.json").read_text())
    family = {"Gemma3ForConditionalGeneration": _gemma3, "Qwen2_5_VLForConditionalGeneration": _qwen2_5_vl}.get(hparams["architectures"][0])
    if family is None:
        raise ValueError(f"{model_dir}: writes Gemma 3's and Qwen2.5-VL's projectors, not {hparams['architectures'][0]}'s")
    return family(model_dir, out, hparams, qtype)


def _preprocessor_config(model_dir: Path) -> dict:
    """MmprojModel.__init__: preprocessor_config.json, then processor_config.json merged over it."""
    pre: dict = {}
    for name in ("preprocessor_config.json", "processor_config.json"):
        if (model_dir / name).is_file():
            pre.update(json.loads((model_dir / name).read_text()))
    return pre


def _close(writer, out: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _writer(out: Path, model_dir: Path, hparams: dict, ftype: LlamaFileType, blocks: int, heads: int) -> gguf.GGUFWriter:
    """A projector file's writer with what every family's has (MmprojModel.set_type and
    set_gguf_parameters: the clip.vision.* sizes, image mean and std)."""
    vision, pre = hparams["vision_config"], _preprocessor_config(model_dir)
    text = {**hparams, **hparams.get("text_config", {})}
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[MODEL_ARCH.MMPROJ])
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_file_type(ftype)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(text["hidden_size"])
    writer.add_vision_image_size(vision.get("image_size", 560))  # Qwen2VLVisionModel: 560, a placeholder
    writer.add_vision_patch_size(vision["patch_size"])
    writer.add_vision_embedding_length(vision["hidden_size"])
    writer.add_vision_feed_forward_length(vision["intermediate_size"])
    writer.add_vision_block_count(blocks)
    writer.add_vision_head_count(heads)
    writer.add_vision_image_mean(pre["image_mean"])
    writer.add_vision_image_std(pre["image_std"])
    return writer


def _gemma3(model_dir: Path, out: Path, hparams: dict, qtype: str) -> Path:
    """Gemma3VisionModel: arch ``clip``, the ``clip.vision.*`` keys of ``MmprojModel.set_gguf_parameters``
    and the projector's own (its type, layer-norm epsilon, GELU, the pooling factor where it is not
    4); tensors of the vision tower and projector only (``filter_tensors``), ``_weight`` names made
    ``.weight`` ones, the soft-embedding norm stored plus one, named by gguf-py's ``TensorNameMap``
    for MMPROJ, typed by ``tensor_force_quant`` (the input projection F16 whatever ``qtype``, the
    embeddings F32, the patch embedding as the file)."""
    vision = hparams["vision_config"]
    ftype, default = QTYPES[qtype]
    writer = _writer(out, model_dir, hparams, ftype, vision["num_hidden_layers"], vision["num_attention_heads"])
    writer.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    writer.add_vision_attention_layernorm_eps(vision.get("layer_norm_eps", 1e-6))
    writer.add_vision_use_gelu(True)
    n_per_side = int(_preprocessor_config(model_dir).get("image_seq_length", 256) ** 0.5)
    scale = (vision["image_size"] // vision["patch_size"]) // n_per_side
    if scale > 0 and scale != 4:
        writer.add_vision_projector_scale_factor(scale)
    tensor_map = gguf.get_tensor_name_map(MODEL_ARCH.MMPROJ, vision["num_hidden_layers"])
    for name, x in _source_tensors(model_dir):
        if "language_model." in name or not name.startswith(("multi_modal_projector.", "vision_tower.")):
            continue
        if name.endswith("patch_embedding.weight"):
            x = x.transpose(0, 3, 1, 2)  # MLX's [out, kh, kw, in] back to torch's [out, in, kh, kw]
        name = name.replace("_weight", ".weight")
        if "soft_emb_norm.weight" in name:
            x = x + 1
        new_name = tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            raise ValueError(f"{model_dir}: gguf-py names no MMPROJ tensor for {name}")
        x = x.squeeze()
        if "input_projection" in name:
            t = Q.F16
        elif ".embeddings." in name and not new_name.endswith("patch_embd.weight"):
            t = Q.F32
        elif x.ndim <= 1:
            t = Q.F32
        else:
            t = default
        data, t = _encode(x, t, asked=False)
        writer.add_tensor(new_name, data, raw_dtype=t)
    return _close(writer, out)


_MERGER_MLP = re.compile(r"^visual\.merger\.mlp\.(\d+)\.(weight|bias)$")


def _qwen2_5_vl(model_dir: Path, out: Path, hparams: dict, qtype: str) -> Path:
    """Qwen2VLVisionModel for model_type qwen2_5_vl: projector type ``qwen2.5vl_merger``, SiLU, the
    window-attention pattern (``n_wa_pattern``: every k-th block attends fully, from
    ``fullatt_block_indexes``), the layer-norm epsilon of the text (the global config's
    ``rms_norm_eps``); tensors: the fused qkv cut in thirds (``attn_q``/``attn_k``/``attn_v``), the
    Conv3D patch embedding cut along time into ``v.patch_embd.weight`` and ``.weight.1`` (the
    converter allows a temporal patch of 2 only), the rest by gguf-py's TensorNameMap."""
    vision = hparams["vision_config"]
    ftype, default = QTYPES[qtype]
    writer = _writer(out, model_dir, hparams, ftype, vision["depth"], vision["num_heads"])
    writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN25VL)
    writer.add_vision_use_silu(True)
    full = vision["fullatt_block_indexes"]
    n_wa_pattern = full[0] + 1
    if any(b - a != n_wa_pattern for a, b in zip(full, full[1:])):
        raise ValueError(f"Invalid fullatt_block_indexes: {full}")
    writer.add_vision_n_wa_pattern(n_wa_pattern)
    writer.add_vision_attention_layernorm_eps(hparams.get("rms_norm_eps", 1e-6))
    tensor_map = gguf.get_tensor_name_map(MODEL_ARCH.MMPROJ, vision["depth"])
    for name, x in _source_tensors(model_dir):
        if not name.startswith("vision_tower."):
            continue  # filter_tensors: the text decoder's are the other file's
        name = "visual." + name.removeprefix("vision_tower.")  # mlx-vlm's sanitize, undone
        if name.endswith("patch_embed.proj.weight"):
            x = x.transpose(0, 4, 1, 2, 3)  # MLX's [out, t, kh, kw, in] back to torch's [out, in, t, kh, kw]
            if x.shape[2] != 2:
                raise ValueError("Current implementation only support temporal_patch_size of 2")
            base = gguf.TENSOR_NAMES[MODEL_TENSOR.V_ENC_EMBD_PATCH]
            parts = [(base + ".weight", x[:, :, 0]), (base + ".weight.1", x[:, :, 1])]
        elif ".qkv." in name:
            c = x.shape[0] // 3
            parts = [(_mmproj_name(tensor_map, name.replace("qkv", p)), x[i * c : (i + 1) * c]) for i, p in enumerate("qkv")]
        else:
            parts = [(_mmproj_name(tensor_map, name), x)]
        for new_name, data in parts:
            if data.ndim <= 1:
                t = Q.F32
            elif ".patch_embd.weight" in new_name:  # MmprojModel.tensor_force_quant
                t = Q.F16 if ftype == LlamaFileType.MOSTLY_F16 else Q.F32
            else:
                t = default
            encoded, t = _encode(np.ascontiguousarray(data), t, asked=False)
            writer.add_tensor(new_name, encoded, raw_dtype=t)
    return _close(writer, out)


def _mmproj_name(tensor_map: gguf.TensorNameMap, name: str) -> str:
    """ModelBase.map_tensor_name. Departure: the converter names the merger's ``mlp.2`` through a map
    built for the tower's blocks, so a tower of fewer than 3 cannot name it and the converter stops;
    every real Qwen2.5-VL (32 blocks) gets ``mm.2``, given here too."""
    new_name = tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
    if new_name is not None:
        return new_name
    if m := _MERGER_MLP.match(name):
        return gguf.TENSOR_NAMES[MODEL_TENSOR.V_MMPROJ].format(bid=int(m.group(1))) + "." + m.group(2)
    raise ValueError(f"Can not map tensor {name!r}")
