"""GGUF files written from tiny mlx-lm model directories the way llama.cpp's own tools write them.

``ringd.models.gguf.reader`` reads GGUF files. Testing it on files it wrote itself would only prove
that it agrees with itself, and there is one real GGUF here (SmolLM2, a llama). So this
writes GGUFs of other architectures from the tiny models of ``ringd.models.tinymodel``, step
by step as llama.cpp does, with llama.cpp's own Python package (gguf-py) and without
looking at ringd's reader:

- ``convert_hf_to_gguf.py`` (qtype f32, f16, bf16, q8_0, its ``--outtype``s): the
  metadata (``TextModel.set_gguf_parameters`` plus what ``LlamaModel``,
  ``Qwen2MoeModel`` and ``Gemma3Model`` add; ``Phi3MiniModel``'s and ``Gemma2Model``'s
  own), tensor names (gguf-py's ``TensorNameMap``), the Q/K permutation of
  ``LlamaModel.modify_tensors``, expert stacking (Qwen2MoeModel's, and LlamaModel's
  for Mixtral), Gemma's norms stored plus one and Gemma 3's embedding cut to the
  vocabulary (``Gemma2Model``/``Gemma3Model.modify_tensors``), Mistral 3's text
  decoder without its vision tower (``Mistral3Model``, written as arch mistral3 by its
  ``Ministral3Model``), the squeeze and tensor types of ``ModelBase.prepare_tensors``
  and the vocabulary of ``_set_vocab_gpt2``; and for the MoE families with converters
  of their own (``DeepseekV2Model``, ``Glm4MoeModel``, ``GptOssModel``,
  ``MiniMaxM2Model``, ``Qwen3NextModel``), a ``Converter``'s ``modify`` and ``params``,
  from an mlx-lm checkpoint (whose sanitize has already done some of the converter's
  work, each says which);
- ``llama-quantize`` (qtype q4_0, q4_1) on top of that: the type rules of
  ``llama_tensor_get_type`` in ``src/llama-quant.cpp`` that apply to these types.

Each step below names the function it follows. Where this departs from llama.cpp it
says so: the tiny tokenizer's pre-tokenizer hash is unknown to the converter (which
would stop), so ``tokenizer.ggml.pre`` is given (``pre=``, "gpt-2" by default, the
name llama.cpp gives GPT-2's ByteLevel split); Phi-3's and Gemma 2's converters take a
SentencePiece ``tokenizer.model``, which the tiny models do not have, so their byte-level
BPE is written by ``_set_vocab_gpt2`` as Phi-4's and Gemma 3's converters write such a
tokenizer; the tiny models are saved as mlx-lm saves them, Mixtral's and Qwen2-MoE's experts
already stacked (``switch_mlp``), which is the tensor the converter stacks from HF's
per-expert ones; the tiny qwen3_moe has a dense first
layer that llama.cpp's qwen3moe cannot name (see ``_stacked_experts``); rows that no
block type fits fall back to F16 as the converter does, where llama-quantize would stop.

RoPE scaling: llama3's, as ``LlamaModel.generate_extra_tensors`` writes it (the
``rope_freqs`` tensor, no metadata), linear and YaRN, as ``TextModel.set_gguf_parameters``
writes them (Gemma 3's global layers take linear), and Phi-3's LongRoPE, as
``Phi3MiniModel.generate_extra_tensors`` writes it (``rope_factors_long``/``rope_factors_short``
and an attention factor); any other is refused.

What it deliberately ignores: SentencePiece vocabularies, other RoPE scalings, the families'
own vocabularies (GLM's ``_set_vocab_glm``), NextN/MTP layers, multimodal towers, and any
architecture not in ``CONVERTERS``.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import gguf
import numpy as np
from gguf import MODEL_ARCH, MODEL_TENSOR, LlamaFileType
from gguf import GGMLQuantizationType as Q

from devkit import kquants

# qtype -> (general.file_type, the type of the 2-D weights). The first four are
# convert_hf_to_gguf.py's --outtype (ALL_F32 .. MOSTLY_Q8_0); the Q4s are llama-quantize's.
QTYPES: dict[str, tuple[LlamaFileType, Q]] = {
    "f32": (LlamaFileType.ALL_F32, Q.F32),
    "f16": (LlamaFileType.MOSTLY_F16, Q.F16),
    "bf16": (LlamaFileType.MOSTLY_BF16, Q.BF16),
    "q8_0": (LlamaFileType.MOSTLY_Q8_0, Q.Q8_0),
    "q4_0": (LlamaFileType.MOSTLY_Q4_0, Q.Q4_0),
    "q4_1": (LlamaFileType.MOSTLY_Q4_1, Q.Q4_1),
}
LLAMA_QUANTIZE_QTYPES = ("q4_0", "q4_1")

# The pre-tokenizer name llama.cpp's llama-vocab.cpp maps to LLAMA_VOCAB_PRE_TYPE_GPT2:
# GPT-2's regex, which is the split of the tiny tokenizer's ByteLevel pre-tokenizer.
DEFAULT_PRE = "gpt-2"

# Weights a row of this many elements at least: the K-quants' super-block (QK_K in ggml).
QK_K = 256


@dataclass(frozen=True)
class Converter:
    """What convert_hf_to_gguf.py's class for one HF architecture does differently."""

    arch: MODEL_ARCH
    llama: bool = False  # LlamaModel: Q/K permuted, vocab_size and rope.dimension_count written
    moe: bool = False  # Qwen2MoeModel: experts stacked, expert_feed_forward_length written
    # A family's own modify_tensors, after the common steps: (HF name, block id, array, hparams,
    # a dict it may keep tensors in between calls) -> the (name, block id, array) it passes on.
    modify: Callable[[str, int | None, np.ndarray, dict, dict], Iterator[tuple[str, int | None, np.ndarray]]] | None = None
    # A family's own set_gguf_parameters, after TextModel's: (writer, hparams).
    params: Callable[[Any, dict], None] | None = None
    # LlamaModel.modify_tensors for Mixtral: block_sparse_moe's experts stacked (w1 gate, w2 down, w3 up)
    mixtral: bool = False
    # GemmaModel/Gemma2Model.modify_tensors, Gemma3Model.norm_shift: every "*norm.weight" stored + 1
    norm_shift: bool = False
    # Gemma3Model.modify_tensors: token_embd cut to the tokenizer's real vocabulary
    trim_vocab: bool = False
    # Mistral3Model.modify_tensors (name.replace("language_model.", "")): the text decoder of a
    # multimodal checkpoint, its vision tower and projector left out
    text_of_multimodal: bool = False
    skip: tuple[str, ...] = ()  # filter_tensors: checkpoint tensors not written (Gemma2Model: lm_head)
    # The class's own set_gguf_parameters (phi3, gemma2, gemma3), else TextModel's and the flags' above
    parameters: str = "text"


