"""A GGUF file (llama.cpp's format) served as an mlx-lm checkpoint, with no conversion step.

People keep their models as GGUF files (Ollama, LM Studio, llama.cpp). This reads
one as mlx-lm would read the same model converted: the metadata becomes mlx-lm's
``config.json`` (architecture, sizes, RoPE), GGUF tensor names become mlx-lm's
parameter names (through gguf-py's own ``TensorNameMap``), and each tensor becomes
the MLX array(s) mlx-lm's model code computes with:

- F32, F16 and BF16 tensors as they are;
- quantized blocks as MLX's quantized arrays, groups of 32 (``gguf/blocks.py``):
  Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and MXFP4 packed as they are, Q3_K,
  IQ4_NL and IQ4_XS widened to 8 bits, all exactly gguf-py's dequantized values
  (Q4_0, Q4_1 and Q8_0 bit for bit what ``mx.load`` makes of the same file,
  ``tests/models/test_gguf.py``); Q6_K and Q2_K, whose scales cover 16 weights,
  requantized to 8 bits with a measured error. No weight is kept dequantized;
- llama-family files store Q and K for the interleaved RoPE, which mlx-lm's llama
  computes as is with ``rope_traditional: true``;
- a family's tensors that mlx-lm names its own way (DeepSeek-V3's ``embed_q`` for
  llama.cpp's ``attn_k_b``, gpt-oss's sinks, Mixtral's and MiniMax's stacked
  ``w1``/``w2``/``w3``) are found through ``Arch.renames`` (``gguf/archs.py``), each tensor
  still read as it is;
- a parameter llama.cpp's converter stores otherwise (Qwen3-Next's in_proj_qkvz split in
  two, its A_log as -exp(A_log)) is made from the file's tensors as ``Arch.derived`` says:
  whole rows moved and joined (exact for quantized rows, which must share a type), or a
  float tensor's values computed with; anything else is refused with the tensor's name;
- a float tensor a family stores otherwise (Gemma's norms stored plus one) is undone as
  ``Arch.fix`` says; an early MoE file's experts, one tensor each, are read one by one and
  stacked, as llama.cpp's loader stacks them.

Any other tensor type (IQ1-IQ3, TQ, NVFP4) is refused at start, naming the type
and what works. So is an architecture this module has no mapping for.

A stage reads only its own tensors: the file is parsed once for its metadata and
tensor table, and each tensor a stage keeps is memory-mapped at its offset, turned
into MLX arrays and unmapped, so a node's memory is its share of the model.

The tokenizer comes from the file's metadata (``gguf/vocab.py``); ``write_sidecar``
puts it, with the config, in a directory mlx-lm's ``load_tokenizer`` reads, and
``convert`` writes a whole mlx-lm checkpoint directory that mlx-lm's own ``load``
reads (``ringd convert``). What ignores: the network, the ring, placement.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ringd.models.gguf import archs
from ringd.models.errors import ModelError
from ringd.models.gguf.archs import Facts, architecture
from ringd.models.gguf.blocks import FORMS, GROUP_SIZE, Form, to_mlx
from ringd.models.samples import SampleReader, sample_spans

GGUF_MAGIC = b"GGUF"

# Tensor types that are MLX arrays as they are; the quantized ones are gguf_blocks.FORMS.
FLOAT_TYPES = ("F32", "F16", "BF16")
_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}  # BF16: the bits, viewed in MLX

# Quantized tensors are converted this many rows at a time, so the numpy temporaries
# stay near this size whatever the tensor (a 128k x 8k embedding is 1 G weights).
CONVERT_CHUNK_BYTES = 64 * 2**20

# The fingerprint reads the whole header (metadata and tensor table) and this many
# slices of this many bytes spread over the tensor data: a different quantization or
# fine-tune changes both, and reading a few hundred KiB keeps it instant on a 40 GB file.
DIGEST_SAMPLES = 16
DIGEST_SAMPLE_BYTES = 16 * 1024

# A checkpoint ``convert`` writes is split into files of about this size, as mlx-lm's
# own save does (it caps files at 5 GB).
CONVERT_FILE_BYTES = 5 * 2**30

# Bump when the tokenizer files write_sidecar makes of the same file change (the
# sidecar's folder name carries it, and a digest of the config, so a new ringd never
# reads an old one).
SIDECAR_VERSION = 1


_BLOCK_NUMBER = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class Tensor:
    """One tensor of the file: where its bytes are and what they hold."""

    name: str
    type: str  # gguf-py's GGMLQuantizationType name: "Q4_1", "F32", ...
    shape: tuple[int, ...]  # numpy order (GGUF lists dimensions innermost first)
    offset: int  # absolute, in the file
    nbytes: int
    file: Path  # the file holding it: a split GGUF's part
    # An early MoE file's experts, one tensor each, stacked into this one (``_stack_split_experts``).
    parts: tuple["Tensor", ...] = ()

    @property
    def spans(self) -> list[tuple[int, int]]:
        """[start, end) of its bytes in its file: one span, or one a part."""
        return [(t.offset, t.offset + t.nbytes) for t in self.parts or (self,)]

    @property
    def form(self) -> Form | None:
        """What its blocks are in MLX; None for a float tensor."""
        return FORMS.get(self.type)

    @property
    def mlx_bytes(self) -> int:
        """What the tensor costs in memory once it is MLX arrays."""
        n = math.prod(self.shape)
        if self.form is None:
            return n * (4 if self.type == "F32" else 2)
        return self.form.mlx_bytes(n)


class GgufFile:
    """A parsed GGUF file: its metadata, tensor table and the mlx-lm config it maps to.

    ``open`` parses (once per process for an unchanged file) and checks that ringd
    can serve it; nothing of the tensor data is read until ``read`` is asked for
    some parameters.
    """

    def __init__(self, path: Path, meta: dict[str, Any], tensors: dict[str, Tensor], data_offset: int, parts: tuple[tuple[Path, int], ...] = ()):
        self.path = path  # a split GGUF's first part
        self.meta = meta
        tensors = _stack_split_experts(path, tensors)
        self.tensors = tensors
        self.data_offset = data_offset
        # Every file of the model and where its tensor data starts: the file, or a split's parts in order.
        self.parts = parts or ((path, data_offset),)
        self.arch = architecture(path, meta)
        _check_types(path, tensors)
        self.config = archs.config(Facts(path, meta, tensors, lambda name: read_tensor(tensors[name].file, tensors[name])[""]))
        from gguf import MODEL_ARCH, get_tensor_name_map

        blocks = self.config["num_hidden_layers"]
        # The architecture's own names, then llama's for what it lacks (a dense feed-forward
        # layer in a MoE model: llama.cpp's llama names for those are the common ones).
        self._names = [get_tensor_name_map(MODEL_ARCH[a], blocks) for a in dict.fromkeys((self.arch.gguf_arch, "LLAMA"))]

    @classmethod
    def open(cls, path: str | os.PathLike) -> "GgufFile":
        # Absolute, its links not followed: a split's parts are found by the name its first part is
        # given (a Hugging Face cache's snapshot links each part to a blob named by its hash).
        p = Path(os.path.abspath(Path(path).expanduser()))
        try:
            st = p.stat()
        except OSError as e:
            raise ModelError(f"{path}: cannot read the GGUF file: {e.strerror}") from e
        # A split's other parts are part of what is cached: any of them replaced is another model.
        siblings = tuple((q, q.stat().st_size, q.stat().st_mtime_ns) for q in _split_parts(p)[1:] if q.is_file())
        return _open_cached(p, st.st_size, st.st_mtime_ns, siblings)

    @property
    def name(self) -> str:
        m = _SPLIT_NAME.match(self.path.name)
        return m[1] if m else self.path.name.removesuffix(".gguf")

    # --- what the model is -------------------------------------------------------

    @functools.cached_property
    def fingerprint(self) -> str:
        """A digest of the header (metadata, tensor table) and of slices of the tensor data."""
        return self.digest()

    def digest_samples(self) -> list[tuple[int, int]]:
        """[start, end) of the slices of tensor data the fingerprint reads (of a file in one part)."""
        return sample_spans(self.path.stat().st_size, self.data_offset, DIGEST_SAMPLES, DIGEST_SAMPLE_BYTES)

    def digest(self, read: SampleReader | None = None) -> str:
        """The fingerprint, its slices from ``read(name, start, end)`` where the file is not whole
        (a model fetched from peers checks itself against its fingerprint this way). A split's
        parts each add their size, header and slices, in order; one file digests as it always has."""
        if read is not None and len(self.parts) > 1:
            raise ModelError(f"{self.path}: a split GGUF is not fetched from peers")
        h = hashlib.sha256(b"gguf:")
        for part, data_offset in self.parts:
            size = part.stat().st_size
            h.update(f"{size}:".encode())
            with open(part, "rb") as f:
                h.update(os.pread(f.fileno(), data_offset, 0))
                for a, b in sample_spans(size, data_offset, DIGEST_SAMPLES, DIGEST_SAMPLE_BYTES):
                    h.update(read(part.name, a, b) if read is not None else os.pread(f.fileno(), b - a, a))
        return "gguf:" + h.hexdigest()

    def part_bytes(self) -> tuple[list[int], int, int, int]:
        """MLX bytes of (each layer, the embeddings, the final norm and the rest, the head)."""
        layers = [0] * self.config["num_hidden_layers"]
        embed = norm = head = 0
        for t in self.tensors.values():
            if t.name in CONFIG_TENSORS:
                continue
            m = _BLOCK_NUMBER.match(t.name)
            if m is not None:
                if int(m.group(1)) < len(layers):
                    layers[int(m.group(1))] += t.mlx_bytes
            elif t.name.startswith("token_embd."):
                embed += t.mlx_bytes
            elif t.name.startswith("output."):
                head += t.mlx_bytes
            else:
                norm += t.mlx_bytes
        return layers, embed, norm, head

    # --- the model's parameters ----------------------------------------------------

    def _gguf_name(self, module_path: str) -> str | None:
        return self._mapped(self.arch.hf_name(module_path))

    def _mapped(self, hf: str) -> str | None:
        # mlx-lm stacks MoE experts under ``switch_mlp``; gguf-py knows the HF name ``experts``.
        hf = hf.replace(".switch_mlp.", ".experts.")
        return next((n for names in self._names if (n := names.get_name(hf)) is not None), None)

    def tensor_of(self, module_path: str) -> Tensor | None:
        """The GGUF tensor holding the weight of the mlx-lm module at ``module_path``."""
        if (d := self._derived(f"{module_path}.weight")) is not None:
            return self.tensors.get(d.tensors[0])
        name = self._gguf_name(module_path)
        return self.tensors.get(f"{name}.weight") if name is not None else None

    def _derived(self, parameter: str) -> archs.Derived | None:
        """How the parameter is made of several tensors, or of one transformed, where the family says so."""
        if self.arch.derived is None or (d := self.arch.derived(parameter, self.config)) is None:
            return None
        missing = [n for n in d.tensors if n not in self.tensors]
        if missing:
            raise ModelError(f"{self.path}: no tensor {missing[0]}, of which the model's parameter {parameter} is made; is the file complete?")
        ts = [self.tensors[n] for n in d.tensors]
        if d.rows_only:
            if len({t.type if t.form is not None else "float" for t in ts}) > 1:
                raise ModelError(
                    f"{self.path}: {', '.join(f'{t.name} ({t.type})' for t in ts)} make one parameter ({parameter}) "
                    "and must be of one type, all quantized alike or all float; ringd does not requantize them"
                )
        elif (quantized := next((t for t in ts if t.form is not None), None)) is not None:
            raise ModelError(
                f"{self.path}: {quantized.name} is {quantized.type}; ringd computes {parameter} from it only from a float "
                "tensor (F32, F16, BF16): take an F16, BF16 or F32 file of this model"
            )
        return d

    def tensors_for(self, parameter: str) -> list[Tensor]:
        """Every tensor an mlx-lm parameter is read from (one, or the several a family's parameter is made of)."""
        if (d := self._derived(parameter)) is not None:
            return [self.tensors[n] for n in d.tensors]
        return [self.source(parameter)[0]]

    def quantization(self, module_path: str) -> dict | None:
        """What ``nn.quantize`` makes of the module: its bits and group size, or None (a float tensor)."""
        t = self.tensor_of(module_path)
        if t is None or t.form is None:
            return None
        return {"group_size": GROUP_SIZE, "bits": t.form.bits, "mode": t.form.mode}

    def source(self, parameter: str) -> tuple[Tensor, str]:
        """The tensor and part ("", "scales", "biases") an mlx-lm parameter is read from (of a parameter
        made of several tensors, the first)."""
        if (d := self._derived(parameter)) is not None:
            leaf = parameter.rsplit(".", 1)[1]
            return self.tensors[d.tensors[0]], leaf if leaf in ("scales", "biases") else ""
        module, leaf = self.arch.hf_name(parameter).rsplit(".", 1)
        name = self._mapped(module)
        part = leaf if leaf in ("scales", "biases") else ""
        t = None
        if name is not None:
            t = self.tensors.get(f"{name}.{'weight' if part else leaf}")
        if t is None or (part and t.form is None):
            raise ModelError(
                f"{self.path}: no tensor holds the model's parameter {parameter} "
                f"(looked for {name or '?'}.{'weight' if part else leaf}); is the file complete?"
            )
        return t, part

    def build_model(self) -> nn.Module:
        """mlx-lm's Model of the file's architecture, its layers quantized as the file's tensors are.

        Its parameters are placeholders (lazy, never evaluated) until ``read`` fills
        the ones a stage keeps.
        """
        from mlx_lm.utils import _get_classes

        model_class, args_class = _get_classes(self.config)
        model = model_class(args_class.from_dict(self.config))
        if self.arch.built is not None:
            self.arch.built(model, self.config)

        def predicate(path: str, module: nn.Module):
            return (hasattr(module, "to_quantized") and self.quantization(path)) or False

        nn.quantize(model, group_size=GROUP_SIZE, bits=4, class_predicate=predicate)
        model.eval()
        return model

    def read(self, parameters: Iterable[str], on_tensor: Callable[[Tensor], None] | None = None) -> list[tuple[str, mx.array]]:
        """The named parameters as MLX arrays, each tensor read (memory-mapped) and converted once.

        ``on_tensor`` hears each tensor as it is done (for progress and cancelling).
        """
        # Parameters by what they are read from: one tensor, or the tensors a family's parameter is made of.
        by_source: dict[tuple[str, ...], list[tuple[str, str]]] = {}
        makers: dict[tuple[str, ...], Callable | None] = {}
        for p in parameters:
            t, part = self.source(p)
            d = self._derived(p)
            key = d.tensors if d is not None else (t.name,)
            by_source.setdefault(key, []).append((p, part))
            makers[key] = d.make if d is not None else None
        out = []
        # In file order (a split's parts by their names, which number them): sequential reads.
        for key in sorted(by_source, key=lambda k: (str(self.tensors[k[0]].file), self.tensors[k[0]].offset)):
            read = []
            for name in key:
                read.append(read_tensor(self.tensors[name].file, self.tensors[name]))
                if on_tensor is not None:
                    on_tensor(self.tensors[name])
            make = makers[key]
            parts = make(read) if make is not None else read[0]
            # A float tensor as the family stores it (Gemma's norms plus one), undone.
            fix = self.arch.fix if make is None and self.tensors[key[0]].form is None else None
            out += [(p, fix(p, parts[part]) if fix else parts[part]) for p, part in by_source[key]]
        return out

    # --- files beside the weights --------------------------------------------------

    def mlx_config(self) -> dict:
        """config.json for the checkpoint this file is: the model's settings and its quantization."""
        config = dict(self.config)
        forms = [(t.form.bits, t.form.mode) for t in self.tensors.values() if t.form is not None and t.name not in CONFIG_TENSORS]
        if forms:
            bits, mode = max(set(forms), key=forms.count)
            quantization: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": bits, "mode": mode}
            # mlx-lm reads a module's own entry first: the modules whose bits or mode differ.
            model = self.build_model()
            for path, module in model.named_modules():
                q = self.quantization(path) if hasattr(module, "to_quantized") else None
                if q is not None and (q["bits"], q["mode"]) != (bits, mode):
                    quantization[path] = q
            config["quantization"] = quantization
        return config

    def write_sidecar(self, directory: Path) -> None:
        """config.json and the tokenizer's files, as an mlx-lm checkpoint directory holds them."""
        from ringd.models.gguf.vocab import tokenizer_files

        directory.mkdir(parents=True, exist_ok=True)
        files = {"config.json": self.mlx_config(), **tokenizer_files(self.meta)}
        for name, content in files.items():
            (directory / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")

    def sidecar(self, cache_dir: Path) -> Path:
        """The sidecar directory of this file under ``cache_dir``, written once (atomically: several
        nodes of one machine may start at the same moment)."""
        config = hashlib.sha256(json.dumps(self.mlx_config(), sort_keys=True).encode()).hexdigest()[:8]
        directory = cache_dir / "gguf" / f"{self.name}-{self.fingerprint.removeprefix('gguf:')[:16]}-{config}-v{SIDECAR_VERSION}"
        return written_once(directory, self.write_sidecar)

    def convert(self, out_dir: Path, on_tensor: Callable[[Tensor], None] | None = None) -> None:
        """Write an mlx-lm checkpoint directory (config, tokenizer, safetensors in MLX's format) that
        mlx-lm's ``load`` reads as the same model ringd serves from this file.

        Written beside ``out_dir`` under a temporary name and renamed when whole: a convert
        that is stopped half-way leaves nothing that looks like a checkpoint.
        """
        from mlx.utils import tree_flatten

        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
        try:
            names = [n for n, _ in tree_flatten(self.build_model().parameters())]
            groups: list[list[str]] = [[]]
            size = 0
            for n in sorted(names, key=lambda n: self.source(n)[0].offset):
                n_bytes = sum(t.mlx_bytes for t in self.tensors_for(n))
                if groups[-1] and size + n_bytes > CONVERT_FILE_BYTES:
                    groups.append([])
                    size = 0
                groups[-1].append(n)
                size += n_bytes
            weight_map, total = {}, 0
            for i, group in enumerate(groups):
                file = "model.safetensors" if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
                arrays = dict(self.read(group, on_tensor))
                mx.save_safetensors(str(tmp / file), arrays, metadata={"format": "mlx"})
                total += sum(a.nbytes for a in arrays.values())
                weight_map.update({n: file for n in arrays})
                del arrays  # one file's arrays in memory at a time
            if len(groups) > 1:
                index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
                (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
            self.write_sidecar(tmp)
            if out_dir.is_dir():
                out_dir.rmdir()  # empty (the caller checks): replaced by the finished one
            os.rename(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


# Tensors of a GGUF that are not parameters of mlx-lm's model: the config is read from them
# (Llama 3's RoPE scaling, Phi-3's LongRoPE factors), so every stage needs their bytes.
CONFIG_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})


@functools.lru_cache(maxsize=8)
def written_once(directory: Path, write: Callable[[Path], None]) -> Path:
    """``directory``, ``write`` having filled it once: into a folder beside it, then renamed into
    place (several nodes of one machine may start at the same moment; the first rename wins and
    a reader never sees half of it). Its ``config.json`` says it is there."""
    if (directory / "config.json").is_file():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".written-", dir=directory.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, directory)
        except OSError:
            if not (directory / "config.json").is_file():  # not another node's win: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def _open_cached(path: Path, size: int, mtime_ns: int, siblings: tuple = ()) -> GgufFile:
    meta, tensors, data_offset = _parse(path, size)
    count = meta.get("split.count")
    if count is None or count == 1:
        return GgufFile(path, meta, tensors, data_offset)
    return GgufFile(path, meta, *_join_split(path, meta, tensors, data_offset))


# llama.cpp's split files (llama_split_path): PREFIX-00001-of-00003.gguf, ... each a GGUF of its
# own, the first with the model's metadata; split.no (from 0) and split.count in every part.
_SPLIT_NAME = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")
# A split of more parts than this is no model llama.cpp's tools write (they cap a part's tensors,
# not their number, but a model of 10k parts would be 10k files open): refused before any is read.
MAX_SPLIT_PARTS = 1024


def _split_parts(first: Path) -> list[Path]:
    """The files of the split whose first part is ``first`` by their names, in order; [first] for
    a file whose name is not a split's first part."""
    m = _SPLIT_NAME.match(first.name)
    if not m or int(m[2]) != 1 or not 1 < int(m[3]) <= MAX_SPLIT_PARTS:
        return [first]
    return [first.with_name(f"{m[1]}-{i:05d}-of-{m[3]}.gguf") for i in range(1, int(m[3]) + 1)]


def _join_split(first: Path, meta: dict, tensors: dict[str, Tensor], data_offset: int) -> tuple[dict[str, Tensor], int, tuple[tuple[Path, int], ...]]:
    """The tensors of every part of a split GGUF, checked against what the first part says of it."""
    count, no = meta.get("split.count"), meta.get("split.no")
    files = _split_parts(first)
    if not isinstance(count, int) or count != len(files) or no != 0:
        raise ModelError(
            f"{first}: a GGUF split in {count} parts (split.no {no}), but its name is not the first of such a split "
            "(NAME-00001-of-0000N.gguf, as llama.cpp's llama-gguf-split names them): name the first part, as it was written"
        )
    tensors, parts = dict(tensors), [(first, data_offset)]
    for i, part in enumerate(files[1:], start=1):
        try:
            size = part.stat().st_size
        except OSError:
            raise ModelError(f"{first}: part {i + 1} of {count} of this split GGUF, {part.name}, is missing beside it; fetch it too") from None
        part_meta, part_tensors, part_offset = _parse(part, size)
        if part_meta.get("split.no") != i or part_meta.get("split.count") != count:
            raise ModelError(f"{part}: says it is part {part_meta.get('split.no')} of {part_meta.get('split.count')}, not part {i} (from 0) of {count}: the parts are of different splits")
        for name, t in part_tensors.items():
            if name in tensors:
                raise ModelError(f"{part}: tensor {name} is also in an earlier part of the split")
            tensors[name] = t
        parts.append((part, part_offset))
    declared = meta.get("split.tensors.count")
    if declared is not None and declared != len(tensors):
        raise ModelError(f"{first}: the split says it holds {declared} tensors, its {count} parts hold {len(tensors)}; is a part from another download?")
    return tensors, data_offset, tuple(parts)


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file that starts as a GGUF file does."""
    p = Path(path).expanduser()
    try:
        with open(p, "rb") as f:
            return p.is_file() and f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _parse(path: Path, size: int) -> tuple[dict[str, Any], dict[str, Tensor], int]:
    """Metadata and tensor table (``gguf/header.py``), from a map of the file: only the header's
    pages are read."""
    import mmap

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from ringd.models.gguf.header import HeaderError, parse_header

    header, why, magic = None, "", b""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            magic = mapped[:4]
            try:
                header = parse_header(mapped)
            except HeaderError as e:
                # Kept as text: the error's traceback holds views of the map, which must go before it closes.
                why = str(e)
    except (OSError, ValueError) as e:  # ValueError: mmap of an empty file
        why = str(e)
    if header is None and magic != GGUF_MAGIC:
        # Not a GGUF file at all (empty, another format, a file named .gguf by mistake), not a broken one.
        raise ModelError(f"{path}: not a GGUF file: it starts {magic!r}, not {GGUF_MAGIC!r} ({why})")
    if header is None:
        raise ModelError(
            f"{path}: not a readable GGUF file ({why}); a file cut short (a download still running "
            "or broken off) reads like this: fetch it again"
        )
    tensors = {}
    for info in header.tensors:
        try:
            qtype = GGMLQuantizationType(info.type)
            name = qtype.name
            block, block_bytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            name, block, block_bytes = f"type {info.type}", 1, 0  # refused by _check_types, by its number
        elements = math.prod(info.dims)
        if info.dims[0] % block:
            raise ModelError(f"{path}: tensor {info.name} ({name}) has rows of {info.dims[0]} weights, not whole blocks of {block}")
        offset = header.data_offset + info.offset
        nbytes = elements // block * block_bytes
        if info.name in tensors:
            raise ModelError(f"{path}: tensor {info.name} is listed twice")
        if offset + nbytes > size:
            raise ModelError(f"{path}: tensor {info.name} ends past the end of the file; is the download complete?")
        tensors[info.name] = Tensor(info.name, name, tuple(reversed(info.dims)), offset, nbytes, path)
    return header.metadata, tensors, header.data_offset


def _check_types(path: Path, tensors: dict[str, Tensor]) -> None:
    odd: dict[str, list[str]] = {}
    for t in tensors.values():
        if t.type not in FLOAT_TYPES and t.type not in FORMS:
            odd.setdefault(t.type, []).append(t.name)
    if odd:
        found = ", ".join(f"{k} ({len(v)} tensors, e.g. {v[0]})" for k, v in sorted(odd.items()))
        raise ModelError(
            f"{path}: tensor types {found} cannot be served; ringd serves GGUF files whose tensors are "
            f"{', '.join((*FLOAT_TYPES, *FORMS))}: take a Q4_K_M, Q5_K_M, Q6_K or Q8_0 file of this model, "
            "or convert the original checkpoint with mlx_lm.convert"
        )


# An expert's own tensor in the files llama.cpp wrote before it stacked them (April 2024: the
# Mixtral GGUFs of that winter): LLM_TENSOR_FFN_GATE_EXP and its kin.
_SPLIT_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate|down|up)\.(\d+)\.weight$")


def _stack_split_experts(path: Path, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The table with each layer's per-expert tensors as one stacked ``ffn_*_exps`` tensor, as
    llama.cpp's loader merges them ("for compatibility with older models"); read part by part."""
    groups: dict[str, dict[int, Tensor]] = {}
    for name, t in tensors.items():
        if m := _SPLIT_EXPERT.match(name):
            groups.setdefault(f"blk.{m.group(1)}.ffn_{m.group(2)}_exps.weight", {})[int(m.group(3))] = t
    if not groups:
        return tensors
    out = {name: t for name, t in tensors.items() if not _SPLIT_EXPERT.match(name)}
    for name, experts in groups.items():
        parts = tuple(experts.get(x) for x in range(len(experts)))
        if None in parts or len({(p.type, p.shape) for p in parts}) != 1 or name in out:
            raise ModelError(f"{path}: the experts of {name} are not one tensor each of one type and shape, numbered from 0")
        first = parts[0]
        out[name] = Tensor(name, first.type, (len(parts), *first.shape), first.offset, sum(p.nbytes for p in parts), first.file, parts)
    return out


def read_tensor(path: Path, t: Tensor) -> dict[str, mx.array]:
    """One tensor as MLX arrays: {"": weight} for a float tensor, plus "scales" (and "biases") for a
    quantized one, laid out as MLX's quantization (groups of 32) lays them out (``gguf_blocks``)."""
    if t.parts:  # experts stored one by one: each read as it is, then stacked
        experts = [read_tensor(path, part) for part in t.parts]
        return {key: mx.stack([e[key] for e in experts]) for key in experts[0]}
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=t.offset, shape=(t.nbytes,))
    try:
        if t.form is None:
            values = data.view(_FLOAT_DTYPES[t.type]).reshape(t.shape)
            array = mx.array(values)
            return {"": array.view(mx.bfloat16) if t.type == "BF16" else array}
        return _blocks_to_mlx(data, t)
    finally:
        del data


