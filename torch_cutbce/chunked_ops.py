"""The chunked engines as torch custom ops: one graph under `torch.compile(fullgraph=True)`, no host sync.

`torch.library.custom_op` makes each engine call one opaque node: dynamo does not trace the tile
loop (the native engine's Python loop over V / block_v tiles, the Triton engine's kernel launches
and their id check), `register_fake` gives the output shapes, `register_autograd` the backward.
Checks that read the data (ids >= V) run inside the op, where a CPU tensor's values are at hand and
a CUDA one gets a device-side assert, so no check outside costs a sync. Autocast is switched off
inside: the entry has already applied autocast's rule to the inputs, and the tiles must stay in the
accumulation dtype.

`ChunkedOps(prefix, passes)` registers one engine's three ops over its `passes` module, which has
the native loop's calls (`torch_cutbce/native/loop.py`: `rows_forward`, `rows_backward`,
`loss_and_grads`) and `saved_shape`: the shape of what its rows forward hands its backward (the
positives' logits `[N, L]` in the native loop; in the Triton engine, `d_hidden` for a row gradient of
1, `[N, D]`, when hidden's gradient is wanted, so that the backward only scales it, else `[N, 0]`).
The rows op is told whether hidden's gradient is wanted (`hidden_grad`: grad mode on and
`hidden.requires_grad`, autograd's own `needs_input_grad[0]`). Every op takes its tensors plus one
`options: str`, a `CutBCEOptions.encode()` string (tile width, metrics, focal, offset, id limit):
adding an option never changes a schema. What varies per call travels beside it: which gradients
are wanted (`need: list[bool]`) and the one-pass `divisor` (a 0-d float64 tensor: as a float,
torch.compile would make N V a constant of the graph, one graph per N under dynamic shapes).

    rows(...)  -> (rows [N], counts [4, N] or [0, N])       reduction='none'; vocab-parallel ranks
    loss(...)  -> (loss [], counts [4] or [0])              'sum' / 'mean', gradients in the forward
"""

from __future__ import annotations

import torch
from torch import Tensor

from cutbce_common.options import CutBCEOptions, decode
from torch_cutbce import positives
from torch_cutbce.arguments import check_ids_below_vocab


def _no_grad_buffer(like: Tensor) -> Tensor:
    """The op's stand-in for a gradient nobody asked for (custom ops cannot return None)."""
    return like.new_empty((0,))


def _refuse_double_backward():
    # create_graph=True runs the backward with grad mode on: say so instead of failing inside mm(out=).
    if torch.is_grad_enabled():
        raise RuntimeError(
            "cut_bce_with_logits is not twice differentiable: its backward is a hand-written pass "
            "over the tiles, not a differentiable graph (backward(create_graph=True) and "
            "torch.autograd.grad(..., create_graph=True) are not supported)"
        )


def _cast(grad: Tensor, dtype: torch.dtype) -> Tensor:
    """Gradients are accumulated in float32/float64 and returned in the input's dtype."""
    return grad.to(dtype)


def _check_ids(targets: Tensor, item_weight: Tensor, options: CutBCEOptions) -> None:
    """ids >= `options.id_limit` (default: the table's V) raise (CPU) or assert (CUDA)."""
    check_ids_below_vocab(targets, item_weight.shape[0] if options.id_limit is None else options.id_limit)


def _rows_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(*output[1:])  # counts, what the backward needs, ids
    ctx.set_materialize_grads(False)
    hidden, item_weight, _, bias, class_weight, pos_weight, _, options = inputs
    ctx.save_for_backward(hidden, item_weight, output[3], bias, class_weight, pos_weight, output[2])
    ctx.options = options


def _loss_setup(ctx, inputs, output):
    # Only the loss is differentiable: otherwise autograd would materialize a zero gradient for
    # every other output, a table-sized one for d_item_weight among them.
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*output[2:], inputs[7])  # divisor: after the six tensors and weight
    hidden, item_weight, _, bias, _, _, weight = inputs[:7]
    ctx.dtypes = [None if x is None else x.dtype for x in (hidden, item_weight, bias, weight)]
    ctx.used = False


