"""Tiny vision-language model directories for tests: real mlx-vlm families, seeded random weights.

Like ``tinymodel.py`` for text models, there is no hub here: tests of images need
checkpoints that mlx-vlm's own ``load`` reads and generates with, on the CPU, in
a second. ``write_tiny_vision_model(out, family)`` writes one of FAMILIES: the
family's config (a text decoder of a few layers, a vision tower of two), mlx-vlm's
own model built from it with seeded random weights (under the names its loader
expects), the processor's files, and a byte-level tokenizer holding the family's
special tokens with a chat template that writes the family's image marker.
The tests keep what it writes (devkit/buildcache.py).

Its tokenizer spells only ASCII, so any id a random model emits decodes to text;
tests compare token ids, not words. Embeddings are tied, as in the real
checkpoints of these families (a separate head would be read by mlx-vlm and
not by mlx-lm's text path).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

_GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<start_of_image>"
    "{% elif c['type'] == 'text' %}{{ c['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


# A few merges, as every real BPE vocabulary has (llama.cpp refuses a GGUF's BPE without them).
_MERGES = [("t", "h"), ("e", "r"), ("i", "n")]
# Tokens besides the leading and special ones: the ASCII bytes and the merges.
_PLAIN = 128 + len(_MERGES)


def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte-to-character map, which a ByteLevel tokenizer spells bytes with."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _write_tokenizer(out: Path, leading: list[str], specials: list[str], template: str, extra: dict) -> dict[str, int]:
    """A byte-level BPE tokenizer: ``leading`` tokens, the 128 ASCII bytes and three merges, then
    ``specials``; saved by transformers as a checkpoint's. Returns every special token's id."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(leading)}
    for b, ch in sorted(_byte_symbols().items()):
        if b < 128:
            vocab[ch] = len(vocab)
    for a, b in _MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_MERGES, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in leading + specials])
    named = {k: v for k, v in extra.items() if k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **named)
    fast.chat_template = template
    fast.save_pretrained(str(out))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=template, add_bos_token=False, model_max_length=4096)
    config.update({k: v for k, v in extra.items() if k not in named})
    config_path.write_text(json.dumps(config, indent=2))
    return {t: tok.token_to_id(t) for t in leading + specials}


