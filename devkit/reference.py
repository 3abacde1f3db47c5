"""mlx-lm's own answers in this process: the reference a ring's tokens and logprobs must equal."""

from __future__ import annotations

from pathlib import Path

from devkit import TEST_PREFILL_CHUNK

_references: dict = {}


def reference(model_path: Path, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from single-process mlx-lm (generate_step)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    key = (str(model_path), tuple(prompt), max_tokens)
    if key not in _references:
        model, _ = load_cached(str(model_path))
        tokens, logprobs = [], []
        steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, prefill_step_size=TEST_PREFILL_CHUNK)
        for token, lp in steps:
            tokens.append(token)
            logprobs.append(lp[token].astype(mx.float32).item())
        _references[key] = (tokens, logprobs)
    return _references[key]


_models: dict = {}


def load_cached(path: str):
    from mlx_lm import load

    if path not in _models:
        _models[path] = load(path)
    return _models[path]


def tokenizer_of(model_path: Path):
    return load_cached(str(model_path))[1]
