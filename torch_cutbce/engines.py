"""The torch engine registry, the one place that knows the engines: backend name -> `Engine`, each
saying what it supports, and the rules that read those fields.

`cut_bce_with_logits` checks its arguments, resolves its backend here (`resolve_backend`: 'auto'
picks by the tensors' device type from each engine's `auto_on`), checks `mesh=` / `vocab_parallel=`
(`check_parallel_options`: `takes_mesh`, `takes_vocab_parallel`) and the devices (`check_devices`:
`on_xla`), builds one `CutBCEOptions`, looks its engine up (`select`) and calls it once: `rows` for
reduction='none' (and N = 0), `weighted_sum` for 'sum' / 'mean', whose gradients every engine but
the dense one computes during the forward. The entry applies the position weight to the rows and
reduces them (`reduction.reduce_rows`). `BACKENDS`, what `backend=` accepts, is 'auto' and the
registry's names.

    native          the chunked custom ops (native/ops.py), CPU / CUDA; 'auto' on any device type
                    no other engine claims; takes vocab_parallel=
    dense           the materializing reference (torch_cutbce.reference), any device
    triton          fused Triton kernels (triton/, imported on first use): CUDA, or CPU tensors in
                    Triton's interpreter; 'auto' on CUDA for bfloat16 / float16 when triton imports
                    (float32 runs native: the cost model, triton/cost_model.py, predicts it faster;
                    not measured); takes vocab_parallel=
    chunked         library matmuls (cuBLAS) around one fused Triton elementwise kernel per chunk of
                    items (chunked/, imported on first use): CUDA, or CPU tensors in Triton's
                    interpreter; takes vocab_parallel=
    xla, xla_blocked, xla_pallas
                    the torch_xla bridge (jax_bridge/xla.py, imported on first use): the JAX engine
                    `impl` ('auto': Pallas on a TPU), on one device or under an SPMD mesh; 'xla' is
                    'auto' on XLA tensors
    torch_tpu       the TorchTPU bridge (jax_bridge/tpu.py, imported on first use): the same JAX
                    engines through `torch.tpu.pallas.jax_op`, `tpu` tensors (or `meta`, shapes
                    only); 'auto' on `tpu` tensors

`vocab_parallel=` is a layout over an engine, not an engine: `select` returns the engine chosen for
the tensors wrapped by `over_ranks` (torch_cutbce/vocab_parallel.py), for engines that take it.

Every engine takes `flat = (hidden [N, D], item_weight [V, D], targets [N, L], bias, class_weight,
pos_weight)` (the one argument order, the entry's) and the call's `route.Route` (its options, and
this rank's `VocabParallelOptions` under vocab_parallel=): `rows(flat, route) -> (rows [N], counts
[4 or 0, N])` and `weighted_sum(flat, weight [N] or None, divisor, route) -> (sum_n weight[n]
rows[n] / divisor, counts [4 or 0] weighted and summed)`.

A new engine is one `Engine(...)` in `ENGINES` (its calls importing its module on first use, as the
bridges' do, where that module needs an optional package); nothing outside this module names it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings
from typing import Callable

import torch

from cutbce_common.shapes import AxisName, check_mesh_axes
from torch_cutbce import vocab_parallel as vocab_parallel_layout
from torch_cutbce.arguments import check_ids_below_vocab
from torch_cutbce.native import ops
from torch_cutbce.positives import accumulation_dtype
from torch_cutbce.reduction import weighted_count_sums
from torch_cutbce.reference import dense_bce_with_logits
from torch_cutbce.route import VocabParallelOptions

ANY_DEVICE = "*"  # in `Engine.auto_on`: 'auto' picks the engine for a device type no engine names


def always() -> bool:
    """`Engine.available` of an engine that needs no optional package."""
    return True


@dataclasses.dataclass(frozen=True)
class Engine:
    """One way to compute the rows and the one-pass loss.

    Attributes:
      name: the `backend=` that selects it.
      rows, weighted_sum: the two calls (module docstring).
      on_xla: True: XLA tensors only; False: CPU / CUDA tensors only; None: any device (the engine
        checks its own, as torch_tpu does).
      impl: the JAX engine behind the torch_xla bridge ('auto', 'blocked', 'pallas'), else 'auto'.
      takes_mesh: runs under a torch_xla SPMD mesh (`mesh=`).
      takes_vocab_parallel: runs on one rank's slice of the table under `vocab_parallel=`
        (`over_ranks`): it reads `options.offset` / `options.id_limit`, keeps the ids in
        `[offset, offset + V)` of its slice as positives, treats the others as padding and refuses
        ids >= `id_limit` (the global V) as it refuses ids >= V.
      drops_padded_positions: eager calls may drop positions of weight 0 without a valid target
        before the tiles (`functional._padded_positions_dropped`).
      auto_on: the device types (`tensor.device.type`) for which backend='auto' picks it;
        `ANY_DEVICE` for any type no engine names (`resolve_backend`).
      available: whether it can run in this process (an optional package imports); asked only by
        backend='auto', inside the traced entry under torch.compile, so it must be cheap and
        traceable. An engine named explicitly runs regardless (and fails on its own import).
      dtypes: the `hidden` dtypes it computes in (None: any); 'auto' passes over it for others,
        and naming it for another is refused (`check_devices`).
      auto_dtypes: the dtypes 'auto' picks it for (None: every one of `dtypes`).
    """

    name: str
    rows: Callable
    weighted_sum: Callable
    on_xla: bool | None = False
    impl: str = "auto"
    takes_mesh: bool = False
    takes_vocab_parallel: bool = False
    drops_padded_positions: bool = False
    auto_on: tuple[str, ...] = ()
    available: Callable[[], bool] = always
    dtypes: tuple[torch.dtype, ...] | None = None
    auto_dtypes: tuple[torch.dtype, ...] | None = None

    def takes_dtype(self, dtype: torch.dtype) -> bool:
        return self.dtypes is None or dtype in self.dtypes

    def auto_takes_dtype(self, dtype: torch.dtype) -> bool:
        return self.takes_dtype(dtype) and (self.auto_dtypes is None or dtype in self.auto_dtypes)


def _native_rows(flat, route):
    return ops.rows(*flat, route.options)


def _native_weighted_sum(flat, weight, divisor, route):
    return ops.loss(*flat, weight, divisor, route.options)


def _dense(flat, weight, options, reduction):
    hidden, item_weight, targets, bias, class_weight, pos_weight = flat
    check_ids_below_vocab(targets, item_weight.shape[0])
    return dense_bce_with_logits(hidden, item_weight, targets, bias, weight=weight, class_weight=class_weight,
                                 pos_weight=pos_weight, reduction=reduction, return_metrics=True,
                                 **options.loss.arguments())


def _dense_rows(flat, route):
    options = route.options
    rows, metrics = _dense(flat, None, options, "none")
    counts = torch.stack(tuple(metrics)) if options.compute_metrics else rows.new_zeros((0, rows.shape[0]))
    return rows, counts.float()


def _dense_weighted_sum(flat, weight, divisor, route):
    options = route.options
    loss, metrics = _dense(flat, weight, options, "sum")
    counts = torch.stack(tuple(metrics)) if options.compute_metrics else loss.new_zeros((0,))
    return loss / divisor, counts.float()


def _bridge(module: str):
    """The JAX bridge `torch_cutbce.jax_bridge.<module>`, imported on first use: the only modules that
    import jax (and torch_xla / torch_tpu). Import statements, not importlib: dynamo traces them
    (fullgraph)."""
    if module == "xla":
        from torch_cutbce.jax_bridge import xla as bridge
    else:
        from torch_cutbce.jax_bridge import tpu as bridge
    return bridge


def _bridge_engine(name: str, module: str, impl: str, **fields) -> Engine:
    """An engine of the JAX bridge `torch_cutbce.jax_bridge.<module>` (xla or tpu)."""

    def rows(flat, route):
        return _bridge(module).cut_bce_rows(*flat, route.options)

    def weighted_sum(flat, weight, divisor, route):
        hidden = flat[0]
        n, acc = hidden.shape[0], accumulation_dtype(hidden.dtype)
        w = torch.ones(n, dtype=acc, device=hidden.device) if weight is None else weight.to(acc)
        loss, counts = _bridge(module).cut_bce_weighted_sum(*flat, w / divisor, route.options)
        return loss, weighted_count_sums(counts, weight)

    return Engine(name, rows, weighted_sum, impl=impl, **fields)


def _triton_ops():
    """`torch_cutbce.triton.ops`, imported on first use: it imports triton."""
    from torch_cutbce.triton import ops as triton_ops

    return triton_ops


def _triton_rows(flat, route):
    return _triton_ops().rows(*flat, route.options)


def _triton_weighted_sum(flat, weight, divisor, route):
    return _triton_ops().loss(*flat, weight, divisor, route.options)


def _chunked_ops():
    """`torch_cutbce.chunked.ops`, imported on first use: it imports triton."""
    from torch_cutbce.chunked import ops as chunked_ops

    return chunked_ops


def _chunked_rows(flat, route):
    return _chunked_ops().rows(*flat, route.options)


def _chunked_weighted_sum(flat, weight, divisor, route):
    return _chunked_ops().loss(*flat, weight, divisor, route.options)


@torch.compiler.assume_constant_result  # a constant of the process: dynamo need not trace importlib
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


# Registry order is `BACKENDS`' order and 'auto''s priority among engines naming one device type.
ENGINES = {
    "native": Engine("native", _native_rows, _native_weighted_sum, takes_vocab_parallel=True,
                     drops_padded_positions=True, auto_on=(ANY_DEVICE,)),
    "dense": Engine("dense", _dense_rows, _dense_weighted_sum, on_xla=None),
    # Fused Triton kernels (torch_cutbce/triton/): 'auto' on CUDA for 16-bit inputs; CPU tensors run in
    # Triton's interpreter (TRITON_INTERPRET=1 before triton is imported). 'auto' follows the cost
    # model (triton/cost_model.py: a model, no GPU has measured either engine): float32 products run on
    # the FP32 pipe in both engines, and the model puts the native one's three ahead of the kernels'
    # four; 16-bit ones it puts far ahead on the tensor cores.
    "triton": Engine("triton", _triton_rows, _triton_weighted_sum, takes_vocab_parallel=True,
                     drops_padded_positions=True, auto_on=("cuda",), available=_triton_installed,
                     dtypes=(torch.float32, torch.bfloat16, torch.float16),
                     auto_dtypes=(torch.bfloat16, torch.float16)),
    # Library matmuls around one Triton elementwise kernel per chunk of items (torch_cutbce/chunked/);
    # CPU tensors run the kernel in Triton's interpreter, as the Triton engine's.
    "chunked": Engine("chunked", _chunked_rows, _chunked_weighted_sum, takes_vocab_parallel=True,
                      drops_padded_positions=True, available=_triton_installed,
                      dtypes=(torch.float32, torch.bfloat16, torch.float16)),
    **{name: _bridge_engine(name, "xla", impl, on_xla=True, takes_mesh=True, auto_on=auto_on)
       for name, impl, auto_on in (("xla", "auto", ("xla",)), ("xla_blocked", "blocked", ()),
                                   ("xla_pallas", "pallas", ()))},
    # on_xla=None: the TorchTPU bridge checks its own devices ('tpu', or 'meta' for shapes only).
    "torch_tpu": _bridge_engine("torch_tpu", "tpu", "auto", on_xla=None, auto_on=("tpu",)),
}

BACKENDS = ("auto", *ENGINES)


def over_ranks(engine: Engine) -> Engine:
    """`engine` as the vocabulary-parallel layout runs it (`torch_cutbce.vocab_parallel`): on this
    rank's slice of the table, with `route.options.offset` / `id_limit` set by the entry, the rows
    (or the one-pass loss) and counts summed over the ranks. Positions are not dropped (the ranks'
    rows are summed position by position)."""

    def rows(flat, route):
        return vocab_parallel_layout.vocab_parallel_rows(engine, flat, route)

    def weighted_sum(flat, weight, divisor, route):
        return vocab_parallel_layout.vocab_parallel_loss(engine, flat, weight, divisor, route)

    return dataclasses.replace(engine, rows=rows, weighted_sum=weighted_sum, drops_padded_positions=False)


# Built once, not per call: the entry's lookup stays a dict read under torch.compile.
_OVER_RANKS = {name: over_ranks(engine) for name, engine in ENGINES.items() if engine.takes_vocab_parallel}


def _named(which: Callable[[Engine], bool]) -> str:
    """The backends whose engine `which` accepts, for a message: `backend='auto' or 'a' / 'b'`."""
    return "backend='auto' or " + " / ".join(repr(name) for name, engine in ENGINES.items() if which(engine))


def check_backend(backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def resolve_backend(backend: str, hidden: torch.Tensor) -> str:
    """`backend`, checked; 'auto' becomes the engine for `hidden`'s device type: the first engine in
    registry order whose `auto_on` names the type, that 'auto' picks for `hidden`'s dtype (the
    matmul's, after promotion or autocast: `auto_dtypes`) and that is `available()`, else the first (and
    available) one that takes `ANY_DEVICE`."""
    check_backend(backend)
    if backend != "auto":
        return backend
    device_type = hidden.device.type
    for wanted in (device_type, ANY_DEVICE):
        for name, engine in ENGINES.items():
            if wanted in engine.auto_on and engine.auto_takes_dtype(hidden.dtype):
                if engine.available():
                    return name
                _say_unavailable(name, device_type)
    raise ValueError(f"backend='auto' finds no engine for tensors on {hidden.device}; name one of {BACKENDS[1:]}")


_said_unavailable: set[str] = set()


def _say_unavailable(name: str, device_type: str) -> None:
    """Once per process (eagerly): 'auto' passes over the engine made for these tensors."""
    if name not in _said_unavailable and not torch.compiler.is_compiling():
        _said_unavailable.add(name)
        warnings.warn(f"backend='auto' passes over {name!r} for {device_type} tensors: it cannot run in this "
                      f"process (its package is not installed); the next engine in the registry runs instead "
                      f"(torch_cutbce.resolved_backend says which)", stacklevel=4)


def resolved_backend(hidden: torch.Tensor, backend: str = "auto") -> str:
    """The engine `cut_bce_with_logits(hidden, ..., backend=backend)` runs when the item table has
    hidden's dtype (the entry decides on the dtype the logits' matmul sees; without vocab_parallel= or
    DTensors, whose local tensors decide the same way): for a user or a log line."""
    return resolve_backend(backend, hidden)


def check_parallel_options(backend: str, mesh, vocab_parallel, vocab_axis: AxisName = None,
                           data_axis: AxisName = None) -> None:
    """`mesh=` needs an engine that `takes_mesh` (the torch_xla bridge) and a mesh whose axes
    `vocab_axis` / `data_axis` name, `vocab_parallel=` a `VocabParallelOptions` and an engine that
    `takes_vocab_parallel`, and they exclude each other; 'auto' passes (the tensors decide). The
    module checks this when built, the function on the resolved backend: one rule, one message."""
    if vocab_parallel is not None:
        if not isinstance(vocab_parallel, VocabParallelOptions):
            raise TypeError(
                f"vocab_parallel must be a VocabParallelOptions or None, got {type(vocab_parallel).__name__}")
    if mesh is not None and vocab_parallel is not None:
        raise ValueError("mesh= (torch_xla SPMD) and vocab_parallel= (torch.distributed ranks) exclude each other")
    engine = ENGINES.get(backend)  # None: 'auto'
    if mesh is not None and engine is not None and not engine.takes_mesh:
        raise ValueError(
            f"mesh= runs under torch_xla SPMD and needs XLA tensors, got backend={backend!r}; "
            f"for CPU/CUDA tensors split over processes use vocab_parallel="
        )
    if vocab_parallel is not None and engine is not None and not engine.takes_vocab_parallel:
        raise ValueError(f"vocab_parallel= needs an engine that takes a slice of the table "
                         f"({_named(lambda e: e.takes_vocab_parallel)}), got backend={backend!r}")
    if mesh is not None:
        if not hasattr(mesh, "axis_names"):
            raise TypeError(f"mesh must be a torch_xla.distributed.spmd.Mesh, got {type(mesh).__name__}")
        check_mesh_axes(mesh.axis_names, vocab_axis, data_axis)


def check_devices(tensors: dict[str, torch.Tensor | None], backend: str, engine: Engine) -> None:
    """One device for every tensor, the one the engine runs on (`Engine.on_xla`: True XLA
    tensors only, False CPU/CUDA only, None any), and a hidden dtype it computes in (`Engine.dtypes`)."""
    device = tensors["hidden"].device
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(
                f"{name} is on {t.device} but hidden is on {device}: all tensors must be on one device "
                f"(move them with .to(hidden.device))"
            )
    is_xla = device.type == "xla"
    if engine.on_xla is True and not is_xla:
        raise ValueError(f"backend={backend!r} needs tensors on an XLA device (torch_xla), got {device}")
    if engine.on_xla is False and is_xla:
        raise ValueError(f"backend={backend!r} runs on CPU/CUDA tensors; XLA tensors use "
                         f"{_named(lambda e: 'xla' in e.auto_on)}")
    hidden = tensors["hidden"]
    if not engine.takes_dtype(hidden.dtype):
        names = ", ".join(str(d).removeprefix("torch.") for d in engine.dtypes)
        raise ValueError(f"backend={backend!r} computes in {names}, got hidden.dtype={hidden.dtype}; "
                         f"backend='native' takes any float dtype")


def select(backend: str, vocab_parallel) -> Engine:
    """The engine of a resolved `backend` (not 'auto': `resolve_backend`), or, when `vocab_parallel`
    is given, that engine under the vocabulary-parallel layout (`over_ranks`; `check_parallel_options`
    allows it only for an engine that `takes_vocab_parallel`)."""
    return ENGINES[backend] if vocab_parallel is None else _OVER_RANKS[backend]
