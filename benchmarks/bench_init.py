"""``init_params`` of the large presets: seconds to initialise rwkv7-1.5b, 2.9b and 7.2b on the device
(``device="gpu"``: draws and Cholesky QR on the GPU, one download), and 1.5b on the host (``"cpu"``,
the PCG64 path) for comparison. One round each: an init is seconds on the GPU, minutes on the host.
``extra_info``: seconds, parameters per second, the device scratch in GiB.
"""
import pytest

from rwkvx import Config, init_params
from rwkvx.device_init import scratch_bytes
from rwkvx.presets import get_preset

CASES = [("rwkv7-1.5b", "gpu"), ("rwkv7-2.9b", "gpu"), ("rwkv7-7.2b", "gpu"), ("rwkv7-1.5b", "cpu")]


@pytest.mark.parametrize("preset, device", CASES, ids=[f"{p}-{d}" for p, d in CASES])
def test_init_params(benchmark, request, preset, device):
    cfg = Config(**get_preset(preset)["model"])
    if device == "gpu":
        request.getfixturevalue("dev")                  # skips without a GPU
        init_params(Config(vocab_size=256, n_embd=128, head_size=64, n_rwkv_layer=1), 0, device="gpu")  # compile
    params = benchmark.pedantic(init_params, args=(cfg, 0, device), rounds=1, iterations=1)
    seconds = benchmark.stats.stats.mean
    count = sum(v.size for v in params.values())
    benchmark.extra_info.update(seconds=round(seconds, 2), params=count,
                                params_per_s=f"{count / seconds:.3g}",
                                scratch_gib=round(scratch_bytes(cfg) / 2**30, 2) if device == "gpu" else 0)
