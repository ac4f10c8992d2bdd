"""Checkpoints of the training example that survive a kill at any moment.

A checkpoint holds everything the rest of a run depends on (model, optimizer, RNG states, where
the run stands), so a run killed and resumed with --resume ends with the same parameters as an
uninterrupted one.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def atomic_save(obj, path: Path) -> None:
    """`torch.save` to a temporary file in the same folder, then rename.

    A kill at any moment leaves either the old file or the new one, never a torn one (the rename
    is atomic within a file system; fsync first, so the new file's bytes are on disk before it
    takes the old one's name).
    """
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
