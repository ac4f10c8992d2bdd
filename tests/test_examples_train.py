"""examples/: one training step of each model, CutBCE vs dense, the normalisations, resume
equivalence, bad configs, the command line, XLA. The sampled-BCE baseline: test_examples_sampled.py."""

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from examples_extra import require_examples

require_examples()

from examples import config, data, train  # noqa: E402

if importlib.util.find_spec("torch_xla") is not None:
    # Start torch_xla's runtime before any backward, as tests/conftest.py does: autograd sizes its
    # per-device queues at its first backward, and an XLA backward after a CPU one in a process
    # that had not started torch_xla then fails an internal assert.
    import torch_xla

    torch_xla.device()
from examples.bert4rec import BERT4Rec  # noqa: E402
from examples.sasrec import RecConfig, SASRec  # noqa: E402

pytestmark = pytest.mark.rung4

MODELS = {"sasrec": SASRec, "bert4rec": BERT4Rec}


def tiny_config(tmp_path, **overrides) -> train.TrainConfig:
    """A run of a few seconds: 64 synthetic users, 300 items, one small layer."""
    settings = dict(dataset="synthetic", synthetic_items=300, synthetic_users=64, max_len=10, k=3, dim=16,
                    num_layers=1, num_heads=2, batch_size=32, epochs=2, eval_batch_size=32, lr=3e-3,
                    out_dir=str(tmp_path / "run"))
    settings.update(overrides)
    return train.TrainConfig(**settings)


def one_batch(cfg, device="cpu"):
    """A model and one training batch of `cfg`, built as train() builds them."""
    ds = data.synthetic(cfg.synthetic_items, cfg.synthetic_users, seed=0)
    windows = data.train_windows(ds, cfg.holdout, cfg.max_len, cfg.labels)
    torch.manual_seed(cfg.seed)
    model = MODELS[cfg.model](RecConfig(ds.num_items, cfg.max_len, cfg.dim, cfg.num_layers, cfg.num_heads,
                                        dropout=cfg.dropout))
    batch = train.make_batch(windows[: cfg.batch_size - 5], cfg, model, step=0)  # a short batch gets padded
    return model.to(device), {name: t.to(device) for name, t in batch.items()}


