"""Which architectures the ring supports is decided here: each one, split anywhere, computes what mlx-lm computes.

For every architecture of ``tinyarchs.ARCHS`` a tiny random model (six layers,
its patterns twice over: sliding and global attention, linear and full
attention, dense then MoE layers) is run in-process by single-process mlx-lm and
by rings of ``Shard`` stages: split at every two-stage cut and at three-stage
cuts that fall inside the patterns. The prompt is prefilled in chunks and 40
tokens are decoded greedily, as the ring's engine drives a request; at every step
the logits must equal mlx-lm's bit for bit, and the tokens must be the same. The
reference must wander (at least MIN_DISTINCT_TOKENS distinct of 40), or equality
would prove little. Quantized checkpoints (mlx-lm's 4- and 8-bit) of a dense and
a MoE model too.

``checkpoint.SUPPORTED_ARCHITECTURES`` must be exactly the mlx-lm modules tested here and the
families that see tested in ``test_vision.py`` (``tinyvision.FAMILIES``: split anywhere, with an
image, each computes what mlx-vlm computes): the list in the code is these tests' result, not a
reading of source.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx.utils import tree_flatten

from ringd.models.checkpoint import SUPPORTED_ARCHITECTURES, _model_module
from ringd.models.errors import ModelError
from ringd.stage.shard import Shard
from devkit.stagering import greedy, reference, ring
from ringd.models.tinyarchs import ARCHS
from ringd.models.tinyvision import FAMILIES

LAYERS = 6
TOKENS = 40
MIN_DISTINCT_TOKENS = 10
CHUNK = 16  # prefill chunk: the prompt spans two, and outgrows the sliding windows (16)
TWO_STAGE_CUTS = [(c,) for c in range(1, LAYERS)]
# Inside the patterns: gemma3's global layers are 2 and 5, qwen3_next's full-attention
# layers 2 and 5, gpt-oss alternates; (1, 2) also isolates layer 1 (the first MoE
# layer after a dense one), (3, 5) a full and a linear/sliding layer together.
THREE_STAGE_CUTS = [(1, 2), (2, 4), (3, 5)]
QUANTIZED = [("qwen3", 4), ("qwen3", 8), ("qwen3_moe", 4), ("gpt_oss", 4)]
PROMPT = "Tell me a short story about the river and the town."


def check_every_split(path) -> None:
    model, tokenizer = load(str(path))
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True))
    want, want_logits = greedy(reference(model), prompt, chunk=CHUNK, tokens=TOKENS)
    assert len(set(want)) >= MIN_DISTINCT_TOKENS, f"the reference repeats itself ({len(set(want))} distinct tokens): the test would prove little"
    for cut in TWO_STAGE_CUTS + THREE_STAGE_CUTS:
        bounds = [0, *cut, LAYERS]
        stages = [Shard.load(str(path), a, b) for a, b in zip(bounds, bounds[1:])]
        got, got_logits = greedy(ring(stages), prompt, chunk=CHUNK, tokens=TOKENS)
        for i, (a, b) in enumerate(zip(want_logits, got_logits)):
            assert mx.array_equal(a, b), f"split {bounds}: logits differ from mlx-lm at step {i}"
        assert got == want, f"split {bounds}: tokens differ"


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_split_computes_what_mlx_lm_computes(tiny_model, arch):
    check_every_split(tiny_model(arch=arch, layers=LAYERS))


@pytest.mark.parametrize(("arch", "bits"), QUANTIZED, ids=[f"{a}-{b}bit" for a, b in QUANTIZED])
def test_quantized_checkpoints_too(tiny_model, arch, bits):
    path = tiny_model(arch=arch, layers=LAYERS, quantize_bits=bits)
    model, _ = load(str(path))
    assert any(k.endswith(".scales") for k, _ in tree_flatten(model.parameters()))
    check_every_split(path)


def test_the_supported_list_is_what_passed_here():
    tested = {_model_module({"model_type": arch}) for arch in ARCHS} | {_model_module({"model_type": f}) for f in FAMILIES}
    assert SUPPORTED_ARCHITECTURES == tested


def test_model_types_mlx_lm_maps_onto_a_tested_module_are_supported():
    # Kimi-K2 is DeepSeek-V3's architecture under another name (mlx-lm maps it).
    assert _model_module({"model_type": "kimi_k2"}) == "deepseek_v3"
    assert _model_module({"model_type": "mistral"}) == "llama"


def test_an_untested_architecture_is_refused_with_the_list(tiny_model, tmp_path):
    import json
    import shutil

    from ringd.models.source import model_info

    path = tmp_path / "olmo"
    shutil.copytree(tiny_model(arch="llama", layers=2), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "olmo2"}))
    with pytest.raises(ModelError, match=r"model_type 'olmo2' \(mlx_lm.models.olmo2\) is not supported by the ring; supported: deepseek_v2, deepseek_v3, gemma2"):
        model_info(str(path))
