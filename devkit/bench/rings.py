"""`ringd local` rings as the bench drives them: started (this code's or a baseline checkout's,
with a draft, TLS or replicas) and stopped, their URLs and /metrics, and what a client asks of
them: one streamed decode, N at once, the stages' compute meanwhile.

mlx_lm.server is asked the same way (``MLX_LM_SERVERS``: its URLs, which take logit_bias where a
ring takes ``ignore_eos``).
"""

from __future__ import annotations

import json
import os
import select
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from devkit import REPO
from ringd.ring.statusdoc import ClusterStatus
from devkit.bench.measure import pin_ring
from devkit.bench.settings import PROMPT, SAMPLING

# The URLs of mlx_lm.server instances the bench started (serving.py), asked as a ring is.
MLX_LM_SERVERS: set[str] = set()

# The CA each TLS ring's URLs are checked with (``start_ring(..., tls=True)``), by URL.
CONTEXTS: dict[str, ssl.SSLContext] = {}


def urlopen(req, timeout: float):
    """urllib's urlopen, trusting the ring's own CA when the URL is a TLS ring's."""
    url = req if isinstance(req, str) else req.full_url
    context = next((c for base, c in CONTEXTS.items() if url.startswith(base)), None)
    return urllib.request.urlopen(req, timeout=timeout, context=context)


def cluster_status(url: str) -> ClusterStatus:
    """The ring's /cluster/status, as the node at ``url`` answers it."""
    with urlopen(url + "/cluster/status", timeout=10) as r:
        return ClusterStatus.parse(json.loads(r.read()))


def node_metrics(url: str) -> list[str]:
    """Each node's /metrics text, in the ring's order (its /cluster/status)."""
    texts = []
    for node in cluster_status(url).nodes:
        with urlopen(f"{url.split('://')[0]}://{node.http}/metrics", timeout=10) as r:
            texts.append(r.read().decode())
    return texts


def stage_compute(url: str) -> float:
    """Seconds the ring's stages spent computing decode frames so far (each node's
    ringd_stage_compute_seconds{phase="decode"}, summed over the ring)."""
    import re

    pattern = r'^ringd_stage_compute_seconds_sum\{[^}]*phase="decode"[^}]*\} (\S+)$'
    return sum(float(v) for text in node_metrics(url) for v in re.findall(pattern, text, re.M))


def decode_and_compute(url: str, prompt: list[int], tokens: int, no_eos: list[int]) -> tuple[float, float]:
    """``ring_decode``'s tokens/s, and the ms per token its stages spent computing meanwhile
    (all stages summed; the prompt's last token included)."""
    before = stage_compute(url)
    tps = ring_decode(url, prompt, tokens, no_eos)
    return tps, 1000 * (stage_compute(url) - before) / tokens


def start_ring(
    model_path: str, nodes: int, draft: str | None = None, repo: Path = REPO, tls: bool = False, replicas: int = 1, tensor_parallel: int = 1,
    tensor_engine: str | None = None,
) -> tuple[subprocess.Popen, str]:
    """A ``ringd local`` ring of ``nodes``, its code from ``repo`` (``python -m`` looks in its
    working directory first: a checkout of other code runs that code, with this environment);
    with ``replicas``, that many instances of the model, each a ring over its share of the nodes;
    with ``tensor_parallel``, its stages groups of that many nodes."""
    cmd = [sys.executable, "-m", "ringd", "local", "--nodes", str(nodes), "--model", model_path, "--port", "0", "--model-id", "bench", "--log-level", "warning"]
    if draft:
        cmd += ["--draft-model", draft]
    if tls:
        cmd += ["--tls", "auto"]
    if replicas != 1:
        cmd += ["--replicas", str(replicas)]
    if tensor_parallel != 1:
        cmd += ["--tensor-parallel", str(tensor_parallel)]
    if tensor_engine is not None:
        cmd += ["--tensor-engine", tensor_engine]
    proc = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            line = proc.stdout.readline()
            if "OpenAI API at " in line:
                url = line.split("OpenAI API at ", 1)[1].split()[0].removesuffix("/v1")
                if tls:
                    # This ring's own CA, for each of its nodes' URLs (the ring is ready: all are listed).
                    ca = line.split("clients trust the cluster CA in ", 1)[1].split()[0]
                    CONTEXTS[url] = ssl.create_default_context(cafile=ca)
                    for node in cluster_status(url).nodes:
                        CONTEXTS[f"https://{node.http}"] = CONTEXTS[url]
                pin_ring(proc.pid)
                return proc, url
    stop_ring(proc)
    raise SystemExit(f"bench: the {nodes}-node ring did not start")


