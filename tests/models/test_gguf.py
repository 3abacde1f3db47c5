"""ringd.models.gguf.reader: a GGUF file read as mlx-lm would read the same model converted, one stage's tensors at a time.

The tensors a stage gets must be what MLX's own GGUF loader (``mx.load``) makes of
the file, bit for bit; the config must be the model's; a stage must read its own
tensors and no others; and what cannot be served as is (K-quants, unmapped
architectures, damaged files) is refused at start with one line.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from ringd.models.errors import ModelError
from ringd.models.gguf.reader import GgufFile, is_gguf, read_tensor
from ringd.models.source import model_info
from devkit.stagering import greedy, reference, ring


def _write(path: Path, arrays: dict[str, np.ndarray], types: dict[str, str], arch: str = "llama") -> Path:
    """A GGUF holding ``arrays`` quantized to ``types`` by gguf-py (llama.cpp's own writer)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for name, x in arrays.items():
        qtype = gguf.GGMLQuantizationType[types[name]]
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _same_as_mlx_load(path: Path, names=None) -> int:
    """Assert every tensor (or those named) reads as mx.load reads it; how many arrays were compared."""
    want = mx.load(str(path))
    compared = 0
    for name, t in _tensors(path).items():
        if names is not None and name not in names:
            continue
        base = name.removesuffix(".weight")
        for part, got in read_tensor(path, t).items():
            key = name if not part else f"{base}.{part}"
            ref = want[key]
            assert (got.dtype, got.shape) == (ref.dtype, ref.shape), f"{key} ({t.type})"
            assert mx.array_equal(got, ref).item(), f"{key} ({t.type}) differs from mx.load's"
            compared += 1
    return compared


def _tensors(path: Path) -> dict:
    """The tensor table alone (these test files are not models GgufFile.open would take)."""
    from ringd.models.gguf.reader import _parse

    return _parse(path, path.stat().st_size)[1]


def test_the_real_file_reads_as_mlx_reads_it(smollm2_gguf):
    # Q4_1 layers, a Q8_0 embedding and F32 norms: every one of its 694 arrays, bit for bit.
    assert _same_as_mlx_load(smollm2_gguf) == 694


def test_every_type_mlx_loads_reads_as_mlx_reads_it(tmp_path):
    # mx.load's own GGUF reader keeps these quantized (it turns BF16 into float16, and refuses
    # the rest); test_gguf_blocks checks every type against gguf-py's dequantize.
    rng = np.random.default_rng(0)
    types = {f"t.{t}.weight": t for t in ("F32", "F16", "Q4_0", "Q4_1", "Q8_0")}
    arrays = {name: rng.standard_normal((3, 5, 64)).astype(np.float32) for name in types}
    path = _write(tmp_path / "types.gguf", arrays, types)
    assert _same_as_mlx_load(path) == 2 + 3 * 3  # F32, F16; weight, scales, biases of three block types


def test_bfloat16_stays_bfloat16(tmp_path):
    # MLX's own loader turns BF16 into float16 (which cannot hold bfloat16's range); ringd keeps it.
    import gguf

    x = (np.random.default_rng(1).standard_normal((4, 64)) * 1e5).astype(np.float32)
    path = _write(tmp_path / "bf16.gguf", {"w.weight": x}, {"w.weight": "BF16"})
    got = read_tensor(path, _tensors(path)["w.weight"])[""]
    assert got.dtype == mx.bfloat16
    want = gguf.quants.dequantize(gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16), gguf.GGMLQuantizationType.BF16)
    assert np.array_equal(np.array(got.astype(mx.float32)), want)


def test_the_config_is_the_models(smollm2_gguf):
    info = model_info(str(smollm2_gguf))
    c = info.config
    assert (c["model_type"], c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]) == ("llama", 30, 576, 1536)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert c["rope_theta"] == 100000.0 and c["rope_traditional"] is True  # llama.cpp's Q/K layout
    assert c["tie_word_embeddings"] is True and c["vocab_size"] == 49152
    assert c["max_position_embeddings"] == 8192
    # It ends where llama.cpp ends it: the file names <|im_end|>, and <|endoftext|> is an end too.
    assert c["eos_token_id"] == [2, 0]
    from ringd.models.checkpoint import load_tokenizer

    assert load_tokenizer(info).eos_token_ids == {0, 2}
    assert info.is_gguf and info.name == "SmolLM2-135M-Instruct.Q4_1"
    # Placement's figures: the layers and the embeddings, as the tensors will be in memory.
    assert info.weights.embed == 49152 * 576 + 2 * 2 * 49152 * 576 // 32  # Q8_0: a byte a weight, scale and bias per 32
    assert len(set(info.weights.layers)) == 1 and info.weights.head == 0


