"""The strict device (MINIPAR_DEVICE=strict): NumPy memory behind CuPy's rules.

Each rule CuPy enforces and NumPy does not is a refusal here, with a message that says what to
write instead; what CuPy allows stays allowed. The suite's engine, communication and parallel
tests run once under MINIPAR_DEVICE=strict in CI, so these rules are what keeps them honest.
"""
import numpy as np
import pytest

import minipar
from minipar import backend
from minipar.backend import strict as xp


@pytest.fixture
def strict_device():
    """The strict device for the test (conftest.py restores the run's device after it)."""
    backend.set_device("strict")
    return xp


def device_array():
    return xp.asarray(np.arange(6.0).reshape(2, 3))


# --- refusals: each a TypeError that names the way out --------------------------------------------
@pytest.mark.parametrize("convert", [np.asarray, np.array, np.float64, np.ascontiguousarray])
def test_no_implicit_conversion_to_numpy(convert):
    with pytest.raises(TypeError, match=r"Implicit conversion to a NumPy array.*\.get\(\)"):
        convert(device_array())


@pytest.mark.parametrize("call, name", [
    (lambda a: np.sum(a), "numpy.sum"), (lambda a: np.concatenate([a, a]), "numpy.concatenate"),
    (lambda a: np.linalg.norm(a), "numpy.linalg.norm"), (lambda a: np.exp(a), "numpy.exp"),
    (lambda a: np.maximum(a, 0), "numpy.maximum"), (lambda a: np.add.at(a, [0], 1), "numpy.add.at"),
])
def test_numpy_functions_refuse_device_arrays(call, name):
    with pytest.raises(TypeError, match=rf"{name}.*device array.*xp\."):
        call(device_array())


@pytest.mark.parametrize("mix", [
    lambda a, h: a + h, lambda a, h: h + a, lambda a, h: h * a, lambda a, h: a < h,
    lambda a, h: h == a, lambda a, h: a @ h.T,
])
def test_arithmetic_mixing_numpy_and_device_arrays_is_refused(mix):
    with pytest.raises(TypeError, match=r"numpy\.ndarray.*xp\.asarray"):
        mix(device_array(), np.ones((2, 3)))


def test_in_place_mixing_is_refused_both_ways():
    a, h = device_array(), np.ones((2, 3))
    with pytest.raises(TypeError, match="numpy.ndarray"):
        a += h
    with pytest.raises(TypeError, match="numpy.ndarray"):
        h += a


def test_the_module_refuses_numpy_arguments():
    with pytest.raises(TypeError, match=r"xp\.add\(\) was given a numpy\.ndarray"):
        xp.add(np.ones(3), xp.ones(3))
    with pytest.raises(TypeError, match=r"xp\.concatenate\(\) was given a numpy\.ndarray"):
        xp.concatenate([xp.ones(3), np.ones(3)])
    with pytest.raises(TypeError, match=r"xp\.where\(\) was given a numpy\.ndarray"):
        xp.where(np.ones(3, bool), xp.ones(3), 0.0)


@pytest.mark.parametrize("kind", [float, int, complex])
def test_python_scalars_only_from_one_element(kind):
    with pytest.raises(TypeError, match=rf"{kind.__name__}\(\) of a device array of shape"):
        kind(device_array())
    assert kind(xp.asarray([3.0])) == kind(3.0)
    assert kind(device_array().sum()) == kind(15.0)
    with pytest.raises(ValueError, match="ambiguous"):
        bool(device_array())


def test_apis_cupy_lacks_are_refused():
    with pytest.raises(TypeError, match="sparse"):
        xp.indices((2, 3), sparse=True)
    assert xp.indices((2, 3)).shape == (2, 2, 3)
    with pytest.raises(AttributeError, match="permutation"):
        xp.random.default_rng(0).permutation(5)
    with pytest.raises(AttributeError, match="at"):
        xp.exp.at
    with pytest.raises(AttributeError, match="tofile"):
        device_array().tofile


def test_mpi_cannot_read_device_memory():
    with pytest.raises(TypeError):
        memoryview(device_array())


# --- what CuPy allows stays allowed ---------------------------------------------------------------
def test_get_and_set_are_the_explicit_transfers():
    a = device_array()
    host = a.get()
    assert type(host) is np.ndarray and host.tolist() == [[0, 1, 2], [3, 4, 5]]
    host[0, 0] = 99.0  # a copy: the device array does not change
    assert a[0, 0].item() == 0.0
    a.set(np.full((2, 3), 7.0))
    assert minipar.to_numpy(a).tolist() == [[7.0] * 3] * 2
    with pytest.raises(ValueError, match="Shape mismatch"):
        a.set(np.ones(3))
    assert type(xp.asnumpy(a)) is np.ndarray


def test_scalars_indexing_and_assignment_as_in_cupy():
    a = device_array()
    assert type(a + 1) is xp.ndarray and type(2.0 * a) is xp.ndarray
    assert type(np.float32(2) * a) is xp.ndarray and (a > np.float64(2)).sum().item() == 3
    assert type(a.sum()) is xp.ndarray and a.sum().ndim == 0  # a reduction stays on the device
    assert a[np.array([1, 0])][0, 0].item() == 3.0  # a NumPy index is copied over
    a[0] = np.array([7.0, 8.0, 9.0])  # and so is a NumPy value assigned into a slice
    assert a[0].tolist() == [7.0, 8.0, 9.0]
    assert [row.shape for row in a] == [(3,), (3,)] and len(a) == 2
    assert f"{a[0, 0]:.1f}" == "7.0"


def test_a_view_names_its_owner_as_cupy_does():
    a = device_array()
    assert a.base is None and a.reshape(6).base is a and a[0].T.base is a


def test_asarray_copies_host_data():
    host = np.zeros(3)
    a = xp.asarray(host)
    host[0] = 1.0
    assert a[0].item() == 0.0
    assert xp.asarray(a) is a


def test_get_array_module_and_namespace():
    a = device_array()
    assert xp.get_array_module(a) is xp and xp.get_array_module(np.ones(1)) is np
    assert xp.float32 is np.float32 and xp.newaxis is None and xp.pi == np.pi
    assert type(xp.linalg.norm(a)) is xp.ndarray
    assert type(xp.random.default_rng(0).standard_normal((2, 2))) is xp.ndarray


# --- the backend's switch -------------------------------------------------------------------------
def test_backend_accepts_strict(strict_device):
    assert backend.device() == "strict" and backend.xp() is xp
    a = backend.asarray(np.ones(3))
    assert backend.is_gpu_array(a) and backend.get_array_module(a) is xp
    assert type(backend.to_numpy(a)) is np.ndarray
    backend.synchronize()  # nothing to wait for


def test_tensors_land_on_the_strict_device(strict_device):
    t = minipar.tensor(np.arange(3.0), requires_grad=True)
    assert type(t.data) is xp.ndarray
    (t * t).sum().backward()
    assert type(t.grad) is xp.ndarray and t.numpy().tolist() == [0.0, 1.0, 2.0]
    assert minipar.to_numpy(t.grad).tolist() == [0.0, 2.0, 4.0]


def test_an_unknown_device_lists_strict():
    with pytest.raises(ValueError, match="auto, cpu, gpu, strict"):
        backend.set_device("tpu")
