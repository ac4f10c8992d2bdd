"""Where the training example runs: the CPU, or an XLA device through torch_xla (optionally SPMD).

torch_xla is imported only here and only when asked for, so the CPU run needs no XLA install.
"""

from __future__ import annotations

import numpy as np
import torch


def get_device(name: str) -> torch.device:
    """'cpu' or 'xla' -> the device.

    Raises:
        RuntimeError: 'xla' without torch_xla installed.
    """
    if name == "cpu":
        return torch.device("cpu")
    try:
        import torch_xla
    except ImportError as e:
        raise RuntimeError("--device xla needs torch_xla: pip install -e '.[xla]'") from e
    return torch_xla.device()


def make_mesh(spec: str):
    """'DxM' -> a torch_xla SPMD mesh of D data-parallel x M vocabulary-parallel devices ('' -> None).

    Device ids go 0..n-1 in order, as `cut_bce_with_logits(..., mesh=)` requires. Call it before
    any XLA tensor exists: SPMD must be on first. On a CPU host, simulate devices with
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4.
    """
    if not spec:
        return None
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    data_n, model_n = (int(x) for x in spec.split("x"))
    return xs.Mesh(np.arange(data_n * model_n), (data_n, model_n), ("data", "model"))


def shard(tensor: torch.Tensor, mesh, spec: tuple) -> None:
    """Lays `tensor` out over `mesh` by `spec` (one mesh axis name or None per dimension)."""
    import torch_xla.distributed.spmd as xs

    xs.mark_sharding(tensor, mesh, spec)


def sync(device: torch.device) -> None:
    """Cuts and runs the lazy XLA graph of one step (a no-op on CPU)."""
    if device.type == "xla":
        import torch_xla

        torch_xla.sync()