def test_a_stage_holds_its_share_and_reads_no_other_tensor(smollm2_gguf):
    # In a process of its own, so its memory is this load's alone.
    script = textwrap.dedent(
        f"""
        import json, psutil, mlx.core as mx
        from ringd.models.source import model_info
        from ringd.stage.shard import Shard
        info = model_info({str(smollm2_gguf)!r})
        out = {{}}
        for a, b in ((10, 20), (0, 10), (20, 30)):
            before = psutil.Process().memory_info().rss
            shard = Shard.load({str(smollm2_gguf)!r}, a, b)
            out[f"{{a}}-{{b}}"] = dict(params=shard.parameter_bytes, share=info.weights.stage(a, b),
                                     rss=psutil.Process().memory_info().rss - before,
                                     names=sorted({{n.split(".")[2] if n.startswith("model.layers.") else n for n, _ in shard._named_parameters()}}))
            del shard
            mx.clear_cache()
        print(json.dumps(out))
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    out = json.loads(r.stdout.strip().splitlines()[-1])
    size = smollm2_gguf.stat().st_size
    middle = out["10-20"]
    assert middle["params"] == middle["share"]
    assert middle["names"] == [str(i) for i in range(10, 20)]
    # The first read: a third of the layers and no embeddings (22 MB), not the 98 MB file. A
    # process's first load also pays one-time costs (MLX's allocator pools, the model's code:
    # about 20 MB here, 45-50 MB in all under load), so the bound sits between that and the file.
    assert middle["rss"] < 0.75 * size, f"loading a third of the layers grew the process by {middle['rss']} bytes"
    first, last = out["0-10"], out["20-30"]
    assert "model.embed_tokens.weight" in first["names"] and "model.norm.weight" not in first["names"]
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= set(last["names"])  # tied: the head is the embedding
    for stage in (first, last):
        assert stage["params"] == stage["share"]
    # Within 10% of the file's own bytes for the same tensors (Q8_0 costs 36 bytes per 32 weights in
    # MLX, 34 in the file; Q4_1 and F32 cost the same).
    g = GgufFile.open(smollm2_gguf)

    def file_bytes(a: int, b: int) -> int:
        names = {t for t in g.tensors if t.startswith(tuple(f"blk.{i}." for i in range(a, b)))}
        names |= {"token_embd.weight"} if a == 0 else set()
        names |= {"output_norm.weight", "token_embd.weight"} if b == 30 else set()
        return sum(g.tensors[n].nbytes for n in names)

    for key, stage in out.items():
        a, b = map(int, key.split("-"))
        assert file_bytes(a, b) <= stage["params"] <= 1.1 * file_bytes(a, b)


def test_the_fingerprint_covers_the_file(smollm2_gguf, tmp_path):
    from ringd.models.gguf import reader as gguf_mod

    data = smollm2_gguf.read_bytes()
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(data)
    a = model_info(str(smollm2_gguf)).fingerprint
    assert model_info(str(copy)).fingerprint == a  # the same file anywhere
    g = GgufFile.open(copy)
    # A weight where the digest samples the data (a fine-tune changes nearly all of them), and a
    # byte of the metadata (another chat template, say): each gives another model.
    sampled = g.data_offset + (len(data) - g.data_offset) * 3 // gguf_mod.DIGEST_SAMPLES
    for offset, flip in ((sampled, 0x01), (data.index(b"You are a helpful AI assistant"), 0x20)):
        changed = bytearray(data)
        changed[offset] ^= flip
        other = tmp_path / f"changed-{offset}.gguf"
        other.write_bytes(bytes(changed))
        assert model_info(str(other)).fingerprint != a


def test_a_damaged_or_foreign_file_is_refused_in_one_line(smollm2_gguf, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    with open(smollm2_gguf, "rb") as f:
        truncated.write_bytes(f.read(40_000_000))
    with pytest.raises(ModelError, match=r"ends past the end of the file; is the download complete\?"):
        model_info(str(truncated))
    cut_in_header = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as f:
        cut_in_header.write_bytes(f.read(100_000))
    with pytest.raises(ModelError, match=r"not a readable GGUF file \(49152 strings of 'tokenizer.ggml.tokens' declared at byte \d+ cannot fit.*a file cut short"):
        model_info(str(cut_in_header))
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    with pytest.raises(ModelError, match="not a GGUF file"):
        model_info(str(text))
    with pytest.raises(ModelError, match="no such GGUF file"):
        model_info(str(tmp_path / "absent.gguf"))
    for junk in (b"", b"PK\x03\x04 a zip named .gguf"):  # read as the model list reads each file
        empty = tmp_path / "junk.gguf"
        empty.write_bytes(junk)
        with pytest.raises(ModelError, match="not a GGUF file") as e:
            GgufFile.open(empty)
        assert "cut short" not in str(e.value)  # no GGUF at all, not a download to fetch again
    header = tmp_path / "header.gguf"
    header.write_bytes(b"GGUF" + b"\xff" * 60)
    with pytest.raises(ModelError, match="not a readable GGUF file"):
        model_info(str(header))
    assert is_gguf(smollm2_gguf) and not is_gguf(text)


# --- tiny models of each mapped architecture, written as llama.cpp writes them (ggufmake) ---

LAYERS = 4
# Every row a whole number of 32-weight blocks, so every matrix takes the file's type.
BLOCKS_FIT = {"intermediate_size": 128}
PROMPT = "Tell me a short story about the river and the town."


# Llama 3.1's RoPE scaling (a GGUF carries it only as the rope_freqs tensor).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _tiny_gguf(tiny_model, tmp_path_factory, arch: str, qtype: str, rope_scaling: dict | None = None) -> tuple[Path, Path]:
    import json
    import shutil

    from devkit.ggufmake import write_gguf

    source = tiny_model(arch=arch, layers=LAYERS, dtype="float32", **BLOCKS_FIT)
    if rope_scaling is not None:  # the same weights, another RoPE: a model of its own
        scaled = tmp_path_factory.mktemp("rope") / source.name
        shutil.copytree(source, scaled)
        config = json.loads((scaled / "config.json").read_text())
        (scaled / "config.json").write_text(json.dumps({**config, "rope_scaling": rope_scaling}))
        source = scaled
    out = tmp_path_factory.mktemp("gguf") / f"tiny-{arch}-{qtype}.gguf"
    return source, write_gguf(source, out, qtype=qtype)


def _convert(gguf_path: Path, out: Path) -> Path:
    r = subprocess.run([sys.executable, "-m", "ringd", "convert", str(gguf_path), str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "mlx_lm.load" in r.stdout
    return out


@pytest.mark.parametrize(
    ("arch", "rope_scaling"),
    [("llama", None), ("llama", LLAMA3_ROPE), ("qwen2", None), ("qwen3", None), ("qwen3_moe", None)],
    ids=["llama", "llama3-rope", "qwen2", "qwen3", "qwen3_moe"],
)
def test_a_float_file_computes_what_the_original_model_computes(tiny_model, tmp_path_factory, arch, rope_scaling):
    """The mapping itself (config, names, llama's Q/K layout, llama3's RoPE) against the model the file was made from."""
    from mlx_lm import load

    from ringd.stage.shard import Shard

    source, path = _tiny_gguf(tiny_model, tmp_path_factory, arch, "f32", rope_scaling)
    if rope_scaling is not None:
        assert model_info(str(path)).config["rope_scaling"] == rope_scaling
    model, tokenizer = load(str(source))
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True))
    want, want_logits = greedy(reference(model), prompt)
    assert len(set(want)) >= 8, "the reference repeats itself: the test would prove little"
    stages = [Shard.load(str(path), a, b) for a, b in ((0, 1), (1, 3), (3, LAYERS))]
    got, got_logits = greedy(ring(stages), prompt)
    assert got == want
    # llama's interleaved RoPE sums the same products in another order: equal up to rounding.
    for a, b in zip(want_logits, got_logits):
        assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item()
    # And the tokenizer rebuilt from the file's metadata encodes as the original does.
    from ringd.models.checkpoint import load_tokenizer

    rebuilt = load_tokenizer(model_info(str(path)))
    assert list(rebuilt.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)) == prompt


@pytest.mark.parametrize(("arch", "qtype"), [("llama", "q4_0"), ("qwen2", "q8_0"), ("qwen3", "q4_1"), ("qwen3", "bf16"), ("qwen3_moe", "q8_0")])
def test_every_split_of_a_file_computes_what_mlx_lm_computes_on_its_conversion(tiny_model, tmp_path_factory, arch, qtype):
    from mlx_lm import load

    from ringd.stage.shard import Shard

    _, path = _tiny_gguf(tiny_model, tmp_path_factory, arch, qtype)
    converted = _convert(path, tmp_path_factory.mktemp("converted") / "model")
    model, tokenizer = load(str(converted))  # mlx-lm's own loader, from the directory convert wrote
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True))
    want, want_logits = greedy(reference(model), prompt)
    assert len(set(want)) >= 8, "the reference repeats itself: the test would prove little"
    for bounds in ([0, 2, LAYERS], [0, 1, 3, LAYERS], [0, LAYERS]):
        stages = [Shard.load(str(path), a, b) for a, b in zip(bounds, bounds[1:])]
        got, got_logits = greedy(ring(stages), prompt)
        for i, (a, b) in enumerate(zip(want_logits, got_logits)):
            assert mx.array_equal(a, b).item(), f"split {bounds}: logits differ at step {i}"
        assert got == want


# A llama whose every row is one K-quant super-block (256 weights), its matrices of every
# exact type a reference quantizer here writes (kquants.py for the K-quants, gguf-py for the
# rest). The embedding is Q4_K: MLX looks embeddings up in their scales' dtype, and float16
# scales (Q8_0's, Q5_0's) would round every looked-up weight to float16 (see below).
K_LAYER_TYPES = {"attn_q": "q4_k", "attn_k": "q5_k", "attn_v": "q5_0", "attn_output": "q5_1", "ffn_gate": "q4_k", "ffn_up": "mxfp4", "ffn_down": "q5_k"}
# Q6_K's 8-bit requantization (at most 1/255 of a 32-group's largest weight, 0.1-0.3% here)
# moves the tiny model's logits by up to this much (measured: 0.2-0.5; its random weights
# amplify: one layer's v_proj alone moves them by 0.18), so its tokens can part at a near tie.
REQUANTIZED_LOGITS_ATOL = 1.5


def _k_source(tiny_model) -> Path:
    return tiny_model(arch="llama", layers=LAYERS, dtype="float32", hidden_size=256, intermediate_size=256)


def _k_files(tiny_model, tmp_path_factory, types: dict[str, str]) -> tuple[Path, Path, Path]:
    """(the K-quant file, the same dequantized to F32 by gguf-py, out dir)."""
    from devkit.ggufmake import write_gguf

    source = _k_source(tiny_model)
    out = tmp_path_factory.mktemp("kquant")
    return write_gguf(source, out / "k.gguf", types=types), write_gguf(source, out / "k-f32.gguf", types=types, dequantized=True), out


def _forced(step, prompt: list[int], tokens: list[int]) -> list[mx.array]:
    """The logits of each step with ``tokens`` fed back (not the step's own choice)."""
    step(prompt[:-1], sample=False)
    return [step([y], sample=True) for y in [prompt[-1], *tokens[:-1]]]


def test_a_k_quant_file_computes_what_mlx_lm_computes_on_it_dequantized(tiny_model, tmp_path_factory):
    """Q4_K, Q5_K, Q5_0, Q5_1 and MXFP4 (exact forms): a 3-stage ring answers token for token as
    mlx-lm does on the same file with every tensor dequantized to float32 by gguf-py, and logit
    for logit (bit for bit) as mlx-lm does on ``ringd convert``'s checkpoint of the file."""
    from mlx_lm import load

    from ringd.stage.shard import Shard

    types = {f"blk.{i}.{name}.weight": t for i in range(LAYERS) for name, t in K_LAYER_TYPES.items()}
    path, plain, out = _k_files(tiny_model, tmp_path_factory, {**types, "token_embd.weight": "q4_k"})
    assert {t.type for t in GgufFile.open(path).tensors.values()} == {"F32", "Q4_K", "Q5_K", "Q5_0", "Q5_1", "MXFP4"}
    model, tokenizer = load(str(_convert(plain, out / "dequantized")))
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True))
    want, want_logits = greedy(reference(model), prompt)
    assert len(set(want)) >= 8, "the reference repeats itself: the test would prove little"
    stages = [Shard.load(str(path), a, b) for a, b in ((0, 1), (1, 3), (3, LAYERS))]
    got, got_logits = greedy(ring(stages), prompt)
    assert got == want
    for a, b in zip(want_logits, got_logits):  # the same products, summed in another order
        assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item()

    converted, _ = load(str(_convert(path, out / "converted")))
    same, same_logits = greedy(reference(converted), prompt)
    assert same == got
    for i, (a, b) in enumerate(zip(same_logits, got_logits)):
        assert mx.array_equal(a, b).item(), f"logits differ from mlx-lm's on the conversion at step {i}"


