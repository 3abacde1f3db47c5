"""Where a model comes from: what a user names as a model, found and described.

A model is named by an mlx-lm directory, a Hugging Face repo id, a GGUF file,
``ollama:NAME[:TAG]``, a GGUF in the local Ollama store (``ollama/store.py`` finds it, with
the request defaults and chat template its other layers make), or
``OWNER/REPO:QUANT`` (``hf.co/OWNER/REPO[:QUANT]``), the file of that quant in a GGUF
repository on the Hub (``hubref.py`` picks it; the Hugging Face cache is looked in
first, so a model once fetched starts offline); a model fetched from peers
(``peers.py``) is a directory that also holds a record of whose model it is.
``model_info`` turns any of these into a ``ModelInfo``: it finds
the files (a repo id is fetched into the Hugging Face cache, only the files asked
for, so a stage can fetch its own layers' files, with progress), has them read
(``checkpoint.py`` a directory, ``gguf/reader.py`` a GGUF file), fingerprints them
(``fingerprint.py``; a model fetched from peers by its record, as its sparse files
make none), and says what the API calls the model.

It ignores what is in the files: reading them is the readers'; fetching from
peers is ``peers.py``'s.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from ringd.models.remote import hubref
from ringd.models.ollama import store
from ringd.models.checkpoint import NON_WEIGHT_PATTERNS, ModelInfo, WeightBytes, check_supported, read_config, weight_bytes
from ringd.models.errors import ModelError
from ringd.models.fingerprint import model_fingerprint, weights_digest
from ringd.models.gguf import mmproj
from ringd.models.gguf.reader import GgufFile, is_gguf
from ringd.models.gguf.vocab import adds_bos
from ringd.models.progress import DOWNLOAD, LoadCancelled, LoadProgress

log = logging.getLogger(__name__)

# A GGUF repository's snapshot in the Hugging Face cache holds a handful of files; a folder past
# this many .gguf files is not one, and the cache lookup gives up on it rather than walk it.
MAX_CACHED_GGUFS = 4096

# In the directory of a model fetched from peers (models/peers/): whose model it is, its
# fingerprint (its files are sparse, holes where other stages' tensors are: no fingerprint can
# be read from them) and the manifest its bytes were checked against.
PEER_RECORD = "ringd-peer.json"


def model_info(path_or_repo: str) -> ModelInfo:
    """Read a model's config and check that it can be split into a ring."""
    if store.is_ollama_ref(path_or_repo):
        return _ollama_info(store.find(path_or_repo))
    gguf_file, label = gguf_source(path_or_repo)
    if gguf_file is not None:
        return _gguf_info(gguf_file, label)
    path = resolve_model_path(path_or_repo)
    config = read_config(path)
    text = check_supported(config, path / "config.json")
    record = read_record(path)  # fetched from peers: its files are sparse
    return ModelInfo(
        path=path,
        config=config,
        model_type=config.get("model_type", "?"),
        num_layers=text["num_hidden_layers"],
        hidden_size=text["hidden_size"],
        vocab_size=text["vocab_size"],
        context_length=int(text.get("max_position_embeddings") or 4096),
        fingerprint=record["fingerprint"] if record else model_fingerprint(config, weights_digest(path)),
        weights=weight_bytes(path, text["num_hidden_layers"]),
        # A repo id names the model better than the snapshot folder it was fetched into.
        label=record["label"] if record else path.name if Path(path_or_repo).expanduser().exists() else path_or_repo,
    )


def _ollama_info(model: store.OllamaModel) -> ModelInfo:
    """An Ollama model: its GGUF, with the defaults its params and system layers make, its projector
    layer (a model that sees) and, for a GGUF without a chat template, its Go template's translation
    (ModelError where there is none)."""
    info = _gguf_info(model.blob, model.ref.removeprefix(store.PREFIX))
    defaults, warnings = model.defaults()
    for warning in warnings:
        log.warning("%s", warning)
    meta = GgufFile.open(model.blob).meta
    template = model.chat_template(meta.get("tokenizer.chat_template"), lambda: adds_bos(meta))
    # A vision model's projector is a layer of it (Ollama keeps llama.cpp's mmproj file so).
    weights = dataclasses.replace(info.weights, vision=model.projector.stat().st_size) if model.projector else info.weights
    return dataclasses.replace(info, defaults=defaults, chat_template=template, mmproj=model.projector, weights=weights)


def _gguf_info(file: Path, label: str) -> ModelInfo:
    """A GGUF file's model (and the projector file beside it, if any: a model that sees)."""
    g = GgufFile.open(file)
    text = check_supported(g.config, file)
    layers, embed, norm, head = g.part_bytes()
    projector = mmproj.beside(g.path)
    record = read_record(file)  # fetched from peers: the file is sparse
    return ModelInfo(
        path=g.path,
        config=g.config,
        model_type=g.config["model_type"],
        num_layers=text["num_hidden_layers"],
        hidden_size=text["hidden_size"],
        vocab_size=text["vocab_size"],
        context_length=int(text.get("max_position_embeddings") or 4096),
        fingerprint=record["fingerprint"] if record else model_fingerprint(g.config, g.fingerprint),
        weights=WeightBytes(tuple(layers), embed, norm, head, projector.stat().st_size if projector else 0),
        label=record["label"] if record else label,
        mmproj=projector,
    )


