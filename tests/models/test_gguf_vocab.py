"""ringd.models.gguf.vocab: a GGUF file's tokenizer, rebuilt as Hugging Face files and loaded by mlx-lm.

Real parts only: the real SmolLM2-135M-Instruct GGUF (its vocabulary, merges and chat
template), SentencePiece BPE models trained here by the sentencepiece library (which
is then the reference encoder; llama.cpp's own loop cuts out the added tokens first),
one like Llama 2's and Phi-3's, one like Gemma's, each written as llama.cpp's converter
writes that family, and ringd.models.tinymodel's trained byte-level BPE under each
pre-tokenizer, checked against transformers' own GGUF tokenizer builder where it knows
the pre-tokenizer and against llama.cpp's regex table otherwise. Everything is loaded
the way the caller loads it: files in a directory, ``mlx_lm.utils.load_tokenizer``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import regex
import sentencepiece
from hypothesis import given, settings
from hypothesis import strategies as st
from gguf import TokenType
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer
from mlx_lm.utils import load_tokenizer
from tokenizers import Tokenizer
from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

from ringd.models.errors import ModelError
from ringd.models.gguf.vocab import PRE_TOKENIZERS, tokenizer_files
from ringd.models.tinymodel import CORPUS, build_tokenizer

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# Text that has to come back byte for byte: accents precomposed and combining,
# CJK, an emoji (4 UTF-8 bytes), digits, runs of spaces, tabs and newlines.
ROUND_TRIP = [
    "Hello world! 123",
    "Café déjà vu.",
    "e\u0301te\u0301 (combining accents)",
    "中文和日本語のテキスト",
    "emoji 🙂 in the 🙂🙂 middle",
    "2024-11-05: 3.14159, 1,000,000",
    # (Not at the start: mlx-lm's byte-level streaming detokenizer drops a leading
    # space of its first text, as generation after a prompt wants.)
    "runs of   spaces\tand\ttabs  ",
    "line one\nline two\n\n\nend\n",
    "<|im_start|>user\nhé 🙂<|im_end|>\n",
]


def _load(files: dict[str, dict], directory: Path):
    """The caller's path: write the files, load them with mlx-lm."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (directory / name).write_text(json.dumps(content, ensure_ascii=False))
    return load_tokenizer(directory)


def _stream(tokenizer, ids: list[int]) -> str:
    """Feed ids one by one to mlx-lm's streaming detokenizer, as generation does.

    No text it shows on the way may be taken back: every step's text is a prefix
    of the final one (a half-received UTF-8 character must not show as U+FFFD).
    """
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    seen = []
    for i in ids:
        detokenizer.add_token(i)
        seen.append(detokenizer.text)
    detokenizer.finalize()
    for text in seen:
        assert detokenizer.text.startswith(text), (text, detokenizer.text)
    return detokenizer.text


# ------------------------------------------------------------------ SmolLM2


@pytest.fixture(scope="module")
def smollm2_meta(smollm2_gguf) -> dict:
    import gguf

    reader = gguf.GGUFReader(smollm2_gguf)
    return {k: f.contents() for k, f in reader.fields.items()}


@pytest.fixture(scope="module")
def smollm2(smollm2_meta, tmp_path_factory):
    return _load(tokenizer_files(smollm2_meta), tmp_path_factory.mktemp("smollm2"))


def test_smollm2_chat_tokens_are_single_ids(smollm2):
    assert smollm2.encode("<|im_start|>") == [1]
    assert smollm2.encode("<|im_end|>") == [2]
    ids = smollm2.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and ids.count(1) == 1 and ids.count(2) == 1
    assert smollm2.eos_token == "<|im_end|>" and smollm2.eos_token_id == 2
    assert 2 in smollm2.eos_token_ids


def test_smollm2_splits_every_digit(smollm2):
    # llama.cpp's "smollm": \p{N} alone first, then GPT-2's split.
    ids = smollm2.encode("2024")
    assert smollm2.convert_ids_to_tokens(ids) == ["2", "0", "2", "4"]
    ids = smollm2.encode("Hello world! 123")
    assert smollm2.convert_ids_to_tokens(ids) == ["Hello", "Ġworld", "!", "Ġ", "1", "2", "3"]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_smollm2_round_trips(smollm2, text):
    ids = smollm2.encode(text)
    assert smollm2.decode(ids) == text
    assert smollm2.decode(smollm2.encode(" " + text)) == " " + text
    assert isinstance(smollm2.detokenizer, BPEStreamingDetokenizer)
    assert _stream(smollm2, ids) == text


