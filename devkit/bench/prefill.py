"""--prefill-pause: the running streams' longest pause while a long prompt prefills, against that
prefill's own time."""

from __future__ import annotations

import json
import time
import urllib.request

from devkit.bench.rings import fixed_length


def prefill_pause(url: str, prompt: list[int], long_prompt: list[int], no_eos: list[int], repeats: int) -> None:
    """The running streams' longest pause while a long prompt prefills, per run and as a share of that prefill."""
    import threading

    def stream(out: list[float], stop: threading.Event) -> None:
        body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": 4000, "temperature": 0, "stream": True, **fixed_length(url, no_eos)}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                if line.startswith(b"data: {"):
                    out.append(time.perf_counter())
                    if stop.is_set():
                        return

    shares = []
    for run in range(repeats):
        stop = threading.Event()
        times: list[list[float]] = [[], []]
        threads = [threading.Thread(target=stream, args=(t, stop)) for t in times]
        for t in threads:
            t.start()
        while min(len(t) for t in times) < 20:  # both streams decoding
            time.sleep(0.05)
        started = time.perf_counter()
        rotated = long_prompt[run * 7 :] + long_prompt[: run * 7]  # no run reuses another's cached prefix
        body = json.dumps({"model": "bench", "prompt": rotated, "max_tokens": 1, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=600).read()
        ended = time.perf_counter()
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(60)
        gaps = []
        for ts in times:
            during = [x for x in ts if started <= x <= ended]
            edges = [max([x for x in ts if x < started], default=started)] + during + [min([x for x in ts if x > ended], default=ended)]
            gaps.append(max(b - a for a, b in zip(edges, edges[1:])))
        prefill = ended - started
        shares.append(max(gaps) / prefill)
        print(f"run {run + 1}/{repeats}: prefill of {len(long_prompt)} tokens {prefill:.2f} s; running streams' longest pause {max(gaps):.3f} s ({shares[-1]:.3f} of the prefill)", flush=True)
    from statistics import median

    print(f"longest pause / prefill time, median of {repeats}: {median(shares):.3f}")
