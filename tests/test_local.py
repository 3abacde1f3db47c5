"""`ringd demo` and `ringd local` as a user runs them: real processes, the real openai client."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from devkit import REPO
from devkit.procs import wait_for_line
from devkit.rings import Ring


def _children(pid: int) -> list[int]:
    return [c.pid for c in psutil.Process(pid).children()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def _wait_dead(pids: list[int], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), "a node outlived its launcher"


def test_uv_run_ringd_demo_answers_a_chat_completion(smollm2_gguf):
    """The README's first command, literally: `uv run ringd demo` (on port 0 to stay out of the way),
    with the model in ringd's cache as the session fixture left it (test_demo.py starts from nothing)."""
    uv = shutil.which("uv")
    assert uv, "uv must be installed (.ci/run installs it): the README tells users to run `uv run ringd demo`"
    env = dict(os.environ)
    proc = subprocess.Popen(
        [uv, "run", "--frozen", "ringd", "demo", "--port", "0"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        line = wait_for_line(proc, "OpenAI API at ", 180)
        base_url = line.split("OpenAI API at ", 1)[1].split()[0]
        import openai

        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
        [model] = [m.id for m in client.models.list().data]
        assert model == "SmolLM2-135M-Instruct"
        question = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(model=model, messages=question, max_tokens=20, temperature=0)
        assert "Paris" in r.choices[0].message.content
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(30)


def _listening(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if f"pid={pid}," in line}


def test_sigterm_stops_every_node(tiny_model):
    """And before: the ready line says how ringctl reaches the run (its own secret file: the
    user's ~/.config/ringd/secret is not it), and --keep-alive reaches every node."""
    ring = Ring(tiny_model(arch="llama", layers=4), nodes=3, extra=["--keep-alive", "10m"])
    try:
        nodes = _children(ring.proc.pid)
        assert len(nodes) == 3
        ctl = ring.ready_line.split("ringctl reaches it as: ringctl ", 1)[1].split()
        shown = subprocess.run([sys.executable, "-m", "ringd.app.ctl", *ctl], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert shown.returncode == 0 and "tiny" in shown.stdout, (shown.stdout, shown.stderr)
        for pid in nodes:
            argv = open(f"/proc/{pid}/cmdline").read().split("\0")
            assert argv[argv.index("--keep-alive") + 1] == "600s", argv
        # The launcher bound every listener (port 0) and handed it down: each node holds its two,
        # the API's among them, and the launcher none (a node that dies closes its ports).
        held = [_listening(pid) for pid in nodes]
        assert all(len(ports) == 2 for ports in held), held
        assert int(ring.url.rsplit(":", 1)[1]) in set().union(*held)
        assert not _listening(ring.proc.pid)
        ring.proc.send_signal(signal.SIGTERM)  # the launcher only, as a service manager would
        assert ring.proc.wait(30) == 0
        _wait_dead(nodes)
    finally:
        ring.stop()


def test_nodes_exit_when_the_launcher_is_killed(tiny_model):
    ring = Ring(tiny_model(arch="llama", layers=4), nodes=2)
    try:
        nodes = _children(ring.proc.pid)
        ring.proc.kill()  # no chance to clean up: the nodes notice on their own
        ring.proc.wait()
        _wait_dead(nodes)
    finally:
        ring.stop()


def test_local_rejects_a_split_that_does_not_fit(tiny_model):
    model = tiny_model(arch="llama", layers=4)
    bad = subprocess.run(
        [sys.executable, "-m", "ringd", "local", "--nodes", "2", "--model", str(model), "--port", "0", "--split", "1,2"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode != 0
    assert "split" in bad.stderr and "sums to 3" in bad.stderr and "4 layers" in bad.stderr


@pytest.mark.parametrize("argv,needle", [(["--split", "a,b"], "--split"), (["--nodes", "0"], "--nodes")])
def test_local_flag_errors(tiny_model, argv, needle):
    model = tiny_model(arch="llama", layers=4)
    args = ["--nodes", "2", "--model", str(model), "--port", "0"]
    # later flags win in argparse, so the bad one is appended
    r = subprocess.run([sys.executable, "-m", "ringd", "local", *args, *argv], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and needle in r.stderr


def test_progress_lines_name_each_loading_node_once_per_change():
    from ringd.app.local import progress_lines

    p = {"phase": "download", "file": "model-00002-of-00004.safetensors", "files_done": 1, "files_total": 4,
         "bytes": 3 * 2**20, "total_bytes": 12 * 2**20, "rate_bytes_s": 2**20, "layers": [2, 4]}  # fmt: skip
    doc = {"nodes": [{"node": "node0", "progress": None}, {"node": "node1", "progress": p}, "junk", {"node": "node2"},
                     {"node": "node3", "progress": {"bytes": "many", "total_bytes": 1}}]}  # fmt: skip
    shown: dict = {}
    assert progress_lines(doc, shown) == [
        "ringd local: node1 downloading layers [2, 4): 3.0 MiB of 12.0 MiB (25%), 1.0 MiB/s, "
        "model-00002-of-00004.safetensors (2 of 4 files)"
    ]
    assert progress_lines(doc, shown) == []  # nothing changed: nothing printed
    doc["nodes"][1]["progress"] = {**p, "phase": "load", "bytes": 12 * 2**20, "files_done": 4}
    [line] = progress_lines(doc, shown)
    assert line.startswith("ringd local: node1 loading layers [2, 4): 12.0 MiB of 12.0 MiB (100%)")
    assert progress_lines({}, shown) == [] and progress_lines({"nodes": [{"node": "node1", "progress": None}]}, shown) == []


def test_local_shows_the_download_of_a_hub_model_while_the_ring_gets_ready(tiny_model, tmp_path):
    """`ringd local --model owner/name` from a Hub (tests/fakehub.py, throttled so the download
    takes a few seconds): the launcher prints the nodes' progress before the ring is ready."""
    from devkit.fakehub import FakeHub

    src = tiny_model(arch="llama", layers=8, hidden_size=64, dtype="float32", shard_bytes=40_000)
    # The model's ~1.8 MiB of weight files in 64 KiB chunks 0.1 s apart: about 3 s of download,
    # which the launcher's polls (every PROGRESS_POLL_S) see whatever the machine's speed. One
    # node: the cheapest ring that downloads (and stops promptly: the node gives the download up).
    with FakeHub({"ringd-test/tiny": src}, chunk_bytes=64 * 1024, delay_s=0.1) as hub:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ringd", "local", "--nodes", "1", "--model", "ringd-test/tiny", "--port", "0"],
            cwd=REPO, env=hub.env(tmp_path / "hf"), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
        )  # fmt: skip
        try:
            line = wait_for_line(proc, "downloading layers", 120)
            assert line.startswith("ringd local: node") and ".safetensors (" in line and "B/s" in line
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)


@pytest.mark.parametrize(
    ("model_args", "nodes", "size", "needle"),
    [
        (dict(arch="llama", layers=4, heads=4, kv_heads=1), 2, 2, "its 1 key/value heads do not split into groups of 2"),
        (dict(arch="phi3", layers=4), 2, 2, "mlx-lm has no tensor parallelism for phi3 (its Model has no shard())"),
        (dict(arch="llama", layers=4), 3, 2, "--nodes 3 does not make whole groups of --tensor-parallel 2"),
    ],
    ids=["heads", "no-shard", "nodes"],
)
def test_local_refuses_groups_the_model_or_the_nodes_cannot_make(tiny_model, model_args, nodes, size, needle):
    from ringd.app.local import LaunchError, check_plan

    with pytest.raises(LaunchError) as e:
        check_plan(str(tiny_model(**model_args)), nodes, None, size)
    assert needle in str(e.value) and e.value.code == 2


def test_signals_one_after_another_stop_the_launcher_s_wait_and_never_hang_it():
    """The launcher's stop is set from a signal handler, which runs on the thread that waits for
    it: a burst of signals while it waits (a second Ctrl-C, SIGTERM after SIGINT) ends the wait,
    however they land. A threading.Event could deadlock here: its ``set`` takes the lock its
    ``wait`` holds as it wakes."""
    import threading

    from ringd.app.local import Stop

    stop = Stop()
    old = signal.signal(signal.SIGUSR1, lambda *_: stop.set())
    try:
        assert not stop.wait(0.01)
        sender = threading.Thread(target=lambda: [os.kill(os.getpid(), signal.SIGUSR1) for _ in range(200)])
        sender.start()
        deadline = time.monotonic() + 30
        while not stop.wait(0.001):
            assert time.monotonic() < deadline, "the signals' stop was never seen"
        sender.join(30)
        assert stop.is_set() and stop.wait(0)
    finally:
        signal.signal(signal.SIGUSR1, old)
