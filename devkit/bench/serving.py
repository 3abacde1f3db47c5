"""--rate: serving latency as vLLM's serving benchmark reports it. Seeded Poisson arrivals, the
same for every server; TTFT and inter-token latency, p50 and p99, and throughput, for each ring
and for mlx-lm's own server (mlx_lm.server) on the same model."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

from devkit import REPO
from devkit.bench.rings import MLX_LM_SERVERS, fixed_length, stop_ring
from devkit.bench.settings import PROMPT


def start_mlx_lm_server(model_path: str) -> tuple[subprocess.Popen, str]:
    """mlx-lm's own OpenAI server on the same model, on a free port."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", model_path, "--port", str(port), "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    MLX_LM_SERVERS.add(url)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=5).read()
            return proc, url
        except OSError:
            time.sleep(0.5)
    stop_ring(proc)
    raise SystemExit("bench: mlx_lm.server did not start")


def timed_stream(url: str, prompt: str, tokens: int, no_eos: list[int]) -> tuple[float, list[float]]:
    """Send one streamed completion now; its send time and the arrival time of each event with text
    (mlx_lm.server takes "default_model" for the model it was started with)."""
    model = "default_model" if url in MLX_LM_SERVERS else "bench"
    body = json.dumps({
        "model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
        **fixed_length(url, no_eos),
    }).encode()  # fmt: skip
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    sent, times = time.perf_counter(), []
    with urllib.request.urlopen(req, timeout=900) as r:
        for line in r:
            if line.startswith(b"data: {") and any(c.get("text") for c in json.loads(line[6:]).get("choices", [])):
                times.append(time.perf_counter())
    return sent, times


def serving(url: str, prompts: list[str], arrivals: list[float], tokens: int, no_eos: list[int]) -> dict:
    """Requests sent at ``arrivals`` (seconds from now); TTFT and ITL samples, and throughput."""
    import threading

    results: list = [None] * len(prompts)

    def one(i: int) -> None:
        results[i] = timed_stream(url, prompts[i], tokens, no_eos)

    started = time.perf_counter()
    threads = []
    for i, at in enumerate(arrivals):
        time.sleep(max(0.0, started + at - time.perf_counter()))
        threads.append(threading.Thread(target=one, args=(i,)))
        threads[-1].start()
    for t in threads:
        t.join()
    ended = max(times[-1] for _, times in results)
    ttft = [times[0] - sent for sent, times in results]
    itl = [b - a for _, times in results for a, b in zip(times, times[1:])]
    produced = tokens * len(prompts)  # every stream runs to max_tokens: end-of-sequence is barred
    return {"ttft": ttft, "itl": itl, "tok_s": produced / (ended - started), "req_s": len(prompts) / (ended - started)}


def rate(args, tok, model_path: str, reference_path: str, rings: dict, no_eos: list[int]) -> None:
    """TTFT and inter-token latency at a steady request rate: each ring against mlx_lm.server, interleaved."""
    import random

    import numpy as np

    servers = {"mlx_lm.server": start_mlx_lm_server(reference_path)}
    servers.update({f"ringd local, {n} node(s)": ring for n, ring in rings.items()})
    try:
        for _, url in servers.values():  # warm-up
            timed_stream(url, PROMPT, 8, no_eos)
        pooled: dict[str, list[dict]] = {name: [] for name in servers}
        for r in range(args.repeats):
            rng = random.Random(r)
            arrivals, t = [], 0.0
            for _ in range(args.requests):
                arrivals.append(t)
                t += rng.expovariate(args.rate)
            prompts = [tok.apply_chat_template([{"role": "user", "content": f"{PROMPT} (run {r}, request {i})"}], add_generation_prompt=True, tokenize=False) for i in range(args.requests)]
            for name, (_, url) in servers.items():
                pooled[name].append(serving(url, prompts, arrivals, args.tokens, no_eos))
                m = pooled[name][-1]
                print(f"run {r + 1}/{args.repeats}, {name}: TTFT p50 {1000 * np.percentile(m['ttft'], 50):.0f} ms, ITL p50 {1000 * np.percentile(m['itl'], 50):.1f} ms, {m['tok_s']:.1f} tok/s", flush=True)
    finally:
        stop_ring(servers["mlx_lm.server"][0])
    print()
    print(f"{args.requests} requests at {args.rate} per second (Poisson), {args.tokens} tokens each, greedy, {args.repeats} run(s) pooled")
    print(f"{'server':<28}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>10}{'ITL p99':>10}{'tok/s':>8}{'req/s':>8}")
    for name, ms in pooled.items():
        ttft = [x for m in ms for x in m["ttft"]]
        itl = [x for m in ms for x in m["itl"]]
        tok_s = float(np.median([m["tok_s"] for m in ms]))
        req_s = float(np.median([m["req_s"] for m in ms]))
        print(
            f"{name:<28}{1000 * np.percentile(ttft, 50):>8.0f}ms{1000 * np.percentile(ttft, 99):>8.0f}ms"
            f"{1000 * np.percentile(itl, 50):>8.1f}ms{1000 * np.percentile(itl, 99):>8.1f}ms{tok_s:>8.1f}{req_s:>8.2f}"
        )
