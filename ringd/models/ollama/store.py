"""``ollama:NAME[:TAG]``: a model pulled with Ollama, served from Ollama's own store as Ollama runs it.

Ollama keeps each pulled model as a manifest (JSON, one file per name and tag) that
names content-addressed blobs; the blob of the layer whose media type is
``application/vnd.ollama.image.model`` is the model's GGUF file, which ringd reads
in place (``gguf/reader.py``): nothing is copied or converted, and Ollama need not be running.

Names are parsed as Ollama parses them (``types/model/name.go``):
``[host/][namespace/]model[:tag]``, with ``registry.ollama.ai``, ``library`` and
``latest`` for the parts left out, so ``ollama:smollm2`` is what ``ollama run
smollm2`` runs, ``ollama:user/model:tag`` what ``ollama run user/model:tag`` does,
and ``ollama:hf.co/OWNER/REPO:Q4_K_M`` what ``ollama run hf.co/OWNER/REPO:Q4_K_M``
pulled from Hugging Face (host ``hf.co``, namespace OWNER, model REPO, tag the quant).
Parts are matched as the store's folders spell them, as Ollama does (on a Mac's
case-insensitive disk any case finds them).

The layers beside the weights are read as Ollama reads them (``server/images.go``:
``GetModel``), each bounded before it is read: the params layer(s) (JSON options,
merged in order: ``ollama/params.py`` makes them the defaults of every API's
requests), the system layer (the system message of a chat without one; the last
one wins) and the template layer (a Go template, also under its older name
``image.prompt``; the last one wins), which ``chat_template`` turns into a Jinja
template only where the GGUF has none of its own (``gotemplates.py`` says which
Go templates it knows).

It deliberately ignores the rest of an Ollama model: the license and messages
layers (a Modelfile's MESSAGE turns are not prepended to chats), adapters, and the newer ``kind`` segment of names (skills, agents: not
models). It checks a blob's size against its manifest (an interrupted pull) but
does not hash it: Ollama did at pull time, and reading tens of GB at every start
is not worth it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ringd.models.ollama import gotemplates
from ringd.models.defaults import ModelDefaults
from ringd.models.errors import ModelError
from ringd.models.ollama.params import MAX_PARAMS_BYTES, layer_options, params_defaults

PREFIX = "ollama:"

# What a name leaves out (types/model/name.go: DefaultName).
DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"

# An Ollama manifest names a handful of layers, about a kilobyte of JSON: a file past this is no
# manifest, and is refused before it is read (a damaged or hostile store costs nothing).
MAX_MANIFEST_BYTES = 1 << 20
# The layer of a manifest that is the model's weights: a GGUF file.
MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
GGUF_MAGIC = b"GGUF"
# The layers beside it that ringd applies (Ollama's template layer went by "prompt" once).
PARAMS_MEDIA_TYPE = "application/vnd.ollama.image.params"
# A vision model's projector: llama.cpp's mmproj file (models/gguf/mmproj.py).
PROJECTOR_MEDIA_TYPE = "application/vnd.ollama.image.projector"
SYSTEM_MEDIA_TYPE = "application/vnd.ollama.image.system"
TEMPLATE_MEDIA_TYPES = ("application/vnd.ollama.image.template", "application/vnd.ollama.image.prompt")
# A system prompt or a template is text of a few kilobytes (the longest Jinja templates, 30 KB);
# past this it is no such layer, and is refused before it is read.
MAX_SYSTEM_BYTES = 1 << 20
MAX_TEMPLATE_BYTES = 1 << 20

# Where the store is when OLLAMA_MODELS is not set: a user's Ollama (the macOS app,
# or `ollama serve` run by hand) keeps it under the home folder; the Linux install
# script's system service runs as the `ollama` user, whose home is /usr/share/ollama.
USER_STORE = Path(".ollama") / "models"  # in the home folder
SYSTEM_STORE = Path("/usr/share/ollama/.ollama/models")

# The parts' characters and lengths, as Ollama's isValidPart checks them: a letter,
# digit or _ first; then also - and . (not in a namespace), and : in a host (a port).
_PART = {
    "host": (re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]*"), 350, "letters, digits, _, -, . and :"),
    "namespace": (re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*"), 80, "letters, digits, _ and -"),
    "model": (re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*"), 80, "letters, digits, _, - and ."),
    "tag": (re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*"), 80, "letters, digits, _, - and ."),
}
_SHA256 = re.compile(r"sha256:([0-9a-f]{64})")
_NAME_FORMS = "NAME, NAME:TAG, NAMESPACE/NAME:TAG or HOST/NAMESPACE/NAME:TAG"


@dataclass(frozen=True)
class OllamaName:
    host: str
    namespace: str
    model: str
    tag: str

    def manifest(self, store: Path) -> Path:
        """Where Ollama writes this name's manifest (Name.Filepath)."""
        return store / "manifests" / self.host / self.namespace / self.model / self.tag

    def __str__(self) -> str:
        return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"


def is_ollama_ref(model: str) -> bool:
    """Whether ``model`` names a model in the Ollama store (``ollama:NAME[:TAG]``)."""
    return model.startswith(PREFIX)


