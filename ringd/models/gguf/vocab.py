"""A GGUF file's tokenizer, rebuilt from its metadata as Hugging Face tokenizer files.

A GGUF has no ``tokenizer.json``. It carries the vocabulary under llama.cpp's keys
(tokens, token types, merges or scores, special token ids and flags) and only
*names* the pre-tokenizer (``tokenizer.ggml.pre``), whose regexes live in llama.cpp's
code. ``tokenizer_files(meta)`` turns that metadata into ``tokenizer.json``,
``tokenizer_config.json`` and ``special_tokens_map.json``, which mlx-lm's
``load_tokenizer`` reads like a checkpoint's own, so that the result encodes as
llama.cpp encodes the same file:

- ``gpt2`` (byte-level BPE: Llama 3, Qwen2/3, SmolLM2, Mistral's tekken): the
  vocabulary and merges as the file has them, the pre-tokenizer regexes of the
  file's ``tokenizer.ggml.pre`` (``PRE_TOKENIZERS``, from llama.cpp), byte-level
  decoding;
- ``llama`` (SentencePiece BPE: Llama 2, Mistral 7B, Gemma 1/2/3/3n, Phi-3 and
  Phi-3.5): merges recovered from the scores (as transformers' SentencePiece
  converters do, and as llama.cpp ranks its merges), byte fallback to the ``<0xNN>``
  tokens, ``▁`` for spaces and one before the text unless the file says not to
  (Gemma's do), as SentencePiece itself encodes. Gemma's runs of spaces and newlines
  are user-defined tokens that the converter spells with real spaces: matched whole
  in the text, longest first, as llama.cpp and SentencePiece match them (not merged
  as BPE, as transformers' own Gemma builder does). A file named Phi-3 has the
  whitespace after its added tokens stripped, as llama.cpp does for that name.

Every token keeps its index in the file as its id and the vocabulary keeps the
file's size, so ids mean the same to the model's embeddings as to llama.cpp.
Control tokens (``<|im_end|>``) become special added tokens, user-defined ones
(``<think>``) plain added tokens, so either is matched whole in the text.

What it ignores: the file itself (the caller reads the metadata), other tokenizer
models (WordPiece, Unigram, RWKV, ...) and pre-tokenizers that llama.cpp implements
in code rather than as regexes (kimi-k2, afmoe, ...): those are refused, naming what
works. Named extra chat templates (``tokenizer.chat_template.<name>``) are left out:
mlx-lm infers its tool-call parser from the default template only when that is a
single string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from ringd.models.errors import ModelError

# ------------------------------------------------------------ pre-tokenizers
#
# From llama.cpp's src/llama-vocab.cpp (ggml-org/llama.cpp; the copy vendored in
# ollama/ollama agrees): `llm_tokenizer_bpe`'s regex table, and the name -> type
# mapping with its flags in `llama_vocab::impl::load`. llama.cpp applies a list of
# regexes in turn, each splitting the pieces the previous one made, every match and
# every gap between matches a piece of its own: a Sequence of `Split(..., "isolated")`.
# Where llama.cpp rewrote a regex for its own engine (case-insensitive contractions
# spelled out, upper and lower case approximated as "a letter but not a-z/A-Z"),
# this is the original from the model's tokenizer.json that it quotes in a comment:
# the `tokenizers` engine (Oniguruma) runs it as is. The two cut text alike except
# where the approximation errs (tekken, gpt-4o: a non-ASCII capital such as the É of
# "ÉCOLE" counts as lowercase there); there this follows the model.

# GPT-2's, without its final `|\s+`: whitespace that it leaves is a gap, a piece anyway.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",  # CJK ideographs, hiragana, katakana
    (
        r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
)
# DeepSeek LLM's letters: Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee and
# other cased scripts, as code point ranges (escaped: some look like ASCII).
_DEEPSEEK_LLM_LETTERS = (
    "A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
    "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"  # CJK ideographs and before, Hangul
_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[" + _DEEPSEEK_LLM_LETTERS + "]+",
    r"\s?[!-/:-~" + "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002" + "]+",  # ASCII and full-width punctuation
    r"\s+$",  # only ever sees pieces without newlines (the first split isolates them)
    _DEEPSEEK_CJK,
    r"\p{N}+",
)
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}")


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text before the merges, for one family of ``tokenizer.ggml.pre``."""

    splits: tuple[str, ...]  # regexes applied in turn, each splitting the pieces of the one before
    # A piece that is a token of the vocabulary is taken whole, merges or not
    # (llama.cpp's ignore_merges, HF's BPE ignore_merges as in Llama 3's tokenizer.json).
    ignore_merges: bool = False
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))
_GPT2_FAMILY = PreTokenizer((_GPT2,))
_LLAMA3_FAMILY = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_LLAMA3_REGEX = PreTokenizer((_LLAMA3,))  # the same split, without llama3's flags
_QWEN2_FAMILY = PreTokenizer((_QWEN2,))
_SMOLLM_FAMILY = PreTokenizer((r"\p{N}", _GPT2))  # every digit alone, then GPT-2's split
_TEKKEN_FAMILY = PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True)
_GPT4O_FAMILY = PreTokenizer((_GPT4O,))

