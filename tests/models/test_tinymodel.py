"""tools/make-tiny-model and ringd.models.tinymodel: real mlx-lm models, loaded by mlx-lm."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load, stream_generate
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_tokenizer

from ringd.models import tinymodel
from ringd.models.tinymodel import IM_END, IM_START, TinyModelError, ensure_tiny_model, write_tiny_model

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "make-tiny-model"

NEW_TOKENS = 40
# An equality test between two runs only means something if the output moves.
MIN_DISTINCT_TOKENS = 10
CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello! Could you tell me a short story about the river?"},
]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


def greedy_tokens(model_dir: Path, messages=CHAT, max_tokens: int = NEW_TOKENS) -> list[int]:
    """generate_step ignores EOS, so this is always max_tokens long."""
    model, tokenizer = load(str(model_dir))
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=make_sampler(0.0))
    return [int(token) for token, _ in steps]


def weight_bytes(model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(model_dir.glob("model*.safetensors"))}


# The sizes and seeds of these tests on the three dense architectures the other tests
# use most; every architecture's tiny model is run (and its output checked to vary)
# by tests/stage/test_archs.py.
DENSE = ("llama", "qwen3", "qwen2")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", DENSE)
def test_greedy_chat_reply_varies_and_runs_to_length(cache_dir, arch, dtype):
    model_dir = ensure_tiny_model(cache_dir, arch=arch, dtype=dtype)
    model, tokenizer = load(str(model_dir))
    assert model.model_type == arch
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)

    responses = list(
        stream_generate(model, tokenizer, prompt, max_tokens=NEW_TOKENS, sampler=make_sampler(0.0))
    )
    tokens = [r.token for r in responses]

    # stream_generate stops at EOS: a full-length reply means EOS never won greedily.
    assert responses[-1].finish_reason == "length", f"stopped early: {tokens}"
    assert len(tokens) == NEW_TOKENS
    assert not set(tokens) & set(tokenizer.eos_token_ids)
    distinct = len(set(tokens))
    assert distinct >= MIN_DISTINCT_TOKENS, f"{arch}/{dtype}: {distinct} distinct in {tokens}"
    # The streamed text is the decoded reply. mlx-lm's BPE streaming detokenizer drops
    # one leading space at the start of a reply; decode() keeps it.
    streamed = "".join(r.text for r in responses)
    decoded = tokenizer.decode(tokens)
    assert streamed == (decoded[1:] if decoded.startswith(" ") else decoded)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(seed=1),
        dict(seed=2, dtype="float32"),
        dict(layers=7, hidden_size=128),
        dict(layers=2, hidden_size=256, heads=8, kv_heads=4),
    ],
    ids=["seed1", "seed2-f32", "7x128", "2x256"],
)
@pytest.mark.parametrize("arch", DENSE)
def test_other_seeds_and_sizes_vary_too(cache_dir, arch, kwargs):
    tokens = greedy_tokens(ensure_tiny_model(cache_dir, arch=arch, **kwargs))
    assert len(set(tokens)) >= MIN_DISTINCT_TOKENS, tokens


def test_config_and_weights_match_the_architecture(cache_dir):
    for arch, tied, has_bias, has_qk_norm in [
        ("llama", False, False, False),
        ("qwen3", True, False, True),
        ("qwen2", True, True, False),
    ]:
        model_dir = ensure_tiny_model(cache_dir, arch=arch, dtype="float32")
        config = json.loads((model_dir / "config.json").read_text())
        assert config["model_type"] == arch
        assert config["tie_word_embeddings"] is tied
        assert config["head_dim"] == config["hidden_size"] // config["num_attention_heads"]
        index = json.loads((model_dir / "model.safetensors.index.json").read_text())
        keys = set(index["weight_map"])
        assert ("lm_head.weight" in keys) is not tied
        assert ("model.layers.0.self_attn.q_proj.bias" in keys) is has_bias
        assert ("model.layers.0.self_attn.q_norm.weight" in keys) is has_qk_norm
        assert keys == set(mx.load(str(model_dir / "model.safetensors")))
        assert config["vocab_size"] >= len(load_tokenizer(model_dir)._tokenizer)


def test_same_arguments_same_bytes_other_seed_other_weights(tmp_path):
    args = dict(arch="qwen2", layers=2, shard_bytes=40_000)
    a = write_tiny_model(tmp_path / "a", **args)
    b = write_tiny_model(tmp_path / "b", **args)
    c = write_tiny_model(tmp_path / "c", **args, seed=1)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()
    assert weight_bytes(a).keys() == weight_bytes(c).keys()
    for name, data in weight_bytes(a).items():
        assert data != weight_bytes(c)[name], name


def test_tokenizer_training_does_not_depend_on_the_process_or_threads():
    # The BPE trainer runs on rayon threads; ties must not be broken by scheduling.
    code = (
        "import hashlib, ringd.models.tinymodel as t;"
        "print(hashlib.sha256(t._tokenizer_json().encode()).hexdigest())"
    )
    here = hashlib.sha256(tinymodel._tokenizer_json().encode()).hexdigest()
    for threads in ("1", "4"):
        env = {**os.environ, "RAYON_NUM_THREADS": threads}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == here, f"RAYON_NUM_THREADS={threads}"


def test_sharded_model_splits_at_layers_and_generates_the_same(cache_dir, tmp_path):
    args = dict(arch="llama", layers=4, dtype="float32")
    whole = ensure_tiny_model(cache_dir, **args)
    sharded = write_tiny_model(tmp_path / "sharded", **args, shard_bytes=100_000)

    files = sorted(p.name for p in sharded.glob("model*.safetensors"))
    assert len(files) > 2 and "model.safetensors" not in files
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    in_files = {}
    for name in files:
        for key in mx.load(str(sharded / name)):
            assert key not in in_files, f"{key} in two files"
            in_files[key] = name
    assert in_files == weight_map
    whole_weights = mx.load(str(whole / "model.safetensors"))
    assert set(weight_map) == set(whole_weights)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in whole_weights.values())

    # A layer never straddles two files, and the layers do not all share one.
    layer_files = {}
    for key, name in weight_map.items():
        if key.startswith("model.layers."):
            layer_files.setdefault(int(key.split(".")[2]), set()).add(name)
    assert all(len(names) == 1 for names in layer_files.values())
    assert len(set.union(*layer_files.values())) > 1
    assert weight_map["model.embed_tokens.weight"] != weight_map["lm_head.weight"]

    assert greedy_tokens(sharded) == greedy_tokens(whole)


def test_tokenizer_loads_through_mlx_lm_with_chatml(cache_dir):
    model_dir = ensure_tiny_model(cache_dir, arch="qwen3", dtype="float32")
    _, tokenizer = load(str(model_dir))
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    assert tokenizer.eos_token == IM_END
    assert im_end in tokenizer.eos_token_ids
    assert im_end in load_tokenizer(model_dir).eos_token_ids  # also without config.json
    assert tokenizer.pad_token is not None

    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello! Could you tell me a short story about the river?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    assert ids == tokenizer.encode(text)
    assert ids.count(tokenizer.convert_tokens_to_ids(IM_START)) == 3  # one id each
    assert ids.count(im_end) == 2
    assert not tokenizer.apply_chat_template(CHAT[1:], tokenize=False).endswith("assistant\n")

    for sample in [
        "The river runs through the middle of the town.",
        "Numbers: 3.14, 2024 and 42!\n\tIndented line, trailing spaces  ",
        "Unicode too: naïve café, 日本語, emoji 🙂 — all bytes.",
        "Words it never saw: quixotic zephyr xylophone.",
    ]:
        tokens = tokenizer.encode(sample)
        assert tokenizer.decode(tokens) == sample
        detokenizer = tokenizer.detokenizer
        detokenizer.reset()
        for token in tokens:
            detokenizer.add_token(token)
        detokenizer.finalize()
        assert detokenizer.text == sample


def test_ensure_tiny_model_writes_once_and_reuses(tmp_path):
    small = dict(arch="qwen2", layers=1, hidden_size=32, heads=2, kv_heads=1)
    first = ensure_tiny_model(tmp_path, **small)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = ensure_tiny_model(tmp_path, **small)
    other = ensure_tiny_model(tmp_path, **small, seed=5)
    assert again == first and other != first
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp
    # Nothing else in the cache: the temporary folders were renamed or removed.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])
    with pytest.raises(TypeError):
        ensure_tiny_model(tmp_path, layer=3)


def test_ensure_tiny_model_race_between_processes(tmp_path):
    code = (
        "import sys, ringd.models.tinymodel as t;"
        "print(t.ensure_tiny_model(sys.argv[1], arch='llama', layers=2, hidden_size=32))"
    )
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    paths = {racer.communicate(timeout=120)[0].strip() for racer in racers}
    assert all(racer.returncode == 0 for racer in racers)
    assert len(paths) == 1
    (path,) = paths
    assert [p.name for p in tmp_path.iterdir()] == [Path(path).name]
    assert len(set(greedy_tokens(Path(path)))) >= MIN_DISTINCT_TOKENS


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(layers=0), "layers"),
        (dict(hidden_size=66, heads=4), "hidden_size"),
        (dict(heads=4, kv_heads=3), "kv_heads"),
        (dict(arch="gpt2"), "arch"),
        (dict(dtype="int8"), "dtype"),
        (dict(vocab_size=100), "vocab_size"),
        (dict(weight_scale=0.0), "weight_scale"),
    ],
)
def test_impossible_arguments_name_the_parameter(tmp_path, kwargs, param):
    with pytest.raises(TinyModelError) as info:
        write_tiny_model(tmp_path / "m", **kwargs)
    assert info.value.param == param
    assert not (tmp_path / "m").exists()


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_cli_writes_a_loadable_model(tmp_path):
    out = tmp_path / "cli"
    result = run_script(
        *("--out", str(out), "--arch", "qwen2", "--layers", "3"),
        *("--dtype", "float32", "--shard-mb", "0.05"),
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0] == str(out)
    assert "qwen2" in lines[1] and "3 layers" in lines[1] and "float32" in lines[1]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert config["num_hidden_layers"] == 3
    assert config["torch_dtype"] == "float32"
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    load(str(out))


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--layers", "0"], "--layers"),
        (["--hidden-size", "66"], "--hidden-size"),
        (["--heads", "4", "--kv-heads", "3"], "--kv-heads"),
        (["--dtype", "int8"], "--dtype"),
        (["--shard-mb", "0"], "--shard-mb"),
    ],
)
def test_cli_rejects_bad_flags_by_name(tmp_path, args, flag):
    result = run_script("--out", str(tmp_path / "bad"), *args)
    assert result.returncode != 0
    assert f"argument {flag}" in result.stderr, result.stderr
    assert not (tmp_path / "bad").exists()
