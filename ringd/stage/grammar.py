"""Grammars for constrained decoding: compile them, check them, mask logits with them.

A grammar is llguidance's string form (a JSON schema or a Lark grammar wrapped
in its JSON envelope). The leader makes it (``from_json_schema``, ``from_lark``)
and checks it against the model's tokenizer (``check``) before the request is
admitted, so a schema llguidance cannot compile is the client's 400, not a
failure mid-stream. It then travels with the request's sampling parameters to
the last stage, where a ``Constraint`` follows the tokens generated so far and
sets every token the grammar forbids next to -inf before sampling.

The mask of the next step is computed by llguidance on a thread of its own
(it releases the GIL) as soon as the previous token is known, while MLX
computes the step's logits; ``mask`` collects it. A grammar's end lets every
end token of the model through, so the engine stops as it would unconstrained.

It knows nothing of the network, of HTTP or of requests' fields beyond the
``where`` it is told to name in its errors.
"""

from __future__ import annotations

import json
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher, LLParserLimits, LLTokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from ringd.ring.sampling import MAX_GRAMMAR_BYTES, wire_bytes

# Threads computing masks. Requests are sampled one at a time on a node's one
# compute thread, so at most one mask is ever wanted at once; one thread overlaps
# it with MLX's step.
MASK_THREADS = 1
# The JSON a schema grammar makes: one line, the separators people write, so the
# model's usual tokens fit it and two runs spell it the same.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's default limits, but with short errors: the verbose ones quote the
# parser's state and the whole grammar, which a client's 400 need not carry.
_LIMITS = LLParserLimits(verbose_errors=False)

_masks = ThreadPoolExecutor(max_workers=MASK_THREADS, thread_name_prefix="ringd-grammar")


class GrammarError(ValueError):
    """A grammar cannot be compiled or followed; ``where`` is the request field it came from."""

    def __init__(self, message: str, where: str):
        super().__init__(message)
        self.where = where


def _bounded(grammar: str, where: str) -> str:
    size = wire_bytes(grammar)
    if size > MAX_GRAMMAR_BYTES:
        raise GrammarError(
            f"{where} is {size} bytes as a grammar, over the limit of {MAX_GRAMMAR_BYTES}; send a smaller schema",
            where,
        )
    return grammar


def from_json_schema(schema: dict, where: str) -> str:
    """The grammar of JSON that ``schema`` accepts, in ringd's layout (``JSON_LAYOUT``)
    unless the schema names its own (``x-guidance``). Compiled only by ``check``."""
    if not isinstance(schema, dict):
        raise GrammarError(f"{where} must be a JSON schema object, got {type(schema).__name__}", where)
    try:
        text = json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"{where} is not JSON: {e}", where) from None
    # Refused before llguidance copies it, let alone compiles it.
    _bounded(text, where)
    try:
        grammar = LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
    except ValueError as e:
        raise GrammarError(f"{where} could not be compiled: {e}", where) from None
    return _bounded(grammar, where)


def json_object(where: str = "response_format") -> str:
    """Any JSON object (OpenAI's ``json_object`` response format)."""
    return from_json_schema({"type": "object"}, where)


def from_lark(text: str, where: str) -> str:
    """The grammar of a Lark text (llguidance's dialect: ``%json {...}`` embeds a schema)."""
    if not isinstance(text, str):
        raise GrammarError(f"{where} must be a Lark grammar string, got {type(text).__name__}", where)
    _bounded(text, where)
    return _bounded(LLMatcher.grammar_from_lark(text), where)


def check(grammar: str, tokenizer, vocab_size: int, where: str) -> None:
    """Compile ``grammar`` against the model's tokenizer (mlx-lm's TokenizerWrapper, or an
    LLTokenizer); a GrammarError naming ``where`` if it does not. Warnings pass.

    CPU-bound (milliseconds, up to a second for a huge schema): call it off the event loop.
    """
    _bounded(grammar, where)
    ll = tokenizer if isinstance(tokenizer, LLTokenizer) else ll_tokenizer(tokenizer, vocab_size)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, ll, limits=_LIMITS)
    if is_error:
        raise GrammarError(f"{where} could not be compiled: {'; '.join(m.strip() for m in messages)}", where)


