"""Compile JAX functions for a TPU chip on a host without one (libtpu's compile-only client).

Used only by the compile-only checks (tests/test_*_tpu_*.py, benchmarks/tpu_compile_matrix.py,
tpu_hbm.py, tpu_torch_step.py): the parent process builds a child's environment (`child_env`) and
reads its result (`run_child`); the child, with the environment's libtpu overlay on PYTHONPATH
(`.venv/libtpu-overlay` from ci/setup.sh, `.venv-jax/libtpu-overlay` from ci/jax_newest.sh),
compiles (`compile_for`). The library never imports this module. Importing it changes nothing:
`pin_mosaic_version()` is the only patch, the caller applies it, and it patches only with the old
libtpu that needs it. Which libtpu knows which chip, how the client works and why the pin:
docs/toolchain.md, 'Compiling for TPU without a TPU' and 'Mosaic version'.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Beside the running interpreter's environment: .venv's (ci/setup.sh: libtpu 0.0.20 for jax 0.7.1)
# or .venv-jax's (ci/jax_newest.sh: the libtpu jax[tpu] pins for the newest JAX).
OVERLAY = Path(sys.prefix) / "libtpu-overlay"

# One host's slice of each chip (v5e and v6e refuse "1x1": their hosts hold 2x2). A TPU7x chip is
# two JAX devices (one per TensorCore); libtpu names it "tpu7x" and refuses "v7" and "v7x".
TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2", "tpu7x": "tpu7x:2x2x1"}
# The oldest libtpu that knows each chip, where that is not every libtpu used here: 0.0.20 (.venv)
# refuses "tpu7x" ("Invalid TPU external name: TPU7x"), 0.0.50 (.venv-jax) accepts it.
MIN_LIBTPU = {"tpu7x": (0, 0, 50)}
MOSAIC_VERSION = 7
# libtpu 0.0.20 and 0.0.21 (what jax[tpu]==0.7.1 and torch_xla[tpu] 2.9 pin) read Mosaic versions
# <= 7 only; 0.0.42 and 0.0.50 read what their JAX writes off a VM. Below this, `pin_mosaic_version` pins.
MOSAIC_PIN_BELOW_LIBTPU = (0, 0, 22)


def overlay_ready() -> bool:
    """Whether `.venv/libtpu-overlay` (libtpu for the compile-only client, built by ci/setup.sh) exists."""
    return (OVERLAY / "libtpu").is_dir()


def require_overlay() -> None:
    """Exit with a message naming the missing overlay (a benchmark's first step)."""
    if not overlay_ready():
        raise SystemExit(f"{OVERLAY} is missing: run ci/setup.sh")


def libtpu_version() -> tuple[int, ...] | None:
    """The version of the libtpu the compile-only children load (the overlay's, else one installed
    in the environment itself, as in .venv-tpu), e.g. (0, 0, 50, 1); None without either. Read from
    its metadata, so libtpu is not loaded here."""
    from importlib import metadata

    for path in ([str(OVERLAY)], None):
        for dist in metadata.distributions(name="libtpu", **({} if path is None else {"path": path})):
            return tuple(int(part) for part in re.findall(r"\d+", dist.version.split("+")[0])[:4])
    return None


def libtpu_knows(chip: str) -> bool:
    """Whether the overlay's libtpu can compile for `chip` (a key of TOPOLOGIES)."""
    needed = MIN_LIBTPU.get(chip)
    version = libtpu_version()
    return needed is None or (version is not None and version >= needed)


def supported_chips() -> tuple[str, ...]:
    """The chips of TOPOLOGIES that the overlay's libtpu knows, in TOPOLOGIES' order."""
    return tuple(chip for chip in TOPOLOGIES if libtpu_knows(chip))


def _version_text(version) -> str:
    return ".".join(map(str, version)) if version else "none"


def child_env(*paths, libtpu: bool = True, **variables) -> dict:
    """The environment of a child process: the repository root and `paths` on PYTHONPATH, and with
    `libtpu` the overlay first, with libtpu's lockfile check off (a compile-only client guards no
    chip, and a second compile-only process on the host would otherwise fail to start). The
    caller's own PYTHONPATH comes last (e.g. optax beside .venv-jax for benchmarks/tpu_hbm.py).
    JAX_PLATFORMS is dropped, so the child's JAX finds the TPU plugin; `variables` are set as given."""
    entries = ([str(OVERLAY)] if libtpu else []) + [str(ROOT)] + [str(p) for p in paths]
    entries += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(entries), **variables)
    if libtpu:
        env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    env.pop("JAX_PLATFORMS", None)
    return env


RESULT_PREFIX = "RESULT "
TIMEOUT_PREFIX = "no result within"  # how `run_child`'s error for a timeout starts


