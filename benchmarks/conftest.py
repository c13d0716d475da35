"""The device fixture of the GPU benchmarks: skipped, with the reason, where no GPU is usable."""
import pytest


@pytest.fixture(scope="module")
def dev():
    """The process-wide rwkvx Device."""
    try:
        from rwkvx.runtime import Device
        return Device.get()
    except Exception as exc:  # noqa: BLE001 - no usable GPU
        pytest.skip(f"no CUDA GPU: {exc}")
