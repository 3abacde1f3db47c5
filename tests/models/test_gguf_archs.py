"""ringd.models.gguf.archs: every GGUF family ringd maps, each proven on a tiny model written as llama.cpp writes it.

For each family, a tiny mlx-lm model of the architecture (``tinyarchs.py``) is written to
GGUF by ``ggufmake`` as llama.cpp's converter class for it writes it (Gemma's norms plus one,
Phi-3's fused projections, Mixtral's experts stacked under the llama architecture, Qwen2-MoE's
shared expert, Mistral 3's text decoder), and then:

- as a float32 file, a ring of one stage per layer answers token for token as mlx-lm does on
  the model the file was written from, its logits equal up to rounding: the mapping (config,
  names, llama.cpp's quirks undone) is the model's;
- quantized, a ring split at every cut answers logit for logit (bit for bit) as mlx-lm does on
  ``ringd convert``'s checkpoint of the same file.

A file of a mapped family that the mapping still cannot serve is refused at start in one line
that says why and what is served. (llama, qwen2, qwen3 and qwen3moe: ``test_gguf.py``.)
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from ringd.models.errors import ModelError
from ringd.models.gguf.reader import GgufFile
from devkit.stagering import greedy, reference, ring

PROMPT = "Tell me a short story about the river and the town."
# Every row a whole number of 32-weight blocks, so every matrix takes the file's type.
BLOCKS_FIT = {"intermediate_size": 128}


@dataclass(frozen=True)
class Family:
    arch: str  # tinyarchs'
    gguf_arch: str  # general.architecture, as llama.cpp's converter names it
    layers: int
    qtype: str  # the quantized file's (ggufmake.QTYPES)
    config: dict = field(default_factory=dict)  # the tiny model's config, changed as llama.cpp reads the family
    tied: bool = False  # the head tied to the embeddings (the checkpoint holds no lm_head)
    seed: int = 0
    written: dict = field(default_factory=dict)  # how ggufmake writes it (write_gguf's options)


LONGROPE = {
    "type": "longrope", "long_factor": [1.0, 1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 8.0], "short_factor": [1.0, 1.0, 1.0, 1.0, 1.1, 1.2, 1.3, 1.5],
}  # fmt: skip

FAMILIES = {
    "phi3": Family("phi3", "phi3", 3, "q8_0", seed=1),
    # Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini: LongRoPE, a factor per rotated frequency pair.
    "phi3-longrope": Family("phi3", "phi3", 3, "q8_0", {"original_max_position_embeddings": 512, "rope_scaling": LONGROPE}, seed=1),
    "gemma2": Family("gemma2", "gemma2", 3, "q4_0"),
    # llama.cpp reads every gemma3 file with five sliding layers to one global: six layers hold both.
    "gemma3": Family("gemma3_text", "gemma3", 6, "q8_0", {"sliding_window_pattern": 6}, tied=True),
    # Gemma 3 4B-27B: linear RoPE scaling (factor 8) on the global layers alone.
    "gemma3-rope-linear": Family(
        "gemma3_text", "gemma3", 6, "q4_0", {"sliding_window_pattern": 6, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, tied=True,
    ),  # fmt: skip
    "mixtral": Family("mixtral", "llama", 3, "q8_0"),
    # Mixtral as llama.cpp's converter wrote it until April 2024: one tensor an expert.
    "mixtral-split-experts": Family("mixtral", "llama", 3, "q4_0", written={"split_experts": True}),
    "qwen2moe": Family("qwen2_moe", "qwen2moe", 3, "q4_1"),
    "mistral3": Family("mistral3", "mistral3", 3, "q4_0"),
}


def _source(tiny_model, tmp_path_factory, family: Family) -> Path:
    """The tiny model, changed (a copy) where llama.cpp reads the family otherwise than its tiny config says."""
    source = tiny_model(arch=family.arch, layers=family.layers, dtype="float32", seed=family.seed, **BLOCKS_FIT)
    if not family.config and not family.tied:
        return source
    changed = tmp_path_factory.mktemp(family.gguf_arch) / source.name
    shutil.copytree(source, changed)
    config = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**config, **family.config, "tie_word_embeddings": family.tied or config["tie_word_embeddings"]}))
    if family.tied:  # mlx-lm's gemma3_text ties its head when the checkpoint has no lm_head (sanitize)
        weights = mx.load(str(changed / "model.safetensors"))
        del weights["lm_head.weight"]
        mx.save_safetensors(str(changed / "model.safetensors"), weights, metadata={"format": "mlx"})
        index = json.loads((changed / "model.safetensors.index.json").read_text())
        del index["weight_map"]["lm_head.weight"]
        (changed / "model.safetensors.index.json").write_text(json.dumps(index))
    return changed


def _splits(layers: int) -> list[list[int]]:
    """Every cut of a two-stage ring, a stage per layer, and one stage holding all."""
    return [[0, k, layers] for k in range(1, layers)] + [list(range(layers + 1)), [0, layers]]


def _stages(path: Path, bounds: list[int]):
    from ringd.stage.shard import Shard

    return [Shard.load(str(path), a, b) for a, b in zip(bounds, bounds[1:])]


def _written_as_llama_cpp_writes_it(name: str, path: Path, source: Path) -> None:
    """The family's quirk is in the file, so the reader is what undoes it."""
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    assert not any(n.startswith(("v.", "mm.")) for n in tensors)
    if name == "phi3":
        assert "blk.0.attn_qkv.weight" in tensors and "blk.0.attn_q.weight" not in tensors
        assert "blk.0.ffn_gate.weight" not in tensors  # gate and up in one ffn_up
    if name.startswith("gemma"):
        original = mx.load(str(source / "model.safetensors"))["model.layers.0.input_layernorm.weight"]
        assert np.allclose(np.array(tensors["blk.0.attn_norm.weight"].data), np.array(original) + 1)
        assert "output.weight" not in tensors
    if name == "mixtral":
        assert tuple(tensors["blk.0.ffn_gate_exps.weight"].shape) == (64, 128, 4)  # GGUF order: in, out, experts
    if name == "mixtral-split-experts":
        assert tuple(tensors["blk.0.ffn_gate.3.weight"].shape) == (64, 128) and "blk.0.ffn_gate_exps.weight" not in tensors
    if name == "qwen2moe":
        assert tuple(tensors["blk.0.ffn_gate_inp_shexp.weight"].shape) == (64,)  # squeezed from (1, 64)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_family_computes_what_mlx_lm_computes(tiny_model, tmp_path_factory, name):
    from mlx_lm import load

    from devkit.ggufmake import write_gguf

    family = FAMILIES[name]
    source = _source(tiny_model, tmp_path_factory, family)
    out = tmp_path_factory.mktemp(f"gguf-{name}")
    plain = write_gguf(source, out / "f32.gguf", qtype="f32", **family.written)
    assert GgufFile.open(plain).meta["general.architecture"] == family.gguf_arch
    if "rope_scaling" in family.config:  # as mlx-lm's own config has it
        want_scaling = {"type": "linear", "factor": 8.0} if name.startswith("gemma3") else LONGROPE
        assert GgufFile.open(plain).config["rope_scaling"] == want_scaling
    _written_as_llama_cpp_writes_it(name, plain, source)

    model, tokenizer = load(str(source))
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True))
    want, want_logits = greedy(reference(model), prompt)
    assert len(set(want)) >= 8, "the reference repeats itself: the test would prove little"
    got, got_logits = greedy(ring(_stages(plain, list(range(family.layers + 1)))), prompt)
    assert got == want
    for a, b in zip(want_logits, got_logits):  # llama's interleaved RoPE sums in another order
        assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item()

    path = write_gguf(source, out / f"{family.qtype}.gguf", qtype=family.qtype, **family.written)
    converted = out / "converted"
    GgufFile.open(path).convert(converted)  # what `ringd convert` writes
    model, _ = load(str(converted))
    want, want_logits = greedy(reference(model), prompt)
    for bounds in _splits(family.layers):
        got, got_logits = greedy(ring(_stages(path, bounds)), prompt)
        for i, (a, b) in enumerate(zip(want_logits, got_logits)):
            assert mx.array_equal(a, b).item(), f"split {bounds}: logits differ from mlx-lm's on the conversion at step {i}"
        assert got == want


