"""GGUF files of the heavier MoE families, written as llama.cpp's converter writes them (ggufmake), served as ring stages.

For each family ringd maps: a tiny model of the mlx-lm architecture, written to GGUF
by ``ggufmake`` as llama.cpp's converter class for it writes it, computes through
ring stages cut at every layer boundary exactly what mlx-lm computes on the
conversion ``ringd convert`` writes of the same file (token for token, logit for
logit), and the float file what mlx-lm computes on the original model (which alone
proves the mapping: the conversion shares it). What llama.cpp stores that ringd
cannot serve exactly is refused at start with one line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from test_gguf import PROMPT

from ringd.models.errors import ModelError
from ringd.models.source import model_info
from devkit.stagering import greedy, reference, ring

# DeepSeek and GLM: a dense first layer, then two MoE layers (cuts at the dense/MoE boundary and
# between MoE layers); gpt-oss: sliding, full, sliding; Qwen3-Next: linear, linear, full attention.
LAYERS = 3
# A stage per layer: every cut at once (test_gguf.py holds single cuts of the same code).
CUTS = ((0, 1), (1, 2), (2, LAYERS))
# Rows of whole 32-weight blocks where the family allows (FFN 128, experts 32).
SIZES = {"layers": LAYERS, "dtype": "float32", "intermediate_size": 128}

# DeepSeek-V3's own YaRN (factor 40, mscale = mscale_all_dim = 1), made small: a factor above 1
# so that the attention scale llama.cpp derives from yarn_log_multiplier counts.
DEEPSEEK_YARN = {
    "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32, "beta_slow": 1,
    "mscale": 1.0, "mscale_all_dim": 1.0,
}  # fmt: skip
# gpt-oss's own (factor 32, truncate false, which neither llama.cpp's file nor mlx-lm keeps), made small.
GPT_OSS_YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 1024}

# family: (tiny arch, its extra sizes, config.json changes, the second file's type and its tensor
# types besides). DeepSeek checkpoints have as many KV heads as heads (the converter's kv_b split
# asserts it); DeepSeek-V2 (softmax router) is served from float files only; gpt-oss's experts
# are MXFP4 in every GGUF of it (the checkpoint's own).
FAMILIES = {
    "deepseek2": ("deepseek_v3", {"kv_heads": 4}, {"rope_scaling": DEEPSEEK_YARN}, "q8_0", {}),
    "deepseek2-v2": ("deepseek_v2", {"kv_heads": 4}, {"rope_scaling": DEEPSEEK_YARN}, "f16", {}),
    "glm4moe": ("glm4_moe", {}, {}, "q8_0", {}),
    "minimax-m2": ("minimax", {}, {}, "q8_0", {}),
    "qwen3next": ("qwen3_next", {}, {}, "q8_0", {}),
    "gpt-oss": ("gpt_oss", {}, {"rope_scaling": GPT_OSS_YARN}, "q8_0", {f"blk.{i}.ffn_{p}_exps.weight": "mxfp4" for i in range(LAYERS) for p in ("gate", "up", "down")}),
}

# What the config read from the file must say (what llama.cpp stores in its own terms).
CONFIG = {
    "deepseek2": {
        "rope_scaling": {
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        },
        "first_k_dense_replace": 1, "n_shared_experts": 1, "q_lora_rank": 48, "qk_nope_head_dim": 16, "v_head_dim": 16,
    },
    "deepseek2-v2": {"topk_method": "greedy", "num_key_value_heads": 4, "head_dim": 24, "first_k_dense_replace": 1},
    "glm4moe": {"partial_rotary_factor": 0.5, "first_k_dense_replace": 1, "n_shared_experts": 1, "use_qk_norm": True, "attention_bias": True},
    "minimax-m2": {"rotary_dim": 8, "use_qk_norm": True, "intermediate_size": 128, "num_local_experts": 4},
    "qwen3next": {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_value_head_dim": 16, "full_attention_interval": 3, "partial_rotary_factor": 0.25},
    "gpt-oss": {
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "sliding_window": 16, "intermediate_size": 128,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0},
    },
}  # fmt: skip

# A MoE layer's tensors as llama.cpp's loader asks for them (llama-model.cpp's create_tensor calls,
# by the names llama-arch.cpp gives them), written out here rather than taken from gguf-py's map,
# which both ggufmake and ringd use: a name both got wrong the same way would show here.
_MOE = {"ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"}
_SHARED = {"ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"}
_MLA = {
    "attn_norm.weight", "attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight", "attn_kv_a_mqa.weight",
    "attn_kv_a_norm.weight", "attn_k_b.weight", "attn_v_b.weight", "attn_output.weight", "ffn_norm.weight",
}
_QK = {"attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_q_norm.weight", "attn_k_norm.weight"}
LAYER_TENSORS = {
    "deepseek2": {1: _MLA | _MOE | _SHARED | {"exp_probs_b.bias"}},
    "deepseek2-v2": {1: _MLA | _MOE | _SHARED},
    "glm4moe": {1: _QK | _MOE | _SHARED | {"attn_norm.weight", "post_attention_norm.weight", "attn_q.bias", "attn_k.bias", "attn_v.bias", "exp_probs_b.bias"}},
    "minimax-m2": {1: _QK | _MOE | {"attn_norm.weight", "ffn_norm.weight", "exp_probs_b.bias"}},
    "qwen3next": {
        1: _MOE | _SHARED | {"attn_norm.weight", "post_attention_norm.weight", "ffn_gate_inp_shexp.weight", "attn_qkv.weight",
                             "attn_gate.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_ba.weight", "ssm_norm.weight", "ssm_out.weight"},
        2: _QK | _MOE | _SHARED | {"attn_norm.weight", "post_attention_norm.weight", "ffn_gate_inp_shexp.weight"},
    },
    "gpt-oss": {
        1: _QK - {"attn_q_norm.weight", "attn_k_norm.weight"} | _MOE | {"attn_norm.weight", "post_attention_norm.weight", "attn_sinks.weight",
            "attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias", "ffn_gate_inp.bias", "ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias"},
    },
}  # fmt: skip


# The tiny models' routers have a zero correction bias, where a trained model's is not: these get
# seeded values of this size, near the sigmoid scores' spread, so that the bias moves the routing
# (measured: it changes 8 to 24 of the 24 greedy tokens of deepseek_v3, glm4_moe and minimax).
CORRECTION_BIAS_STD = 0.1


def _source(tiny_model, tmp_path_factory, arch: str, sizes: dict, changes: dict) -> Path:
    """The tiny model, with ``changes`` to its config and its routers' correction bias made nonzero:
    a model of its own, in a folder of its own."""
    import numpy as np

    source = tiny_model(arch=arch, **SIZES, **sizes)
    changed = tmp_path_factory.mktemp("changed") / source.name
    shutil.copytree(source, changed)
    config = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**config, **changes}))
    weights = mx.load(str(changed / "model.safetensors"))
    rng = np.random.default_rng(0)
    for name, w in weights.items():
        if name.endswith("e_score_correction_bias"):
            weights[name] = mx.array(rng.normal(0, CORRECTION_BIAS_STD, w.shape).astype(np.float32))
    mx.save_safetensors(str(changed / "model.safetensors"), weights, metadata={"format": "mlx"})
    return changed


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_computes_what_mlx_lm_computes_at_every_cut(tiny_model, tmp_path_factory, family):
    """The float file against the original model (config, names, llama.cpp's tensor forms), and
    the quantized (or F16) file at every cut against mlx-lm on ``ringd convert``'s conversion, bit for bit."""
    from mlx_lm import load

    from devkit.ggufmake import write_gguf
    from ringd.models.gguf.reader import GgufFile
    from ringd.stage.shard import Shard

    arch, sizes, changes, qtype, types = FAMILIES[family]
    source = _source(tiny_model, tmp_path_factory, arch, sizes, changes)
    out = tmp_path_factory.mktemp(family)
    model, tokenizer = load(str(source))
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True))
    want, want_logits = greedy(reference(model), prompt)
    assert len(set(want)) >= 8, "the reference repeats itself: the test would prove little"

    plain = write_gguf(source, out / "f32.gguf")
    for block, names in LAYER_TENSORS[family].items():
        assert {n.split(".", 2)[2] for n in GgufFile.open(plain).tensors if n.startswith(f"blk.{block}.")} == names
    config = model_info(str(plain)).config
    assert config["model_type"] == arch
    for key, value in CONFIG.get(family, {}).items():
        assert config[key] == value, key
    got, got_logits = greedy(ring([Shard.load(str(plain), a, b) for a, b in CUTS]), prompt)
    assert got == want
    for a, b in zip(want_logits, got_logits):
        assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item()

    path = write_gguf(source, out / f"{qtype}.gguf", qtype=qtype, types=types)
    GgufFile.open(path).convert(out / "converted")  # what `ringd convert` does (test_gguf.py runs the command)
    converted, _ = load(str(out / "converted"))
    want, want_logits = greedy(reference(converted), prompt)
    assert len(set(want)) >= 8
    got, got_logits = greedy(ring([Shard.load(str(path), a, b) for a, b in CUTS]), prompt)
    for i, (a, b) in enumerate(zip(want_logits, got_logits)):
        assert mx.array_equal(a, b).item(), f"logits differ from mlx-lm's on the conversion at step {i}"
    assert got == want


