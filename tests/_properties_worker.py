"""Long-lived subprocesses for the sharded engines' properties (test_jax_mesh_properties.py,
test_torch_vocab_parallel_properties.py).

Hypothesis runs in the pytest process (so it shrinks and prints as usual); each example's spec is
sent to a worker, which rebuilds the example (`_properties_examples.build`), runs it and sends back
the results or the exception. Messages are pickles over the worker's stdin and a private copy of
its stdout (fd 1 itself is pointed at stderr, so nothing a library prints can corrupt them).

- `python _properties_worker.py jax-mesh`: JAX on 4 simulated CPU devices (XLA_FLAGS is set before
  jax is imported, which is why this is a separate process); runs `jax_kernels.cut_bce(mesh=...)`.
- `python _properties_worker.py vocab-parallel RANK INIT_FILE`: one of 2 gloo ranks running
  `cut_bce_with_logits(..., vocab_parallel=options)` on its slice of the table. The client sends
  every example to both ranks and joins their replies (a 60 s gloo timeout turns a hang into an error).

Requests are `(mode, spec, params)`: mode 'A' (the example as built), 'B' (with `params['mutation']`),
or 'C' (`params['bad_ids']`: the results with those ids and with -1 in their slots, same program).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

TESTS = Path(__file__).resolve().parent
NUM_DEVICES = 4
WORLD = 2


class WorkerError(RuntimeError):
    """A worker raised something other than ValueError / TypeError, hung, or died."""


# -- server side -----------------------------------------------------------------------------------


def _private_stdout():
    """A private copy of stdout for the replies; fd 1 then points at stderr (gloo prints to it)."""
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    return replies


def _serve(handle, replies) -> None:
    requests = sys.stdin.buffer
    while True:
        try:
            request = pickle.load(requests)
        except EOFError:
            return
        if request is None:
            return
        try:
            reply = ("ok", handle(*request))
        except Exception as error:  # reported to the client, which decides what it means
            reply = ("error", type(error).__name__, str(error), traceback.format_exc())
        pickle.dump(reply, replies)
        replies.flush()


def _prepare(mode, spec, params, num_items):
    """The example's arguments for `mode` (A, B: one bad argument) and the ids variants (C)."""
    from _properties_examples import build, corrupt, mutate

    example = build(spec)
    inputs, options = dict(example.inputs), example.call_options
    if mode == "B":
        inputs, options, _ = mutate(inputs, options, params["mutation"], spec, num_items)
    variants = None
    if mode == "C":
        variants = list(corrupt(inputs["targets"], params["bad_ids"], spec.seed))
    return example, inputs, options, variants


def _jax_mesh_request(mode, spec, params):
    import jax

    from _properties_runners import jax_results

    example, inputs, options, variants = _prepare(mode, spec, params, spec.num_items)
    mesh = jax.make_mesh(params["mesh_shape"], params["mesh_axes"])
    return jax_results(example, jit=params["jit"], inputs=inputs, options=options, variants=variants,
                       impl="blocked", mesh=mesh, vocab_axis=params["vocab_axis"], data_axis=params["data_axis"])


def _vocab_parallel_request(rank, mode, spec, params):
    from _properties_examples import build, mutate
    from _properties_runners import torch_results
    from torch_cutbce import cut_bce_with_logits
    from torch_cutbce.vocab_parallel import VocabParallelOptions

    example = build(spec)
    split = params["split"]
    start, stop = (0, split) if rank == 0 else (split, spec.num_items)
    inputs = {k: (x[start:stop] if k in ("item_weight", "bias", "class_weight", "pos_weight") else x)
              for k, x in example.inputs.items()}
    options = example.call_options
    if mode == "B":
        inputs, options, _ = mutate(inputs, options, params["mutation"], spec, spec.num_items)
    vp_options = VocabParallelOptions(start, stop, spec.num_items)

    def fn(*args, **kwargs):
        return cut_bce_with_logits(*args, vocab_parallel=vp_options, **kwargs)

    return torch_results(example, fn, inputs=inputs, options=options)


