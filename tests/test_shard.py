"""ringd.shard: a stage loads and materializes its own layers only, and computes what mlx-lm computes."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load

from ringd.shard import ModelError, Shard, model_info, resolve_model_path, weight_files_for


def _full_bytes(path) -> int:
    model, _ = load(str(path))
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_stage_materializes_about_its_share(tiny_model, arch):
    layers = 12
    path = tiny_model(arch=arch, layers=layers, hidden_size=128, dtype="float32")
    info = model_info(str(path))
    total = _full_bytes(path)
    embed = info.vocab_size * info.hidden_size * 4
    per_layer = (total - embed * (1 if info.config["tie_word_embeddings"] else 2)) / layers

    middle = Shard.load(str(path), 4, 8)
    assert not middle.is_first and not middle.is_last
    names = [n for n, _ in middle._named_parameters()]
    assert all(n.startswith("model.layers.") for n in names)  # no embeddings, final norm or head
    assert {int(n.split(".")[2]) for n in names} == {4, 5, 6, 7}
    assert middle.parameter_bytes == pytest.approx(4 * per_layer, rel=0.01)
    assert middle.parameter_bytes < total / 2

    first = Shard.load(str(path), 0, 4)
    assert first.parameter_bytes == pytest.approx(4 * per_layer + embed, rel=0.01)

    last = Shard.load(str(path), 8, 12)
    # The last stage holds the final norm and the head (tied: the embeddings).
    assert "model.norm.weight" in dict(last._named_parameters())
    assert last.parameter_bytes == pytest.approx(4 * per_layer + embed + info.hidden_size * 4, rel=0.01)


def test_a_stage_reads_only_its_weight_files(tiny_model, tmp_path):
    # Split checkpoint: a stage needs the files of its layers and the non-layer weights.
    src = tiny_model(arch="llama", layers=8, hidden_size=64, dtype="float32", shard_bytes=40_000)
    files = sorted(p.name for p in src.glob("model-*.safetensors"))
    assert len(files) >= 4
    needed = weight_files_for(src, 6, 8)
    assert needed and set(needed) < set(files)
    # With the other layers' files gone, the stage still loads, and matches a full load.
    partial = tmp_path / "partial"
    shutil.copytree(src, partial)
    for f in set(files) - set(needed):
        (partial / f).unlink()
    a = Shard.load(str(partial), 6, 8)
    b = Shard.load(str(src), 6, 8)
    for (ka, va), (kb, vb) in zip(a._named_parameters(), b._named_parameters()):
        assert ka == kb and mx.array_equal(va, vb)
    # Asking that directory for layers whose file is gone is a clear error, not random weights.
    with pytest.raises(ModelError, match="are missing; is the download complete"):
        Shard.load(str(partial), 0, 2)


def test_stages_compose_to_the_full_model(tiny_model):
    path = tiny_model(arch="qwen3", layers=7, dtype="bfloat16")
    model, tok = load(str(path))
    tokens = mx.array(tok.encode("the ring of machines passes hidden states along"))[None]
    want = model(tokens)
    stages = [Shard.load(str(path), a, b) for a, b in ((0, 1), (1, 6), (6, 7))]
    h = None
    for s in stages[:-1]:
        h = s(tokens, h, s.make_cache())
        assert h.dtype == mx.bfloat16  # no float32 detour between stages
    got = stages[-1](tokens, h, stages[-1].make_cache())
    assert mx.array_equal(got, want)


def test_bad_ranges_and_unsupported_models(tiny_model, tmp_path):
    path = tiny_model(arch="llama", layers=4)
    with pytest.raises(ModelError, match="not inside"):
        Shard.load(str(path), 2, 9)
    with pytest.raises(ModelError, match="not inside"):
        Shard.load(str(path), 3, 3)
    gemma = tmp_path / "gemma"
    shutil.copytree(path, gemma)
    config = json.loads((gemma / "config.json").read_text())
    (gemma / "config.json").write_text(json.dumps({**config, "model_type": "gemma"}))
    with pytest.raises(ModelError, match="not supported by the ring"):
        model_info(str(gemma))
    with pytest.raises(ModelError, match="neither an existing directory nor"):
        resolve_model_path("./no/such/model")


def test_hub_repo_id_resolves_through_the_hub_cache(tiny_model, tmp_path, monkeypatch):
    """The Hub path, offline: a repo id is found in a Hugging Face cache laid out by hand."""
    src = tiny_model(arch="llama", layers=4, dtype="float32")
    commit = "0" * 40
    repo = tmp_path / "hub" / "models--ringd-test--tiny-llama"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(src, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    shard = Shard.load("ringd-test/tiny-llama", 0, 4)
    assert shard.is_first and shard.is_last
    assert shard.info.path == snapshot