def test_a_q6_k_file_computes_within_its_requantization_error(tiny_model, tmp_path_factory, capsys):
    """Q6_K (requantized to 8 bits, not exact) as llama.cpp's Q4_K_M puts it: attn_v, ffn_down and
    the (tied) embedding and head. Fed the reference's tokens, each step's logits stay within the
    measured bound of mlx-lm's on the file dequantized to float32 by gguf-py."""
    from mlx_lm import load

    from ringd.stage.shard import Shard

    types = {f"blk.{i}.{name}.weight": "q6_k" for i in range(LAYERS) for name in ("attn_v", "ffn_down")}
    path, plain, out = _k_files(tiny_model, tmp_path_factory, {**types, "token_embd.weight": "q6_k"})
    model, tokenizer = load(str(_convert(plain, out / "dequantized")))
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True))
    want, want_logits = greedy(reference(model), prompt)
    stages = [Shard.load(str(path), a, b) for a, b in ((0, 1), (1, 3), (3, LAYERS))]
    got_logits = _forced(ring(stages), prompt, want)
    worst = max(mx.abs(a - b).max().item() for a, b in zip(want_logits, got_logits))
    # What Q6_K itself does to the same logits: the unquantized model, fed the same tokens.
    original, _ = load(str(_k_source(tiny_model)))
    q6_k = max(mx.abs(a - b).max().item() for a, b in zip(want_logits, _forced(reference(original), prompt, want)))
    with capsys.disabled():
        print(f"\nQ6_K tiny llama: ringd's logits within {worst:.3g} of gguf-py's float32 values' (Q6_K's own: {q6_k:.3g} from the unquantized model's)")
    assert worst < REQUANTIZED_LOGITS_ATOL


