"""Rung L2: the Pallas launchers (jax_kernels/pallas/launch.py) refuse bad inputs with a clear
error, and the kernels run through torch_xla's call_jax (interpret mode on PJRT_DEVICE=CPU).
The kernels' numbers against the float64 oracle: test_jax_pallas.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("jax", reason="needs jax: pip install 'torch-cutbce[jax]'")  # every test here runs JAX

import jax.numpy as jnp  # noqa: E402

from jax_kernels.pallas.launch import (  # noqa: E402
    pallas_backward,
    pallas_forward,
    pallas_value_and_grad,
)

pytestmark = pytest.mark.rung2


def test_bad_inputs_raise():
    h64, w64 = np.zeros((4, 8)), np.zeros((16, 8))  # numpy float64: no jax x64 needed
    h32, w32 = h64.astype(np.float32), w64.astype(np.float32)
    ids = np.full((4, 2), -1, np.int32)
    with pytest.raises(TypeError, match="float64"):
        pallas_forward(h64, w64, ids, None, None, None, compute_counts=False)
    with pytest.raises(TypeError, match="float64"):
        pallas_backward(h64, w64, ids, None, None, None, np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="g must have shape"):
        pallas_value_and_grad(h32, w32, ids, None, None, None,
                                         np.zeros(3, np.float32), compute_counts=True)
    with pytest.raises(TypeError, match="float16"):
        pallas_forward(h64.astype(np.float16), w64.astype(np.float16), ids, None, None,
                                  None, compute_counts=False)
    with pytest.raises(TypeError, match="must match"):
        pallas_forward(h32, jnp.zeros((16, 8), jnp.bfloat16), ids, None, None, None,
                                  compute_counts=False)
    for name, position in (("bias", 3), ("pos_weight", 5)):
        args = [h32, w32, ids, None, None, None]
        args[position] = np.zeros(15, np.float32)
        with pytest.raises(ValueError, match=name):
            pallas_forward(*args, compute_counts=False)
    with pytest.raises(ValueError, match="ids"):
        pallas_forward(h32, w32, ids[:3], None, None, None, compute_counts=False)
    with pytest.raises(TypeError, match="ids"):
        pallas_forward(h32, w32, ids.astype(np.float32), None, None, None,
                                  compute_counts=False)


CALL_JAX_SCRIPT = textwrap.dedent(
    """
    import os, sys
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    sys.path.insert(0, "tests")  # parity (the one tolerance table); the cwd is the repository root
    import torch  # torch and torch_xla before jax
    import torch_xla
    import torch_xla.core.xla_builder as xb
    import numpy as np
    from parity import assert_close
    from jax_kernels.pallas.block_sizes import BlockSizes
    from jax_kernels.pallas.launch import (
        pallas_backward, pallas_forward)

    BS = BlockSizes(block_n=128, block_v=256)

    def forward(h, w, ids, b, c, p):  # module level: call_jax caches by id(fn)
        return pallas_forward(h, w, ids, b, c, p, compute_counts=True, block_sizes=BS)

    def backward(h, w, ids, b, c, p, g):
        return pallas_backward(h, w, ids, b, c, p, g, block_sizes=BS)

    rng = np.random.default_rng(0)
    n, v, d = 200, 600, 40
    h = (rng.normal(size=(n, d)) * 0.5).astype(np.float32)
    w = rng.normal(size=(v, d)).astype(np.float32)
    b = rng.normal(size=v).astype(np.float32)
    c = rng.uniform(0.5, 2, size=v).astype(np.float32)
    p = rng.uniform(0.5, 3, size=v).astype(np.float32)
    ids = np.stack([rng.permutation(v)[:2] for _ in range(n)]).astype(np.int32)
    ids[::3, 1] = -1
    g = rng.normal(size=n).astype(np.float32)
    dev = torch_xla.device()
    t = lambda x: torch.from_numpy(x).to(dev)
    rows, predicted, hits = xb.call_jax(forward, (t(h), t(w), t(ids), t(b), t(c), t(p)))
    grads = xb.call_jax(backward, (t(h), t(w), t(ids), t(b), t(c), t(p), t(g)))
    torch_xla.sync()
    z = h.astype(np.float64) @ w.T.astype(np.float64) + b
    y = np.zeros((n, v), bool)
    y[np.arange(n)[:, None].repeat(2, 1)[ids >= 0], ids[ids >= 0]] = True
    wgt = c * np.where(y, p, 1.0)
    zs = np.where(y, -z, z)
    s = 1 / (1 + np.exp(-zs))
    dz = g[:, None] * wgt * np.where(y, -s, s)
    pairs = [(rows, (np.logaddexp(0, zs) * wgt).sum(1)), (predicted, (z > 0).sum(1)),
             (hits, (y & (z > 0)).sum(1)), (grads[0], dz @ w), (grads[1], dz.T @ h),
             (grads[2], dz.sum(0))]
    for i, (got, want) in enumerate(pairs):
        assert_close(got.cpu().numpy(), want, dtype="float32", name=f"call_jax output {i}")
    print("CALL_JAX_OK")
    """
)


@pytest.mark.xla
def test_kernels_through_torch_xla_call_jax():
    """The same kernels lowered by torch_xla's call_jax on PJRT_DEVICE=CPU pick the interpreter
    (platform_dependent sees the CPU lowering platform). A subprocess, because torch_xla must be
    imported before jax and call_jax changes global JAX config."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-c", CALL_JAX_SCRIPT], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "CALL_JAX_OK" in proc.stdout, proc.stderr[-4000:]
