"""Speculative decoding (--draft-model): mlx-lm's own speculative decoding, the early-exit pair of a
generated model (``early:K``), and the proposals a ring's last stage kept (its /metrics)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from devkit.bench.reference import mlx_sampler
from devkit.bench.rings import node_metrics


def single_process_speculative(model, draft, prompt: list[int], tokens: int, num_draft: int, counts: list[int]) -> float:
    """mlx-lm's own speculative decoding; ``counts`` gains the proposals it kept and the tokens it made."""
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step

    start = None
    n = 0
    steps = speculative_generate_step(mx.array(prompt), model, draft, num_draft_tokens=num_draft, max_tokens=tokens, sampler=mlx_sampler())
    for n, (_, _, from_draft) in enumerate(steps, start=1):
        if n == 1:
            start = time.perf_counter()
        counts[0] += bool(from_draft)
    counts[1] += n
    return (n - 1) / (time.perf_counter() - start)


def early_exit_pair(model_path: str, k: int) -> tuple[str, str]:
    """A target and a draft that agrees with it: the target's layers from ``k`` on have their
    output projections zeroed (they compute, and add nothing), the draft is its first ``k``."""
    import shutil

    import mlx.core as mx

    from ringd.app.cli import cache_dir

    src = Path(model_path)
    config = json.loads((src / "config.json").read_text())
    out = cache_dir() / "models" / f"bench-early-{k}-{src.name}"
    target, draft = out / "target", out / "draft"
    if not (draft / "config.json").is_file():
        weights = mx.load(str(src / "model.safetensors"))
        for d in (target, draft):
            d.mkdir(parents=True, exist_ok=True)
            for f in src.iterdir():
                if f.name not in ("model.safetensors", "model.safetensors.index.json", "config.json"):
                    shutil.copy(f, d / f.name)
        layer = lambda name: int(name.split(".")[2]) if name.startswith("model.layers.") else -1  # noqa: E731
        quiet = {n: mx.zeros_like(w) if layer(n) >= k and n.endswith(("o_proj.weight", "down_proj.weight")) else w for n, w in weights.items()}
        mx.save_safetensors(str(target / "model.safetensors"), quiet)
        (target / "config.json").write_text(json.dumps(config))
        mx.save_safetensors(str(draft / "model.safetensors"), {n: w for n, w in weights.items() if layer(n) < k})
        (draft / "config.json").write_text(json.dumps({**config, "num_hidden_layers": k}))
    return str(target), str(draft)


def draft_counts(url: str) -> tuple[float, float]:
    """Proposals the ring's last stage kept and cut so far (its ringd_draft_tokens_total)."""
    import re

    text = node_metrics(url)[-1]
    return tuple(
        sum(float(m) for m in re.findall(rf'^ringd_draft_tokens_total\{{node="[^"]+",outcome="{o}"\}} (\S+)$', text, re.M)) for o in ("accepted", "rejected")
    )
