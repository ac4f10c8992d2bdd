"""Which float32 CPU tile runs on this machine: the candidate measured fastest, once per machine.

The C kernel is not faster everywhere (a compiler that vectorizes it badly, a CPU it was not tuned
for), so its first use times each candidate on one small tile and keeps the fastest. The choice is
cached beside the kernel's build (`<library>.<label>.json`, so it is keyed as the build is: sources,
flags, compiler, CPU) and reused by every later process. `TORCH_CUTBCE_TILE` forces a candidate
(`auto`, the default, measures). Framework-neutral: the callers pass the candidates as functions.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from jax_kernels.neutral import cpu_tile_build

ENV = "TORCH_CUTBCE_TILE"
MEASURED_TILE = (1024, 1024)  # the [N, block_v] tile each candidate's rows_grad is timed on
logger = logging.getLogger("torch_cutbce.tiles")


class TileChoiceWarning(UserWarning):
    """jax_kernels' first-call messages, each once per machine: before its kernel is built, before
    the tiles are timed, and the tile then chosen (torch says the same as its TileCompileWarning)."""


@dataclass(frozen=True)
class Choice:
    """`name` the candidate in use; `why` says how it was chosen (for the log and the warning)."""

    name: str
    why: str
    measured_now: bool = False


def forced(choices: tuple[str, ...]) -> str | None:
    """The candidate `TORCH_CUTBCE_TILE` names, or None for 'auto' / unset.

    Raises:
      ValueError: a value that is neither 'auto' nor one of `choices`.
    """
    value = os.environ.get(ENV, "").strip()
    if value in ("", "auto"):
        return None
    if value not in choices:
        raise ValueError(f"{ENV}={value!r}: expected 'auto' or one of {choices}")
    return value


# A later-listed candidate must be this much faster than an earlier one to be chosen. The callers
# list them by what they cost beyond their time (the C kernel: nothing per process; torch.compile's
# tile: a compile in every process), and timings on a shared machine differ by about this much run
# to run: a near tie then keeps the cheaper candidate instead of a coin flip.
MARGIN = 0.10


def fastest(timings_ms: dict[str, float]) -> str:
    """The first listed candidate, unless a later one is more than MARGIN faster than the choice so far."""
    best = None
    for name, ms in timings_ms.items():
        if best is None or ms < timings_ms[best] * (1 - MARGIN):
            best = name
    return best


def median_ms(run: Callable[[], object], repeats: int = 5) -> float:
    """Median wall time of `run()` in ms, after one untimed call (a compile, a cold cache)."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def cached_choice(path: Path, candidates: dict[str, Callable[[], float]],
                  before_measuring: Callable[[], None] = lambda: None) -> Choice:
    """The candidate cached in `path` if it is still one of `candidates`, else each candidate's
    measurement (a function returning ms; one that raises drops out), the fastest written to `path`;
    `before_measuring()` runs first (to say so). A cache that cannot be written is only logged: the
    choice stands for this process."""
    try:
        cached = json.loads(path.read_text())
        if cached.get("choice") in candidates:
            return Choice(cached["choice"], f"cached in {path} ({_timings_text(cached['timings_ms'])})")
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        pass  # missing or unreadable: measure again
    before_measuring()
    timings_ms = {}
    for name, measure in candidates.items():
        try:
            timings_ms[name] = float(measure())
        except Exception as error:  # a candidate that fails here is not a candidate
            logger.debug("tile candidate %s failed: %r", name, error)
    name = fastest(timings_ms)
    try:
        cpu_tile_build.write_atomically(path, json.dumps({"choice": name, "timings_ms": timings_ms}), path.parent)
    except OSError as error:
        logger.debug("cannot cache the tile choice in %s: %r", path, error)
    return Choice(name, f"measured now ({_timings_text(timings_ms)}), cached in {path}", measured_now=True)


def announced_choice(library: Path, framework: str, version: str, candidates: dict[str, Callable[[], float]],
                     tiles: tuple[str, ...], warning: type[Warning], cost: str | None = None) -> Choice:
    """`cached_choice` for `framework`'s tiles, cached beside the kernel's `library` as
    `<library>.<framework>-<version>.json`. Measuring (once per machine) is said as `warning` with
    its result, and before it starts where it is slow (`cost`: how long and why; None: about a
    second, not said first); the choice is on the log in each process. `tiles`: what `ENV` may name."""
    prefix = "torch_cutbce" if framework == "torch" else "jax_kernels"

    def before_measuring():
        if cost is not None:
            warnings.warn(f"{prefix}: timing the float32 CPU tiles ({', '.join(candidates)}) to keep the fastest, "
                          f"once per machine ({cost}); {ENV}={tiles[0]} skips it", warning, stacklevel=4)

    choice = cached_choice(library.with_name(f"{library.name}.{framework}-{version}.json"), candidates,
                           before_measuring)
    message = (f"{prefix}: float32 CPU tiles use '{choice.name}': {choice.why}; "
               f"{ENV} forces one of {tiles}")
    logger.info(message)
    if choice.measured_now:
        warnings.warn(message, warning, stacklevel=3)
    return choice


def _timings_text(timings_ms: dict[str, float]) -> str:
    return ", ".join(f"{name} {ms:.3g} ms" for name, ms in timings_ms.items())
