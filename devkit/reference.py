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


# mlx.launch runs a program: this one loads the model with mlx-lm's sharded_load over the global
# group (tensor parallelism) and, on rank 0, prints each prompt's greedy tokens, alone
# (generate_step) and all together (BatchGenerator), as JSON.
_TENSOR_PARALLEL_SCRIPT = """\
import json, sys
import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.utils import sharded_load

path, prompts, max_tokens, chunk = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
group = mx.distributed.init(backend="ring", strict=True)
model, _ = sharded_load(path, tensor_group=group)
plain = [[t for t, _ in generate_step(mx.array(p), model, max_tokens=max_tokens, prefill_step_size=chunk)] for p in prompts]
gen = BatchGenerator(model, max_tokens=max_tokens, completion_batch_size=len(prompts), prefill_batch_size=len(prompts), prefill_step_size=chunk)
uids = gen.insert(prompts, [max_tokens] * len(prompts))
batched = {u: [] for u in uids}
while responses := gen.next_generated():
    for r in responses:
        batched[r.uid].append(r.token)
gen.close()
if group.rank() == 0:
    print("RESULT " + json.dumps({"plain": plain, "batched": [batched[u] for u in uids]}), flush=True)
"""
# Tries of one mlx.launch run: its ring backend on loopback loses a peer now and then.
MLX_LAUNCH_TRIES = 3
MLX_LAUNCH_TIMEOUT_S = 300


def mlx_tensor_parallel(model_path: Path, prompts: list[list[int]], max_tokens: int, ranks: int = 2) -> dict[str, list[list[int]]]:
    """mlx-lm's own tensor parallelism: ``ranks`` processes of ``mlx.launch --backend ring`` on
    loopback, each ``sharded_load(..., tensor_group=...)``; greedy tokens of each prompt alone
    ("plain") and all in one BatchGenerator ("batched")."""
    import json

    from devkit.mlxlaunch import run_ranks

    def result(stdout: str) -> dict | None:
        return next((json.loads(line.removeprefix("RESULT ")) for line in stdout.splitlines() if line.startswith("RESULT ")), None)

    args = [str(model_path), json.dumps(prompts), str(max_tokens), str(TEST_PREFILL_CHUNK)]
    found, stderr = run_ranks(_TENSOR_PARALLEL_SCRIPT, args, ranks, result, MLX_LAUNCH_TRIES, MLX_LAUNCH_TIMEOUT_S)
    if found is None:
        raise RuntimeError(f"mlx-lm's tensor parallelism over {ranks} ranks failed {MLX_LAUNCH_TRIES} times; the last:\n{stderr[-2000:]}")
    return found
