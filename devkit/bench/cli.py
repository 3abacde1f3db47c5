"""The bench's command line: its flags, their checks, the model (generated, or a GGUF and the mlx-lm
copy of it), the rings started, and a short ``main`` that hands them to the mode the flags ask for
(decode.py unless a flag asks for another measurement instead)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import devkit.bench
from devkit.bench import measure
from devkit.bench.concurrency import concurrency
from devkit.bench.decode import decode, report
from devkit.bench.draft import early_exit_pair
from devkit.bench.embeddings import embeddings
from devkit.bench.images import image_ttft
from devkit.bench.links import link_arguments, links
from devkit.bench.prefill import prefill_pause, short_behind
from devkit.bench.reference import converted, single_process
from devkit.bench.replicas import replicas_against_one, wait_for_replicas
from devkit.bench.rings import Started, follower_url, ring_concurrent, ring_decode, start_ring, stream_prompts
from devkit.bench.serving import rate
from devkit.bench.settings import PROMPT, SAMPLED_SEED, SAMPLING
from devkit.bench.tensor import tensor_parallel
from devkit.bench.tlscost import tls_cost


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=devkit.bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an mlx-lm model directory, a .gguf file or ollama:NAME (default: generate one with the flags below)")
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--vocab-size", type=int, help="a generated model's vocabulary (default: its tokenizer's, rounded up); 152064, Qwen2.5's, makes a sampled draft's q as large as a real model's")
    parser.add_argument("--tokens", type=int, default=128, help="tokens to decode per run")
    parser.add_argument("--nodes", default="2,3", help="ring sizes to measure, e.g. 1,2,3,4")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved runs per configuration")
    parser.add_argument("--json-schema", action="store_true", help="also measure each ring with a response_format JSON schema (the mask's cost)")
    parser.add_argument("--concurrency", help="measure aggregate tokens/s of this many streams at once instead, e.g. 1,2,4,8,16")
    parser.add_argument("--short-behind", type=int, metavar="TOKENS", help="measure a short chat's time to first token alone and behind long prompts (one of this many tokens, then six of half) instead")
    parser.add_argument("--prefill-pause", type=int, metavar="TOKENS", help="measure running streams' longest pause while a prompt of this many tokens prefills instead")
    parser.add_argument("--rate", type=float, metavar="REQ_PER_S", help="measure TTFT and inter-token latency at this steady request rate instead, against mlx_lm.server")
    parser.add_argument("--requests", type=int, default=32, help="requests per run with --rate")
    parser.add_argument("--mlx-pipeline", action="store_true", help="also measure mlx-lm's own pipeline over mx.distributed (mlx.launch --backend ring) for each ring size of 2 or more")
    parser.add_argument("--draft-model", help="also measure speculative decoding with this draft model (self: the model itself)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (a fixed seed) instead of greedy decoding")
    parser.add_argument("--embeddings", type=int, metavar="TOKENS", help="measure inputs embedded per second (/v1/embeddings, inputs of this many tokens) instead, against mlx-lm in one process")
    parser.add_argument("--embed-batch", type=int, default=16, help="inputs per request with --embeddings")
    parser.add_argument("--image-ttft", action="store_true", help="measure an image prompt's time to first token instead, against mlx-vlm in one process (--model: a vision-language checkpoint; default: a generated Gemma 3)")
    parser.add_argument("--tls", action="store_true", help="measure the cost of TLS per streamed token instead: each ring beside one with --tls auto, through a follower")
    parser.add_argument("--replicas", type=int, default=1, help="with --concurrency: each ring of N also as N/R-node replicas (ringd local --replicas R), against the one ring of N")
    parser.add_argument("--pin-cores", type=int, metavar="K", help="each process of a ring on its own K cores, and this one (mlx-lm, the client) on the first K: a machine with room measured as separate Macs (Linux)")
    parser.add_argument("--link", metavar="PROFILE[,PROFILE...]", help="run each ring's nodes on network namespace hosts joined by links of these profiles (thunderbolt, 10gbe, 1gbe, wifi; needs root): one stream and --concurrency streams against compute plus the links in theory")
    parser.add_argument("--tensor-parallel", type=int, metavar="K", help="measure one stream on K nodes that split every layer (ringd local --tensor-parallel K) instead, against mlx-lm in one process and mlx-lm's own tensor parallelism over K ranks, each process on a core of its own; then the all-reduce's cost")
    parser.add_argument("--baseline", metavar="CHECKOUT", help="also measure rings running the code of this checkout of ringd (a git worktree of another commit), asked in turn with this code's")
    return parser


def checked_arguments(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The flags, refused early where they cannot work together; --pin-cores and --temperature applied."""
    args = parser.parse_args()
    if args.pin_cores:
        most = max(int(n) for n in args.nodes.split(","))
        if args.pin_cores * (most + 1) > len(os.sched_getaffinity(0)):
            parser.error(f"--pin-cores {args.pin_cores}: {most} nodes and this process need {args.pin_cores * (most + 1)} cores; this process may use {len(os.sched_getaffinity(0))}")
        measure.PIN_CORES = args.pin_cores
        os.sched_setaffinity(0, set(range(args.pin_cores)))
    if args.temperature:
        SAMPLING.update(temperature=args.temperature, seed=SAMPLED_SEED)
    if args.replicas != 1:
        if not args.concurrency:
            parser.error("--replicas compares throughput of concurrent streams: give --concurrency too")
        if any(int(n) % args.replicas for n in args.nodes.split(",")):
            parser.error(f"--replicas {args.replicas}: every --nodes size must divide into {args.replicas} replicas of equal size")
    if args.link:
        link_arguments(parser, args)
    return args