def parse_name(name: str) -> OllamaName:
    """An Ollama model name with its defaults filled in, as ``ParseName`` makes it; ModelError if invalid.

    The tag is after the last ":" if that comes after the last "/" (a host may carry a
    port); then the model, namespace and host are cut at the last "/" each, a host
    losing any ``scheme://``. A separator with nothing on one side is an invalid name.
    """
    s, parts = name, {}
    if s.rfind(":") > s.rfind("/"):
        s, _, parts["tag"] = s.rpartition(":")
    for kind in ("model", "namespace"):
        before, sep, after = s.rpartition("/")
        if not sep:
            parts[kind] = s
            break
        parts[kind], s = after, before
    else:
        parts["host"] = s.partition("://")[2] or s
    full = {"host": DEFAULT_HOST, "namespace": DEFAULT_NAMESPACE, "tag": DEFAULT_TAG, **parts}
    for kind, (pattern, max_len, allowed) in _PART.items():
        value = full[kind]
        if not (1 <= len(value) <= max_len and pattern.fullmatch(value)):
            shown = f"the {kind} {value!r}" if value else f"an empty {kind}"
            raise ModelError(
                f"{PREFIX}{name}: not an Ollama model name ({shown}: a {kind} is 1 to {max_len} of {allowed}, "
                f"starting with a letter, digit or _); names look like {_NAME_FORMS}"
            )
    return OllamaName(full["host"], full["namespace"], full["model"], full["tag"])


def store_dir(environ: Mapping[str, str] | None = None, *, name: str = "NAME") -> Path:
    """Ollama's model store: $OLLAMA_MODELS if set, else ~/.ollama/models, else the Linux
    system service's; ModelError naming each place looked in when there is none."""
    env = os.environ if environ is None else environ
    if env.get("OLLAMA_MODELS"):
        store = Path(env["OLLAMA_MODELS"]).expanduser()
        if not store.is_dir():
            raise ModelError(f"OLLAMA_MODELS is {store}, which is not a directory; point it at Ollama's model store, or unset it to use ~/{USER_STORE}")
        return store
    user = Path(env.get("HOME") or Path.home()) / USER_STORE
    for store in (user, SYSTEM_STORE):
        if store.is_dir():
            return store
    raise ModelError(
        f"no Ollama model store: OLLAMA_MODELS is not set and neither {user} nor {SYSTEM_STORE} exists; "
        f"install Ollama (https://ollama.com) and run `ollama pull {name}`, or set OLLAMA_MODELS to where its models are"
    )


@dataclass(frozen=True)
class OllamaModel:
    """A model in the store: its GGUF blob and the layers beside it that ringd applies."""

    ref: str  # as named: ollama:NAME[:TAG]
    blob: Path
    options: dict | None = None  # the params layers' options, merged in the manifest's order
    system: str | None = None
    template: str | None = None  # a Go template
    projector: Path | None = None  # a vision model's projector layer (llama.cpp's mmproj file)

    def defaults(self) -> tuple[ModelDefaults, list[str]]:
        """The defaults of requests its params and system layers make, and a warning for each
        option ignored; ModelError for a params layer ringd cannot apply (``ollama/params.py``)."""
        if self.options is None:
            defaults, warnings = ModelDefaults(source=self.ref), []
        else:
            defaults, warnings = params_defaults(self.options, f"{self.ref}: its params layer", self.ref)
        if self.system:
            defaults = dataclasses.replace(defaults, system=self.system)
        return defaults, warnings

    def chat_template(self, gguf_template: str | None, bos: Callable[[], bool]) -> str | None:
        """The Jinja template to give the tokenizer in place of the GGUF's: None where the GGUF has
        one (it is rendered, whatever the template layer says) or neither has one; the translation of
        a known Go template (``gotemplates.py``) where only the layer has one, BOS first if ``bos()``
        (asked only then: whether the GGUF's tokenizer adds BOS). ModelError, naming the
        template and what to do, for a Go template ringd cannot translate on a GGUF without one."""
        if gguf_template or self.template is None:
            return None
        if gotemplates.known_name(self.template) is None:
            known = ", ".join(name for name in gotemplates.KNOWN if name != "prompt")
            raise ModelError(
                f"{self.ref}: its GGUF has no chat template (tokenizer.chat_template) and its template layer is a Go template "
                f"ringd does not know ({gotemplates.first_line(self.template)!r}); ringd renders chats with Jinja and translates only "
                f"Ollama's own {known} templates and its default {{{{ .Prompt }}}}: serve a GGUF of this model that carries its chat template "
                f"(its Hugging Face repo's file, say), or `ollama create` it with one of those templates"
            )
        return gotemplates.jinja_for(self.template, bos())


def resolve(ref: str, models_dir: Path | None = None) -> Path:
    """The GGUF file of ``ollama:NAME[:TAG]`` in the Ollama store (``models_dir``, else ``store_dir()``)."""
    return find(ref, models_dir).blob