# SmolLM2 as llama-quantize makes it of each K-quant mix (its 576-wide rows fall back to
# Q5_0/Q8_0, as the issue counts for Q4_K_M), and the tensor types each then holds.
SMOLLM2_MIXES = {
    "q4_k_m": {"F32": 61, "Q5_0": 166, "Q4_K": 16, "Q6_K": 14, "Q8_0": 15},
}
FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


# Through the real model, the two ways a K-quant becomes MLX: Q4_K_M's Q4_K/Q5_0 (exact affine
# groups, as Q5_K_M's Q5_K/Q5_1 are) and its 14 Q6_K tensors' requantization to 8 bits. Q5_K_M
# and Q6_K files (65 s and 50-70 s of the suite's budget) add no code path: their types are
# proven on a tiny model above, and Q4_K_M's ring already requantizes Q6_K.
RING_MIXES = ["q4_k_m"]


@pytest.mark.parametrize("mix", RING_MIXES)
def test_smollm2_requantized_to_k_quants_answers_as_mlx_lm(smollm2_gguf, tmp_path_factory, mix):
    """The real model requantized to Q4_K_M and Q6_K (``ggufmake.requantize``): a 3-stage
    ring answers token for token as mlx-lm on the file dequantized to float32 by gguf-py, and (Q4_K_M)
    logit for logit as mlx-lm on ``ringd convert``'s checkpoint of it; each stage holds its share."""
    from collections import Counter

    from mlx_lm import load

    from devkit.ggufmake import requantize
    from ringd.stage.shard import Shard

    out = tmp_path_factory.mktemp(mix)
    # The file, and the same dequantized to float32 by gguf-py (written in the same pass).
    path = requantize(smollm2_gguf, out / f"smollm2-{mix}.gguf", mix, dequantized=out / "f32.gguf")
    g = GgufFile.open(path)
    assert Counter(t.type for t in g.tensors.values()) == SMOLLM2_MIXES[mix]

    bounds = ((0, 10), (10, 20), (20, 30))
    stages = [Shard.load(str(path), a, b) for a, b in bounds]
    info = model_info(str(path))
    assert [s.parameter_bytes for s in stages] == [info.weights.stage(a, b) for a, b in bounds]

    # GgufFile.convert is what `ringd convert` runs (tested through the command above): in-process here.
    GgufFile.open(out / "f32.gguf").convert(out / "f32")
    model, tokenizer = load(str(out / "f32"))
    prompt = list(tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True))
    ends = frozenset(tokenizer.eos_token_ids)
    want, _ = greedy(reference(model), prompt, ends)
    got, got_logits = greedy(ring(stages), prompt, ends)
    assert "Paris" in tokenizer.decode(got)
    assert got == want, f"{tokenizer.decode(got)!r} against {tokenizer.decode(want)!r}"
    if mix != "q4_k_m":
        return  # the conversion's bit-identity is one code path for every type (and tested on each, tiny, above)

    g.convert(out / "converted")
    converted, _ = load(str(out / "converted"))
    same, same_logits = greedy(reference(converted), prompt, ends)
    assert same == got
    for i, (a, b) in enumerate(zip(same_logits, got_logits)):
        assert mx.array_equal(a, b).item(), f"logits differ from mlx-lm's on the conversion at step {i}"


