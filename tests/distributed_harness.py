"""The one harness for multi-process tests: P gloo ranks on this CPU, each running a module-level
function, their results handed back to the test process.

    results = run_ranks(world, program, *args)   # [program(rank, world, *args) for each rank]

`program` must be importable by name (spawned processes import it). Each rank is a fresh process
with eager tiles (`TORCH_CUTBCE_NO_COMPILE=1`: no torch.compile per process) and one thread.
`timeout_s=` kills the ranks and raises TimeoutError when they run longer: a rank left waiting in a
collective then fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from unittest import mock

import torch


def _rank_entry(rank, world, init_file, out_dir, program, args):
    import torch.distributed as dist

    os.environ["TORCH_CUTBCE_NO_COMPILE"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = program(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears gloo down while another still talks to it
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown: under torch 2.13 a rank sometimes aborted there
    # ("terminate called without an active exception"), after its results were saved.
    os._exit(0)


def _join(context, timeout_s: float | None, what: str) -> None:
    """`mp.spawn`'s join, or kill the ranks (the processes of `context`) past `timeout_s`."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not context.join(None if deadline is None else max(deadline - time.monotonic(), 0.0)):
        if deadline is not None and time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
                process.join()
            raise TimeoutError(f"{what} still ran after {timeout_s} s (a rank waiting in a collective?)")


def run_ranks(world: int, program, *args, timeout_s: float | None = None) -> list:
    """`program(rank, world, *args)` on `world` gloo ranks; its results, rank by rank."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        for attempt in (1, 2):
            try:
                # The ranks start with TRITON_INTERPRET=1 (a rank's backend='triton' runs in Triton's
                # interpreter, CPU tensors): in their environment from the start, as triton reads it
                # when first imported; restored here, where triton may compile for a GPU target.
                with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
                    context = mp.start_processes(
                        _rank_entry, args=(world, os.path.join(tmp, f"init{attempt}"), tmp, program, args),
                        nprocs=world, join=False, start_method="spawn")
                _join(context, timeout_s, f"{world} ranks of {program.__name__}")
                break
            except mp.ProcessExitedException as error:
                # torch 2.13's gloo ranks have aborted now and then at exit (SIGABRT; about 1 run in
                # 10 of the core-only check): run once more, so a second abort still fails.
                if attempt == 2 or error.signal_name != "SIGABRT":
                    raise
                warnings.warn(f"a rank aborted ({error}); running the ranks again", stacklevel=2)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]