def main(argv) -> None:
    replies = _private_stdout()
    sys.path[:0] = [str(TESTS.parent), str(TESTS)]
    if argv[0] == "jax-mesh":
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={NUM_DEVICES}"
        import jax

        assert jax.device_count() == NUM_DEVICES, jax.devices()
        _serve(_jax_mesh_request, replies)
    elif argv[0] == "vocab-parallel":
        import datetime

        import torch
        import torch.distributed as dist

        rank = int(argv[1])
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{argv[2]}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))
        try:
            _serve(lambda *request: _vocab_parallel_request(rank, *request), replies)
        finally:
            dist.destroy_process_group()
    else:
        raise SystemExit(f"unknown worker {argv[0]!r}")


# -- client side -----------------------------------------------------------------------------------


class Workers:
    """One or more worker processes that receive every request; `call` returns their replies.

    A reply that is an exception re-raises here: ValueError / TypeError as themselves (the message
    kept), anything else, a hang past `timeout_s` or a dead process as `WorkerError` with the
    worker's traceback (the workers are then restarted for the next example).
    """

    def __init__(self, commands, env, timeout_s=180.0):
        """`commands()`: the workers' argument lists, asked again at each (re)start."""
        self.commands, self.env, self.timeout_s = commands, env, timeout_s
        self.procs, self.logs, self.starts = [], [], 0

    def _start(self):
        self.close()
        self.starts += 1
        for command in self.commands(self.starts):
            log = tempfile.TemporaryFile()
            proc = subprocess.Popen([sys.executable, str(TESTS / "_properties_worker.py"), *command],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=self.env)
            self.procs.append(proc)
            self.logs.append(log)

    def _log_tail(self, i) -> str:
        self.logs[i].seek(0)
        return self.logs[i].read()[-3000:].decode(errors="replace")

    def call(self, mode, spec, params):
        if not self.procs or any(p.poll() is not None for p in self.procs):
            self._start()
        replies = [None] * len(self.procs)

        def exchange(i, proc):
            try:
                pickle.dump((mode, spec, params), proc.stdin)
                proc.stdin.flush()
                replies[i] = pickle.load(proc.stdout)
            except (EOFError, OSError, pickle.UnpicklingError) as error:
                replies[i] = ("died", repr(error))

        threads = [threading.Thread(target=exchange, args=(i, p), daemon=True) for i, p in enumerate(self.procs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout_s)
        if any(t.is_alive() for t in threads) or any(r[0] == "died" for r in replies):
            tails = "\n".join(self._log_tail(i) for i in range(len(self.procs)))
            self.close()
            raise WorkerError(f"a worker hung or died (replies {[r and r[:2] for r in replies]}):\n{tails}")
        errors = [r for r in replies if r[0] == "error"]
        if errors and len(errors) < len(replies):
            raise WorkerError(f"only some ranks raised: {[r[1:3] for r in errors]}")
        if errors:
            kind, message, trace = errors[0][1:]
            if kind in ("ValueError", "TypeError"):
                raise {"ValueError": ValueError, "TypeError": TypeError}[kind](message)
            raise WorkerError(f"{kind}: {message}\n{trace}")
        return [r[1] for r in replies]

    def close(self):
        for proc in self.procs:
            try:
                pickle.dump(None, proc.stdin)
                proc.stdin.close()
                proc.wait(timeout=30)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()
        self.procs, self.logs = [], []


def worker_env() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    env.pop("XLA_FLAGS", None)
    # The ranks run the eager tile functions: a torch.compile per rank would cost more than all their
    # examples (the compiled tiles are covered by the native properties in the pytest process).
    env["TORCH_CUTBCE_NO_COMPILE"] = "1"
    return env


def jax_mesh_workers() -> Workers:
    return Workers(lambda start: [["jax-mesh"]], worker_env())


def vocab_parallel_workers(tmp_dir) -> Workers:
    def commands(start):  # a fresh rendezvous file for every start: a file store is not reusable
        return [["vocab-parallel", str(r), str(Path(tmp_dir) / f"gloo-init-{start}")] for r in range(WORLD)]

    return Workers(commands, worker_env())


if __name__ == "__main__":
    main(sys.argv[1:])
