"""--embeddings: inputs embedded per second through each ring's /v1/embeddings against mlx-lm
computing the same vectors in one pass; each ring's vectors compared with mlx-lm's first."""

from __future__ import annotations

import json
import time
import urllib.request

from devkit.bench.settings import PROMPT


def embeddings(args, model, tok, rings: dict[str, tuple]) -> None:
    """Inputs embedded per second: OpenAI's /v1/embeddings on each ring (``--embed-batch`` inputs a
    request, ``--embeddings`` tokens each), against mlx-lm in one process computing the same
    vectors (the decoder's final hidden states, mean-pooled, normalized), the batch in one pass;
    each ring's vectors checked against mlx-lm's first."""
    from statistics import median

    import mlx.core as mx
    import numpy as np

    words = tok.encode(" ".join([PROMPT] * (1 + args.embeddings // 8)), add_special_tokens=False)

    def batch(run: int) -> list[list[int]]:  # inputs of the same length, each its own
        return [words[i + run : i + run + args.embeddings] for i in range(args.embed_batch)]

    def reference(inputs: list[list[int]]) -> np.ndarray:
        pooled = model.model(mx.array(inputs)).astype(mx.float32).mean(axis=1)
        pooled = pooled / mx.linalg.norm(pooled, axis=-1, keepdims=True)
        mx.eval(pooled)
        return np.array(pooled)

    def ring(url: str, inputs: list[list[int]]) -> np.ndarray:
        body = json.dumps({"model": "bench", "input": inputs}).encode()
        req = urllib.request.Request(url + "/v1/embeddings", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return np.array([d["embedding"] for d in json.load(r)["data"]], dtype=np.float32)

    want = reference(batch(0))
    for name, (_, url) in rings.items():
        error = float(np.abs(ring(url, batch(0)) - want).max())
        print(f"{name}: largest difference from mlx-lm's vectors {error:.2e}")
    runs: dict[str, list[float]] = {}
    for r in range(args.repeats):
        inputs = batch(r + 1)
        started = time.perf_counter()
        reference(inputs)
        runs.setdefault("mlx-lm, 1 process, one batch", []).append(len(inputs) / (time.perf_counter() - started))
        for name, (_, url) in rings.items():
            started = time.perf_counter()
            ring(url, inputs)
            runs.setdefault(name, []).append(len(inputs) / (time.perf_counter() - started))
        print(f"run {r + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items()), flush=True)
    base = median(runs["mlx-lm, 1 process, one batch"])
    print()
    print(f"inputs embedded per second, {args.embed_batch} inputs of {args.embeddings} tokens a request, {args.repeats} interleaved runs (median)")
    for name, values in runs.items():
        print(f"{name:<40}{median(values):>10.1f}{median(values) / base:>10.3f}")
