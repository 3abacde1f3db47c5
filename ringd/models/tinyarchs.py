"""Tiny configurations of real mlx-lm architectures, for tiny random models (``tinymodel.py``).

Each entry is the config.json an architecture's own ``ModelArgs`` reads, made
small: a few layers, hidden size 64, four experts where there are experts, a
latent rank of 32 for multi-head latent attention, a sliding window of 16 (so a
40-token answer outgrows it), patterns short enough that a six-layer model holds
each kind twice (sliding and global, linear and full attention, dense then MoE).
Sizes come from the caller; what is here is what makes each architecture itself.

Also per architecture: the dtype its tiny model is written in (float32 where
MLX's CPU backend has no lower-precision kernel, e.g. the gather matmul of MoE
layers), and how its norms are parameterized (Gemma's RMSNorm computes with
``1 + weight``, so its weights start around 0, not 1).

What it deliberately ignores: anything about quality; and architectures the
ring does not claim (``checkpoint.SUPPORTED_ARCHITECTURES`` is the list tests prove).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Base:
    """The sizes every architecture shares; each builder reads what it needs."""

    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie: bool
    dtype: str
    eos_token_id: int
    pad_token_id: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.heads


# Every sliding window in these models: short enough that prompt + answer outgrow it.
SLIDING_WINDOW = 16
# Experts per MoE layer and per token: enough for routing to matter, few enough to stay tiny.
EXPERTS, EXPERTS_PER_TOKEN = 4, 2
MLA_KV_LORA_RANK, MLA_Q_LORA_RANK, MLA_ROPE_DIM, MLA_NOPE_DIM, MLA_V_DIM = 32, 48, 8, 16, 16


@dataclass(frozen=True)
class ArchSpec:
    hf_class: str
    tied: bool  # tie_word_embeddings by default
    dtype: str  # the dtype its tiny model is written in by default
    extra: Callable[[Base], dict]  # config.json fields beyond the common ones
    norm_center: float = 1.0  # RMSNorm weights start at this plus noise (Gemma: 0, it adds 1)
    # Centers of particular norms, by module name: Gemma scales its embeddings by
    # sqrt(hidden_size), so its layers' outputs (through these norms) must be larger
    # to count against them in the residual stream.
    norm_centers: tuple[tuple[str, float], ...] = ()
    text_config: bool = False  # a multimodal checkpoint: the decoder's config under text_config
    weight_scale: float | None = None  # overrides tinymodel's default where output needs it


def _moe(b: Base) -> int:
    return max(16, b.intermediate_size // 4)


def _llama(b: Base) -> dict:
    return {"mlp_bias": False, "pretraining_tp": 1, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}


def _qwen(b: Base) -> dict:
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": b.layers, "rope_theta": 1000000.0}


def _phi3(b: Base) -> dict:
    return {"rope_theta": 10000.0, "partial_rotary_factor": 1.0, "original_max_position_embeddings": b.max_position_embeddings}


def _gemma2(b: Base) -> dict:
    return {"query_pre_attn_scalar": b.head_dim, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh"}


def _gemma3(b: Base) -> dict:
    return {
        "query_pre_attn_scalar": b.head_dim, "sliding_window": SLIDING_WINDOW, "sliding_window_pattern": 3,
        "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0, "rope_scaling": None,
    }  # fmt: skip


def _mixtral(b: Base) -> dict:
    return {"num_local_experts": EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN, "rope_theta": 1000000.0}


def _qwen2_moe(b: Base) -> dict:
    return {
        "num_experts": EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN, "moe_intermediate_size": _moe(b),
        "shared_expert_intermediate_size": _moe(b) * 2, **_qwen(b),
    }  # fmt: skip


def _qwen3_moe(b: Base) -> dict:
    # Layer 0 dense, the rest MoE: a cut can fall at the dense/MoE boundary.
    return {
        "num_experts": EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN, "decoder_sparse_step": 1,
        "mlp_only_layers": [0], "moe_intermediate_size": _moe(b), "norm_topk_prob": True, **_qwen(b),
    }  # fmt: skip


def _deepseek(b: Base, v3: bool) -> dict:
    d = {
        "kv_lora_rank": MLA_KV_LORA_RANK, "q_lora_rank": MLA_Q_LORA_RANK, "qk_rope_head_dim": MLA_ROPE_DIM,
        "qk_nope_head_dim": MLA_NOPE_DIM, "v_head_dim": MLA_V_DIM, "n_routed_experts": EXPERTS,
        "n_shared_experts": 1, "num_experts_per_tok": EXPERTS_PER_TOKEN, "moe_intermediate_size": _moe(b),
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "routed_scaling_factor": 1.0, "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn", "factor": 1.0, "original_max_position_embeddings": b.max_position_embeddings,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.0,
        },
    }  # fmt: skip
    if v3:
        d.update(topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, n_group=1, topk_group=1)
    else:
        d.update(topk_method="greedy", n_group=None, topk_group=None)
    return d


def _glm4_moe(b: Base) -> dict:
    return {
        "moe_intermediate_size": _moe(b), "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
        "n_shared_experts": 1, "n_routed_experts": EXPERTS, "routed_scaling_factor": 1.0,
        "num_experts_per_tok": EXPERTS_PER_TOKEN, "first_k_dense_replace": 1, "rope_scaling": None,
        "use_qk_norm": True, "attention_bias": True, "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
    }  # fmt: skip


def _gpt_oss(b: Base) -> dict:
    # Alternating sliding and full attention, as gpt-oss does.
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(b.layers)]
    return {
        "num_local_experts": EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN, "sliding_window": SLIDING_WINDOW,
        "layer_types": types, "rope_theta": 150000.0, "rope_scaling": None,
    }  # fmt: skip


def _minimax(b: Base) -> dict:
    return {
        "num_local_experts": EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN, "shared_intermediate_size": 0,
        "rotary_dim": b.head_dim // 2, "use_qk_norm": True, "rope_theta": 10000.0, "scoring_func": "sigmoid",
    }  # fmt: skip


def _qwen3_next(b: Base) -> dict:
    # Every third layer full attention, the others linear (gated delta net).
    return {
        "linear_num_value_heads": b.heads, "linear_num_key_heads": b.kv_heads, "linear_key_head_dim": b.head_dim,
        "linear_value_head_dim": b.head_dim, "linear_conv_kernel_dim": 4, "num_experts": EXPERTS,
        "num_experts_per_tok": EXPERTS_PER_TOKEN, "decoder_sparse_step": 1, "shared_expert_intermediate_size": _moe(b),
        "mlp_only_layers": [], "moe_intermediate_size": _moe(b), "partial_rotary_factor": 0.25,
        "full_attention_interval": 3, "rope_theta": 10000.0, "norm_topk_prob": True,
    }  # fmt: skip


def _mistral3(b: Base) -> dict:
    # Mistral Small 3.x: a Mistral (llama) decoder under text_config; the vision tower is not ours.
    return {"model_type": "mistral", **_llama(b), "rope_theta": 1000000000.0}


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("LlamaForCausalLM", False, "bfloat16", _llama),
    "mistral": ArchSpec("MistralForCausalLM", False, "bfloat16", lambda b: {**_llama(b), "sliding_window": None}),
    "qwen2": ArchSpec("Qwen2ForCausalLM", True, "bfloat16", _qwen),
    "qwen3": ArchSpec("Qwen3ForCausalLM", True, "bfloat16", _qwen),
    "phi3": ArchSpec("Phi3ForCausalLM", False, "bfloat16", _phi3),
    "gemma2": ArchSpec(
        "Gemma2ForCausalLM", True, "bfloat16", _gemma2, norm_center=0.0,
        norm_centers=(("post_attention_layernorm", 3.0), ("post_feedforward_layernorm", 3.0)),
    ),  # fmt: skip
    "gemma3_text": ArchSpec("Gemma3ForCausalLM", False, "bfloat16", _gemma3, norm_center=0.0),
    "mixtral": ArchSpec("MixtralForCausalLM", False, "float32", _mixtral),
    "qwen2_moe": ArchSpec("Qwen2MoeForCausalLM", False, "float32", _qwen2_moe),
    "qwen3_moe": ArchSpec("Qwen3MoeForCausalLM", False, "float32", _qwen3_moe),
    # Multi-head latent attention computes through two low-rank products: its
    # tiny weights need more scale for the output to wander.
    "deepseek_v2": ArchSpec("DeepseekV2ForCausalLM", False, "float32", lambda b: _deepseek(b, v3=False), weight_scale=0.14),
    "deepseek_v3": ArchSpec("DeepseekV3ForCausalLM", False, "float32", lambda b: _deepseek(b, v3=True), weight_scale=0.2),
    "glm4_moe": ArchSpec("Glm4MoeForCausalLM", False, "float32", _glm4_moe),
    "gpt_oss": ArchSpec("GptOssForCausalLM", False, "float32", _gpt_oss),
    "minimax": ArchSpec("MiniMaxM2ForCausalLM", False, "float32", _minimax),
    "qwen3_next": ArchSpec("Qwen3NextForCausalLM", False, "float32", _qwen3_next),
    "mistral3": ArchSpec("Mistral3ForConditionalGeneration", False, "bfloat16", _mistral3, text_config=True),
}


def config_for(arch: str, b: Base) -> dict:
    """config.json of a tiny ``arch`` with the sizes in ``b``."""
    spec = ARCHS[arch]
    common = {
        "model_type": arch,
        "hidden_size": b.hidden_size,
        "intermediate_size": b.intermediate_size,
        "num_hidden_layers": b.layers,
        "num_attention_heads": b.heads,
        "num_key_value_heads": b.kv_heads,
        "head_dim": b.head_dim,
        "hidden_act": "silu",
        "vocab_size": b.vocab_size,
        "max_position_embeddings": b.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": arch == "qwen2" or arch == "qwen2_moe",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": b.tie,
        "bos_token_id": None,
        "eos_token_id": b.eos_token_id,
        "pad_token_id": b.pad_token_id,
        "torch_dtype": b.dtype,
        "dtype": b.dtype,
        "use_cache": True,
    }
    text = {**common, **spec.extra(b)}
    if not spec.text_config:
        return {"architectures": [spec.hf_class], **text}
    top = {k: common[k] for k in ("eos_token_id", "pad_token_id", "torch_dtype", "dtype", "tie_word_embeddings")}
    return {"architectures": [spec.hf_class], "model_type": arch, "text_config": text, **top}
