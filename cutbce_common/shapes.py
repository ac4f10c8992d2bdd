"""Argument checks shared by `jax_kernels` and `torch_cutbce` (plain Python: imports neither).

Both frameworks describe their arrays to `check_arguments` as (shape, dtype name) pairs, so the
same error messages come out of every entry point. Dtype names are spelled alike in numpy, JAX and
torch (`str(torch.float32)` without "torch."). Shapes are static under `jax.jit` and under
torch_xla's lazy tensors, so none of these checks syncs with a device. The tile choices live here
too: `tile_width` (the vocabulary tile every engine uses) and `BlockSizes` (the Pallas tiles).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

REDUCTIONS = ("none", "sum", "mean")
# The one list of accepted dtypes. Complex and float8 are not floating for us (no softplus /
# matmul support worth having); torch's uint16/32/64 lack sort, max and indexing on most devices.
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
ID_DTYPES = ("int8", "int16", "int32", "int64", "uint8")


@dataclass(frozen=True)
class ArraySpec:
    """What the checks need to know of one argument: its shape and dtype name ('float32', 'int64', ...)."""

    shape: tuple[int, ...]
    dtype_name: str


@dataclass(frozen=True)
class ProblemSize:
    lead_shape: tuple[int, ...]
    num_positions: int  # N (may be 0)
    num_items: int  # V (>= 1)
    hidden_size: int  # D (may be 0)
    num_slots: int  # L
    block_v: int | None = None  # the caller's block_v as a Python int (numpy integers converted)


def check_reduction(reduction) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def check_block_v(block_v) -> int | None:
    """None, or a positive integer (numpy integers too) returned as a Python int; bool is refused."""
    if block_v is None:
        return None
    if isinstance(block_v, bool) or not isinstance(block_v, numbers.Integral):
        raise TypeError(f"block_v must be a positive int or None, got {block_v!r} of type {type(block_v).__name__}")
    if block_v < 1:
        raise ValueError(f"block_v must be a positive int or None, got {block_v!r}")
    return int(block_v)


def check_largest_id(largest: int, num_items: int) -> None:
    """The ids >= V rule for both frameworks, given the largest id (callers read it where no sync is needed)."""
    if largest >= num_items:
        raise ValueError(f"targets holds item id {largest}, but item_weight has only V={num_items} items (ids must be < V)")


AxisName = str | tuple[str, ...] | None


def mesh_axis_names(axis: AxisName) -> tuple[str, ...]:
    """A `vocab_axis` / `data_axis` (a name, a tuple of names, or None) as a tuple of names."""
    if axis is None:
        return ()
    return (axis,) if isinstance(axis, str) else tuple(axis)


def check_mesh_axes(mesh_axes, vocab_axis: AxisName, data_axis: AxisName) -> None:
    """`vocab_axis` and `data_axis` name axes of a mesh with axes `mesh_axes` (JAX's or torch_xla's), none shared."""
    for label, axis in (("vocab_axis", vocab_axis), ("data_axis", data_axis)):
        for name in mesh_axis_names(axis):
            if name not in mesh_axes:
                raise ValueError(
                    f"{label}={axis!r} is not an axis of the mesh (axes {tuple(mesh_axes)}); "
                    f"pass {label}=None if nothing is sharded that way"
                )
    shared = set(mesh_axis_names(vocab_axis)) & set(mesh_axis_names(data_axis))
    if shared:
        # The backward psums d_hidden over the vocab axis and d_item_weight over the data axis; one
        # axis cannot be both (a position block and an item slice would be split the same way).
        raise ValueError(f"vocab_axis={vocab_axis!r} and data_axis={data_axis!r} share mesh axes {sorted(shared)}")


def _check_float(name: str, spec: ArraySpec) -> None:
    if spec.dtype_name not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a floating-point array of dtype {' / '.join(FLOAT_DTYPES)}, got dtype {spec.dtype_name}"
        )


def check_id_dtype(targets: ArraySpec) -> None:
    if targets.dtype_name in ID_DTYPES:
        return
    if targets.dtype_name in ("uint16", "uint32", "uint64"):
        raise TypeError(
            f"targets must be signed integer ids ({' / '.join(ID_DTYPES[:-1])}) or uint8, got dtype "
            f"{targets.dtype_name} (poorly supported by torch's sort/max/indexing); cast to int64 "
            f"(torch: targets.long(); numpy / JAX: targets.astype('int64'))"
        )
    raise TypeError(
        f"targets must be integer item ids [*S, L] padded with negative ids, of dtype "
        f"{' / '.join(ID_DTYPES)}, got dtype {targets.dtype_name}; a dense multi-hot [*S, V] target "
        f"converts with multi_hot_to_ids"
    )


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
    block_v=None,
) -> ProblemSize:
    """Validates every argument of `cut_bce` / `cut_bce_with_logits` and returns the sizes.

    N = 0 positions and D = 0 are valid (the loss of no positions, logits equal to the bias).
    Every float argument may have any dtype of FLOAT_DTYPES: the entries promote hidden and
    item_weight to a common dtype (the framework's type promotion; under torch.autocast, the
    autocast dtype, as a linear layer would), and cast the others to the compute dtype (float32, or
    float64 for float64 inputs).

    Raises:
      TypeError: a float argument's dtype is not in FLOAT_DTYPES, `targets`' dtype is not in
        ID_DTYPES, or block_v is not an integer (bool included).
      ValueError: a rank or shape does not fit, V = 0, an unknown reduction, or block_v < 1.
    """
    check_reduction(reduction)
    block_v = check_block_v(block_v)
    _check_float("hidden", hidden)
    _check_float("item_weight", item_weight)
    check_id_dtype(targets)
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
        _check_float(name, spec)
        if tuple(spec.shape) != want:
            expected = "[V]" if name != "weight" else "[*S] (one weight per position)"
            raise ValueError(f"{name} must have shape {expected} = {want}, got shape {spec.shape}")
    return ProblemSize(
        lead_shape=lead_shape,
        num_positions=math.prod(lead_shape),
        num_items=num_items,
        hidden_size=hidden_size,
        num_slots=targets.shape[-1],
        block_v=block_v,
    )


def reduction_divisor(reduction: str, num_positions: int, num_items: int) -> float:
    """What the summed, weighted rows are divided by: N V for 'mean' (as BCEWithLogitsLoss), else 1.

    A Python float: N * V overflows int32 under jit (8192 x 876,939 > 2**31) without x64. For N = 0
    it is 0.0: divide tensors by it (0 / 0 = nan, the mean of an empty tensor in torch), never a
    Python float (ZeroDivisionError). The entry points route N = 0 to their rows path, whose
    gradients (of no rows) are zeros, as torch's on an empty `[0, V]` tensor.
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


