"""Checkpoints of the training example that survive a kill at any moment, and --resume.

A checkpoint holds everything the rest of a run depends on (model, optimizer, RNG states, where
the run stands: `TrainState`), so a run killed and resumed with --resume ends with the same
parameters as an uninterrupted one. `save_checkpoint` writes one (atomically), `start_or_resume`
reads it back after checking that this run can continue it; both take the `examples.train.Run`
being trained. `RunError` is the one-line error (exit 2) of a file or folder the run cannot use.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from examples import fsdp

if TYPE_CHECKING:
    from examples.train import Run


# Settings a resumed run must share with the checkpoint (the rest, e.g. --epochs, may change).
SAME_ON_RESUME = ("model", "dataset", "data_path", "synthetic_items", "synthetic_users", "loss", "seed", "holdout",
                  "k", "bert_labels", "max_len", "mask_prob", "dim", "num_layers", "num_heads", "dropout",
                  "item_bias", "batch_size", "lr", "weight_decay", "pos_weight", "mesh", "negatives",
                  "normalization", "optimizer", "adam_eps")


class RunError(ValueError):
    """A file or folder the run cannot use (the data, a checkpoint, --out-dir): one line, exit 2."""


class ResumeError(RunError):
    """--resume with a checkpoint that this run cannot continue exactly."""


@dataclass
class TrainState:
    """Where the run stands; saved in every checkpoint, so that a resumed run continues exactly."""

    epoch: int = 0
    step_in_epoch: int = 0
    step: int = 0
    losses: list = field(default_factory=list)  # every step's training loss
    val: list = field(default_factory=list)  # one dict of validation metrics per epoch
    best_epoch: int = -1
    best_ndcg: float = -1.0
    bad_epochs: int = 0  # epochs since the best one, for --patience
    done: bool = False  # --max-steps or --patience ended the run
    train_time_s: float = 0.0
    positions: int = 0

    def positions_per_s(self) -> float:
        return self.positions / max(self.train_time_s, 1e-9)


def atomic_save(obj, path: Path) -> None:
    """`torch.save` to a temporary file in the same folder, then rename.

    A kill at any moment leaves either the old file or the new one, never a torn one (the rename
    is atomic within a file system; fsync first, so the new file's bytes are on disk before it
    takes the old one's name).
    """
    tmp = temporary(path)
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def temporary(path: Path) -> Path:
    """The file `atomic_save` writes before renaming it to `path`."""
    return path.with_name(path.name + ".tmp")


def remove_stale_temporaries(out_dir: Path) -> None:
    """Deletes the temporary files of a run killed inside `atomic_save` (ckpt.pt.tmp, best.pt.tmp).

    Such a file is torn or whole but never renamed, so nothing reads it; the checkpoint beside it is
    the last whole one. Every run that writes to `out_dir` calls this before its first save.
    """
    for name in ("ckpt.pt", "best.pt"):
        temporary(out_dir / name).unlink(missing_ok=True)


def to_cpu(obj):
    """`obj` with every tensor in it (in dicts, lists, tuples) detached and moved to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {key: to_cpu(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(value) for value in obj)
    return obj


def rng_states(device: torch.device) -> dict:
    """The RNG states a resumed run must restore: torch's CPU generator, and the XLA or CUDA device's."""
    states = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    if device.type == "xla":
        import torch_xla.core.xla_model as xm

        states["xla"] = xm.get_rng_state(device)
    return states


def set_rng_states(states: dict, device: torch.device) -> None:
    """Restores what `rng_states` saved."""
    torch.set_rng_state(states["torch"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)
    if device.type == "xla":
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(states["xla"], device)


def model_state(run: Run) -> dict:
    """The model's state dict on the CPU (--fsdp: gathered, on rank 0; every rank must call it)."""
    return to_cpu(run.model.state_dict()) if run.ranks is None else fsdp.model_state(run.model, run.ranks)


def load_model_state(run: Run, state: dict) -> None:
    """Loads a state dict (--fsdp: rank 0's, into every rank's shards)."""
    if run.ranks is None:
        run.model.load_state_dict(state)
    else:
        fsdp.load_model_state(run.model, state, run.ranks)


def save_checkpoint(run: Run, state: TrainState) -> None:
    """ckpt.pt, written atomically by rank 0 (--fsdp: every rank joins the gathers; the format is one
    process's, plus `world`, the number of processes, and `rank_rng`, every rank's RNG states)."""
    rng = to_cpu(rng_states(run.device))
    ckpt = dict(config=dataclasses.asdict(run.cfg), model=model_state(run), rng=rng, state=dataclasses.asdict(state),
                data_order=run.data_order(state.epoch), world=run.world)
    if run.ranks is None:
        ckpt["optimizer"] = to_cpu(run.optimizer.state_dict())
    else:
        ckpt["optimizer"] = fsdp.optimizer_state(run.model, run.optimizer, run.ranks)
        ckpt["rank_rng"] = fsdp.gather(rng)
    if run.main:
        atomic_save(ckpt, run.out_dir / "ckpt.pt")


def read_checkpoint(run: Run) -> dict | None:
    """The checkpoint --resume continues from, checked; None when there is none.

    Raises:
        ResumeError: the checkpoint was made with other settings, other training data or another
            number of processes.
    """
    cfg, ckpt_path = run.cfg, run.out_dir / "ckpt.pt"
    if not ckpt_path.exists():
        print(f"--resume: no checkpoint in {run.out_dir}, starting fresh")
        return None
    try:
        ckpt = torch.load(ckpt_path, weights_only=False)
        ckpt["config"], ckpt["state"]  # noqa: B018 (a checkpoint of another kind fails here, named)
    except Exception as error:  # noqa: BLE001 (torch.load of a damaged file raises many kinds)
        raise ResumeError(f"--resume: {ckpt_path} is not a readable checkpoint ({type(error).__name__}: "
                          f"{str(error)[:200]}); delete it or use another --out-dir") from error
    changed = [n for n in SAME_ON_RESUME if ckpt["config"].get(n) != getattr(cfg, n)]  # absent: an older run
    if changed:
        raise ResumeError(f"--resume: {changed} differ from the checkpoint in {ckpt_path}; use another --out-dir")
    # Each rank has its own dropout stream (examples/fsdp.py): continuing exactly needs as many.
    if ckpt.get("world", 1) != run.world:
        raise ResumeError(f"--resume: the checkpoint in {ckpt_path} was written by {ckpt.get('world', 1)} "
                          f"process(es), this run has {run.world}; resume with as many (or use another --out-dir)")
    state = TrainState(**ckpt["state"])
    if state.step_in_epoch and not np.array_equal(run.data_order(state.epoch), ckpt["data_order"]):
        raise ResumeError(f"--resume: the training data differ from the checkpoint's ({len(run.windows)} windows "
                          f"now, {len(ckpt['data_order'])} then); the run cannot continue exactly")
    return ckpt


def start_or_resume(run: Run) -> TrainState:
    """A fresh state, or with --resume the checkpoint's (model, optimizer and RNGs restored too); either
    way a killed save's temporary files go first (`remove_stale_temporaries`).

    With --fsdp rank 0 reads and checks the checkpoint and the other ranks get what they need from it.

    Raises:
        ResumeError: see `read_checkpoint`.
    """
    if run.main:  # the process that writes the checkpoints
        remove_stale_temporaries(run.out_dir)
    if not run.cfg.resume:
        return TrainState()
    if run.ranks is None:
        ckpt = read_checkpoint(run)
        if ckpt is None:
            return TrainState()
        run.model.load_state_dict(ckpt["model"])
        run.optimizer.load_state_dict(ckpt["optimizer"])
        rng = ckpt["rng"]
    else:
        ckpt, error = None, None
        if run.main:
            try:
                ckpt = read_checkpoint(run)
            except ResumeError as e:
                error = str(e)
        found, error = fsdp.broadcast((ckpt is not None, error))  # every rank raises, or none
        if error:
            raise ResumeError(error)
        if not found:
            return TrainState()
        fsdp.load_model_state(run.model, ckpt["model"] if run.main else {}, run.ranks)
        fsdp.load_optimizer_state(run.model, run.optimizer, ckpt["optimizer"] if run.main else {}, run.ranks)
        ckpt = fsdp.broadcast(dict(state=ckpt["state"], rank_rng=ckpt["rank_rng"]) if run.main else None)
        rng = ckpt["rank_rng"][run.ranks.rank]
    set_rng_states(rng, run.device)
    state = TrainState(**ckpt["state"])
    if run.main:
        print(f"resumed from {run.out_dir / 'ckpt.pt'}: epoch {state.epoch}, step {state.step}")
    return state
