"""mlx-lm on the same model, what each ring is measured against: single-process decode (greedy or
sampled), the same with each token's layers evaluated in pieces, BatchGenerator over N prompts,
mlx-lm's own pipeline over ``mx.distributed``, and the mlx-lm copy of a GGUF model.

MLX and mlx-lm are imported inside the functions: ``--help`` and the pure tests load none of it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from devkit import REPO
from devkit.bench.measure import own_cpu_seconds
from devkit.bench.settings import SAMPLED_SEED, SAMPLING


def mlx_sampler():
    """mlx-lm's sampler for --temperature (None: its greedy default), seeded as the rings' requests are."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    if not SAMPLING["temperature"]:
        return None
    mx.random.seed(SAMPLED_SEED)
    return make_sampler(SAMPLING["temperature"])


def single_process(model, prompt: list[int], tokens: int) -> float:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    start = None
    n = 0
    for n, _ in enumerate(generate_step(mx.array(prompt), model, max_tokens=tokens, sampler=mlx_sampler()), start=1):
        if n == 1:
            start = time.perf_counter()
    return (n - 1) / (time.perf_counter() - start)


class _EvaluatedAfter:
    """A layer whose output is evaluated as soon as the model's code has it: the end of a piece
    of ``in_pieces``, as the end of a stage of a ring."""

    def __init__(self, layer):
        self.layer = layer

    def __getattr__(self, name):  # the model's loop may read a layer's attributes
        return getattr(self.layer, name)

    def __call__(self, *args, **kwargs):
        import mlx.core as mx

        out = self.layer(*args, **kwargs)
        mx.eval(out)
        return out


def in_pieces(model, prompt: list[int], tokens: int, pieces: int) -> float:
    """``single_process`` with each token's layers evaluated in ``pieces`` evaluations, cut as a
    ring of that many nodes cuts them (even ranges): MLX's own cost of a ring's extra stages in
    one process, with no frames, links or threads. Returns CPU ms per token of this process."""
    from ringd.ring.plan import even_split
    from ringd.stage.shard import inner_model

    _, decoder = inner_model(model)
    layers = list(decoder.layers)
    counts = even_split(len(layers), pieces)
    ends = {sum(counts[: i + 1]) for i in range(pieces - 1)}
    decoder.layers = [_EvaluatedAfter(layer) if i + 1 in ends else layer for i, layer in enumerate(layers)]
    try:
        before = own_cpu_seconds()
        single_process(model, prompt, tokens)
        return 1000 * (own_cpu_seconds() - before) / tokens
    finally:
        decoder.layers = layers


def batch_generator(model, prompts: list[list[int]], tokens: int) -> float:
    """Aggregate tokens/s of mlx-lm's BatchGenerator over the same prompts (no stop token, as the rings bar EOS)."""
    from mlx_lm.generate import BatchGenerator

    started = time.perf_counter()
    gen = BatchGenerator(model, max_tokens=tokens, completion_batch_size=max(32, len(prompts)), prefill_batch_size=len(prompts))
    gen.insert(prompts, [tokens] * len(prompts))
    produced = 0
    while responses := gen.next_generated():
        produced += len(responses)
    gen.close()
    if produced != len(prompts) * tokens:
        raise SystemExit(f"bench: BatchGenerator produced {produced} tokens, expected {len(prompts) * tokens}")
    return produced / (time.perf_counter() - started)


def with_index(model_path: str) -> str:
    """The model directory with a ``model.safetensors.index.json`` (mlx-lm's ``sharded_load``
    reads it to fetch each rank's files): itself, or a copy of links beside it with one added."""
    import mlx.core as mx

    from ringd.app.cli import cache_dir

    src = Path(model_path)
    if (src / "model.safetensors.index.json").is_file():
        return model_path
    out = cache_dir() / "models" / f"bench-indexed-{src.name}"
    if not (out / "model.safetensors.index.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        weight_map = {}
        for f in sorted(src.iterdir()):
            if not (out / f.name).exists():
                (out / f.name).symlink_to(f.resolve())
            if f.suffix == ".safetensors":
                weight_map.update(dict.fromkeys(mx.load(str(f)), f.name))
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(out)


# Tries of one mlx-lm pipeline run: its ring backend loses a peer now and then (another range
# of ports, a fresh start each time); how many failed, by ranks, is reported with the figures.
MLX_PIPELINE_TRIES = 5
MLX_PIPELINE_FAILURES: dict[int, int] = {}


def mlx_pipeline(model_path: str, ranks: int, prompt_tokens: int, tokens: int) -> float | None:
    """mlx-lm's own pipeline: ``ranks`` local processes started by ``mlx.launch --backend ring``,
    each loading its layers with ``sharded_load``, timed by ``mlx_lm.benchmark --pipeline`` (one
    trial after its warm-up); its generation tokens/s, as rank 0 reports it. None if every try
    failed (on loopback its ring backend often loses a peer mid-generation: "[ring] connection
    to a peer was lost"; the failures are counted in the table)."""
    import re

    from devkit.mlxlaunch import run_ranks

    def tps(stdout: str) -> float | None:
        # Its ranks often fail as the others exit after the last trial; rank 0 has printed by then.
        found = re.search(r"^Averages: .*generation_tps=([\d.]+)", stdout, re.M)
        if found is None:
            MLX_PIPELINE_FAILURES[ranks] = MLX_PIPELINE_FAILURES.get(ranks, 0) + 1
        return float(found.group(1)) if found else None

    program = "from mlx_lm.benchmark import main\nmain()\n"
    args = ["--model", model_path, "--pipeline", "--prompt-tokens", str(prompt_tokens), "--generation-tokens", str(tokens), "--num-trials", "1"]
    found, stderr = run_ranks(program, args, ranks, tps, MLX_PIPELINE_TRIES, 600)
    if found is None:
        print(f"bench: mlx-lm's pipeline over {ranks} ranks failed {MLX_PIPELINE_TRIES} times in a row; the last:\n{stderr[-1500:]}", file=sys.stderr)
    return found


def converted(model: str) -> str | None:
    """For a GGUF model, the mlx-lm directory of the same model (written once); None for a directory."""
    from ringd.models.source import gguf_source
    from ringd.app.cli import cache_dir
    from ringd.models.gguf.reader import GgufFile

    file, _ = gguf_source(model)
    if file is None:
        return None
    g = GgufFile.open(file)
    out = cache_dir() / "converted" / f"{g.name}-{g.fingerprint.removeprefix('gguf:')[:16]}"
    if not (out / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "ringd", "convert", str(file), str(out)], check=True, cwd=REPO)
    print(f"model: {file} ({g.config['model_type']}, {g.config['num_hidden_layers']} layers); mlx-lm runs {out}")
    return str(out)