def step_grads(cfg, device="cpu"):
    model, batch = one_batch(cfg, device)
    loss = train.loss_of_batch(model, batch, cfg)
    loss.backward()
    train.sync(torch.device(device))  # XLA: one graph for the step, not one per fetched tensor
    return loss.detach().cpu(), {n: p.grad.detach().cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("model", ["sasrec", "bert4rec"])
def test_batches_have_the_documented_targets(tmp_path, model):
    cfg = tiny_config(tmp_path, model=model, bert_labels=2)
    net, batch = one_batch(cfg)
    inputs, targets, weight = batch["inputs"], batch["targets"], batch["weight"]
    assert inputs.shape == (32, 10) and targets.shape == (32, 10, cfg.labels) and weight.shape == (32, 10)
    assert (weight[-5:] == 0).all() and (inputs[-5:] == 0).all()  # padding rows
    assert ((targets >= -1) & (targets < 300)).all()
    if model == "sasrec":  # position t's first positive is the next input item (catalog id = item id - 1)
        real = (inputs[:, 1:] != 0) & (weight[:, :-1] > 0)
        assert torch.equal(targets[:, :-1, 0][real], inputs[:, 1:][real] - 1)
    else:  # weight marks exactly the [MASK]ed positions
        assert torch.equal(weight > 0, inputs == net.mask_id) and weight.sum() > 0


@pytest.mark.parametrize("model, normalization", [("sasrec", "positions"), ("bert4rec", "items"), ("sasrec", "mean")])
def test_cutbce_step_matches_dense_bce(tmp_path, model, normalization):
    """The example's CutBCE loss and gradients equal the materialized BCEWithLogitsLoss A/B."""
    loss_cut, grads_cut = step_grads(tiny_config(tmp_path, model=model, loss="cutbce", block_v=64,
                                                 normalization=normalization))
    loss_dense, grads_dense = step_grads(tiny_config(tmp_path, model=model, loss="dense",
                                                     normalization=normalization))
    assert torch.isfinite(loss_cut) and loss_cut > 0
    torch.testing.assert_close(loss_cut, loss_dense, rtol=1e-5, atol=1e-7)
    for name in grads_dense:
        torch.testing.assert_close(grads_cut[name], grads_dense[name], rtol=1e-4, atol=1e-7, msg=name)
    assert grads_cut["item_emb.weight"][0].abs().max() == 0  # the padding row never learns


def test_focal_step_is_focal_and_gamma_zero_is_plain(tmp_path):
    """--loss focal: a different loss than plain CutBCE at gamma 2, the same at gamma 0."""
    plain, plain_grads = step_grads(tiny_config(tmp_path, loss="cutbce", block_v=64))
    focal, _ = step_grads(tiny_config(tmp_path, loss="focal", focal_gamma=2.0, block_v=64))
    assert torch.isfinite(focal) and 0 < focal < plain  # (1 - p_t)^gamma < 1 scales every term down
    zero, zero_grads = step_grads(tiny_config(tmp_path, loss="focal", focal_gamma=0.0, block_v=64))
    assert torch.equal(zero, plain)
    assert all(torch.equal(zero_grads[name], plain_grads[name]) for name in plain_grads)


def test_normalizations_scale_the_same_step(tmp_path):
    """positions = items x V, mean = items x (real positions) / (B T): the same sum, three divisors."""
    _, batch = one_batch(tiny_config(tmp_path))
    real, size = batch["weight"].sum(), batch["weight"].numel()
    assert 0 < real < size  # the batch has padding, so 'mean' differs from 'items'
    runs = {norm: step_grads(tiny_config(tmp_path, normalization=norm, block_v=64))
            for norm in ("items", "positions", "mean")}
    for norm, scale in (("positions", 300.0), ("mean", float(real) / size)):
        loss, grads = runs[norm]
        torch.testing.assert_close(loss, runs["items"][0] * scale, rtol=1e-5, atol=0)
        for name, grad in grads.items():  # float32 sums in another order: an atol of the gradient's scale
            expected = runs["items"][1][name] * scale
            torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()), msg=name)


def test_optimizer_flags(tmp_path):
    """--optimizer adamw defaults to torch's weight decay 0.01; --adam-eps reaches the optimizer."""
    assert tiny_config(tmp_path).weight_decay == 0.0
    assert tiny_config(tmp_path, optimizer="adamw").weight_decay == config.ADAMW_WEIGHT_DECAY == 0.01
    cfg = tiny_config(tmp_path, optimizer="adamw", weight_decay=0.1, adam_eps=1e-12)
    _, optimizer, _ = train.build_model(cfg, 300, torch.device("cpu"), None)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert (optimizer.defaults["weight_decay"], optimizer.defaults["eps"]) == (0.1, 1e-12)
    assert train.parse_args(["--optimizer", "adamw"]).weight_decay == 0.01


def final_state(out_dir):
    ckpt = torch.load(Path(out_dir) / "ckpt.pt", weights_only=False)
    return ckpt["model"], ckpt["state"]


class SimulatedKill(BaseException):
    """Raised from train()'s after_step hook; BaseException, so no `except Exception` swallows it."""


def kill_after(steps: int):
    """An after_step hook that ends the run abruptly after `steps` steps, like a kill -9."""
    def after_step(step):
        if step == steps:
            raise SimulatedKill(f"killed after step {step}")
    return after_step


@pytest.mark.parametrize("model, loss, kill_after_steps", [("sasrec", "cutbce", 5), ("bert4rec", "cutbce", 8),
                                                          ("sasrec", "sampled", 5), ("sasrec", "ce", 5)])
def test_resume_after_kill_equals_uninterrupted_run(tmp_path, model, loss, kill_after_steps):
    """Kill mid-epoch (work since the last checkpoint is lost), resume: bitwise the same run."""
    settings = dict(model=model, loss=loss, negatives=3, ckpt_every=3)
    straight = train.train(tiny_config(tmp_path / "a", **settings))
    with pytest.raises(SimulatedKill):
        train.train(tiny_config(tmp_path / "b", **settings), after_step=kill_after(kill_after_steps))
    resumed = train.train(tiny_config(tmp_path / "b", resume=True, **settings))
    params_a, state_a = final_state(tmp_path / "a" / "run")
    params_b, state_b = final_state(tmp_path / "b" / "run")
    assert state_a["step"] == state_b["step"] > kill_after_steps
    for name in params_a:
        assert torch.equal(params_a[name], params_b[name]), name
    assert state_a["losses"] == state_b["losses"]
    assert straight["test"] == resumed["test"] and straight["history"] == resumed["history"]


