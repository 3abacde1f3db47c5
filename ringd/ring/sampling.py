"""A request's sampling parameters, as the API parses them and the last stage reads them.

They travel with a request's first frame as a plain dict (``to_wire`` /
``from_wire``); any flaw, from a client or from a peer, is a ``SamplingError``
that names its field. The sampling itself (MLX, mlx-lm's processors) is the
last stage's: ``stage/sampling.py``. Nothing here imports MLX.
"""

from __future__ import annotations

import json
import math
import reprlib
from dataclasses import asdict, dataclass, fields

from wire.frames import MAX_DESCRIPTOR_BYTES

# A grammar travels in its request's first FORWARD frame, whose JSON descriptor is
# at most MAX_DESCRIPTOR_BYTES (64 KiB) together with a prefill chunk of token ids
# (512 by default: under 4 KiB) and the sampling parameters (a full logit_bias: ~5
# KiB). Half of the descriptor is the grammar's, measured as the frame spells it
# (JSON-escaped: a quote is two bytes, a non-ASCII character six).
MAX_GRAMMAR_BYTES = MAX_DESCRIPTOR_BYTES // 2
# OpenAI allows at most 20 alternatives per position; more would bloat every
# TOKEN frame for no use.
MAX_TOP_LOGPROBS = 20
# Largest logit_bias map OpenAI accepts.
MAX_LOGIT_BIAS_ENTRIES = 300


def _integer(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def number_value(v: object) -> bool:
    """A JSON number that arithmetic can use: an int (not a bool) or a finite float.

    Ints are finite whatever their size; ``math.isfinite`` would overflow
    converting a 400-digit one to a float.
    """
    return _integer(v) or (isinstance(v, float) and math.isfinite(v))


# Error messages quote what was sent; reprlib keeps a 16 MB string or a
# 4,000-digit number from coming back whole.
_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = _SHOW.maxlong = 60


def brief_repr(v: object) -> str:
    """repr(v), shortened: for error messages that quote what a client sent."""
    return _SHOW.repr(v)


def wire_bytes(grammar: str) -> int:
    """The bytes ``grammar`` takes in a frame's descriptor (JSON, ASCII-escaped, as wire.frames writes it)."""
    return len(json.dumps(grammar))


class SamplingError(ValueError):
    """A sampling parameter is out of range; the message names it, ``field`` too.

    ``field`` is the request field at fault (``"top_k"``, ``"logit_bias"``), so
    the API can answer 400 with OpenAI's ``param``; None when no single field is.
    """

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    grammar: str | None = None  # llguidance's grammar (grammar.py) the answer must follow

    def __post_init__(self):
        def need(ok: bool, name: str, rule: str):
            if not ok:
                raise SamplingError(f"{name} must be {rule}, got {brief_repr(getattr(self, name))}", name)

        def number(name: str) -> bool:
            return number_value(getattr(self, name))

        need(number("temperature") and 0 <= self.temperature <= 2, "temperature", "between 0 and 2")
        need(number("top_p") and 0 < self.top_p <= 1, "top_p", "in (0, 1]")
        need(_integer(self.top_k) and self.top_k >= 0, "top_k", "an integer >= 0")
        need(number("min_p") and 0 <= self.min_p <= 1, "min_p", "in [0, 1]")
        need(
            self.seed is None or (_integer(self.seed) and 0 <= self.seed < 2**63),
            "seed",
            "an integer in [0, 2^63)",
        )
        need(isinstance(self.logprobs, bool), "logprobs", "a boolean")
        need(
            _integer(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
            "top_logprobs",
            f"an integer from 0 to {MAX_TOP_LOGPROBS}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            need(number(name) and -2 <= getattr(self, name) <= 2, name, "between -2 and 2")
        need(
            number("repetition_penalty") and 0 <= self.repetition_penalty <= 10,
            "repetition_penalty",
            "between 0 and 10 (0 or 1 for none)",
        )
        if self.logit_bias is not None:
            need(
                isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_LOGIT_BIAS_ENTRIES,
                "logit_bias",
                f"a map of at most {MAX_LOGIT_BIAS_ENTRIES} token ids to biases",
            )
            for k, v in self.logit_bias.items():
                if not (_integer(k) and k >= 0 and number_value(v) and -100 <= v <= 100):
                    raise SamplingError(
                        f"logit_bias entry {brief_repr(k)}: {brief_repr(v)} must map a token id to a bias in [-100, 100]",
                        "logit_bias",
                    )
        if self.grammar is not None:
            need(
                isinstance(self.grammar, str) and wire_bytes(self.grammar) <= MAX_GRAMMAR_BYTES,
                "grammar",
                f"a grammar string of at most {MAX_GRAMMAR_BYTES} bytes (as a frame carries it)",
            )

    @property
    def verifiable(self) -> bool:
        """Whether a draft's proposals can be checked for this request, every position of a verify
        row at once: nothing that follows the tokens sampled (penalties, a grammar), whose
        distribution at one proposal would depend on the proposals before it. Greedy requests keep
        the proposals that agree; sampled ones use speculative sampling (stage/sampling.py)."""
        return self.grammar is None and not (self.presence_penalty or self.frequency_penalty or self.repetition_penalty)

    def to_wire(self) -> dict:
        d = asdict(self)
        if self.logit_bias is not None:
            d["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        if self.grammar is None:
            del d["grammar"]  # most requests have none: their frames stay as they were
        return d

    @classmethod
    def from_wire(cls, d: object) -> "SamplingParams":
        """Parse parameters that came over the network; any flaw is a SamplingError."""
        if not isinstance(d, dict):
            raise SamplingError("sampling parameters must be an object")
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise SamplingError(f"unknown sampling parameters: {brief_repr(sorted(map(str, unknown)))}")
        d = dict(d)
        if isinstance(d.get("logit_bias"), dict):
            try:
                d["logit_bias"] = {int(k): v for k, v in d["logit_bias"].items()}
            except (TypeError, ValueError):
                raise SamplingError("logit_bias keys must be token ids", "logit_bias") from None
        return cls(**d)

    def check_vocab(self, vocab_size: int) -> None:
        """What only the model can tell: token ids and top_k against its vocabulary."""
        # mlx-lm's apply_top_k raises for k >= V (k = V would keep every token,
        # as 0 does): refused here, before the request reaches the last stage.
        if self.top_k >= vocab_size:
            raise SamplingError(
                f"top_k must be below the vocabulary size {vocab_size} (0 turns it off), got {brief_repr(self.top_k)}", "top_k"
            )
        for k in self.logit_bias or {}:
            if k >= vocab_size:
                raise SamplingError(f"logit_bias token id {k} is outside the vocabulary of {vocab_size}", "logit_bias")