def gguf_source(model: str, progress: LoadProgress | None = None) -> tuple[Path | None, str]:
    """The GGUF file ``model`` names, and what to call it; (None, "") when it names no GGUF.

    A Hub GGUF repository's file is fetched when the cache lacks it, reported to ``progress``
    (by default, to the log).
    """
    if store.is_ollama_ref(model):
        return store.resolve(model), model.removeprefix(store.PREFIX)
    path = Path(model).expanduser()
    ref = None if path.exists() else hubref.parse(model)
    if ref is not None:
        return hub_gguf(ref, progress)
    if path.suffix.lower() == ".gguf" or path.is_file():
        if not path.is_file():
            raise ModelError(f"{path}: no such GGUF file")
        if not is_gguf(path):
            raise ModelError(f"{path}: not a GGUF file (it does not start with 'GGUF'); a model is an mlx-lm directory, a Hugging Face repo id, a .gguf file or ollama:NAME")
        return path.resolve(), path.name.removesuffix(".gguf")
    return None, ""


def hub_gguf(ref: hubref.HubRef, progress: LoadProgress | None = None) -> tuple[Path, str]:
    """The GGUF file of ``ref``'s quant, from the Hugging Face cache, else fetched into it (that
    file and, for a split GGUF, its other parts; nothing else of the repository), and what to call
    the model (``OWNER/REPO:QUANT``).

    The cache is looked in first without any request, so a model once fetched starts with
    HF_HUB_OFFLINE=1 or no network at all. ModelError for a quant the repository lacks (naming
    those it has), a repository the Hub does not have, or, offline, a quant not in the cache.
    """
    from huggingface_hub import constants

    first = None
    cached = _cached_snapshot(ref.repo, Path(constants.HF_HUB_CACHE))
    if cached is not None:
        snapshot, files = cached
        try:
            # Online, a name without a quant fetches the default rather than take any file the cache has.
            first = snapshot / hubref.pick(files, ref.quant, any_file=bool(constants.HF_HUB_OFFLINE))[0]
        except ModelError:
            if constants.HF_HUB_OFFLINE:
                have = hubref.quants(files)
                raise ModelError(
                    f"{ref}: not in the Hugging Face cache {constants.HF_HUB_CACHE} (it holds {', '.join(have) or 'no GGUF model file'} "
                    "of this repository) and HF_HUB_OFFLINE is set; unset it to fetch it"
                ) from None
    elif constants.HF_HUB_OFFLINE:
        raise ModelError(f"{ref}: not in the Hugging Face cache {constants.HF_HUB_CACHE}, and HF_HUB_OFFLINE is set; unset it to fetch it")
    if first is None:
        first = _fetch_gguf(ref, progress)
    split = hubref.split_info(first.name)  # a split's first part: gguf/reader.py finds the others beside it
    quant = (split.quant if split is not None else "") or ref.quant
    return first, f"{ref.repo}:{quant}" if quant else ref.repo


def _cached_snapshot(repo: str, cache: Path) -> tuple[Path, list[str]] | None:
    """The snapshot of ``repo`` in the Hugging Face cache and the .gguf files in it, as repository
    paths; None when the cache has none. No network."""
    snapshot = hf_snapshot(cache / f"models--{repo.replace('/', '--')}")
    if snapshot is None:
        return None
    files = []
    for path in snapshot.rglob("*.gguf"):
        if path.is_file():  # a symlink into blobs/; a dangling one is a file not (fully) fetched
            files.append(path.relative_to(snapshot).as_posix())
        if len(files) > MAX_CACHED_GGUFS:
            return None
    return (snapshot, files) if files else None


def hf_snapshot(repo_dir: Path) -> Path | None:
    """A repository's snapshot folder in the Hugging Face cache (``repo_dir``: its
    ``models--OWNER--NAME``): the one refs/main names, else the newest; None when there is none."""
    try:
        snapshot = repo_dir / "snapshots" / (repo_dir / "refs" / "main").read_text().strip()
        if snapshot.is_dir():
            return snapshot
    except OSError:
        pass
    try:
        return max((repo_dir / "snapshots").iterdir(), key=lambda p: p.stat().st_mtime, default=None)
    except OSError:
        return None


def _fetch_gguf(ref: hubref.HubRef, progress: LoadProgress | None) -> Path:
    """Fetch the file (and split parts) of ``ref``'s quant from the Hub into its cache, with
    progress; the path of the (first) file."""
    from huggingface_hub import snapshot_download

    try:
        listing = snapshot_download(ref.repo, allow_patterns=["*.gguf"], dry_run=True, tqdm_class=_hub_bar(None, ""))
        by_name = {f.filename: f for f in listing}
        chosen = hubref.pick(list(by_name), ref.quant, f"{ref.repo} on the Hugging Face Hub")
        fetch = [by_name[name] for name in chosen if by_name[name].will_download]
        if fetch:
            progress = progress if progress is not None else LoadProgress(0, 0, subject=str(ref))
            _fetch_files(ref.repo, fetch[0].commit_hash, fetch, progress)
    except (LoadCancelled, ModelError):
        raise
    except Exception as e:  # the hub raises many kinds; all mean the same to the user
        raise ModelError(f"could not fetch {str(ref)!r} from the Hugging Face Hub: {e}") from e
    return Path(by_name[chosen[0]].local_path)