_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {vocab_size: LLTokenizer}
_tokenizers_lock = threading.Lock()  # the leader's check and the last stage may both build the first one


def ll_tokenizer(tokenizer, vocab_size: int) -> LLTokenizer:
    """llguidance's view of ``tokenizer`` for a model of ``vocab_size`` logits, built once per
    tokenizer object (0.3 s for a 49k vocabulary; about a second for the largest).

    ``tokenizer``: mlx-lm's TokenizerWrapper (or the Hugging Face fast tokenizer inside it).
    Every end token the wrapper knows is the grammar's end, since the engine stops on each.
    """
    if tokenizer is None:
        raise GrammarError("constrained decoding needs the model's tokenizer, which is not loaded (yet)", "tokenizer")
    with _tokenizers_lock:
        built = _tokenizers.setdefault(tokenizer, {})
        ll = built.get(vocab_size)
        if ll is None:
            ll = built[vocab_size] = _build(tokenizer, vocab_size)
        return ll


def _build(tokenizer, vocab_size: int) -> LLTokenizer:
    import llguidance.hf  # transformers: loaded by the first grammar, not by every node
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    if isinstance(tokenizer, TokenizerWrapper):
        hf, eos = tokenizer._tokenizer, sorted(tokenizer.eos_token_ids)
    else:
        hf, eos = tokenizer, [tokenizer.eos_token_id]
    try:
        return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
    except ValueError as e:
        raise GrammarError(f"constrained decoding needs a fast Hugging Face tokenizer: {e}", "tokenizer") from None


class Constraint:
    """One request's grammar state on the last stage: which tokens may come next.

    ``consume`` the tokens generated (each, as it is fed back), ``mask`` the logits
    before sampling. The mask for a step reflects exactly the tokens consumed
    before it: it is started when the last of them is consumed and waited for.
    Not thread-safe: one request's steps run in order on the compute thread.
    """

    def __init__(self, tokenizer: LLTokenizer, grammar: str, where: str = "grammar"):
        self.where = where
        # Compiling (milliseconds; more for a huge schema) drops the GIL; a grammar that does
        # not compile leaves the matcher in error.
        self._matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=_LIMITS)
        self._raise_if_error()
        self._vocab_size = tokenizer.vocab_size
        self._bitmask = allocate_token_bitmask(1, self._vocab_size)
        self._pending: Future | None = None  # the mask being computed for the tokens consumed
        self._ready = False  # _bitmask is the mask for the tokens consumed

    @property
    def accepting(self) -> bool:
        """The tokens so far are a whole sentence of the grammar (an end token may come)."""
        self._settle()
        return self._matcher.is_accepting()

    def consume(self, tokens: list[int]) -> None:
        """Tokens generated and fed back; starts computing the next mask."""
        self._settle()  # the matcher is not touched while a mask of it is computed
        self._ready = False
        if self._matcher.consume_tokens(tokens):
            self._pending = _masks.submit(fill_next_token_bitmask, self._matcher, self._bitmask)
        # else: in error; mask() says so

    def mask(self, logits: mx.array) -> mx.array:
        """``logits`` ([1, V]) with the tokens the grammar forbids next at -inf.

        Start MLX on the logits (``mx.async_eval``) before calling: the wait here overlaps it.
        """
        if logits.shape[-1] != self._vocab_size:
            raise ValueError(f"logits of {logits.shape[-1]} tokens, but the grammar's tokenizer has {self._vocab_size}")
        self._settle()
        self._raise_if_error()
        if not self._ready:
            fill_next_token_bitmask(self._matcher, self._bitmask)  # the first step: nothing consumed yet
            self._ready = True
        allowed = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self._vocab_size]
        if not allowed.any():
            raise GrammarError("the grammar allows no token here", self.where)
        return mx.where(mx.array(allowed.view(np.bool_))[None], logits, -mx.inf)

    def _settle(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()  # an llguidance API error comes out here
            self._ready = True

    def _raise_if_error(self) -> None:
        if self._matcher.is_error():
            raise GrammarError(f"the answer left its grammar: {self._matcher.get_error()}", self.where)

