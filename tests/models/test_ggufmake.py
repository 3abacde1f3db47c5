"""ggufmake writes what llama.cpp's converter would: checked with gguf-py's reader and MLX's own loader.

The expected GGUF names below are written out by hand (as mlx-lm's ``gguf.py`` does for
llama), not taken from gguf-py's TensorNameMap that ggufmake uses, so the two agree
independently.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from devkit.ggufmake import permute, write_gguf

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")
# Every row length a multiple of 32 (FFN 128, experts 128 // 4), so that every 2-D weight
# takes the 32-weight blocks; the default tiny FFN (176) does not (see the F16 test).
BLOCKS_FIT = {"intermediate_size": 128}

GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "lm_head.weight": "output.weight",
    "model.norm.weight": "output_norm.weight",
}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.switch_mlp.gate_proj.weight": "ffn_gate_exps.weight",
    "mlp.switch_mlp.up_proj.weight": "ffn_up_exps.weight",
    "mlp.switch_mlp.down_proj.weight": "ffn_down_exps.weight",
}
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}


def _source(model_dir: Path) -> dict[str, np.ndarray]:
    """The checkpoint's tensors by the GGUF name llama.cpp gives them, as float32, in HF order."""
    out = {}
    for name, x in mx.load(str(model_dir / "model.safetensors")).items():
        if name in GGUF_NAMES:
            gguf_name = GGUF_NAMES[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            gguf_name = f"blk.{layer}.{LAYER_NAMES[rest]}"
        out[gguf_name] = np.array(x.astype(mx.float32))
    return out


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of LlamaModel.permute: interleaved RoPE pairs back to HF's halves."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_order(name: str, x: np.ndarray, arch: str, config: dict) -> np.ndarray:
    if arch == "llama" and name.endswith("attn_q.weight"):
        return unpermute(x, config["num_attention_heads"])
    if arch == "llama" and name.endswith("attn_k.weight"):
        return unpermute(x, config["num_key_value_heads"])
    return x


def _fields(reader: gguf.GGUFReader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items()}


def _dequantized(t) -> np.ndarray:
    """A tensor of a GGUFReader as float32, in numpy order (the reverse of GGUF's ne)."""
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(n) for n in reversed(t.shape)))