def model_paths(args) -> tuple[str, str]:
    """The model the rings serve, and the mlx-lm directory of the same model mlx-lm runs (a GGUF's
    converted copy); with ``--draft-model early:K``, the target of the pair built (args.draft_model
    becomes its draft)."""
    from ringd.app.cli import cache_dir
    from ringd.models.tinymodel import ensure_tiny_model, summary

    reference_path = None
    if args.model:
        model_path = args.model
        reference_path = converted(model_path)
    else:
        model_path = str(
            ensure_tiny_model(
                cache_dir() / "models", arch=args.arch, layers=args.layers, hidden_size=args.hidden_size,
                heads=args.heads, kv_heads=args.kv_heads, dtype=args.dtype, seed=0, vocab_size=args.vocab_size,
            )
        )  # fmt: skip
        print(f"model: {summary(model_path)}")
    if args.draft_model and args.draft_model.startswith("early:"):
        if args.model:
            raise SystemExit("bench: --draft-model early:K builds a pair from a generated model; drop --model")
        model_path, args.draft_model = early_exit_pair(model_path, int(args.draft_model.removeprefix("early:")))
        print(f"target: {model_path}; draft: its first layers, {args.draft_model}")
    return model_path, reference_path or model_path


def start_rings(args, started: Started, model_path: str, draft_path: str | None, sizes: list[int], tok, prompt: list[int], no_eos: list[int]) -> None:
    """Every ring the flags ask for, each warmed up (first-use allocations on every stage), into ``started``."""
    for nodes in sizes:
        started.rings[nodes] = start_ring(model_path, nodes)
        ring_decode(started.rings[nodes][1], prompt, 8, no_eos)  # warm-up: first-use allocations on every stage
        if draft_path:
            started.drafted[nodes] = start_ring(model_path, nodes, draft_path)
            ring_decode(started.drafted[nodes][1], prompt, 8, no_eos)
        if args.baseline:
            started.baselines[nodes] = start_ring(model_path, nodes, repo=Path(args.baseline).resolve())
            ring_decode(started.baselines[nodes][1], prompt, 8, no_eos)
            if draft_path:
                started.drafted_baselines[nodes] = start_ring(model_path, nodes, draft_path, repo=Path(args.baseline).resolve())
                ring_decode(started.drafted_baselines[nodes][1], prompt, 8, no_eos)
        if args.replicas != 1:
            started.replicated[nodes] = start_ring(model_path, nodes, replicas=args.replicas)
            url = started.replicated[nodes][1]
            rows = wait_for_replicas(url, args.replicas)
            print(f"{nodes} nodes as {args.replicas} replicas: " + "; ".join(" -> ".join(f"{s[0]}[{s[1]},{s[2]})" for s in row["stages"]) for row in rows))
            ring_concurrent(url, stream_prompts(tok, 2 * args.replicas, -1), 8, no_eos)  # warm-up: every replica takes some
        if args.tls:
            started.secured[nodes] = start_ring(model_path, nodes, tls=True)
            ring_decode(follower_url(started.secured[nodes][1]) if nodes > 1 else started.secured[nodes][1], prompt, 8, no_eos)


