"""examples/train.py --fsdp: 2 gloo ranks under torchrun train as one process does on the global batch.

The 2-rank run stops after epoch 0 and a second 2-rank run resumes its checkpoint for epoch 1; the
result is compared with one uninterrupted process (same flags, no --fsdp): validation history,
train losses, test metrics and the final parameters. Dropout is 0: each rank draws its own
dropout masks (examples/fsdp.py), so only without dropout are the runs the same up to float
summation order.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from examples_extra import require_examples

require_examples()

if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not built", allow_module_level=True)

from examples import train  # noqa: E402

pytestmark = pytest.mark.rung4

ROOT = Path(__file__).resolve().parents[1]
# tests/test_examples_train.py's tiny run, without dropout; --batch-size 31 splits 16 / 15 over the ranks.
SETTINGS = dict(dataset="synthetic", synthetic_items=300, synthetic_users=64, max_len=10, k=3, dim=16, num_layers=1,
                num_heads=2, batch_size=31, eval_batch_size=32, lr=3e-3, dropout=0.0, num_threads=1)
RTOL = 1e-5


def flags(**settings) -> list[str]:
    out = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        out += [flag] if value is True else [f"{flag}={value}"]
    return out


def torchrun(out_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    """examples/train.py --fsdp on 2 CPU ranks (gloo); eager tiles, no torch.compile per rank."""
    env = dict(os.environ, TORCH_CUTBCE_NO_COMPILE="1", CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "examples/train.py", *flags(**SETTINGS), "--fsdp", f"--out-dir={out_dir}", *extra]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done


def close(a, b) -> bool:
    return np.allclose(a, b, rtol=RTOL, atol=0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:  # eager tiles for this process's run only
        patch.setenv("TORCH_CUTBCE_NO_COMPILE", "1")
        try:
            one = train.train(train.TrainConfig(**SETTINGS, epochs=2, out_dir=str(tmp / "one")))
        finally:
            torch.set_num_threads(threads)
    first = torchrun(tmp / "fsdp", "--epochs=1")
    second = torchrun(tmp / "fsdp", "--epochs=2", "--resume")
    return dict(tmp=tmp, one=one, first=first, second=second,
                fsdp=json.loads((tmp / "fsdp" / "metrics.json").read_text()))


def test_two_ranks_resumed_equal_one_process(runs):
    one, sharded = runs["one"], runs["fsdp"]
    assert "resumed from" in runs["second"].stdout and "2 ranks (FSDP2)" in runs["second"].stdout
    assert runs["second"].stdout.count("test  (sasrec") == 1  # rank 0 alone prints
    assert sharded["steps"] == one["steps"] and len(sharded["history"]) == len(one["history"]) == 2
    for h_one, h_fsdp in zip(one["history"], sharded["history"]):
        assert h_one.keys() == h_fsdp.keys()
        for name in h_one:
            assert close(h_fsdp[name], h_one[name]), (h_one["epoch"], name, h_fsdp[name], h_one[name])
    assert sharded["best_epoch"] == one["best_epoch"]
    assert sharded["test"].keys() == one["test"].keys()
    for name, value in one["test"].items():
        assert close(sharded["test"][name], value), (name, sharded["test"][name], value)
    for stats in ("item_row_norm", "item_bias"):
        for key, value in one["parameters"]["tested"][stats].items():
            assert close(sharded["parameters"]["tested"][stats][key], value), (stats, key)


def test_checkpoint_is_the_one_process_format(runs):
    """Rank 0 writes the one-process checkpoint: same names and shapes, the same parameters and Adam
    state; every step's train loss (the mean of the ranks' losses) is the one process's."""
    one = torch.load(runs["tmp"] / "one" / "ckpt.pt", weights_only=False)
    sharded = torch.load(runs["tmp"] / "fsdp" / "ckpt.pt", weights_only=False)
    assert sharded["world"] == 2 and len(sharded["rank_rng"]) == 2
    assert list(sharded["model"]) == list(one["model"])
    for name, param in one["model"].items():
        assert sharded["model"][name].shape == param.shape, name
        got = sharded["model"][name]
        if name.endswith("qkv.bias"):
            # Not the key bias: softmax ignores it, its gradient is rounding noise, which Adam turns
            # into steps of about lr whose signs differ between the runs.
            got, param = got.view(3, -1)[[0, 2]], param.view(3, -1)[[0, 2]]
        torch.testing.assert_close(got, param, rtol=1e-4, atol=1e-5 * float(param.abs().max()), msg=name)
    assert sharded["optimizer"]["param_groups"] == one["optimizer"]["param_groups"]
    assert sharded["optimizer"]["state"].keys() == one["optimizer"]["state"].keys()
    for index, state in one["optimizer"]["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(sharded["optimizer"]["state"][index][key], value, rtol=1e-4,
                                       atol=1e-5 * float(value.abs().max()), msg=f"{index} {key}")
    np.testing.assert_allclose(sharded["state"]["losses"], one["state"]["losses"], rtol=RTOL, atol=0)
    assert not list((runs["tmp"] / "fsdp").glob("*.tmp"))


def test_best_model_loads_into_a_plain_model(runs):
    """best.pt of the 2-rank run is a plain SASRec's state dict."""
    best = torch.load(runs["tmp"] / "fsdp" / "best.pt", weights_only=False)
    model, _, _ = train.build_model(train.TrainConfig(**SETTINGS, out_dir=str(runs["tmp"] / "x")), 300,
                                    torch.device("cpu"), None)
    model.load_state_dict(best["model"])  # strict: same names and shapes


def test_resume_refuses_another_number_of_processes(runs):
    with pytest.raises(train.ResumeError, match="written by 2 process"):
        train.train(train.TrainConfig(**SETTINGS, epochs=3, resume=True, out_dir=str(runs["tmp"] / "fsdp")))


@pytest.mark.parametrize("argv, message, env", [
    (["--fsdp"], "--fsdp runs under torchrun", {}),
    (["--fsdp", "--device", "xla"], "does not combine with --device xla or --mesh", {}),
    (["--fsdp", "--loss", "dense"], "--loss cutbce and focal", {}),
    (["--fsdp", "--batch-size", "3"], "--batch-size 3", dict(RANK="0", WORLD_SIZE="4", MASTER_ADDR="localhost",
                                                             MASTER_PORT="29500")),
])
def test_bad_fsdp_flags_exit_with_a_usage_error(capsys, monkeypatch, argv, message, env):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "usage: examples/train.py" in err and message in err, err
