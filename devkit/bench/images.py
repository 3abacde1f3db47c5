"""--image-ttft: an image prompt's time to first token through each ring, against mlx-vlm in one
process on the same model and pictures (each run a picture not seen before, so nothing is cached),
both from the image's file to the first token: processor, vision tower, prefill, first sample."""

from __future__ import annotations

import base64
import io
import json
import time
import urllib.request
from statistics import median

from devkit.bench.rings import start_ring, stop_ring
from devkit.bench.settings import PROMPT


def vision_model(args) -> str:
    """The model the runs use: ``--model`` (a vision-language checkpoint, on a Mac a real one),
    else a generated Gemma 3 of the benchmark's size (ringd/models/tinyvision.py), written once."""
    if args.model:
        return args.model
    from ringd.app.cli import cache_dir
    from ringd.models.tinyvision import write_tiny_vision_model

    out = cache_dir() / "models" / "bench-vlm-gemma3-v1"
    if not (out / "model.safetensors").exists():
        write_tiny_vision_model(out, "gemma3", size="bench")
    return str(out)


def picture(run: int):
    """A picture of its own for each run (a gradient, its size and turn by the run)."""
    from devkit.pictures import gradient

    return gradient(200 + run, 180 + 3 * run, turn=run % 4)


def ring_ttft(url: str, image) -> float:
    """Seconds from sending a streamed chat with ``image`` (a PNG data URL, as a client sends it) to its first token."""
    out = io.BytesIO()
    image.save(out, "PNG")
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()}}, {"type": "text", "text": PROMPT}]
    body = json.dumps({"model": "bench", "messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0, "stream": True}).encode()
    started = time.perf_counter()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: ") and b'"content"' in line:
                took = time.perf_counter() - started
                r.read()
                return took
    raise RuntimeError("the stream ended without a token")


def image_ttft(args) -> None:
    from mlx_vlm import apply_chat_template, load, stream_generate

    path = vision_model(args)
    model, processor = load(path)
    prompt = apply_chat_template(processor, model.config, PROMPT, num_images=1)
    sizes = [int(n) for n in args.nodes.split(",")]
    rings = {n: start_ring(path, n) for n in sizes}

    def reference(image) -> float:
        out = io.BytesIO()
        image.save(out, "PNG")  # from the file, as the ring's leader starts
        started = time.perf_counter()
        from PIL import Image

        decoded = Image.open(io.BytesIO(out.getvalue())).convert("RGB")
        for _ in stream_generate(model, processor, prompt, image=[decoded], max_tokens=2, temperature=0.0):
            return time.perf_counter() - started
        raise RuntimeError("mlx-vlm gave no token")

    try:
        for n, (_, url) in rings.items():  # warm-up: first-use allocations on every stage
            ring_ttft(url, picture(-1 - n))
        reference(picture(-1))
        runs: dict[str, list[float]] = {}
        for run in range(args.repeats):
            image = picture(run)
            runs.setdefault("mlx-vlm, 1 process", []).append(reference(image))
            for n, (_, url) in rings.items():
                runs.setdefault(f"ringd local, {n} node(s)", []).append(ring_ttft(url, image))
            print(f"run {run + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in runs.items()), flush=True)
    finally:
        for proc, _ in rings.values():
            stop_ring(proc)
    base = median(runs["mlx-vlm, 1 process"])
    print()
    print(f"an image prompt's time to first token ({path}), {args.repeats} interleaved runs: median (min-max), against mlx-vlm")
    for name, values in runs.items():
        print(f"{name:<28}{median(values):>8.3f} s  ({min(values):.3f}-{max(values):.3f}){median(values) / base:>8.2f}x")
