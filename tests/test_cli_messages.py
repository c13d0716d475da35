"""What ``python -m rwkvx`` prints and how it ends: the CPU fallback note, the validation counts, the
schedule of a resumed run, unwritable outputs, Ctrl-C, the progress bar and the suggested prompt."""
import csv
import re
from pathlib import Path

import numpy as np
import pytest

from rwkvx.cli import main

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--n-embd", "32", "--n-layer", "1", "--n-attn-layer", "1", "--head-size", "16", "--chunk", "8",
         "--top-k", "2", "--batch-size", "2", "--seq-len", "32"]
TINY = ["--device", "cpu", *SMALL, "--no-progress"]


def _exit(argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return exc.value.code


def _lrs(path):
    with open(path, newline="") as f:
        return {int(r["step"]): float(r["lr"]) for r in csv.DictReader(f)}


def test_cpu_fallback_is_one_short_line(tmp_path, capsys, monkeypatch):
    import rwkvx.training.trainer

    long_reason = ("no CUDA GPU is available (the CUDA driver could not be loaded: (details)). Install the "
                   "cu13 extra (pip install 'rwkvx[cu13]'); on a CPU use rwkvx.oracle.Oracle instead.")
    monkeypatch.setattr(rwkvx.training.trainer, "gpu_unavailable_reason", lambda: long_reason)
    assert main(["train", *SMALL, "--no-progress", "--steps", "1", "--out", str(tmp_path / "r")]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert notes == ["note: no usable CUDA GPU here, so training runs on the CPU (the oracle)"]


def test_validation_counts_held_out_and_scored(tmp_path, capsys):
    from rwkvx.training.setup import RunRequest, prepare

    text = tmp_path / "small.txt"
    text.write_text("".join(chr(97 + i % 26) for i in range(279)))
    assert main(["train", *TINY, "--data", str(text), "--steps", "1", "--out", str(tmp_path / "r")]) == 0
    # 279 tokens: the last window of T + 1 = 33 is held out; both evaluation windows score its 32 targets
    assert "(246 train, 33 held out for validation, 32 of them scored)" in capsys.readouterr().out

    prep = prepare(RunRequest(device="cpu", progress=False))      # the default run on the CPU
    assert len(prep.val_tokens) == 51_824 and prep.val_scored == 4 * 8 * 128


def test_resume_keeps_the_schedule_unless_stretched(tmp_path, capsys):
    sched = ["--lr", "4e-3", "--lr-min", "4e-4", "--warmup", "0", "--eval-every", "0"]
    for name in ("kept", "stretched"):
        assert main(["train", *TINY, *sched, "--steps", "3", "--out", str(tmp_path / name)]) == 0
    capsys.readouterr()

    assert main(["train", "--resume", str(tmp_path / "kept"), "--steps", "6", "--no-progress"]) == 0
    assert ("note: the learning-rate schedule keeps its 3 steps: lr stays at 0.0004 after step 3 "
            "(--stretch-schedule stretches the cosine to 6 steps)") in capsys.readouterr().out
    lrs = _lrs(tmp_path / "kept" / "log.csv")
    assert lrs[3] == pytest.approx(4e-4) and [lrs[s] for s in (4, 5, 6)] == pytest.approx([4e-4] * 3)

    assert main(["train", "--resume", str(tmp_path / "stretched"), "--steps", "6", "--stretch-schedule",
                 "--no-progress"]) == 0
    assert "note: the cosine is stretched from 3 to 6 steps: lr at step 4 is 0.0013 (was 0.0004)" in (
        capsys.readouterr().out)
    lrs = _lrs(tmp_path / "stretched" / "log.csv")
    assert lrs[4] == pytest.approx(4e-4 + 0.5 * 3.6e-3 * (1 + np.cos(np.pi * 4 / 6)), rel=1e-5)


@pytest.mark.parametrize("command", ["train", "export", "prepare"])
def test_unwritable_out_is_one_line_and_exit_2(tmp_path, capsys, command):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    out = blocker / "sub" / "x"
    if command == "train":
        argv = ["train", *TINY, "--steps", "1", "--out", str(out)]
    elif command == "export":
        assert main(["train", *TINY, "--n-attn-layer", "0", "--steps", "1", "--out", str(tmp_path / "r")]) == 0
        argv = ["export", "--ckpt", str(tmp_path / "r"), "--out", str(out)]
    else:
        (tmp_path / "doc.txt").write_text("some text to tokenise")
        argv = ["prepare", "--data", str(tmp_path / "doc.txt"), "--tokenizer", "bytes", "--out", str(out),
                "--no-progress"]
    capsys.readouterr()
    assert _exit(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"python -m rwkvx {command}: error: --out {out}: cannot write there "
                   f"({blocker} is not a directory)\n")


def test_io_error_while_training_is_one_line(tmp_path, capsys, monkeypatch):
    import rwkvx.training.loop

    def disk_full(*args):
        raise OSError(28, "No space left on device", str(tmp_path / "r" / "loss.png"))

    monkeypatch.setattr(rwkvx.training.loop, "write_plot", disk_full)
    assert _exit(["train", *TINY, "--steps", "1", "--out", str(tmp_path / "r")]) == 1
    assert capsys.readouterr().err == (f"python -m rwkvx train: error: {tmp_path / 'r' / 'loss.png'}: "
                                       "No space left on device\n")


def test_abort_is_one_line_exit_130_nothing_half_written(tmp_path, capsys, monkeypatch):
    """A second Ctrl-C (KeyboardInterrupt inside a step) aborts: the last periodic checkpoint stays,
    no temporary file is left behind."""
    from rwkvx.training.trainer import Trainer

    out = tmp_path / "r"
    submit = Trainer.submit

    def interrupted_at_3(self, x, y):
        if self.step_count == 2:
            raise KeyboardInterrupt
        return submit(self, x, y)

    monkeypatch.setattr(Trainer, "submit", interrupted_at_3)
    assert _exit(["train", *TINY, "--steps", "5", "--ckpt-every", "1", "--eval-every", "0",
                  "--out", str(out)]) == 130
    assert capsys.readouterr().err == "python -m rwkvx train: interrupted (the run's last checkpoint stays)\n"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.safetensors", "log.csv", "run.json"]
    assert Trainer.load(out / "checkpoint.safetensors", backend="cpu").step_count == 2


def test_progress_bar_draws_its_last_line_once(tmp_path, capsys, monkeypatch):
    import rwkvx.training.loop

    monkeypatch.setattr(rwkvx.training.loop, "PROGRESS_INTERVAL_S", 0)   # redraw on every step
    assert main(["train", "--device", "cpu", *SMALL, "--steps", "3", "--out", str(tmp_path / "r")]) == 0
    frames = [f for f in re.split(r"[\r\n]", capsys.readouterr().err) if f.strip()]
    assert sum("3/3" in f for f in frames) == 1, frames
    assert "2/3" in " ".join(frames)


def test_readme_suggests_the_prompt_the_cli_suggests(tmp_path, capsys):
    from rwkvx.data import DEFAULT_CORPUS_PROMPT

    assert main(["train", *TINY, "--steps", "1", "--eval-every", "0", "--out", str(tmp_path / "r")]) == 0
    assert f"--prompt {DEFAULT_CORPUS_PROMPT!r}" in capsys.readouterr().out
    readme = (REPO / "README.md").read_text()
    prompts = set(re.findall(r"sample --ckpt runs/<run> --prompt \"([^\"]*)\"", readme))
    assert DEFAULT_CORPUS_PROMPT in prompts and "ROMEO." not in readme
