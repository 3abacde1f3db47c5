"""Run one contiguous layer range of an mlx-lm model: the model's own code, cut at the stage's bounds.

A node of the ring holds layers [start, end) of the model, plus the token
embeddings when it is the first stage and the final norm and LM head when it is
the last (with tied embeddings the last stage also holds ``embed_tokens``, for
``as_linear``). Loading goes through mlx-lm's own loader lazily and then
materializes only the parameters this stage keeps, so a node's memory is its
share of the model, not the whole of it. A GGUF file is read the same way through
``gguf/reader.py``: the model built from the file's config, then only the stage's tensors
read out of the file.

The forward pass is mlx-lm's own ``Model.__call__`` with the layer list cut
(``Shard``): same modules, same masks, same cache objects, whatever the
architecture, so a ring computes bit for bit what a single process computes
(``tests/stage/test_archs.py`` shows it per architecture). It ignores sampling
(``sampling.py``), the network (``stage/runner.py``), and what a model on disk is
(``checkpoint.py``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache, CacheList, KVCache, RotatingKVCache
from mlx_lm.utils import load_model, maybe_set_recommended_wired_limit

from ringd.ring.kvcost import KvCost
from ringd.models.checkpoint import (
    NON_WEIGHT_PATTERNS,
    ModelInfo,
    check_weights_present,
    stage_keeps,
    weight_files_for,
    weight_map,
)
from ringd.models.errors import ModelError
from ringd.models.gguf.reader import GgufFile
from ringd.models.progress import LOAD, LoadProgress
from ringd.models.source import model_info, resolve_model_path
from ringd.stage.sessions import mergeable_kind
from ringd.stage.vlmtext import VlmText, plain_positions

# A stage's parameters are read in groups of about this many bytes (a group ends with
# the tensor that reaches it): progress then moves within a multi-GB weight file, and
# a group is still large enough that its reads overlap as in one mx.eval of them all.
LOAD_GROUP_BYTES = 256 * 2**20
# A layer's number in a parameter or checkpoint key.
_LAYER_NUMBER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


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
        # Its rotary embedding, which holds no weights: Qwen-VL's decoder computes every layer's
        # from its first layer's, whichever stage holds that.
        rotary = getattr(getattr(layer, "self_attn", None), "rotary_emb", None)
        if rotary is not None:
            object.__setattr__(self, "self_attn", _Rotary(rotary))

    def __call__(self, x, *args, **kwargs):
        return x


class _Rotary:
    """What an absent layer's attention shows of itself: its rotary embedding."""

    def __init__(self, rotary_emb: nn.Module):
        self.rotary_emb = rotary_emb


# How far one row's output of a batched step may be from the same row's alone, relative to
# its norm, for a stage to batch: rounding (bfloat16: 2**-8 per value) stays far below it, a
# model whose code ignores the batch's left padding goes far above it.
BATCH_AGREEMENT = 0.05


def _cache_kind(c: Any) -> tuple:
    """What makes two caches interchangeable for building a mask: their class and shape rules."""
    if isinstance(c, CacheList):
        return ("CacheList", tuple(_cache_kind(x) for x in c.caches))
    if isinstance(c, BatchKVCache):  # several requests' KVCaches merged (sessions.py): masks as theirs
        return ("KVCache", None, None, None)
    if isinstance(c, BatchRotatingKVCache):  # their sliding windows merged (keep 0: sessions.py)
        return ("RotatingKVCache", c.max_size, 0, None)
    size = len(c.cache) if isinstance(c, ArraysCache) else None
    return (type(c).__name__, getattr(c, "max_size", None), getattr(c, "keep", None), size)


