"""The model list a node answers: every model it could serve, the loaded ones marked, each with
whether the cluster's memory holds it.

One list (``rows``) behind three views: ``GET /v1/models`` (OpenAI's and Anthropic's
shape), ``GET /api/tags`` (Ollama's) and ``GET /cluster/models`` (the whole rows, paths
too, for ``ringctl models``). The models are the catalogue's (``models/catalogue.py``:
the Ollama store, the Hugging Face cache, ``models_dir``); the loaded one comes first,
named as requests name it, whether or not the catalogue found it. Whether the memory
holds a model is the node's ``fit_rule``: placement's own rule over the members' budgets
as they are now (``cluster/placement.shortfall``).

The list is built off the event loop (realpaths, fits over up to MAX_MODELS models) from
the catalogue's cached listing. On the leader, the models it loaded on demand (its
instances, ``node/pool.py``) are marked loaded too; any other a request names is loaded then.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Callable

from ringd.models.catalogue import Entry, Facts, Listing, gguf_quant, mlx_quant
from ringd.models.errors import ModelError
from ringd.models.gguf.reader import GgufFile
from ringd.models.naming import ollama_spelling

if TYPE_CHECKING:
    from ringd.http.node import ApiNode
    from ringd.models.checkpoint import ModelInfo

LOADED = "loaded"  # the source of the loaded model's row when no place of the catalogue holds it


async def rows(node: "ApiNode") -> tuple[list[dict], bool]:
    """The list's rows (the loaded model first), and whether the catalogue stopped short."""
    listing = await node.catalogue.listing() if node.catalogue is not None else Listing()
    rule = node.fit_rule()  # on the loop: it reads the members' budgets
    # The leader's instances loaded from the list, by their names there (a follower knows none),
    # with what they are, for those a listing cut short left out.
    instances = {}
    for row in node.instances():
        served = node.find(row["instance"]) if row.get("source") else None
        if served is not None:
            instances[row["source"]] = served.info
    return await asyncio.to_thread(_rows, listing, node.info, node.model_id, rule, instances), listing.truncated


def _rows(
    listing: Listing, served: "ModelInfo", model_id: str, fit: Callable[["ModelInfo"], str | None], instances: dict[str, "ModelInfo"] | None = None
) -> list[dict]:
    """The loaded model first, then the other loaded ones (listed or not: a listing cut short may
    not hold them), then the models that can be served, then the files that cannot (each with its
    error): a models folder full of junk does not push a model out of sight."""
    instances = instances or {}
    real = os.path.realpath(served.path)
    loaded, others = None, []
    for entry in listing.entries:
        if loaded is None and os.path.realpath(entry.path) == real:
            loaded = _row(entry, fit) | {"name": model_id, "loaded": True, "started_as": entry.name}
        else:
            others.append(_row(entry, fit) | ({"loaded": True} if entry.name in instances else {}))
    if loaded is None:
        loaded = _row(_served_entry(served, model_id), fit) | {"loaded": True, "started_as": str(served.path)}
    listed = {row["name"] for row in others}
    others += [_row(_served_entry(info, name), fit) | {"loaded": True} for name, info in instances.items() if name not in listed]
    others.sort(key=lambda row: (not row["loaded"], bool(row["error"])))  # stable: the listing's order within each
    return [loaded, *others]


def _row(entry: Entry, fit: Callable[["ModelInfo"], str | None]) -> dict:
    why = fit(entry.facts.info) if entry.facts.info is not None else None
    fits = None if entry.facts.info is None else why is None
    return entry.to_wire() | {"loaded": False, "fits": fits, "fit": why or ""}


def _served_entry(info: "ModelInfo", model_id: str) -> Entry:
    """The loaded model as the catalogue would have listed it (it was started from elsewhere)."""
    path = info.path
    try:
        if info.is_gguf:
            files, quant, fmt = [path], gguf_quant(GgufFile.open(path)), "gguf"
        else:
            files, quant, fmt = sorted(path.glob("*.safetensors")), mlx_quant(info.config), "mlx"
        stats = [f.stat() for f in files]
    except (OSError, ModelError):
        stats, quant, fmt = [], "", "gguf" if info.is_gguf else "mlx"
    size = sum(s.st_size for s in stats)
    modified = max((s.st_mtime for s in stats), default=0.0)
    return Entry(model_id, LOADED, path, size, modified, Facts(fmt, quant, info.model_type, info.num_layers, info))


def iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- the views -------------------------------------------------------------------------

# What /v1/models and /api/tags add to each API's own fields (paths stay out: those answer anyone
# the API answers; /cluster/models, keyed or signed like /cluster/status, has them).
_FACTS = ("loaded", "source", "format", "size", "quant", "architecture", "layers", "fits", "fit", "error")


def openai_model(row: dict, started: int | None = None) -> dict:
    """A row in OpenAI's shape and Anthropic's at once (each SDK reads its own fields)."""
    created = started if started is not None else int(row["modified"])
    created_at = datetime.fromtimestamp(created, timezone.utc).isoformat().replace("+00:00", "Z")
    return {
        "id": row["name"], "object": "model", "created": created, "owned_by": "ringd",
        "type": "model", "display_name": row["name"], "created_at": created_at,
        **{k: row[k] for k in _FACTS},
    }  # fmt: skip


def ollama_models(rows: list[dict]) -> list[dict]:
    """The rows as Ollama's /api/tags lists models (without a digest: nothing is hashed to list
    them), each named as Ollama's clients spell names (``naming.ollama_spelling``), unless two
    rows would then share a name: those keep the list's own (which ``match`` finds first, exactly)."""
    spelled = [ollama_spelling(row["name"]) for row in rows]
    twice = {name for name, n in Counter(spelled).items() if n > 1}
    return [_ollama_model(row, row["name"] if name in twice else name) for row, name in zip(rows, spelled)]


def _ollama_model(row: dict, name: str) -> dict:
    arch = row["architecture"]
    details = {"parent_model": "", "format": row["format"], "family": arch, "families": [arch] if arch else [], "parameter_size": "", "quantization_level": row["quant"]}
    return {"name": name, "model": name, "modified_at": iso(row["modified"]), "size": row["size"], "digest": "", "details": details, **{k: row[k] for k in _FACTS}}
