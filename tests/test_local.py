"""`ringd demo` and `ringd local` as a user runs them: real processes, the real openai client."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, Ring, wait_for_line


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


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


def test_uv_run_ringd_demo_answers_a_chat_completion(tmp_path):
    """The README's first command, literally: `uv run ringd demo` (on port 0 to stay out of the way)."""
    uv = shutil.which("uv")
    assert uv, "uv must be installed (.ci/run installs it): the README tells users to run `uv run ringd demo`"
    env = dict(os.environ, RINGD_CACHE=str(tmp_path / "cache"))
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
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello!"}], max_tokens=20)
        assert r.choices[0].message.content and r.usage.completion_tokens >= 1
        assert len(list((tmp_path / "cache" / "models").iterdir())) == 1  # the demo model, made once
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(30)


def test_sigterm_stops_every_node(tiny_model):
    ring = Ring(tiny_model(arch="llama", layers=4), nodes=3)
    try:
        nodes = _children(ring.proc.pid)
        assert len(nodes) == 3
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
