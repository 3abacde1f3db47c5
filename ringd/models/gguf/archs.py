"""How each GGUF architecture ringd serves maps onto mlx-lm's: the model's config from the file's metadata.

llama.cpp's converter writes a model's settings as ``{arch}.*`` metadata keys and its
weights under its own tensor names; mlx-lm builds a model from a ``config.json`` in
Hugging Face's terms. Each family here says which mlx-lm ``model_type`` computes it,
which of gguf-py's ``MODEL_ARCH`` tensor maps names its tensors, and what of llama.cpp's
writing differs from the original checkpoint: interleaved RoPE, a family's own keys, the
settings llama.cpp fixes rather than reads (Gemma 3's window pattern), the names mlx-lm
gives its own modules (Mixtral's and MiniMax's experts, DeepSeek-V3's embed_q), the
tensors the converter splits or transforms (Qwen3-Next's in_proj_qkvz, DeepSeek-V2's
kv_b), and float tensors stored otherwise (Gemma's norms plus one, Qwen2-MoE's squeezed
shared-expert gate). Phi-3's fused attn_qkv and ffn_up need nothing: mlx-lm's phi3 keeps
HF's fused qkv_proj and gate_up_proj too.

Served: llama (and Mixtral, a llama with experts), mistral3, qwen2, qwen2vl, qwen2moe, qwen3,
qwen3moe, phi3, gemma2, gemma3. A family with no entry, or a file of one that mlx-lm
cannot compute as llama.cpp does (a YaRN Phi-3, Ministral 3's attention temperature,
Gemma 3 with a final soft-cap, experts with gate and up fused), is refused at start
in one line that says why and names what is served. What this ignores: the bytes of
tensors (``gguf/reader.py``, ``gguf/blocks.py``), the tokenizer (``gguf/vocab.py``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import mlx.core as mx
import numpy as np

from ringd.models.errors import ModelError

# llama.cpp's pooling types (``{arch}.pooling_type``) that make one vector of an input, by
# the name ``steps.POOLINGS`` gives them (0, none, and 4, rank, make no embedding of it).
GGUF_POOLINGS = {1: "mean", 2: "cls", 3: "last"}


class TensorInfo(Protocol):
    """What the mapping reads of a tensor of the file (``gguf.Tensor``)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def type(self) -> str: ...


@dataclass(frozen=True)
class Facts:
    """What a family's mapping reads of a file: its metadata, its tensor table, and (for the few
    settings stored as a tensor, like Llama 3's ``rope_freqs``) a float tensor's values."""

    path: Path
    meta: Mapping[str, Any]
    tensors: Mapping[str, TensorInfo]
    read: Callable[[str], mx.array]

    @property
    def arch(self) -> str:
        return self.meta["general.architecture"]

    def key(self, name: str, default: Any = ..., kind: type = int) -> Any:
        """The metadata value ``{arch}.{name}`` as ``kind`` (a positive number), else ``default``."""
        full = f"{self.arch}.{name}"
        if full not in self.meta:
            if default is ...:
                raise ModelError(f"{self.path}: metadata key {full} is missing; is this a complete GGUF file?")
            return default
        value = self.meta[full]
        try:
            number = kind(value)
        except (TypeError, ValueError):
            number = None
        if number is None or not number > 0 or (kind is float and not math.isfinite(number)):
            raise ModelError(f"{self.path}: metadata key {full} is {value!r}; a positive {kind.__name__} was expected")
        return number


@dataclass(frozen=True)
class Derived:
    """An mlx-lm parameter llama.cpp's converter stores otherwise: the file's tensors it is made of,
    and how (``make``: from each tensor's parts, "" and for a quantized one "scales" and "biases", to
    the parameter's parts)."""

    tensors: tuple[str, ...]  # GGUF names, in the order make takes them
    make: Callable[[list[dict[str, mx.array]]], dict[str, mx.array]]
    # make only reorders and joins whole rows, so it is exact on quantized rows too (each row its own
    # blocks); otherwise it computes with the values, and only float tensors are taken.
    rows_only: bool


@dataclass(frozen=True)
class Arch:
    """A GGUF architecture ringd maps onto mlx-lm's."""

    model_type: str  # mlx-lm's
    gguf_arch: str  # gguf-py's MODEL_ARCH member name, for its TensorNameMap
    # llama.cpp's converter permutes Q and K of these for its interleaved RoPE
    # (LlamaModel.permute); mlx-lm computes the same with rope_traditional.
    rope_interleaved: bool
    # The family's own config keys (experts, windows, ...), from the file's metadata;
    # a "model_type" here overrides the one above (a llama file with experts is a Mixtral).
    extra: Callable[[Facts], dict] | None = None
    # Parts of mlx-lm's parameter names spelled as the Hugging Face names gguf-py's map knows
    # (mlx-lm's own modules, like DeepSeek-V3's embed_q for the k_b_proj llama.cpp splits out).
    renames: tuple[tuple[str, str], ...] = ()
    # The parameters the file stores otherwise (by mlx-lm name, given the config), or None.
    derived: Callable[[str, Mapping[str, Any]], Derived | None] | None = None
    # A float tensor as llama.cpp's converter stored it -> the parameter mlx-lm computes with
    # (Gemma's norms are stored plus one), by mlx-lm parameter name.
    fix: Callable[[str, mx.array], mx.array] | None = None
    # What mlx-lm's load does to a fresh model from the checkpoint's weights alone (Gemma 3's
    # sanitize ties the head when there is no lm_head), given the config.
    built: Callable[[Any, dict], None] | None = None

    def hf_name(self, name: str) -> str:
        """An mlx-lm module or parameter name as gguf-py's TensorNameMap knows it."""
        for ours, theirs in self.renames:
            name = name.replace(ours, theirs)
        return name


