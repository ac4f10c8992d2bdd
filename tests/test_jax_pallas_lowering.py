"""Rung L2, TPU side: every kernel variant lowers to Mosaic for TPU, on this CPU-only host.

`jax.export` with `platforms=['tpu']` runs the Pallas TPU lowering (block-shape rules, the tpu
dialect of every op in the kernel bodies) without a TPU; nothing is executed, all inputs are
`jax.ShapeDtypeStruct`s. A block shape or an op that Mosaic's Pallas lowering rejects fails here.
(Mosaic's own backend compile, layouts and the real VMEM fit, happens only in libtpu on a TPU.)

The same functions jitted for CPU must lower to the interpreter, with no TPU custom call:
the mode is chosen by the platform lowered for, not by the host.
"""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("jax", reason="needs jax: pip install 'torch-cutbce[jax]'")  # every test here runs JAX

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import export  # noqa: E402

from jax_kernels.pallas.block_sizes import BlockSizes, default_block_sizes  # noqa: E402
from jax_kernels.pallas.launch import (  # noqa: E402
    pallas_backward,
    pallas_forward,
    pallas_value_and_grad,
)

pytestmark = pytest.mark.rung2

NS = (1000, 8192)
VS = (1000, 100000, 876939)
DS = (64, 96, 256)
DTYPES = (jnp.float32, jnp.bfloat16)
SLOTS = (0, 1, 8, 32, 3)  # L, target slots per row; 5 is prime to the other rotations
TPU_CALL = "tpu_custom_call"


def sds(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def exported_text(fn, *args):
    return export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()


def lower_all(n, v, d, dtype, block_sizes, *, bias, class_weight, pos_weight, num_slots,
               compute_counts):
    """Export forward, backward and the one-pass value_and_grad for TPU; return their module texts."""

    def forward(h, w, ids, b, c, p):
        return pallas_forward(h, w, ids, b, c, p, compute_counts=compute_counts,
                                         block_sizes=block_sizes)

    def backward(h, w, ids, b, c, p, g):
        return pallas_backward(h, w, ids, b, c, p, g, block_sizes=block_sizes)

    def one_pass(h, w, ids, b, c, p, g):
        return pallas_value_and_grad(h, w, ids, b, c, p, g, block_sizes=block_sizes,
                                                compute_counts=compute_counts)

    args = (sds((n, d), dtype), sds((v, d), dtype), sds((n, num_slots), jnp.int32),
            sds((v,)) if bias else None, sds((v,)) if class_weight else None,
            sds((v,)) if pos_weight else None)
    g = sds((n,))
    return exported_text(forward, *args), exported_text(backward, *args, g), exported_text(
        one_pass, *args, g)


def check_shape_matrix(chip, dtype):
    """Every (N, V, D) of the issue's matrix, forward (one kernel) and backward (two kernels).
    The optional inputs rotate with the loop index, so each variant meets every shape class."""
    for k, (n, v, d) in enumerate(itertools.product(NS, VS, DS)):
        num_slots = SLOTS[k % len(SLOTS)]
        options = dict(bias=k % 2 == 0, class_weight=k % 3 != 1, pos_weight=k % 4 != 3,
                       num_slots=num_slots, compute_counts=k % 4 < 2)
        block_sizes = default_block_sizes(n, v, d, dtype, chip=chip, num_targets=num_slots)
        fwd, bwd, one_pass = lower_all(n, v, d, dtype, block_sizes, **options)
        where = f"{chip} {jnp.dtype(dtype).name} N={n} V={v} D={d} {block_sizes} {options}"
        assert fwd.count(TPU_CALL) == 1, f"forward not lowered to Mosaic: {where}"
        assert bwd.count(TPU_CALL) == 2, f"backward not lowered to two Mosaic kernels: {where}"
        assert one_pass.count(TPU_CALL) == 2, f"value_and_grad not lowered to two kernels: {where}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: jnp.dtype(t).name)
@pytest.mark.parametrize("chip", ["v5e", "v6e", "v4"])
def test_shape_matrix_lowers_for_tpu(chip, dtype):
    check_shape_matrix(chip, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: jnp.dtype(t).name)
def test_every_variant_lowers(dtype):
    """Every combination of the optional inputs, counts and L = 0 / L > 0 on one odd shape."""
    flags = ("bias", "class_weight", "pos_weight", "compute_counts")
    for values in itertools.product((False, True), repeat=len(flags)):
        for num_slots in (0, 5):
            options = dict(zip(flags, values), num_slots=num_slots)
            texts = lower_all(300, 1000, 72, dtype, BlockSizes(block_n=128, block_v=256),
                               **options)
            assert [t.count(TPU_CALL) for t in texts] == [1, 2, 2], options


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: jnp.dtype(t).name)
def test_lowers_under_x64(dtype):
    """The session runs with x64 off, as users do; with x64 on, the kernels must still lower (their
    constants and indices are typed: Python floats and ints would become float64 / int64)."""
    from parity import enable_x64

    with enable_x64(True):
        texts = lower_all(300, 1000, 72, dtype, BlockSizes(block_n=128, block_v=256), bias=True,
                          class_weight=True, pos_weight=True, num_slots=5, compute_counts=True)
    assert [t.count(TPU_CALL) for t in texts] == [1, 2, 2]