def _write_weights(model_type: str, config: dict, out: Path, seed: int, scale: float = 1.0, tied: bool = True) -> None:
    """mlx-vlm's model of ``config``, built as its ``load_model`` builds it, with seeded random
    weights; saved under its own names, the head left out where it is ``tied`` to the embeddings.
    ``scale`` multiplies the decoder's projections: with MLX's initialization a small Qwen's
    residual stream is its token embedding's, and its greedy answer one token repeated."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import update_module_configs

    mx.random.seed(seed)
    module = importlib.import_module(f"mlx_vlm.models.{model_type}")
    raw = json.loads(json.dumps(config))  # from_dict changes what it is given
    model_config = update_module_configs(module.ModelConfig.from_dict(raw), module, raw, ["text", "vision", "perceiver", "projector", "audio"])
    weights = {
        k: v * scale if k.startswith("language_model.") and k.endswith("proj.weight") else v
        for k, v in tree_flatten(module.Model(model_config).parameters())
        if not (tied and k.endswith("lm_head.weight"))
    }
    for k, v in weights.items():
        if k.endswith("mm_input_projection_weight"):
            # Gemma 3's projection starts as ones (every feature the same in each of the text's
            # dimensions): made random, so a test sees it, and rounded through float16, which is how
            # llama.cpp's converter keeps it whatever the file's type (a GGUF pair holds it exactly).
            weights[k] = (mx.random.normal(v.shape) * 0.2).astype(mx.float16).astype(v.dtype)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})


# Gemma 3's sizes: "tiny" for the tests; "bench" for tools/bench --image-ttft, large enough that the
# tower and the layers cost what the ring and its messages do (a 224-pixel image in patches of 14,
# pooled to 64 tokens, as the real one's 896 pixels are to 256).
_GEMMA_SIZES = {
    "tiny": {"hidden": 64, "layers": 6, "heads": 2, "kv_heads": 1, "head_dim": 32, "window": 16, "vision": 32, "vision_layers": 2, "vision_heads": 2, "image": 32, "patch": 8, "tokens": 4},
    "bench": {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 2, "head_dim": 64, "window": 512, "vision": 256, "vision_layers": 6, "vision_heads": 4, "image": 224, "patch": 14, "tokens": 64},
}


def _gemma3(out: Path, seed: int, size: str = "tiny") -> None:
    """Gemma 3: a SigLIP tower, 32 x 32 pixels in patches of 8, pooled to 4 tokens an image; a
    decoder of 6 layers, 5 sliding (window 16) then a global one, the pattern llama.cpp fixes for
    every gemma3 file (``size`` "tiny"; "bench": _GEMMA_SIZES')."""
    s = _GEMMA_SIZES[size]
    ids = _write_tokenizer(
        out, ["<pad>", "<eos>", "<bos>", "<unk>"],
        ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"],
        _GEMMA_TEMPLATE,
        {
            "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
            # The processor finds its markers by these names.
            "extra_special_tokens": {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"},
        },
    )  # fmt: skip
    vocab, hidden, image_size, tokens = len(ids) + _PLAIN, s["hidden"], s["image"], s["tokens"]
    eos = [ids["<eos>"], ids["<end_of_turn>"]]
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "image_token_index": ids["<image_soft_token>"],
        "boi_token_index": ids["<start_of_image>"],
        "eoi_token_index": ids["<end_of_image>"],
        "mm_tokens_per_image": tokens,
        "hidden_size": hidden,  # scales the image features: the decoder's width (mlx-vlm's default is 2048)
        "vocab_size": vocab,
        "pad_token_id": ids["<pad>"],
        "eos_token_id": eos,
        "text_config": {
            "model_type": "gemma3_text", "hidden_size": hidden, "num_hidden_layers": s["layers"], "intermediate_size": 2 * hidden,
            "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"], "query_pre_attn_scalar": s["head_dim"],
            "rms_norm_eps": 1e-6, "vocab_size": vocab, "sliding_window": s["window"], "sliding_window_pattern": 6,
            "rope_global_base_freq": 1000000.0, "rope_local_base_freq": 10000.0, "mm_tokens_per_image": tokens,
            "max_position_embeddings": 4096,
        },
        "vision_config": {
            "model_type": "siglip_vision_model", "hidden_size": s["vision"], "intermediate_size": 2 * s["vision"], "num_hidden_layers": s["vision_layers"],
            "num_attention_heads": s["vision_heads"], "patch_size": s["patch"], "image_size": image_size, "num_channels": 3, "layer_norm_eps": 1e-6,
        },
    }  # fmt: skip
    _json(out / "config.json", config)
    _json(out / "preprocessor_config.json", {
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "size": {"height": image_size, "width": image_size}, "resample": 2, "do_resize": True, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
    })  # fmt: skip
    _json(out / "processor_config.json", {"processor_class": "Gemma3Processor", "image_seq_length": tokens})
    _json(out / "generation_config.json", {"bos_token_id": ids["<bos>"], "eos_token_id": eos, "pad_token_id": ids["<pad>"]})
    _write_weights("gemma3", config, out, seed)


_QWEN_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Qwen2.5-VL's own bounds on an image's pixels (its preprocessor_config.json): a GGUF's projector file
# keeps none, and ringd reads one with these.
QWEN_PIXELS = (3136, 12845056)


