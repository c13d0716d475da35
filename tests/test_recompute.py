"""recompute="auto" (rwkvx.model): the setting's validation, the pure decision from the free memory and
the arena's size (rwkvx.arena.Layout, no GPU needed), and the CLI's --recompute / --no-recompute."""
import pytest

from rwkvx import Config, init_params
from rwkvx.arena import Layout
from rwkvx.cli import build_parser
from rwkvx.model import (DEFAULT_RECOMPUTE, RECOMPUTE_AUTO, RECOMPUTE_AUTO_MARGIN, Model, auto_recompute,
                         check_recompute)
from rwkvx.presets import get_preset
from rwkvx.runtime.device import H200
from rwkvx.training.config import TrainConfig

H200_FREE = 139 << 30      # about what cuMemGetInfo reports free on an idle H200


def keep_bytes(name: str) -> int:
    """The arena without recompute of preset ``name`` at its GPU training batch."""
    preset = get_preset(name, "gpu")
    train = preset["train"]
    return Layout(Config(**preset["model"]), train.batch_size, train.seq_len, H200, train.precision,
                  recompute=False).total


def test_auto_keeps_the_forward_state_when_that_arena_fits():
    assert DEFAULT_RECOMPUTE == RECOMPUTE_AUTO and TrainConfig().recompute == RECOMPUTE_AUTO
    assert auto_recompute(H200_FREE, keep_bytes("small")) is False
    assert auto_recompute(H200_FREE, keep_bytes("rwkv7-0.1b")) is False   # 53 GiB
    assert auto_recompute(H200_FREE, keep_bytes("rwkv7-2.9b")) is True    # 152 GiB
    assert auto_recompute(40 << 30, keep_bytes("rwkv7-0.1b")) is True     # a smaller or busier GPU


def test_auto_leaves_the_margin():
    keep = keep_bytes("small")
    assert auto_recompute(keep + RECOMPUTE_AUTO_MARGIN, keep) is False
    assert auto_recompute(keep + RECOMPUTE_AUTO_MARGIN - 1, keep) is True
    assert auto_recompute(keep + 10, keep, margin=10) is False


@pytest.mark.parametrize("value", [True, False, "auto"])
def test_valid_settings(value):
    assert check_recompute(value) is value
    assert TrainConfig(recompute=value).recompute is value


@pytest.mark.parametrize("value, error", [("always", ValueError), ("", ValueError), (1, TypeError),
                                          (None, TypeError)])
def test_bad_settings_are_clear_errors(value, error):
    with pytest.raises(error, match=r"TrainConfig.recompute must be True, False or 'auto'"):
        TrainConfig(recompute=value)
    cfg = Config(vocab_size=16, n_embd=16, head_size=8, n_rwkv_layer=1)
    with pytest.raises(error, match=r"^recompute must be True, False or 'auto'"):   # before any GPU work
        Model(cfg, init_params(cfg, 0), 1, 8, recompute=value)


@pytest.mark.parametrize("flags, value", [([], None), (["--recompute"], True), (["--no-recompute"], False),
                                          (["--recompute", "auto"], "auto")])
def test_cli_flags(flags, value):
    assert build_parser().parse_args(["train", *flags]).recompute == value


def test_cli_rejects_other_values(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["train", "--recompute", "sometimes"])
    assert exc.value.code == 2 and "invalid choice: 'sometimes'" in capsys.readouterr().err


@pytest.mark.parametrize("requested, resolved, note", [
    ("auto", False, "recompute off; auto: the arena without recompute fits in the free GPU memory"),
    ("auto", True, "recompute on; auto: the arena without recompute does not fit in the free GPU memory"),
    (True, True, "recompute on"), (False, False, "recompute off")])
def test_the_device_line_says_what_was_chosen_and_why(requested, resolved, note):
    from types import SimpleNamespace

    from rwkvx.cli import _recompute_note

    run = SimpleNamespace(info={"recompute": resolved}, train=TrainConfig(recompute=requested))
    assert _recompute_note(run) == note