def inner_model(model: nn.Module) -> tuple[str, nn.Module]:
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
        # A decoder that places positions by three numbers (vlmtext.py): each call is given them.
        self.three_axis = isinstance(model, VlmText)
        self.kv_cost = KvCost()  # measured at load
        self.batchable = False  # decode rows of several requests in one pass: tried at load
        _, inner = inner_model(model)
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
    def load(cls, path_or_repo: str, start: int, end: int, progress: LoadProgress | None = None, group: Any = None) -> "Shard":
        """Layers [start, end) of a model directory, Hugging Face repo id or GGUF file, read into memory.

        ``progress`` hears how it goes: the download of this stage's weight files when a Hub
        model lacks them, then the reading of its parameters, file by file. ``group``: a
        tensor-parallel group (``tensorgroup.TensorGroup``) this node is a member of; the
        model's own ``shard()`` cuts every layer to this member's slice before anything is read.
        """
        progress = progress if progress is not None else LoadProgress(start, end)
        info = model_info(path_or_repo)
        if not (0 <= start < end <= info.num_layers):
            raise ModelError(
                f"layer range [{start}, {end}) is not inside the model's {info.num_layers} layers"
            )
        _wire_memory()
        if info.is_gguf:
            return cls._load_gguf(info, start, end, progress, group)
        path = info.path
        files = weight_files_for(path, start, end)
        if _weights_absent(path, files):
            # A Hub model: fetch this stage's files only (without an index, the one weight file).
            path = resolve_model_path(path_or_repo, NON_WEIGHT_PATTERNS + (files or ["model*.safetensors"]), progress)
            absent = [f for f in files or () if not (path / f).exists()]
            if absent:
                raise ModelError(
                    f"{path}: weight files {', '.join(absent)} holding layers [{start}, {end}) are "
                    "missing; is the download complete?"
                )

        # Lazy: mx.load maps the files and reads a tensor only when it is evaluated,
        # so the layers other stages hold are never read into memory.
        if info.three_axis:
            model = VlmText.load(path)
        else:
            model, _ = load_model(path, lazy=True, strict=False)
        _cut_for(model, info, group)
        protos = _protos(model, info)
        kept = _stage_parameters(model, info, start, end)
        check_weights_present(path, files, kept, start, end)
        shard = cls(info, start, end, model, protos, kept)
        # A member's slice is read as its whole tensors, then cut: groups of as many whole bytes.
        _materialize(path, kept, progress, LOAD_GROUP_BYTES // (group.size() if group is not None else 1))
        shard._test(group)
        return shard

    @classmethod
    def _load_gguf(cls, info: ModelInfo, start: int, end: int, progress: LoadProgress, group: Any = None) -> "Shard":
        """Layers [start, end) of a GGUF file: the model built from its config, and only the stage's
        tensors read from the file (each memory-mapped, converted, unmapped); a group member's
        slices of them are cut after reading (a GGUF tensor is read whole)."""
        source = GgufFile.open(info.path)
        model = source.build_model()
        protos = _protos(model, info)
        names = [name for name, _ in _stage_parameters(model, info, start, end)]
        tensors = {source.source(n)[0] for n in names}
        file = info.path.name
        progress.begin(LOAD, {file: sum(t.mlx_bytes for t in tensors)})
        progress.start_file(file)
        kept = source.read(names, on_tensor=lambda t: progress.advance(file, t.mlx_bytes))
        model.load_weights(kept, strict=False)
        if info.three_axis and info.mmproj is not None:
            # A decoder that places positions by three numbers, and its projector: mlx-vlm's language
            # model computes it (vlmtext.py), with the same tensors under its names.
            model = VlmText.of(info)
            kept = [("language_model." + name, v) for name, v in kept]
            model.load_weights(kept, strict=False)
            protos = _protos(model, info)
        if group is not None:
            _cut_for(model, info, group)
            kept = _stage_parameters(model, info, start, end)
            mx.eval([v for _, v in kept])
        progress.finish_file(file)
        progress.end()
        shard = cls(info, start, end, model, protos, kept)
        shard._test(group)
        return shard

    def _test(self, group: Any) -> None:
        """Measure what a request's caches cost here and whether rows batch: on a tensor-parallel
        group's member, each on its own slice, with no all-reduce (``TensorGroup.alone``): the
        caches' sizes and the batch's masks are the slice's, whatever the others hold."""
        with group.alone() if group is not None else contextlib.nullcontext():
            self.kv_cost = self._measure_kv_cost()
            self.batchable = self._batches_right()

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

    def _batches_right(self) -> bool:
        """Whether this stage may run several requests' decode rows as one batch (sessions.py).

        Only caches whose kind merges (``sessions.mergeable_kind``) are merged, and not every
        model's code takes batched caches (gemma2's soft-capped attention does not broadcast
        their masks; others might ignore the left padding): so two requests of different
        lengths take one step batched and one step each alone, here at load, and the stage
        batches only if the two agree.
        """
        if not all(mergeable_kind(c) for c in self.make_cache()):
            return False
        dtype = self._activation_dtype()

        def hidden(n: int, seed: int) -> mx.array | None:
            return None if self.is_first else mx.random.normal((1, n, self.info.hidden_size), key=mx.random.key(seed)).astype(dtype)

        prompts = [[1, 2, 3], [4, 5]]
        caches = []
        for i, ids in enumerate(prompts):
            cache = self.make_cache()
            self(mx.array(ids, dtype=mx.int32)[None], hidden(len(ids), i), cache)
            mx.eval([c.state for c in cache])
            caches.append(cache)
        steps = [hidden(1, 10 + i) for i in range(len(prompts))]
        tokens = mx.array([[6], [7]], dtype=mx.int32)
        try:
            merged = [type(layer[0]).merge(list(layer)) for layer in zip(*caches)]
            together = self(tokens, None if self.is_first else mx.concatenate(steps), merged).astype(mx.float32)
            mx.eval(together)
        except Exception:  # the model's code cannot take batched caches
            return False
        finally:
            mx.clear_cache()
        for i, cache in enumerate(caches):
            alone = self(tokens[i : i + 1], steps[i], cache).astype(mx.float32)
            gap = mx.linalg.norm(together[i] - alone[0]) / mx.maximum(mx.linalg.norm(alone[0]), 1e-6)
            if gap.item() > BATCH_AGREEMENT:
                return False
        return True

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

    def __call__(
        self,
        tokens: mx.array,
        hidden: mx.array | None,
        cache: list[Any],
        head: bool = True,
        embeddings: mx.array | None = None,
        positions: mx.array | None = None,
    ) -> mx.array:
        """One step of the ring on this stage.

        ``tokens``: the step's token ids [B, L] (every stage gets them: some models use
        them beyond the embedding). ``hidden``: the previous stage's output [B, L, D]
        (None on the first stage). Returns this stage's hidden states, or on the last
        stage the model's logits; without the ``head``, the last stage's final hidden
        states (the decoder's own output, its norm applied: what an embedding pools).
        ``embeddings``: on the first stage, the input embeddings [B, L, D] to start from instead
        of the tokens' (a prompt's images in their tokens' places, ``vision.py``); the model's
        own code goes on from them as from its own (Gemma's scaling included). ``positions``: for a
        three-axis decoder, each position's three numbers [3, B, L]; by default, text's (each row's
        cache offset on), which is what every other decoder computes from its caches itself.
        """
        if self.three_axis:
            offsets = cache[0].offset if cache else 0
            self.model.positions = positions if positions is not None else plain_positions(offsets, tokens.shape[1])
        if self._first is not None:
            self._first.set_hidden(hidden)
        try:
            model = self.model if head or not self.is_last else inner_model(self.model)[1]
            if embeddings is not None:
                return model(tokens, cache=self._all_caches(cache), input_embeddings=embeddings)
            return model(tokens, cache=self._all_caches(cache))
        except _StageOutput as out:
            return out.value
        finally:
            if self._first is not None:
                self._first.set_hidden(None)
            if self.three_axis:
                self.model.positions = None


@functools.cache
def _wire_memory() -> None:
    """On a Mac, wire MLX's memory up to the recommended working set, as mlx-lm's generate does,
    so a stage's weights are not paged out. (There is nothing to wire on the CPU backend.)"""
    if mx.metal.is_available():
        maybe_set_recommended_wired_limit()


def tensor_parallel_refusal(info: ModelInfo, size: int) -> str | None:
    """Why the model cannot be split across tensor-parallel groups of ``size``, or None: mlx-lm's
    own ``Model.shard`` does the cutting, not every architecture has one, and it gives each
    member whole attention heads."""
    from mlx_lm.utils import _get_classes

    try:
        model_class, _ = _get_classes({"model_type": info.model_type})
    except ValueError as e:
        return str(e)
    if not hasattr(model_class, "shard"):
        return f"mlx-lm has no tensor parallelism for {info.model_type} (its Model has no shard()); serve it with tensor_parallel: 1"
    config = info.config.get("text_config", info.config)
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = config.get(key)
        if isinstance(heads, int) and heads % size:
            return f"its {heads} {'attention' if key == 'num_attention_heads' else 'key/value'} heads do not split into groups of {size}"
    return None


def _cut_for(model: nn.Module, info: ModelInfo, group: Any) -> None:
    """Cut every layer of ``model`` (lazily: nothing is read) to this member's slice, by mlx-lm's
    own ``shard()``; nothing when the node is not a group's member."""
    if group is None:
        return
    if not hasattr(model, "shard"):
        raise ModelError(f"mlx-lm has no tensor parallelism for {info.model_type} (its Model has no shard()); serve it with tensor_parallel: 1")
    try:
        model.shard(group)
    except ValueError as e:  # dimensions the group's size does not divide
        raise ModelError(f"{info.model_type} cannot be split {group.size()} ways: {e}") from None


def _protos(model: nn.Module, info: ModelInfo) -> list:
    """The model's own caches, one per layer, made before its layer list is cut (make_cache reads it)."""
    protos = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    if len(protos) != info.num_layers:
        raise ModelError(f"the model makes {len(protos)} caches for {info.num_layers} layers")
    return protos


def _weights_absent(path: Path, files: list[str] | None) -> bool:
    """Whether weight files this stage needs are missing from ``path`` (``files`` None: the model
    has no index, and its one weight file is needed)."""
    if files is None:
        return not any(path.glob("model*.safetensors"))
    return not all((path / f).exists() for f in files)


def _materialize(path: Path, kept: list[tuple[str, mx.array]], progress: LoadProgress, group_bytes: int = LOAD_GROUP_BYTES) -> None:
    """Read the stage's parameters into memory, file by file, in groups of about
    ``group_bytes``, telling ``progress`` each group's bytes (one ``mx.eval`` of them all
    reads the same values; in groups, the reading can be counted)."""
    by_file = _by_source_file(path, kept)
    progress.begin(LOAD, {file: sum(v.nbytes for v in arrays) for file, arrays in by_file.items()})
    for file, arrays in by_file.items():
        progress.start_file(file)
        group, size = [], 0
        for v in arrays:
            group.append(v)
            size += v.nbytes
            if size >= group_bytes:
                mx.eval(group)
                progress.advance(file, size)
                group, size = [], 0
        if group:
            mx.eval(group)
            progress.advance(file, size)
        progress.finish_file(file)
    progress.end()


def _by_source_file(path: Path, kept: list[tuple[str, mx.array]]) -> dict[str, list[mx.array]]:
    """The kept parameters by the weight file they are read from, in file order.

    A checkpoint in MLX format names them as the model does. In another, mlx-lm's
    sanitize renames or stacks (experts), so a name the checkpoint lacks is counted
    with the first file holding its layer, and a non-layer one with the last file.
    """
    source = weight_map(path)
    files = sorted(set(source.values()))
    layer_file: dict[int, str] = {}
    for key, file in sorted(source.items(), key=lambda kv: kv[1]):
        m = _LAYER_NUMBER.search(key)
        if m is not None:
            layer_file.setdefault(int(m.group(1)), file)
    out: dict[str, list[mx.array]] = {}
    for name, v in kept:
        file = source.get(name)
        if file is None:
            m = _LAYER_NUMBER.search(name)
            file = layer_file.get(int(m.group(1))) if m is not None else None
            file = file or (files[-1] if files else "weights")
        out.setdefault(file, []).append(v)
    return dict(sorted(out.items()))


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
    """The parameters a stage materializes, by name (``checkpoint.stage_keeps``): its layers; the
    embeddings on the first stage; everything else that is not a layer (final norm, head, tied
    embeddings) on the last.

    Anything else the model's own code touches loads on first use (it is lazy), so a stage
    never computes with weights it lacks; this list is what it reads up front and counts.
    """
    params = tree_flatten(model.parameters())
    untied = any("lm_head" in name for name, _ in params)
    return [(name, value) for name, value in params if stage_keeps(name, start, end, info.num_layers, untied)]
