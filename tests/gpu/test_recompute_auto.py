"""recompute="auto" on the GPU: the Model resolves it from the free device memory (the small preset keeps
its forward state; a GPU reported too full recomputes), and a training run prints the choice and saves
it with the run (run.json and the checkpoint's meta["user"]["run"]) beside the requested setting."""
import json

from rwkvx import Config, init_params
from rwkvx.arena import Layout
from rwkvx.checkpoint import load_checkpoint
from rwkvx.cli import main
from rwkvx.model import RECOMPUTE_AUTO_MARGIN, Model
from rwkvx.presets import get_preset
from rwkvx.runtime import Device
from rwkvx.training.rundir import CHECKPOINT_NAME, RUN_NAME


def small():
    preset = get_preset("small", "gpu")
    return Config(**preset["model"]), preset["train"]


def test_auto_keeps_the_forward_state_of_the_small_preset(dev):
    cfg, train = small()
    model = Model(cfg, init_params(cfg, 0), train.batch_size, train.seq_len, precision=train.precision)
    assert model.recompute is False and model.layout.recompute is False
    keep = Layout(cfg, train.batch_size, train.seq_len, dev.info, train.precision, recompute=False)
    assert model.memory_bytes() == keep.total


def test_auto_recomputes_when_the_free_memory_is_short(dev, monkeypatch):
    cfg, train = small()
    B, T = train.batch_size, train.seq_len
    keep = Layout(cfg, B, T, dev.info, train.precision, recompute=False).total
    real = Device.memory_info
    monkeypatch.setattr(Device, "memory_info",
                        lambda self: {**real(self), "free": keep + RECOMPUTE_AUTO_MARGIN - 1})
    model = Model(cfg, init_params(cfg, 0), B, T, precision=train.precision)
    assert model.recompute is True
    assert model.memory_bytes() == Layout(cfg, B, T, dev.info, train.precision, recompute=True).total


def test_the_resolved_choice_is_printed_and_saved_with_the_run(dev, tmp_path, capsys):
    runs = {}
    for flag, requested in (([], "auto"), (["--recompute"], True)):
        out = tmp_path / str(requested)
        assert main(["train", "--preset", "small", "--device", "gpu", "--steps", "2", "--eval-every", "0",
                     "--no-progress", "--out", str(out), *flag]) == 0
        runs[requested] = out, capsys.readouterr().out
    out, printed = runs["auto"]
    assert "(fp32, recompute off; auto: the arena without recompute fits in the free GPU memory)" in printed
    meta = load_checkpoint(out / CHECKPOINT_NAME)[2]["meta"]
    assert meta["train"]["recompute"] == "auto" and meta["user"]["run"]["recompute"] is False
    assert json.loads((out / RUN_NAME).read_text())["run"]["recompute"] is False
    out, printed = runs[True]
    assert "(fp32, recompute on)" in printed
    assert load_checkpoint(out / CHECKPOINT_NAME)[2]["meta"]["user"]["run"]["recompute"] is True