# Registered by config.json's architectures[0], as ModelBase.register does.
CONVERTERS: dict[str, Converter] = {
    "LlamaForCausalLM": Converter(MODEL_ARCH.LLAMA, llama=True),
    "MistralForCausalLM": Converter(MODEL_ARCH.LLAMA, llama=True),
    "MixtralForCausalLM": Converter(MODEL_ARCH.LLAMA, llama=True, mixtral=True),  # LlamaModel
    # Mistral3Model.Ministral3Model (a LlamaModel) for a text_config of model_type "mistral"
    "Mistral3ForConditionalGeneration": Converter(MODEL_ARCH.MISTRAL3, llama=True, text_of_multimodal=True),
    "Qwen2ForCausalLM": Converter(MODEL_ARCH.QWEN2),
    "Qwen2MoeForCausalLM": Converter(MODEL_ARCH.QWEN2MOE, moe=True),  # Qwen2MoeModel
    "Qwen3ForCausalLM": Converter(MODEL_ARCH.QWEN3),
    "Qwen3MoeForCausalLM": Converter(MODEL_ARCH.QWEN3MOE, moe=True),
    "DeepseekV2ForCausalLM": Converter(MODEL_ARCH.DEEPSEEK2, moe=True, modify=lambda *a: _deepseek2_tensors(*a), params=lambda *a: _deepseek2_params(*a)),
    "DeepseekV3ForCausalLM": Converter(MODEL_ARCH.DEEPSEEK2, moe=True, modify=lambda *a: _deepseek2_tensors(*a), params=lambda *a: _deepseek2_params(*a)),
    "Glm4MoeForCausalLM": Converter(MODEL_ARCH.GLM4_MOE, moe=True, modify=lambda *a: _glm4moe_tensors(*a), params=lambda *a: _glm4moe_params(*a)),
    "MiniMaxM2ForCausalLM": Converter(MODEL_ARCH.MINIMAXM2, moe=True, modify=lambda *a: _minimax_m2_tensors(*a), params=lambda *a: _minimax_m2_params(*a)),
    "Qwen3NextForCausalLM": Converter(MODEL_ARCH.QWEN3NEXT, moe=True, modify=lambda *a: _qwen3next_tensors(*a), params=lambda *a: _qwen3next_params(*a)),
    "GptOssForCausalLM": Converter(MODEL_ARCH.GPT_OSS, moe=True, modify=lambda *a: _gpt_oss_tensors(*a), params=lambda *a: _gpt_oss_params(*a)),
    "Phi3ForCausalLM": Converter(MODEL_ARCH.PHI3, parameters="phi3"),  # Phi3MiniModel
    "Gemma2ForCausalLM": Converter(MODEL_ARCH.GEMMA2, norm_shift=True, skip=("lm_head.weight",), parameters="gemma2"),  # Gemma2Model
    "Gemma3ForCausalLM": Converter(MODEL_ARCH.GEMMA3, norm_shift=True, trim_vocab=True, parameters="gemma3"),  # Gemma3Model
    # Qwen2VLModel: Qwen2's decoder, its multimodal RoPE's sections written; the vision tower goes to
    # the mmproj file (devkit/mmprojmake.py)
    "Qwen2_5_VLForConditionalGeneration": Converter(MODEL_ARCH.QWEN2VL, text_of_multimodal=True, params=lambda *a: _qwen2vl_parameters(*a)),
    # Gemma3Model for a multimodal checkpoint: its text decoder ("language_model." dropped); the
    # vision tower and projector go to the mmproj file (devkit/mmprojmake.py)
    "Gemma3ForConditionalGeneration": Converter(MODEL_ARCH.GEMMA3, norm_shift=True, trim_vocab=True, text_of_multimodal=True, parameters="gemma3"),
}


def write_gguf(
    model_dir: Path,
    out: Path,
    *,
    qtype: str = "f32",
    types: dict[str, str] | None = None,
    arch: str | None = None,
    pre: str = DEFAULT_PRE,
    dequantized: bool = False,
    split_max_tensors: int = 0,
    split_experts: bool = False,
) -> Path:
    """Write the unquantized mlx-lm model in ``model_dir`` to the GGUF file ``out``; return ``out``.

    ``qtype`` is the file's type (``QTYPES``): 1-D tensors, norms and MoE routers stay
    F32 whatever it is, as llama.cpp keeps them. ``types`` overrides the type of single
    tensors by GGUF name (``{"token_embd.weight": "q8_0"}``); a type gguf-py cannot
    quantize (the K-quants, IQ types) is written as zero blocks of the right size,
    which needs rows that are a whole number of its blocks (256 weights for a K-quant).
    ``arch`` overrides ``general.architecture`` (and so the prefix of its keys), to
    make files of architectures a reader must refuse. ``pre`` is ``tokenizer.ggml.pre``.
    ``dequantized`` writes the same file with every tensor, once quantized, turned back
    into F32 by gguf-py's ``dequantize`` (the reference a reader of the quantized file is
    checked against). ``split_max_tensors``: split the file as ``convert_hf_to_gguf.py
    --split-max-tensors N`` does (gguf-py's writer: OUT-00001-of-0000K.gguf, ...); the first
    part's path is returned.
    checked against). ``split_experts`` writes each expert's matrices as tensors of their own
    (``blk.N.ffn_gate.X.weight``), as the converter wrote Mixtral before llama.cpp stacked
    them (April 2024; its loader still merges them, LLM_TENSOR_FFN_GATE_EXP).
    """
    model_dir, out = Path(model_dir), Path(out)
    if qtype not in QTYPES:
        raise ValueError(f"qtype {qtype!r}: expected one of {', '.join(QTYPES)}")
    hparams = json.loads((model_dir / "config.json").read_text())
    if "quantization" in hparams:
        raise ValueError(f"{model_dir} is an mlx-lm quantized model; write the GGUF from an unquantized one")
    if "text_config" in hparams:  # TextModel.__init__: the text config moved to the root
        hparams = {**hparams, **hparams["text_config"]}
    hf_arch = hparams["architectures"][0]
    if hf_arch not in CONVERTERS:
        raise ValueError(f"{model_dir}: {hf_arch} is not written by this helper (it writes {', '.join(CONVERTERS)})")
    conv = CONVERTERS[hf_arch]
    ftype, default_type = QTYPES[qtype]
    overrides = {name: _qtype(t) for name, t in (types or {}).items()}

    writer = gguf.GGUFWriter(str(out), arch or gguf.MODEL_ARCH_NAMES[conv.arch], split_max_tensors=split_max_tensors)
    # ModelBase.write: prepare_tensors, then prepare_metadata (which counts the parameters).
    written = _add_tensors(writer, model_dir, hparams, conv, qtype, default_type, overrides, dequantized, split_experts)
    unknown = sorted(set(overrides) - written)
    if unknown:
        raise ValueError(f"types names tensors the file does not have: {', '.join(unknown)}")
    _add_metadata(writer, model_dir, hparams, conv, ftype)
    _add_vocab(writer, model_dir, hparams, conv, pre)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(out)[0]


def _qtype(name: str) -> Q:
    try:
        return Q[name.upper()]
    except KeyError:
        raise ValueError(f"unknown GGUF tensor type {name!r} (gguf-py's GGMLQuantizationType names)") from None


# ------------------------------------------------------------------ tensors


def permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """LlamaModel.permute: HF's rotate-half Q/K rows to the interleaved pairs llama.cpp's RoPE takes."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _source_tensors(model_dir: Path):
    """(name, float32 array) in the converter's order: part files sorted, names sorted within each
    (ModelBase.index_tensors with gguf-py's SafetensorsLocal). Every dtype becomes float32 as in
    prepare_tensors (it keeps F16 as is; quantizing its exact float32 copy gives the same bytes)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        parts = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        parts = sorted(p.name for p in model_dir.iterdir() if p.name.startswith("model") and p.name.endswith(".safetensors"))
    for part in parts:
        with gguf.utility.SafetensorsLocal(model_dir / part) as tensors:
            for name, t in tensors.items():
                raw = t.mmap_bytes()
                if t.dtype == "BF16":  # bfloat16 is the top half of a float32
                    x = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
                elif t.dtype in ("F16", "F32"):
                    x = raw.view(np.float16 if t.dtype == "F16" else np.float32).astype(np.float32)
                else:
                    raise ValueError(f"{part}: {name} is {t.dtype}; only F32, F16 and BF16 checkpoints are written")
                yield name, x.reshape(t.shape)


_LAYER = re.compile(r"\.layers\.(\d+)\.")
# mlx-lm's sanitize stacks a layer's experts into mlp.switch_mlp.<proj>; the converter
# stacks HF's mlp.experts.<i>.<proj> into mlp.experts.<proj> (Qwen2MoeModel.modify_tensors).
_MLX_EXPERTS = re.compile(r"^(.*\.mlp)\.switch_mlp\.(gate_proj|up_proj|down_proj)\.weight$")
_HF_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_DENSE_FFN = {"gate_proj": MODEL_TENSOR.FFN_GATE, "up_proj": MODEL_TENSOR.FFN_UP, "down_proj": MODEL_TENSOR.FFN_DOWN}
_MLX_EXPERTS_MIXTRAL = re.compile(r"^(.*\.block_sparse_moe)\.switch_mlp\.(gate_proj|up_proj|down_proj)\.weight$")
_MIXTRAL_W = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_STACKED = re.compile(r"^(blk\.\d+\.ffn_(?:gate|down|up))_exps\.weight$")


def _real_vocab_size(model_dir: Path) -> int:
    """Gemma3Model.modify_tensors' n_vocab_real for a tokenizer.json without tokenizer.model."""
    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    return len(tokenizer_json["model"]["vocab"]) + len(tokenizer_json["added_tokens"])


def _modified(model_dir: Path, hparams: dict, conv: Converter):
    """(HF name, block id, array) after each converter's modify_tensors, in its order."""
    n_head = hparams["num_attention_heads"]
    n_kv_head = hparams["num_key_value_heads"]
    experts: dict[int, dict[str, np.ndarray]] = {}
    held: dict[str, np.ndarray] = {}  # what a family's modify keeps until its other half comes
    for name, x in _source_tensors(model_dir):
        if conv.text_of_multimodal:
            if "multi_modal_projector" in name or "vision_tower" in name:
                continue
            name = name.replace("language_model.", "")
        if name in conv.skip:
            continue
        m = _LAYER.search(name)
        bid = int(m.group(1)) if m else None  # prepare_tensors: the first number-like part
        if conv.trim_vocab and "embed_tokens.weight" in name:
            x = x[: _real_vocab_size(model_dir)]
        if conv.norm_shift and name.endswith("norm.weight"):
            x = x + 1  # "Gemma3RMSNorm adds 1.0 to the norm value"
        if conv.mixtral and (m := _MLX_EXPERTS_MIXTRAL.match(name)):
            # mlx-lm's sanitize stacked HF's experts.{i}.w1 (gate), w3 (up), w2 (down) in expert
            # order, as the converter stacks them into feed_forward.experts.w*
            yield f"layers.{bid}.feed_forward.experts.{_MIXTRAL_W[m.group(2)]}.weight", bid, x
            continue
        if conv.llama:
            # LlamaModel.modify_tensors (undo_permute): q with n_head, k with n_head_kv.
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                x = permute(x, n_head, n_head)
            if name.endswith(("k_proj.weight", "k_proj.bias")):
                x = permute(x, n_head, n_kv_head)
        if conv.modify is not None:
            for name, bid, x in conv.modify(name, bid, x, hparams, held):
                yield name, bid, x
            continue
        if conv.moe and (m := _MLX_EXPERTS.match(name)):
            yield f"{m.group(1)}.experts.{m.group(2)}.weight", bid, x  # already the stacked tensor
            continue
        if conv.moe and (m := _HF_EXPERT.match(name)):
            layer = experts.setdefault(bid, {})
            layer[name] = x
            n_experts = hparams["num_experts"]
            if len(layer) >= n_experts * 3:  # Qwen2MoeModel.modify_tensors: stack once all are in
                for w_name in ("down_proj", "gate_proj", "up_proj"):
                    stacked = np.stack([layer.pop(f"{m.group(1)}.experts.{i}.{w_name}.weight") for i in range(n_experts)])
                    yield f"{m.group(1)}.experts.{w_name}.weight", bid, stacked
            continue
        yield name, bid, x
    left = [k for layer in experts.values() for k in layer] + list(held)
    if left:
        raise ValueError(f"unprocessed experts (not all {hparams['num_experts']} of a layer found): {left}")


def _gguf_name(tensor_map: gguf.TensorNameMap, name: str, bid: int | None, conv: Converter) -> str:
    """ModelBase.map_tensor_name, and the one name it has no answer for here.

    The tiny qwen3_moe keeps layer 0 dense (mlp_only_layers=[0]); real Qwen3-MoE
    checkpoints have no dense layer and gguf-py's QWEN3MOE has no dense FFN tensors, so
    the converter would stop there. It is written under the names llama.cpp gives dense
    FFNs in every other architecture (blk.0.ffn_gate.weight, ...), so that a reader can
    still tell which layers are dense. llama.cpp itself would not load such a file.
    """
    if name.startswith("blk."):  # named by the converter itself (format_tensor_name), not mapped
        return name
    new_name = tensor_map.get_name(key=name, try_suffixes=(".weight", ".bias"))
    if new_name is not None:
        return new_name
    proj = name.rsplit(".", 2)[-2] if name.endswith(".weight") else None
    if conv.moe and bid is not None and proj in _DENSE_FFN and ".mlp." in name:
        return gguf.TENSOR_NAMES[_DENSE_FFN[proj]].format(bid=bid) + ".weight"
    raise ValueError(f"Can not map tensor {name!r}")


def _converter_type(new_name: str, x: np.ndarray, bid: int | None, arch: MODEL_ARCH, default: Q) -> Q:
    """ModelBase.prepare_tensors' choice for one tensor (tensor_force_quant is False for these)."""
    if x.ndim <= 1 or new_name.endswith("_norm.weight"):
        return Q.F32  # "Most of the codebase that takes in 1D tensors or norms only handles F32 tensors"
    routers = (MODEL_TENSOR.FFN_GATE_INP, MODEL_TENSOR.FFN_GATE_INP_SHEXP)
    if any(_is(new_name, key, bid, arch) for key in routers) or new_name[-7:] not in (".weight", ".lora_a", ".lora_b"):
        return Q.F32  # the routers, as llama_model_quantize_internal keeps them
    if any(_is(new_name, key, bid, arch) for key in (MODEL_TENSOR.FFN_GATE_INP_SHEXP, MODEL_TENSOR.SSM_CONV1D)):
        return Q.F32  # in prepare_tensors' list of tensors kept F32
    return default


def _llama_quantize_type(new_name: str, x: np.ndarray, current: Q, default: Q, tied: bool, n_expert: int) -> Q:
    """llama_tensor_get_type for Q4_0/Q4_1 files, from the converter's type ``current``.

    tensor_allows_quantization: only 2-D and 3-D ``*weight`` tensors that are no norm and
    no router are requantized. The output (or a tied token embedding) gets Q6_K where
    its rows hold whole super-blocks, else Q8_0 (Q6_K's fallback); attn_k and attn_v go
    to Q8_0 in 8-expert models. Everything else for Q4_0/Q4_1 is the default type.
    """
    quantizable = new_name.endswith("weight") and x.ndim >= 2
    if not quantizable or "_norm.weight" in new_name or "ffn_gate_inp.weight" in new_name:
        return current
    if new_name == "output.weight" or (tied and new_name == "token_embd.weight"):
        return Q.Q6_K if x.shape[-1] % QK_K == 0 else Q.Q8_0
    if n_expert == 8 and (".attn_v." in new_name or ".attn_k." in new_name):
        return Q.Q8_0
    return default


def _is(name: str, key: MODEL_TENSOR, bid: int | None, arch: MODEL_ARCH) -> bool:
    """ModelBase.match_model_tensor_name."""
    if key not in gguf.MODEL_TENSORS[arch]:
        return False
    key_name = gguf.TENSOR_NAMES[key]
    if "{bid}" in key_name:
        if bid is None:
            return False
        key_name = key_name.format(bid=bid)
    elif bid is not None:
        return False
    return name == key_name + ".weight"


def _encode(x: np.ndarray, qtype: Q, *, asked: bool) -> tuple[np.ndarray, Q]:
    """The tensor's bytes in ``qtype`` (gguf.quants.quantize), and the type they are in.

    A row that is no whole number of blocks falls back to F16, as prepare_tensors does on
    gguf.QuantError, unless the type was ``asked`` for by name (then it is an error). Q4_K,
    Q5_K and Q6_K are quantized by llama.cpp's reference quantizers (``kquants.py``); a
    type neither can quantize (the other K-quants, IQ types) is written as zero blocks.
    """
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if x.shape[-1] % block != 0:
        if asked:
            raise ValueError(f"{qtype.name} needs rows that are a multiple of {block} weights; this tensor's are {x.shape[-1]}")
        qtype = Q.F16
    if qtype.name in kquants.QUANTIZERS:  # what gguf-py cannot quantize, llama.cpp's reference (ported)
        return kquants.QUANTIZERS[qtype.name](x), qtype
    try:
        return gguf.quants.quantize(x, qtype), qtype
    except NotImplementedError:
        return np.zeros((*x.shape[:-1], x.shape[-1] // block * type_size), dtype=np.uint8), qtype


def _split_experts(tensors: list) -> list:
    """Stacked experts as the early format's tensors, one an expert (blk.N.ffn_gate.X.weight), in the
    order the early converter wrote them, the checkpoint's: expert by expert, w1 (gate), w2 (down),
    w3 (up) of each, so that no kind's experts lie side by side in the file."""
    out, layer = [], {}
    for name, bid, x in tensors:
        if not (m := _STACKED.match(name)):
            out.append((name, bid, x))
            continue
        layer[m.group(1).rsplit("_", 1)[1]] = (m.group(1), x)
        if len(layer) == 3:
            for i in range(len(x)):
                out += [(f"{layer[kind][0]}.{i}.weight", bid, layer[kind][1][i]) for kind in ("gate", "down", "up")]
            layer = {}
    return out


def _add_tensors(
    writer, model_dir: Path, hparams: dict, conv: Converter, qtype: str, default: Q, overrides: dict[str, Q], dequantized: bool = False,
    split_experts: bool = False,
) -> set[str]:
    """ModelBase.prepare_tensors (and llama-quantize for the Q4s); the GGUF names written."""
    block_count = hparams["num_hidden_layers"]
    tensor_map = gguf.get_tensor_name_map(conv.arch, block_count)
    # prepare_tensors squeezes every tensor ("necessary for reloading in transformers"): a
    # (1, hidden) matrix such as Qwen2-MoE's shared expert gate is written as a vector.
    tensors = [(_gguf_name(tensor_map, name, bid, conv), bid, x.squeeze()) for name, bid, x in _modified(model_dir, hparams, conv)]
    # prepare_tensors chains generate_extra_tensors() before the checkpoint's own.
    tensors = _extra_tensors(hparams, conv) + tensors
    if split_experts:
        tensors = _split_experts(tensors)
    tied = not any(name == "output.weight" for name, _, _ in tensors)
    n_expert = hparams.get("num_local_experts") or hparams.get("num_experts") or 0
    if qtype in LLAMA_QUANTIZE_QTYPES:
        # llama-quantize reads a file the converter wrote (its f32 here: the same values
        # as the bf16 source) and requantizes its tensors.
        first = Q.F32
    else:
        first = default
    for new_name, bid, x in tensors:
        if new_name in overrides:
            t = overrides[new_name]
        else:
            t = _converter_type(new_name, x, bid, conv.arch, first)
            if qtype in LLAMA_QUANTIZE_QTYPES:
                t = _llama_quantize_type(new_name, x, t, default, tied, n_expert)
        data, t = _encode(x, t, asked=new_name in overrides)
        if dequantized and t != Q.F32:
            data, t = gguf.quants.dequantize(data, t), Q.F32
        writer.add_tensor(new_name, data, raw_dtype=t)
    return {name for name, _, _ in tensors}


def _phi3_rope_factors(hparams: dict) -> list:
    """Phi3MiniModel.generate_extra_tensors: LongRoPE's per-frequency factors, long and short, as
    ``rope_factors_long.weight`` and ``rope_factors_short.weight`` (F32)."""
    rope = hparams.get("rope_parameters", hparams.get("rope_scaling")) or {}
    long_factors, short_factors = rope.get("long_factor"), rope.get("short_factor")
    if not long_factors:
        return []
    rope_dims = int(rope.get("partial_rotary_factor", hparams.get("partial_rotary_factor", 1.0)) * hparams["hidden_size"]) // hparams["num_attention_heads"]
    if len(long_factors) != len(short_factors) or len(long_factors) != rope_dims / 2:
        raise ValueError(f"The length of rope long and short factors must be {rope_dims / 2}")
    return [
        (gguf.TENSOR_NAMES[MODEL_TENSOR.ROPE_FACTORS_LONG] + ".weight", None, np.array(long_factors, dtype=np.float32)),
        (gguf.TENSOR_NAMES[MODEL_TENSOR.ROPE_FACTORS_SHORT] + ".weight", None, np.array(short_factors, dtype=np.float32)),
    ]


def _phi3_attn_factor(hparams: dict) -> float | None:
    """The attention factor Phi3MiniModel.generate_extra_tensors writes beside LongRoPE's factors."""
    import math

    rope = hparams.get("rope_parameters", hparams.get("rope_scaling")) or {}
    if not rope.get("long_factor"):
        return None
    orig = rope.get("original_max_position_embeddings", hparams["original_max_position_embeddings"])
    scale = _find(hparams, ["n_positions", "max_position_embeddings"]) / orig
    kind = rope.get("rope_type", rope.get("type", "")).lower()
    if kind in ("su", "longrope"):
        return math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
    if kind == "yarn":
        return 0.1 * math.log(scale) + 1.0 if scale > 1.0 else 1.0
    raise NotImplementedError(f"The rope scaling type {kind} is not supported yet")


def _extra_tensors(hparams: dict, conv: Converter) -> list:
    """LlamaModel.generate_extra_tensors: for llama3's RoPE scaling, the factor each frequency is
    divided by, as ``rope_freqs.weight`` (F32). Note ``old_context_len`` comes from the top-level
    config there (default 8192), not from rope_scaling: followed as it is. Phi3MiniModel's: its
    LongRoPE factors."""
    import math

    if conv.parameters == "phi3":
        return _phi3_rope_factors(hparams)
    rope = hparams.get("rope_scaling") or {}
    if not conv.llama or rope.get("rope_type", "").lower() != "llama3":
        return []
    base = hparams.get("rope_theta", 10000.0)
    dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor = rope.get("low_freq_factor", 1.0)
    high_freq_factor = rope.get("high_freq_factor", 4.0)
    old_context_len = hparams.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return [("rope_freqs.weight", None, np.array(factors, dtype=np.float32))]


# ----------------------------------------------------------------- metadata


# The config keys TextModel.__init__ / set_gguf_parameters try, in order.
_CONTEXT_KEYS = ["max_position_embeddings", "n_ctx", "n_positions", "max_length", "max_sequence_length", "model_max_length"]
_ROPE_THETA_KEYS = ["global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta", "rotary_emb_base"]


def _find(hparams: dict, keys: list[str]):
    """ModelBase.find_hparam(keys, optional=True)."""
    return next((hparams[k] for k in keys if k in hparams), None)


def _add_metadata(writer, model_dir: Path, hparams: dict, conv: Converter, ftype: LlamaFileType) -> None:
    """ModelBase.prepare_metadata: general.*, set_gguf_parameters, quantization version."""
    writer.add_type(gguf.GGUFType.MODEL)
    total, shared, expert, expert_count = writer.get_total_parameter_count()
    metadata = gguf.Metadata.load(None, model_dir, None, total)
    if metadata.name is None:
        metadata.name = model_dir.name
    if metadata.size_label is None and total > 0:
        metadata.size_label = gguf.size_label(total, shared, expert, expert_count)
    metadata.set_gguf_meta_model(writer)
    _set_gguf_parameters(writer, hparams, conv, ftype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _set_gguf_parameters(writer, hparams: dict, conv: Converter, ftype: LlamaFileType) -> None:
    """The converter class's set_gguf_parameters: its own (Phi3MiniModel, Gemma2Model), or
    TextModel's with what Gemma3Model, LlamaModel or Qwen2MoeModel add."""
    if conv.parameters == "phi3":
        return _phi3_parameters(writer, hparams, ftype)
    if conv.parameters == "gemma2":
        return _gemma2_parameters(writer, hparams, ftype)
    _text_parameters(writer, hparams, conv, ftype)
    if conv.parameters == "gemma3":
        _gemma3_parameters(writer, hparams)


def _phi3_parameters(writer, hparams: dict, ftype: LlamaFileType) -> None:
    """Phi3MiniModel.set_gguf_parameters (it does not call TextModel's): no head size, the rotated
    part of a head as rope.dimension_count, a sliding window of 0 where the config has none."""
    n_embd, n_head = hparams["hidden_size"], hparams["num_attention_heads"]
    rope = hparams.get("rope_parameters", hparams.get("rope_scaling")) or {}
    rot_pct = rope.get("partial_rotary_factor", hparams.get("partial_rotary_factor", 1.0))
    writer.add_context_length(_find(hparams, ["n_positions", "max_position_embeddings"]))
    writer.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings", hparams["original_max_position_embeddings"]))
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(hparams["intermediate_size"])
    writer.add_block_count(hparams["num_hidden_layers"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(_find(hparams, ["num_key_value_heads", "n_head_kv"]))
    writer.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
    writer.add_rope_dimension_count(int(rot_pct * n_embd) // n_head)
    writer.add_rope_freq_base(rope.get("rope_theta", hparams["rope_theta"]))
    writer.add_file_type(ftype)
    writer.add_sliding_window(hparams.get("sliding_window") or 0)  # 0: "to distinguish Phi-4 from other PHI3 models"
    if (attn_factor := _phi3_attn_factor(hparams)) is not None:  # generate_extra_tensors writes it
        writer.add_rope_scaling_attn_factors(attn_factor)


# Gemma2Config's default window, which the converter's hparams (AutoConfig's) hold where config.json has none.
GEMMA2_SLIDING_WINDOW = 4096


def _gemma2_parameters(writer, hparams: dict, ftype: LlamaFileType) -> None:
    """Gemma2Model.set_gguf_parameters (it does not call TextModel's): no RoPE base, the soft caps
    and the window."""
    writer.add_context_length(hparams["max_position_embeddings"])
    writer.add_embedding_length(hparams["hidden_size"])
    writer.add_block_count(hparams["num_hidden_layers"])
    writer.add_feed_forward_length(hparams["intermediate_size"])
    writer.add_head_count(hparams["num_attention_heads"])
    writer.add_head_count_kv(hparams.get("num_key_value_heads", hparams["num_attention_heads"]))
    writer.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
    writer.add_key_length(hparams["head_dim"])
    writer.add_value_length(hparams["head_dim"])
    writer.add_file_type(ftype)
    writer.add_attn_logit_softcapping(hparams["attn_logit_softcapping"])
    writer.add_final_logit_softcapping(hparams["final_logit_softcapping"])
    writer.add_sliding_window(hparams.get("sliding_window", GEMMA2_SLIDING_WINDOW))


def _qwen2vl_parameters(writer, hparams: dict) -> None:
    """TextModel.set_gguf_parameters for a multimodal RoPE: ``mrope_section`` padded to 4 with zeros,
    as ``rope.dimension_sections`` (Qwen2VLModel adds nothing else)."""
    rope = hparams.get("rope_parameters", hparams.get("rope_scaling")) or {}
    if "mrope_section" in rope:
        sections = list(rope["mrope_section"])
        writer.add_rope_dimension_sections((sections + [0] * 4)[:4])


def _gemma3_parameters(writer, hparams: dict) -> None:
    """What Gemma3Model.set_gguf_parameters writes after TextModel's (the same keys again, with
    Gemma 3's defaults; the RoPE base of the global layers). It writes no window pattern and no
    local RoPE base: llama.cpp fixes those for every gemma3 file (5 sliding to 1 global, 10000)."""
    writer.add_context_length(hparams.get("max_position_embeddings", 131072))
    writer.add_head_count(hparams.get("num_attention_heads", 8))
    writer.add_layer_norm_rms_eps(hparams.get("rms_norm_eps", 1e-6))
    writer.add_key_length(hparams.get("head_dim", 256))
    writer.add_value_length(hparams.get("head_dim", 256))
    writer.add_rope_freq_base(hparams.get("rope_theta", 1_000_000.0))
    assert hparams.get("attn_logit_softcapping") is None  # "attn_logit_softcapping is removed in Gemma3"
    if final_logit_softcap := hparams.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(final_logit_softcap)
    if hparams.get("sliding_window_pattern") != 1:
        writer.add_sliding_window(hparams["sliding_window"])
    writer.add_head_count_kv(hparams.get("num_key_value_heads", 4))


def _text_parameters(writer, hparams: dict, conv: Converter, ftype: LlamaFileType) -> None:
    """TextModel.set_gguf_parameters, then LlamaModel's or Qwen2MoeModel's additions (Qwen2Model
    and Qwen3Model add only a pooling type, which a causal LM does not have)."""
    writer.add_block_count(hparams["num_hidden_layers"])
    if (n_ctx := _find(hparams, _CONTEXT_KEYS)) is not None:
        writer.add_context_length(n_ctx)
    if (n_embd := _find(hparams, ["hidden_size", "n_embd", "dim"])) is not None:
        writer.add_embedding_length(n_embd)
    if (n_ff := _find(hparams, ["intermediate_size", "n_inner", "hidden_dim"])) is not None:
        writer.add_feed_forward_length(n_ff)
    if (n_head := _find(hparams, ["num_attention_heads", "n_head", "n_heads"])) is not None:
        writer.add_head_count(n_head)
    if (n_head_kv := _find(hparams, ["num_key_value_heads", "n_kv_heads"])) is not None:
        writer.add_head_count_kv(n_head_kv)
    rope = hparams.get("rope_parameters", hparams.get("rope_scaling")) or {}
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type == "mrope":  # transformers' Qwen2.5-VL config makes it "default"; its sections: _qwen2vl_parameters
        rope_type = "default"
    if rope_type not in (None, "default", "linear", "yarn", *(("llama3",) if conv.llama else ())):
        raise ValueError(f"rope scaling {rope} is not written by this helper")
    if rope_type == "yarn" and rope.get("factor") is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (("beta_fast", writer.add_rope_scaling_yarn_beta_fast), ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
            if rope.get(key) is not None:
                add(rope[key])
    if (rope_theta := rope.get("rope_theta", _find(hparams, _ROPE_THETA_KEYS))) is not None:
        writer.add_rope_freq_base(rope_theta)
    if rope_type == "linear" and rope.get("factor") is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if (f_rms_eps := _find(hparams, ["rms_norm_eps", "norm_eps"])) is not None:
        writer.add_layer_norm_rms_eps(f_rms_eps)
    if (f_norm_eps := _find(hparams, ["layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"])) is not None:
        writer.add_layer_norm_eps(f_norm_eps)
    if (n_experts := _find(hparams, ["num_local_experts", "num_experts", "n_routed_experts"])) is not None:
        writer.add_expert_count(n_experts)
    if (n_experts_used := _find(hparams, ["num_experts_per_tok", "num_experts_per_token", "top_k_experts"])) is not None:
        writer.add_expert_used_count(n_experts_used)
    if (n_expert_groups := hparams.get("n_group")) is not None:
        writer.add_expert_group_count(n_expert_groups)
    if (n_group_used := hparams.get("topk_group")) is not None:
        writer.add_expert_group_used_count(n_group_used)
    if (score_func := _find(hparams, ["score_function", "scoring_func", "score_func"])) is not None:
        writer.add_expert_gating_func({"sigmoid": gguf.ExpertGatingFuncType.SIGMOID, "softmax": gguf.ExpertGatingFuncType.SOFTMAX}[score_func])
    if (head_dim := hparams.get("head_dim")) is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(ftype)
    if conv.llama:
        writer.add_vocab_size(hparams["vocab_size"])
        if (rope_dim := hparams.get("head_dim")) is None:
            rope_dim = hparams["hidden_size"] // hparams["num_attention_heads"]
        writer.add_rope_dimension_count(rope_dim)
    if conv.params is not None:
        conv.params(writer, hparams)
        return
    if conv.moe:
        if (moe_ff := hparams.get("moe_intermediate_size")) is not None:
            writer.add_expert_feed_forward_length(moe_ff)
        if (shared_ff := hparams.get("shared_expert_intermediate_size")) is not None:
            writer.add_expert_shared_feed_forward_length(shared_ff)


# --------------------------------------------------------------- deepseek2


def _deepseek2_tensors(name: str, bid: int | None, x: np.ndarray, hparams: dict, held: dict):
    """DeepseekV2Model.modify_tensors (ModelBase.filter_tensors first: the router's correction bias
    renamed e_score_correction.bias, so it maps to exp_probs_b.bias).

    The tiny model is an mlx-lm checkpoint: its experts are already stacked (as the converter
    stacks them), and a deepseek_v3's sanitize has split kv_b_proj into ``embed_q`` (k_b,
    transposed) and ``unembed_out`` (v_b). Those are joined back into HF's kv_b_proj here, which
    the converter then splits per head into k_b_proj (transposed) and v_b_proj as it does.
    """
    if name.endswith("e_score_correction_bias"):
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
    if (m := _MLX_EXPERTS.match(name)) is not None:
        yield f"{m.group(1)}.experts.{m.group(2)}.weight", bid, x
        return
    if name.endswith("self_attn.embed_q.weight"):
        held[name] = x  # joined with unembed_out, which sorts after it
        return
    if name.endswith("self_attn.unembed_out.weight"):
        k_b = held.pop(name.replace("unembed_out", "embed_q"))  # (heads, kv_lora_rank, nope)
        x = np.concatenate([k_b.swapaxes(1, 2), x], axis=1).reshape(-1, k_b.shape[1])
        name = name.replace("unembed_out", "kv_b_proj")
    if name.endswith("kv_b_proj.weight"):
        n_head_kv = hparams["num_key_value_heads"]
        v_head_dim, qk_nope_head_dim = hparams["v_head_dim"], hparams["qk_nope_head_dim"]
        assert x.shape[0] == n_head_kv * (v_head_dim + qk_nope_head_dim)
        kv_b = x.reshape(n_head_kv, v_head_dim + qk_nope_head_dim, x.shape[-1])
        k_b, v_b = kv_b[:, :qk_nope_head_dim], kv_b[:, qk_nope_head_dim:]
        yield name.replace("kv_b_proj", "k_b_proj"), bid, np.ascontiguousarray(k_b.swapaxes(1, 2))
        yield name.replace("kv_b_proj", "v_b_proj"), bid, np.ascontiguousarray(v_b)
        return
    yield name, bid, x


def _deepseek2_params(writer, hparams: dict) -> None:
    """DeepseekV2Model.set_gguf_parameters, after TextModel's (it sets num_key_value_heads to 1
    before them: written over here, which keeps the key where TextModel put it)."""
    writer.add_head_count_kv(1)  # "deepseek2 using MLA converts into MQA (ie: GQA with 1 group)"
    has_moe = hparams.get("n_routed_experts") is not None
    first_k_dense_replace = hparams.get("first_k_dense_replace")
    if first_k_dense_replace is None:
        first_k_dense_replace = hparams["num_hidden_layers"] if not has_moe else 0
    writer.add_leading_dense_block_count(first_k_dense_replace)
    kv_lora_rank = hparams.get("kv_lora_rank", 512)
    writer.add_vocab_size(hparams["vocab_size"])
    if hparams.get("q_lora_rank") is not None:
        writer.add_q_lora_rank(hparams["q_lora_rank"])
    writer.add_kv_lora_rank(kv_lora_rank)
    writer.add_key_length(kv_lora_rank + hparams["qk_rope_head_dim"])
    writer.add_value_length(kv_lora_rank)
    writer.add_key_length_mla(hparams["qk_nope_head_dim"] + hparams["qk_rope_head_dim"])
    writer.add_value_length_mla(hparams["v_head_dim"])
    writer.add_expert_feed_forward_length(_find(hparams, ["moe_intermediate_size", "intermediate_size"]))
    if (n_routed_experts := hparams.get("n_routed_experts")) is not None:
        writer.add_expert_count(n_routed_experts)
    writer.add_expert_shared_count(hparams.get("n_shared_experts", 0))
    if (routed_scaling_factor := hparams.get("routed_scaling_factor")) is not None:
        writer.add_expert_weights_scale(routed_scaling_factor)
    if hparams.get("norm_topk_prob"):
        writer.add_expert_weights_norm(hparams["norm_topk_prob"])
    writer.add_rope_dimension_count(hparams["qk_rope_head_dim"])
    if (rope_mscale_all := (hparams.get("rope_scaling") or {}).get("mscale_all_dim")) is not None:
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope_mscale_all)


# ----------------------------------------------------------------- glm4moe


def _glm4moe_tensors(name: str, bid: int | None, x: np.ndarray, hparams: dict, held: dict):
    """Glm4MoeModel.modify_tensors after ModelBase.filter_tensors (the router's correction bias
    renamed e_score_correction.bias); the tiny mlx-lm checkpoint's experts already stacked, as the
    converter's MOE_HF_MLP stacks them. There is no NextN layer to write: the tiny config has none."""
    if name.endswith("e_score_correction_bias"):
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
    if (m := _MLX_EXPERTS.match(name)) is not None:
        name = f"{m.group(1)}.experts.{m.group(2)}.weight"
    yield name, bid, x


def _glm4moe_params(writer, hparams: dict) -> None:
    """Glm4MoeModel.set_gguf_parameters, after TextModel's. Its set_vocab (_set_vocab_glm) names
    <|endoftext|> and <|user|> as the special tokens, which the tiny tokenizer lacks: the common
    vocabulary is written instead."""
    rope_dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
    writer.add_rope_dimension_count(int(rope_dim * hparams.get("partial_rotary_factor", 0.5)))
    if (n_routed_experts := hparams.get("n_routed_experts")) is not None:
        writer.add_expert_count(n_routed_experts)
    if (moe_intermediate_size := hparams.get("moe_intermediate_size")) is not None:
        writer.add_expert_feed_forward_length(moe_intermediate_size)
    if (n_shared_experts := hparams.get("n_shared_experts")) is not None:
        writer.add_expert_shared_count(n_shared_experts)
    if (first_k_dense_replace := hparams.get("first_k_dense_replace")) is not None:
        writer.add_leading_dense_block_count(first_k_dense_replace)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if (routed_scaling_factor := hparams.get("routed_scaling_factor")) is not None:
        writer.add_expert_weights_scale(routed_scaling_factor)
    if (norm_topk_prob := hparams.get("norm_topk_prob")) is not None:
        writer.add_expert_weights_norm(norm_topk_prob)
    if (num_nextn_predict_layers := hparams.get("num_nextn_predict_layers")) is not None:
        writer.add_nextn_predict_layers(num_nextn_predict_layers)


# -------------------------------------------------------------- minimax-m2

# mlx-lm's stacked experts by the w-names of HF's MiniMax-M2 experts (w1 gate, w2 down, w3 up).
_MINIMAX_EXPERT_NAMES = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def _minimax_m2_tensors(name: str, bid: int | None, x: np.ndarray, hparams: dict, held: dict):
    """MiniMaxM2Model.modify_tensors: the router's correction bias renamed e_score_correction.bias,
    each layer's block_sparse_moe.experts.{e}.w1/w2/w3 stacked into block_sparse_moe.experts.w1/w2/w3.
    The tiny mlx-lm checkpoint's experts are already stacked (switch_mlp.gate_proj, ...): written
    under the merged names the converter gives them."""
    if name.endswith("e_score_correction_bias"):
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
    m = re.match(r"^(.*\.block_sparse_moe)\.switch_mlp\.(gate_proj|up_proj|down_proj)\.weight$", name)
    if m is not None:
        name = f"{m.group(1)}.experts.{_MINIMAX_EXPERT_NAMES[m.group(2)]}.weight"
    yield name, bid, x


def _minimax_m2_params(writer, hparams: dict) -> None:
    """MiniMaxM2Model.set_gguf_parameters, after TextModel's."""
    writer.add_expert_feed_forward_length(_find(hparams, ["intermediate_size"]))
    writer.add_rope_dimension_count(_find(hparams, ["rotary_dim"]))


# --------------------------------------------------------------- qwen3next


def _qwen3next_tensors(name: str, bid: int | None, x: np.ndarray, hparams: dict, held: dict):
    """Qwen3NextModel.modify_tensors: A_log as -exp(A_log), dt_bias as dt_proj.bias, the conv1d
    squeezed to (channels, kernel), norms but linear_attn.norm with 1 added, in_proj_qkvz split into
    attn_qkv (all heads' q, then k, then v) and attn_gate (z); experts stacked as Qwen2MoeModel does.

    The tiny model is an mlx-lm checkpoint, whose sanitize has already added that 1 to the same
    norms and moved the conv1d to MLX's (channels, kernel, 1): its norms are written as they are
    (what the converter makes of the original's) and its conv1d squeezed the same.
    """
    if name.endswith(".A_log"):
        x = -np.exp(x)
    elif name.endswith(".dt_bias"):
        name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
    elif "conv1d" in name:
        x = x.squeeze()
    if (m := _MLX_EXPERTS.match(name)) is not None:
        name = f"{m.group(1)}.experts.{m.group(2)}.weight"
    if "in_proj_qkvz.weight" in name:
        head_k_dim, head_v_dim = hparams["linear_key_head_dim"], hparams["linear_value_head_dim"]
        num_v_heads, num_k_heads = hparams["linear_num_value_heads"], hparams["linear_num_key_heads"]
        hidden_size = hparams["hidden_size"]
        split = [head_k_dim, head_k_dim, num_v_heads // num_k_heads * head_v_dim, num_v_heads // num_k_heads * head_v_dim]
        grouped = x.T.reshape(-1, num_k_heads, sum(split))  # (n_embd, head_count, [q+k+v+z])
        q, k, v, z = np.split(grouped, np.cumsum(split)[:-1], axis=-1)
        qkv = np.concatenate([t.reshape(hidden_size, -1) for t in (q, k, v)], axis=-1).T
        yield gguf.TENSOR_NAMES[MODEL_TENSOR.ATTN_QKV].format(bid=bid) + ".weight", bid, np.ascontiguousarray(qkv)
        yield gguf.TENSOR_NAMES[MODEL_TENSOR.ATTN_GATE].format(bid=bid) + ".weight", bid, np.ascontiguousarray(z.reshape(hidden_size, -1).T)
        return
    yield name, bid, x


def _qwen3next_params(writer, hparams: dict) -> None:
    """Qwen2MoeModel's set_gguf_parameters additions, then Qwen3NextModel's."""
    if (moe_ff := hparams.get("moe_intermediate_size")) is not None:
        writer.add_expert_feed_forward_length(moe_ff)
    if (shared_ff := hparams.get("shared_expert_intermediate_size")) is not None:
        writer.add_expert_shared_feed_forward_length(shared_ff)
    writer.add_ssm_conv_kernel(hparams["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(hparams["linear_key_head_dim"])
    writer.add_ssm_group_count(hparams["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(hparams["linear_num_value_heads"])
    writer.add_ssm_inner_size(hparams["linear_value_head_dim"] * hparams["linear_num_value_heads"])
    writer.add_full_attention_interval(hparams.get("full_attention_interval", 4))
    if (rope_dim := hparams.get("head_dim")) is None:
        rope_dim = hparams["hidden_size"] // hparams["num_attention_heads"]
    writer.add_rope_dimension_count(int(rope_dim * hparams.get("partial_rotary_factor", 0.25)))


# ----------------------------------------------------------------- gpt-oss


def _gpt_oss_tensors(name: str, bid: int | None, x: np.ndarray, hparams: dict, held: dict):
    """GptOssModel.filter_tensors and modify_tensors for a checkpoint whose experts are not MXFP4.

    The sinks get a ``.weight``. The tiny model is an mlx-lm checkpoint: its sanitize already
    split HF's interleaved ``gate_up_proj`` (and its bias) into stacked gate_proj and up_proj
    (``[:, ::2]``, ``[:, 1::2]``) and holds them, and down_proj, as (experts, out, in): what the
    converter's transpose and split of the float gate_up_proj writes, under the merged HF names
    (mlp.experts.gate_proj.weight, ...) that gguf-py maps to ffn_gate_exps and the rest. An
    original checkpoint's MXFP4 experts are repacked by the converter as they are (repack_mxfp4);
    the tests write the experts MXFP4 by type instead (gguf-py's quantize).
    """
    if "sinks" in name:
        name += ".weight"
    yield name, bid, x


def _gpt_oss_params(writer, hparams: dict) -> None:
    """GptOssModel.set_gguf_parameters, after TextModel's."""
    writer.add_sliding_window(hparams["sliding_window"])
    writer.add_expert_feed_forward_length(hparams["intermediate_size"])
    writer.add_expert_count(hparams.get("num_local_experts") or hparams.get("num_experts") or 32)
    writer.add_expert_used_count(hparams.get("num_experts_per_tok") or 4)


# -------------------------------------------------------------------- vocab


def _looks_special(token: str) -> bool:
    """TextModel.does_token_look_special."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<｜") and token.endswith("｜>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def _add_vocab(writer, model_dir: Path, hparams: dict, conv: Converter, pre: str) -> None:
    """TextModel._set_vocab_gpt2 (with get_vocab_base), where both LlamaModel.set_vocab and
    Qwen2Model.set_vocab end for a byte-level BPE tokenizer.json without tokenizer.model.

    get_vocab_base_pre would hash the tokenizer's split of a test string; the tiny
    tokenizer's hash is in no list, so the converter would stop: ``pre`` stands in.
    """
    from transformers import AutoTokenizer  # ~2 s of imports, only when a file is written

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = hparams.get("vocab_size", len(tokenizer.vocab))
    assert max(tokenizer.vocab.values()) < vocab_size, f"{model_dir}: the tokenizer has ids past vocab_size {vocab_size}"
    reverse_vocab = {id_: tok for tok, id_ in tokenizer.vocab.items()}
    added_vocab = tokenizer.get_added_vocab()
    added_tokens_decoder = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    toktypes: list[int] = []
    for i in range(vocab_size):
        if i not in reverse_vocab:
            tokens.append(f"[PAD{i}]")
            toktypes.append(gguf.TokenType.UNUSED)
            continue
        token = reverse_vocab[i]
        if token in added_vocab:
            # llama.cpp takes CONTROL and USER_DEFINED tokens as pre-normalized
            if not added_tokens_decoder[i].normalized:
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if added_tokens_decoder[i].special or _looks_special(token):
                toktypes.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")  # pre-normalize user-defined spaces
                toktypes.append(gguf.TokenType.USER_DEFINED)
        else:
            toktypes.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(toktypes)
    # Merges, bos/eos/pad ids, add_bos_token and the chat template, from the directory's files.
    gguf.SpecialVocab(model_dir, load_merges=True).add_to_gguf(writer, quiet=True)
    if conv.llama:  # LlamaModel.set_vocab, after the vocab
        config_file = model_dir / "tokenizer_config.json"
        if config_file.is_file() and "add_prefix_space" in (tc := json.loads(config_file.read_text())):
            writer.add_add_space_prefix(tc["add_prefix_space"])


# ------------------------------------------------------- llama-quantize --allow-requantize

# llama-quantize's K-quant mixes (LLAMA_FTYPE_MOSTLY_*): the default type of their matrices.
K_FTYPES: dict[str, tuple[LlamaFileType, Q]] = {
    "q4_k_m": (LlamaFileType.MOSTLY_Q4_K_M, Q.Q4_K),
    "q5_k_m": (LlamaFileType.MOSTLY_Q5_K_M, Q.Q5_K),
    "q6_k": (LlamaFileType.MOSTLY_Q6_K, Q.Q6_K),
}
# llama_tensor_get_type's fallback where a row is no whole number of super-blocks.
K_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quant.cpp's use_more_bits: the first and last eighth, and every third between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def requantize(src: Path, out: Path, ftype: str, dequantized: Path | None = None) -> Path:
    """llama-quantize --allow-requantize ``src`` (a llama GGUF) to ``ftype`` (``K_FTYPES``): every
    tensor dequantized by gguf-py, then given the type llama_tensor_get_type gives it for that mix
    (the output or tied embedding Q6_K; attn_v and ffn_down Q6_K where use_more_bits says so in
    Q4_K_M and Q5_K_M; the rest the mix's type; its fallback where a row is no whole number of
    256) and quantized (``kquants.py``, gguf-py). The metadata is copied, ``general.file_type`` set.

    ``dequantized``: also write there what ``dequantize_file`` would make of the new file (the
    same bytes, dequantized as they are written: one pass instead of reading it again)."""
    file_type, default = K_FTYPES[ftype]
    reader = _reader(src)
    tied = "output.weight" not in {t.name for t in reader.tensors}
    n_layers = int(reader.fields[f"{reader.fields['general.architecture'].contents()}.block_count"].contents())
    seen = {"attn_v": 0, "ffn_down": 0}

    def choose(name: str, x: np.ndarray) -> Q:
        if not name.endswith(".weight") or x.ndim < 2 or "_norm" in name:
            return Q.F32
        qtype = default
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            qtype = Q.Q6_K
        for kind in seen:
            if f".{kind}." in name:
                if ftype in ("q4_k_m", "q5_k_m") and _use_more_bits(seen[kind], n_layers):
                    qtype = Q.Q6_K
                seen[kind] += 1
        return K_FALLBACK.get(qtype, qtype) if x.shape[-1] % QK_K else qtype

    return _rewrite(reader, out, choose, file_type, dequantized)


def dequantize_file(src: Path, out: Path) -> Path:
    """The same GGUF with every tensor F32, as gguf-py's ``dequantize`` reads it: the reference a
    reader of the quantized file is checked against."""
    return _rewrite(_reader(src), out, lambda name, x: Q.F32, LlamaFileType.ALL_F32)


@functools.lru_cache(maxsize=4)
def _reader(path: Path) -> gguf.GGUFReader:
    # gguf-py reads a 49k-token vocabulary field by field (8 s for SmolLM2): once per file a session.
    return gguf.GGUFReader(path)


def _rewrite(reader, out: Path, choose, file_type: LlamaFileType, dequantized: Path | None = None) -> Path:
    """A copy of the file ``reader`` reads, its metadata as is (but ``general.file_type``), each
    tensor dequantized and quantized again to ``choose(name, array)``; and, at ``dequantized``,
    the copy's tensors as gguf-py dequantizes them, all F32."""
    from gguf.scripts.gguf_new_metadata import MetadataDetails

    writers = [(gguf.GGUFWriter(str(o), reader.fields["general.architecture"].contents()), t) for o, t in ((out, file_type), (dequantized, LlamaFileType.ALL_F32)) if o is not None]
    for writer, kind_of_file in writers:
        for field in reader.fields.values():
            if field.name in ("general.architecture", "general.file_type") or field.name.startswith("GGUF."):
                continue
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, MetadataDetails(kind, field.contents()).value, kind, sub_type=sub)
        writer.add_file_type(kind_of_file)
    for t in reader.tensors:
        x = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(n) for n in t.shape])))
        qtype = choose(t.name, x)
        data = x.astype(np.float32) if qtype == Q.F32 else _encode(x, qtype, asked=True)[0]
        writers[0][0].add_tensor(t.name, data, raw_dtype=qtype)
        if len(writers) > 1:
            plain = x.astype(np.float32) if qtype == Q.F32 else gguf.quants.dequantize(data, qtype).reshape(x.shape)
            writers[1][0].add_tensor(t.name, plain.astype(np.float32), raw_dtype=Q.F32)
    for writer, _ in writers:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return out

