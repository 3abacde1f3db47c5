"""Ollama's options, as a request's ``options`` and a model's params layer spell them.

Ollama keeps a model's ``PARAMETER`` lines as a JSON object, the blob of its
``application/vnd.ollama.image.params`` layer (``{"stop": ["<|im_end|>"],
"temperature": 0.7, "num_ctx": 8192}``), and merges a request's ``options`` over
it key by key (``api/types.go``: ``Options.FromMap``, first the model's map, then
the request's). One table of the options Ollama knows and their types serves both:
``ollama_api.py`` checks a request's with it, ``params_defaults`` turns a layer's
into the ``ModelDefaults`` every API's requests fall back to.

A layer is held to what Ollama does with it, and said so at start:

- not JSON, or not an object: Ollama cannot load the model; here a ``ModelError``
  naming the layer;
- an option of the wrong type (``"num_ctx": "big"``): Ollama fails every request
  with the model; here a ``ModelError`` at start;
- a value ringd's sampling does not take (a temperature of 5, a negative
  num_predict other than -1/-2): a ``ModelError`` naming the option;
- an option Ollama does not know: Ollama logs a warning and ignores it; so does
  ringd (``warnings``);
- sampling ringd does not do (mirostat, typical_p other than off): ignored with a
  warning, the model served without it;
- load-time settings (num_gpu, num_thread, num_batch, use_mmap, ...), num_keep,
  repeat_last_n, tfs_z, penalize_newline: type-checked, no effect (a ring loads
  its model its own way).

Pure: bytes in, values out.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ringd.models.defaults import SAMPLED, ModelDefaults
from ringd.models.errors import ModelError
from ringd.ring.sampling import SamplingError, SamplingParams, brief_repr

# Options ringd samples with: Ollama's name -> SamplingParams' field.
SAMPLED_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
assert set(SAMPLED_OPTIONS.values()) == set(SAMPLED), "every sampled option is a default a model may set"
# Each option Ollama knows, with the type Ollama's Options struct gives it.
OPTION_TYPES: dict[str, type] = {
    # load time: how one process loads its model; a ring loads its own way
    "numa": bool, "num_ctx": int, "num_batch": int, "num_gpu": int, "main_gpu": int, "low_vram": bool,
    "f16_kv": bool, "logits_all": bool, "vocab_only": bool, "use_mmap": bool, "use_mlock": bool,
    "embedding_only": bool, "num_thread": int,
    # run time
    "num_keep": int, "seed": int, "num_predict": int, "top_k": int, "top_p": float, "min_p": float,
    "tfs_z": float, "typical_p": float, "repeat_last_n": int, "temperature": float, "repeat_penalty": float,
    "presence_penalty": float, "frequency_penalty": float, "mirostat": int, "mirostat_tau": float,
    "mirostat_eta": float, "penalize_newline": bool, "stop": list,
}  # fmt: skip
# Sampling ringd does not do, and the value that turns it off (the only one a request may send).
UNSUPPORTED_OPTIONS = {"mirostat": 0, "typical_p": 1.0}
# num_predict values that mean "until the context ends": Ollama's -1 (infinite)
# and -2 (fill the context), and 0, which Ollama's own client sends for "unset".
UNTIL_CONTEXT_ENDS = (-1, -2, 0)

# A params layer is a few PARAMETER lines, about a hundred bytes; a few stop words more at
# most. Past this it is no params layer, and is refused before it is read.
MAX_PARAMS_BYTES = 64 << 10


class OptionError(ValueError):
    """An option of the wrong type; the message is Ollama's ('option "top_k" must be of type integer')."""


def integral(v: Any) -> bool:
    """A JSON number Ollama reads as an integer: Go's decoder gives every number as a float."""
    if isinstance(v, bool):
        return False
    return isinstance(v, int) or (isinstance(v, float) and math.isfinite(v) and v.is_integer())


