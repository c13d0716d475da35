"""The host images a GPU Model uploads, built on the CPU (no device): the bf16 copy of the weights packed one
tensor at a time equals the bf16 rounding of the whole float32 image, bit for bit, in the trained and the
frozen (state tuning) layouts."""
import types

import numpy as np
import pytest

from rwkvx import Config
from rwkvx.arena import Layout
from rwkvx.model import Model
from rwkvx.runtime.device import H200
from rwkvx.runtime.dtypes import to_storage

from test_model_plan import CONFIGS


@pytest.mark.parametrize("tune_states", [False, True])
def test_bf16_copy_packed_per_tensor_equals_the_whole_image(random_params, tune_states):
    cfg = Config(**CONFIGS[1][0])
    model = types.SimpleNamespace(cfg=cfg, layout=Layout(cfg, 1, 16, H200, "bf16", True, tune_states=tune_states))
    model._tensors = lambda region: Model._tensors(model, region)
    params = {n: p.astype(np.float32) for n, p in random_params(cfg, 5).items()}
    whole = to_storage("bf16", Model._pack(model, "params_x", params))
    per_tensor = Model._pack(model, "params_x", params, "bf16")
    assert per_tensor.dtype == np.uint16 and per_tensor.size == model.layout.counts["params_x"] > 0
    np.testing.assert_array_equal(per_tensor, whole)