def test_what_deepseek2_files_hold_that_mlx_lm_cannot_take_is_refused_in_one_line(tiny_model, tmp_path_factory):
    """A quantized DeepSeek-V2 (softmax router: mlx-lm's deepseek_v2 wants kv_b_proj whole, which
    the file holds split, k_b transposed across its blocks), and a file from before llama.cpp split kv_b."""
    from devkit.ggufmake import write_gguf
    from ringd.models.gguf.reader import GgufFile, _parse
    from ringd.stage.shard import Shard

    v2 = write_gguf(tiny_model(arch="deepseek_v2", **SIZES, kv_heads=4), tmp_path_factory.mktemp("v2") / "v2.gguf", qtype="q8_0")
    with pytest.raises(ModelError, match=r"blk.0.attn_v_b.weight is Q8_0; ringd computes model.layers.0.self_attn.kv_b_proj.weight from it only from a float tensor") as e:
        Shard.load(str(v2), 0, LAYERS)
    assert "\n" not in str(e.value)

    v3 = write_gguf(tiny_model(arch="deepseek_v3", **SIZES, kv_heads=4), tmp_path_factory.mktemp("v3") / "v3.gguf")
    meta, tensors, data_offset = _parse(v3, v3.stat().st_size)
    whole = {n.replace("attn_k_b", "attn_kv_b"): t for n, t in tensors.items() if "attn_v_b" not in n}
    with pytest.raises(ModelError, match=r"keeps MLA's kv_b whole .* convert the checkpoint again with a current llama.cpp") as e:
        GgufFile(v3, meta, whole, data_offset)
    assert "\n" not in str(e.value)