# tokenizer.ggml.pre -> how to split. A name missing here is refused, listing these.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _DEFAULT,
    **dict.fromkeys(
        ["gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4", "gigachat", "a.x-4.0", "mellum"],
        _GPT2_FAMILY,
    ),
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"], _LLAMA3_FAMILY
    ),
    **dict.fromkeys(["dbrx", "smaug-bpe", "glm4", "chatglm-bpe"], _LLAMA3_REGEX),
    **dict.fromkeys(
        ["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"], _QWEN2_FAMILY
    ),
    "qwen35": PreTokenizer((_QWEN35,)),
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"], _SMOLLM_FAMILY
    ),
    "tekken": _TEKKEN_FAMILY,
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O_FAMILY),
    **dict.fromkeys(["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"], PreTokenizer(_DEEPSEEK_V3)),
    "deepseek-llm": PreTokenizer(_DEEPSEEK_LLM),
    "deepseek-coder": PreTokenizer(_DEEPSEEK_CODER),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
}

# ------------------------------------------------------------------ vocabularies

TOKENIZER_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece BPE"}

SPM_SPACE = "\u2581"  # "▁": SentencePiece's spelling of a space inside tokens
# llama.cpp's special token ids for a SentencePiece vocabulary whose file names none
# (llama_vocab::impl::load): Llama's <unk>, <s>, </s>.
_SPM_DEFAULT_IDS = {"unknown": 0, "bos": 1, "eos": 2}
# llama.cpp strips the whitespace after Phi-3's added tokens (the rstrip of Phi-3's
# tokenizer.json, which a GGUF does not carry) and knows Phi-3 by its name: llama_vocab::impl::load
# sets LLAMA_TOKEN_ATTR_RSTRIP on every special and user-defined token but these when
# general.name, lowercased, contains "phi-3" or "phi3" (whatever the architecture).
_RSTRIP_NAMES = ("phi-3", "phi3")
_RSTRIP_EXCEPT = frozenset({"<unk>", "<s>", "<|endoftext|>"})


def tokenizer_files(meta: Mapping[str, Any]) -> dict[str, dict]:
    """The tokenizer described by a GGUF file's metadata, as the files of a checkpoint.

    ``meta`` maps GGUF keys to plain values (``tokenizer.ggml.tokens`` a list of
    str, ...), as ``GGUFReader`` fields' ``contents()`` give them. Returns
    ``{"tokenizer.json": ..., "tokenizer_config.json": ..., "special_tokens_map.json": ...}``,
    each a JSON object to write as is. Raises ModelError for a vocabulary ringd
    cannot rebuild (unknown tokenizer model or pre-tokenizer, no tokens).
    """
    model = meta.get("tokenizer.ggml.model")
    if model not in TOKENIZER_MODELS:
        known = ", ".join(f"{name!r} ({what})" for name, what in TOKENIZER_MODELS.items())
        what = "is missing" if model is None else f"{model!r} is not known to ringd"
        raise ModelError(f"tokenizer.ggml.model {what}; known: {known}")
    tokens = _tokens(meta)
    types = _token_types(meta, len(tokens))
    special = _special_ids(meta, model, len(tokens))
    if model == "gpt2":
        tokenizer = _byte_level(meta, tokens, _pre_tokenizer(meta))
    else:
        tokenizer = _sentencepiece(meta, tokens, types, special.get("unknown"))
    add_bos = adds_bos(meta)
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))

    # Control and unknown tokens are special (skipped by decode(skip_special_tokens=True)),
    # user-defined ones are not. Every one is already in the vocabulary under its own
    # spelling, so adding it gives no new id: it only makes it matched whole in text,
    # as llama.cpp matches them, before the pre-tokenizer could cut it.
    special_types = (TokenType.CONTROL, TokenType.UNKNOWN)
    rstrip = _rstrips(meta)
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False, rstrip=rstrip and t not in _RSTRIP_EXCEPT)
            for t, k in zip(tokens, types)
            if k in special_types
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, special=False, normalized=False, rstrip=rstrip and t not in _RSTRIP_EXCEPT)
            for t, k in zip(tokens, types)
            if k == TokenType.USER_DEFINED
        ]
    )
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    assert size == len(tokens), f"rebuilt tokenizer has {size} tokens, the file {len(tokens)}"  # all were in the vocab

    names = {role: tokens[i] for role, i in special.items()}
    for flag, role, value in (("add_bos_token", "bos", add_bos), ("add_eos_token", "eos", add_eos)):
        if value and role not in names:
            raise ModelError(
                f"tokenizer.ggml.{flag} is true but the file names no {role} token (tokenizer.ggml.{role}_token_id)"
            )
    bos, eos = (names["bos"] if add_bos else None), (names["eos"] if add_eos else None)
    template = _template(bos, eos, tokenizer)
    if model == "gpt2":
        byte_level = processors.ByteLevel(trim_offsets=False)
        tokenizer.post_processor = processors.Sequence([byte_level, template]) if add_bos or add_eos else byte_level
    else:
        tokenizer.post_processor = template

    return {
        "tokenizer.json": json.loads(tokenizer.to_str()),
        "tokenizer_config.json": _tokenizer_config(meta, names, add_bos, add_eos),
        "special_tokens_map.json": {f"{role}_token": names[role] for role in ("bos", "eos", "unk", "pad") if role in names},
    }