def test_smollm2_vocabulary_is_the_files(smollm2, smollm2_meta):
    tokens = smollm2_meta["tokenizer.ggml.tokens"]
    assert len(tokens) == 49152
    assert len(smollm2) == 49152 and len(smollm2.get_vocab()) == 49152
    assert smollm2.convert_ids_to_tokens(list(range(len(tokens)))) == tokens
    vocab = smollm2.get_vocab()
    assert all(vocab[t] == i for i, t in enumerate(tokens))


def test_smollm2_chat_template(smollm2):
    messages = [{"role": "user", "content": "hi"}]
    text = smollm2.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        f"<|im_start|>system\n{SMOLLM2_SYSTEM}<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    # The file says add_bos_token false: the prompt starts with the template's own token.
    assert smollm2.encode(text)[0] == 1 and smollm2.bos_token_id == 1


# ------------------------------------------------------------- SentencePiece

SPM_TEXTS = [
    "hello",
    " hello",
    "  two leading spaces",
    "double  spaces  inside",
    "trailing space ",
    "Numbers such as 1, 2, 3, 10, 42, 100 and 2024",
    "bytes: é ü ß 中文 🙂",  # not in the training text: byte fallback
    "line one\nline two\n\n",
    "\n starts with a newline",
    "The river runs through the middle of the town.",
]


def _train(folder, **settings) -> "sentencepiece.SentencePieceProcessor":
    """A SentencePiece BPE model of CORPUS as Llama 2's and Gemma's are trained (byte fallback,
    digits split, no normalization, whitespace kept), with ``settings`` on top."""
    prefix = folder / "m"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines()), model_prefix=str(prefix), model_type="bpe",
        byte_fallback=True, split_digits=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, minloglevel=2, **settings,
    )  # fmt: skip
    return sentencepiece.SentencePieceProcessor(model_file=f"{prefix}.model")


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    """A SentencePiece BPE model trained like Llama 2's: byte fallback, digits split,
    no normalization, extra whitespace kept, a dummy prefix space."""
    return _train(tmp_path_factory.mktemp("spm"), vocab_size=400, add_dummy_prefix=True)


def _spm_meta(sp, **extra) -> dict:
    """What llama.cpp's converter writes for a SentencePiece model (_create_vocab_sentencepiece)."""

    def token_type(i: int) -> int:
        for test, kind in ((sp.is_unknown, TokenType.UNKNOWN), (sp.is_control, TokenType.CONTROL),
                           (sp.is_unused, TokenType.UNUSED), (sp.is_byte, TokenType.BYTE)):  # fmt: skip
            if test(i):
                return int(kind)
        return int(TokenType.NORMAL)

    n = sp.vocab_size()
    return {
        "general.architecture": "llama",
        "llama.context_length": 4096,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": [token_type(i) for i in range(n)],
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        **extra,
    }


@pytest.fixture(scope="module")
def spm_tokenizer(spm, tmp_path_factory):
    return _load(tokenizer_files(_spm_meta(spm)), tmp_path_factory.mktemp("spm-tok"))


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_encodes_as_sentencepiece(spm, spm_tokenizer, text):
    ids = spm_tokenizer.encode(text)
    assert ids == [spm.bos_id(), *spm.encode(text)]  # llama.cpp adds BOS when the file does not say
    assert spm_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert isinstance(spm_tokenizer.detokenizer, SPMStreamingDetokenizer)
    # Generated ids carry no BOS; the detokenizer drops the prefix space. (It drops
    # every space until the first other character, so text that starts with spaces
    # streams without them: mlx-lm's choice, as generated text follows a prompt.)
    assert _stream(spm_tokenizer, ids[1:]) == text.lstrip(" ")


def test_sentencepiece_space_after_special_tokens(spm, spm_tokenizer):
    """llama.cpp prefixes a space to each stretch of text after a special token too
    (llama_vocab::impl::tokenize, is_prev_special), as SentencePiece does to each
    text it encodes."""
    ids = spm_tokenizer.encode("a</s>b")
    assert ids == [spm.bos_id(), *spm.encode("a"), spm.eos_id(), *spm.encode("b")]
    assert spm_tokenizer.convert_ids_to_tokens(ids)[-1].startswith("\u2581")


