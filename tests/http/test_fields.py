"""ringd.http.fields: a body that is not a JSON object, and the field checks every API shares, are 400s naming what is at fault.

Each API's own parser is tested with its own bodies (test_openai_types,
test_responses_api, test_anthropic_api, test_ollama_api); here the pieces they
share, and Hypothesis over random bytes into ``parse_json``.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringd.http.errors import ApiError
from ringd.http.fields import MAX_MODEL_CHARS, asks_nothing, is_bool, model_name, optional, parse_json, sampling_fields, sampling_params


def refused(raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_json(raw)
    assert e.value.status == 400 and e.value.type == "invalid_request_error", e.value.body()
    return e.value


# --- parse_json ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw,needle",
    [
        (b"[" * 100_000, "too deeply"),
        (b'{"a": ' * 50_000, "too deeply"),
        (b'{"model": "tiny", "max_tokens": ' + b"7" * 4301 + b"}", "too many digits"),
        (b'{"model": "tiny", "n": -' + b"1" * 5000 + b"}", "too many digits"),
        (b"\xff\xfe\xfd", "not valid JSON"),
        (b'{"model": "tiny"', "not valid JSON"),
        (b"", "not valid JSON"),
        (b'{"temperature": NaN}', "NaN is not a JSON value"),
        (b'{"temperature": -Infinity}', "-Infinity is not a JSON value"),
        (b"[1, 2]", "must be a JSON object"),
        (b'"just a string"', "must be a JSON object"),
        (b"null", "must be a JSON object"),
    ],
)
def test_bodies_json_cannot_read_are_400s(raw, needle):
    e = refused(raw)
    assert needle in e.message and e.param is None
    assert "set_int_max_str_digits" not in e.message  # Python's advice is not the client's


@given(st.binary(max_size=200))
@settings(max_examples=300)
def test_random_bytes_into_parse_json_raise_only_api_errors(raw):
    try:
        body = parse_json(raw)
    except ApiError as e:
        assert e.status == 400
    else:
        assert isinstance(body, dict)


# --- the checks every API shares ------------------------------------------------------


def test_a_model_name_is_a_short_string_of_valid_text():
    assert model_name({"model": "m" * MAX_MODEL_CHARS}) == "m" * MAX_MODEL_CHARS
    for body, says in (({}, "model is required"), ({"model": 7}, "model is required"), ({"model": "m" * (MAX_MODEL_CHARS + 1)}, "GET /v1/models lists it"), ({"model": "m\ud800"}, "lone surrogate")):
        with pytest.raises(ApiError) as e:
            model_name(body)
        assert e.value.param == "model" and says in e.value.message, body


def test_an_optional_field_is_none_when_absent_or_null_and_a_400_naming_it_when_wrong():
    assert optional({}, "stream", is_bool, "a boolean") is None
    assert optional({"stream": None}, "stream", is_bool, "a boolean") is None
    assert optional({"stream": False}, "stream", is_bool, "a boolean") is False
    with pytest.raises(ApiError) as e:
        optional({"stream": "yes"}, "stream", is_bool, "a boolean")
    assert e.value.param == "stream" and e.value.message == "stream must be a boolean; got 'yes'"


def test_what_asks_for_nothing():
    assert all(asks_nothing(v) for v in (None, [], {}))
    assert asks_nothing("none", ("none",)) and asks_nothing(False, (False,))
    # Of the same JSON type: 0 is not false, "none" is not asked for where nothing is accepted.
    assert not asks_nothing(0, (False,)) and not asks_nothing("none") and not asks_nothing([1])


def test_sampling_fields_are_type_checked_and_their_ranges_named():
    assert sampling_fields({"temperature": 0.5, "seed": 3, "unrelated": "x"}) == {"temperature": 0.5, "seed": 3}
    with pytest.raises(ApiError) as e:
        sampling_fields({"top_k": 1.5})
    assert e.value.param == "top_k" and "an integer" in e.value.message
    assert sampling_params({"top_k": -1}).top_k == 0  # OpenAI clients' "off"
    assert sampling_params({"seed": -1}).seed == 2**63 - 1
    with pytest.raises(ApiError) as e:
        sampling_params({"top_k": -1}, negative_top_k_is_off=False)
    assert e.value.param == "top_k"
    with pytest.raises(ApiError) as e:
        sampling_params({"temperature": 5})
    assert e.value.status == 400 and e.value.param == "temperature"
