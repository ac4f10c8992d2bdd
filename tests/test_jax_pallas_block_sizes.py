"""Rung L2: the Pallas tile sizes (jax_kernels/pallas/block_sizes.py): `BlockSizes` (an option of
the framework-neutral `CutBCEOptions`, defined beside it in cutbce_common/shapes.py and re-exported
here) validates and hashes, and `default_block_sizes` fits every chip's VMEM budget with balanced,
aligned tiles.
"""

from __future__ import annotations

import pytest

pytest.importorskip("jax", reason="needs jax: pip install 'torch-cutbce[jax]'")  # every test here runs JAX

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import cutbce_common.shapes  # noqa: E402
from jax_kernels.pallas.block_sizes import (  # noqa: E402
    CHIPS,
    PORTABLE_CHIP,
    BlockSizes,
    default_block_sizes,
    vmem_estimate_bytes,
)

pytestmark = pytest.mark.rung2


def test_block_sizes_validate_and_hash():
    with pytest.raises(ValueError, match="block_v=100"):
        BlockSizes(block_n=128, block_v=100)
    with pytest.raises(ValueError, match="block_n=8"):
        BlockSizes(block_n=8, block_v=128)
    with pytest.raises(ValueError, match="vmem_limit_bytes"):
        BlockSizes(block_n=128, block_v=128, vmem_limit_bytes=10)
    with pytest.raises(TypeError, match="block_n"):
        BlockSizes(block_n=128.0, block_v=128)
    with pytest.raises(TypeError, match="vmem_limit_bytes"):
        BlockSizes(block_n=128, block_v=128, vmem_limit_bytes=2e6)
    assert BlockSizes is cutbce_common.shapes.BlockSizes  # the old import path still works
    a, b = BlockSizes(256, 512, 32 << 20), BlockSizes(np.int64(256), 512, np.int32(32 << 20))
    assert a == b and hash(a) == hash(b) and type(b.block_n) is int  # numpy sizes stored as ints
    assert a.clipped(n=10, v=300) == BlockSizes(128, 384, 32 << 20)
    with pytest.raises(ValueError, match="chip"):
        default_block_sizes(100, 100, 64, jnp.float32, chip="v9")


@pytest.mark.parametrize("chip", sorted(CHIPS))
def test_default_block_sizes_fit_the_chip(chip):
    spec = CHIPS[chip]
    for n, v, d, dtype, slots in [(8192, 876939, 256, jnp.float32, 1),
                                  (1000, 100000, 64, jnp.bfloat16, 32),
                                  (1100, 1000, 96, jnp.bfloat16, 0),
                                  (1, 50, 512, jnp.float32, 300)]:
        bs = default_block_sizes(n, v, d, dtype, chip=chip, num_targets=slots)
        assert bs.vmem_limit_bytes == spec.vmem_limit_bytes < spec.vmem_bytes
        assert (vmem_estimate_bytes(bs.block_n, bs.block_v, d, dtype, num_targets=slots)
                <= bs.vmem_limit_bytes)
        assert bs.block_n % 128 == 0 and bs.block_v % 128 == 0
        if bs.block_v >= spec.mxu_width:
            assert bs.block_v % spec.mxu_width == 0, bs
        # balanced and clipped: never more than one tile's alignment of padding
        assert bs.block_n < n + 128 and bs.block_v < v + max(spec.mxu_width, 128)
    # N = 1100: two balanced tiles of 640 rows, not 2 x 1024.
    if spec.vmem_bytes >= 64 << 20 and spec.cores_per_device == 1:
        assert default_block_sizes(1100, 10**6, 128, jnp.bfloat16, chip=chip).block_n == 640
    assert default_block_sizes(10, 10, 8, jnp.float32, chip=PORTABLE_CHIP).block_n == 128
    # Up to 128 target slots share one lane-padded ids block.
    assert vmem_estimate_bytes(512, 512, 64, jnp.float32, num_targets=1) == vmem_estimate_bytes(
        512, 512, 64, jnp.float32, num_targets=128)