def test_sentencepiece_flags(spm, tmp_path):
    """add_bos_token/add_eos_token as the file says; no prefix space when it says so."""
    tokenizer = _load(
        tokenizer_files(_spm_meta(spm, **{"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True})),
        tmp_path / "eos",
    )
    assert tokenizer.encode("hello") == [*spm.encode("hello"), spm.eos_id()]

    files = tokenizer_files(_spm_meta(spm, **{"tokenizer.ggml.add_space_prefix": False}))
    tokenizer = _load(files, tmp_path / "no-prefix")
    pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode("hello world"))
    assert pieces[0] == "<s>" and not pieces[1].startswith("\u2581") and any(p.startswith("\u2581w") for p in pieces)
    assert tokenizer.decode(tokenizer.encode("hello world"), skip_special_tokens=True) == "hello world"
    assert isinstance(tokenizer.detokenizer, SPMStreamingDetokenizer) and not tokenizer.detokenizer.trim_space


# ------------------------------------------- Gemma's and Phi-3's SentencePiece
#
# Both are SentencePiece BPE as above; what differs is how llama.cpp's converter
# writes them and how llama.cpp reads them. Gemma (gemma, gemma2, gemma3, gemma3n
# share Gemma2Model's set_vocab): no dummy prefix, and its user-defined pieces
# (runs of spaces and newlines, HTML tags) listed again in tokenizer_config.json,
# which turns them into USER_DEFINED tokens with "▁" written back as " "
# (_create_vocab_sentencepiece). Phi-3 (Phi3MiniModel.set_vocab): Llama 2's pieces,
# then padding, then its chat tokens from tokenizer.json's added_tokens, special ones
# CONTROL and the rest (its "</s>") USER_DEFINED; llama.cpp strips the whitespace
# after them when the file's name says Phi-3. The reference below is llama.cpp's own
# loop (tokenizer_st_partition) cutting those tokens out of the text, and
# SentencePiece itself encoding each stretch between them.

GEMMA_TURNS = ["<start_of_turn>", "<end_of_turn>"]
GEMMA_USER_DEFINED = ["\n", "\n\n", "\n\n\n", "<table>", *("\u2581" * n for n in range(2, 9))]
PHI3_ADDED = ["<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|system|>", "<|end|>", "<|user|>"]
PHI3_PADDING = 8  # Phi-3's config says 32064 tokens, its tokenizer.model has 32000
# Text that reaches every path: special and user-defined tokens with and without
# whitespace after them, runs of spaces and newlines, tabs, bytes no piece spells.
SPM_FAMILY_TEXTS = [
    "hello",
    " hello",
    "   three leading spaces",
    "a  b   c    d" + " " * 11 + "e",
    "line\nline\n\n\nend\n\n\n\n\n",
    "\ttabs\tand\r\nreturns",
    "bytes: é ü ß 中文 🙂 e\u0301",
    "The river runs through the middle of the town.",
    "<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n",
    "<table>  <table>\n",
    "<|system|>\nYou are helpful.<|end|>\n<|user|>\n  Hello, 2024!<|end|>\n<|assistant|>\n",
    "<|user|>   spaces kept?<|end|> \t\n<|endoftext|>  kept<s>  kept<unk>  kept</s>  stripped",
    "trailing  ",
    "\u3000ideographic space",
]


@pytest.fixture(scope="module")
def gemma_spm(tmp_path_factory):
    """A SentencePiece BPE model trained like Gemma's: byte fallback, digits split, no
    dummy prefix, whitespace kept, pad/eos/bos/unk first, and user-defined pieces for
    its chat turns, runs of spaces and newlines and an HTML tag."""
    return _train(
        tmp_path_factory.mktemp("gemma-spm"), vocab_size=420, add_dummy_prefix=False,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, user_defined_symbols=GEMMA_TURNS + GEMMA_USER_DEFINED,
    )  # fmt: skip


def _looks_special(token: str) -> bool:
    """convert_hf_to_gguf.py's does_token_look_special, for the tokens used here."""
    return token in ("<pad>", "<mask>") or (token.startswith("<|") and token.endswith("|>"))


def _added_tokens(meta: dict, added: list[tuple[int, str, bool]], *, respell_spaces: bool) -> dict:
    """The converter's pass over tokenizer_config.json's added_tokens_decoder (Gemma's,
    respelling "▁" as " " in user-defined ones) or tokenizer.json's added_tokens (Phi-3's):
    each becomes CONTROL when special, USER_DEFINED otherwise, scored -1000."""
    tokens, scores, types = (list(meta[f"tokenizer.ggml.{k}"]) for k in ("tokens", "scores", "token_type"))
    for i, content, special in added:
        if special or _looks_special(content):
            types[i] = int(TokenType.CONTROL)
        else:
            types[i] = int(TokenType.USER_DEFINED)
            content = content.replace("\u2581", " ") if respell_spaces else content
        tokens[i], scores[i] = content, -1000.0
    return {**meta, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types}


def _gemma_meta(sp, arch: str = "gemma2") -> dict:
    """What Gemma2Model.set_vocab writes: _set_vocab_sentencepiece, then no space prefix."""
    meta = _spm_meta(
        sp,
        **{
            "general.architecture": arch,
            "general.name": "Gemma 2 2b It",
            "tokenizer.ggml.add_space_prefix": False,
            "tokenizer.ggml.padding_token_id": sp.pad_id(),
        },
    )
    user = GEMMA_TURNS + GEMMA_USER_DEFINED
    return _added_tokens(meta, [(sp.piece_to_id(t), t, t in GEMMA_TURNS) for t in user], respell_spaces=True)


def _phi3_meta(sp, name: str = "Phi3") -> dict:
    """What Phi3MiniModel.set_vocab writes: the pieces, [PADn] up to the config's size,
    then tokenizer.json's added tokens over them (Phi-3's "</s>" is not special)."""
    n = sp.vocab_size()
    meta = _spm_meta(sp, **{"general.architecture": "phi3", "general.name": name, "phi3.context_length": 4096})
    size = n + PHI3_PADDING
    meta["tokenizer.ggml.tokens"] += [f"[PAD{i}]" for i in range(n, size)]
    meta["tokenizer.ggml.scores"] += [-10000.0] * PHI3_PADDING
    meta["tokenizer.ggml.token_type"] += [int(TokenType.UNUSED)] * PHI3_PADDING
    added = [(0, "<unk>", True), (1, "<s>", True), (2, "</s>", False)]
    added += [(n + i, t, True) for i, t in enumerate(PHI3_ADDED)]
    meta = _added_tokens(meta, added, respell_spaces=False)
    return {**meta, "tokenizer.ggml.eos_token_id": n}  # <|endoftext|>, as Phi-3's tokenizer_config says


def _llama_cpp_encode(sp, meta: dict, text: str) -> list[int]:
    """llama.cpp's tokenize for a SentencePiece vocabulary, with SentencePiece as the encoder.

    tokenizer_st_partition cuts the special and user-defined tokens out of the text,
    longest first, each wherever it occurs; a Phi-3 file's tokens (by name) take the
    ASCII whitespace after them along (RSTRIP). Each stretch left is encoded alone, a
    space before it unless the file says not (is_prev_special is true at the start
    and after every token): what SentencePiece's dummy prefix does, or not, for the
    model the file was converted from.
    """
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    kinds = (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)
    specials = sorted((i for i, k in enumerate(types) if k in kinds), key=lambda i: -len(tokens[i]))
    name = meta.get("general.name", "").lower()
    phi3 = "phi-3" in name or "phi3" in name
    pieces: list[str | int] = [text]
    for i in specials:
        rstrip = phi3 and tokens[i] not in ("<unk>", "<s>", "<|endoftext|>")
        cut: list[str | int] = []
        for piece in pieces:
            while isinstance(piece, str) and (at := piece.find(tokens[i])) >= 0:
                cut += [piece[:at], i] if at else [i]
                piece = piece[at + len(tokens[i]) :]
                piece = piece.lstrip(" \t\n\v\f\r") if rstrip else piece
            cut += [piece] if piece != "" else []
        pieces = cut
    ids = [meta["tokenizer.ggml.bos_token_id"]] if meta.get("tokenizer.ggml.add_bos_token", True) else []
    for piece in pieces:
        ids += [piece] if isinstance(piece, int) else sp.encode(piece)
    return ids


def _has_control_token(meta: dict, text: str) -> bool:
    """Whether llama.cpp reads a control token in the text, which SentencePiece reads as text."""
    kinds = (TokenType.CONTROL, TokenType.UNKNOWN)
    return any(t in text for t, k in zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]) if k in kinds)


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma_spm, tmp_path_factory):
    return _load(tokenizer_files(_gemma_meta(gemma_spm)), tmp_path_factory.mktemp("gemma-tok"))


