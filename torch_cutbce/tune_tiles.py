"""Choose this machine's float32 CPU tile by measuring it: `python -m torch_cutbce.tune_tiles`.

The library runs the C kernel (`cutbce_common/cpu_tile.c`) for plain float32 CPU tiles
wherever it builds, and times nothing on a first call. This command is the one place another tile
can be chosen: it runs the whole native forward + backward ('mean', float32; N 4096, V 32,768,
D 64, L 8 unless told otherwise) once with each candidate tile (the C kernel, torch.compile's tile,
which compiles here, 10-60 s, and the eager one), then `--rounds` rounds in which the candidates
take turns, and keeps the fastest by the medians (another tile must beat the C kernel by more than
10%: `tile_choice.MARGIN`). The choice is written beside the kernel's build
(`<library>.torch-<torch version>.tuned.json` in `TORCH_CUTBCE_CACHE_DIR`), where every later process
reads it; a rebuilt kernel, another CPU or another torch version starts from the C kernel again.
`--framework jax` does the same for JAX's blocked loop (the FFI kernel against the jnp tile, jitted),
`--framework both` for both; `--dry-run` measures without writing; `--forget` deletes the choices.
`TORCH_CUTBCE_TILE` still forces a tile in any process. Docs: docs/performance.md, 'First call and
tile choice'.

    python -m torch_cutbce.tune_tiles                     # torch, about 1-2 min on 2 cores
    python -m torch_cutbce.tune_tiles --framework both --rounds 7
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import warnings
from typing import Callable

from cutbce_common import cpu_tile_build, tile_choice


def _say(caught) -> None:
    for warning in caught:
        print(f"  ({warning.message})")


def tuning_runs(num_positions: int = 4096, num_items: int = 32768, hidden_size: int = 64, num_targets: int = 8,
                tiles: tuple[str, ...] | None = None, seed: int = 0) -> dict[str, Callable[[], None]]:
    """For each of `tiles` (default: `fused_tile.available_tiles()`), one forward + backward of the
    whole native loss through the entry ('mean', float32, the CPU) with `TORCH_CUTBCE_TILE` set to it
    for the call: what this command times. A run raises where its tile did not run (torch.compile
    failed). Here, above the entry, not in `fused_tile`, which the entry's engine imports."""
    import torch

    from torch_cutbce.functional import cut_bce_with_logits
    from torch_cutbce.native import fused_tile

    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_positions, hidden_size, generator=generator).requires_grad_()
    items = (torch.randn(num_items, hidden_size, generator=generator) / hidden_size ** 0.5).requires_grad_()
    targets = torch.randint(0, num_items, (num_positions, num_targets), generator=generator)

    def run(tile: str) -> None:
        previous = os.environ.get(tile_choice.ENV)
        os.environ[tile_choice.ENV] = tile
        try:
            hidden.grad = items.grad = None
            cut_bce_with_logits(hidden, items, targets, backend="native").backward()
            if fused_tile._plain_cpu_tile() != tile:
                raise RuntimeError(f"the {tile!r} tile did not run here")
        finally:
            if previous is None:
                os.environ.pop(tile_choice.ENV, None)
            else:
                os.environ[tile_choice.ENV] = previous

    return {tile: functools.partial(run, tile) for tile in (tiles or fused_tile.available_tiles())}


