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


# Long prompts the second case sends at once (as a batch of embedding inputs, or several agents'
# long contexts): the short chat waited for a chunk of each of them before its turn came.
LONG_PROMPTS_AT_ONCE = 6


def short_behind(url: str, short: list[int], long_prompt: list[int], repeats: int) -> dict[str, list[float]]:
    """A short chat's time to first token alone, behind one long prompt of ``long_prompt``'s length,
    and behind LONG_PROMPTS_AT_ONCE prompts of half that length sent at once; each run's figures
    printed, then the medians. The long requests are in flight (0.3 s after they were sent) when
    the short one is sent."""
    import threading
    from statistics import median

    def first_token(prompt: list[int]) -> float:
        body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        started = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                if line.startswith(b"data: {"):
                    return time.perf_counter() - started
        raise RuntimeError("the stream ended without a token")

    figures: dict[str, list[float]] = {"alone": [], "behind one long prompt": [], f"behind {LONG_PROMPTS_AT_ONCE} long prompts": []}
    # What the short chat's turn costs the long prompts: their own time to first token (the last of six).
    longs_took: dict[str, list[float]] = {"one long prompt": [], f"the last of {LONG_PROMPTS_AT_ONCE}": []}
    half = len(long_prompt) // 2
    for run in range(repeats):
        tweak = [10 + run, 20 + run]  # no run reuses another's cached prefix
        figures["alone"].append(first_token(tweak + short))
        for name, took, longs in [
            ("behind one long prompt", "one long prompt", [tweak + long_prompt]),
            (f"behind {LONG_PROMPTS_AT_ONCE} long prompts", f"the last of {LONG_PROMPTS_AT_ONCE}", [[30 + run, 40 + k] + long_prompt[k * 7 :][:half] for k in range(LONG_PROMPTS_AT_ONCE)]),
        ]:  # fmt: skip
            ttfts: list[float] = []
            threads = [threading.Thread(target=lambda p=p: ttfts.append(first_token(p))) for p in longs]
            for t in threads:
                t.start()
            time.sleep(0.3)  # the long prompts are in: their chunks go round the ring
            figures[name].append(first_token([50 + run] + short))
            for t in threads:
                t.join(600)
            longs_took[took].append(max(ttfts))
        print(
            f"run {run + 1}/{repeats}: short chat's first token " + ", ".join(f"{name} {v[-1]:.3f} s" for name, v in figures.items())
            + "; the long prompts' own first token: " + ", ".join(f"{name} {v[-1]:.2f} s" for name, v in longs_took.items()),
            flush=True,
        )  # fmt: skip
    print(
        f"median of {repeats}: " + ", ".join(f"{name} {median(v):.3f} s" for name, v in figures.items())
        + "; the long prompts' own first token: " + ", ".join(f"{name} {median(v):.2f} s" for name, v in longs_took.items())
    )  # fmt: skip
    return figures
