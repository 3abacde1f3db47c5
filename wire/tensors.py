"""mx.array <-> raw bytes, for every MLX dtype, bit for bit.

A tensor travels as a descriptor {"dtype": "bfloat16", "shape": [1, 7, 64]}
plus its own bytes in C order and the host's byte order (little-endian on every
platform MLX runs on). No dtype is converted on the way: bfloat16 stays
bfloat16. Where a descriptor sits in a frame, and what the tensor means, is up
to the caller; this module only maps arrays to bytes and validates the way back.

Both directions move the bits as a same-size unsigned integer view: bfloat16
has no PEP 3118 format, bool exports as '?' and complex64 as 'Zf', while
uint8/16/32/64 pass through memoryview and numpy untouched.
"""

import math

import mlx.core as mx
import numpy as np

from wire.frames import FrameError

DTYPES: dict[str, mx.Dtype] = {
    "bool": mx.bool_,
    "uint8": mx.uint8,
    "uint16": mx.uint16,
    "uint32": mx.uint32,
    "uint64": mx.uint64,
    "int8": mx.int8,
    "int16": mx.int16,
    "int32": mx.int32,
    "int64": mx.int64,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "float32": mx.float32,
    "float64": mx.float64,
    "complex64": mx.complex64,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# One byte per dtype, for fixed binary headers (0 stands for no tensor). Part of the
# protocol: append new dtypes, never renumber.
DTYPE_CODES: dict[mx.Dtype, int] = {
    mx.bool_: 1, mx.uint8: 2, mx.uint16: 3, mx.uint32: 4, mx.uint64: 5, mx.int8: 6, mx.int16: 7,
    mx.int32: 8, mx.int64: 9, mx.float16: 10, mx.bfloat16: 11, mx.float32: 12, mx.float64: 13,
    mx.complex64: 14,
}  # fmt: skip
CODE_DTYPES: dict[int, mx.Dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}
assert set(DTYPE_CODES) == set(DTYPES.values()), "every wire dtype has a code"

# The ring carries activations (batch, sequence, hidden) and KV blocks (batch,
# heads, sequence, head_dim); 8 dimensions is double that and bounds the work
# of validating a shape.
MAX_NDIM = 8
# MLX stores each dimension as an int32; a larger one cannot become an array.
MAX_DIM = 2**31 - 1

# Same-size carriers for the bits, by item size in bytes.
_MX_BITS = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}
_NP_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def tensor_descriptor(arr: mx.array) -> dict:
    """{"dtype": name, "shape": [...]} for `arr`; FrameError if it cannot travel."""
    if arr.dtype not in _DTYPE_NAMES:
        raise FrameError(f"dtype {arr.dtype} is not in the wire allow-list {sorted(DTYPES)}")
    if arr.ndim > MAX_NDIM:
        raise FrameError(f"array has {arr.ndim} dimensions, over the limit of {MAX_NDIM}")
    return {"dtype": _DTYPE_NAMES[arr.dtype], "shape": list(arr.shape)}


# Dtypes whose arrays export a PEP 3118 buffer as they are: their bytes need no view.
_NATIVE = {mx.uint8, mx.uint16, mx.uint32, mx.uint64, mx.int8, mx.int16, mx.int32, mx.int64, mx.float16, mx.float32, mx.float64}


def wire_bits(arr: mx.array) -> mx.array:
    """``arr``'s bits as an array whose buffer exports as it is (lazy): itself, or a same-size
    unsigned view (bfloat16, bool, complex64). Evaluated with the caller's own ``mx.eval``, its
    ``tensor_to_buffer`` costs no evaluation of its own, which on MLX's CPU backend is a thread
    round trip (~70 us) per hop."""
    return arr if arr.dtype in _NATIVE else arr.view(_MX_BITS[arr.dtype.size])


