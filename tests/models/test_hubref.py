"""ringd.models.remote.hubref: ``OWNER/REPO:QUANT`` names, and the file of a quant picked from a repository's list.

Repositories are lists of names as GGUF repositories on the Hub hold them (bartowski's,
unsloth's, a llama.cpp split); Hypothesis builds repositories of random quants, splits
and side files and checks what ``pick`` must do with any of them.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringd.models.remote import hubref
from ringd.models.errors import ModelError
from ringd.models.remote.hubref import HubRef, parse, pick, quants, split_info

BARTOWSKI = [
    ".gitattributes",
    "README.md",
    "SmolLM2-135M-Instruct-IQ4_XS.gguf",
    "SmolLM2-135M-Instruct-Q4_K_M.gguf",
    "SmolLM2-135M-Instruct-Q4_K_L.gguf",
    "SmolLM2-135M-Instruct-Q8_0.gguf",
    "SmolLM2-135M-Instruct-f16.gguf",
    "SmolLM2-135M-Instruct.imatrix",
    "mmproj-SmolLM2-135M-Instruct-f16.gguf",
]


def test_names_of_gguf_repositories():
    assert parse("bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M") == HubRef("bartowski/SmolLM2-135M-Instruct-GGUF", "Q4_K_M")
    assert parse("hf.co/bartowski/SmolLM2-135M-Instruct-GGUF") == HubRef("bartowski/SmolLM2-135M-Instruct-GGUF", None)
    assert parse("https://huggingface.co/o/r:q8_0") == parse("huggingface.co/o/r:q8_0") == HubRef("o/r", "q8_0")
    assert parse("unsloth/Qwen3-8B-GGUF:UD-Q4_K_XL") == HubRef("unsloth/Qwen3-8B-GGUF", "UD-Q4_K_XL")
    # Not ours: an mlx-lm repo id, paths, Ollama names.
    for other in ("mlx-community/Qwen3-8B-4bit", "./m:q", "/models/a:b", "~/a/b:c", "ollama:smollm2", "ollama:user/model:tag", "a/b/c:q", "model.gguf"):
        assert parse(other) is None, other
    for bad, why in (("hf.co/justone", "not a Hugging Face GGUF"), ("o/r:", "not a quant"), ("o/r:Q4 K", "not a quant"), ("hf.co/o/../r", "not a Hugging")):
        with pytest.raises(ModelError, match=why):
            parse(bad)


def test_a_quant_picks_its_file_as_llama_cpp_does():
    assert pick(BARTOWSKI, "Q4_K_M") == ["SmolLM2-135M-Instruct-Q4_K_M.gguf"]
    assert pick(BARTOWSKI, "q4_k_m") == ["SmolLM2-135M-Instruct-Q4_K_M.gguf"]  # case-insensitive
    assert pick(BARTOWSKI, "F16") == ["SmolLM2-135M-Instruct-f16.gguf"]  # never the projector
    assert pick(["m-BF16.gguf", "m-F16.gguf"], "F16") == ["m-F16.gguf"]  # a word: not the end of BF16
    assert pick(BARTOWSKI, None) == ["SmolLM2-135M-Instruct-Q4_K_M.gguf"]  # the default
    assert pick([f for f in BARTOWSKI if "Q4_K_M" not in f], None) == ["SmolLM2-135M-Instruct-Q8_0.gguf"]
    assert pick(["a/model-IQ4_XS.gguf", "b/model-F16.gguf"], None) == ["a/model-IQ4_XS.gguf"]  # else the first
    with pytest.raises(ModelError, match="has no Q4_K_M or Q8_0 file; its quants: F16, IQ4_XS"):
        pick(["a/model-IQ4_XS.gguf", "b/model-F16.gguf"], None, any_file=False)
    assert quants(BARTOWSKI) == ["F16", "IQ4_XS", "Q4_K_L", "Q4_K_M", "Q8_0"]
    with pytest.raises(ModelError, match=r"has no Q5_K_M file; its quants: F16, IQ4_XS, Q4_K_L, Q4_K_M, Q8_0"):
        pick(BARTOWSKI, "Q5_K_M")
    with pytest.raises(ModelError, match=r"has no GGUF model file \(only mmproj-x.gguf, which are not models\)"):
        pick(["README.md", "mmproj-x.gguf"], None)
    split = [f"Q8_0/big-Q8_0-0000{i}-of-00003.gguf" for i in (3, 1, 2)]
    assert pick(split + BARTOWSKI, "Q8_0")[0] == "Q8_0/big-Q8_0-00001-of-00003.gguf"  # sorted: the folder first
    assert pick(split, "q8_0") == sorted(split)
    with pytest.raises(ModelError, match=r"part\(s\) 2 are not in the repository"):
        pick(split[:2], "Q8_0")
    assert split_info("x/M-q4_k_m-00002-of-00005.gguf") == hubref.Split("x/M-q4_k_m", "Q4_K_M", 2, 5)
    assert split_info("README.md") is None


QUANT_NAMES = ["Q4_K_M", "Q4_K_S", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS", "F16", "BF16", "Q4_0", "Q2_K"]


@st.composite
def repositories(draw):
    """A repository: for each of some quants a single file or a split in 2-4 parts (named in any
    letter case, with - or . before the quant), plus side files that are not models."""
    chosen = draw(st.lists(st.sampled_from(QUANT_NAMES), unique=True, max_size=6))
    files, truth = [], {}
    for q in chosen:
        shown = draw(st.sampled_from([q, q.lower()]))
        stem = f"Model-7B{draw(st.sampled_from(['-', '.']))}{shown}"
        n = draw(st.sampled_from([1, 1, 2, 4]))
        names = [f"{stem}.gguf"] if n == 1 else [f"{stem}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
        files += names
        truth[q] = names
    files += draw(st.lists(st.sampled_from(["README.md", "mmproj-Model-F16.gguf", "Model.imatrix", "config.json"]), unique=True))
    return draw(st.permutations(files)), truth


@given(repositories(), st.sampled_from(QUANT_NAMES), st.booleans())
def test_pick_finds_exactly_the_quant_and_its_parts(repo, quant, lower):
    files, truth = repo
    asked = quant.lower() if lower else quant
    if quant in truth:
        assert pick(files, asked) == truth[quant]
    else:
        with pytest.raises(ModelError) as e:
            pick(files, asked)
        assert all(q in str(e.value) for q in truth)  # the line lists what there is
    assert quants(files) == sorted(truth)


@given(repositories())
def test_no_quant_picks_the_default_or_the_first_model(repo):
    files, truth = repo
    if not truth:
        with pytest.raises(ModelError, match="no GGUF model file"):
            pick(files, None)
        return
    default = next((q for q in hubref.DEFAULT_QUANTS if q in truth), None)
    picked = pick(files, None)
    assert picked in truth.values()
    if default is not None:
        assert picked == truth[default]
    assert not any(word in f for f in picked for word in hubref.NOT_MODEL)