def jax_tuning_runs(num_positions: int = 4096, num_items: int = 32768, hidden_size: int = 64, num_targets: int = 8,
                    tiles: tuple[str, ...] | None = None, seed: int = 0) -> dict:
    """For each of `tiles`, one jitted forward + backward of the whole blocked loss ('mean', float32,
    the CPU; default: `negative_tile.TILES`), traced and compiled here with `TORCH_CUTBCE_TILE` set to it:
    what `--framework jax` times. Here, above JAX's entry, not in `negative_tile`, which the entry imports."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_kernels.api import cut_bce
    from jax_kernels.blocked import negative_tile

    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.standard_normal((num_positions, hidden_size)), jnp.float32)
    items = jnp.asarray(rng.standard_normal((num_items, hidden_size)) / hidden_size ** 0.5, jnp.float32)
    targets = jnp.asarray(rng.integers(0, num_items, (num_positions, num_targets)), jnp.int32)
    previous, runs = os.environ.get(tile_choice.ENV), {}
    try:
        for tile in tiles or negative_tile.TILES:
            os.environ[tile_choice.ENV] = tile
            jax.clear_caches()  # the choice is read at trace time: nothing traced for another tile is reused
            step = jax.jit(jax.value_and_grad(lambda h, e: cut_bce(h, e, targets, impl="blocked"), argnums=(0, 1)))
            compiled = step.lower(hidden, items).compile()
            if ("cutbce_" in compiled.as_text()) != (tile == "c_kernel"):
                raise RuntimeError(f"the {tile!r} tile was not compiled in")
            runs[tile] = functools.partial(lambda compiled: jax.block_until_ready(compiled(hidden, items)), compiled)
    finally:
        if previous is None:
            os.environ.pop(tile_choice.ENV, None)
        else:
            os.environ[tile_choice.ENV] = previous
        jax.clear_caches()
    return runs


def _torch_runs(args):
    import torch

    from torch_cutbce.native import fused_tile

    if args.threads:
        torch.set_num_threads(args.threads)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        library = fused_tile._cpu_library()
    _say(caught)
    if library is None:
        return None, f"the C kernel cannot be built here: float32 CPU tiles run '{fused_tile._plain_cpu_tile()}'"
    tiles = tuple(tile for tile in (args.tiles or fused_tile.available_tiles()) if tile in fused_tile.TILES)
    if not tiles:
        return None, f"none of {', '.join(args.tiles)} is a torch tile ({', '.join(fused_tile.TILES)})"
    if "compiled" in tiles:
        print("  torch.compile's tile compiles in the first run of its candidate: 10-60 s")
    runs = tuning_runs(args.num_positions, args.num_items, args.hidden_size, args.num_targets, tiles)
    details = {"framework": "torch", "version": torch.__version__, "threads": torch.get_num_threads()}
    return (fused_tile.tuned_path(), runs, details, fused_tile._tuned_cpu_tile.cache_clear), None


def _jax_runs(args):
    try:
        import jax
    except ImportError:
        return None, "jax is not installed (pip install -e '.[jax]')"
    from jax_kernels.blocked import negative_tile

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registered = negative_tile._ffi_registered()
    _say(caught)
    if not registered:
        return None, "the C kernel's FFI wrapper cannot be built here: float32 CPU tiles run jnp"
    tiles = tuple(tile for tile in (args.tiles or negative_tile.TILES) if tile in negative_tile.TILES)
    if not tiles:
        return None, f"none of {', '.join(args.tiles)} is a JAX tile ({', '.join(negative_tile.TILES)})"
    runs = jax_tuning_runs(args.num_positions, args.num_items, args.hidden_size, args.num_targets, tiles)
    details = {"framework": "jax", "version": jax.__version__, "threads": int(negative_tile._threads())}
    return (negative_tile.tuned_path(), runs, details, negative_tile._tuned_tile.cache_clear), None


def _tune(framework: str, args) -> bool:
    print(f"{framework}: N {args.num_positions}, V {args.num_items}, D {args.hidden_size}, L {args.num_targets}, "
          f"float32, 'mean', forward + backward")
    prepared, why_not = (_torch_runs if framework == "torch" else _jax_runs)(args)
    if prepared is None:
        print(f"  nothing to tune: {why_not}")
        return False
    path, runs, details, forget_read = prepared
    if args.forget:
        path.unlink(missing_ok=True)
        forget_read()
        print(f"  forgot the tuned choice ({path}): the C kernel runs")
        return True
    print(f"  candidates {', '.join(runs)}; {args.rounds} interleaved rounds after one untimed run each")
    shape = {"num_positions": args.num_positions, "num_items": args.num_items, "hidden_size": args.hidden_size,
             "num_targets": args.num_targets}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if args.dry_run:
            timings = tile_choice.interleaved_medians(runs, args.rounds)
            record = {"choice": tile_choice.fastest(timings) if timings else None, "timings_ms": timings}
        else:
            record = tile_choice.tune(path, runs, args.rounds, shape=shape, **details)
            forget_read()
    _say(caught)
    timings = record["timings_ms"]
    base = timings.get(tile_choice.DEFAULT)
    for name, ms in timings.items():
        ratio = f" ({ms / base:.2f}x the C kernel)" if base and name != tile_choice.DEFAULT else ""
        print(f"  {name:<9} median {ms:9.1f} ms{ratio}")
    missing = [name for name in runs if name not in timings]
    if missing:
        print(f"  failed to run: {', '.join(missing)}")
    where = "not written (--dry-run)" if args.dry_run else f"written to {path}"
    print(f"  choice: {record['choice']}; {where}")
    return bool(timings)


def positive_int(text: str) -> int:
    """An argparse `type`: `text` as an integer of at least 1, else a usage error naming the flag
    (exit 2), not a traceback from deep inside the tuning run."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def argument_parser() -> argparse.ArgumentParser:
    """The command's flags, every number checked as it is parsed (`positive_int`)."""
    parser = argparse.ArgumentParser(prog="python -m torch_cutbce.tune_tiles", description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=("torch", "jax", "both"), default="torch")
    parser.add_argument("--rounds", type=positive_int, default=tile_choice.ROUNDS)
    parser.add_argument("--num-positions", type=positive_int, default=4096)
    parser.add_argument("--num-items", type=positive_int, default=32768)
    parser.add_argument("--hidden-size", type=positive_int, default=64)
    parser.add_argument("--num-targets", type=positive_int, default=8)
    parser.add_argument("--threads", type=positive_int, help="torch's threads (default: torch's own)")
    parser.add_argument("--tiles", nargs="+", choices=("c_kernel", "compiled", "eager", "xla"),
                        help="the candidates to measure (default: every one that runs here)")
    parser.add_argument("--dry-run", action="store_true", help="measure and print, write nothing")
    parser.add_argument("--forget", action="store_true", help="delete the tuned choice: the C kernel runs again")
    return parser