@pytest.mark.parametrize("chip", ["v5p", "tpu7x", None])
def test_other_chips_and_portable_default_lower(chip):
    """v5p and TPU7x budgets (TPU7x also by its old name "v7"), and chip=None (no TPU here: the
    portable table row)."""
    for n, v, d, dtype in [(8192, 876939, 96, jnp.bfloat16), (1000, 100000, 256, jnp.float32)]:
        block_sizes = None if chip is None else default_block_sizes(n, v, d, dtype, chip=chip)
        if chip == "tpu7x":
            assert default_block_sizes(n, v, d, dtype, chip="v7") == block_sizes
        texts = lower_all(n, v, d, dtype, block_sizes, bias=True, class_weight=True,
                           pos_weight=True, num_slots=20, compute_counts=True)
        assert [t.count(TPU_CALL) for t in texts] == [1, 2, 2]


def test_user_block_sizes_and_tiny_shapes_lower():
    """Hand-picked tiles, including ones larger than the problem (clipped), a single row, a single
    item and more target slots than one 128-lane block holds."""
    cases = [
        (1, 1, 8, 1, jnp.float32, BlockSizes(block_n=1024, block_v=4096)),
        (5, 100, 64, 0, jnp.bfloat16, BlockSizes(block_n=128, block_v=128)),
        (1000, 1000, 96, 200, jnp.float32, BlockSizes(block_n=1024, block_v=1024)),
        (300, 70000, 33, 7, jnp.bfloat16, BlockSizes(block_n=256, block_v=8192,
                                                     vmem_limit_bytes=64 << 20)),
    ]
    for n, v, d, num_slots, dtype, block_sizes in cases:
        texts = lower_all(n, v, d, dtype, block_sizes, bias=False, class_weight=False,
                           pos_weight=False, num_slots=num_slots, compute_counts=False)
        assert [t.count(TPU_CALL) for t in texts] == [1, 2, 2]


def test_cpu_lowering_uses_the_interpreter():
    """Lowered for CPU, the same functions contain no Mosaic call: platform_dependent keeps only
    the interpret=True branch."""
    block_sizes = BlockSizes(block_n=128, block_v=256)

    def both(h, w, ids, b, c, p, g):
        rows, _, _ = pallas_forward(h, w, ids, b, c, p, compute_counts=True,
                                               block_sizes=block_sizes)
        return rows, pallas_backward(h, w, ids, b, c, p, g, block_sizes=block_sizes)

    args = (sds((300, 40)), sds((700, 40)), sds((300, 4), jnp.int32), sds((700,)), sds((700,)),
            sds((700,)), sds((300,)))
    cpu_text = jax.jit(both).lower(*args).as_text()
    assert TPU_CALL not in cpu_text
    assert exported_text(both, *args).count(TPU_CALL) == 3


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_scalar_loss_gradient_runs_two_kernels(reduction):
    """The gradient of `cut_bce(impl='pallas')` for 'mean'/'sum' runs the one-pass kernels (the
    d_hidden kernel sums the rows too, no forward kernel): two Mosaic calls. 'none' does not know
    its row gradient in the forward: forward, then both backward kernels."""
    import jax_kernels

    def loss(h, w, ids):
        return jax_kernels.cut_bce(h, w, ids, reduction=reduction, impl="pallas").sum()

    step = jax.value_and_grad(loss, argnums=(0, 1))  # the loss too, or 'none' drops its forward
    text = exported_text(step, sds((300, 72), jnp.bfloat16), sds((1000, 72), jnp.bfloat16),
                         sds((300, 5), jnp.int32))
    assert text.count(TPU_CALL) == (3 if reduction == "none" else 2)