def read_record(path: Path) -> dict | None:
    """The peer record of a model fetched from peers (``path``: its directory, or the GGUF file in
    it); None for a model of a node's own."""
    root = path.parent if path.is_file() else path
    try:
        record = json.loads((root / PEER_RECORD).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(record, dict) and isinstance(record.get("fingerprint"), str) and isinstance(record.get("label"), str)
    return record if ok else None


def resolve_model_path(path_or_repo: str, allow_patterns: list[str] | None = None, progress: LoadProgress | None = None) -> Path:
    """A local model directory as is, or a Hugging Face repo id fetched into the hub cache.

    Only the files matching ``allow_patterns`` are fetched, so a stage can ask for
    the weight files of its own layers and nothing else. With ``progress``, the files
    not in the cache yet are fetched one by one and reported to it (phase "download").
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

    patterns = allow_patterns or NON_WEIGHT_PATTERNS
    try:
        if progress is None:
            return Path(snapshot_download(path_or_repo, allow_patterns=patterns))
        commit = _download_with_progress(path_or_repo, patterns, progress)
        # Everything is in the cache now: this only names the snapshot's folder.
        return Path(snapshot_download(path_or_repo, revision=commit, allow_patterns=patterns, tqdm_class=_hub_bar(None, "")))
    except LoadCancelled:
        raise
    except Exception as e:  # the hub raises many kinds; all mean the same to the user
        raise ModelError(f"could not fetch {path_or_repo!r} from the Hugging Face Hub: {e}") from e


def _download_with_progress(repo: str, patterns: list[str], progress: LoadProgress) -> str | None:
    """Fetch the files of ``repo`` matching ``patterns`` that the hub cache lacks, reporting each
    file's bytes to ``progress``; the commit they were fetched at (None: the repo has no such file).

    huggingface_hub's dry run says which files a download would fetch and their sizes; each is
    then fetched with ``hf_hub_download`` into the normal cache (so mlx-lm and a second run find
    it there), its progress bar feeding ``progress``. One file at a time: the progress names the
    file being fetched, and hf_xet already fetches a file's chunks in parallel.
    """
    from huggingface_hub import snapshot_download

    plan = snapshot_download(repo, allow_patterns=patterns, dry_run=True, tqdm_class=_hub_bar(None, ""))
    if not plan:
        return None
    commit = plan[0].commit_hash
    fetch = sorted((f for f in plan if f.will_download), key=lambda f: f.filename)
    if fetch:
        _fetch_files(repo, commit, fetch, progress)
    return commit


def _fetch_files(repo: str, commit: str, fetch: list, progress: LoadProgress) -> None:
    """Fetch these files of a dry run's plan one by one with ``hf_hub_download``, each reported to ``progress``."""
    from huggingface_hub import hf_hub_download

    progress.begin(DOWNLOAD, {f.filename: f.file_size for f in fetch})
    for f in fetch:
        progress.start_file(f.filename)
        hf_hub_download(repo, f.filename, revision=commit, tqdm_class=_hub_bar(progress, f.filename))
        progress.finish_file(f.filename)
    progress.end()


class _HubBar:
    """The part of tqdm that huggingface_hub calls on a ``tqdm_class`` (per-file bars, xet's
    reporter, snapshot_download's bars), passing a file's bytes to a LoadProgress, or nowhere."""

    progress: LoadProgress | None = None
    file = ""

    def __init__(self, *args, total: int | None = None, initial: int = 0, **kwargs):
        self.n, self.total = 0, total
        if self.progress is not None and total is not None:
            self.progress.set_size(self.file, total)
        if initial:
            self.update(initial)

    def update(self, n: int | float | None = 1) -> None:
        self.n += n or 0
        if self.progress is not None and n:
            self.progress.advance(self.file, int(n))

    def update_transfer(self, n: int | float | None = 1) -> None:
        pass  # bytes off the network (xet: compressed, deduplicated); ``update`` counts the file's own

    def __enter__(self) -> "_HubBar":
        return self

    def __exit__(self, *exc) -> None:
        pass

    format_dict: dict = {}

    def set_postfix_str(self, *args, **kwargs) -> None:
        pass

    set_transfer_postfix_str = set_description = set_description_str = set_postfix_str

    def refresh(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


def _hub_bar(progress: LoadProgress | None, file: str) -> type[_HubBar]:
    """A tqdm_class for huggingface_hub (it wants a class) reporting ``file`` to ``progress``."""
    return type("_FileBar", (_HubBar,), {"progress": progress, "file": file})
