"""Block sizes and the VMEM budget of the Pallas TPU kernels.

`ChipSpec` / `CHIPS` (per-generation VMEM, MXU width, HBM bandwidth, peak matmul rate),
`detect_chip()`, `vmem_estimate_bytes()` (a conservative model of a kernel's VMEM for one tile
shape), `BlockSizes` (the user's override: frozen, hashable, validated; defined in
`cutbce_common.shapes`, re-exported here) and `default_block_sizes()` (the largest MXU-aligned tiles
that fit). The table's sources, the model's check against libtpu and the derived tiles: docs/jax.md,
'Block sizes and the VMEM budget'.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

# `BlockSizes` is an option of a call (`CutBCEOptions.block_sizes`), so it lives with the options,
# which import no framework; these names stay importable from here.
from cutbce_common.shapes import LANES, MIB, BlockSizes


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """What the block-size heuristic needs to know about one TPU generation (per JAX device).

    Attributes:
        name: short name, e.g. `'v5e'`; `'tpu7x'` as libtpu and the device kind ("TPU7x") name it.
        vmem_bytes: VMEM capacity of one TensorCore.
        mxu_width: side of the systolic matmul unit (128 or 256); tiles are multiples of it.
        hbm_bytes_per_s: HBM bandwidth available to the device.
        bf16_flops_per_s: peak bf16 matmul rate of the device (2 flops per multiply-add).
        cores_per_device: TensorCores behind one device (2 on megacore chips v4 and v5p; 1 on TPU7x,
            whose two TensorCores per chip are two devices).
    """

    name: str
    vmem_bytes: int
    mxu_width: int
    hbm_bytes_per_s: float
    bf16_flops_per_s: float
    cores_per_device: int = 1

    @property
    def f32_flops_per_s(self) -> float:
        """Peak f32 matmul rate at Precision.HIGHEST (6 bf16 passes; an estimate)."""
        return self.bf16_flops_per_s / 6

    @property
    def vmem_limit_bytes(self) -> int:
        """The scoped-VMEM limit the kernels request: 3/4 of capacity, the rest left to Mosaic."""
        return self.vmem_bytes * 3 // 4

    def ridge_flops_per_byte(self, dtype) -> float:
        """Arithmetic intensity at which a matmul stops being HBM-bound (roofline ridge point)."""
        peak = self.bf16_flops_per_s if _itemsize(dtype) == 2 else self.f32_flops_per_s
        return peak / self.hbm_bytes_per_s


CHIPS: dict[str, ChipSpec] = {
    "v4": ChipSpec("v4", 16 * MIB, 128, 1.23e12, 2.75e14, cores_per_device=2),
    "v5e": ChipSpec("v5e", 128 * MIB, 128, 8.2e11, 1.97e14),
    "v5p": ChipSpec("v5p", 64 * MIB, 128, 2.46e12, 4.59e14, cores_per_device=2),
    "v6e": ChipSpec("v6e", 128 * MIB, 256, 1.64e12, 9.2e14),
    # Per TensorCore, i.e. half a chip: 7.4 TB/s HBM and 2.31 PFLOP/s bf16 a chip.
    "tpu7x": ChipSpec("tpu7x", 64 * MIB, 256, 3.7e12, 1.155e15),
}
# Other names `default_block_sizes(chip=...)` accepts: "v7", this table's first name for TPU7x
# (libtpu's topologies and the device kind say "tpu7x" / "TPU7x"; libtpu refuses "v7").
CHIP_ALIASES = {"v7": "tpu7x"}

# Used when lowering for TPU on a host without one (jax.export in CI): tiles that are legal and fit
# on every generation above (the smallest VMEM, the widest MXU alignment).
PORTABLE_CHIP = ChipSpec("portable", 16 * MIB, 256, 8.2e11, 1.97e14)

# `jax.Device.device_kind` strings as reported by the TPU runtime (same list as jax's tpu_info.py).
_DEVICE_KINDS = {
    "TPU v4": "v4",
    "TPU v5 lite": "v5e",
    "TPU v5e": "v5e",
    "TPU v5": "v5p",
    "TPU v5p": "v5p",
    "TPU v6 lite": "v6e",
    "TPU v6e": "v6e",
    "TPU7x": "tpu7x",
    "TPU7": "tpu7x",
}


def _itemsize(dtype) -> int:
    return np.dtype(dtype).itemsize


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@functools.lru_cache(maxsize=1)
def detect_chip() -> ChipSpec | None:
    """The spec of the first JAX device if it is a known TPU, else None.

    Called at trace time, never at import. The torch_xla bridge should pass `chip=` to
    `default_block_sizes` instead: under torch_xla, JAX may not see the TPU that torch_xla holds.
    """
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return None
    if device.platform != "tpu":
        return None
    name = _DEVICE_KINDS.get(device.device_kind)
    return CHIPS.get(name) if name else None


def vmem_estimate_bytes(block_n: int, block_v: int, d: int, dtype, *, num_targets: int = 1) -> int:
    """Upper estimate of the VMEM one grid step of the worst of the kernels uses.

    Every block double-buffered (rows padded to 128 lanes, row vectors to 8 sublanes):
    - inputs: hidden `[block_n, d]`, item_weight `[block_v, d]` (input dtype); bias, class and pos
      weight `[1, block_v]` f32; the ids `[block_n, L]` int32 (any L <= 128 costs one 128-lane
      block); the lane-replicated upstream gradient `[block_n, 128]` f32.
    - outputs, the larger of: d_item_weight `[block_v, d]` (f32, or a bf16 block plus an f32
      scratch: the same bytes) with d_bias `[1, block_v]`; or d_hidden `[block_n, d]` f32 with the
      three `[block_n, 128]` f32 row and count partials the one-pass kernel writes beside it.
    - scratch: the rounding errors of d_hidden `[block_n, d]` and of the loss partials
      `[block_n, 128]`, f32 (the compensated sums across item tiles).
    - temporaries: five 4-byte `[block_n, block_v]` tiles (the logits scratch walked in 8-row
      strips, the logits before they are stored, dz read back, its transpose, one for Mosaic's
      copies), one input-dtype copy of the tile, the masked item_weight tile and the
      f32 matmul result before it is accumulated.
    The table counts as `[block_v, d]` with d lane-padded also when the kernels take it as
    `[d, V]`, so the estimate is an upper bound there. Checked against libtpu's compile-only
    client: docs/jax.md, 'Block sizes and the VMEM budget'.

    Args:
        block_n: rows (positions) per tile.
        block_v: columns (items) per tile.
        d: hidden size D.
        dtype: input dtype of hidden and item_weight.
        num_targets: target slots per row L (0: no ids block).

    Returns:
        Bytes of VMEM.
    """
    b = _itemsize(dtype)
    dp = _round_up(d, LANES)
    row_vec = 8 * block_v * 4
    ids_block = block_n * _round_up(num_targets, LANES) * 4
    blocks = block_n * dp * b + block_v * dp * b + 3 * row_vec + ids_block + block_n * LANES * 4
    inputs = 2 * blocks
    outputs = 2 * max(block_v * dp * 4 + row_vec, block_n * dp * 4 + 3 * block_n * LANES * 4)
    temps = 5 * block_n * block_v * 4 + block_n * block_v * b + block_v * dp * (b + 4)
    errors = block_n * (dp + LANES) * 4
    return inputs + outputs + temps + errors


def _balanced(total: int, cap: int, align: int) -> int:
    """The smallest aligned tile that covers `total` in as few tiles as a `cap` tile would.

    N = 1100 with cap 1024 gives 2 tiles of 640 (1280 rows) instead of 2 x 1024 (2048 rows).
    """
    tiles = -(-max(total, 1) // cap)
    return min(cap, _round_up(-(-max(total, 1) // tiles), align))


def default_block_sizes(
    n: int, v: int, d: int, dtype, chip: str | ChipSpec | None = None, *, num_targets: int = 1
) -> BlockSizes:
    """Derive tiles for an `[N, D] x [V, D]` background from the chip's VMEM and MXU.

    Start from block_n = 1024 and block_v = 4096 and halve the larger side (block_v first, never
    below block_n) until `vmem_estimate_bytes` fits `chip.vmem_limit_bytes`. block_n sets the
    arithmetic intensity of the forward and the d_hidden kernel (the item table is streamed once
    per token tile: 2 * block_n / itemsize flops per byte); block_v sets that of the d_item_weight
    kernel (hidden is streamed once per item tile). Tiles are multiples of the MXU width, then
    balanced over the problem (no mostly empty last tile) and clipped to it.

    Args:
        n: positions N.
        v: items V.
        d: hidden size D.
        dtype: input dtype (float32 or bfloat16).
        chip: a key of `CHIPS` or `CHIP_ALIASES`, a `ChipSpec`, or None to use `detect_chip()`,
            falling back to `PORTABLE_CHIP` when no TPU is visible (e.g. when exporting for TPU from
            a CPU host).
        num_targets: target slots per row L; the default 1 budgets one 128-lane ids block, which
            covers any L <= 128.

    Returns:
        A validated `BlockSizes`.
    """
    if isinstance(chip, str):
        if CHIP_ALIASES.get(chip, chip) not in CHIPS:
            raise ValueError(f"unknown TPU {chip=}; known: {sorted(CHIPS)} (or {sorted(CHIP_ALIASES)})")
        spec = CHIPS[CHIP_ALIASES.get(chip, chip)]
    else:
        spec = chip or detect_chip() or PORTABLE_CHIP
    align = max(spec.mxu_width, LANES)
    budget = spec.vmem_limit_bytes
    block_n, block_v = 1024, 4096
    while vmem_estimate_bytes(block_n, block_v, d, dtype, num_targets=num_targets) > budget:
        if block_v > max(block_n, align):
            block_v //= 2
        elif block_n > LANES:
            block_n //= 2
        elif block_v > LANES:
            block_v //= 2
        else:
            break  # d alone exceeds the budget; the smallest tiles are the best we can do.
    # Megacore chips split the "parallel" token axis over two cores: give each core a tile.
    if spec.cores_per_device > 1 and n > LANES:
        block_n = min(block_n, _round_up(-(-n // spec.cores_per_device), LANES))
    block_n = _balanced(n, block_n, LANES)
    block_v = _balanced(v, block_v, align if block_v >= align else LANES)
    return BlockSizes(block_n=block_n, block_v=block_v, vmem_limit_bytes=budget)


def tile_cost(
    block_n: int, block_v: int, d: int, dtype, *, num_targets: int = 1
) -> dict[str, float]:
    """Flops and HBM bytes of one grid step of each kernel (the numbers in docs/jax.md).

    Returns:
        A dict with `flops` (one logits matmul: 2 * block_n * block_v * d) and, for each kernel, the
        bytes streamed from HBM per step: `fwd_bytes` and `dh_bytes` (one item_weight tile with its
        bias, class and pos weight; hidden and ids stay resident across the item axis), `dw_bytes`
        (one hidden tile, its ids and gradient rows; item_weight stays resident across the token
        axis).
    """
    b = _itemsize(dtype)
    flops = 2.0 * block_n * block_v * d
    table_tile = block_v * (d * b + 12)  # item_weight rows plus bias, class and pos weight
    token_tile = block_n * (d * b + LANES * 4 + num_targets * 4)  # hidden, g, ids
    return {
        "flops": flops,
        "fwd_bytes": float(table_tile),
        "dh_bytes": float(table_tile),
        "dw_bytes": float(token_tile),
        "fwd_intensity": flops / table_tile,
        "dh_intensity": 2 * flops / table_tile,
        "dw_intensity": 2 * flops / token_tile,
        "vmem_bytes": float(vmem_estimate_bytes(block_n, block_v, d, dtype,
                                                num_targets=num_targets)),
    }