def test_permute_is_llama_cpps_and_mlx_lms():
    from mlx_lm.gguf import permute_weights

    w = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)  # k_proj: 2 kv heads of 16
    for n_head, n_kv in ((4, 4), (4, 2)):
        ours = permute(w, n_head, n_kv)
        assert np.array_equal(ours, np.array(permute_weights(mx.array(w), n_head, n_kv)))
        assert np.array_equal(unpermute(ours, n_kv), w)
    # Within each head, HF's first half (x) and second half (y) become pairs x0 y0 x1 y1 ...
    head = permute(np.arange(16, dtype=np.float32)[:, None], 1, 1)[:, 0]
    assert head.tolist() == [0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15]


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_file_holds_the_checkpoint_under_llama_cpp_names(arch, tiny_model, tmp_path):
    model = tiny_model(arch=arch, layers=2)
    config = json.loads((model / "config.json").read_text())
    path = write_gguf(model, tmp_path / f"{arch}.gguf")
    reader = gguf.GGUFReader(path)
    source = _source(model)
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == set(source)
    assert ("output.weight" in tensors) == (not config["tie_word_embeddings"])
    for name, t in tensors.items():
        assert t.tensor_type == Q.F32, name
        assert [int(n) for n in t.shape] == list(reversed(source[name].shape)), f"{name}: ne is numpy's shape reversed"
        assert np.array_equal(_hf_order(name, np.asarray(t.data), arch, config), source[name]), name
    if arch == "llama":  # the permutation is really there
        assert not np.array_equal(np.asarray(tensors["blk.0.attn_q.weight"].data), source["blk.0.attn_q.weight"])

    f = _fields(reader)
    a = GGUF_ARCH[arch]
    assert f["general.architecture"] == a and f["general.file_type"] == gguf.LlamaFileType.ALL_F32
    expected = {
        f"{a}.block_count": 2, f"{a}.context_length": 4096, f"{a}.embedding_length": 64,
        f"{a}.feed_forward_length": config["intermediate_size"], f"{a}.attention.head_count": 4,
        f"{a}.attention.head_count_kv": 2, f"{a}.rope.freq_base": config["rope_theta"],
        f"{a}.attention.key_length": 16, f"{a}.attention.value_length": 16,
    }  # fmt: skip
    if arch == "llama":
        expected |= {"llama.vocab_size": 704, "llama.rope.dimension_count": 16, "tokenizer.ggml.add_space_prefix": False}
    if arch == "qwen3_moe":
        expected |= {"qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2, "qwen3moe.expert_feed_forward_length": 44}
    assert {k: f.get(k) for k in expected} == expected
    assert f[f"{a}.attention.layer_norm_rms_epsilon"] == pytest.approx(config["rms_norm_eps"])
    if arch != "llama":
        assert f"{a}.vocab_size" not in f and f"{a}.rope.dimension_count" not in f  # only LlamaModel writes them

    # The vocabulary: tokenizer.json's, in id order, the added special tokens CONTROL.
    tok = json.loads((model / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "gpt-2"
    assert f["tokenizer.ggml.tokens"] == sorted(vocab, key=vocab.get)
    specials = {t["id"] for t in tok["added_tokens"]}
    assert f["tokenizer.ggml.token_type"] == [3 if i in specials else 1 for i in range(len(vocab))]
    assert f["tokenizer.ggml.merges"] == [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]]
    assert f["tokenizer.ggml.eos_token_id"] == vocab["<|im_end|>"] and f["tokenizer.ggml.padding_token_id"] == vocab["<|endoftext|>"]
    assert "tokenizer.ggml.bos_token_id" not in f and f["tokenizer.ggml.add_bos_token"] is False
    assert f["tokenizer.chat_template"] == json.loads((model / "tokenizer_config.json").read_text())["chat_template"]

    # MLX's own GGUF loader reads the file and agrees.
    arrays, metadata = mx.load(str(path), return_metadata=True)
    assert set(arrays) == set(source) and metadata["general.architecture"] == a
    for name, x in arrays.items():
        assert np.array_equal(_hf_order(name, np.array(x), arch, config), source[name]), name


@pytest.mark.parametrize("arch", ARCHS)
def test_q8_0_quantizes_the_matrices_and_keeps_norms_and_routers_f32(arch, tiny_model, tmp_path):
    model = tiny_model(arch=arch, layers=2, **BLOCKS_FIT)
    config = json.loads((model / "config.json").read_text())
    path = write_gguf(model, tmp_path / f"{arch}.q8_0.gguf", qtype="q8_0")
    reader = gguf.GGUFReader(path)
    source = _source(model)
    assert _fields(reader)["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    arrays = mx.load(str(path))
    for t in reader.tensors:
        x = source[t.name]
        if x.ndim == 1 or t.name.endswith("ffn_gate_inp.weight"):
            assert t.tensor_type == Q.F32, t.name
            continue
        assert t.tensor_type == Q.Q8_0, t.name  # the token embedding and output too
        got = _hf_order(t.name, _dequantized(t), arch, config)
        # A Q8_0 block's step is max|w| / 127 (its float16 scale rounds a little more).
        assert np.abs(got - x).max() <= 0.6 * np.abs(x).max() / 127, t.name
        base = t.name.removesuffix(".weight")
        assert {f"{base}.scales", f"{base}.biases"} <= set(arrays), f"mx.load gives {t.name} as weight, scales, biases"
        assert arrays[f"{base}.scales"].shape == (*x.shape[:-1], x.shape[-1] // 32)
    if arch == "qwen3_moe":
        shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
        assert shapes["blk.1.ffn_gate_exps.weight"] == [64, 32, 4] and shapes["blk.1.ffn_down_exps.weight"] == [32, 64, 4]
        assert "blk.0.ffn_gate.weight" in shapes  # the tiny model's dense first layer


def test_rows_no_block_fits_fall_back_to_f16(tiny_model, tmp_path):
    # The tiny FFN is 176 wide: ffn_down's rows are 5.5 blocks of 32, so the converter writes F16.
    model = tiny_model(arch="qwen3", layers=2)
    reader = gguf.GGUFReader(write_gguf(model, tmp_path / "q8.gguf", qtype="q8_0"))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.ffn_down.weight"] == Q.F16 and types["blk.0.ffn_up.weight"] == Q.Q8_0


@pytest.mark.parametrize(
    "qtype, matrix, embedding, output, ftype",
    [
        ("f16", Q.F16, Q.F16, Q.F16, gguf.LlamaFileType.MOSTLY_F16),
        ("bf16", Q.BF16, Q.BF16, Q.BF16, gguf.LlamaFileType.MOSTLY_BF16),
        # llama-quantize: the output (or a tied embedding) Q8_0 where rows hold no 256-weight super-block.
        ("q4_0", Q.Q4_0, Q.Q4_0, Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q4_0),
        ("q4_1", Q.Q4_1, Q.Q4_1, Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q4_1),
    ],
)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # untied, tied
def test_other_file_types(arch, qtype, matrix, embedding, output, ftype, tiny_model, tmp_path):
    model = tiny_model(arch=arch, layers=2, **BLOCKS_FIT)
    config = json.loads((model / "config.json").read_text())
    path = write_gguf(model, tmp_path / f"{arch}.{qtype}.gguf", qtype=qtype)
    reader = gguf.GGUFReader(path)
    source = _source(model)
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert _fields(reader)["general.file_type"] == ftype
    assert types["token_embd.weight"] == (embedding if arch == "llama" else output)
    assert types.get("output.weight", output) == output
    assert types["blk.1.attn_norm.weight"] == Q.F32
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight"):
        assert types[name] == matrix
    for t in reader.tensors:
        x = source[t.name]
        got = _hf_order(t.name, _dequantized(t), arch, config)
        # F16/BF16 round each weight. Q4_1 rounds to steps of range / 15. Q4_0's step is
        # max|w| / 8 and its top level is 7 steps: the far end of a block can be a whole step off.
        tolerance = {Q.F32: 0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 0.6 / 127, Q.Q4_0: 1.1 / 8, Q.Q4_1: 0.6 * 2 / 15}
        assert np.abs(got - x).max() <= tolerance[t.tensor_type] * np.abs(x).max(), t.name
    arrays = mx.load(str(path))  # MLX's loader takes every one of these files
    assert "blk.0.attn_q.weight" in arrays


def test_type_overrides_and_k_quant_blocks(tiny_model, tmp_path):
    # 256 wide: attn_q's rows are one K-quant super-block.
    model = tiny_model(arch="llama", layers=1, hidden_size=256)
    types = {"blk.0.attn_q.weight": "q4_k", "token_embd.weight": "q8_0", "blk.0.attn_v.weight": "Q6_K"}
    path = write_gguf(model, tmp_path / "k.gguf", types=types)
    reader = gguf.GGUFReader(path)
    t = {t.name: t for t in reader.tensors}
    assert t["blk.0.attn_q.weight"].tensor_type == Q.Q4_K and [int(n) for n in t["blk.0.attn_q.weight"].shape] == [256, 256]
    assert t["blk.0.attn_q.weight"].n_bytes == 256 * 144  # a row: one 144-byte Q4_K block
    assert t["blk.0.attn_v.weight"].tensor_type == Q.Q6_K and t["blk.0.attn_v.weight"].n_bytes == 128 * 210
    assert t["token_embd.weight"].tensor_type == Q.Q8_0 and t["output.weight"].tensor_type == Q.F32
    with pytest.raises(ValueError, match="multiple of 256 weights; this tensor's are 704"):
        write_gguf(model, tmp_path / "bad.gguf", types={"blk.0.ffn_down.weight": "q4_k"})
    with pytest.raises(ValueError, match="does not have: blk.9.attn_q.weight"):
        write_gguf(model, tmp_path / "bad.gguf", types={"blk.9.attn_q.weight": "q8_0"})
    # llama-quantize makes an output whose rows hold whole super-blocks Q6_K (kquants.py writes it).
    reader = gguf.GGUFReader(write_gguf(model, tmp_path / "q4.gguf", qtype="q4_0"))
    assert {t.name: t.tensor_type for t in reader.tensors}["output.weight"] == Q.Q6_K
    reader = gguf.GGUFReader(write_gguf(model, tmp_path / "q4.gguf", qtype="q4_0", types={"output.weight": "q8_0"}))
    assert {t.name: t.tensor_type for t in reader.tensors}["output.weight"] == Q.Q8_0


def test_architecture_override(tiny_model, tmp_path):
    reader = gguf.GGUFReader(write_gguf(tiny_model(arch="llama", layers=2), tmp_path / "m.gguf", arch="mamba"))
    f = _fields(reader)
    assert f["general.architecture"] == "mamba" and f["mamba.block_count"] == 2 and "llama.block_count" not in f


# The metadata each converter class added for the other families writes, and what it leaves
# out (written out by hand from convert_hf_to_gguf.py, as GGUF_NAMES above): (tiny arch,
# general.architecture, keys and values present, keys absent).
CONVERTER_METADATA = {
    "phi3": (  # Phi3MiniModel.set_gguf_parameters: no head size, the rotated part, window 0
        "phi3", {"phi3.rope.dimension_count": 16, "phi3.rope.scaling.original_context_length": 4096, "phi3.attention.sliding_window": 0},
        ("phi3.attention.key_length",),
    ),
    "gemma2": (  # Gemma2Model.set_gguf_parameters: soft caps, Gemma2Config's window, no RoPE base
        "gemma2", {"gemma2.attn_logit_softcapping": 50.0, "gemma2.final_logit_softcapping": 30.0, "gemma2.attention.sliding_window": 4096},
        ("gemma2.rope.freq_base",),
    ),
    "gemma3_text": (  # Gemma3Model: the window, the global layers' RoPE base; no pattern, no local base
        "gemma3", {"gemma3.attention.sliding_window": 16, "gemma3.rope.freq_base": 1000000.0},
        ("gemma3.attention.sliding_window_pattern", "gemma3.rope.freq_base_swa", "gemma3.final_logit_softcapping"),
    ),
    "mixtral": (  # LlamaModel: a llama with experts
        "llama", {"llama.expert_count": 4, "llama.expert_used_count": 2, "llama.rope.dimension_count": 16}, ("llama.expert_feed_forward_length",),
    ),
    "qwen2_moe": (  # Qwen2MoeModel: the experts' and the shared expert's sizes
        "qwen2moe", {"qwen2moe.expert_count": 4, "qwen2moe.expert_feed_forward_length": 44, "qwen2moe.expert_shared_feed_forward_length": 88}, (),
    ),
    "mistral3": (  # Mistral3Model.Ministral3Model, a LlamaModel, for a text_config of model_type mistral
        "mistral3", {"mistral3.vocab_size": 704, "mistral3.rope.dimension_count": 16, "mistral3.block_count": 2},
        ("mistral3.attention.temperature_scale", "mistral3.rope.scaling.yarn_log_multiplier"),
    ),
}  # fmt: skip


@pytest.mark.parametrize("arch", list(CONVERTER_METADATA))
def test_other_families_metadata_is_their_converter_classes(arch, tiny_model, tmp_path):
    gguf_arch, present, absent = CONVERTER_METADATA[arch]
    f = _fields(gguf.GGUFReader(write_gguf(tiny_model(arch=arch, layers=2), tmp_path / f"{arch}.gguf")))
    assert f["general.architecture"] == gguf_arch
    assert {k: f.get(k) for k in present} == present
    assert not [k for k in absent if k in f]