def print_result(result: dict) -> None:
    """Child side: hand `result` (JSON-able) to `run_child` as the last line of stdout."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_child(cmd, env: dict, timeout_s: float, *, stderr_tail: int = 1000, require_exit_zero: bool = False):
    """Parent side: run `cmd` and read the dict of its last `print_result` line.

    Returns `(result, None)`, or `(None, error)` on a timeout, no result line, or (with
    `require_exit_zero`) a non-zero exit. A child that printed its result and then died on the way
    out (libtpu's teardown) still counts unless `require_exit_zero`.
    """
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"{TIMEOUT_PREFIX} {timeout_s:g} s"
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if not lines or (require_exit_zero and proc.returncode != 0):
        return None, f"exit {proc.returncode}: {proc.stderr[-stderr_tail:]}"
    return json.loads(lines[-1][len(RESULT_PREFIX):]), None


def mosaic_pin_needed() -> bool:
    """Whether the overlay's libtpu is one that reads only Mosaic versions <= 7 (0.0.20, 0.0.21)."""
    version = libtpu_version()
    return version is not None and version < MOSAIC_PIN_BELOW_LIBTPU


def pin_mosaic_version(version: int = MOSAIC_VERSION) -> bool:
    """With the old libtpu only (`mosaic_pin_needed`), make JAX serialize Pallas TPU kernels at
    Mosaic `version` (default 7), for compile-only use. Returns whether it pinned.

    JAX 0.7.1 picks the Mosaic IR version in `jax._src.tpu_custom_call.get_ir_version` from the TPU
    runtime's build date (`cloud_tpu_init.is_cloud_tpu_older_than`). Off a Cloud TPU VM that check
    finds no runtime and answers "not older", so jax 0.7.1 serializes version 8, while libtpu
    0.0.20 (the one jax[tpu]==0.7.1 pins) deserializes only versions <= 7 ("Unsupported version:
    expected <= 7 but got 8"). Pinning 7 is what that libtpu would negotiate on a VM. The newest
    pair (jax 0.12 with libtpu 0.0.50) agrees on the latest version off a VM: no pin there, so its
    checks compile what a TPU VM would.

    On a real TPU VM JAX reads the version from the runtime it runs on; do NOT apply this pin there
    (it could serialize an older version than the runtime expects, or hide a real mismatch).
    The patch lasts for the process.
    """
    if not mosaic_pin_needed():
        return False
    from jax._src import tpu_custom_call

    tpu_custom_call.get_ir_version = lambda ctx: version
    return True


def topology(chip: str):
    """The `jax.experimental.topologies` description of the smallest slice of `chip`, or of a named
    slice such as "v6e:2x4".

    Args:
        chip: 'v4', 'v5e', 'v5p', 'v6e' or 'tpu7x', or a topology name `<chip>:<shape>` of one of
            them. 'tpu7x' needs libtpu >= 0.0.50 (.venv-jax's; .venv's 0.0.20 does not know it).

    Raises:
        ValueError: for another chip name, or a chip the overlay's libtpu does not know.
    """
    name = TOPOLOGIES.get(chip, chip)
    family = name.split(":")[0]
    if family not in TOPOLOGIES or ":" not in name:
        raise ValueError(f"chip must be one of {sorted(TOPOLOGIES)} or '<chip>:<shape>' of one, got {chip=}")
    if not libtpu_knows(family):
        raise ValueError(f"{chip=} needs libtpu >= {_version_text(MIN_LIBTPU[family])}, and {OVERLAY} has "
                         f"libtpu {_version_text(libtpu_version())}: run it in .venv-jax (ci/jax_newest.sh)")
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name=name, platform="tpu")


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
    alias_bytes: int | None = None
    xla_peak_bytes: int | None = None  # XLA's peak_memory_in_bytes (counts VMEM buffers too)

    @property
    def ok(self) -> bool:
        return self.error is None


def memory_bytes(stats) -> dict:
    """The byte counts of a compiled program's memory statistics (`memory_analysis()` or
    `get_compiled_memory_stats()`), named as `CompileResult` names them."""
    return dict(argument_bytes=stats.argument_size_in_bytes, output_bytes=stats.output_size_in_bytes,
                temp_bytes=stats.temp_size_in_bytes, code_bytes=stats.generated_code_size_in_bytes,
                alias_bytes=stats.alias_size_in_bytes)


def shape_dtype_struct(chip_topology, shape, dtype):
    """A `jax.ShapeDtypeStruct` placed (replicated) on the first device of `chip_topology`."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(chip_topology.devices[:1], ("x",))
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))


def compile_for(chip: str, fn, *structs, keep_text: bool = False):
    """Lower and compile `jax.jit(fn)` for `chip` with inputs `structs`; never raises for a failed compile.

    Args:
        chip: as in `topology` (a chip or a topology name; only tuples in `structs` need it).
        fn: the function to jit; its static options bound already (e.g. `functools.partial`).
        structs: one `jax.ShapeDtypeStruct` (or None) per positional argument, plain `(shape, dtype)`
            tuples are placed on the chip's first device here; None passes through as None. A
            struct with a sharding over several devices compiles an SPMD program (statistics per chip).
        keep_text: also return the optimized HLO text (`compiled.as_text()`): `(result, text)`.

    Returns:
        A `CompileResult` (and the HLO text, or None on failure, when `keep_text`).
    """
    import jax

    topo = topology(chip) if any(isinstance(s, tuple) for s in structs) else None
    args = [shape_dtype_struct(topo, *s) if isinstance(s, tuple) else s for s in structs]
    start = time.perf_counter()
    text = None
    try:
        compiled = jax.jit(fn).lower(*args).compile()
        stats = compiled.memory_analysis()
        if keep_text:
            text = compiled.as_text()
    except Exception as e:  # noqa: BLE001 (any compile failure is a result to report, not a crash)
        result = CompileResult(chip, f"{type(e).__name__}: {e}", time.perf_counter() - start)
    else:
        result = CompileResult(chip, None, time.perf_counter() - start, xla_peak_bytes=stats.peak_memory_in_bytes,
                               **memory_bytes(stats))
    return (result, text) if keep_text else result
