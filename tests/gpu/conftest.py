"""Skip every test under tests/gpu, with a visible reason, when no CUDA GPU is usable (never fail);
the fixtures of the kernel tests: the device, the activation element type, a KernelCase."""
from pathlib import Path

import pytest

from harness import KernelCase
from rwkvx.runtime.dtypes import XTYPES

_HERE = Path(__file__).resolve().parent
_state: dict = {}


def gpu_unavailable_reason():
    """None when rwkvx.runtime.Device.get() works here, else why not (cached)."""
    if "reason" not in _state:
        try:
            from rwkvx.runtime import Device
            Device.get()
            _state["reason"] = None
        except Exception as e:  # noqa: BLE001 - any failure means: no usable GPU here
            _state["reason"] = f"no CUDA GPU: {type(e).__name__}: {e}"
    return _state["reason"]


def pytest_collection_modifyitems(config, items):
    mine = [it for it in items if _HERE in Path(str(it.path)).resolve().parents]
    if not mine:
        return
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    marker = pytest.mark.skip(reason=reason)
    for it in mine:
        it.add_marker(marker)


@pytest.fixture(scope="session")
def dev():
    """The process-wide rwkvx Device (tests here only run when it exists)."""
    reason = gpu_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    from rwkvx.runtime import Device
    return Device.get()


@pytest.fixture(params=XTYPES)
def xtype(request):
    """The activation element type a kernel test runs with: every kernel is tested in each."""
    return request.param


@pytest.fixture
def case(dev, xtype):
    """A fresh KernelCase (its buffers are freed with it)."""
    return KernelCase(dev, xtype)