def checked_option(name: str, value: Any) -> Any:
    """``value`` as option ``name`` (a known one, not null) takes it; OptionError if of the wrong type.

    A list option (stop) is checked for its type only: what its items may be is the caller's rule.
    """
    kind = OPTION_TYPES[name]
    if kind is int and not integral(value):
        raise OptionError(f'option "{name}" must be of type integer; got {brief_repr(value)}')
    if kind is float and not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)):
        raise OptionError(f'option "{name}" must be of type float; got {brief_repr(value)}')
    if kind is bool and not isinstance(value, bool):
        raise OptionError(f'option "{name}" must be of type boolean; got {brief_repr(value)}')
    if kind is list and not isinstance(value, (list, str)):  # a lone stop word is taken as a list of one
        raise OptionError(f'option "{name}" must be of type array; got {brief_repr(value)}')
    return int(value) if kind is int else value


def sampling_of(checked: dict[str, Any]) -> dict[str, Any]:
    """The SamplingParams fields that checked options set: a negative seed is Ollama's
    "random" (no seed), a negative top_k its "off" (0)."""
    sampling = {SAMPLED_OPTIONS[k]: checked[k] for k in SAMPLED_OPTIONS if k in checked}
    if sampling.get("seed", 0) < 0:
        del sampling["seed"]
    if sampling.get("top_k", 0) < 0:
        sampling["top_k"] = 0
    return sampling


def layer_options(raw: bytes, where: str) -> dict[str, Any]:
    """A params layer's blob as the JSON object it is; ModelError naming ``where`` if it is none."""
    if len(raw) > MAX_PARAMS_BYTES:
        raise ModelError(f"{where} is over {MAX_PARAMS_BYTES} bytes, where a params layer is a few hundred; `ollama show --modelfile` shows its PARAMETER lines")
    try:
        options = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ModelError(f"{where} is not JSON ({e}); Ollama could not load this model either: `ollama create` it again") from None
    if not isinstance(options, dict):
        raise ModelError(f"{where} must be a JSON object of options; got {brief_repr(options)}")
    return options


def params_defaults(options: dict[str, Any], where: str, source: str = "") -> tuple[ModelDefaults, list[str]]:
    """What a params layer's options (merged, in the manifest's order) make a request's defaults,
    and a warning for each option ignored; ModelError naming ``where`` and the option for one that
    cannot be used (see the module's docstring)."""
    warnings: list[str] = []
    checked: dict[str, Any] = {}
    for name, value in options.items():
        if name not in OPTION_TYPES:
            warnings.append(f"{where}: option {brief_repr(name)} is not one Ollama knows; ignored, as Ollama ignores it")
            continue
        if value is None:
            continue  # Ollama skips a null
        try:
            checked[name] = checked_option(name, value)
        except OptionError as e:
            raise ModelError(f"{where}: {e} (Ollama would fail every request with this model)") from None
    for name, off in UNSUPPORTED_OPTIONS.items():
        if checked.pop(name, off) != off:
            warnings.append(f"{where}: option {name!r} asks for sampling ringd does not do; ignored, the model samples without it")
    sampling = sampling_of(checked)
    try:
        SamplingParams(**sampling)
    except SamplingError as e:
        option = next(name for name, f in SAMPLED_OPTIONS.items() if f == e.field)
        raise ModelError(f"{where}: option {option!r}: {str(e).replace(e.field or '', option, 1)}") from None
    stop = checked.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not all(isinstance(s, str) and s for s in stop):
            raise ModelError(f"{where}: option \"stop\" must be a list of non-empty strings; got {brief_repr(stop)}")
    predict = checked.get("num_predict")
    if predict is not None and predict < -2:
        raise ModelError(f"{where}: option \"num_predict\" must be a number of tokens, or -1 for until the context ends; got {predict}")
    num_ctx = checked.get("num_ctx")
    defaults = ModelDefaults(
        sampling=sampling,
        stop=None if stop is None else tuple(stop),
        max_tokens=None if predict is None or predict in UNTIL_CONTEXT_ENDS else predict,
        context=num_ctx if num_ctx is not None and num_ctx > 0 else None,  # Ollama's 0: its default
        source=source,
    )
    return defaults, warnings
