"""ringd.stage.shard: a stage loads and materializes its own layers only, and computes what mlx-lm computes."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load

from ringd.models.checkpoint import weight_files_for
from ringd.models.errors import ModelError
from ringd.models.progress import LoadProgress
from ringd.models.source import model_info, resolve_model_path
from ringd.stage.shard import Shard


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


# --- what a stage really costs: weights and KV cache, per architecture -------------------------


@pytest.mark.parametrize(
    ("arch", "bits"),
    [("qwen3_moe", None), ("deepseek_v3", None), ("gpt_oss", None), ("qwen3_next", None), ("gemma3_text", None), ("qwen3_moe", 4)],
    ids=["qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_next", "gemma3_text", "qwen3_moe-4bit"],
)
def test_a_stage_materializes_what_the_checkpoint_says_its_layers_cost(tiny_model, arch, bits):
    path = tiny_model(arch=arch, layers=6, quantize_bits=bits)
    info = model_info(str(path))
    # Dense first layers and MoE layers differ; placement sees each layer's own bytes.
    if arch in ("qwen3_moe", "deepseek_v3"):
        assert info.weights.layers[0] < info.weights.layers[1]
    for a, b in ((0, 2), (2, 5), (5, 6), (0, 6)):
        stage = Shard.load(str(path), a, b)
        want = info.weights.stage(a, b)
        assert stage.parameter_bytes == pytest.approx(want, rel=0.10), (a, b)


def _run_prompt(stages, prompt: list[int], chunk: int) -> list[list]:
    """Prefill ``prompt`` through the stages as the engine does (chunks, then the last token alone)."""
    caches = [s.make_cache() for s in stages]
    pieces = [prompt[i : i + chunk] for i in range(0, len(prompt) - 1, chunk)] + [prompt[-1:]]
    for piece in pieces:
        ids, h = mx.array(piece, dtype=mx.int32)[None], None
        for s, c in zip(stages, caches):
            h = s(ids, h, c)
            mx.eval(h, [x.state for x in c])
    return caches


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3", "gemma3_text", "qwen3_next"], ids=["dense", "mla", "sliding-window", "linear-attention"])
def test_the_ledger_books_what_the_caches_hold_after_a_1000_token_prompt(tiny_model, arch):
    from ringd.leader.admission import KvLedger, StageKv

    path = tiny_model(arch=arch, layers=6)
    stages = [Shard.load(str(path), 0, 3), Shard.load(str(path), 3, 6)]
    prompt = [int(t) for t in mx.random.randint(3, 600, (1000,), key=mx.random.key(0)).tolist()]
    caches = _run_prompt(stages, prompt, chunk=512)
    ledger = KvLedger([StageKv(f"s{i}", s.kv_cost, None) for i, s in enumerate(stages)])
    for stage, cache, booked in zip(stages, caches, ledger.need(len(prompt))):
        real = sum(c.nbytes for c in cache)
        assert booked == pytest.approx(real, rel=0.05), (arch, stage.kv_cost, booked, real)
    if arch == "deepseek_v3":  # the compressed latent, far below what the dense formula says
        assert stages[0].kv_cost.per_token < model_info(str(path)).kv_bytes_per_token() * 3
    if arch == "gemma3_text":  # the sliding layers' caches stopped growing at their window
        assert stages[0].kv_cost.windows and stages[0].kv_cost.trim_limit == 16
    if arch == "qwen3_next":
        assert stages[0].kv_cost.fixed > 0 and stages[0].kv_cost.trim_limit == 0


def test_layers_past_num_hidden_layers_are_neither_fetched_loaded_nor_counted(tiny_model, tmp_path):
    """DeepSeek-V3's checkpoints carry a multi-token-prediction layer after the last one."""
    src = tiny_model(arch="deepseek_v3", layers=4)
    path = tmp_path / "with-mtp"
    shutil.copytree(src, path)
    weights = mx.load(str(path / "model.safetensors"))
    mtp = {k.replace("model.layers.3.", "model.layers.4."): v for k, v in weights.items() if k.startswith("model.layers.3.")}
    mx.save_safetensors(str(path / "model-mtp.safetensors"), mtp, metadata={"format": "mlx"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(mtp, "model-mtp.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps(index))

    with_mtp, without = model_info(str(path)), model_info(str(src))
    assert with_mtp.weights == without.weights  # not counted
    for a, b in ((0, 2), (2, 4), (0, 4)):
        assert "model-mtp.safetensors" not in weight_files_for(path, a, b)  # not fetched
    stage = Shard.load(str(path), 2, 4)  # loaded without it, and computes as before
    assert not any(".layers.4." in n for n, _ in stage._named_parameters())
    assert stage.parameter_bytes == Shard.load(str(src), 2, 4).parameter_bytes


# --- progress: the load, file by file, and the download of a Hub model's stage ------------------


class RecordingProgress(LoadProgress):
    """A LoadProgress that keeps, after each update, the bytes of the file it was about."""

    def __init__(self, start: int, end: int):
        super().__init__(start, end)
        self.events: list[tuple] = []

    def begin(self, phase, sizes):
        super().begin(phase, sizes)
        self.events.append(("begin", phase, dict(sizes)))

    def advance(self, file, n):
        super().advance(file, n)
        self.events.append(("advance", self.to_wire()["phase"], file, self.file_bytes()[file][0]))

    def finish_file(self, file):
        self.events.append(("finish", self.to_wire()["phase"], file))
        super().finish_file(file)


def _phase_events(events: list[tuple], phase: str) -> list[tuple]:
    return [e for e in events if e[1] == phase]


def test_a_load_reports_each_files_bytes_up_to_what_the_stage_keeps(tiny_model, monkeypatch):
    import ringd.stage.shard as shard_module

    src = tiny_model(arch="llama", layers=8, hidden_size=64, dtype="float32", shard_bytes=40_000)
    # Small groups: each file's parameters are read in several steps, and each step is counted.
    monkeypatch.setattr(shard_module, "LOAD_GROUP_BYTES", 8 * 1024)
    progress = RecordingProgress(2, 6)
    stage = Shard.load(str(src), 2, 6, progress)

    # Each file's share: the bytes of the parameters this stage keeps from it.
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    want: dict[str, int] = {}
    for name, v in stage._named_parameters():
        want[weight_map[name]] = want.get(weight_map[name], 0) + v.nbytes
    assert len(want) >= 2 and set(want) <= set(weight_files_for(src, 2, 6))
    [begin] = [e for e in progress.events if e[0] == "begin"]
    assert begin == ("begin", "load", want)  # no download: the files are here

    # File after file, each one's bytes growing in steps to its share before the next starts.
    advances = [e for e in progress.events if e[0] == "advance"]
    order = list(dict.fromkeys(e[2] for e in advances))
    assert order == sorted(want)
    steps = {file: [e[3] for e in advances if e[2] == file] for file in order}
    for file in order:
        assert steps[file] == sorted(steps[file]) and steps[file][-1] == want[file]
    # Each of layers 2-5 is a file of its own here. Its seven projections each reach the 8 KiB
    # of a group alone; its two norms (256 bytes each) are read together last: eight steps.
    assert {file: len(s) for file, s in steps.items()} == {file: 8 for file in want}, steps
    assert progress.to_wire() | {"rate_bytes_s": 0} == {
        "phase": "load", "file": order[-1], "files_done": len(want), "files_total": len(want),
        "bytes": stage.parameter_bytes, "total_bytes": stage.parameter_bytes, "rate_bytes_s": 0, "layers": [2, 6],
    }  # fmt: skip

    # Read in steps, the same values as read at once.
    whole = Shard.load(str(src), 2, 6)
    for (ka, va), (kb, vb) in zip(stage._named_parameters(), whole._named_parameters()):
        assert ka == kb and mx.array_equal(va, vb)


# Run in a process of its own, as a node does: huggingface_hub reads HF_ENDPOINT and its
# cache folders from the environment when it is imported. Loads a stage twice and prints
# what each load reported and a digest of every parameter.
_HUB_LOAD = """
import hashlib, json, sys
sys.path.insert(0, sys.argv[4])
from test_shard import RecordingProgress
from ringd.stage.shard import Shard

repo, start, end = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
runs = []
for _ in range(2):
    progress = RecordingProgress(start, end)
    stage = Shard.load(repo, start, end, progress)
    digests = {n: hashlib.sha256(memoryview(v)).hexdigest() for n, v in stage._named_parameters()}
    runs.append({"events": progress.events, "path": str(stage.info.path), "params": digests})
print(json.dumps(runs))
"""


def _digests(stage: Shard) -> dict[str, str]:
    import hashlib

    return {n: hashlib.sha256(memoryview(v)).hexdigest() for n, v in stage._named_parameters()}


def test_a_hub_stage_downloads_only_its_files_with_progress_and_once(tiny_model, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from devkit.fakehub import FakeHub

    src = tiny_model(arch="llama", layers=8, hidden_size=64, dtype="float32", shard_bytes=40_000)
    start, end = 3, 6
    needed = weight_files_for(src, start, end)
    sizes = {f: (src / f).stat().st_size for f in needed}
    with FakeHub({"ringd-test/tiny": src}) as hub:
        tests = str(Path(__file__).parent)
        r = subprocess.run(
            [sys.executable, "-c", _HUB_LOAD, "ringd-test/tiny", str(start), str(end), tests],
            env=hub.env(tmp_path / "hf"), capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-4000:]
        first, second = json.loads(r.stdout.splitlines()[-1])
        fetched = hub.fetched()

    # Only this stage's weight files came, each once; the other stages' files stayed on the hub.
    weights = [f for f in fetched if f.endswith(".safetensors")]
    assert sorted(weights) == needed and len(set(fetched)) == len(fetched)
    assert set(needed) < {p.name for p in src.glob("model-*.safetensors")}

    # The download phase: this stage's files and their sizes, each file's bytes growing to its size,
    # as huggingface_hub's progress bar reports them (in reads of 10 MiB: these files take one each).
    events = [tuple(e) for e in first["events"]]
    download = _phase_events(events, "download")
    assert download[0] == ("begin", "download", sizes)
    for file, size in sizes.items():
        steps = [e[3] for e in download if e[0] == "advance" and e[2] == file]
        assert steps and steps == sorted(steps) and steps[-1] == size, (file, steps)
    assert [e[2] for e in download if e[0] == "finish"] == needed
    # Then the load phase, from the files just fetched.
    assert _phase_events(events, "load")[0][:2] == ("begin", "load")

    # Into the hub cache, where a second load finds everything: no download phase, nothing fetched.
    assert "/models--ringd-test--tiny/snapshots/" in first["path"] and second["path"] == first["path"]
    assert not _phase_events([tuple(e) for e in second["events"]], "download")

    # And the stage is the one a local directory gives.
    assert first["params"] == second["params"] == _digests(Shard.load(str(src), start, end))