def _blocks_to_mlx(data: np.ndarray, t: Tensor) -> dict[str, mx.array]:
    *outer, cols = t.shape
    rows = math.prod(outer)
    form = t.form
    if cols % form.block:
        raise ModelError(f"tensor {t.name}: rows of {cols} weights are not whole blocks of {form.block}")
    blocks, groups = cols // form.block, cols // GROUP_SIZE
    words_per_row = cols * form.bits // 32
    weights = np.empty((rows, words_per_row), dtype=np.uint32)
    scales = np.empty((rows, groups), dtype=form.scale_dtype)
    biases = np.empty((rows, groups), dtype=form.scale_dtype) if form.mode == "affine" else None
    raw = data.reshape(rows, blocks, form.block_bytes)
    step = max(1, CONVERT_CHUNK_BYTES // max(1, blocks * form.block_bytes))
    for r in range(0, rows, step):
        chunk = np.asarray(raw[r : r + step])
        n = len(chunk)
        packed, s, b = to_mlx(chunk.reshape(n * blocks, form.block_bytes), t.type)
        weights[r : r + n] = packed.reshape(n, -1).view(np.uint32)
        scales[r : r + n] = s.reshape(n, groups)
        if biases is not None:
            biases[r : r + n] = b.reshape(n, groups)
    out = {"": mx.array(weights.reshape(*outer, words_per_row)), "scales": mx.array(scales.reshape(*outer, groups))}
    if biases is not None:
        out["biases"] = mx.array(biases.reshape(*outer, groups))
    return out