# The most terms one float32 product of a tile's `d_hidden = dz @ items` may sum (every engine that
# contracts a whole tile). A tile is as wide as the memory budget allows (millions of items at small
# N), and a CPU dot may sum each output in a few lanes, in order: 2**22 equal terms drifted by 1.3e-3
# on an AVX-512 Xeon (XLA:CPU), 2.9e-6 in chunks of 2048. Tiles of N >= 2048 rows (the default
# budget) are at most this wide: one product, as before. Sums across chunks and tiles are carried
# compensated or in float64.
MAX_CONTRACTION = 2048


def tile_width(block_v: int | None, num_positions: int, num_items: int) -> int:
    """The vocabulary tile every engine uses: the user's `block_v`, else `default_block_v`; at most V."""
    return min(block_v or default_block_v(num_positions, num_items), num_items)


MIB = 1024 * 1024
LANES = 128  # TPU vector register: 8 sublanes x 128 lanes of 32-bit words.


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class BlockSizes:
    """Tile shape and VMEM limit of the Pallas kernels (frozen and hashable: a static argument).

    Here, not beside the kernels (`jax_kernels.pallas.block_sizes` re-exports it), because it is an
    option of a call (`CutBCEOptions.block_sizes`) and the options import no framework.

    Attributes:
        block_n: positions per tile; a multiple of 128 (the backward transposes `[block_n, block_v]`
            tiles and contracts over block_n on the MXU).
        block_v: items per tile; a multiple of 128 (lanes). Prefer a multiple of the MXU width.
        vmem_limit_bytes: scoped VMEM limit passed to Mosaic; None keeps the compiler's default
            (16 MiB on v4/v5e, 32 MiB on v6e), which large tiles exceed.
    """

    block_n: int
    block_v: int
    vmem_limit_bytes: int | None = None

    def __post_init__(self):
        sizes = {"block_n": self.block_n, "block_v": self.block_v, "vmem_limit_bytes": self.vmem_limit_bytes}
        for name, value in sizes.items():
            if value is None and name == "vmem_limit_bytes":  # the compiler's default
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"BlockSizes.{name} must be an int, got {value!r}")
            # numpy integers become ints: equal sizes hash alike, and `CutBCEOptions.encode` writes them.
            object.__setattr__(self, name, int(value))
        block_n, block_v, vmem_limit_bytes = self.block_n, self.block_v, self.vmem_limit_bytes
        if block_n <= 0 or block_n % LANES:
            raise ValueError(f"BlockSizes: {block_n=} must be a positive multiple of {LANES}")
        if block_v <= 0 or block_v % LANES:
            raise ValueError(f"BlockSizes: {block_v=} must be a positive multiple of {LANES}")
        if vmem_limit_bytes is not None and not (MIB <= vmem_limit_bytes <= 256 * MIB):
            raise ValueError(f"BlockSizes: {vmem_limit_bytes=} must lie in [1 MiB, 256 MiB]")

    def clipped(self, n: int, v: int) -> BlockSizes:
        """The same config with tiles no larger than the (128-aligned) problem, so that a small N or
        V does not pay for a mostly empty tile."""
        return replace(
            self,
            block_n=min(self.block_n, _round_up(max(n, 1), LANES)),
            block_v=min(self.block_v, _round_up(max(v, 1), LANES)),
        )


def accumulation_dtype_name(dtype_name: str) -> str:
    """Where every engine sums: float64 stays float64; float32, bfloat16 and float16 accumulate in float32."""
    return "float64" if dtype_name == "float64" else "float32"


# The Pallas kernels' dtypes (TPU has no float64; float16 should be cast to bfloat16).
KERNEL_DTYPES = ("float32", "bfloat16")
IMPL_CHOICES = ("auto", "blocked", "pallas")


def choose_impl(impl: str, dtype_name: str, on_tpu: bool) -> str:
    """The engine for `impl`: 'auto' is the Pallas kernels on a TPU for float32 / bfloat16 inputs,
    the blocked loop everywhere else. Both entries (and the torch_xla bridge) decide here.

    Raises:
      ValueError: an unknown impl. TypeError: impl='pallas' for a dtype the kernels do not take.
    """
    if impl not in IMPL_CHOICES:
        raise ValueError(f"impl must be one of {IMPL_CHOICES}, got {impl!r}")
    kernel_dtype = dtype_name in KERNEL_DTYPES
    if impl == "pallas" and not kernel_dtype:
        raise TypeError(f"impl='pallas' supports float32 and bfloat16 inputs, got {dtype_name}; use impl='blocked'")
    if impl != "auto":
        return impl
    return "pallas" if kernel_dtype and on_tpu else "blocked"
