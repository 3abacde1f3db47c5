"""``OWNER/REPO:QUANT``: a GGUF repository on the Hugging Face Hub, and which of its files a quant names.

People name a GGUF repository's quant as ``llama-server -hf OWNER/REPO:Q4_K_M`` and
``ollama run hf.co/OWNER/REPO:Q4_K_M`` do. ``parse`` reads such a name, ``pick``
chooses the file(s) of the quant from the repository's file list, as llama.cpp's
``common/download.cpp`` (``find_best_model``, ``get_split_files``) does:

- the quant matches a file name case-insensitively where it is followed by ``.``
  or ``-`` (``Q4_K_M`` picks ``model-Q4_K_M.gguf`` and ``model.q4_k_m.gguf``, not
  ``model-Q4_K_M_L.gguf``), and, stricter than llama.cpp, where it starts a word
  (``F16`` does not pick ``model-BF16.gguf``); without a quant, Q4_K_M, then Q8_0, then the first
  model file;
- files that are not the model (``mmproj``, ``imatrix``, draft heads) are never
  picked;
- a split GGUF (``NAME-00001-of-00003.gguf``) is picked by its first part and
  brings all its parts, in order; a split with a part missing is refused.

Pure functions over names: no network, no files (``source.py`` lists the cache or
the Hub and fetches what ``pick`` returns). A plain ``OWNER/REPO`` with no quant
and no ``hf.co/`` stays what it was, an mlx-lm repository (``parse`` returns None).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ringd.models.errors import ModelError

# How a Hub GGUF repository may be prefixed (Ollama's hf.co/ names, and the URL people paste).
HOST_PREFIXES = ("https://huggingface.co/", "https://hf.co/", "huggingface.co/", "hf.co/")
# llama.cpp's find_best_model: what a name without a quant picks, in this order.
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")
# Words in a .gguf file name that mark a file other than the model (llama.cpp's gguf_filename_is_model).
NOT_MODEL = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")

# A repo id's parts as the Hub allows them: letters, digits, -, _ and . (not first or last).
_REPO_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")
# A quant tag: Q4_K_M, IQ4_XS, F16, BF16, UD-Q4_K_XL, ...
_QUANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SPLIT = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})$", re.IGNORECASE)
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)


@dataclass(frozen=True)
class HubRef:
    """A GGUF repository and the quant asked for (None: the default)."""

    repo: str
    quant: str | None

    def __str__(self) -> str:
        return self.repo if self.quant is None else f"{self.repo}:{self.quant}"


@dataclass(frozen=True)
class Split:
    """What a .gguf file name says of itself: its name without part number and suffix, its quant
    (upper case; "" if the name has none), and which part of how many it is (1 of 1: not split)."""

    prefix: str
    quant: str
    index: int
    count: int


def parse(model: str) -> HubRef | None:
    """The Hub GGUF repository ``model`` names, or None when it names none.

    ``OWNER/REPO:QUANT`` and ``hf.co/OWNER/REPO[:QUANT]`` (also ``huggingface.co/``
    and the https URL) name one; ModelError for such a name that is malformed.
    """
    text, hosted = model, False
    for prefix in HOST_PREFIXES:
        if text.lower().startswith(prefix):
            text, hosted = text[len(prefix) :], True
            break
    repo, sep, quant = text.partition(":")
    if not hosted and not sep:
        return None  # an mlx-lm repo id, a directory or a file: not ours
    if not hosted and (model.startswith((".", "/", "~")) or repo.count("/") != 1):
        return None  # a path with a colon in it, or ollama:NAME
    parts = repo.split("/")
    if len(parts) != 2 or not all(_REPO_PART.fullmatch(p) for p in parts) or any(".." in p for p in parts):
        raise ModelError(f"{model}: not a Hugging Face GGUF repository name; they look like OWNER/REPO:QUANT or hf.co/OWNER/REPO:QUANT, e.g. bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M")
    if sep and not _QUANT.fullmatch(quant):
        raise ModelError(f"{model}: {quant!r} is not a quant; a quant is letters, digits, _, - and ., e.g. Q4_K_M, Q8_0 or IQ4_XS")
    return HubRef(repo, quant or None)


def split_info(path: str) -> Split | None:
    """What the .gguf file name ``path`` says of itself (llama.cpp's get_gguf_split_info); None for
    a name that does not end in .gguf."""
    name = path.rsplit("/", 1)[-1]
    if not name.lower().endswith(".gguf"):
        return None
    prefix = path[: -len(".gguf")]
    index = count = 1
    m = _SPLIT.match(prefix)
    if m:
        prefix, index, count = m[1], int(m[2]), int(m[3])
    tag = _TAG.search(prefix)
    return Split(prefix, tag[1].upper() if tag else "", index, count)


def is_model_file(path: str) -> bool:
    """A .gguf file that holds a model, not a projector, an importance matrix or a draft head."""
    name = path.rsplit("/", 1)[-1]
    return name.lower().endswith(".gguf") and not any(word in name for word in NOT_MODEL)


def quants(files: list[str]) -> list[str]:
    """The quants the model files of a repository come in (upper case, sorted, each once)."""
    return sorted({s.quant for f in files if is_model_file(f) and (s := split_info(f)) is not None and s.quant})


def parts(files: list[str], first: str) -> list[str]:
    """The parts of the split GGUF whose first part is ``first``, in order (``[first]`` when it is
    not split); ModelError naming the parts the list lacks."""
    s = split_info(first)
    if s is None or s.count == 1:
        return [first]
    by_index = {}
    for f in files:
        t = split_info(f)
        if t is not None and t.count == s.count and t.prefix == s.prefix:
            by_index[t.index] = f
    missing = [i for i in range(1, s.count + 1) if i not in by_index]
    if missing:
        raise ModelError(f"{first}: a GGUF split in {s.count} parts, but part(s) {', '.join(map(str, missing))} are not in the repository")
    return [by_index[i] for i in range(1, s.count + 1)]


def pick(files: list[str], quant: str | None, what: str = "the repository", any_file: bool = True) -> list[str]:
    """The file of ``quant`` among ``files`` (a repository's paths), with its split parts in order;
    without a quant, the first of DEFAULT_QUANTS there, else (``any_file``) the first model file.

    ModelError when none matches: it lists the quants ``what`` has, or says it has no GGUF model file.
    """
    candidates = sorted(f for f in files if is_model_file(f) and (s := split_info(f)) is not None and s.index == 1)
    for tag in (quant,) if quant else DEFAULT_QUANTS:
        pattern = re.compile(r"(?<![A-Za-z0-9])" + re.escape(tag) + r"[.-]", re.IGNORECASE)
        for f in candidates:
            if pattern.search(f):
                return parts(files, f)
    if not candidates:
        ggufs = [f for f in files if f.lower().endswith(".gguf")]
        extra = f" (only {', '.join(sorted(ggufs)[:5])}, which are not models)" if ggufs else ""
        raise ModelError(f"{what} has no GGUF model file{extra}")
    if not quant and any_file:
        return parts(files, candidates[0])
    have = quants(files)
    raise ModelError(f"{what} has no {quant or ' or '.join(DEFAULT_QUANTS)} file; its quants: {', '.join(have) if have else 'none named in its files'} ({len(candidates)} model file(s))")
