"""A checkpoint on disk, read: what the model is, what its weights cost per layer, which files hold what.

Everything a node and the leader need to know about a model before (or without)
loading it, as a ``ModelInfo``: the config and the architecture (and whether the
ring supports it), the bytes of each layer and of the embeddings and head from the
safetensors headers (each checked against its file; no tensor is read), which
weight files a stage holding some layers needs (a Hugging Face repo id's files are
fetched stage by stage) and which weights it keeps, and the tokenizer.

It ignores where the model comes from (``source.py`` finds the directory, the Hub
snapshot, the GGUF file or the Ollama blob a user names, and makes its
``ModelInfo``), what identifies it (``fingerprint.py``), GGUF's own format
(``gguf/reader.py``), and running a stage (``shard.py``).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from mlx_lm.utils import load_config

from ringd.base.device import default_cache_dir
from ringd.models.defaults import ModelDefaults
from ringd.models.errors import ModelError, ModelFileError
from ringd.models.gguf.reader import GgufFile

# The mlx-lm architectures (module names) a ring runs, bit for bit as one process does:
# decided by tests/stage/test_archs.py, which splits a tiny model of each at every cut and
# compares with single-process mlx-lm (and checks that this list is what passed).
# Another architecture is refused at start, naming this list.
SUPPORTED_ARCHITECTURES = frozenset(
    {
        "llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "mistral3",  # dense
        "gemma3",  # multimodal: mlx-lm's text path; stage/vision.py sees its images
        "qwen2_vl",  # multimodal (Qwen2-VL, Qwen2.5-VL): mlx-vlm's language model (stage/vlmtext.py)
        "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss", "minimax",  # MoE
        "qwen3_next",  # hybrid: linear and full attention, MoE
    }
)  # fmt: skip

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
# A decoder's embeddings, whatever the model calls them beyond "embed_tokens" ("embed_in", "embeddings").
_EMBED_KEY = re.compile(r"(?:^|\.)embed")
# Checkpoint keys of parts of a multimodal model that are not its text decoder.
_NOT_THE_DECODER = ("vision_tower", "vision_model", "multi_modal_projector", "mm_projector", "audio_tower")

# safetensors: an 8-byte little-endian header length, then a JSON header.
# A header over this size is not a safetensors file we should trust.
_MAX_SAFETENSORS_HEADER_BYTES = 100 * 1024 * 1024
# Bytes per element of the safetensors dtypes, to check each tensor's byte range
# against its shape; a dtype not listed here is left to the loader.
_SAFETENSORS_ITEM_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip


@dataclass(frozen=True)
class WeightBytes:
    """Bytes of the checkpoint's tensors, by the part of the model they belong to."""

    layers: tuple[int, ...]
    embed: int
    norm: int
    head: int  # 0 with tied embeddings: the last stage then holds `embed` again
    vision: int = 0  # a model that sees: its vision tower and projector, which the first stage runs

    def stage(self, start: int, end: int) -> int:
        """What a stage holding layers [start, end) materializes."""
        n = sum(self.layers[start:end])
        last = end == len(self.layers)
        if start == 0:
            n += self.embed + self.vision
        if last:
            n += self.norm + (self.head or (self.embed if start != 0 else 0))
        return n


@dataclass(frozen=True)
class ModelInfo:
    """What every node and the leader need to know about a model without loading it."""

    path: Path  # the mlx-lm directory, or the GGUF file
    config: dict
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    context_length: int
    fingerprint: str
    weights: WeightBytes
    label: str = ""  # what the API calls the model unless told otherwise
    # What requests leaving a field unset get (an Ollama model's params and system layers).
    defaults: ModelDefaults = field(default_factory=ModelDefaults)
    # A Jinja chat template for a GGUF without one (an Ollama model's Go template, translated).
    chat_template: str | None = None
    # A GGUF model's projector file (llama.cpp's mmproj, beside it): its vision tower (gguf/mmproj.py).
    mmproj: Path | None = None

    @property
    def name(self) -> str:
        return self.label or self.path.name

    @property
    def is_gguf(self) -> bool:
        return self.path.is_file()

    @property
    def three_axis(self) -> bool:
        """Whether the decoder places a position by three numbers (Qwen-VL's multimodal RoPE): its
        stages run mlx-vlm's language model (``stage/vlmtext.py``)."""
        scaling = text_config(self.config).get("rope_scaling")
        return isinstance(scaling, dict) and "mrope_section" in scaling

    @property
    def pooling(self) -> str:
        """How an embedding pools the model's final hidden states: as its GGUF file declares
        (``gguf_archs.GGUF_POOLINGS``), else the mean over the input (a generative model declares none)."""
        return self.config.get("pooling") or "mean"

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


