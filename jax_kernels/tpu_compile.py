"""Compile JAX functions for a TPU chip on a host without one (libtpu's compile-only client).

Used only by the compile-only checks (tests/test_tpu_compile.py, benchmarks/tpu_compile_matrix.py),
in processes that put `.venv/libtpu-overlay` (ci/setup.sh) on PYTHONPATH; the library never imports
this module. Importing it changes nothing: `pin_mosaic_version()` is the only patch, and the caller
applies it. Recipe and measurements: /work/shared/reference/TOOLCHAIN.md section 8.
"""

from __future__ import annotations

import dataclasses
import time

# Smallest topology libtpu accepts for each chip (v5e and v6e refuse "1x1": their hosts hold 2x2).
TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
MOSAIC_VERSION = 7


def pin_mosaic_version(version: int = MOSAIC_VERSION) -> None:
    """Make JAX serialize Pallas TPU kernels at Mosaic `version` (default 7), for compile-only use.

    JAX picks the Mosaic IR version in `jax._src.tpu_custom_call.get_ir_version` from the TPU
    runtime's build date (`cloud_tpu_init.is_cloud_tpu_older_than`). Off a Cloud TPU VM that check
    finds no runtime and answers "not older", so jax 0.7.1 serializes version 8, while libtpu
    0.0.20 (the one jax[tpu]==0.7.1 pins) deserializes only versions <= 7 ("Unsupported version:
    expected <= 7 but got 8"). Pinning 7 is what that libtpu would negotiate on a VM.

    On a real TPU VM JAX reads the version from the runtime it runs on; do NOT apply this pin there
    (it could serialize an older version than the runtime expects, or hide a real mismatch).
    The patch lasts for the process.
    """
    from jax._src import tpu_custom_call

    tpu_custom_call.get_ir_version = lambda ctx: version


def topology(chip: str):
    """The `jax.experimental.topologies` description of the smallest slice of `chip`.

    Args:
        chip: 'v4', 'v5e', 'v5p' or 'v6e'. libtpu 0.0.20 does not know v7 ("Invalid TPU external
            name: TPU v7"), so it is not offered.

    Raises:
        ValueError: for another chip name.
    """
    if chip not in TOPOLOGIES:
        raise ValueError(f"chip must be one of {sorted(TOPOLOGIES)}, got {chip=}")
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name=TOPOLOGIES[chip], platform="tpu")


@dataclasses.dataclass(frozen=True)
class CompileResult:
    """One compile: `error` is None when it succeeded; byte counts from `memory_analysis()`
    (None when the compile failed)."""

    chip: str
    error: str | None
    seconds: float
    argument_bytes: int | None = None
    output_bytes: int | None = None
    temp_bytes: int | None = None
    code_bytes: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def shape_dtype_struct(chip_topology, shape, dtype):
    """A `jax.ShapeDtypeStruct` placed (replicated) on the first device of `chip_topology`."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(chip_topology.devices[:1], ("x",))
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))


def compile_for(chip: str, fn, *structs, keep_text: bool = False):
    """Lower and compile `jax.jit(fn)` for `chip` with inputs `structs`; never raises for a failed compile.

    Args:
        chip: as in `topology`.
        fn: the function to jit; its static options bound already (e.g. `functools.partial`).
        structs: one `jax.ShapeDtypeStruct` (or None) per positional argument, plain `(shape, dtype)`
            tuples are placed on the chip here; None passes through as None.
        keep_text: also return the optimized HLO text (`compiled.as_text()`): `(result, text)`.

    Returns:
        A `CompileResult` (and the HLO text, or None on failure, when `keep_text`).
    """
    import jax

    topo = topology(chip)
    args = [shape_dtype_struct(topo, *s) if isinstance(s, tuple) else s for s in structs]
    start = time.perf_counter()
    text = None
    try:
        compiled = jax.jit(fn).lower(*args).compile()
        stats = compiled.memory_analysis()
        if keep_text:
            text = compiled.as_text()
    except Exception as e:  # noqa: BLE001: any compile failure is a result to report, not a crash
        result = CompileResult(chip, f"{type(e).__name__}: {e}", time.perf_counter() - start)
    else:
        result = CompileResult(
            chip, None, time.perf_counter() - start,
            argument_bytes=stats.argument_size_in_bytes, output_bytes=stats.output_size_in_bytes,
            temp_bytes=stats.temp_size_in_bytes, code_bytes=stats.generated_code_size_in_bytes,
        )
    return (result, text) if keep_text else result
