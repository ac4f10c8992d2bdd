"""examples/train.py refuses what it cannot run before it trains (issue 39): a catalog smaller than
the top items the metrics rank, data with no negative left to sample; and a killed save's temporary
checkpoint file does not outlive the next run. Each refusal is exit status 2 and one error line,
no traceback, also from every rank under torchrun."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples_extra import require_examples

require_examples()

from examples import train  # noqa: E402

pytestmark = pytest.mark.rung4

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--dataset", "synthetic", "--synthetic-users", "64", "--max-len", "10", "--dim", "16", "--num-layers", "1",
        "--num-heads", "2", "--epochs", "1"]


def run_example(*argv: str, fsdp_ranks: int = 0) -> subprocess.CompletedProcess:
    env = dict(os.environ, TORCH_CUTBCE_NO_COMPILE="1", CUDA_VISIBLE_DEVICES="")
    launcher = [sys.executable]
    if fsdp_ranks:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={fsdp_ranks}"]
    return subprocess.run([*launcher, "examples/train.py", *argv], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("examples/train.py: error:")]


@pytest.mark.parametrize("argv, message", [
    # The catalog of 2 or 3 items trained a whole epoch, then failed to rank the top 20 (--loss
    # sampled: failed at start-up, finding no negative to sample).
    (["--synthetic-items", "2"], "--synthetic-items must be >= 20 (the top items the metrics rank: max(20, --k)), got 2"),
    (["--synthetic-items", "3", "--loss", "sampled"], "--synthetic-items must be >= 20"),
    (["--synthetic-items", "24", "--k", "25"], "--synthetic-items must be >= 25 (the top items the metrics rank"),
])
def test_a_catalog_too_small_for_the_metrics_is_a_usage_error(tmp_path, argv, message):
    done = run_example(*TINY, *argv, "--out-dir", str(tmp_path))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(error_lines(done.stderr)) == 1
    assert message in done.stderr and not list(tmp_path.iterdir())  # refused before it wrote anything


def test_data_with_no_negative_to_sample_is_one_line(tmp_path):
    """20 items pass the metrics' rule, but one of 300 synthetic users has seen all of them."""
    done = run_example(*TINY, "--synthetic-items", "20", "--synthetic-users", "300", "--loss", "sampled",
                       "--out-dir", str(tmp_path))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.splitlines() == ["examples/train.py: error: --loss sampled: synthetic-20: user 39 has seen "
                                        "all 20 items in training; no negative can be sampled for it"]


def test_a_small_data_file_is_refused_before_training(tmp_path, capsys):
    """A catalog the flags do not reveal (--data-path) is checked once the data are read."""
    events = [(user, item) for user in range(3) for item in range(5)]
    inter = tmp_path / "small.inter"
    inter.write_text("user_id:token\titem_id:token\ttimestamp:float\n"
                     + "".join(f"{u}\t{i}\t{n}\n" for n, (u, i) in enumerate(events)))
    assert train.main(["--data-path", str(inter), "--out-dir", str(tmp_path / "run"), "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert err == (f"examples/train.py: error: --dataset ml-100k --data-path {inter}: 5 items, fewer than the top 20 "
                   "the metrics rank\n")


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")
def test_every_rank_refuses_under_torchrun(tmp_path):
    """Checked at parse time, before the process group starts: each rank exits 2 with the one line
    (torchrun itself then reports the failed ranks, with its own traceback)."""
    done = run_example(*TINY, "--synthetic-items", "2", "--fsdp", "--out-dir", str(tmp_path), fsdp_ranks=2)
    assert done.returncode != 0 and "exitcode  : 2" in done.stderr, done.stderr[-3000:]
    assert error_lines(done.stderr) and set(error_lines(done.stderr)) == {
        "examples/train.py: error: --synthetic-items must be >= 20 (the top items the metrics rank: max(20, --k)), "
        "got 2"}
    assert 'examples/train.py", line' not in done.stderr  # no rank died in a traceback


class SimulatedKill(BaseException):
    """Raised from train()'s after_step hook before any checkpoint is written."""


def kill_at_first_step(step):
    raise SimulatedKill(f"killed after step {step}")


@pytest.mark.parametrize("resume", [False, True])
def test_a_killed_saves_temporary_file_goes_when_the_next_run_starts(tmp_path, resume):
    """A run killed inside atomic_save leaves ckpt.pt.tmp (or best.pt.tmp) beside the whole file; the
    next run on that --out-dir, resumed or fresh, deletes it before its first step."""
    cfg = train.parse_args([*TINY, "--synthetic-items", "300", "--out-dir", str(tmp_path)])
    for name in ("ckpt.pt.tmp", "best.pt.tmp"):
        (tmp_path / name).write_bytes(b"half a checkpoint")
    with pytest.raises(SimulatedKill):  # killed after step 1, before any save could replace the files
        train.train(train.TrainConfig(**{**vars(cfg), "resume": resume}), after_step=kill_at_first_step)
    assert not list(tmp_path.glob("*.tmp"))