def test_what_mlx_cannot_compute_as_is_is_refused_at_start(tiny_model, tmp_path_factory):
    from devkit.ggufmake import write_gguf

    source = tiny_model(arch="llama", layers=2, dtype="float32", intermediate_size=256)
    iquant = write_gguf(source, tmp_path_factory.mktemp("k") / "k.gguf", qtype="q8_0", types={"blk.0.ffn_down.weight": "iq2_xxs", "blk.1.ffn_down.weight": "iq2_xxs"})
    with pytest.raises(ModelError) as e:
        model_info(str(iquant))
    message = str(e.value)
    assert "\n" not in message
    assert "IQ2_XXS (2 tensors, e.g. blk.0.ffn_down.weight) cannot be served" in message
    assert "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4, Q6_K, Q2_K" in message
    mamba = write_gguf(source, tmp_path_factory.mktemp("arch") / "mamba.gguf", arch="mamba")
    from ringd.models.gguf.archs import ARCHITECTURES

    served = ", ".join(sorted(ARCHITECTURES))
    with pytest.raises(ModelError, match=re.escape(f"GGUF architecture 'mamba' has no mapping to mlx-lm in ringd; GGUF files of {served} are served directly")) as e:
        model_info(str(mamba))
    assert "\n" not in str(e.value)


