"""`CutBCEOptions`: every non-tensor choice of one call, as one value (framework-neutral: plain Python).

The one config type of both frameworks. The torch custom ops take their tensors plus this value
encoded as one `str` (what `torch.library` and torch_xla's `call_jax` accept as a static argument),
as CCE passes one params dataclass: adding an option touches this type, the math, the oracles and
the tests, never an op's schema. Inside an op `decode` rebuilds the value. The JAX engines run on
the same value, `resolved` for the rows and items a device sees (`jax_kernels.core.OneDevice` or
`jax_kernels.sharded.ShardedLayout` holds it; the torch_xla bridge resolves the decoded options).

Only static choices belong in what the torch side encodes, nothing derived from a shape: under
`torch.compile` with dynamic shapes N is symbolic, and a string cannot hold it without a recompile
per N. So `block_v` is the caller's (None: each engine sizes the tile for the rows it sees,
`shapes.tile_width`, which `resolved` calls inside JAX's trace), and the one-pass divisor N x V
travels as a float beside the options.

`encode` is canonical JSON (sorted keys, no spaces: equal options give equal strings, a good cache
key) written with string formatting only, so that `torch.compile(fullgraph=True)` traces it
(dynamo cannot trace `json.dumps`); `decode` validates and names a bad string.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from cutbce_common.focal import Focal
from cutbce_common.loss import Loss
from cutbce_common.shapes import IMPL_CHOICES, AxisName, BlockSizes, check_mesh_axes, tile_width

# The impls `resolved` accepts: an engine, not 'auto' (the names of `jax_kernels.engines.ENGINES`:
# tests/test_repo_layout.py holds that IMPL_CHOICES is 'auto' and those names).
ENGINE_NAMES = tuple(name for name in IMPL_CHOICES if name != "auto")


@dataclasses.dataclass(frozen=True)
class CutBCEOptions:
    """The static options of one engine call (hashable; `encode()` crosses a custom-op boundary).

    Attributes:
      block_v: the caller's vocabulary tile width, a positive int, or None: a 16 MiB float32 tile
        for the rows the engine sees (`shapes.tile_width`, called where the engine runs; in JAX
        by `resolved`).
      compute_metrics: also count TP / FP / FN / TN.
      loss: the `cutbce_common.loss.Loss` (what is computed per element; the other fields
        are the route: where and how it runs). The engines hand it unopened to the branch math.
      impl: the JAX engine (also behind the torch_xla bridge): 'auto' (Pallas on a TPU for
        float32 / bfloat16), 'blocked' or 'pallas' (`shapes.choose_impl`); an engine name once
        `resolved`. Unused by the native engine.
      block_sizes: the Pallas tiles (`shapes.BlockSizes`), None: derived from the chip.
      cpu_kernel: the JAX blocked loop's float32 tiles run the C kernel (`cpu_tile.c`, through
        XLA's FFI) when lowered for the CPU; False keeps them in jnp. The torch_xla bridge sets
        False (`jax_kernels.bridge.jax_static`): its runtime is its own XLA build, where the FFI
        target is not registered. Unused by the native engine.
      mesh_shape, mesh_axes: the mesh's shape and axis names (torch_xla's SPMD mesh, or the mesh
        the JAX entry got); `()` for one device.
      vocab_axis, data_axis: the mesh axes the table and the positions are split on (a name, a
        tuple of names, or None); None without a mesh.
      offset: the global id of the table's first row (a vocabulary-parallel rank's slice start).
      id_limit: ids >= this raise (the global V of a vocabulary-parallel table); None: the table's V.
    """

    block_v: int | None = None
    compute_metrics: bool = False
    loss: Loss = Loss()
    impl: str = "auto"
    block_sizes: BlockSizes | None = None
    cpu_kernel: bool = True
    mesh_shape: tuple[int, ...] = ()
    mesh_axes: tuple[str, ...] = ()
    vocab_axis: AxisName = None
    data_axis: AxisName = None
    offset: int = 0
    id_limit: int | None = None

    def __post_init__(self):
        if self.block_v is not None:
            _check_int("block_v", self.block_v, low=1)
        if not isinstance(self.compute_metrics, bool):
            raise TypeError(f"options compute_metrics must be a bool, got {self.compute_metrics!r}")
        if not isinstance(self.loss, Loss):
            raise TypeError(f"options loss must be a Loss, got {self.loss!r}")
        self.loss.__post_init__()  # checked again: a frozen dataclass can still be changed
        if self.impl not in IMPL_CHOICES:
            raise ValueError(f"options impl must be one of {IMPL_CHOICES}, got {self.impl!r}")
        if self.block_sizes is not None:
            if not isinstance(self.block_sizes, BlockSizes):
                raise TypeError(f"options block_sizes must be a BlockSizes or None, got {self.block_sizes!r}")
            self.block_sizes.__post_init__()
        if not isinstance(self.cpu_kernel, bool):
            raise TypeError(f"options cpu_kernel must be a bool, got {self.cpu_kernel!r}")
        self._set_mesh()
        _check_int("offset", self.offset, low=0)
        if self.id_limit is not None:
            _check_int("id_limit", self.id_limit, low=1)

    def _set_mesh(self):
        """Mesh fields as tuples (JSON gives lists) and checked: positive sizes, one name per
        dimension, axes of the mesh (`shapes.check_mesh_axes`), none without a mesh."""
        shape, axes = tuple(self.mesh_shape), tuple(self.mesh_axes)
        for size in shape:
            _check_int("mesh_shape entry", size, low=1)
        for name in axes:
            _check_name("mesh_axes entry", name)
        if len(axes) != len(shape):
            raise ValueError(f"options mesh_axes {axes} must name each of the {len(shape)} mesh dimensions {shape}")
        vocab_axis, data_axis = _axis(self.vocab_axis), _axis(self.data_axis)
        if shape:
            check_mesh_axes(axes, vocab_axis, data_axis)
        elif vocab_axis is not None or data_axis is not None:
            raise ValueError(f"options vocab_axis={vocab_axis!r} / data_axis={data_axis!r} need a mesh (mesh_shape)")
        for name, value in (("mesh_shape", shape), ("mesh_axes", axes), ("vocab_axis", vocab_axis),
                            ("data_axis", data_axis)):
            object.__setattr__(self, name, value)

    def resolved(self, *, num_positions: int, num_items: int, impl: str) -> CutBCEOptions:
        """These options as a JAX engine runs them: `block_v` an int, sized by `shapes.tile_width`
        for the `num_positions` x `num_items` one device sees, and `impl` the engine already chosen
        (`shapes.choose_impl`: one of `ENGINE_NAMES`, not 'auto')."""
        if impl not in ENGINE_NAMES:
            raise ValueError(f"resolved impl must be an engine, one of {ENGINE_NAMES}, got {impl!r}")
        block_v = tile_width(self.block_v, num_positions, num_items)
        return dataclasses.replace(self, block_v=block_v, impl=impl)

    def encode(self) -> str:
        """Canonical JSON (sorted keys, no spaces), the custom ops' `options` argument."""
        return "{" + ",".join([f'"{name}":{_json(getattr(self, name))}' for name in _FIELDS]) + "}"


