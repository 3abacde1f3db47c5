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

import copy
import functools
import hashlib
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache
from mlx_lm.utils import load_config, load_model, maybe_set_recommended_wired_limit

from .admission import KvCost

# The mlx-lm architectures (module names) a ring runs, bit for bit as one process does:
# decided by tests/test_archs.py, which splits a tiny model of each at every cut and
# compares with single-process mlx-lm (and checks that this list is what passed).
# Another architecture is refused at start, naming this list.
SUPPORTED_ARCHITECTURES = frozenset(
    {
        "llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "mistral3",  # dense
        "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss", "minimax",  # MoE
        "qwen3_next",  # hybrid: linear and full attention, MoE
    }
)  # fmt: skip
# Weight digests read this many slices of this many bytes from each weight file.
SAMPLES_PER_FILE = 16
SAMPLE_BYTES = 16 * 1024

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
# Checkpoint keys of parts of a multimodal model that are not its text decoder.
_NOT_THE_DECODER = ("vision_tower", "vision_model", "multi_modal_projector", "mm_projector", "audio_tower")

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


def text_config(config: dict) -> dict:
    """The decoder's settings: a multimodal checkpoint keeps them under ``text_config``."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def model_info(path_or_repo: str) -> ModelInfo:
    """Read a model's config and check that it can be split into a ring."""
    path = resolve_model_path(path_or_repo)
    config = load_config(path)
    model_type = config.get("model_type", "?")
    module = _model_module(config)
    if module not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"model_type {model_type!r} (mlx_lm.models.{module}) is not supported by the ring; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))} (README.md lists the models each covers)"
        )
    text = text_config(config)
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        if not isinstance(text.get(key), int) or text[key] <= 0:
            raise ModelError(f"{path / 'config.json'}: {key} must be a positive integer")
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(weights_digest(path).encode())
    return ModelInfo(
        path=path,
        config=config,
        model_type=model_type,
        num_layers=text["num_hidden_layers"],
        hidden_size=text["hidden_size"],
        vocab_size=text["vocab_size"],
        context_length=int(text.get("max_position_embeddings") or 4096),
        fingerprint=digest.hexdigest()[:16],
        weights=weight_bytes(path, text["num_hidden_layers"]),
    )