def _tokens(meta: Mapping[str, Any]) -> list[str]:
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelError(
            "the GGUF file has no tokenizer.ggml.tokens: ringd rebuilds the tokenizer from the vocabulary in "
            "the file (llama.cpp's convert_hf_to_gguf.py writes it); serve the original checkpoint instead"
        )
    seen: dict[str, int] = {}
    out = []
    for i, token in enumerate(tokens):
        token = str(token) or f"[EMPTY_{i}]"  # llama.cpp's name for an empty token
        if token in seen:
            raise ModelError(
                f"tokenizer.ggml.tokens has {token!r} twice (ids {seen[token]} and {i}); llama.cpp refuses it too"
            )
        seen[token] = i
        out.append(token)
    return out


def _rstrips(meta: Mapping[str, Any]) -> bool:
    """Whether llama.cpp strips the whitespace after this file's added tokens (Phi-3's, by name).

    llama.cpp strips ASCII whitespace there; tokenizers' rstrip strips any Unicode
    whitespace, so the two differ only where one such as U+3000 follows the token.
    """
    name = str(meta.get("general.name") or "").lower()
    return any(part in name for part in _RSTRIP_NAMES)


def _token_types(meta: Mapping[str, Any], n: int) -> list[int]:
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        return [TokenType.NORMAL] * n  # llama.cpp: every token normal
    if len(types) < n:
        raise ModelError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
    return [int(t) for t in types[:n]]


def _special_ids(meta: Mapping[str, Any], model: str, n: int) -> dict[str, int]:
    """bos/eos/unk/pad -> id, for the ones the file names (or llama.cpp assumes) within the vocabulary."""
    ids = {}
    for role, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        if value is None and model == "llama":
            value = _SPM_DEFAULT_IDS.get(key)
        # llama.cpp ignores an id outside the vocabulary (with a warning), and so do we.
        if value is not None and 0 <= int(value) < n:
            ids[role] = int(value)
    return ids