_FIELDS = tuple(sorted(field.name for field in dataclasses.fields(CutBCEOptions)))
# Looked up, not computed, in `_json`: dynamo traces a dict lookup, not `dataclasses.fields`.
_VALUE_FIELDS = {kind: tuple(sorted(field.name for field in dataclasses.fields(kind)))
                 for kind in (Loss, Focal, BlockSizes)}


@functools.lru_cache(maxsize=256)
def decode(text: str) -> CutBCEOptions:
    """The options `text` encodes (`CutBCEOptions.encode`); cached: the ops decode on every call.

    Raises:
      ValueError: `text` is not such a string (not JSON, a missing or unknown field, a value out of
        range), naming it.
    """
    if not isinstance(text, str):
        raise ValueError(f"options must be a str from CutBCEOptions.encode(), got {type(text).__name__} {text!r}")
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or set(data) != set(_FIELDS):
            keys = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"expected a JSON object with the fields {list(_FIELDS)}, got {keys}")
        if not isinstance(data["loss"], dict):
            raise ValueError(f"loss must be an object of Loss fields, got {data['loss']!r}")
        data["loss"] = Loss.from_arguments(data["loss"])
        data["block_sizes"] = _block_sizes(data["block_sizes"])
        return CutBCEOptions(**data)
    except (TypeError, ValueError) as error:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"options {text!r} is not a CutBCEOptions.encode() string: {error}") from None


def _block_sizes(data) -> BlockSizes | None:
    """The `block_sizes` JSON value (null or an object of every `BlockSizes` field) as stored."""
    if data is None:
        return None
    if not isinstance(data, dict) or set(data) != set(_VALUE_FIELDS[BlockSizes]):
        raise ValueError(f"block_sizes must be null or an object with the fields "
                         f"{list(_VALUE_FIELDS[BlockSizes])}, got {data!r}")
    return BlockSizes(**data)


def _check_int(name: str, value, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"options {name} must be an int >= {low}, got {value!r}")


def _check_name(name: str, value) -> None:
    # Printable ASCII without quotes or backslashes: `encode` writes names without JSON escapes.
    if not isinstance(value, str) or not value or not (value.isascii() and value.isprintable()) \
            or '"' in value or "\\" in value:
        raise ValueError(f"options {name} must be a non-empty printable ASCII name without quotes or "
                         f"backslashes, got {value!r}")


def _axis(axis):
    """A vocab / data axis as stored: None, a name, or a tuple of names (JSON gives a list)."""
    if axis is None or isinstance(axis, str):
        if axis is not None:
            _check_name("axis name", axis)
        return axis
    if not isinstance(axis, (tuple, list)):
        raise ValueError(f"options axis must be a name, a tuple of names or None, got {axis!r}")
    for name in axis:
        _check_name("axis name", name)
    return tuple(axis)


def _json(value) -> str:
    """`value` as JSON text, as `json.dumps(..., sort_keys=True, separators=(",", ":"))` writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    # f-strings, not str() / repr(): dynamo traces these.
    if isinstance(value, int):
        return f"{value}"
    if isinstance(value, float):
        return f"{value!r}"  # finite (Loss checks): the shortest text that reads back as the same float
    if isinstance(value, str):
        return f'"{value}"'  # checked by _check_name: nothing to escape
    names = _VALUE_FIELDS.get(type(value))  # the Loss and its parts, the BlockSizes: their fields, sorted
    if names is not None:
        return "{" + ",".join([f'"{name}":{_json(getattr(value, name))}' for name in names]) + "}"
    return "[" + ",".join([_json(item) for item in value]) + "]"