def _loss_grad(ctx, g_loss, *_):
    _refuse_double_backward()
    if ctx.used:
        raise RuntimeError(
            "cut_bce_with_logits(reduction='sum'/'mean') computes its gradients during the forward "
            "and scales them in place, so its graph can be backpropagated once; for retain_graph / "
            "several backward passes use reduction='none' and reduce the rows yourself"
        )
    ctx.used = True
    row_losses, *grads, divisor = ctx.saved_tensors
    wants = ctx.needs_input_grad
    need = (wants[0], wants[1], wants[3], wants[6])  # hidden, item_weight, bias, weight
    d_hidden, d_items, d_bias = (_cast(d.mul_(g_loss.to(d.dtype)), dtype) if n else None
                                 for d, dtype, n in zip(grads, ctx.dtypes, need))
    d_weight = None
    if need[3]:
        scale = g_loss.to(row_losses.dtype) / divisor.to(row_losses.dtype)
        d_weight = (row_losses * scale).to(ctx.dtypes[3])
    return d_hidden, d_items, None, d_bias, None, None, d_weight, None, None, None  # divisor, need, options


class ChunkedOps:
    """One engine's custom ops `torch_cutbce::<prefix>rows`, `<prefix>rows_backward`, `<prefix>loss`
    over its `passes` (module docstring), and the two calls the registry makes (`rows`, `loss`)."""

    def __init__(self, prefix: str, passes):
        self.rows_op, self.rows_backward_op = self._define_rows(prefix, passes)
        self.loss_op = self._define_loss(prefix, passes)

    @staticmethod
    def _define_rows(prefix, passes):
        @torch.library.custom_op(f"torch_cutbce::{prefix}rows", mutates_args=())
        def rows_op(hidden: Tensor, item_weight: Tensor, targets: Tensor, bias: Tensor | None,
                    class_weight: Tensor | None, pos_weight: Tensor | None, hidden_grad: bool,
                    options: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
            o = decode(options)
            _check_ids(targets, item_weight, o)
            with torch.autocast(hidden.device.type, enabled=False), torch.no_grad():
                return passes.rows_forward(hidden, item_weight, targets, bias, class_weight, pos_weight,
                                           hidden_grad, o)

        @rows_op.register_fake
        def _(hidden, item_weight, targets, bias, class_weight, pos_weight, hidden_grad, options):
            acc = positives.accumulation_dtype(hidden.dtype)
            n = hidden.shape[0]
            return (hidden.new_empty((n,), dtype=acc),
                    hidden.new_empty((4 if decode(options).compute_metrics else 0, n), dtype=torch.float32),
                    hidden.new_empty(passes.saved_shape(hidden.shape, targets.shape, hidden_grad), dtype=acc),
                    targets.new_empty(targets.shape, dtype=torch.int64))

        @torch.library.custom_op(f"torch_cutbce::{prefix}rows_backward", mutates_args=())
        def rows_backward_op(hidden: Tensor, item_weight: Tensor, ids: Tensor, bias: Tensor | None,
                             class_weight: Tensor | None, pos_weight: Tensor | None, saved: Tensor, g: Tensor,
                             need: list[bool], options: str) -> tuple[Tensor, Tensor, Tensor]:
            with torch.autocast(hidden.device.type, enabled=False), torch.no_grad():
                grads = passes.rows_backward(hidden, item_weight, ids, bias, class_weight, pos_weight, saved, g,
                                             tuple(need), decode(options))
            return tuple(_no_grad_buffer(g) if d is None else d for d in grads)

        @rows_backward_op.register_fake
        def _(hidden, item_weight, ids, bias, class_weight, pos_weight, saved, g, need, options):
            acc = positives.accumulation_dtype(hidden.dtype)
            shapes = (hidden.shape, item_weight.shape, item_weight.shape[:1])
            return tuple(g.new_empty(shape if wanted else (0,), dtype=acc) for shape, wanted in zip(shapes, need))

        def rows_grad(ctx, g_rows, _g_counts, _g_logits, _g_ids):
            _refuse_double_backward()
            if g_rows is None:  # the rows' gradient is undefined (not materialized): every input's is too
                return (None,) * 8
            hidden, item_weight, ids, bias, class_weight, pos_weight, saved = ctx.saved_tensors
            wants = ctx.needs_input_grad
            need = [wants[0], wants[1], wants[3] and bias is not None]
            grads = rows_backward_op(hidden, item_weight, ids, bias, class_weight, pos_weight, saved, g_rows, need,
                                     ctx.options)
            d_hidden, d_items, d_bias = (_cast(d, x.dtype) if n else None
                                         for d, x, n in zip(grads, (hidden, item_weight, bias), need))
            return d_hidden, d_items, None, d_bias, None, None, None, None  # targets, class/pos weight, flag, options

        rows_op.register_autograd(rows_grad, setup_context=_rows_setup)
        return rows_op, rows_backward_op

    @staticmethod
    def _define_loss(prefix, passes):
        @torch.library.custom_op(f"torch_cutbce::{prefix}loss", mutates_args=())
        def loss_op(hidden: Tensor, item_weight: Tensor, targets: Tensor, bias: Tensor | None,
                    class_weight: Tensor | None, pos_weight: Tensor | None, weight: Tensor | None, divisor: Tensor,
                    need: list[bool], options: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
            o = decode(options)
            _check_ids(targets, item_weight, o)
            with torch.autocast(hidden.device.type, enabled=False), torch.no_grad():
                out = passes.loss_and_grads(hidden, item_weight, targets, bias, class_weight, pos_weight, weight,
                                            float(divisor), tuple(need), o)
            loss, counts, row_losses = out[:3]
            return (loss, counts, row_losses, *(_no_grad_buffer(row_losses) if d is None else d for d in out[3:]))

        @loss_op.register_fake
        def _(hidden, item_weight, targets, bias, class_weight, pos_weight, weight, divisor, need, options):
            acc = positives.accumulation_dtype(hidden.dtype)
            grads = [hidden.new_empty(shape if wanted else (0,), dtype=acc) for shape, wanted in
                     zip((hidden.shape, item_weight.shape, item_weight.shape[:1]), need)]
            counts = hidden.new_empty((4 if decode(options).compute_metrics else 0,), dtype=torch.float32)
            return (hidden.new_empty((), dtype=acc), counts, hidden.new_empty(hidden.shape[:1], dtype=acc), *grads)

        loss_op.register_autograd(_loss_grad, setup_context=_loss_setup)
        return loss_op

    def rows(self, hidden, item_weight, targets, bias, class_weight, pos_weight, options: CutBCEOptions):
        """`(rows [N], counts [4, N] or [0, N])` of `passes.rows_forward` for `[N, D]` / `[N, L]` inputs."""
        hidden_grad = torch.is_grad_enabled() and hidden.requires_grad
        out = self.rows_op(hidden, item_weight, targets, bias, class_weight, pos_weight, hidden_grad, options.encode())
        return out[0], out[1]

    def loss(self, hidden, item_weight, targets, bias, class_weight, pos_weight, weight, divisor: float,
             options: CutBCEOptions):
        """`(loss [], counts [4] or [0])` of `passes.loss_and_grads` for `[N, D]` / `[N, L]` inputs: the
        weighted rows' sum over `divisor`, the gradients computed only for the inputs that require them
        while grad mode is on."""
        grad_on = torch.is_grad_enabled()
        need = [grad_on and x is not None and x.requires_grad for x in (hidden, item_weight, bias)]
        divisor = torch.scalar_tensor(divisor, dtype=torch.float64)  # exact: N V < 2**53
        out = self.loss_op(hidden, item_weight, targets, bias, class_weight, pos_weight, weight, divisor,
                           need, options.encode())
        return out[0], out[1]