def weight_map(path: Path) -> dict[str, str]:
    """Checkpoint key -> the weight file holding it: from the index, else from the headers of the
    model*.safetensors files present (a checkpoint in one file needs no index)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return _index_weight_map(index)
    return {key: file.name for file in sorted(path.glob("model*.safetensors")) for key in safetensors_keys(file)}


def text_config(config: dict) -> dict:
    """The decoder's settings: a multimodal checkpoint keeps them under ``text_config``."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def check_supported(config: dict, where: Path) -> dict:
    """The decoder's settings, once the ring is known to run the model's architecture."""
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
            raise ModelError(f"{where}: {key} must be a positive integer")
    return text


def load_tokenizer(info: ModelInfo, cache_dir: Path | None = None):
    """mlx-lm's TokenizerWrapper for the model: from its directory, or for a GGUF file from the
    config and tokenizer files its metadata makes (written once under ``cache_dir``)."""
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    # Every end token the config names, as mlx-lm's own load passes them (a chat model may
    # end a turn with one token and the text with another).
    eos = info.config.get("eos_token_id")
    if not info.is_gguf:
        return mlx_load_tokenizer(info.path, eos_token_ids=eos)
    # The sidecar is the GGUF's own (cached by its content); a template from elsewhere goes in here.
    extra = {"chat_template": info.chat_template} if info.chat_template is not None else None
    return mlx_load_tokenizer(GgufFile.open(info.path).sidecar(cache_dir or default_cache_dir()), extra, eos_token_ids=eos)


