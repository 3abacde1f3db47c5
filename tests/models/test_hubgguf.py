"""``--model OWNER/REPO:QUANT``: a GGUF repository's quant fetched from the Hub (tests/kit/fakehub.py) alone,
with progress, into the Hugging Face cache, and served from there offline.

The repository holds two quants of a tiny llama written as llama.cpp writes GGUFs
(tests/kit/ggufmake.py), a projector and a README beside them, and a split F16 in a
folder of its own. The client runs in processes of its own, as a node does:
huggingface_hub reads HF_ENDPOINT, its cache folders and HF_HUB_OFFLINE when it is
imported.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from devkit import REPO as REPO_ROOT
from devkit.procs import wait_for_line
from devkit.fakehub import FakeHub
from devkit.ggufmake import write_gguf

REPO = "ringd-test/Tiny-GGUF"

# Resolves each name given (gguf_source with a recording progress, then model_info as a node
# does at start) and prints, per name, what came of it and what the progress heard.
_RESOLVE = """
import json, sys
from ringd.models.errors import ModelError
from ringd.models.progress import LoadProgress
from ringd.models.source import gguf_source, model_info

class Recording(LoadProgress):
    def __init__(self):
        super().__init__(0, 0)
        self.events = []
    def begin(self, phase, sizes):
        super().begin(phase, sizes)
        self.events.append(["begin", phase, dict(sizes)])
    def advance(self, file, n):
        super().advance(file, n)
        self.events.append(["advance", file, self.file_bytes()[file][0]])
    def finish_file(self, file):
        self.events.append(["finish", file])
        super().finish_file(file)

out = []
for name in sys.argv[1:]:
    progress = Recording()
    try:
        path, label = gguf_source(name, progress)
        info = model_info(name)
        out.append({"path": str(path), "label": label, "name": info.name, "layers": info.num_layers, "events": progress.events})
    except ModelError as e:
        out.append({"error": str(e), "events": progress.events})
print(json.dumps(out))
"""


def _resolve(env: dict, *names: str) -> list[dict]:
    r = subprocess.run([sys.executable, "-c", _RESOLVE, *names], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_a_quant_is_fetched_alone_with_progress_and_then_starts_offline(tiny_model, tmp_path):
    model = tiny_model(arch="llama", layers=2)
    repo = tmp_path / "repo"
    (repo / "F16").mkdir(parents=True)
    q8 = write_gguf(model, repo / "Tiny-Q8_0.gguf", qtype="q8_0")
    write_gguf(model, repo / "Tiny-Q4_0.gguf", qtype="q4_0")
    # A split as the Hub holds big models: llama.cpp's converter's --split-max-tensors parts.
    write_gguf(model, repo / "F16" / "Tiny-F16.gguf", qtype="f16", split_max_tensors=16)
    f16 = [(repo / "F16" / f"Tiny-F16-0000{i}-of-00002.gguf").stat().st_size for i in (1, 2)]
    (repo / "mmproj-Tiny-F16.gguf").write_bytes((repo / "F16" / "Tiny-F16-00001-of-00002.gguf").read_bytes()[:1024])
    (repo / "README.md").write_text("# Tiny GGUF\n")
    home = tmp_path / "hf"

    with FakeHub({REPO: repo}) as hub:
        online = hub.env(home)
        first, again, split, missing = _resolve(online, f"{REPO}:q8_0", f"{REPO}:Q8_0", f"hf.co/{REPO}:F16", f"{REPO}:Q5_K_M")
        fetched = hub.fetched()
        asked = len(hub.requests)
        offline = _resolve(online | {"HF_HUB_OFFLINE": "1"}, f"{REPO}:Q8_0", f"hf.co/{REPO}", f"{REPO}:Q4_0")
        assert len(hub.requests) == asked  # offline: not one request

    # Only the quant asked for, and the split's two parts: no other quant, projector or README.
    assert sorted(fetched) == ["F16/Tiny-F16-00001-of-00002.gguf", "F16/Tiny-F16-00002-of-00002.gguf", "Tiny-Q8_0.gguf"]

    # The first name fetched it with progress: its size, bytes growing to it, finished; into the cache.
    size = q8.stat().st_size
    assert first["events"][0] == ["begin", "download", {"Tiny-Q8_0.gguf": size}]
    steps = [e[2] for e in first["events"] if e[0] == "advance"]
    assert steps and steps == sorted(steps) and steps[-1] == size
    assert first["events"][-1] == ["finish", "Tiny-Q8_0.gguf"]
    assert "/hub/models--ringd-test--Tiny-GGUF/snapshots/" in first["path"] and first["path"].endswith("/Tiny-Q8_0.gguf")
    assert first["label"] == first["name"] == f"{REPO}:Q8_0" and first["layers"] == 2
    # The second found it in the cache: the same file, nothing fetched.
    assert again["path"] == first["path"] and again["events"] == []

    # A split: both parts fetched (one progress phase), and served as the one model they are.
    assert split["events"][0] == ["begin", "download", {"F16/Tiny-F16-00001-of-00002.gguf": f16[0], "F16/Tiny-F16-00002-of-00002.gguf": f16[1]}]
    assert "error" not in split, split["error"]
    assert split["path"].endswith("/F16/Tiny-F16-00001-of-00002.gguf") and split["label"] == f"{REPO}:F16" and split["layers"] == 2
    # No such quant: one line naming the quants the repository has.
    assert missing["error"] == f"{REPO} on the Hugging Face Hub has no Q5_K_M file; its quants: F16, Q4_0, Q8_0 (3 model file(s))"

    # Offline: the cached quant starts (also as the default of a name without one); another is refused, saying why.
    q8_offline, default_offline, q4_offline = offline
    assert q8_offline["path"] == default_offline["path"] == first["path"] and q8_offline["layers"] == 2
    assert "not in the Hugging Face cache" in q4_offline["error"] and "HF_HUB_OFFLINE is set" in q4_offline["error"]
    assert "F16, Q8_0" in q4_offline["error"]  # what the cache does hold of the repository


def test_ringd_local_prints_the_fetch_of_a_hub_gguf(tiny_model, tmp_path):
    """`ringd local --model OWNER/REPO:QUANT` fetches the file before any node starts, and says so."""
    model = tiny_model(arch="llama", layers=2)
    repo = tmp_path / "repo"
    repo.mkdir()
    write_gguf(model, repo / "Tiny-Q8_0.gguf", qtype="q8_0")
    with FakeHub({REPO: repo}) as hub:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ringd", "local", "--nodes", "1", "--model", f"hf.co/{REPO}:Q8_0", "--port", "0"],
            cwd=REPO_ROOT, env=hub.env(tmp_path / "hf"), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
        )  # fmt: skip
        try:
            line = wait_for_line(proc, "downloaded", 60)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
    assert line.startswith(f"ringd local: downloaded {REPO}:Q8_0: ") and "in 1 file" in line