def test_convert_refuses_to_write_over_a_directory(tmp_path, smollm2_gguf):
    (tmp_path / "keep.txt").write_text("mine")
    r = subprocess.run([sys.executable, "-m", "ringd", "convert", str(smollm2_gguf), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "exists and is not empty" in r.stderr
    assert (tmp_path / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("llama.attention.head_count", 0, "metadata key llama.attention.head_count is 0; a positive int was expected"),
        ("llama.embedding_length", "wide", "metadata key llama.embedding_length is 'wide'; a positive int was expected"),
        ("llama.attention.layer_norm_rms_epsilon", float("nan"), "layer_norm_rms_epsilon is nan; a positive float was expected"),
        ("llama.block_count", None, "metadata key llama.block_count is missing"),
        ("general.architecture", "gpt2", "GGUF architecture 'gpt2' has no mapping to mlx-lm"),
        ("tokenizer.ggml.pre", "klingon", "tokenizer.ggml.pre 'klingon' is not known to ringd"),
    ],
)
def test_metadata_that_lies_is_refused_with_the_key(smollm2_gguf, key, value, message, tmp_path):
    """A file's metadata is input like any other: a value that makes no sense names its key."""
    from ringd.models.gguf.reader import _parse

    meta, tensors, data_offset = _parse(smollm2_gguf, smollm2_gguf.stat().st_size)
    meta = dict(meta)
    if value is None:
        del meta[key]
    else:
        meta[key] = value
    with pytest.raises(ModelError, match=re.escape(message)) as e:
        g = GgufFile(smollm2_gguf, meta, tensors, data_offset)
        g.write_sidecar(tmp_path / "sidecar")  # the tokenizer is rebuilt here
    assert "\n" not in str(e.value)


def test_a_convert_stopped_half_way_leaves_nothing_that_looks_like_a_checkpoint(smollm2_gguf, tmp_path):
    g = GgufFile.open(smollm2_gguf)
    seen = []

    def stop_after_ten(tensor) -> None:
        seen.append(tensor.name)
        if len(seen) == 10:
            raise KeyboardInterrupt  # as Ctrl-C would, between two tensors

    with pytest.raises(KeyboardInterrupt):
        g.convert(tmp_path / "out", stop_after_ten)
    assert list(tmp_path.iterdir()) == []  # neither the directory nor its temporary twin


def test_an_embedding_models_pooling_is_what_its_file_declares(smollm2_gguf):
    """llama.cpp's ``{arch}.pooling_type`` (e5-mistral's GGUF files are llama with 3, last): how
    an embedding pools; a generative model's file declares none, and embeddings take the mean."""
    from ringd.models.gguf.reader import _parse

    meta, tensors, data_offset = _parse(smollm2_gguf, smollm2_gguf.stat().st_size)
    assert "pooling" not in GgufFile(smollm2_gguf, meta, tensors, data_offset).config
    assert model_info(str(smollm2_gguf)).pooling == "mean"
    for declared, pooling in ((1, "mean"), (2, "cls"), (3, "last"), (0, None), (4, None)):
        config = GgufFile(smollm2_gguf, {**meta, "llama.pooling_type": declared}, tensors, data_offset).config
        assert config.get("pooling") == pooling


def test_a_split_file_is_the_model_its_parts_hold_and_a_missing_part_is_named(tiny_model, tmp_path):
    """A GGUF split as llama.cpp's converter splits it (--split-max-tensors: NAME-00001-of-0000N.gguf,
    the metadata in the first) is read, named and computed as the same model in one file; it is not
    served to peers (each node holds the parts), and a part missing is one line naming it."""
    from mlx.utils import tree_flatten

    from devkit.ggufmake import write_gguf
    from ringd.models.peers import manifest

    source = tiny_model(arch="llama", layers=2, dtype="float32")
    whole = write_gguf(source, tmp_path / "whole.gguf", qtype="q8_0")
    (tmp_path / "split").mkdir()
    first = write_gguf(source, tmp_path / "split" / "tiny.gguf", qtype="q8_0", split_max_tensors=8)
    parts = sorted((tmp_path / "split").iterdir())
    assert len(parts) == 3 and first == parts[0] and first.name == "tiny-00001-of-00003.gguf"
    g, w = GgufFile.open(first), GgufFile.open(whole)
    assert g.name == "tiny" and g.config == w.config and [p for p, _ in g.parts] == parts
    assert {n: (t.type, t.shape) for n, t in g.tensors.items()} == {n: (t.type, t.shape) for n, t in w.tensors.items()}
    assert {t.file for t in g.tensors.values()} == set(parts)
    names = [n for n, _ in tree_flatten(w.build_model().parameters())]
    for (n, a), (m, b) in zip(sorted(g.read(names)), sorted(w.read(names))):
        assert n == m and mx.array_equal(a, b).item(), n
    info = model_info(str(first))
    assert info.num_layers == 2 and info.weights == model_info(str(whole)).weights
    assert g.fingerprint.startswith("gguf:") and info.fingerprint != model_info(str(whole)).fingerprint
    with pytest.raises(manifest.ManifestError, match=r"a GGUF split in 3 parts is not served to peers"):
        manifest.build(first, info.fingerprint, "tiny")

    parts[2].rename(tmp_path / "elsewhere.gguf")
    with pytest.raises(ModelError) as e:
        model_info(str(first))
    assert str(e.value) == f"{first}: part 3 of 3 of this split GGUF, tiny-00003-of-00003.gguf, is missing beside it; fetch it too"