def test_a_kill_while_a_checkpoint_is_written_resumes_from_the_last_whole_one(tmp_path, monkeypatch):
    """Issue 31: the process dies halfway through writing its second ckpt.pt (a torn temporary
    file); the first checkpoint is intact, and resuming from it gives the uninterrupted run."""
    from examples import checkpoint

    settings = dict(ckpt_every=3)
    straight = train.train(tiny_config(tmp_path / "a", **settings))
    real_open, writes = open, []

    class TornFile:
        """Writes half of what it is given, then dies."""

        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(bytes(data)[: len(data) // 2])
            self.f.flush()
            raise SimulatedKill("killed while writing a checkpoint")

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def dying_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if str(path).endswith("ckpt.pt.tmp"):
            writes.append(path)
            if len(writes) == 2:
                return TornFile(f)
        return f

    monkeypatch.setattr(checkpoint, "open", dying_open, raising=False)
    with pytest.raises(SimulatedKill):
        train.train(tiny_config(tmp_path / "b", **settings))
    monkeypatch.undo()
    out = tmp_path / "b" / "run"
    assert (out / "ckpt.pt.tmp").exists() and (out / "ckpt.pt").exists()  # the torn file beside the whole one
    assert torch.load(out / "ckpt.pt", weights_only=False)["state"]["step"] == 3
    resumed = train.train(tiny_config(tmp_path / "b", resume=True, **settings))
    params_a, _ = final_state(tmp_path / "a" / "run")
    params_b, _ = final_state(out)
    assert all(torch.equal(params_a[name], params_b[name]) for name in params_a)
    assert straight["test"] == resumed["test"]


def _main_error(capsys, argv) -> str:
    """Runs the example's main(); it must end with exit status 2 and one line, no traceback."""
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


def test_file_errors_are_one_line_naming_the_file(tmp_path, capsys):
    """Issue 31: a corrupt checkpoint given to --resume, an --out-dir that is a file, a malformed or
    missing data file and a --holdout larger than the data ended in tracebacks."""
    quick = ["--dataset", "synthetic", "--synthetic-items", "300", "--synthetic-users", "64", "--max-len", "10",
             "--dim", "16", "--num-layers", "1", "--num-heads", "2", "--epochs", "1"]
    run = tmp_path / "run"
    run.mkdir()
    (run / "ckpt.pt").write_bytes(b"not a checkpoint")
    err = _main_error(capsys, quick + ["--out-dir", str(run), "--resume"])
    assert f"--resume: {run / 'ckpt.pt'} is not a readable checkpoint" in err, err
    (tmp_path / "a-file").write_text("")
    err = _main_error(capsys, quick + ["--out-dir", str(tmp_path / "a-file")])
    assert f"--out-dir {tmp_path / 'a-file'}: cannot create it" in err, err
    bad = tmp_path / "ml-100k.zip"
    bad.write_bytes(b"garbage")
    err = _main_error(capsys, ["--dataset", "ml-100k", "--data-path", str(bad), "--out-dir", str(run)])
    assert f"--data-path {bad}: cannot read the data" in err, err
    err = _main_error(capsys, quick + ["--holdout", "500", "--out-dir", str(run)])
    assert "--holdout 500: synthetic-300: no user has >= 1001 items" in err, err


def test_run_writes_metrics_and_curves(tmp_path):
    result = train.train(tiny_config(tmp_path, epochs=2, model="sasrec"))
    out = Path(tmp_path / "run")
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["test"] == result["test"] and len(saved["history"]) == 2
    assert {"HR@10", "NDCG@10", "Hit@3(next1)"} <= set(saved["test"]) and saved["peak_rss_mib"] > 0
    assert saved["best_epoch"] == int(np.argmax([h["NDCG@10"] for h in saved["history"]]))
    assert (out / "curves.png").stat().st_size > 0 and not list(out.glob("*.tmp"))
    assert saved["setup"] == dict(loss="cutbce", negatives=None, normalization="positions", optimizer="adam",
                                  adam_eps=1e-8, weight_decay=0.0)
    tested, final = saved["parameters"]["tested"], saved["parameters"]["final"]
    assert tested["item_bias"]["min"] <= tested["item_bias"]["mean"] <= tested["item_bias"]["max"]
    assert tested["item_bias"]["std"] > 0 and tested["item_row_norm"]["mean"] > 0
    assert {"item_bias", "item_table", "other"} == set(final["adam"])
    assert all(0 <= group["below_eps"] <= 1 and group["median_sqrt_v"] > 0 for group in final["adam"].values())
    with pytest.raises(ValueError, match="differ from the checkpoint"):
        train.train(tiny_config(tmp_path, epochs=2, dim=8, resume=True))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(dataset="movielens"), "unknown --dataset 'movielens'"),
        (dict(model="gru4rec"), "unknown --model"),
        (dict(loss="softmax"), "unknown --loss"),
        (dict(loss="sampled", model="bert4rec"), "--loss sampled trains SASRec only"),
        (dict(loss="sampled", negatives=0), "--negatives must be >= 1, got 0"),
        (dict(loss="sampled", device="xla", mesh="2x2"), "--loss sampled runs on one device"),
        (dict(normalization="batch"), "unknown --normalization 'batch'"),
        (dict(optimizer="sgd"), "unknown --optimizer 'sgd'"),
        (dict(adam_eps=0.0), "--adam-eps must be > 0"),
        (dict(optimizer="adamw", weight_decay=-0.1), "--weight-decay must be >= 0"),
        (dict(device="tpu"), "unknown --device"),
        (dict(k=0), "--k must be >= 1"),
        (dict(bert_labels=0), "--bert-labels must be >= 1"),
        (dict(max_len=0), "--max-len must be >= 1"),
        (dict(exclude_seen="maybe"), "--exclude-seen"),
        (dict(dim=30, num_heads=4), "--dim 30 must be divisible by --num-heads 4"),
        (dict(synthetic_items=-5), r"--synthetic-items must be >= 20 \(the top items the metrics rank"),
        (dict(num_layers=-1), "--num-layers must be >= 0"),
        (dict(dropout=1.0), r"--dropout must be in \[0, 1\), got 1.0"),
        (dict(lr=0.0), "--lr must be > 0"),
        (dict(dataset="yambda"), "--dataset yambda needs --data-path"),
        (dict(data_path="/no/such/file.inter"), "--data-path '/no/such/file.inter' does not exist"),
    ],
)
def test_bad_configs_raise_clear_errors(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        train.train(tiny_config(tmp_path, **overrides))


def test_command_line_parsing():
    cfg = train.parse_args(["--model", "bert4rec", "--k", "4", "--resume", "--pos-weight", "2.5"])
    assert (cfg.model, cfg.k, cfg.resume, cfg.pos_weight, cfg.dataset) == ("bert4rec", 4, True, 2.5, "ml-100k")
    assert train.parse_args([]) == train.TrainConfig()  # the flags' defaults are the config's


def test_every_flag_has_help_and_its_default():
    parser = config.build_parser()
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert {a.dest for a in flags} == {f.name for f in dataclasses.fields(train.TrainConfig)}
    text = " ".join(parser.format_help().split())  # undo the line wrapping
    for action in flags:
        assert action.help, action.dest
        if action.default not in ("", None):  # an empty default is explained in the help instead
            assert f"(default: {action.default})" in text, action.dest
    for closed in ("--model {sasrec,bert4rec}", "--loss {cutbce,focal,dense,sampled,ce}", "--device {cpu,xla}",
                   "--normalization {items,positions,mean}", "--optimizer {adam,adamw}",
                   "--dataset {ml-100k,yambda,synthetic}", "--exclude-seen {auto,yes,no}"):
        assert closed in text
    assert "--kill" not in text  # test hooks are not user options


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "foo"], "argument --model: invalid choice: 'foo'"),
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["--batch-size", "-3"], "--batch-size must be >= 1, got -3"),
        (["--dim", "many"], "argument --dim: invalid int value: 'many'"),
        (["--mask-prob", "1.5"], r"--mask-prob must be in \(0, 1\], got 1.5"),
        (["--mesh", "2x2"], "--mesh takes DATAxMODEL device counts"),
        (["--loss", "sampled", "--model", "bert4rec"], "--loss sampled trains SASRec only"),
        (["--normalization", "all"], "argument --normalization: invalid choice: 'all'"),
        # Issue 31: non-finite values passed the checks (training to NaN, or never moving), a focal
        # gamma out of range, a mesh of 0 devices and a one-item catalog ended in tracebacks.
        (["--lr", "inf"], "--lr must be a finite number, got inf"),
        (["--pos-weight", "inf"], "--pos-weight must be a finite number, got inf"),
        (["--adam-eps", "inf"], "--adam-eps must be a finite number, got inf"),
        (["--lr", "nan"], "--lr must be a finite number, got nan"),
        (["--loss", "focal", "--focal-gamma", "inf"], "--focal-gamma must be a finite number, got inf"),
        (["--loss", "focal", "--focal-gamma", "1e39"], "--focal-gamma / --focal-alpha: focal gamma must be at most 32"),
        (["--device", "xla", "--mesh", "0x2"], "--mesh takes DATAxMODEL device counts"),
        (["--synthetic-items", "1"], r"--synthetic-items must be >= 20 \(.*\), got 1"),
    ],
)
def test_bad_flags_exit_with_a_usage_error(capsys, argv, message):
    """The script's own command line: a usage line and the message on stderr, exit status 2, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "usage: examples/train.py" in err and "Traceback" not in err
    assert re.search(message, err), err


@pytest.fixture
def xla_device(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", os.environ.get("PJRT_DEVICE", "CPU"))
    torch_xla = pytest.importorskip("torch_xla")
    return torch_xla.device()


@pytest.mark.xla
@pytest.mark.parametrize("model", ["sasrec", "bert4rec"])
def test_xla_step_matches_cpu(tmp_path, xla_device, model):
    cfg = tiny_config(tmp_path, model=model, dropout=0.0)
    loss_cpu, grads_cpu = step_grads(cfg)
    loss_xla, grads_xla = step_grads(cfg, xla_device)
    torch.testing.assert_close(loss_xla, loss_cpu, rtol=1e-4, atol=1e-6)
    for name in grads_cpu:
        torch.testing.assert_close(grads_xla[name], grads_cpu[name], rtol=1e-3, atol=1e-6, msg=name)


@pytest.mark.xla
def test_xla_training_run(tmp_path, xla_device):
    """The train script end to end on an XLA device: steps, sync, checkpoint, full-catalog evaluation."""
    result = train.train(tiny_config(tmp_path, device="xla", epochs=1, max_steps=3, ckpt_every=2))
    assert result["steps"] == 3 and np.isfinite(result["history"][0]["train_loss"])
    assert 0 <= result["test"]["HR@10"] <= 1


@pytest.mark.xla
def test_sharded_training_on_a_simulated_mesh(tmp_path):
    """--mesh 2x2: torch_xla SPMD on 4 CPU devices, the table split along V; same losses as on CPU."""
    settings = dict(dropout=0.0, epochs=1, max_steps=3)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in dataclasses.asdict(tiny_config(tmp_path, **settings)).items()
             if isinstance(v, (int, float, str)) and not isinstance(v, bool) and v != "" and k != "out_dir"]
    out = tmp_path / "mesh"
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", TORCH_CUTBCE_NO_COMPILE="1")
    subprocess.run([sys.executable, "examples/train.py", *flags, "--device=xla", "--mesh=2x2", f"--out-dir={out}"],
                   env=env, cwd=Path(__file__).resolve().parents[1], check=True, capture_output=True)
    sharded = json.loads((out / "metrics.json").read_text())
    on_cpu = train.train(tiny_config(tmp_path, **settings))
    assert sharded["steps"] == 3
    np.testing.assert_allclose(sharded["history"][0]["train_loss"], on_cpu["history"][0]["train_loss"], rtol=1e-4)