def tensor_to_buffer(arr: mx.array) -> memoryview:
    """A flat byte view ('B', C order) of the array's own memory.

    No copy when the array is already row-contiguous; otherwise (transposed,
    sliced with steps, broadcast) one copy by mx.contiguous. Evaluates the array
    (nothing to do if it is evaluated, and of a native dtype: see ``wire_bits``).
    """
    mx.eval(arr)
    if arr.size == 0:
        return memoryview(b"")
    if not memoryview(arr).c_contiguous:
        arr = mx.contiguous(arr)
    # A same-size view shares the array's buffer: the bits, not a conversion.
    bits = wire_bits(arr)
    if bits is not arr:
        mx.eval(bits)
    return memoryview(bits).cast("B")


def check_tensor_descriptor(descriptor, payload_len: int) -> tuple[mx.Dtype, tuple[int, ...]]:
    """Validate a tensor descriptor against the payload length; allocates nothing."""
    if not isinstance(descriptor, dict) or descriptor.keys() != {"dtype", "shape"}:
        raise FrameError(
            'tensor descriptor must be exactly {"dtype": ..., "shape": [...]}, got '
            f"{descriptor!r:.200}"
        )
    name, shape = descriptor["dtype"], descriptor["shape"]
    if not isinstance(name, str) or name not in DTYPES:
        raise FrameError(f"tensor dtype {name!r:.50} is not in the allow-list {sorted(DTYPES)}")
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_NDIM:
        raise FrameError(
            f"tensor shape must be a list of at most {MAX_NDIM} ints, got {shape!r:.200}"
        )
    for dim in shape:
        # bool is an int subclass, but true is no dimension.
        if type(dim) is not int or not 0 <= dim <= MAX_DIM:
            raise FrameError(
                f"tensor shape {shape!r:.200} has dimension {dim!r:.50}; each must be "
                f"an int in [0, {MAX_DIM}]"
            )
    dtype = DTYPES[name]
    _check_size(dtype, shape, payload_len)
    return dtype, tuple(shape)


def _check_size(dtype: mx.Dtype, shape, payload_len: int) -> None:
    # Python ints: the product cannot overflow, whatever the peer declared.
    expected = math.prod(shape) * dtype.size
    if expected != payload_len:
        raise FrameError(
            f"tensor {_DTYPE_NAMES[dtype]}{list(shape)} needs {expected} bytes but the payload has {payload_len}"
        )


def tensor_from_buffer(descriptor: dict, payload) -> mx.array:
    """The array a descriptor and payload describe: validated first, then one copy into MLX."""
    payload = memoryview(payload)
    dtype, shape = check_tensor_descriptor(descriptor, payload.nbytes)
    return _from_bits(dtype, shape, payload)


def tensor_from_bits(code: int, shape: tuple[int, ...], payload) -> mx.array:
    """The array of dtype ``code`` (``DTYPE_CODES``) and ``shape`` whose bytes are ``payload``,
    as a fixed binary header declares it: validated first, then one copy into MLX."""
    payload = memoryview(payload)
    dtype = CODE_DTYPES.get(code)
    if dtype is None:
        raise FrameError(f"tensor dtype code {code} is not one of {sorted(CODE_DTYPES)}")
    if len(shape) > MAX_NDIM or not all(type(d) is int and 0 <= d <= MAX_DIM for d in shape):
        raise FrameError(f"tensor shape {list(shape)!r:.200} must be at most {MAX_NDIM} ints in [0, {MAX_DIM}]")
    _check_size(dtype, shape, payload.nbytes)
    return _from_bits(dtype, tuple(shape), payload)


def _from_bits(dtype: mx.Dtype, shape: tuple[int, ...], payload: memoryview) -> mx.array:
    bits = np.frombuffer(payload, dtype=_NP_BITS[dtype.size]).reshape(shape)
    if dtype == mx.bool_ and bits.size and bits.max() > 1:
        # MLX only ever writes 0 or 1 into a bool; other bytes are not valid bools.
        raise FrameError("bool tensor payload has bytes other than 0 and 1")
    return mx.array(bits).view(dtype)
