"""Load and run one contiguous layer range of an mlx-lm model.

A node of the ring holds layers [start, end) of the model, plus the token
embeddings when it is the first stage and the final norm and LM head when it is
the last (with tied embeddings the last stage also holds ``embed_tokens``, for
``as_linear``). Loading goes through mlx-lm's own loader lazily and then
materializes only the parameters this stage keeps, so a node's memory is its
share of the model, not the whole of it.

The forward pass here is the body of mlx-lm's own ``Model.__call__`` for the
plain decoder architectures, cut at the stage's bounds: same modules, same
masks, same cache objects, so a ring computes bit for bit what a single process
computes. It ignores sampling (``sampling.py``) and the network (``pipeline.py``).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.utils import load_config, load_model

# mlx-lm modules whose inner model is exactly `embed -> layer(h, mask, cache)...
# -> norm`, checked by reading their source. Others (gemma scales the embeddings,
# hybrid and MoE models keep other cache kinds, ...) would compute garbage if
# cut here, which is the failure that sank earlier attempts, so they are refused.
PLAIN_DECODER_MODULES = frozenset({"llama", "qwen2", "qwen3"})

# Files a stage needs besides weights: config, tokenizer, chat template.
NON_WEIGHT_PATTERNS = [
    "*.json",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]

_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")

# safetensors: an 8-byte little-endian header length, then a JSON header.
# A header over this size is not a safetensors file we should trust.
_MAX_SAFETENSORS_HEADER_BYTES = 100 * 1024 * 1024


class ModelError(ValueError):
    """The model cannot be served by a ring: unsupported, incomplete, bad range."""


@dataclass(frozen=True)
class WeightBytes:
    """Bytes of the checkpoint's tensors, by the part of the model they belong to."""

    layers: tuple[int, ...]
    embed: int
    norm: int
    head: int  # 0 with tied embeddings: the last stage then holds `embed` again

    def stage(self, start: int, end: int) -> int:
        """What a stage holding layers [start, end) materializes."""
        n = sum(self.layers[start:end])
        last = end == len(self.layers)
        if start == 0:
            n += self.embed
        if last:
            n += self.norm + (self.head or (self.embed if start != 0 else 0))
        return n


@dataclass(frozen=True)
class ModelInfo:
    """What every node and the leader need to know about a model without loading it."""

    path: Path
    config: dict
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    context_length: int
    fingerprint: str
    weights: WeightBytes

    @property
    def name(self) -> str:
        return self.path.name

    def kv_bytes_per_token(self, kv_bits: int | None = None, kv_group_size: int = 64) -> int:
        """KV-cache bytes one position costs in one layer (keys and values).

        Activations, and so the cache, are in the checkpoint's dtype (a
        quantized checkpoint's too: its scales' dtype); mlx-lm's
        QuantizedKVCache holds ``kv_bits`` per element plus a scale and a bias
        per group.
        """
        c = self.config
        heads = c.get("num_attention_heads") or 1
        kv_heads = c.get("num_key_value_heads") or heads
        head_dim = c.get("head_dim") or self.hidden_size // heads
        itemsize = _DTYPE_BYTES.get(str(c.get("torch_dtype") or c.get("dtype")), 2)
        elements = kv_heads * head_dim
        if kv_bits is None:
            per = elements * itemsize
        else:
            per = elements * kv_bits // 8 + 2 * (elements // kv_group_size) * itemsize
        return 2 * per


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def resolve_model_path(path_or_repo: str, allow_patterns: list[str] | None = None) -> Path:
    """A local model directory as is, or a Hugging Face repo id fetched into the hub cache.

    Only the files matching ``allow_patterns`` are fetched, so a stage can ask for
    the weight files of its own layers and nothing else.
    """
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} has no config.json; is it an mlx-lm model directory?")
        return path
    if path_or_repo.startswith((".", "/", "~")) or path_or_repo.count("/") != 1:
        raise ModelError(
            f"model {path_or_repo!r} is neither an existing directory nor a Hugging Face "
            "repo id of the form owner/name"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path_or_repo, allow_patterns=allow_patterns or NON_WEIGHT_PATTERNS))
    except Exception as e:  # the hub raises many kinds; all mean the same to the user
        raise ModelError(f"could not fetch {path_or_repo!r} from the Hugging Face Hub: {e}") from e