@pytest.fixture(scope="module")
def phi3_tokenizer(spm, tmp_path_factory):
    return _load(tokenizer_files(_phi3_meta(spm)), tmp_path_factory.mktemp("phi3-tok"))


def test_gemma_file_is_written_as_the_converter_writes_it(gemma_spm):
    """The shape that the generic path must take: runs of spaces as spaces, user-defined."""
    meta = _gemma_meta(gemma_spm)
    i = gemma_spm.piece_to_id("\u2581\u2581\u2581")
    assert meta["tokenizer.ggml.tokens"][i] == "   " and meta["tokenizer.ggml.token_type"][i] == TokenType.USER_DEFINED
    i = gemma_spm.piece_to_id("<end_of_turn>")
    assert meta["tokenizer.ggml.token_type"][i] == TokenType.CONTROL
    assert gemma_spm.encode("a  b") == [gemma_spm.piece_to_id(p) for p in ("a", "\u2581\u2581", "b")]


@pytest.mark.parametrize("text", SPM_FAMILY_TEXTS)
def test_gemma_encodes_as_llama_cpp_and_sentencepiece(gemma_spm, gemma_tokenizer, text):
    meta = _gemma_meta(gemma_spm)
    ids = gemma_tokenizer.encode(text)
    assert ids == _llama_cpp_encode(gemma_spm, meta, text)
    if not _has_control_token(meta, text):  # SentencePiece itself knows the user-defined pieces
        assert ids == [gemma_spm.bos_id(), *gemma_spm.encode(text)]
        assert gemma_tokenizer.decode(ids, skip_special_tokens=True) == gemma_spm.decode(ids[1:]) == text
    assert gemma_tokenizer.decode(ids[1:]) == text
    assert isinstance(gemma_tokenizer.detokenizer, SPMStreamingDetokenizer)
    assert not gemma_tokenizer.detokenizer.trim_space  # no prefix space to take off
    assert _stream(gemma_tokenizer, ids[1:]) == text


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3", "gemma3n"])
def test_gemma_family_matches_transformers_gguf_loader(gemma_spm, arch):
    """transformers' own Gemma builder (runs of spaces respelled, merges by file order)
    gives the same ids on this file, where file order and scores agree. Not on a run of
    spaces longer than the longest token: it merges the run as BPE, where llama.cpp and
    SentencePiece take the longest token first (11 spaces: 8 + 3 here, 4 + 7 there)."""
    meta = _gemma_meta(gemma_spm, arch)
    reference, _ = convert_gguf_tokenizer(
        "gemma3" if arch == "gemma3n" else arch,  # transformers has no builder named gemma3n
        {"tokenizer_type": "llama", **{k: meta[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores", "token_type")}},
    )
    ours = _backend(meta)
    for text in SPM_FAMILY_TEXTS:
        if " " * 9 not in text:
            assert ours.encode(text).ids[1:] == reference.encode(text, add_special_tokens=False).ids, text


@pytest.mark.parametrize("text", SPM_FAMILY_TEXTS)
def test_phi3_encodes_as_llama_cpp(spm, phi3_tokenizer, text):
    meta = _phi3_meta(spm)
    ids = phi3_tokenizer.encode(text)
    assert ids == _llama_cpp_encode(spm, meta, text)
    if not _has_control_token(meta, text) and "</s>" not in text:
        assert ids == [spm.bos_id(), *spm.encode(text)]
    assert isinstance(phi3_tokenizer.detokenizer, SPMStreamingDetokenizer)


def test_phi3_strips_whitespace_after_its_chat_tokens(spm, phi3_tokenizer):
    """As llama.cpp does for a file named Phi-3: "<|user|>\n  Hello" encodes as
    "<|user|>Hello", the space before Hello SentencePiece's."""
    user, end = phi3_tokenizer.convert_tokens_to_ids(["<|user|>", "<|end|>"])
    ids = phi3_tokenizer.encode("<|user|>\n  Hello<|end|>\n", add_special_tokens=False)
    assert ids == [user, *spm.encode("Hello"), end]
    # <|endoftext|>, <s> and <unk> keep what follows them.
    ids = phi3_tokenizer.encode("<|endoftext|>\nHello", add_special_tokens=False)
    assert ids == [phi3_tokenizer.eos_token_id, *spm.encode("\nHello")]
    assert phi3_tokenizer.eos_token == "<|endoftext|>"
    assert len(phi3_tokenizer) == spm.vocab_size() + PHI3_PADDING  # the added tokens are within the padding


@pytest.mark.parametrize("name", ["Phi 3 Mini 4k Instruct", "Llama 2 7b"])
def test_whitespace_after_tokens_is_kept_unless_named_phi3(spm, name, tmp_path):
    """llama.cpp keys the stripping on general.name alone: any other name keeps the whitespace."""
    meta = _phi3_meta(spm, name)
    tokenizer = _load(tokenizer_files(meta), tmp_path)
    for text in SPM_FAMILY_TEXTS:
        assert tokenizer.encode(text) == _llama_cpp_encode(spm, meta, text), text
    user = tokenizer.convert_tokens_to_ids("<|user|>")
    assert tokenizer.encode("<|user|>\nHi", add_special_tokens=False) == [user, *spm.encode("\nHi")]


_SPM_ALPHABET = st.sampled_from(
    [" ", "  ", "\n", "\t", "a", "e", "r", "th", "the", "river", "é", "中", "🙂", "1", "23", ".", "<"]
    + GEMMA_TURNS + [" " * 8, "<table>", "<|user|>", "<|end|>", "<|endoftext|>", "</s>", "<s>"]
)


@settings(deadline=None)  # example counts from the profile (conftest.py)
@given(parts=st.lists(_SPM_ALPHABET, max_size=24))
def test_gemma_and_phi3_encode_as_llama_cpp_on_any_text(spm, gemma_spm, phi3_tokenizer, gemma_tokenizer, parts):
    text = "".join(parts)
    assert gemma_tokenizer.encode(text) == _llama_cpp_encode(gemma_spm, _gemma_meta(gemma_spm), text)
    assert phi3_tokenizer.encode(text) == _llama_cpp_encode(spm, _phi3_meta(spm), text)
    assert gemma_tokenizer.decode(gemma_tokenizer.encode(text, add_special_tokens=False)) == text


# ------------------------------------------------------------ byte-level BPE

# Pieces llama.cpp's regex table (src/llama-vocab.cpp) cuts "12345 67" into, per family.
DIGIT_SPLITS = {
    "gpt-2": ["12345", " 67"],  # ' ?\p{N}+'
    "llama-bpe": ["123", "45", " ", "67"],  # '\p{N}{1,3}'
    "deepseek-v3": ["123", "45", " ", "67"],  # '\p{N}{1,3}' first
    "default": ["123", "45", " ", "67"],  # '\p{N}+', then '[0-9][0-9][0-9]'
    "falcon": ["123", "45", " 67"],  # GPT-2's, then '[0-9][0-9][0-9]'
    "deepseek-llm": ["12345", " ", "67"],  # '\p{N}+'
    **{pre: ["1", "2", "3", "4", "5", " ", "6", "7"] for pre in ("qwen2", "smollm", "tekken", "deepseek-coder")},
}
# Families transformers' GGUF loader also knows (its GGUF_PRE_TOKENIZER_SPLITS).
TRANSFORMERS_KNOWS = ["llama-bpe", "qwen2", "qwen35", "tekken", "gpt-4o"]
SPLIT_TEXTS = [
    "Hello world! 12345 I'M here, they'll see; you'D know.",
    "CamelCaseWords, UPPERcase and lowerCASE: HTTPServer",
    "a\n\n  b\tc   \r\nd  ",
    "héllo ÉCOLE 中文 日本語のテキスト 한국어 🙂 e\u0301",
    "x = f(a[1]) + {'k': \"v\"}  // path/to/file.py\n",
    "Ωmega Straße ﬁne ＡＢＣ",
]


@pytest.fixture(scope="module")
def tiny_vocab():
    """ringd.models.tinymodel's trained byte-level BPE as a GGUF lists it, plus a user-defined
    token and a control token spelled as the converter writes added tokens (raw text)."""
    model = json.loads(build_tokenizer().to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    types = [TokenType.CONTROL if t.startswith("<|") else TokenType.NORMAL for t in tokens]
    extra = [
        ("<think>", TokenType.USER_DEFINED),
        ("</think>", TokenType.USER_DEFINED),
        ("<|fim middle|>", TokenType.CONTROL),  # a space: outside the byte alphabet
    ]
    return {
        "tokens": tokens + [t for t, _ in extra],
        "types": [int(t) for t in types] + [int(k) for _, k in extra],
        "merges": [f"{a} {b}" for a, b in model["merges"]],
    }


def _byte_level_meta(vocab, pre: str, **extra) -> dict:
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": vocab["tokens"],
        "tokenizer.ggml.token_type": vocab["types"],
        "tokenizer.ggml.merges": vocab["merges"],
        "tokenizer.ggml.bos_token_id": vocab["tokens"].index("<|endoftext|>"),
        "tokenizer.ggml.eos_token_id": vocab["tokens"].index("<|im_end|>"),
        **extra,
    }


def _backend(meta: dict) -> Tokenizer:
    return Tokenizer.from_str(json.dumps(tokenizer_files(meta)["tokenizer.json"]))


@pytest.mark.parametrize("pre", TRANSFORMERS_KNOWS)
def test_byte_level_matches_transformers_gguf_loader(tiny_vocab, pre):
    """transformers builds the same GGUF tokenizers on its own; both must give the same ids."""
    reference, _ = convert_gguf_tokenizer(
        "llama",
        {
            "tokenizer_type": "gpt2",
            "pre_tokenizer_type": pre,
            "tokens": tiny_vocab["tokens"],
            "token_type": tiny_vocab["types"],
            "merges": tiny_vocab["merges"],
        },
    )
    ours = _backend(_byte_level_meta(tiny_vocab, pre, **{"tokenizer.ggml.add_bos_token": False}))
    for text in SPLIT_TEXTS + ROUND_TRIP[:-1]:
        assert ours.encode(text).ids == reference.encode(text, add_special_tokens=False).ids, text


@pytest.mark.parametrize("pre", sorted(DIGIT_SPLITS))
def test_byte_level_digit_splits(tiny_vocab, pre):
    text = "12345 67"
    pieces = _backend(_byte_level_meta(tiny_vocab, pre)).pre_tokenizer.pre_tokenize_str(text)
    assert [text[a:b] for _, (a, b) in pieces] == DIGIT_SPLITS[pre]


def _llama_cpp_split(text: str, regexes: tuple[str, ...]) -> list[str]:
    """llama.cpp's unicode_regex_split: each regex in turn cuts every piece into its
    matches and the gaps between them."""
    pieces = [text]
    for expression in regexes:
        pattern = regex.compile(expression)
        cut = []
        for piece in pieces:
            at = 0
            for match in pattern.finditer(piece):
                cut += [piece[at : match.start()]] if match.start() > at else []
                cut.append(match.group())
                at = match.end()
            cut += [piece[at:]] if at < len(piece) else []
        pieces = cut
    return pieces


# The regexes llama.cpp runs where it rewrote the model's own (src/llama-vocab.cpp,
# `llm_tokenizer_bpe`), verbatim: contractions without (?i:...), and for tekken and
# gpt-4o upper and lower case approximated as "a letter but not a-z" / "not A-Z".
# gguf_vocab uses the originals; both must cut the same, except where the case
# approximation is the point (non-ASCII capitals, combining marks: see below).
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_UPPER, _LOWER = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
LLAMA_CPP_ADAPTED = {
    "llama-bpe": _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen35": _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "tekken": rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "gpt-4o": rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


@pytest.mark.parametrize("pre", sorted({id(p): name for name, p in PRE_TOKENIZERS.items()}.values()))
def test_byte_level_split_is_llama_cpps(tiny_vocab, pre):
    """The tokenizers pipeline (Split "isolated", in sequence) cuts text as llama.cpp's
    loop does with llama.cpp's own regexes, run here by Python's regex engine."""
    tokenizer = _backend(_byte_level_meta(tiny_vocab, pre))
    reference = (LLAMA_CPP_ADAPTED[pre],) if pre in LLAMA_CPP_ADAPTED else PRE_TOKENIZERS[pre].splits
    texts = SPLIT_TEXTS + ROUND_TRIP
    if pre in ("tekken", "gpt-4o"):
        texts = [t for t in texts if t.isascii()]
    for text in texts:
        pieces = tokenizer.pre_tokenizer.pre_tokenize_str(text)
        assert [text[a:b] for _, (a, b) in pieces] == _llama_cpp_split(text, reference), text


@pytest.mark.parametrize("pre", ["tekken", "gpt-4o"])
def test_byte_level_case_split_follows_the_model_not_the_approximation(tiny_vocab, pre):
    """llama.cpp's rewrite takes a non-ASCII capital for a lowercase letter; the
    model's own regex (Mistral's and OpenAI's) keeps a capitalized word whole."""
    text = "ÉCOLE Straße"
    pieces = _backend(_byte_level_meta(tiny_vocab, pre)).pre_tokenizer.pre_tokenize_str(text)
    assert [text[a:b] for _, (a, b) in pieces] == ["ÉCOLE", " Straße"]
    assert _llama_cpp_split(text, (LLAMA_CPP_ADAPTED[pre],))[:2] == ["É", "COLE"]


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "tekken", "smollm", "deepseek-v3"])
def test_byte_level_through_mlx_lm(tiny_vocab, tmp_path, pre):
    """BOS exactly when the file says so; added tokens whole, at their own ids; exact round trips."""
    tokens = tiny_vocab["tokens"]
    bos = tokens.index("<|endoftext|>")
    think, fim = tokens.index("<think>"), tokens.index("<|fim middle|>")
    meta = _byte_level_meta(tiny_vocab, pre, **{"tokenizer.ggml.add_bos_token": True})
    with_bos = _load(tokenizer_files(meta), tmp_path / "bos")
    assert with_bos.encode("hi") == [bos, *with_bos.encode("hi", add_special_tokens=False)]
    assert with_bos.encode("hi").count(bos) == 1

    meta = _byte_level_meta(tiny_vocab, pre, **{"tokenizer.ggml.add_bos_token": False})
    tokenizer = _load(tokenizer_files(meta), tmp_path / "plain")
    assert len(tokenizer) == len(tokens) and tokenizer.convert_ids_to_tokens(list(range(len(tokens)))) == tokens
    ids = tokenizer.encode("a<think>b</think> c<|fim middle|>d")
    assert ids[0] != bos and think in ids and fim in ids
    assert tokenizer.decode(ids) == "a<think>b</think> c<|fim middle|>d"
    # The control token is dropped, the user-defined ones are text.
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a<think>b</think> cd"
    assert isinstance(tokenizer.detokenizer, BPEStreamingDetokenizer)
    for text in ROUND_TRIP:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert _stream(tokenizer, ids) == text


def test_default_bos_follows_llama_cpp(tiny_vocab):
    """Without tokenizer.ggml.add_bos_token, llama.cpp adds BOS for llama3 and tekken, not for qwen2."""
    bos = tiny_vocab["tokens"].index("<|endoftext|>")
    assert _backend(_byte_level_meta(tiny_vocab, "llama-bpe")).encode("hi").ids[0] == bos
    assert _backend(_byte_level_meta(tiny_vocab, "tekken")).encode("hi").ids[0] == bos
    assert bos not in _backend(_byte_level_meta(tiny_vocab, "qwen2")).encode("hi").ids


def test_tokenizer_config(tiny_vocab):
    meta = _byte_level_meta(
        tiny_vocab,
        "qwen2",
        **{"tokenizer.chat_template": "{{ messages }}", "llama.context_length": 32768, "tokenizer.ggml.padding_token_id": 0},
    )
    files = tokenizer_files(meta)
    config = files["tokenizer_config.json"]
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["clean_up_tokenization_spaces"] is False
    special = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert {k: config[k] for k in special} == special
    assert (config["add_bos_token"], config["add_eos_token"]) == (False, False)
    assert config["chat_template"] == "{{ messages }}" and config["model_max_length"] == 32768
    assert files["special_tokens_map.json"] == special


# ------------------------------------------------------------------ refusals


def test_refuses_unknown_pre_tokenizer(tiny_vocab):
    known = r"tokenizer\.ggml\.pre 'foo' is not known to ringd; known: .*llama-bpe.*qwen2.*smollm"
    with pytest.raises(ModelError, match=known):
        tokenizer_files(_byte_level_meta(tiny_vocab, "foo"))


def test_refuses_unknown_tokenizer_model(tiny_vocab):
    meta = {**_byte_level_meta(tiny_vocab, "default"), "tokenizer.ggml.model": "rwkv"}
    known = r"tokenizer\.ggml\.model 'rwkv' is not known to ringd; known: 'gpt2' .*'llama' "
    with pytest.raises(ModelError, match=known):
        tokenizer_files(meta)


def test_refuses_a_file_without_tokens(tiny_vocab):
    meta = _byte_level_meta(tiny_vocab, "qwen2")
    del meta["tokenizer.ggml.tokens"]
    with pytest.raises(ModelError, match=r"no tokenizer\.ggml\.tokens"):
        tokenizer_files(meta)
