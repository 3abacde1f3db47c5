"""ringd.models.gguf.header: a GGUF header read as llama.cpp's own reader (gguf-py) reads it, and no damage gets past it.

gguf-py is the reference: the same metadata and tensor table from the real SmolLM2
file and from a file holding every value type. Then the parser is fed what a damaged
or hostile file could hold (cut anywhere, bytes flipped, counts and lengths that
cannot fit): it answers HeaderError or a header, never another exception, never a
read past the end.
"""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringd.models.gguf.header import HeaderError, parse_header


def reference(path):
    r = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = [(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset) - int(r.data_offset)) for t in r.tensors]
    return meta, tensors, int(r.data_offset)


def check_same(path) -> None:
    header = parse_header(path.read_bytes())
    meta, tensors, data_offset = reference(path)
    assert header.metadata == meta
    assert [(t.name, t.dims, t.type, t.offset) for t in header.tensors] == tensors
    assert header.data_offset == data_offset


@pytest.fixture(scope="module")
def every_type(tmp_path_factory):
    """A small GGUF with a value of every type GGUF has, and two tensors."""
    path = tmp_path_factory.mktemp("header") / "types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -70000)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 2**40)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "café 🙂")
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, -1.5])
    w.add_array("t.strs", ["a", "", "ü"])
    w.add_tensor("a.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.add_tensor("b.weight", np.ones((3, 4, 32), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_real_file_reads_as_gguf_py_reads_it(smollm2_gguf):
    check_same(smollm2_gguf)


def test_every_value_type_reads_as_gguf_py_reads_it(every_type):
    check_same(every_type)
    meta = parse_header(every_type.read_bytes()).metadata
    assert meta["t.str"] == "café 🙂" and meta["t.strs"] == ["a", "", "ü"] and meta["t.bool"] is True
    assert meta["t.i64"] == -(2**40) and meta["t.ints"] == [1, 2, 3]


def header_end(path) -> int:
    return parse_header(path.read_bytes()).data_offset


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(min_value=0, max_value=10_000))
def test_a_file_cut_anywhere_in_its_header_is_a_header_error(every_type, cut):
    data = every_type.read_bytes()
    end = header_end(every_type)
    cut = cut % end
    with pytest.raises(HeaderError):
        parse_header(data[:cut])


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(min_value=1, max_value=255)), min_size=1, max_size=4))
def test_flipped_bytes_give_a_header_or_a_header_error_and_nothing_else(every_type, flips):
    data = bytearray(every_type.read_bytes())
    end = header_end(every_type)
    for at, mask in flips:
        data[at % end] ^= mask
    try:
        header = parse_header(bytes(data))
    except HeaderError:
        return
    assert header.data_offset <= len(data) + 4096  # whatever it read, it read inside the buffer


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        (lambda d: d[:4] + struct.pack("<I", 1) + d[8:], "GGUF version 1 is not one ringd reads"),
        (lambda d: b"GGML" + d[4:], "not a GGUF file"),
        (lambda d: d[:8] + struct.pack("<Q", 2**62) + d[16:], "tensors declared at byte 24 cannot fit"),
        (lambda d: d[:16] + struct.pack("<Q", 2**62) + d[24:], "metadata keys declared at byte 24 cannot fit"),
        (lambda d: d[:24] + struct.pack("<Q", 2**62) + d[32:], "the header ends early"),  # the first key's length
    ],
)
def test_declared_sizes_are_checked_before_anything_is_read(every_type, patch, message):
    with pytest.raises(HeaderError, match=message):
        parse_header(patch(every_type.read_bytes()))


def test_a_huge_array_count_is_refused_before_it_is_allocated(every_type):
    data = every_type.read_bytes()
    at = data.index(b"t.ints") + len(b"t.ints") + 4 + 4  # past the key, the value type (array), the item type
    hostile = data[:at] + struct.pack("<Q", 2**61) + data[at + 8 :]
    with pytest.raises(HeaderError, match="items of 't.ints'.* cannot fit"):
        parse_header(hostile)