def weight_bytes(path: Path, num_layers: int) -> WeightBytes:
    """Tensor sizes from the safetensors headers (no tensor is read).

    A Hub model whose weight files are not here yet has only its index: its
    total is spread evenly over the layers, which is what placement needs.
    """
    files = sorted(path.glob("model*.safetensors"))
    layers = [0] * num_layers
    parts = {"embed": 0, "norm": 0, "head": 0, "vision": 0}
    if not files:
        index = path / "model.safetensors.index.json"
        metadata = _json_file(index).get("metadata") if index.is_file() else None
        total = metadata.get("total_size", 0) if isinstance(metadata, dict) else 0
        if not isinstance(total, int) or total < 0:
            raise ModelFileError(f"{index}: metadata.total_size must be a byte count, got {total!r:.40}")
        return WeightBytes(tuple([total // max(num_layers, 1)] * num_layers), 0, 0, 0)
    for file in files:
        for key, size in _safetensors_sizes(file).items():
            if any(part in key for part in _NOT_THE_DECODER):
                parts["vision"] += size  # a multimodal checkpoint's vision tower: the first stage runs it
                continue
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
    return WeightBytes(tuple(layers), parts["embed"], parts["norm"], parts["head"], parts["vision"])


def _model_module(config: dict) -> str:
    from mlx_lm.utils import _get_classes

    try:
        model_class, _ = _get_classes(config)
    except ValueError as e:
        raise ModelError(str(e)) from e
    return model_class.__module__.rsplit(".", 1)[-1]


def safetensors_header_bytes(f, file: Path, size: int) -> bytes:
    """The JSON header of the safetensors file open as ``f`` (``size`` bytes), its length checked first."""
    head = f.read(8)
    if len(head) < 8:
        raise ModelFileError(f"{file}: not a safetensors file: {size} bytes, too short for a header; fetch or copy it again")
    (n,) = struct.unpack("<Q", head)
    if n > min(_MAX_SAFETENSORS_HEADER_BYTES, size - 8):
        raise ModelFileError(
            f"{file}: corrupt safetensors file: it declares a header of {n} bytes in a file of {size} bytes; fetch or copy it again"
        )
    return f.read(n)


def _safetensors_header(file: Path, keep_metadata: bool = False) -> dict:
    """A safetensors file's header, checked against the file: every tensor's bytes lie within it.

    mlx reads a tensor only when it is evaluated, so a file cut short or a header
    that does not parse would otherwise fail deep in a stage's load, as a traceback.
    """
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw = safetensors_header_bytes(f, file, size)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(f"{file}: corrupt safetensors file: its header is not JSON ({e}); fetch or copy it again") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{file}: corrupt safetensors file: its header is not a JSON object; fetch or copy it again")
    data = size - 8 - len(raw)  # bytes of tensor data the file holds
    end = 0  # bytes of tensor data the header describes
    for name, t in header.items():
        if name == "__metadata__":
            continue
        offsets = t.get("data_offsets") if isinstance(t, dict) else None
        shape = t.get("shape") if isinstance(t, dict) else None
        if not (
            isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1]
            and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape) and isinstance(t.get("dtype"), str)
        ):  # fmt: skip
            raise ModelFileError(f"{file}: corrupt safetensors file: tensor {name!r:.120} has no valid dtype, shape and data_offsets; fetch or copy it again")
        item = _SAFETENSORS_ITEM_BYTES.get(t["dtype"])
        if item is not None and offsets[1] - offsets[0] != math.prod(shape) * item:
            raise ModelFileError(
                f"{file}: corrupt safetensors file: tensor {name!r:.120} of shape {shape} and dtype {t['dtype']} "
                f"is said to take {offsets[1] - offsets[0]} bytes; fetch or copy it again"
            )
        end = max(end, offsets[1])
    if end > data:
        raise ModelFileError(
            f"{file}: truncated: its header describes {end} bytes of tensors, the file holds {data} "
            f"({size} bytes in all); is the download or copy complete? Fetch or copy it again"
        )
    if not keep_metadata:
        header.pop("__metadata__", None)
    return header


def _json_file(file: Path) -> dict:
    """A JSON object from a model's file, or a ModelFileError naming the file."""
    try:
        value = json.loads(file.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(f"{file}: not valid JSON ({e}); fetch or copy the model again") from None
    if not isinstance(value, dict):
        raise ModelFileError(f"{file}: not a JSON object; fetch or copy the model again")
    return value


def _index_weight_map(index: Path) -> dict[str, str]:
    weight_map = _json_file(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelFileError(f"{index}: weight_map must be an object naming a file for each tensor; fetch or copy the model again")
    return weight_map


def read_config(path: Path) -> dict:
    """config.json as mlx-lm reads it (with generation_config.json's end tokens), checked first."""
    _json_file(path / "config.json")  # a ModelFileError naming the file, not mlx-lm's traceback
    return load_config(path)


def safetensors_keys(file: Path) -> set[str]:
    """The tensor names in a safetensors file, read from its header only."""
    return set(_safetensors_header(file))


def _safetensors_sizes(file: Path) -> dict[str, int]:
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in _safetensors_header(file).items()}


def weight_files_for(path: Path, start: int, end: int) -> list[str] | None:
    """The weight files holding layers [start, end) and the non-layer weights.

    None when the model has no index (a single file, fetched whole). Every stage
    takes the non-layer files: they are small next to the layers, and which of
    embeddings, norm and head a stage needs is decided after loading. A multimodal
    model's vision tower and projector go to the first stage, which runs them.
    """
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return None
    weight_map = _index_weight_map(index)
    files = set()
    for key, file in weight_map.items():
        if any(part in key for part in _NOT_THE_DECODER):
            if start == 0:
                files.add(file)
            continue
        m = _LAYER_KEY.search(key)
        if m is None or start <= int(m.group(1)) < end:
            files.add(file)
    return sorted(files)


def weights_complete(path: Path) -> bool:
    """Whether every weight file of the checkpoint at ``path`` is here (a GGUF file: itself). A
    node that fetched only its own stage's files from the Hub does not hold the model whole."""
    if path.is_file():
        return True
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return any(path.glob("model*.safetensors"))
    try:
        needed = set(_index_weight_map(index).values())
    except ModelFileError:
        return False
    return all((path / name).is_file() for name in needed)


def stage_keeps(key: str, start: int, end: int, num_layers: int, untied: bool) -> bool:
    """Whether the stage holding layers [start, end) of ``num_layers`` takes the weight ``key``
    (a model parameter's name, or a checkpoint's, which in MLX format are the same): its layers;
    the embeddings on the first stage, and on the last when the head is tied to them
    (``untied``: the model has an ``lm_head`` of its own); everything else of the decoder that is
    not a layer (final norm, head) on the last. One rule for what a stage reads (shard.py) and
    what it fetches from peers (peers.py)."""
    if any(part in key for part in _NOT_THE_DECODER):
        return False
    m = _LAYER_KEY.search(key)
    if m is not None:
        return start <= int(m.group(1)) < end
    first, last = start == 0, end == num_layers
    if "embed_tokens" in key or _EMBED_KEY.search(key):
        return first or (last and not untied)
    return last


def check_weights_present(path: Path, files: list[str] | None, kept: list[tuple[str, object]], start: int, end: int) -> None:
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