def stop_ring(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def fixed_length(url: str, no_eos: list[int]) -> dict:
    """What keeps a stream from ending before max_tokens: ringd's ``ignore_eos``; mlx_lm.server
    has no such option, so its end tokens are barred with logit_bias (a logits processor's work)."""
    if url in MLX_LM_SERVERS:
        return {"logit_bias": {str(t): -100 for t in no_eos}}
    return {"ignore_eos": True}


def ring_decode(url: str, prompt: list[int], tokens: int, no_eos: list[int] = (), response_format: dict | None = None, gaps: list | None = None) -> float:
    """Decode tokens/s after the first token; ``gaps`` (if given) gains the seconds between tokens."""
    request = {
        "model": "bench", "prompt": prompt, "max_tokens": tokens, "stream": True,
        **fixed_length(url, no_eos), **SAMPLING,
    }  # fmt: skip
    if response_format is not None:
        request["response_format"] = response_format
    body = json.dumps(request).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    times = []
    with urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
    if len(times) != tokens:
        raise SystemExit(f"bench: the ring produced {len(times)} tokens, expected {tokens} (EOS?)")
    if gaps is not None:
        gaps.extend(b - a for a, b in zip(times, times[1:]))
    return (len(times) - 1) / (times[-1] - times[0])


def ring_concurrent(url: str, prompts: list[list[int]], tokens: int, no_eos: list[int]) -> float:
    """Aggregate tokens/s of one stream per prompt, all at once."""
    from concurrent.futures import ThreadPoolExecutor

    started = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda p: ring_decode(url, p, tokens, no_eos), prompts))
    return len(prompts) * tokens / (time.perf_counter() - started)


def stream_prompts(tok, n: int, run: int) -> list[list[int]]:
    """``n`` prompts, each its own (no stream reuses another's cached prefix, nor a run another run's)."""
    return [list(tok.apply_chat_template([{"role": "user", "content": f"{PROMPT} (run {run}, stream {i})"}], add_generation_prompt=True)) for i in range(n)]


def follower_url(url: str) -> str:
    """The URL of a node of the ring at ``url`` that does not lead it."""
    doc = cluster_status(url)
    node = next(n for n in doc.nodes if n.node != doc.leader)
    return f"{url.split('://')[0]}://{node.http}"


@dataclass
class Started:
    """The rings one run of the bench started, each role's by ring size (``start_ring``'s process and
    URL); all stopped at the end, however the run ends."""

    rings: dict[int, tuple] = field(default_factory=dict)  # this code's, plain
    drafted: dict[int, tuple] = field(default_factory=dict)  # with --draft-model on the leader
    baselines: dict[int, tuple] = field(default_factory=dict)  # --baseline's code
    drafted_baselines: dict[int, tuple] = field(default_factory=dict)
    replicated: dict[int, tuple] = field(default_factory=dict)  # --replicas R
    secured: dict[int, tuple] = field(default_factory=dict)  # --tls auto

    def stop(self) -> None:
        for proc, _ in [*self.rings.values(), *self.drafted.values(), *self.baselines.values(), *self.secured.values(), *self.replicated.values(), *self.drafted_baselines.values()]:
            stop_ring(proc)