def test_what_qwen3next_files_hold_that_ringd_would_have_to_requantize_is_refused_in_one_line(tiny_model, tmp_path_factory):
    """in_proj_qkvz is joined from attn_qkv and attn_gate row by row, which is exact only where both
    are of one type; ssm_a becomes A_log through a logarithm, which needs its values (a float tensor)."""
    import dataclasses

    from mlx.utils import tree_flatten

    from devkit.ggufmake import write_gguf
    from ringd.models.gguf.reader import GgufFile, _parse

    path = write_gguf(tiny_model(arch="qwen3_next", **SIZES), tmp_path_factory.mktemp("qwen3next") / "q8_0.gguf", qtype="q8_0")
    meta, tensors, data_offset = _parse(path, path.stat().st_size)
    for name, kind, message in (
        ("blk.0.attn_gate.weight", "Q4_0", r"blk.0.attn_qkv.weight \(Q8_0\), blk.0.attn_gate.weight \(Q4_0\) make one parameter \(model.layers.0.linear_attn.in_proj_qkvz.weight\) and must be of one type"),
        ("blk.0.ssm_a", "Q8_0", r"blk.0.ssm_a is Q8_0; ringd computes model.layers.0.linear_attn.A_log from it only from a float tensor"),
    ):
        changed = {**tensors, name: dataclasses.replace(tensors[name], type=kind)}
        with pytest.raises(ModelError, match=message) as e:
            g = GgufFile(path, meta, changed, data_offset)
            g.read([p for p, _ in tree_flatten(g.build_model().parameters())])
        assert "\n" not in str(e.value)
