"""Tensors as bytes: bit-exact for every dtype, no detours, strict on the way back."""

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wire.frames import FrameError
from wire.tensors import (
    DTYPES,
    MAX_DIM,
    MAX_NDIM,
    check_tensor_descriptor,
    tensor_descriptor,
    tensor_from_buffer,
    tensor_to_buffer,
    wire_bits,
)

UINT_OF_SIZE = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def bits(arr: mx.array) -> bytes:
    """The array's bits in C order, independent of the code under test (NaN != NaN)."""
    return np.array(arr.view(UINT_OF_SIZE[arr.dtype.size])).tobytes()


def address(buffer) -> int:
    return np.frombuffer(buffer, np.uint8).__array_interface__["data"][0]


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(sorted(DTYPES)),
    st.lists(st.integers(0, 5), max_size=4),
    st.data(),
)
def test_random_bits_round_trip(name, shape, data):
    dtype = DTYPES[name]
    payload = data.draw(
        st.binary(min_size=math.prod(shape) * dtype.size, max_size=math.prod(shape) * dtype.size)
    )
    if dtype == mx.bool_:
        payload = bytes(b & 1 for b in payload)
    descriptor = {"dtype": name, "shape": shape}

    arr = tensor_from_buffer(descriptor, bytearray(payload))

    assert arr.dtype == dtype and arr.shape == tuple(shape)
    assert tensor_descriptor(arr) == descriptor
    assert bytes(tensor_to_buffer(arr)) == payload  # bfloat16 NaN payloads included
    if arr.size:
        assert bits(arr) == payload


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_arrays_in_any_layout_travel_in_c_order(name):
    dtype = DTYPES[name]
    base = mx.random.normal((4, 6)) * 100
    arr = (base > 0) if dtype == mx.bool_ else base.astype(dtype)
    views = {
        "contiguous": arr,
        "transposed": arr.T,
        "strided": arr[:, ::2],
        "offset": arr[1:],
        "broadcast": mx.broadcast_to(arr[:1], (3, 6)),
        "scalar": arr[2, 3],
        "empty": arr[:0],
        "lazy": arr + arr if dtype != mx.bool_ else mx.logical_not(arr),
    }
    for label, view in views.items():
        buffer = tensor_to_buffer(view)
        assert buffer.format == "B" and buffer.ndim == 1, label
        assert bytes(buffer) == (bits(view) if view.size else b""), label
        back = tensor_from_buffer(tensor_descriptor(view), buffer)
        assert back.dtype == dtype and back.shape == view.shape, label
        assert bits(back) == bits(view) if view.size else back.size == 0, label


def test_bfloat16_stays_bfloat16():
    arr = mx.array([1.0, -2.5, 3.140625], dtype=mx.bfloat16)
    assert tensor_descriptor(arr) == {"dtype": "bfloat16", "shape": [3]}
    assert bytes(tensor_to_buffer(arr)) == np.array(arr.view(mx.uint16)).tobytes()
    assert tensor_to_buffer(arr).nbytes == 3 * 2  # not widened to float32


def test_contiguous_arrays_are_not_copied():
    for arr in (mx.ones((64, 64), dtype=mx.float32), mx.ones((64, 64), dtype=mx.bfloat16)[8:]):
        mx.eval(arr)
        assert address(tensor_to_buffer(arr)) == address(memoryview(arr))


def test_received_array_is_its_own_copy():
    payload = bytearray(np.arange(4, dtype=np.float32).tobytes())
    arr = tensor_from_buffer({"dtype": "float32", "shape": [4]}, payload)
    payload[:] = bytes(16)  # the frame's buffer may be reused; the array must not change
    assert arr.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    "descriptor, payload_len, needle",
    [
        ({"dtype": "float8", "shape": [1]}, 1, "'float8' is not in the allow-list"),
        ({"dtype": "object", "shape": [1]}, 8, "not in the allow-list"),
        ({"dtype": ["float32"], "shape": [1]}, 4, "not in the allow-list"),
        ({"dtype": "float32"}, 4, "exactly"),
        ({"dtype": "float32", "shape": [1], "name": "x"}, 4, "exactly"),
        ({"tensor": {"dtype": "float32", "shape": [1]}}, 4, "exactly"),
        ([1], 4, "exactly"),
        ({"dtype": "float32", "shape": "1"}, 4, "must be a list"),
        ({"dtype": "float32", "shape": [1] * (MAX_NDIM + 1)}, 4, f"at most {MAX_NDIM}"),
        ({"dtype": "float32", "shape": [-1]}, 4, "dimension -1"),
        ({"dtype": "float32", "shape": [1.0]}, 4, "dimension 1.0"),
        ({"dtype": "float32", "shape": [True]}, 4, "dimension True"),
        ({"dtype": "float32", "shape": [None]}, 4, "dimension None"),
        ({"dtype": "float32", "shape": [MAX_DIM + 1, 0]}, 0, f"dimension {MAX_DIM + 1}"),
        ({"dtype": "float32", "shape": [2, 3]}, 23, "needs 24 bytes but the payload has 23"),
        ({"dtype": "bfloat16", "shape": [3]}, 3, "needs 6 bytes"),
        ({"dtype": "complex64", "shape": [MAX_DIM] * MAX_NDIM}, 64, "needs .* bytes"),
    ],
)
def test_bad_descriptors_are_frame_errors(descriptor, payload_len, needle):
    with pytest.raises(FrameError, match=needle):
        check_tensor_descriptor(descriptor, payload_len)
    with pytest.raises(FrameError, match=needle):
        tensor_from_buffer(descriptor, bytes(payload_len))


def test_bool_payload_must_hold_only_zero_and_one():
    with pytest.raises(FrameError, match="bool tensor payload"):
        tensor_from_buffer({"dtype": "bool", "shape": [3]}, b"\x00\x01\x02")


@settings(max_examples=200)
@given(
    st.dictionaries(
        st.sampled_from(["dtype", "shape", "x"]),
        st.none()
        | st.integers()
        | st.text(max_size=10)
        | st.lists(st.integers(-(2**40), 2**40) | st.floats() | st.booleans(), max_size=10),
    ),
    st.integers(0, 10_000),
)
def test_arbitrary_descriptors_validate_or_raise_frame_error(descriptor, payload_len):
    try:
        dtype, shape = check_tensor_descriptor(descriptor, payload_len)
    except FrameError:
        return
    assert math.prod(shape) * dtype.size == payload_len


def test_arrays_that_cannot_travel():
    with pytest.raises(FrameError, match=f"over the limit of {MAX_NDIM}"):
        tensor_descriptor(mx.zeros([1] * (MAX_NDIM + 1)))


def test_dtype_names_are_mlx_names():
    assert all(str(dtype) == f"mlx.core.{name}" for name, dtype in DTYPES.items())


@pytest.mark.parametrize("dtype", sorted(DTYPES, key=str))
def test_wire_bits_are_the_arrays_own_bytes_and_need_no_view_where_the_buffer_exports(dtype):
    arr = (mx.arange(6) % 2).astype(DTYPES[dtype]).reshape(2, 3)
    bits = wire_bits(arr)
    mx.eval(bits)
    assert bytes(tensor_to_buffer(bits)) == bytes(tensor_to_buffer(arr))
    native = dtype not in ("bfloat16", "bool", "complex64")
    assert (bits is arr) == native
    if native:
        memoryview(arr)  # exports as it is: tensor_to_buffer takes it without a view