# Mixtral's experts: mlx-lm's switch_mlp holds HF's w1 (gate), w3 (up), w2 (down), stacked.
_MIXTRAL_EXPERTS = tuple(
    (f".block_sparse_moe.switch_mlp.{proj}", f".block_sparse_moe.experts.{w}")
    for proj, w in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))
)

ARCHITECTURES = {
    # Llama 2/3.x, Mistral 7B, SmolLM2, DeepSeek-R1-Distill-Llama; Mixtral 8x7B/8x22B (experts: mixtral)
    "llama": Arch("llama", "LLAMA", rope_interleaved=True, extra=lambda f: _llama(f), renames=_MIXTRAL_EXPERTS),
    # Mistral Small 3.x's text decoder, as llama.cpp's Mistral3Model writes it (a llama)
    "mistral3": Arch("llama", "MISTRAL3", rope_interleaved=True, extra=lambda f: _mistral3(f)),
    "qwen2": Arch("qwen2", "QWEN2", rope_interleaved=False),  # Qwen2, Qwen2.5, QwQ, DeepSeek-R1-Distill-Qwen
    # Qwen2-VL, Qwen2.5-VL: Qwen2's decoder, its positions by time, row and column (the sections of its
    # multimodal RoPE); text alone is Qwen2's, and with its projector file the ring runs mlx-vlm's
    # language model (stage/vlmtext.py) with the same tensors.
    "qwen2vl": Arch("qwen2", "QWEN2VL", rope_interleaved=False, extra=lambda f: _qwen2vl(f)),
    # Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B
    "qwen2moe": Arch("qwen2_moe", "QWEN2MOE", rope_interleaved=False, extra=lambda f: _qwen2_moe(f), fix=lambda n, a: _shared_expert_gate_fix(n, a)),
    "qwen3": Arch("qwen3", "QWEN3", rope_interleaved=False),
    "qwen3moe": Arch("qwen3_moe", "QWEN3MOE", rope_interleaved=False, extra=lambda f: _qwen3_moe(f)),  # Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder
    # DeepSeek-V3/R1, Kimi K2 (sigmoid router): mlx-lm's deepseek_v3, whose MLA holds kv_b_proj
    # split per head as llama.cpp's converter stores it (attn_k_b, attn_v_b), tensor for tensor.
    # DeepSeek-V2, V2.5, V2-Lite (softmax router): mlx-lm's deepseek_v2, from float files only.
    "deepseek2": Arch(
        "deepseek_v3", "DEEPSEEK2", rope_interleaved=False, extra=lambda f: _deepseek2(f),
        renames=((".self_attn.embed_q", ".self_attn.k_b_proj"), (".self_attn.unembed_out", ".self_attn.v_b_proj"),
                 (".e_score_correction_bias", ".e_score_correction.bias")),
        derived=lambda p, c: _deepseek2_derived(p, c),
    ),  # fmt: skip
    # gpt-oss-20b, gpt-oss-120b: attention sinks (attn_sinks, a tensor llama.cpp names with .weight),
    # biases on attention, router and experts, MXFP4 experts served packed, every other layer a window.
    # GLM-4.5, GLM-4.5-Air, GLM-4.6 (their NextN/MTP layer, past block_count's decoder layers, unused).
    "glm4moe": Arch("glm4_moe", "GLM4_MOE", rope_interleaved=False, extra=lambda f: _glm4moe(f), renames=((".e_score_correction_bias", ".e_score_correction.bias"),)),
    # MiniMax-M2 (mlx-lm's minimax): HF's block_sparse_moe experts w1/w2/w3 are mlx-lm's gate/down/up.
    "minimax-m2": Arch(
        "minimax", "MINIMAXM2", rope_interleaved=False, extra=lambda f: _minimax_m2(f),
        renames=((".switch_mlp.gate_proj", ".experts.w1"), (".switch_mlp.down_proj", ".experts.w2"),
                 (".switch_mlp.up_proj", ".experts.w3"), (".e_score_correction_bias", ".e_score_correction.bias")),
    ),  # fmt: skip
    # Qwen3-Next-80B-A3B: gated delta net (linear attention) layers between full-attention ones.
    "qwen3next": Arch(
        "qwen3_next", "QWEN3NEXT", rope_interleaved=False, extra=lambda f: _qwen3next(f),
        renames=((".linear_attn.dt_bias", ".linear_attn.dt_proj.bias"),), derived=lambda p, c: _qwen3next_derived(p, c),
        fix=lambda n, a: _shared_expert_gate_fix(n, a),
    ),  # fmt: skip
    "gpt-oss": Arch("gpt_oss", "GPT_OSS", rope_interleaved=False, extra=lambda f: _gpt_oss(f), renames=((".self_attn.sinks", ".self_attn.sinks.weight"),)),
    "phi3": Arch("phi3", "PHI3", rope_interleaved=False, extra=lambda f: _phi3(f)),  # Phi-3/3.5-mini, Phi-4, Phi-4-mini
    "gemma2": Arch("gemma2", "GEMMA2", rope_interleaved=False, extra=lambda f: _gemma2(f), fix=lambda n, a: _gemma_norm(n, a)),
    "gemma3": Arch(
        "gemma3_text", "GEMMA3", rope_interleaved=False, extra=lambda f: _gemma3(f),
        fix=lambda n, a: _gemma_norm(n, a), built=lambda m, c: _gemma3_built(m, c),
    ),  # Gemma 3 1B-27B (the text decoder)  # fmt: skip
}