TILE_BYTES = 16 << 20  # the default tile (`shapes.default_block_v`): the loop holds about three


def run_bytes(args) -> dict[str, int]:
    """About what one tuning run allocates, by the flag whose size sets it (float32 hidden and table
    with their gradients, int64 ids twice; then the tiles): estimated before anything is allocated."""
    n, v, d, slots = args.num_positions, args.num_items, args.hidden_size, args.num_targets
    return {"--num-positions": n * (2 * 4 * d + 2 * 8 * slots), "--num-items": v * 2 * 4 * d,
            "tiles": 3 * TILE_BYTES}


def memory_bytes() -> int | None:
    """This machine's physical memory, where the OS says (None elsewhere: nothing is refused)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_fits(parser: argparse.ArgumentParser, args) -> None:
    """A usage error (exit 2) naming the flag and its value where one run would need more than this
    machine's memory (a torch traceback from the first allocation before)."""
    memory, needs = memory_bytes(), run_bytes(args)
    total = sum(needs.values())
    if memory is None or total <= memory:
        return
    # The flag furthest above its default: --hidden-size multiplies both terms, so the larger term
    # alone would blame --num-items for a huge D.
    sizes = ("--num-positions", "--num-items", "--hidden-size", "--num-targets")
    ratio = {f: getattr(args, f[2:].replace("-", "_")) / parser.get_default(f[2:].replace("-", "_")) for f in sizes}
    flag = max(sizes, key=ratio.get)
    value = getattr(args, flag[2:].replace("-", "_"))
    parser.error(f"argument {flag}: {value} is too large: one tuning run at --num-positions {args.num_positions}, "
                 f"--num-items {args.num_items}, --hidden-size {args.hidden_size}, --num-targets {args.num_targets} "
                 f"needs about {total / 2**30:.3g} GiB, more than this machine's {memory / 2**30:.3g} GiB; "
                 f"pick smaller sizes (the defaults: N 4096, V 32768, D 64, L 8)")


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser()
    args = parser.parse_args(argv)
    check_fits(parser, args)
    if os.environ.get(tile_choice.ENV, "auto") not in ("", "auto"):
        print(f"note: {tile_choice.ENV}={os.environ[tile_choice.ENV]} is set: it overrides any tuned choice "
              f"in processes that keep it set")
    if cpu_tile_build.disabled():
        print("TORCH_CUTBCE_NO_COMPILE is set: no kernel is built, nothing to tune")
        return 1
    frameworks = ("torch", "jax") if args.framework == "both" else (args.framework,)
    ok = [_tune(framework, args) for framework in frameworks]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
