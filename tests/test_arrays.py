"""gpucoll.arrays: which objects become ArrayRefs, without copies, and how refs are sliced."""

import array

import ml_dtypes
import numpy as np
import pytest

from gpucoll.arrays import (
    SUPPORTED_DTYPES,
    as_ref,
    check_dtype,
    dtype_from_name,
    empty_like,
    flat_view,
    new_array,
    write_back,
)


def test_numpy_ref_points_at_the_arrays_memory():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    ref = as_ref(x, "x")
    assert (ref.kind, ref.shape, ref.count, ref.nbytes) == ("host", (3, 4), 12, 48)
    assert ref.array is x and ref.ptr == x.ctypes.data
    assert ref.host.shape == (12,) and np.shares_memory(ref.host, x)


def test_zero_d_array_has_one_element():
    ref = as_ref(np.array(5, dtype=np.int64), "x")
    assert (ref.shape, ref.count, ref.nbytes) == ((), 1, 8)


def test_empty_array_has_no_elements():
    ref = as_ref(np.empty((0, 3), dtype=np.float64), "x")
    assert (ref.count, ref.nbytes, ref.shape) == (0, 0, (0, 3))


def test_bytearray_is_viewed_as_writable_uint8_without_copy():
    buf = bytearray(b"abcd")
    ref = as_ref(buf, "x")
    ref.host[0] = ord("z")
    assert buf[0] == ord("z") and ref.dtype == np.uint8 and ref.writable


def test_bytes_are_read_only():
    assert not as_ref(b"abcd", "x").writable


def test_array_module_keeps_its_item_type():
    ref = as_ref(array.array("d", [1.0, 2.0, 3.0]), "x")
    assert ref.dtype == np.float64 and ref.count == 3


def test_array_interface_object_is_viewed_without_copy():
    backing = np.zeros(4, dtype=np.int32)

    class Exposes:
        __array_interface__ = backing.__array_interface__

    ref = as_ref(Exposes(), "x")
    ref.host[2] = 7
    assert backing[2] == 7


@pytest.mark.slow
def test_cpu_dlpack_tensor_is_viewed_without_copy():
    torch = pytest.importorskip("torch")
    t = torch.zeros(5, dtype=torch.float32)
    ref = as_ref(t, "x")
    ref.host[1] = 3.0
    assert float(t[1]) == 3.0 and ref.array is t


def test_bfloat16_arrays_keep_their_dtype():
    ref = as_ref(np.ones(3, dtype=ml_dtypes.bfloat16), "x")
    assert ref.dtype.name == "bfloat16"
    check_dtype(ref.dtype, "x")


@pytest.mark.parametrize("obj", [[1, 2], 3.0, "text", None, {"a": 1}])
def test_non_arrays_are_a_type_error_naming_the_argument(obj):
    with pytest.raises(TypeError, match=r"^buf must be an array .* got "):
        as_ref(obj, "buf")


def test_strided_array_is_refused_unless_copying_is_allowed():
    x = np.arange(10.0)[::2]
    with pytest.raises(ValueError, match="x must be C-contiguous"):
        as_ref(x, "x")
    ref = as_ref(x, "x", copy=True)
    assert ref.array is not x and ref.host.tolist() == x.tolist()


def test_write_back_returns_results_into_the_strided_original():
    x = np.zeros((4, 4))[:, 1]
    ref = as_ref(x, "x", copy=True)
    ref.host[:] = [1, 2, 3, 4]
    write_back(ref, x)
    assert x.tolist() == [1, 2, 3, 4]


def test_flat_view_is_a_slice_sharing_memory():
    x = np.arange(10, dtype=np.int16)
    part = flat_view(as_ref(x, "x"), 3, 4)
    assert part.host.tolist() == [3, 4, 5, 6] and part.ptr == x.ctypes.data + 6
    part.host[0] = -1
    assert x[3] == -1


def test_flat_view_outside_the_buffer_is_refused():
    with pytest.raises(ValueError, match="outside 10 elements"):
        flat_view(as_ref(np.arange(10), "x"), 8, 3)


def test_empty_like_makes_a_numpy_array_of_the_dtype():
    out = empty_like(as_ref(np.ones(2, dtype=np.complex64), "x"), (3, 2))
    assert isinstance(out, np.ndarray) and out.shape == (3, 2) and out.dtype == np.complex64


def test_new_array_of_host_kind_is_numpy():
    out = new_array("host", (2,), np.dtype(np.uint16))
    assert isinstance(out, np.ndarray) and out.dtype == np.uint16


@pytest.mark.parametrize("name", SUPPORTED_DTYPES)
def test_every_supported_dtype_name_round_trips(name):
    dtype = dtype_from_name(name)
    assert dtype.name == name
    check_dtype(dtype, "x")


@pytest.mark.parametrize("dtype", [np.dtype(object), np.dtype("U3"), np.dtype(">i4"),
                                   np.dtype([("a", "i4")]), np.dtype(np.longdouble)])
def test_unsupported_dtypes_are_a_type_error_listing_the_supported_ones(dtype):
    if dtype == np.dtype(np.longdouble) and dtype.itemsize == 8:
        pytest.skip("long double is float64 here")
    with pytest.raises(TypeError, match=r"x has unsupported dtype .*expected native-endian"):
        check_dtype(dtype, "x")