def find(ref: str, models_dir: Path | None = None) -> OllamaModel:
    """``ollama:NAME[:TAG]`` in the Ollama store (``models_dir``, else ``store_dir()``): its GGUF
    file and the params, system and template layers beside it.

    ModelError, naming what was looked for, where, and the ``ollama pull`` that fixes
    it, for a malformed name, no store, no manifest, a manifest without a model layer,
    a missing blob, a blob shorter or longer than its manifest says, one that is
    not a GGUF file, and a params, system or template layer that is missing, over its
    size limit, not text (system, template) or not a JSON object (params).
    """
    text = ref.removeprefix(PREFIX)
    name = parse_name(text)
    what = f"{PREFIX}{text}"
    pull = f"`ollama pull {text}`"
    store = Path(models_dir).expanduser() if models_dir is not None else store_dir(name=text)
    manifest_path = name.manifest(store)
    if not manifest_path.is_file():
        raise ModelError(f"{what}: no such model in the Ollama store {store} (no manifest {manifest_path}); {pull} fetches it, `ollama list` shows what is there")
    try:
        with open(manifest_path, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ValueError(f"over {MAX_MANIFEST_BYTES} bytes, where a manifest is about a kilobyte")
        manifest = json.loads(raw.decode())
        layers = [layer for layer in manifest.get("layers") or [] if isinstance(layer, dict)]
    except (OSError, UnicodeDecodeError, ValueError, AttributeError, TypeError, RecursionError) as e:  # RecursionError: nested too deep
        raise ModelError(f"{what}: cannot read its manifest {manifest_path} ({e}); {pull} writes it again") from None
    layer = next((layer for layer in layers if layer.get("mediaType") == MODEL_MEDIA_TYPE), None)
    if layer is None:
        kinds = ", ".join(str(layer.get("mediaType")) for layer in layers) or "none"
        raise ModelError(f"{what}: its manifest {manifest_path} has no {MODEL_MEDIA_TYPE} layer (its layers: {kinds}); is it a model? {pull} rewrites it")
    blob = _blob(store, layer, f"{what}: its model layer", manifest_path, pull)
    with open(blob, "rb") as f:
        if f.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            raise ModelError(f"{what}: its model blob {blob} is not a GGUF file (it does not start with 'GGUF'); ringd serves GGUF models")
    options: dict | None = None
    system = template = projector = None
    for layer in layers:
        kind = layer.get("mediaType")
        if kind == PROJECTOR_MEDIA_TYPE:
            projector = _blob(store, layer, f"{what}: its projector layer", manifest_path, pull)
        if kind == PARAMS_MEDIA_TYPE:
            where = f"{what}: its params layer"
            options = {**(options or {}), **layer_options(_layer_bytes(store, layer, MAX_PARAMS_BYTES, where, manifest_path, pull), where)}
        elif kind == SYSTEM_MEDIA_TYPE:
            system = _layer_text(store, layer, MAX_SYSTEM_BYTES, f"{what}: its system layer", manifest_path, pull)
        elif kind in TEMPLATE_MEDIA_TYPES:
            template = _layer_text(store, layer, MAX_TEMPLATE_BYTES, f"{what}: its template layer", manifest_path, pull)
    return OllamaModel(what, blob, options, system, template, projector)


def _blob(store: Path, layer: dict, where: str, manifest_path: Path, pull: str) -> Path:
    """The file of ``layer``'s blob, its size as the manifest says; ModelError naming ``where`` if not."""
    digest = _SHA256.fullmatch(str(layer.get("digest")))
    if digest is None:
        raise ModelError(f"{where}: the manifest {manifest_path} gives it the digest {layer.get('digest')!r}, not sha256:<64 hex digits>; {pull} rewrites it")
    # Blobs are named sha256-<hex>; older stores used sha256:<hex>, a name Windows does not allow.
    candidates = [store / "blobs" / f"sha256-{digest[1]}", store / "blobs" / f"sha256:{digest[1]}"]
    blob = next((path for path in candidates if path.is_file()), None)
    if blob is None:
        raise ModelError(f"{where}: its blob is missing (no {candidates[0]}); {pull} fetches it again")
    size, expected = blob.stat().st_size, layer.get("size")
    if isinstance(expected, int) and size != expected:
        raise ModelError(f"{where}: its blob {blob} is {size} bytes, its manifest says {expected} (an interrupted pull?); {pull} completes it")
    return blob


def _layer_bytes(store: Path, layer: dict, limit: int, where: str, manifest_path: Path, pull: str) -> bytes:
    """A small layer's blob, whole; ModelError naming ``where`` if it is over ``limit`` bytes (refused unread)."""
    blob = _blob(store, layer, where, manifest_path, pull)
    with open(blob, "rb") as f:
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise ModelError(f"{where}: its blob {blob} is over {limit} bytes, where such a layer is a few kilobytes; is the store damaged? {pull} fetches it again")
    return raw


def _layer_text(store: Path, layer: dict, limit: int, where: str, manifest_path: Path, pull: str) -> str:
    raw = _layer_bytes(store, layer, limit, where, manifest_path, pull)
    try:
        return raw.decode()
    except UnicodeDecodeError as e:
        raise ModelError(f"{where}: not UTF-8 text ({e}); {pull} fetches it again") from None