def model_info(path_or_repo: str) -> ModelInfo:
    """Read a model's config and check that it can be split into a ring."""
    import hashlib

    path = resolve_model_path(path_or_repo)
    config = load_config(path)
    model_type = config.get("model_type", "?")
    module = _model_module(config)
    if module not in PLAIN_DECODER_MODULES:
        raise ModelError(
            f"model_type {model_type!r} (mlx_lm.models.{module}) is not supported by the ring; "
            f"supported: {', '.join(sorted(PLAIN_DECODER_MODULES))}"
        )
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        if not isinstance(config.get(key), int) or config[key] <= 0:
            raise ModelError(f"{path / 'config.json'}: {key} must be a positive integer")
    fingerprint = hashlib.sha256(
        json.dumps(config, sort_keys=True, default=str).encode()
    ).hexdigest()[:16]
    return ModelInfo(
        path=path,
        config=config,
        model_type=model_type,
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        vocab_size=config["vocab_size"],
        context_length=int(config.get("max_position_embeddings") or 4096),
        fingerprint=fingerprint,
        weights=weight_bytes(path, config["num_hidden_layers"]),
    )


def weight_bytes(path: Path, num_layers: int) -> WeightBytes:
    """Tensor sizes from the safetensors headers (no tensor is read).

    A Hub model whose weight files are not here yet has only its index: its
    total is spread evenly over the layers, which is what placement needs.
    """
    files = sorted(path.glob("model*.safetensors"))
    layers = [0] * num_layers
    parts = {"embed": 0, "norm": 0, "head": 0}
    if not files:
        index = path / "model.safetensors.index.json"
        total = json.loads(index.read_text()).get("metadata", {}).get("total_size", 0) if index.is_file() else 0
        return WeightBytes(tuple([total // max(num_layers, 1)] * num_layers), 0, 0, 0)
    for file in files:
        for key, size in _safetensors_sizes(file).items():
            m = _LAYER_KEY.search(key)
            if m is not None:
                if int(m.group(1)) < num_layers:  # extra layers (MTP heads) are dropped on load
                    layers[int(m.group(1))] += size
            elif "embed_tokens" in key:
                parts["embed"] += size
            elif key.startswith("lm_head"):
                parts["head"] += size
            elif "norm" in key:
                parts["norm"] += size
    return WeightBytes(tuple(layers), parts["embed"], parts["norm"], parts["head"])


def _model_module(config: dict) -> str:
    from mlx_lm.utils import _get_classes

    try:
        model_class, _ = _get_classes(config)
    except ValueError as e:
        raise ModelError(str(e)) from e
    return model_class.__module__.rsplit(".", 1)[-1]


def _safetensors_header(file: Path) -> dict:
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_SAFETENSORS_HEADER_BYTES:
            raise ModelError(f"{file}: safetensors header of {n} bytes is implausible")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def safetensors_keys(file: Path) -> set[str]:
    """The tensor names in a safetensors file, read from its header only."""
    return set(_safetensors_header(file))


def _safetensors_sizes(file: Path) -> dict[str, int]:
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in _safetensors_header(file).items()}


def weight_files_for(path: Path, start: int, end: int) -> list[str] | None:
    """The weight files holding layers [start, end) and the non-layer weights.

    None when the model has no index (a single file, fetched whole). Every stage
    takes the non-layer files: they are small next to the layers, and which of
    embeddings, norm and head a stage needs is decided after loading.
    """
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return None
    weight_map = json.loads(index.read_text())["weight_map"]
    files = set()
    for key, file in weight_map.items():
        m = _LAYER_KEY.search(key)
        if m is None or start <= int(m.group(1)) < end:
            files.add(file)
    return sorted(files)


class Shard:
    """Layers [start, end) of a model, ready to run on this node's compute thread."""

    def __init__(
        self,
        info: ModelInfo,
        start: int,
        end: int,
        layers: list[nn.Module],
        embed_tokens: nn.Module | None,
        norm: nn.Module | None,
        lm_head: nn.Module | None,
        cache_factories: list,
    ):
        self.info = info
        self.start, self.end = start, end
        self.layers = layers
        self.embed_tokens = embed_tokens
        self.norm = norm
        self.lm_head = lm_head
        self._cache_factories = cache_factories
        self.rotating_allowed = True
        self.sliding_window = info.config.get("sliding_window")

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.info.num_layers

    @classmethod
    def load(cls, path_or_repo: str, start: int, end: int) -> "Shard":
        info = model_info(path_or_repo)
        if not (0 <= start < end <= info.num_layers):
            raise ModelError(
                f"layer range [{start}, {end}) is not inside the model's {info.num_layers} layers"
            )
        path = info.path
        files = weight_files_for(path, start, end)
        if files is not None and not all((path / f).exists() for f in files):
            # A Hub model: fetch this stage's files only.
            path = resolve_model_path(path_or_repo, NON_WEIGHT_PATTERNS + files)
            absent = [f for f in files if not (path / f).exists()]
            if absent:
                raise ModelError(
                    f"{path}: weight files {', '.join(absent)} holding layers [{start}, {end}) are "
                    "missing; is the download complete?"
                )

        # Lazy: mx.load maps the files and reads a tensor only when it is evaluated,
        # so the layers other stages hold are never read into memory.
        model, _ = load_model(path, lazy=True, strict=False)
        inner = model.model
        first, last = start == 0, end == info.num_layers
        # mlx-lm builds an lm_head only for untied checkpoints.
        tied = not hasattr(model, "lm_head")
        cache_factories = _cache_factories(model)[start:end]
        # As mlx-lm's make_prompt_cache: max_kv_size applies only to models
        # without a make_cache of their own.
        model_makes_cache = hasattr(model, "make_cache")
        shard = cls(
            info,
            start,
            end,
            layers=list(inner.layers[start:end]),
            embed_tokens=inner.embed_tokens if first or (last and tied) else None,
            norm=inner.norm if last else None,
            lm_head=(None if tied else model.lm_head) if last else None,
            cache_factories=cache_factories,
        )
        shard.rotating_allowed = not model_makes_cache
        del model, inner  # drops every lazy tensor this stage does not keep
        shard._check_weights_present(path, files)
        mx.eval(shard.parameters())
        return shard

    def _check_weights_present(self, path: Path, files: list[str] | None) -> None:
        # strict=False lets a stage load with only its own files present; then a
        # missing tensor would silently stay randomly initialized, so check by name.
        names = files if files is not None else [p.name for p in sorted(path.glob("model*.safetensors"))]
        if not names:
            raise ModelError(f"no model*.safetensors in {path}")
        present: set[str] = set()
        for name in names:
            present |= safetensors_keys(path / name)
        missing = [k for k, _ in self._named_parameters() if k not in present]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ModelError(
                f"{path}: {len(missing)} weights of layers [{self.start}, {self.end}) are "
                f"missing from the checkpoint ({shown}); is the download complete?"
            )

    def _named_parameters(self) -> list[tuple[str, mx.array]]:
        named = []
        for i, layer in enumerate(self.layers, start=self.start):
            named += [(f"model.layers.{i}.{k}", v) for k, v in tree_flatten(layer.parameters())]
        for prefix, module in (
            ("model.embed_tokens", self.embed_tokens),
            ("model.norm", self.norm),
            ("lm_head", self.lm_head),
        ):
            if module is not None:
                named += [(f"{prefix}.{k}", v) for k, v in tree_flatten(module.parameters())]
        return named

    def parameters(self) -> list[mx.array]:
        return [v for _, v in self._named_parameters()]

    @property
    def parameter_bytes(self) -> int:
        return sum(v.nbytes for v in self.parameters())

    def make_cache(self, max_kv_size: int | None = None) -> list[Any]:
        """This stage's caches for one request, as mlx-lm's make_prompt_cache makes them."""
        if max_kv_size is not None and self.rotating_allowed:
            return [RotatingKVCache(max_size=max_kv_size, keep=4) for _ in self._cache_factories]
        return [factory() for factory in self._cache_factories]

    def __call__(self, x: mx.array, cache: list[Any]) -> mx.array:
        """Token ids [B, L] (first stage) or hidden states [B, L, D] -> hidden states.

        The last stage returns the final-normed hidden states; ``logits`` turns
        them into vocabulary scores.
        """
        h = self.embed_tokens(x) if self.is_first else x
        # One mask per attention kind, built from this stage's own caches exactly
        # as the full model builds it from layer 0's (all layers share an offset).
        masks: dict[int | None, Any] = {}
        for layer, c in zip(self.layers, cache):
            window = self.sliding_window if getattr(layer, "use_sliding", False) else None
            if window not in masks:
                masks[window] = create_attention_mask(h, c, window_size=window)
            h = layer(h, masks[window], c)
        return self.norm(h) if self.is_last else h

    def logits(self, h: mx.array) -> mx.array:
        if self.lm_head is not None:
            return self.lm_head(h)
        return self.embed_tokens.as_linear(h)


def _cache_factories(model: nn.Module) -> list:
    """One constructor per layer making the cache mlx-lm would make for it."""
    protos = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    factories = []
    for proto in protos:
        if type(proto) is KVCache:
            factories.append(KVCache)
        elif type(proto) is RotatingKVCache:
            max_size, keep = proto.max_size, proto.keep
            factories.append(lambda m=max_size, k=keep: RotatingKVCache(max_size=m, keep=k))
        else:
            raise ModelError(f"cache kind {type(proto).__name__} is not supported by the ring")
    return factories