_SERVED = (
    f"GGUF files of {', '.join(sorted(ARCHITECTURES))} are served directly (for another, serve the "
    "original checkpoint converted with mlx_lm.convert)"
)

# Llama 3.1+ GGUFs carry their RoPE scaling only as the ``rope_freqs`` tensor (the
# factor each frequency is divided by). These are the llama3 scalings Meta shipped
# (3.1: factor 8; 3.2 and 3.3: factor 32, or 8); a file's factors are matched
# against them and mlx-lm's Llama3RoPE recomputes the same.
_LLAMA3_SCALINGS = [
    {"rope_type": "llama3", "factor": f, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    for f in (8.0, 16.0, 32.0, 64.0)
]  # fmt: skip
# How close a file's rope_freqs must be to a known scaling (they are float32 of the same formula).
_ROPE_FREQS_RTOL = 1e-4



def architecture(path: Path, meta: Mapping[str, Any]) -> Arch:
    """The family of the file, or a ModelError naming those served."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelError(f"{path}: GGUF architecture {arch!r} has no mapping to mlx-lm in ringd; {_SERVED}")
    return ARCHITECTURES[arch]


def _refuse(g: Facts, why: str) -> ModelError:
    """A file of a served architecture that this mapping still cannot serve: why, and what is."""
    return ModelError(f"{g.path}: {why}; {_SERVED}")


def config(g: Facts) -> dict:
    """mlx-lm's config for the file, from its metadata (llama.cpp's keys, as its converter writes them)."""
    meta, arch, key = g.meta, architecture(g.path, g.meta), g.key
    embed = g.tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        raise ModelError(f"{g.path}: no token_embd.weight matrix; is this a complete GGUF file?")
    heads = key("attention.head_count")
    hidden = key("embedding_length")
    out: dict[str, Any] = {
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": key("block_count"),
        "intermediate_size": key("feed_forward_length", None if arch.model_type == "qwen3_moe" else ...),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length", hidden // heads),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", kind=float),
        "rope_theta": key("rope.freq_base", 10000.0, kind=float),
        "max_position_embeddings": key("context_length"),
        "vocab_size": embed.shape[0],
        "tie_word_embeddings": "output.weight" not in g.tensors,
    }
    pooling = GGUF_POOLINGS.get(meta.get(f"{g.arch}.pooling_type"))
    if pooling is not None:  # an embedding model's: how its embeddings pool (checkpoint.ModelInfo.pooling)
        out["pooling"] = pooling
    if arch.extra is not None:
        out.update(arch.extra(g))
    if arch.rope_interleaved:
        out["rope_traditional"] = True
    if arch.model_type == "llama":
        out["attention_bias"] = "blk.0.attn_q.bias" in g.tensors
        out["mlp_bias"] = "blk.0.ffn_up.bias" in g.tensors
    scaling = _rope_scaling(g, key("rope.dimension_count", out["head_dim"]), out["rope_theta"])
    if scaling is not None:
        out.setdefault("rope_scaling", scaling)  # a family's own (extra) first
    # Activations take the dtype of the norms (llama.cpp keeps them F32), and so the KV cache.
    norm = g.tensors.get("output_norm.weight")
    out["torch_dtype"] = {"F32": "float32", "BF16": "bfloat16"}.get(norm.type if norm else "", "float16")
    ends = _end_of_generation_ids(meta)
    if ends:
        out["eos_token_id"] = ends[0] if len(ends) == 1 else ends
    if meta.get("tokenizer.ggml.bos_token_id") is not None:
        out["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    return out


def _qwen3_moe(g: Facts) -> dict:
    """Qwen3-MoE's experts, as llama.cpp's qwen3moe reads them: every layer a mixture (llama.cpp
    has no dense layers in this architecture; a layer holding a plain feed-forward instead is
    taken as one, as mlx-lm's mlp_only_layers), the chosen experts' weights normalized (its
    build_moe_ffn with norm_w, Qwen3's norm_topk_prob)."""
    key = g.key
    layers = key("block_count")
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" not in g.tensors and f"blk.{i}.ffn_gate.weight" in g.tensors]
    experts = {
        "num_experts": key("expert_count"),
        "num_experts_per_tok": key("expert_used_count"),
        "moe_intermediate_size": key("expert_feed_forward_length"),
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        "norm_topk_prob": True,
    }
    if key("feed_forward_length", None) is None:  # the dense size, which only dense layers use
        experts["intermediate_size"] = experts["moe_intermediate_size"]
    return experts


# llama.cpp's expert_gating_func values (gguf-py's ExpertGatingFuncType).
_GATING_SOFTMAX, _GATING_SIGMOID = 1, 2
_FLOAT32_TENTH = 0.10000000149011612  # 0.1 as the float32 llama.cpp's converter multiplies in


def _deepseek2(g: Facts) -> dict:
    """DeepSeek-V2/V3's multi-head latent attention and experts, as DeepseekV2Model (llama.cpp's
    converter) writes them: the MLA sizes under key_length_mla/value_length_mla (key_length and
    head_count_kv, which mlx-lm's deepseek_v3 does not read, stay llama.cpp's absorbed form: one
    head of the latent and the RoPE part, what a position costs in the cache), kv_b_proj split per head
    into attn_k_b (transposed) and attn_v_b, which is exactly how mlx-lm's deepseek_v3 holds it
    (embed_q, unembed_out). Leading dense layers, shared experts, the router's correction bias
    (exp_probs_b), group-limited routing and yarn's attention scale as llama.cpp reads them.
    A softmax router (DeepSeek-V2, V2.5, V2-Lite; llama.cpp's default where the file names none) is
    mlx-lm's deepseek_v2, whose kv_b_proj is whole: made of attn_k_b and attn_v_b, from float
    tensors only (``_deepseek2_derived``)."""
    key, meta, arch = g.key, g.meta, g.arch
    if "blk.0.attn_kv_b.weight" in g.tensors and "blk.0.attn_k_b.weight" not in g.tensors:
        raise ModelError(
            f"{g.path}: this deepseek2 file keeps MLA's kv_b whole (llama.cpp's converter before it split "
            "kv_b into attn_k_b and attn_v_b); ringd serves the split form: convert the checkpoint again "
            "with a current llama.cpp, or take a newer GGUF of this model"
        )
    sigmoid = meta.get(f"{arch}.expert_gating_func", _GATING_SOFTMAX) == _GATING_SIGMOID  # softmax: llama.cpp's default (V2, V2.5)
    norm = bool(meta.get(f"{arch}.expert_weights_norm", False))
    if not sigmoid and norm:
        raise ModelError(f"{g.path}: deepseek2 with a softmax router whose weights are normalized is not what mlx-lm's deepseek_v2 computes")
    rope, layers = key("rope.dimension_count"), key("block_count")
    config: dict[str, Any] = {
        "kv_lora_rank": key("attention.kv_lora_rank"),
        "q_lora_rank": key("attention.q_lora_rank", None),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": key("attention.key_length_mla") - rope,
        "v_head_dim": key("attention.value_length_mla"),
        "first_k_dense_replace": meta.get(f"{arch}.leading_dense_block_count", 0),
        "moe_layer_freq": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": norm,
        "routed_scaling_factor": key("expert_weights_scale", 1.0, kind=float),
        "n_group": key("expert_group_count", 1),
        "topk_group": key("expert_group_used_count", 1),
    }
    if f"{arch}.expert_count" in meta:
        shared = meta.get(f"{arch}.expert_shared_count", 0)
        config.update(
            n_routed_experts=key("expert_count"),
            num_experts_per_tok=key("expert_used_count"),
            moe_intermediate_size=key("expert_feed_forward_length"),
            n_shared_experts=shared or None,
        )
    else:
        config["first_k_dense_replace"] = layers
    scaling = _rope_scaling(g, rope, key("rope.freq_base", 10000.0, kind=float))
    if scaling is not None and scaling.get("rope_type") == "yarn":
        # llama.cpp scales attention by (1 + yarn_log_multiplier ln factor)^2 and leaves RoPE unscaled
        # (its attn_factor cancels yarn's own): HF's mscale_all_dim = mscale = the multiplier / 0.1.
        # The file holds 0.1 * mscale_all_dim as a float32: divided by 0.1 as a float32, it comes back whole.
        mscale = float(meta.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0)) / _FLOAT32_TENTH
        scaling.update(mscale=mscale, mscale_all_dim=mscale)
        config["rope_scaling"] = scaling
    if not sigmoid:
        # DeepSeek-V2, V2.5, V2-Lite: mlx-lm's deepseek_v2, a softmax router (group-limited where the
        # file has groups), kv_b_proj whole (made of attn_k_b and attn_v_b: _deepseek2_derived).
        config.update(model_type="deepseek_v2", topk_method="group_limited_greedy" if config["n_group"] > 1 else "greedy")
        # It caches every head's keys and values, not llama.cpp's absorbed latent: what a position costs.
        config.update(num_key_value_heads=key("attention.head_count"), head_dim=config["qk_nope_head_dim"] + rope)
        del config["scoring_func"], config["norm_topk_prob"]
        config.setdefault("rope_scaling", {"type": "yarn", "factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0})  # it reads one: this one is none
    return config


_DEEPSEEK2_KV_B = re.compile(r"^model\.layers\.(\d+)\.self_attn\.kv_b_proj\.(weight|scales|biases)$")


def _deepseek2_derived(parameter: str, config: Mapping[str, Any]) -> Derived | None:
    """DeepseekV2Model.modify_tensors undone for mlx-lm's deepseek_v2, which holds kv_b_proj whole:
    each head's rows of k_b (stored transposed, as (kv_lora_rank, nope)) turned back and followed by
    its rows of v_b. The transpose crosses the blocks a quantized k_b is stored in, so only float
    k_b and v_b are taken (a quantized DeepSeek-V2 file is refused in one line naming the tensor)."""
    m = _DEEPSEEK2_KV_B.match(parameter)
    if m is None or config.get("model_type") != "deepseek_v2":
        return None

    def join(parts: list[dict[str, mx.array]]) -> dict[str, mx.array]:
        k_b, v_b = parts[0][""], parts[1][""]  # (heads, kv_lora_rank, nope), (heads, v_head_dim, kv_lora_rank)
        return {"": mx.concatenate([k_b.swapaxes(1, 2), v_b], axis=1).reshape(-1, k_b.shape[1])}

    bid = m.group(1)
    return Derived((f"blk.{bid}.attn_k_b.weight", f"blk.{bid}.attn_v_b.weight"), join, rows_only=False)


def _glm4moe(g: Facts) -> dict:
    """GLM-4.5's experts as Glm4MoeModel (llama.cpp's converter) writes them: block_count counts the
    NextN/MTP layers too (mlx-lm's glm4_moe drops them), a sigmoid router with its correction bias
    (exp_probs_b), shared experts, leading dense layers, partial RoPE as rope.dimension_count."""
    key, meta, arch = g.key, g.meta, g.arch
    if meta.get(f"{arch}.expert_gating_func", _GATING_SIGMOID) != _GATING_SIGMOID:
        raise ModelError(f"{g.path}: glm4moe with a softmax router is not what mlx-lm's glm4_moe computes (a sigmoid one)")
    if meta.get(f"{arch}.rope.scaling.type") not in (None, "none"):
        raise ModelError(f"{g.path}: glm4moe with RoPE scaling is not served (mlx-lm's glm4_moe applies none)")
    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", hidden // heads)
    shared = meta.get(f"{arch}.expert_shared_count", 0)
    return {
        "num_hidden_layers": key("block_count") - meta.get(f"{arch}.nextn_predict_layers", 0),
        "head_dim": head_dim,
        "partial_rotary_factor": key("rope.dimension_count", head_dim) / head_dim,
        "rope_scaling": None,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in g.tensors,
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
        "n_routed_experts": key("expert_count"),
        "num_experts_per_tok": key("expert_used_count"),
        "moe_intermediate_size": key("expert_feed_forward_length"),
        "n_shared_experts": shared or None,
        "first_k_dense_replace": meta.get(f"{arch}.leading_dense_block_count", 0),
        "routed_scaling_factor": key("expert_weights_scale", 1.0, kind=float),
        "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", False)),
        "n_group": key("expert_group_count", 1),
        "topk_group": key("expert_group_used_count", 1),
    }


def _minimax_m2(g: Facts) -> dict:
    """MiniMax-M2 as MiniMaxM2Model (llama.cpp's converter) writes it: every layer a mixture with a
    sigmoid router and its correction bias (exp_probs_b), the experts' width as
    expert_feed_forward_length, partial RoPE as rope.dimension_count (HF's rotary_dim), Q/K norms
    over all heads at once. mlx-lm's minimax has no shared expert: a file with one is refused."""
    key, meta, arch = g.key, g.meta, g.arch
    if meta.get(f"{arch}.expert_gating_func", _GATING_SIGMOID) != _GATING_SIGMOID:
        raise ModelError(f"{g.path}: minimax-m2 with a softmax router is not what mlx-lm's minimax computes (a sigmoid one)")
    if meta.get(f"{arch}.expert_shared_feed_forward_length") or meta.get(f"{arch}.expert_shared_count"):
        raise ModelError(f"{g.path}: minimax-m2 with a shared expert is not what mlx-lm's minimax computes (it has none)")
    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", hidden // heads)
    return {
        "head_dim": head_dim,
        "intermediate_size": key("expert_feed_forward_length"),
        "num_local_experts": key("expert_count"),
        "num_experts_per_tok": key("expert_used_count"),
        "shared_intermediate_size": 0,
        "rotary_dim": key("rope.dimension_count", head_dim),
        "use_qk_norm": "blk.0.attn_q_norm.weight" in g.tensors,
        "scoring_func": "sigmoid",
    }


def _qwen3next(g: Facts) -> dict:
    """Qwen3-Next as Qwen3NextModel (llama.cpp's converter, a Qwen2MoeModel) writes it: the linear
    attention's sizes under ssm.* (time_step_rank the value heads, group_count the key heads,
    state_size a key head's width, inner_size all value heads' width), every full_attention_interval-th
    layer full attention, experts with a shared expert behind a sigmoid gate, their weights
    normalized (llama.cpp's qwen3next build_moe_ffn normalizes them, as Qwen3-Next's
    norm_topk_prob does), partial RoPE as rope.dimension_count. Its norms llama.cpp stores with
    Qwen3-Next's 1 added, which is how mlx-lm's qwen3_next holds them."""
    key = g.key
    hidden, heads, layers = key("embedding_length"), key("attention.head_count"), key("block_count")
    head_dim = key("attention.key_length", hidden // heads)
    value_heads = key("ssm.time_step_rank")
    return {
        "head_dim": head_dim,
        "partial_rotary_factor": key("rope.dimension_count", head_dim) / head_dim,
        "linear_num_value_heads": value_heads,
        "linear_num_key_heads": key("ssm.group_count"),
        "linear_key_head_dim": key("ssm.state_size"),
        "linear_value_head_dim": key("ssm.inner_size") // value_heads,
        "linear_conv_kernel_dim": key("ssm.conv_kernel"),
        "full_attention_interval": key("full_attention_interval"),
        "num_experts": key("expert_count"),
        "num_experts_per_tok": key("expert_used_count"),
        "moe_intermediate_size": key("expert_feed_forward_length"),
        "shared_expert_intermediate_size": key("expert_shared_feed_forward_length"),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" not in g.tensors],
        "norm_topk_prob": True,
    }


_QWEN3NEXT_DERIVED = re.compile(r"^model\.layers\.(\d+)\.linear_attn\.(in_proj_qkvz\.(?:weight|scales|biases)|A_log|conv1d\.weight)$")


def _qwen3next_derived(parameter: str, config: Mapping[str, Any]) -> Derived | None:
    """Qwen3NextModel.modify_tensors undone: in_proj_qkvz, which it splits into attn_qkv (all heads'
    q, then k, then v) and attn_gate (z), joined back into HF's rows (q, k, v, z of one key head after
    another): whole rows moved, so exact whatever the type; A_log, which it stores as -exp(A_log)
    (ssm_a), as log(-ssm_a) (float32: within a unit in the last place of the checkpoint's); the
    depthwise conv1d, which it squeezes to (channels, kernel), as MLX's (channels, kernel, 1)."""
    m = _QWEN3NEXT_DERIVED.match(parameter)
    if m is None:
        return None
    bid, what = m.group(1), m.group(2)
    if what == "A_log":
        return Derived((f"blk.{bid}.ssm_a",), lambda parts: {"": mx.log(-parts[0][""].astype(mx.float32))}, rows_only=False)
    if what == "conv1d.weight":
        return Derived((f"blk.{bid}.ssm_conv1d.weight",), lambda parts: {"": parts[0][""][..., None]}, rows_only=False)
    nk, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
    per_key_head = config["linear_num_value_heads"] // nk * config["linear_value_head_dim"]

    def join(parts: list[dict[str, mx.array]]) -> dict[str, mx.array]:
        out = {}
        for part, qkv in parts[0].items():
            z = parts[1][part]
            q, k, v = qkv[: nk * dk], qkv[nk * dk : 2 * nk * dk], qkv[2 * nk * dk :]
            heads = [q.reshape(nk, dk, -1), k.reshape(nk, dk, -1), v.reshape(nk, per_key_head, -1), z.reshape(nk, per_key_head, -1)]
            out[part] = mx.concatenate(heads, axis=1).reshape(-1, qkv.shape[-1])
        return out

    return Derived((f"blk.{bid}.attn_qkv.weight", f"blk.{bid}.attn_gate.weight"), join, rows_only=True)


def _gpt_oss(g: Facts) -> dict:
    """gpt-oss as GptOssModel (llama.cpp's converter) writes it and llama.cpp reads it: its experts'
    width as expert_feed_forward_length, one sliding window, and the layers it applies to by
    llama.cpp's fixed pattern for gpt-oss (set_swa_pattern(2): even layers slide, odd ones see
    everything), which is the checkpoint's own layer_types; a file that lists its pattern
    (``attention.sliding_window_pattern``) is read as it says."""
    key, meta = g.key, g.meta
    layers = key("block_count")
    pattern = meta.get(f"{g.arch}.attention.sliding_window_pattern")
    sliding = [bool(p) for p in pattern] if isinstance(pattern, list) and len(pattern) == layers else [i % 2 == 0 for i in range(layers)]
    if all(sliding) or not any(sliding):
        raise ModelError(f"{g.path}: gpt-oss layers must mix sliding and full attention (mlx-lm's gpt_oss takes one mask of each)")
    return {
        "num_local_experts": key("expert_count"),
        "num_experts_per_tok": key("expert_used_count"),
        "intermediate_size": key("expert_feed_forward_length"),
        "sliding_window": key("attention.sliding_window"),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
    }


def _llama(g: Facts) -> dict:
    """A llama file with experts is a Mixtral (LlamaModel writes Mixtral as llama): llama.cpp's llama
    computes every layer as a mixture of ``expert_count`` experts (ffn_*_exps stacked, or one tensor
    an expert in early files, which ``gguf/reader.py`` stacks as llama.cpp's loader does; ffn_gate_inp the
    router), the chosen experts' softmax weights normalized (build_moe_ffn with norm_w), which is
    mlx-lm's mixtral."""
    key = g.key
    if key("expert_count", None) is None:
        return {}
    dense = _layers_without_stacked_experts(g)
    if dense:
        raise _refuse(g, f"a llama file with experts whose layers {dense[:4]} hold none (mlx-lm's mixtral has no dense layers)")
    heads, hidden = key("attention.head_count"), key("embedding_length")
    if key("attention.key_length", hidden // heads) != hidden // heads:
        raise _refuse(g, f"a llama file with experts and heads of {key('attention.key_length')}, not hidden size / heads (all mlx-lm's mixtral computes)")
    return {"model_type": "mixtral", "num_local_experts": key("expert_count"), "num_experts_per_tok": key("expert_used_count")}


def _layers_without_stacked_experts(g: Facts) -> list[int]:
    """The layers with no ffn_gate_exps; a file whose experts' gate and up are one tensor is refused."""
    fused = [name for name in g.tensors if name.endswith(".ffn_gate_up_exps.weight")]
    if fused:
        raise _refuse(g, f"experts' gate and up fused in one tensor ({fused[0]}: convert_hf_to_gguf's --fuse-gate-up-exps), which ringd does not split")
    return [i for i in range(g.key("block_count")) if f"blk.{i}.ffn_gate_exps.weight" not in g.tensors]


def _mistral3(g: Facts) -> dict:
    """Mistral Small 3.x as llama.cpp's Mistral3Model writes it: its text decoder as LlamaModel writes
    a llama (Q/K permuted), the vision tower left out; mlx-lm's mistral3 computes the same decoder with
    its llama. Ministral 3 (the same converter, with Llama 4's attention temperature and a yarn log
    multiplier) is mlx-lm's ministral3, which the ring has not proven."""
    if f"{g.arch}.attention.temperature_scale" in g.meta or f"{g.arch}.rope.scaling.yarn_log_multiplier" in g.meta:
        raise _refuse(g, "a Ministral 3 file (mistral3 with attention temperature scaling), which is mlx-lm's ministral3, not proven in the ring")
    return {}


def _qwen2vl(g: Facts) -> dict:
    """Qwen2-VL's and Qwen2.5-VL's decoder as llama.cpp's Qwen2VLModel writes it: Qwen2's, and
    ``rope.dimension_sections`` (the multimodal RoPE's, padded to 4 with zeros): mlx-lm's and
    mlx-vlm's ``rope_scaling`` of type mrope, its three sections."""
    sections = g.meta.get(f"{g.arch}.rope.dimension_sections")
    if not isinstance(sections, (list, tuple)) or len(sections) < 3 or any(type(s) is not int or s < 0 for s in sections):
        raise _refuse(g, f"a qwen2vl file whose rope.dimension_sections ({sections!r:.60}) are not its multimodal RoPE's")
    if any(sections[3:]):
        raise _refuse(g, f"a qwen2vl file with a fourth RoPE section ({list(sections)}), which mlx-vlm's Qwen2.5-VL does not have")
    return {"rope_scaling": {"type": "mrope", "mrope_section": list(sections[:3])}}


def _qwen2_moe(g: Facts) -> dict:
    """Qwen1.5/Qwen2-MoE as llama.cpp's qwen2moe reads it: every layer a mixture whose chosen experts'
    softmax weights are not normalized (build_moe_ffn without norm_w, as mlx-lm's qwen2_moe), plus a
    shared expert weighed by sigmoid(ffn_gate_inp_shexp); its size is the shared expert's tensor's
    where the key is missing, as llama.cpp takes it."""
    key = g.key
    dense = _layers_without_stacked_experts(g)
    if dense:
        raise _refuse(g, f"a qwen2moe file whose layers {dense[:4]} hold no stacked experts (mlx-lm's qwen2_moe has no dense layers)")
    shared = g.tensors.get("blk.0.ffn_up_shexp.weight")
    return {
        "num_experts": key("expert_count"),
        "num_experts_per_tok": key("expert_used_count"),
        "moe_intermediate_size": key("expert_feed_forward_length"),
        "shared_expert_intermediate_size": key("expert_shared_feed_forward_length", shared.shape[0] if shared is not None else ...),
    }


def _shared_expert_gate_fix(name: str, array: mx.array) -> mx.array:
    # The converter squeezes the shared expert's gate, a (1, hidden) matrix, to a vector
    # (ModelBase.prepare_tensors; Qwen2-MoE's and Qwen3-Next's).
    return array.reshape(1, -1) if name.endswith("shared_expert_gate.weight") else array


def _phi3(g: Facts) -> dict:
    """Phi-3 as llama.cpp's phi3 reads it: attention as one fused attn_qkv and the feed-forward's gate
    and up as one ffn_up (HF's own qkv_proj and gate_up_proj, which mlx-lm's phi3 keeps too), the
    rotation over ``rope.dimension_count`` of each head.

    Two things mlx-lm's phi3 computes otherwise than llama.cpp, as it does on the original
    checkpoint: llama.cpp slides a window over every layer where the file names one
    (Phi-3-mini-4k: 2047), mlx-lm attends to the whole context, so the two agree up to the
    window; and LongRoPE (the 128k Phi-3s, Phi-3.5-mini, Phi-4-mini: the rope_factors_long and
    rope_factors_short tensors) takes the long factors at every length in mlx-lm, where llama.cpp
    takes the short ones while its context is within the original length."""
    key = g.key
    heads, hidden = key("attention.head_count"), key("embedding_length")
    head_dim = hidden // heads  # mlx-lm's phi3 (and llama.cpp's) sizes heads so
    context = key("context_length")
    original = key("rope.scaling.original_context_length", context)
    out = {
        "partial_rotary_factor": key("rope.dimension_count", head_dim) / head_dim,
        "original_max_position_embeddings": original,
    }
    factors = [name for name in ("rope_factors_long.weight", "rope_factors_short.weight") if name in g.tensors]
    if factors:
        if len(factors) != 2:
            raise _refuse(g, f"a phi3 file with {factors[0]} alone (LongRoPE takes both rope_factors_long and rope_factors_short)")
        # mlx-lm's SuScaledRoPE scales queries by LongRoPE's own attention factor, from the context
        # lengths; llama.cpp by the file's (which the converter computes so, but for YaRN's).
        scale = context / original
        longrope = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        stated = key("rope.scaling.attn_factor", longrope, kind=float)
        if not math.isclose(stated, longrope, rel_tol=_ROPE_FREQS_RTOL):
            raise _refuse(g, f"a phi3 file whose RoPE attention factor {stated:.6g} is not LongRoPE's {longrope:.6g} (a YaRN Phi), which mlx-lm's phi3 does not compute")
        # Each float32 factor as the shortest decimal that is it (1.1, not 1.100000023841858): the
        # checkpoint's config.json numbers, which mlx-lm rounds to the same float32 values.
        long, short = (
            [float(str(v)) for v in np.array(g.read(name).astype(mx.float32))] for name in ("rope_factors_long.weight", "rope_factors_short.weight")
        )
        out["rope_scaling"] = {"type": "longrope", "long_factor": long, "short_factor": short}
    return out


# llama.cpp's llama_model::load_hparams: Gemma 2's 27B (46 layers) and Gemma 3's 27B (62) scale
# queries by 1/sqrt(hidden size / heads), the others by 1/sqrt(head size), as Google's reference does.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp's defaults for Gemma 2 files without the keys (llama_hparams).
_GEMMA2_ATTN_SOFTCAP, _GEMMA2_FINAL_SOFTCAP = 50.0, 30.0
# What llama.cpp fixes for every Gemma 3 file rather than reading it (load_hparams, LLM_ARCH_GEMMA3):
# five sliding-window layers to one global, and the sliding layers' RoPE base. A file that states
# them (attention.sliding_window_pattern, rope.freq_base_swa) is read as it says.
_GEMMA3_SLIDING_WINDOW_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10000.0


def _gemma_query_scalar(g: Facts) -> int:
    key = g.key
    heads, hidden = key("attention.head_count"), key("embedding_length")
    if key("block_count") == _GEMMA_27B_LAYERS[g.arch]:
        return hidden // heads
    return key("attention.key_length", hidden // heads)


def _gemma2(g: Facts) -> dict:
    """Gemma 2 as llama.cpp's gemma2 reads it: soft-capped attention and logits, norms after attention
    and after the feed-forward, the head tied to the embeddings. llama.cpp slides a window
    (``attention.sliding_window``) over every other layer; mlx-lm's gemma2 attends to the whole
    context, as it does on the original checkpoint, so the two agree up to the window (4096)."""
    key = g.key
    return {
        "query_pre_attn_scalar": _gemma_query_scalar(g),
        "attn_logit_softcapping": key("attn_logit_softcapping", _GEMMA2_ATTN_SOFTCAP, kind=float),
        "final_logit_softcapping": key("final_logit_softcapping", _GEMMA2_FINAL_SOFTCAP, kind=float),
    }


def _gemma3(g: Facts) -> dict:
    """Gemma 3's text decoder as llama.cpp's gemma3 reads it: q/k norms, post norms, five sliding
    layers (their own RoPE base) to one global one, linear RoPE scaling on the global layers only
    (as mlx-lm's gemma3_text), no logit soft-capping."""
    key = g.key
    if key("final_logit_softcapping", None, kind=float) is not None:
        raise _refuse(g, "a gemma3 file with final logit soft-capping, which mlx-lm's gemma3_text does not compute")
    pattern = _GEMMA3_SLIDING_WINDOW_PATTERN
    sliding = g.meta.get(f"{g.arch}.attention.sliding_window_pattern")  # one flag a layer, where a file says
    if sliding is not None:
        sliding = [bool(s) for s in sliding]
        pattern = sliding.index(False) + 1 if False in sliding else len(sliding) + 1
        if sliding != [(i + 1) % pattern != 0 for i in range(len(sliding))]:
            raise _refuse(g, f"a gemma3 file whose sliding layers ({sliding[:8]}...) repeat no pattern mlx-lm's gemma3_text holds (n-1 sliding, then one global)")
    return {
        "query_pre_attn_scalar": _gemma_query_scalar(g),
        "sliding_window": key("attention.sliding_window"),
        "sliding_window_pattern": pattern,
        "rope_local_base_freq": key("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE, kind=float),
    }


def _gemma_norm(name: str, array: mx.array) -> mx.array:
    # Gemma's RMSNorm computes with 1 + weight; llama.cpp's converter stores weight + 1
    # (GemmaModel.modify_tensors, Gemma3Model.norm_shift) and mlx-lm adds the 1 itself.
    return array - 1 if name.endswith("norm.weight") else array


def _gemma3_built(model, config: dict) -> None:
    # mlx-lm's gemma3_text ties its head in sanitize, when the checkpoint holds no lm_head.
    if config["tie_word_embeddings"]:
        model.sanitize({})


# Tokens llama.cpp ends a generation on by their text, besides the ids the file names
# (llama-vocab.cpp, where it builds special_eog_ids): files often name only one of a
# chat model's end tokens (SmolLM2 names <|im_end|>, Llama 3.1 <|eot_id|> but not <|eom_id|>).
_END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
})  # fmt: skip
_CONTROL = 3  # tokenizer.ggml.token_type of a control token


def _end_of_generation_ids(meta: dict) -> list[int]:
    """The ids a generation ends on, as llama.cpp finds them: eos, eot and eom as the file names
    them, then the control tokens spelled as a known end token."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or []
    ids = [int(meta[f"tokenizer.ggml.{k}_token_id"]) for k in ("eos", "eot", "eom") if meta.get(f"tokenizer.ggml.{k}_token_id") is not None]
    ids += [i for i, (t, k) in enumerate(zip(tokens, types)) if k == _CONTROL and t in _END_OF_GENERATION_TEXTS]
    return [i for i in dict.fromkeys(ids) if 0 <= i < len(tokens)]


def _rope_scaling(g: Facts, dims: int, base: float) -> dict | None:
    key = g.key
    kind = g.meta.get(f"{g.arch}.rope.scaling.type")
    factor = key("rope.scaling.factor", None, kind=float)
    if "rope_freqs.weight" in g.tensors:
        return _llama3_scaling(g, dims, base)
    if kind in (None, "none") or (kind == "linear" and not factor):
        return None
    if kind == "linear":
        return {"type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(factor)}
        original = key("rope.scaling.original_context_length", None)
        if original:
            scaling["original_max_position_embeddings"] = original
        for ours, theirs in (("beta_fast", "rope.scaling.yarn_beta_fast"), ("beta_slow", "rope.scaling.yarn_beta_slow")):
            if (value := key(theirs, None, kind=float)) is not None:
                scaling[ours] = value
        return scaling
    raise ModelError(f"{g.path}: RoPE scaling {kind!r} is not mapped by ringd (linear, yarn and llama3 are)")


def _llama3_scaling(g: Facts, dims: int, base: float) -> dict:
    from mlx_lm.models.rope_utils import Llama3RoPE

    have = g.read("rope_freqs.weight")
    for scaling in _LLAMA3_SCALINGS:
        rope = Llama3RoPE(dims, traditional=True, base=base, scaling_config=scaling)
        want = rope._freqs / (base ** (mx.arange(0, dims, 2) / dims))
        if have.shape == want.shape and mx.allclose(have, want, rtol=_ROPE_FREQS_RTOL).item():
            return dict(scaling)
    raise ModelError(f"{g.path}: its rope_freqs match none of the llama3 RoPE scalings ringd knows (factor 8 to 64)")
