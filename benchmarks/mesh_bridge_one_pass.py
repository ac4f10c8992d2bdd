"""The torch_xla bridge under an SPMD mesh, 'mean' forward + backward: two passes (before) vs one.

    .venv/bin/python benchmarks/mesh_bridge_one_pass.py      # XLA:CPU, 2 devices, 1 x 2 mesh, N 1024, V 8192, D 64

Simulated CPU devices (CPU_NUM_DEVICES), the table split along V on 'model' and the positions
along 'data'; interleaved rounds, medians of one step. Two passes is the route 'mean' took before
(`jax_bridge/xla.py`'s `cut_bce_rows`, then the rows' reduction), one pass `cut_bce_with_logits(mesh=)` with
the gradients from the forward; both must give the same loss and gradients (benchmarks/results/cpu_speed.md, 'The bridge and the mesh').
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--num-items", type=int, default=8192)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--mesh", default="1x2", help="DATAxMODEL device counts, or 'none': one device, no SPMD")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    data, model = (1, 1) if args.mesh == "none" else (int(x) for x in args.mesh.split("x"))
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ["CPU_NUM_DEVICES"] = str(data * model)

    import numpy as np
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    if args.mesh != "none":
        xr.use_spmd()
    from ablation import interleave, report
    from cutbce_common.shapes import tile_width
    from cutbce_common.options import CutBCEOptions
    from torch_cutbce import cut_bce_with_logits
    from torch_cutbce.jax_bridge import xla as xla_bridge
    from torch_cutbce.arguments import mesh_layout
    from torch_cutbce.reduction import reduce_rows

    n, v, d = args.n, args.num_items, args.hidden_size
    g = torch.Generator().manual_seed(0)
    device = torch_xla.device()
    mesh = None if args.mesh == "none" else xs.Mesh(np.arange(data * model), (data, model), ("data", "model"))
    hidden = (torch.randn(n, d, generator=g)).to(device).requires_grad_(True)
    items = (torch.randn(v, d, generator=g) * 0.1).to(device).requires_grad_(True)
    targets = torch.randint(-1, v, (n, args.slots), generator=g).to(device)
    if mesh is not None:
        xs.mark_sharding(hidden, mesh, ("data", None))
        xs.mark_sharding(items, mesh, ("model", None))
    block_v = tile_width(None, n, v)  # what cut_bce_with_logits picks

    def two_passes():
        options = CutBCEOptions(block_v=block_v, **mesh_layout(mesh, "model", "data"))
        rows, counts = xla_bridge.cut_bce_rows(hidden, items, targets, None, None, None, options)
        return reduce_rows(rows, counts, None, "mean", (n,), v, False)

    def one_pass():
        return cut_bce_with_logits(hidden, items, targets, mesh=mesh)

    def step(loss_fn):
        hidden.grad = items.grad = None
        loss = loss_fn()
        loss.backward()
        torch_xla.sync()
        xm.wait_device_ops()
        return loss.detach().cpu(), hidden.grad.cpu(), items.grad.cpu()

    before, after = step(two_passes), step(one_pass)
    for a, b in zip(before, after):  # the same loss and gradients both ways
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max())), (a, b)
    where = "one XLA:CPU device, no mesh" if mesh is None else (
        f"torch_xla SPMD on {xr.global_runtime_device_count()} XLA:CPU devices, mesh {data} x {model} (data x model)")
    medians = interleave({"two passes (before)": lambda: step(two_passes),
                          "one pass (shipped)": lambda: step(one_pass)}, args.rounds)
    report(f"{where}; N {n}, V {v}, D {d}, L {args.slots}, block_v {block_v}, 'mean', fwd+bwd", medians)
    return 0


if __name__ == "__main__":
    sys.exit(main())