def _pre_tokenizer(meta: Mapping[str, Any]) -> PreTokenizer:
    # No name: llama.cpp falls back to "default" (warning that quality will suffer).
    name = meta.get("tokenizer.ggml.pre") or "default"
    if name not in PRE_TOKENIZERS:
        raise ModelError(
            f"tokenizer.ggml.pre {name!r} is not known to ringd; known: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    return PRE_TOKENIZERS[name]


def _byte_level(meta: Mapping[str, Any], tokens: list[str], pre: PreTokenizer) -> Tokenizer:
    """Byte-level BPE: the file's tokens are already in GPT-2's byte-to-character spelling."""
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise ModelError(
            "tokenizer.ggml.merges is missing: a byte-level BPE vocabulary (tokenizer.ggml.model 'gpt2') needs its merges"
        )
    pairs = []
    for i, merge in enumerate(merges):
        # llama.cpp splits at the first space after the first character.
        cut = merge.find(" ", 1)
        if cut < 0:
            raise ModelError(f"tokenizer.ggml.merges[{i}] {merge!r} is not two tokens separated by a space")
        pairs.append((merge[:cut], merge[cut + 1 :]))
    vocab = {token: i for i, token in enumerate(tokens)}
    try:
        model = models.BPE(vocab, pairs, ignore_merges=pre.ignore_merges)
    except Exception as e:  # tokenizers raises its own type for a merge of tokens not in the vocabulary
        raise ModelError(f"the merges in tokenizer.ggml.merges do not fit tokenizer.ggml.tokens: {e}") from e
    tokenizer = Tokenizer(model)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
    # The regexes split the text; ByteLevel then only respells each piece's bytes.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    # mlx-lm picks its byte-level streaming detokenizer from this decoder's type.
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(meta: Mapping[str, Any], tokens: list[str], types: list[int], unk_id: int | None) -> Tokenizer:
    """SentencePiece BPE: merges from the scores, bytes for what no token spells, ▁ for spaces."""
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) < len(tokens):
        raise ModelError(
            "tokenizer.ggml.scores is missing or shorter than the vocabulary: a SentencePiece vocabulary "
            "(tokenizer.ggml.model 'llama') needs a score per token to order its merges"
        )
    vocab = {token: i for i, token in enumerate(tokens)}
    model = models.BPE(
        vocab,
        _spm_merges(tokens, [float(s) for s in scores], types),
        unk_token=tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(model)
    # llama.cpp (like SentencePiece) puts a space before the text, and after each
    # special token, unless the file says not to, then spells every space "▁". A
    # normalizer does the same: it runs on each stretch of text between added tokens.
    # (Not the Metaspace pre-tokenizer of newer Llama/Mistral tokenizer.json files:
    # it prepends nothing to text that starts with a space, so " hi" would lose one.)
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    spaces = [normalizers.Prepend(SPM_SPACE)] if space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*spaces, normalizers.Replace(" ", SPM_SPACE)])
    # This exact sequence is how mlx-lm recognizes SentencePiece and picks its
    # streaming detokenizer (the one without Strip when no space was prepended).
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies, in the order its scores rank them.

    Every way to cut a normal token into two normal tokens is a merge, ranked by the
    merged token's score, highest first; ties go to the longer left part, then the
    longer right part (transformers' ``generate_merges``, which its SentencePiece
    converters and GGUF loader use). Only normal tokens take part, as in
    SentencePiece: control and user-defined tokens are matched whole as added
    tokens, byte tokens only stand in for what no token spells.
    """
    normal = {t: i for i, t in enumerate(tokens) if types[i] == TokenType.NORMAL}
    found = []
    for token, i in normal.items():
        cuts = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in normal and token[k:] in normal]
        cuts.sort(key=lambda pair: (normal[pair[0]], normal[pair[1]]))
        found.extend((scores[i], left, right) for left, right in cuts)
    found.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)  # stable: equal keys keep token order
    return [(left, right) for _, left, right in found]


def adds_bos(meta: Mapping[str, Any]) -> bool:
    """Whether llama.cpp puts BOS before a prompt of this file: as it says, else the default of its
    tokenizer (a byte-level BPE's pre-tokenizer family; BOS for SentencePiece unless told otherwise)."""
    if meta.get("tokenizer.ggml.model") == "gpt2":
        return bool(meta.get("tokenizer.ggml.add_bos_token", _pre_tokenizer(meta).add_bos))
    return bool(meta.get("tokenizer.ggml.add_bos_token", True))


def _template(bos: str | None, eos: str | None, tokenizer: Tokenizer) -> processors.TemplateProcessing:
    """BOS and EOS around each sequence exactly when the file says so, as llama.cpp adds them.

    transformers rebuilds the same template from add_bos_token/add_eos_token in
    tokenizer_config.json; having it in tokenizer.json too keeps encode right for a
    version that reads only that file.
    """

    def sequence(name: str, type_id: int) -> list[str]:
        return [f"{t}:{type_id}" for t in (bos,) if t] + [f"${name}:{type_id}"] + [f"{t}:{type_id}" for t in (eos,) if t]

    single = sequence("A", 0)
    return processors.TemplateProcessing(
        single=single,
        pair=single + sequence("B", 1),
        special_tokens=[(t, tokenizer.token_to_id(t)) for t in dict.fromkeys((bos, eos)) if t],
    )


def _tokenizer_config(meta: Mapping[str, Any], names: dict[str, str], add_bos: bool, add_eos: bool) -> dict:
    config: dict[str, Any] = {
        # The generic class: a named one (LlamaTokenizer, Qwen2Tokenizer, ...) may
        # rebuild the pipeline from its own defaults instead of using tokenizer.json.
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{f"{role}_token": names.get(role) for role in ("bos", "eos", "unk", "pad")},
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        # decode() must give back exactly what was encoded, as mlx-lm's streaming
        # detokenizers do. (llama.cpp would drop spaces before punctuation for some
        # pre-tokenizers, llama3's among them, and only when asked to.)
        "clean_up_tokenization_spaces": False,
    }
    context = meta.get(f"{meta.get('general.architecture')}.context_length")
    if context is not None:
        config["model_max_length"] = int(context)
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = str(template)
    return config
