"""benchmarks/tpu_hbm.py: its dense loss is the loss CutBCE computes, and one small cell of each
loss compiles for a TPU chip (libtpu's compile-only client, in subprocesses, as the script runs it).

The full table (benchmarks/results/tpu_hbm.md) takes minutes; this checks the script's pieces on
shapes that compile in seconds. The compile test is skipped without `.venv/libtpu-overlay`
(ci/setup.sh builds it).
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import tpu_compile, tpu_hbm  # a namespace package: the repository root is on pytest's pythonpath
from parity import assert_close

pytestmark = pytest.mark.rung2

OVERLAY = tpu_compile.OVERLAY




@pytest.mark.jax
def test_dense_bce_is_the_reference_loss_with_padding_and_duplicates():
    """The user's dense loss (scatter-built multi-hot, optax) equals `dense_cut_bce`, gradients too:
    in particular a padding id -1 marks no item (JAX would wrap it to the last one)."""
    import jax
    import jax.numpy as jnp

    from jax_kernels import dense_cut_bce

    rng = np.random.default_rng(0)
    n, v, d = 6, 11, 5
    hidden = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    items = jnp.asarray(rng.normal(size=(v, d)), jnp.float32)
    targets = jnp.asarray([[10, -1, 3], [3, 3, -1], [-1, -1, -1], [0, 10, 5], [-7, 2, 2], [1, 4, 9]], jnp.int32)
    got, got_grads = jax.value_and_grad(tpu_hbm.dense_bce, argnums=(0, 1))(hidden, items, targets)
    want, want_grads = jax.value_and_grad(lambda h, w: dense_cut_bce(h, w, targets), argnums=(0, 1))(hidden, items)
    # Two float32 computations of the same dense loss: the float32 tolerance of the parity table.
    assert_close({"loss": got, "d_hidden": got_grads[0], "d_item_weight": got_grads[1]},
                 {"loss": want, "d_hidden": want_grads[0], "d_item_weight": want_grads[1]},
                 dtype="float32", name="optax dense vs dense_cut_bce")


def test_oom_message_is_parsed_to_bytes():
    message = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
               "Used 45.78G of 15.75G hbm. Exceeded hbm capacity by 30.03G.")
    one_buffer = "RESOURCE_EXHAUSTED: Allocation (size=327680000000) would exceed memory (size=17179869184) :: #a"
    newer = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required "
             "for HLO temporaries (612.74G) exceeds available HBM (94.74G). HLO module: jit_step.")  # libtpu 0.0.50
    assert tpu_hbm.oom_needed_bytes(message) == round(45.78 * 2**30)
    assert tpu_hbm.oom_needed_bytes(one_buffer) == 327680000000
    assert tpu_hbm.oom_needed_bytes(newer) == round(612.74 * 2**30)
    assert tpu_hbm.oom_needed_bytes("some other error") is None


@pytest.mark.tpu_compile
@pytest.mark.skipif(not (OVERLAY / "libtpu").is_dir(), reason=f"{OVERLAY} is missing: run ci/setup.sh")
def test_one_small_cell_of_each_loss_compiles():
    """v5e, one chip: both losses compile, their HBM figures add up, and the dense one is larger;
    8 x v6e, the table split along V with a catalog that does not divide (padding rows)."""
    # V large enough for the dense [N, V] buffers to leave VMEM (128 MiB on v5e) for HBM.
    cells = [tpu_hbm.Cell("v5e", "v5e:2x2", "single", loss, "bfloat16", 256, 200_000, 64, 8) for loss in tpu_hbm.LOSSES]
    cells.append(tpu_hbm.Cell("v6e", "v6e:2x4", "vocab", "cutbce", "bfloat16", 256, 5001, 64, 8))
    rows = [tpu_hbm.run_cell(cell, timeout_s=120) for cell in cells]
    for row in rows:
        assert row["status"] == "ok", row
        assert row["peak_bytes"] == row["argument_bytes"] + row["output_bytes"] + row["temp_bytes"] - row["alias_bytes"]
    cut, dense, sharded = rows
    # The [N, V] float32 multi-hot alone is 205 MB; CutBCE holds about the table and its gradient (51 MB).
    assert dense["peak_bytes"] > 4 * cut["peak_bytes"], (cut, dense)
    assert sharded["table_rows"] == 5008
    # Per chip: an eighth of the (padded) table and of its gradient, every position.
    assert sharded["argument_bytes"] < cut["argument_bytes"], (cut, sharded)