def _qwen2_5_vl(out: Path, seed: int) -> None:
    """Qwen2.5-VL: a windowed vision tower on patches of 14 merged 2 x 2 (the tests' small pictures
    take 4 to 6 tokens, their grid by the picture's shape); a decoder of 4 layers with multimodal
    RoPE (an image's tokens placed by time, row and column)."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
    ids = _write_tokenizer(out, [], specials, _QWEN_TEMPLATE, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    vocab, hidden, patch, merge = len(ids) + _PLAIN, 64, 14, 2
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    text = {
        "hidden_size": hidden, "num_hidden_layers": 4, "intermediate_size": 128, "num_attention_heads": 2,
        "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "vocab_size": vocab, "max_position_embeddings": 4096,
        "rope_theta": 1000000.0, "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},  # sums to head_dim / 2
        "tie_word_embeddings": False,
    }  # fmt: skip
    config = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "eos_token_id": eos,
        # mlx-vlm's Qwen config reads the decoder's settings at the top level (Hugging Face's older layout).
        **text,
        "text_config": {"model_type": "qwen2_5_vl", **text},
        "vision_config": {
            # 4 blocks, every second one attending fully: llama.cpp's converter names the merger's layers
            # by a map of the tower's blocks, which needs 3 at least.
            "model_type": "qwen2_5_vl", "depth": 4, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": hidden,
            "num_heads": 2, "patch_size": patch, "spatial_patch_size": patch, "spatial_merge_size": merge,
            "temporal_patch_size": 2, "in_channels": 3, "window_size": 112, "fullatt_block_indexes": [1, 3], "tokens_per_second": 2,
        },
    }  # fmt: skip
    _json(out / "config.json", config)
    _json(out / "preprocessor_config.json", {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor", "patch_size": patch,
        "temporal_patch_size": 2, "merge_size": merge, "min_pixels": QWEN_PIXELS[0], "max_pixels": QWEN_PIXELS[1],
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
    })  # fmt: skip
    _json(out / "processor_config.json", {"processor_class": "Qwen2_5_VLProcessor"})
    _json(out / "chat_template.json", {"chat_template": _QWEN_TEMPLATE})
    _json(out / "generation_config.json", {"eos_token_id": eos, "pad_token_id": ids["<|endoftext|>"]})
    # Seeded 3 on: with 0, its greedy answers to some of the tests' pictures end after a token or three,
    # and an equality of three tokens proves little.
    _write_weights("qwen2_5_vl", config, out, seed + 3, scale=3.0, tied=False)


# Mistral Small 3.1's template without its default system prompt: one <s>, each user turn in
# [INST] ... [/INST] with [IMG] where an image goes, each answer closed by </s>; no generation
# prompt (the model answers right after [/INST]).
_MISTRAL_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{% endif %}"
    "{% for c in parts %}"
    "{% if c['type'] in ['image', 'image_url'] %}[IMG]"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}"
    "{% if message['role'] == 'system' %}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[/INST]"
    "{% else %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)


def _mistral3(out: Path, seed: int) -> None:
    """Mistral Small 3.1: a Pixtral tower on patches of 8 (images scaled to at most 32 pixels a
    side, in steps of 16), its patches merged 2 x 2 and projected: a 32 x 32 picture is 4 [IMG]
    in 2 rows ([IMG][IMG][IMG_BREAK][IMG][IMG][IMG_END]); a Mistral decoder of 4 layers, a
    separate head (not tied, as the real one), RoPE theta 1e9 set in the config (mlx-vlm's
    mistral3 text config has no default, mlx-lm's llama a different one). Projections scaled by 3:
    unscaled, greedy answers fall into two tokens repeated."""
    # The first 14 ids as in Mistral's tekken tokenizer: [IMG] is 10 there too.
    leading = [
        "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
        "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
    ]  # fmt: skip
    ids = _write_tokenizer(
        out, leading, ["[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"], _MISTRAL_TEMPLATE,
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"},
    )  # fmt: skip
    vocab, hidden, image_size, patch, merge = len(ids) + _PLAIN, 64, 32, 8, 2
    config = {
        "architectures": ["Mistral3ForConditionalGeneration"],
        "model_type": "mistral3",
        "image_token_index": ids["[IMG]"],
        "spatial_merge_size": merge,
        "multimodal_projector_bias": False,
        "projector_hidden_act": "gelu",
        "vision_feature_layer": -1,
        "vocab_size": vocab,
        "eos_token_id": ids["</s>"],
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "mistral", "hidden_size": hidden, "num_hidden_layers": 4, "intermediate_size": 128,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "rms_norm_eps": 1e-5,
            "vocab_size": vocab, "max_position_embeddings": 4096, "rope_theta": 1000000000.0,
            "sliding_window": None, "hidden_act": "silu", "tie_word_embeddings": False,
        },
        "vision_config": {
            "model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "head_dim": 16, "patch_size": patch, "image_size": image_size,
            "num_channels": 3, "rope_theta": 10000.0, "hidden_act": "silu",
        },
    }  # fmt: skip
    _json(out / "config.json", config)
    _json(out / "preprocessor_config.json", {
        "image_processor_type": "PixtralImageProcessor", "processor_class": "PixtralProcessor",
        "size": {"longest_edge": image_size}, "patch_size": {"height": patch, "width": patch}, "resample": 3,
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    })  # fmt: skip
    _json(out / "processor_config.json", {
        "processor_class": "PixtralProcessor", "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]",
        "image_end_token": "[IMG_END]", "patch_size": patch, "spatial_merge_size": merge,
    })  # fmt: skip
    _json(out / "chat_template.json", {"chat_template": _MISTRAL_TEMPLATE})
    _json(out / "generation_config.json", {"bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"], "pad_token_id": ids["<pad>"]})
    _write_weights("mistral3", config, out, seed, scale=3.0, tied=False)


FAMILIES = {"gemma3": _gemma3, "qwen2_5_vl": _qwen2_5_vl, "mistral3": _mistral3}


def _json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2))


def write_tiny_vision_model(out_dir: str | os.PathLike, family: str, seed: int = 0, size: str = "tiny") -> Path:
    """A tiny checkpoint of ``family`` (one of FAMILIES) in ``out_dir``, which mlx-vlm loads; ``size``
    "bench" (Gemma 3 only): one a benchmark measures (_GEMMA_SIZES)."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    if size != "tiny" and family != "gemma3":
        raise ValueError(f"size {size!r} is Gemma 3's only; {family} comes tiny")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if size == "tiny":
        FAMILIES[family](out, seed)
    else:
        _gemma3(out, seed, size)
    return out