def weights_digest(path: Path) -> str:
    """What identifies the weights, so that a fine-tune and its base model never share a ring.

    A Hugging Face snapshot is named by its commit, which fixes every file (and a
    node that fetched only its own layers' files still knows it). A local directory:
    each weight file's name, size and header, and SAMPLES_PER_FILE slices of its
    data spread over the file: a fine-tune changes nearly every weight, and reading
    a few hundred KiB per file keeps this instant on a model of hundreds of GB.
    """
    parts = path.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return f"hub:{parts[-3]}@{parts[-1]}"
    h = hashlib.sha256()
    for file in sorted(path.glob("model*.safetensors")):
        size = file.stat().st_size
        h.update(f"{file.name}:{size}:".encode())
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > _MAX_SAFETENSORS_HEADER_BYTES:
                raise ModelError(f"{file}: safetensors header of {n} bytes is implausible")
            h.update(f.read(n))
            data = 8 + n
            for i in range(SAMPLES_PER_FILE):
                f.seek(data + (size - data) * i // SAMPLES_PER_FILE)
                h.update(f.read(SAMPLE_BYTES))
    return "local:" + h.hexdigest()


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
            if any(part in key for part in _NOT_THE_DECODER):
                continue  # a multimodal checkpoint's vision tower: the ring serves the text path
            m = _LAYER_KEY.search(key)
            if m is not None:
                if int(m.group(1)) < num_layers:  # extra layers (MTP heads) are dropped on load
                    layers[int(m.group(1))] += size
            elif "embed_tokens" in key:
                parts["embed"] += size
            elif "lm_head" in key:
                parts["head"] += size
            else:  # the final norm, and whatever else the last stage runs after the layers
                parts["norm"] += size
    return WeightBytes(tuple(layers), parts["embed"], parts["norm"], parts["head"])


def _model_module(config: dict) -> str:
    from mlx_lm.utils import _get_classes

    try:
        model_class, _ = _get_classes(config)
    except ValueError as e:
        raise ModelError(str(e)) from e
    return model_class.__module__.rsplit(".", 1)[-1]


def _safetensors_header(file: Path, keep_metadata: bool = False) -> dict:
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_SAFETENSORS_HEADER_BYTES:
            raise ModelError(f"{file}: safetensors header of {n} bytes is implausible")
        header = json.loads(f.read(n))
    if not keep_metadata:
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
        if any(part in key for part in _NOT_THE_DECODER):
            continue
        m = _LAYER_KEY.search(key)
        if m is None or start <= int(m.group(1)) < end:
            files.add(file)
    return sorted(files)


class _StageOutput(Exception):
    """Raised by the last layer of a stage that is not the ring's last: its output is the stage's."""

    def __init__(self, value: mx.array):
        self.value = value


class _Wrapped(nn.Module):
    """One of the model's own layers, called through a wrapper; reads its attributes through too."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "layer" not in self:
                raise
            return getattr(self["layer"], name)

    def set_hidden(self, hidden: mx.array | None) -> None:
        # Not an attribute MLX tracks: it is no parameter of the model.
        object.__setattr__(self, "_hidden", hidden)


class _FirstLayer(_Wrapped):
    """The stage's first layer: it takes the hidden states the ring brought, not what the
    model's own code computed in front of it (embeddings, and whatever follows them)."""

    def __call__(self, x, *args, **kwargs):
        return self.layer(self._hidden, *args, **kwargs)


class _LastLayer(_Wrapped):
    """The stage's last layer when more stages follow: its output leaves the model's code there."""

    def __call__(self, *args, **kwargs):
        raise _StageOutput(self.layer(*args, **kwargs))


class _FirstAndLastLayer(_Wrapped):
    """A one-layer stage in the middle of the ring."""

    def __call__(self, x, *args, **kwargs):
        raise _StageOutput(self.layer(self._hidden, *args, **kwargs))


class _Absent(nn.Module):
    """A layer another stage holds, in its place in the list: the model's own code still counts
    absolute layer indices (sliding-window patterns, layer types, full-attention intervals)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        # Its plain attributes (use_sliding, is_linear, layer_idx, ...): the model's loop may read them.
        for k, v in vars(layer).items():
            if isinstance(v, (bool, int, float, str, type(None))) and not k.startswith("_"):
                object.__setattr__(self, k, v)

    def __call__(self, x, *args, **kwargs):
        return x


def _cache_kind(c: Any) -> tuple:
    """What makes two caches interchangeable for building a mask: their class and shape rules."""
    if isinstance(c, CacheList):
        return ("CacheList", tuple(_cache_kind(x) for x in c.caches))
    size = len(c.cache) if isinstance(c, ArraysCache) else None
    return (type(c).__name__, getattr(c, "max_size", None), getattr(c, "keep", None), size)


def _inner_model(model: nn.Module) -> tuple[str, nn.Module]:
    """The text decoder inside an mlx-lm Model (``model``, or ``language_model.model`` for a
    multimodal checkpoint's text path), and its parameter prefix."""
    for path in ("model", "language_model.model", "language_model", "transformer"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None) if isinstance(obj, nn.Module) else None
        if isinstance(obj, nn.Module) and isinstance(getattr(obj, "layers", None), list):
            return path + ".", obj
    raise ModelError(f"{type(model).__module__}: no decoder with a list of layers found in the model")


class Shard:
    """Layers [start, end) of a model, run by the model's own code, on this node's compute thread.

    The model is mlx-lm's own ``Model`` object, loaded lazily, with its layer list cut:
    the layers before ``start`` are stand-ins that keep every index where it was (a
    layer's absolute index decides its attention kind, window, mask), the layers after
    ``end`` are gone, the first kept layer takes the hidden states the ring brought (so
    whatever the model computes in front of it, embeddings and their scaling included,
    is not used and, MLX being lazy, not computed), and on every stage but the last the
    last kept layer ends the call. The last stage runs the rest of the model's own code:
    its final norm and head, soft-capping, tied embeddings. Masks are built by the model's
    own code from the caches it is given: in the places of the absent layers, the stage's
    own cache of the same kind, which holds the same positions.
    """

    def __init__(self, info: ModelInfo, start: int, end: int, model: nn.Module, protos: list, kept: list[tuple[str, mx.array]]):
        self.info = info
        self.start, self.end = start, end
        self.model = model
        self._protos = protos  # one empty cache per layer of the whole model, as the model makes them
        self._kept = kept  # (checkpoint name, array) of every parameter this stage materializes
        self.rotating_allowed = not hasattr(model, "make_cache")
        self.kv_cost = KvCost()  # measured at load
        _, inner = _inner_model(model)
        layers = list(inner.layers)
        first = None
        wrapped = []
        for i in range(start, end):
            layer = layers[i]
            head, tail = i == start and not self.is_first, i == end - 1 and not self.is_last
            if head and tail:
                layer = first = _FirstAndLastLayer(layer)
            elif head:
                layer = first = _FirstLayer(layer)
            elif tail:
                layer = _LastLayer(layer)
            wrapped.append(layer)
        inner.layers = [_Absent(layers[i]) for i in range(start)] + wrapped
        self._first = first
        # The kind of cache of every layer of the model, for the stand-ins of the absent ones.
        self._kinds = [_cache_kind(p) for p in protos]

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

        _wire_memory()
        # Lazy: mx.load maps the files and reads a tensor only when it is evaluated,
        # so the layers other stages hold are never read into memory.
        model, _ = load_model(path, lazy=True, strict=False)
        # The model's own caches, made before its layer list is cut (make_cache reads it).
        protos = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
        if len(protos) != info.num_layers:
            raise ModelError(f"the model makes {len(protos)} caches for {info.num_layers} layers")
        kept = _stage_parameters(model, info, start, end)
        _check_weights_present(path, files, kept, start, end)
        shard = cls(info, start, end, model, protos, kept)
        mx.eval([v for _, v in kept])
        shard.kv_cost = shard._measure_kv_cost()
        return shard

    def _measure_kv_cost(self) -> KvCost:
        """What a request's caches cost here, read off the stage's own caches after one position."""
        caches = self.make_cache()
        tokens = mx.zeros((1, 1), dtype=mx.int32)
        hidden = None if self.is_first else mx.zeros((1, 1, self.info.hidden_size), dtype=self._activation_dtype())
        self(tokens, hidden, caches)
        mx.eval([c.state for c in caches])
        cost = _kv_cost(caches)
        mx.clear_cache()
        return cost

    def _activation_dtype(self) -> mx.Dtype:
        # The hidden states are in the dtype of the model's norms (quantized models too).
        for name, v in self._kept:
            if "norm" in name and mx.issubdtype(v.dtype, mx.floating):
                return v.dtype
        return mx.float16

    def parameters(self) -> list[mx.array]:
        return [v for _, v in self._kept]

    def _named_parameters(self) -> list[tuple[str, mx.array]]:
        return list(self._kept)

    @property
    def parameter_bytes(self) -> int:
        return sum(v.nbytes for v in self.parameters())

    def make_cache(self, max_kv_size: int | None = None) -> list[Any]:
        """This stage's caches for one request, as mlx-lm's make_prompt_cache makes them."""
        if max_kv_size is not None and self.rotating_allowed:
            return [RotatingKVCache(max_size=max_kv_size, keep=4) for _ in range(self.start, self.end)]
        return [copy.deepcopy(p) for p in self._protos[self.start : self.end]]

    def _all_caches(self, cache: list[Any]) -> list[Any]:
        """A cache for every layer of the model, at its index: the stage's own, and for each absent
        layer a stand-in, the stage's own cache of the same kind (the model builds masks from
        whichever index it likes, and that one holds the same positions), else an empty one of
        that kind (then no layer of this stage uses the mask built from it)."""
        by_kind = {}
        for c in cache:
            by_kind.setdefault(_cache_kind(c), c)

        def stand_in(i: int) -> Any:
            c = by_kind.get(self._kinds[i])
            return c if c is not None else copy.deepcopy(self._protos[i])

        n = len(self._kinds)
        return [stand_in(i) for i in range(self.start)] + list(cache) + [stand_in(i) for i in range(self.end, n)]

    def __call__(self, tokens: mx.array, hidden: mx.array | None, cache: list[Any]) -> mx.array:
        """One step of the ring on this stage.

        ``tokens``: the step's token ids [B, L] (every stage gets them: some models use
        them beyond the embedding). ``hidden``: the previous stage's output [B, L, D]
        (None on the first stage). Returns this stage's hidden states, or on the last
        stage the model's logits.
        """
        if self._first is not None:
            self._first.set_hidden(hidden)
        try:
            return self.model(tokens, cache=self._all_caches(cache))
        except _StageOutput as out:
            return out.value
        finally:
            if self._first is not None:
                self._first.set_hidden(None)


@functools.cache
def _wire_memory() -> None:
    """On a Mac, wire MLX's memory up to the recommended working set, as mlx-lm's generate does,
    so a stage's weights are not paged out. (There is nothing to wire on the CPU backend.)"""
    if mx.metal.is_available():
        maybe_set_recommended_wired_limit()


def _kv_cost(caches: list[Any]) -> KvCost:
    """Add up what each cache holds after one position: per position where it grows with the
    context, per position up to its window where it rotates, as is where it is state."""
    per_token, windows, fixed, itemsize, limits = 0, {}, 0, 2, []
    for c in caches:
        for leaf in (c.caches if isinstance(c, CacheList) else [c]):
            if isinstance(leaf, RotatingKVCache):
                per = (leaf.keys.nbytes + leaf.values.nbytes) // leaf.keys.shape[2]
                windows[leaf.max_size] = windows.get(leaf.max_size, 0) + per
                limits.append(leaf.max_size)
            elif isinstance(leaf, KVCache):
                per_token += (leaf.keys.nbytes + leaf.values.nbytes) // leaf.keys.shape[2]
                itemsize = leaf.keys.dtype.size
            else:  # state that does not grow with the context (linear attention), nor trims
                fixed += leaf.nbytes
                limits.append(0)
    return KvCost(per_token, tuple((b, w) for w, b in sorted(windows.items())), fixed, itemsize, min(limits) if limits else None)


def _stage_parameters(model: nn.Module, info: ModelInfo, start: int, end: int) -> list[tuple[str, mx.array]]:
    """The parameters a stage materializes, by name: its layers; the embeddings on the first
    stage; everything else that is not a layer (final norm, head, tied embeddings) on the last.

    Anything else the model's own code touches loads on first use (it is lazy), so a stage
    never computes with weights it lacks; this list is what it reads up front and counts.
    """
    prefix, inner = _inner_model(model)
    layer_key = re.compile(re.escape(prefix) + r"layers\.(\d+)\.")
    params = tree_flatten(model.parameters())
    first, last = start == 0, end == info.num_layers
    untied = any("lm_head" in name for name, _ in params)
    kept = []
    for name, value in params:
        m = layer_key.match(name)
        if m is not None:
            if start <= int(m.group(1)) < end:
                kept.append((name, value))
        elif "embed_tokens" in name or name.startswith(prefix + "embed"):
            if first or (last and not untied):
                kept.append((name, value))
        elif last:
            kept.append((name, value))
    return kept


def _check_weights_present(path: Path, files: list[str] | None, kept: list[tuple[str, mx.array]], start: int, end: int) -> None:
    """strict=False lets a stage load with only its own files present; then a missing tensor
    would silently stay randomly initialized. So: in an MLX-format checkpoint (what mlx-lm
    converts to, names as the model has them) every kept name must be there; in another
    (the loader renames and stacks, e.g. experts) every kept layer must have weights."""
    names = files if files is not None else [p.name for p in sorted(path.glob("model*.safetensors"))]
    if not names:
        raise ModelError(f"no model*.safetensors in {path}")
    present: set[str] = set()
    mlx_format = True
    for name in names:
        header = _safetensors_header(path / name, keep_metadata=True)
        mlx_format &= (header.pop("__metadata__", None) or {}).get("format") == "mlx"
        present |= set(header)
    if mlx_format:
        missing = [k for k, _ in kept if k not in present]
    else:
        layers = {int(m.group(1)) for k in present if (m := _LAYER_KEY.search(k))}
        missing = [f"layer {i}" for i in range(start, end) if i not in layers]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelError(
            f"{path}: {len(missing)} weights of layers [{start}, {end}) are missing from the "
            f"checkpoint ({shown}); is the download complete?"
        )
