"""A tiny llama that speaks through SmolLM2's tokenizer and chat template: for what words do not prove.

API translation, tool calls, structured output and sampling mechanics are the
same code paths whatever the weights: the same template renders the same
prompt, llguidance compiles the same grammar over the same 49,152 tokens, the
same parsers read the answer. So those tests run on this model, ~20x cheaper a
token than the real SmolLM2 on MLX's CPU backend, and keep the real one for
what needs words (tests/test_smollm2.py, tests/http/test_serving.py).

Its weights are ringd's tiny llama (``ringd.models.tinymodel``, seeded random:
what it writes is gibberish that depends on every token of the prompt, so two
APIs that render a conversation differently get different answers) with one
change, so that an answer a grammar constrains ends: the residual stream's
first dimension is a constant no layer writes to, and the head reads it into
a bonus for JSON's closing tokens (``"``, ``}``, ``]``) and for the end of a
turn (``<|im_end|>``). Greedy, a string then closes within a few tokens and an
array or object ends when the grammar allows it, as a real model's would;
unconstrained, the closing tokens appear now and then in the gibberish, and
some answers end their turn within a few dozen tokens while others run to
max_tokens (which, for a given prompt, is as fixed as the weights). Sampled, a 49,152-token vocabulary is nearly flat: strings that
must end within max_tokens are given a maxLength by the tests that sample.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

LAYERS = 4
HIDDEN = 64
SEED = 0
# The residual stream's first dimension: the embedding's own scale (~0.06), so it is one
# dimension among 64 as the layers read it, and 10x in the final norm, which the head reads.
CONSTANT = 0.06
NORM_GAIN = 10.0
# The bonus of each closing token in the head: about the random logits' top, so greedy picks
# one of them about one step in six where nothing constrains it (measured over four prompts).
CLOSING_BONUS = 1.6
CLOSING = ('"', "}", "]")
# The end of a turn's bonus: measured over eight prompts, 2.0 ends some answers within 4-60
# tokens and leaves others past 100 (1.8 ends none within 100; 2.2 all but one within 16).
END = "<|im_end|>"
END_BONUS = 2.0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build(out: Path, smollm2_dir: Path) -> None:
    """Write the model into ``out``, its tokenizer and template copied from ``smollm2_dir``."""
    import mlx.core as mx

    from ringd.models.tinymodel import write_tiny_model

    source = json.loads((smollm2_dir / "config.json").read_text())
    write_tiny_model(
        out, arch="llama", layers=LAYERS, hidden_size=HIDDEN, vocab_size=source["vocab_size"], dtype="float32", seed=SEED,
        tie_embeddings=False, max_position_embeddings=source["max_position_embeddings"],
    )  # fmt: skip
    for name in TOKENIZER_FILES:
        shutil.copy(smollm2_dir / name, out / name)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((out / name).read_text())
        cfg.update({k: source[k] for k in ("eos_token_id", "bos_token_id") if k in source})
        (out / name).write_text(json.dumps(cfg, indent=2))

    vocab = json.loads((smollm2_dir / "tokenizer.json").read_text())["model"]["vocab"]
    weights = dict(mx.load(str(out / "model.safetensors")))
    embed = weights["model.embed_tokens.weight"]
    embed[:, 0] = CONSTANT
    for key, w in weights.items():
        if key.endswith(("o_proj.weight", "down_proj.weight")):
            w[0, :] = 0  # nothing writes to the constant dimension
    weights["model.norm.weight"][0] = NORM_GAIN
    head = weights["lm_head.weight"]
    head[:, 0] = 0
    for token in CLOSING:
        head[vocab[token], 0] = CLOSING_BONUS
    head[vocab[END], 0] = END_BONUS
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