def measured_instead(args, model, tok, started: Started, sizes: list[int], model_path: str, reference_path: str, prompt: list[int], no_eos: list[int]) -> bool:
    """The measurement a flag asks for instead of decode tokens/s, if one does (then True)."""
    rings = started.rings
    if args.concurrency and started.replicated:
        replicas_against_one(args, model, tok, rings, started.replicated, no_eos)
    elif args.concurrency:
        named = {f"ringd local, {n} node(s)": rings[n] for n in sizes}
        concurrency(args, model, tok, {**named, **{f"baseline, {n} node(s)": started.baselines[n] for n in started.baselines}}, no_eos)
    elif args.rate:
        rate(args, tok, model_path, reference_path, rings, no_eos)
    elif args.tls:
        tls_cost(args, prompt, no_eos, rings, started.secured)
    elif args.embeddings:
        embeddings(args, model, tok, {f"ringd local, {n} node(s)": rings[n] for n in sizes})
    elif args.short_behind:
        words = tok.encode(" ".join(["the ring of small computers shares one mind"] * args.short_behind), add_special_tokens=False)
        for name, (_, url) in [*((f"ringd local, {n} node(s)", r) for n, r in rings.items()), *((f"baseline, {n} node(s)", r) for n, r in started.baselines.items())]:
            print(f"{name}:")
            short_behind(url, prompt, words[: args.short_behind], args.repeats)
    elif args.prefill_pause:
        words = tok.encode(" ".join(["the ring of small computers shares one mind"] * args.prefill_pause), add_special_tokens=False)
        for name, (_, url) in [*((f"ringd local, {n} node(s)", r) for n, r in rings.items()), *((f"baseline, {n} node(s)", r) for n, r in started.baselines.items())]:
            print(f"{name}:")
            prefill_pause(url, prompt, words[: args.prefill_pause], no_eos, args.repeats)
    else:
        return False
    return True


def main() -> int:
    args = checked_arguments(parser())
    if args.image_ttft:
        image_ttft(args)
        return 0
    from mlx_lm import load
    from mlx_lm.utils import load_tokenizer

    model_path, reference_path = model_paths(args)
    tok = load_tokenizer(Path(reference_path))
    prompt = list(tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True))
    no_eos = sorted(tok.eos_token_ids)
    if args.tensor_parallel:  # --link: the all-reduce over each profile's links too
        tensor_parallel(args, load(reference_path)[0], model_path, prompt, no_eos)
        return 0
    if args.link:
        return links(args, model_path, reference_path, tok, prompt, no_eos)

    model, _ = load(reference_path)
    sizes = [int(n) for n in args.nodes.split(",")]
    draft_path = (model_path if args.draft_model == "self" else args.draft_model) if args.draft_model else None
    draft_model = load(converted(draft_path) or draft_path)[0] if draft_path else None
    started = Started()
    try:
        start_rings(args, started, model_path, draft_path, sizes, tok, prompt, no_eos)
        single_process(model, prompt, 8)
        if measured_instead(args, model, tok, started, sizes, model_path, reference_path, prompt, no_eos):
            return 0
        figures = decode(args, model, draft_model, started, sizes, prompt, no_eos, reference_path)
    finally:
        started.stop()
    report(args, figures, sizes, prompt, started.baselines)
    return 0
