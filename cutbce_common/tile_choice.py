"""Which float32 CPU tile runs on this machine: the C kernel, unless the tuning command measured another faster.

By default the C kernel runs wherever it builds: the first call times nothing and compiles nothing
beyond the kernel's own build. Choosing another tile is an explicit, repeatable command,
`python -m torch_cutbce.tune_tiles` (docs/performance.md, 'First call and tile choice'): it runs
the whole forward + backward with each candidate, in interleaved rounds (`interleaved_medians`),
keeps the fastest by the medians (`fastest`) and writes the choice beside the kernel's build
(`cache_path`: keyed as the build is, by sources, flags, compiler and CPU, and by the framework's
version), where every later process reads it (`cached`). `TORCH_CUTBCE_TILE` forces a candidate.
Framework-neutral: the callers pass the candidates as functions.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from cutbce_common import cpu_tile_build

ENV = "TORCH_CUTBCE_TILE"
DEFAULT = "c_kernel"  # wherever it builds, unless a tuned choice says otherwise
ROUNDS = 5
# What a cache file must say it measured to be read: files of the earlier timing on the first call
# (one [1024, 1024] tile, one sample, `<library>.<framework>-<version>.json`) are never read.
METHOD = "forward+backward, interleaved rounds, medians"
TUNE_COMMAND = "python -m torch_cutbce.tune_tiles"
logger = logging.getLogger("torch_cutbce.tiles")


class TileChoiceWarning(UserWarning):
    """jax_kernels' first-call message: before its kernel is built, once per machine (torch says
    the same as its TileCompileWarning)."""


@dataclass(frozen=True)
class Choice:
    """`name` the candidate in use; `why` says how it was chosen (for the log)."""

    name: str
    why: str


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
# tile: a compile in every process): a near tie keeps the cheaper candidate instead of a coin flip.
MARGIN = 0.10


def fastest(timings_ms: dict[str, float]) -> str:
    """The first listed candidate, unless a later one is more than MARGIN faster than the choice so far."""
    best = None
    for name, ms in timings_ms.items():
        if best is None or ms < timings_ms[best] * (1 - MARGIN):
            best = name
    return best


def interleaved_medians(runs: dict[str, Callable[[], object]], rounds: int = ROUNDS,
                        clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Each candidate's median ms over `rounds` rounds, each round running every candidate once in
    turn (load from other jobs falls on all of them alike), after one untimed run of each (its
    compile, cold caches). A candidate that raises drops out."""
    live = {}
    for name, run in runs.items():
        try:
            run()
            live[name] = run
        except Exception as error:  # a candidate that fails here is not a candidate
            logger.debug("tile candidate %s failed: %r", name, error)
    times: dict[str, list[float]] = {name: [] for name in live}
    for _ in range(rounds):
        for name, run in list(live.items()):
            start = clock()
            try:
                run()
            except Exception as error:
                logger.debug("tile candidate %s failed: %r", name, error)
                del live[name], times[name]
                continue
            times[name].append((clock() - start) * 1e3)
    return {name: statistics.median(ms) for name, ms in times.items() if ms}


def cache_path(library: Path, framework: str, version: str) -> Path:
    """Where `framework`'s tuned choice for the kernel `library` is kept: beside it, so it is keyed as
    the build is (and a rebuilt kernel, another CPU or compiler, starts from the default again)."""
    return library.with_name(f"{library.name}.{framework}-{version}.tuned.json")


def cached(path: Path, candidates: tuple[str, ...]) -> Choice | None:
    """The choice the tuning command wrote to `path`, if it is one of `candidates`; None where there
    is none (or it is unreadable, of another method, or names a candidate that is gone)."""
    try:
        record = json.loads(path.read_text())
        if record.get("method") == METHOD and record.get("choice") in candidates:
            choice = Choice(record["choice"], f"tuned in {path} ({_timings_text(record['timings_ms'])})")
            logger.debug("float32 CPU tiles use '%s': %s", choice.name, choice.why)
            return choice
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as error:
        logger.debug("ignoring the tile choice in %s: %r", path, error)
    return None


def tune(path: Path, runs: dict[str, Callable[[], object]], rounds: int = ROUNDS, **details) -> dict:
    """Measures `runs` (`interleaved_medians`), writes the fastest (`fastest`) to `path` with the
    timings and `details` (the shape, threads...), and returns that record.

    Raises:
      RuntimeError: every candidate failed.
      OSError: the cache cannot be written.
    """
    timings_ms = interleaved_medians(runs, rounds)
    if not timings_ms:
        raise RuntimeError(f"no tile candidate ran ({', '.join(runs)})")
    record = {"choice": fastest(timings_ms), "method": METHOD, "timings_ms": timings_ms, "rounds": rounds,
              "when": time.strftime("%Y-%m-%d %H:%M:%S"), **details}
    path.parent.mkdir(parents=True, exist_ok=True)
    cpu_tile_build.write_atomically(path, json.dumps(record, indent=1) + "\n", path.parent)
    return record


def _timings_text(timings_ms: dict[str, float]) -> str:
    return ", ".join(f"{name} {ms:.4g} ms" for name, ms in timings_ms.items())
