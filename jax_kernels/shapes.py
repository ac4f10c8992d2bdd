"""Argument checks shared by `jax_kernels` and `torch_cutbce` (plain Python: imports neither).

Both frameworks describe their arrays to `check_arguments` as (shape, dtype kind) pairs, so the
same error messages come out of every entry point. Shapes are static under `jax.jit` and under
torch_xla's lazy tensors, so none of these checks syncs with a device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

REDUCTIONS = ("none", "sum", "mean")


@dataclass(frozen=True)
class ArraySpec:
    """What the checks need to know of one argument: its shape and dtype kind ('f', 'i', 'b', ...)."""

    shape: tuple[int, ...]
    kind: str
    dtype_name: str


@dataclass(frozen=True)
class ProblemSize:
    lead_shape: tuple[int, ...]
    num_positions: int  # N
    num_items: int  # V
    hidden_size: int  # D
    num_slots: int  # L


def check_arguments(
    hidden: ArraySpec,
    item_weight: ArraySpec,
    targets: ArraySpec,
    bias: ArraySpec | None = None,
    weight: ArraySpec | None = None,
    class_weight: ArraySpec | None = None,
    pos_weight: ArraySpec | None = None,
    *,
    reduction: str = "mean",
    block_v: int | None = None,
) -> ProblemSize:
    """Validates every argument of `cut_bce` / `cut_bce_with_logits` and returns the sizes.

    Raises:
      TypeError: a float argument is not floating point, or `targets` is not an integer array.
      ValueError: a rank or shape does not fit, V = 0, an unknown reduction, or a bad block_v.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if hidden.kind != "f":
        raise TypeError(f"hidden must be a floating-point tensor, got dtype {hidden.dtype_name}")
    if item_weight.kind != "f":
        raise TypeError(f"item_weight must be a floating-point tensor, got dtype {item_weight.dtype_name}")
    if hidden.dtype_name != item_weight.dtype_name:
        raise TypeError(
            f"hidden and item_weight must share a dtype, got {hidden.dtype_name} and {item_weight.dtype_name}"
        )
    if targets.kind not in ("i", "u"):
        raise TypeError(
            f"targets must be integer item ids [*S, L] padded with negative ids, got dtype "
            f"{targets.dtype_name}; a dense multi-hot [*S, V] target converts with multi_hot_to_ids"
        )
    if len(hidden.shape) < 1:
        raise ValueError(f"hidden must have shape [*S, D] with rank >= 1, got shape {hidden.shape}")
    if len(item_weight.shape) != 2:
        raise ValueError(f"item_weight must have shape [V, D], got shape {item_weight.shape}")
    num_items, hidden_size = item_weight.shape
    if num_items == 0:
        raise ValueError(f"item_weight must hold at least one item (V >= 1), got shape {item_weight.shape}")
    if hidden.shape[-1] != hidden_size:
        raise ValueError(
            f"hidden's last dimension D={hidden.shape[-1]} must equal item_weight's D={hidden_size} "
            f"(hidden shape {hidden.shape}, item_weight shape {item_weight.shape})"
        )
    lead_shape = tuple(hidden.shape[:-1])
    if len(targets.shape) != len(lead_shape) + 1 or tuple(targets.shape[:-1]) != lead_shape:
        raise ValueError(
            f"targets must have shape [*S, L] = {list(lead_shape) + ['L']} to match hidden {hidden.shape}, "
            f"got shape {targets.shape}"
        )
    for name, spec, want in (
        ("bias", bias, (num_items,)),
        ("class_weight", class_weight, (num_items,)),
        ("pos_weight", pos_weight, (num_items,)),
        ("weight", weight, lead_shape),
    ):
        if spec is None:
            continue
        if spec.kind != "f":
            raise TypeError(f"{name} must be floating point, got dtype {spec.dtype_name}")
        if tuple(spec.shape) != want:
            expected = "[V]" if name != "weight" else "[*S] (one weight per position)"
            raise ValueError(f"{name} must have shape {expected} = {want}, got shape {spec.shape}")
    if block_v is not None and (not isinstance(block_v, int) or block_v < 1):
        raise ValueError(f"block_v must be a positive int or None, got {block_v!r}")
    return ProblemSize(
        lead_shape=lead_shape,
        num_positions=math.prod(lead_shape),
        num_items=num_items,
        hidden_size=hidden_size,
        num_slots=targets.shape[-1],
    )


def reduction_divisor(reduction: str, num_positions: int, num_items: int) -> float:
    """What the summed, weighted rows are divided by: N V for 'mean' (as BCEWithLogitsLoss), else 1.

    A Python float: N * V overflows int32 under jit (8192 x 876,939 > 2**31) without x64.
    """
    return float(num_positions * num_items) if reduction == "mean" else 1.0


def default_block_v(num_positions: int, num_items: int, tile_bytes: int = 16 << 20) -> int:
    """Vocabulary tile width so that one float32 `[N, block_v]` tile takes about `tile_bytes`.

    16 MiB keeps a tile and its few temporaries inside a CPU's last-level cache region while the
    matmul stays large enough to run near peak. The result is a multiple of 128 (MXU and SIMD
    friendly), at least 128, and at most V.
    """
    columns = tile_bytes // (4 * max(num_positions, 1))
    columns = max(128, (columns // 128) * 128)
    return min(columns, num_items)