# Files of a mapped family that mlx-lm cannot compute as llama.cpp does: (family, what is
# changed in its file: metadata, tensors added or dropped, and what the one line says).
REFUSED = {
    "ministral3": ("mistral3", {"meta": {"mistral3.attention.temperature_scale": 0.1}}, "a Ministral 3 file"),
    "phi3-long-factors-alone": ("phi3", {"add": ["rope_factors_long.weight"]}, "a phi3 file with rope_factors_long.weight alone"),
    "phi3-yarn": (
        "phi3", {"add": ["rope_factors_long.weight", "rope_factors_short.weight"], "meta": {"phi3.rope.scaling.attn_factor": 1.2}},
        "is not LongRoPE's 1 (a YaRN Phi)",
    ),  # fmt: skip
    "gemma3-final-softcap": ("gemma3", {"meta": {"gemma3.final_logit_softcapping": 30.0}}, "a gemma3 file with final logit soft-capping"),
    "gemma3-window-pattern": (
        "gemma3", {"meta": {"gemma3.attention.sliding_window_pattern": [True, False, True, True, True, False]}},
        "repeat no pattern mlx-lm's gemma3_text holds",
    ),  # fmt: skip
    "qwen2moe-fused-gate-up": (
        "qwen2moe", {"add": ["blk.0.ffn_gate_up_exps.weight"], "drop": ["blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight"]},
        "experts' gate and up fused in one tensor (blk.0.ffn_gate_up_exps.weight",
    ),  # fmt: skip
    "mixtral-dense-layer": ("mixtral", {"drop": ["blk.1.ffn_gate_exps.weight"]}, "a llama file with experts whose layers [1] hold none"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_a_family_cannot_serve_is_refused_in_one_line(tiny_model, tmp_path_factory, case):
    from devkit.ggufmake import write_gguf
    from ringd.models.gguf.reader import Tensor, _parse
    from ringd.models.gguf.archs import ARCHITECTURES

    name, change, message = REFUSED[case]
    family = FAMILIES[name]
    path = write_gguf(_source(tiny_model, tmp_path_factory, family), tmp_path_factory.mktemp(case) / "f.gguf")
    meta, tensors, data_offset = _parse(path, path.stat().st_size)
    meta, tensors = {**meta, **change.get("meta", {})}, dict(tensors)
    norm = tensors["output_norm.weight"]
    for added in change.get("add", []):  # a tensor the family's file may hold (8 floats of another's bytes)
        tensors[added] = Tensor(added, "F32", (8,), norm.offset, 32, path)
    for dropped in change.get("drop", []):
        del tensors[dropped]
    with pytest.raises(ModelError) as e:
        GgufFile(path, meta, tensors, data_offset)
    text = str(e.value)
    assert message in text and "\n" not in text
    assert f"GGUF files of {', '.join(sorted(ARCHITECTURES))} are served directly" in text


# What llama.cpp reads of a family's metadata beyond what a tiny model exercises: (family,
# metadata changed, the config keys mlx-lm then gets).
READ = {
    # Gemma 2 27B (46 layers) scales queries by hidden size / heads, as llama.cpp's LLM_TYPE_27B.
    "gemma2-27b-query-scale": ("gemma2", {"gemma2.block_count": 46}, {"query_pre_attn_scalar": 64 // 4}),
    "gemma2-query-scale": ("gemma2", {"gemma2.attention.key_length": 32}, {"query_pre_attn_scalar": 32, "head_dim": 32}),
    "gemma3-27b-query-scale": ("gemma3", {"gemma3.block_count": 62, "gemma3.attention.key_length": 32}, {"query_pre_attn_scalar": 64 // 4}),
    "gemma3-stated-window": (
        "gemma3", {"gemma3.attention.sliding_window_pattern": [True, True, False] * 2, "gemma3.rope.freq_base_swa": 20000.0},
        {"sliding_window_pattern": 3, "rope_local_base_freq": 20000.0},
    ),  # fmt: skip
    "gemma2-softcaps": ("gemma2", {"gemma2.attn_logit_softcapping": 40.0, "gemma2.final_logit_softcapping": 20.0}, {"attn_logit_softcapping": 40.0, "final_logit_softcapping": 20.0}),
}


@pytest.mark.parametrize("case", list(READ))
def test_a_familys_metadata_reads_as_llama_cpp_reads_it(tiny_model, tmp_path_factory, case):
    from devkit.ggufmake import write_gguf
    from ringd.models.gguf.reader import _parse

    name, change, want = READ[case]
    path = write_gguf(_source(tiny_model, tmp_path_factory, FAMILIES[name]), tmp_path_factory.mktemp(case) / "f.gguf")
    meta, tensors, data_offset = _parse(path, path.stat().st_size)
    config = GgufFile(path, {**meta, **change}, tensors, data_offset).config
    assert {k: config[k] for k in want} == want


@pytest.mark.parametrize("name", ["phi3-longrope", "mixtral-split-experts"])
def test_a_stage_fetched_from_peers_holds_what_it_would_read_from_the_whole_file(tiny_model, tmp_path_factory, name):
    """A node that fetches only its stage's bytes (``PeerModel.stage_ranges``, the manifest's
    ``always``, the header) loads the parameters it would load from the whole file: LongRoPE's
    factors, which the config is read from, and each expert of an early file, stored apart."""
    from devkit.ggufmake import write_gguf
    from ringd.models.peers import manifest as m
    from ringd.models.peers import PeerModel
    from ringd.models.source import model_info
    from ringd.stage.shard import Shard

    family = FAMILIES[name]
    out = tmp_path_factory.mktemp(f"peers-{name}")
    (out / "whole").mkdir()
    path = write_gguf(_source(tiny_model, tmp_path_factory, family), out / "whole" / "m.gguf", qtype=family.qtype, **family.written)
    manifest = m.build(path, model_info(str(path)).fingerprint, "tiny")
    peer = PeerModel(path.parent, manifest, b"secret", "node1")
    data = path.read_bytes()
    for start, end in ((0, 1), (1, family.layers)):
        need = [(0, manifest.files[0].head), *((a, b) for _, a, b in manifest.always), *peer.stage_ranges(start, end, family.layers)[path.name]]
        sparse = bytearray(len(data))  # what a fetching node's sparse file holds: zeros where it fetched nothing
        for a, b in need:
            sparse[a:b] = data[a:b]
        fetched = out / f"{start}-{end}" / "m.gguf"
        fetched.parent.mkdir()
        fetched.write_bytes(bytes(sparse))
        got, want = Shard.load(str(fetched), start, end), Shard.load(str(path), start, end)
        assert model_info(str(fetched)).config == model_info(str(path)).config
        want_parameters = dict(want._named_parameters())
        for key, value in got._named_parameters():
            assert mx.array_equal(value, want_parameters[key]).item(), f"[{start}, {end}): {key} differs from the whole file's"
