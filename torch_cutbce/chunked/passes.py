"""The chunked engine's three calls, with the native loop's signatures (`torch_cutbce/native/loop.py`), so
that one set of custom ops (`torch_cutbce/chunked_ops.py`) serves it.

Per chunk of `C` items, in a fixed order: the logits `z = h @ W[chunk].T` by one library matmul
(`torch.mm`: cuBLAS on CUDA) into one reused float32 `[N, C]` buffer (the kernel adds the bias),
the chunk's positives taken out (`positives.TilePositives`: their logits kept, -inf in the chunk),
one Triton kernel that adds each row's loss and overwrites the chunk with `dz`
(`elementwise.chunk_pass`), then `d_hidden += dz @ W[chunk]` and `d_items[chunk] = dz.T @ h`, two
more library matmuls. Each positive's own terms are added once per call (O(N L)). Three products
per logit for 'sum' / 'mean'; 'none' runs the logits and the kernel in the forward and all three in
the backward (four), as the native engine.

Precision: every product accumulates in float32 and returns float32 (16-bit operands on the tensor
cores; `torch.mm(..., out_dtype=torch.float32)` on CUDA, float32 operands elsewhere, the same
exact products); `dz` is rounded to the input dtype, as the dense loss in that dtype rounds it.
`d_hidden` sums over the chunks in float32 for 16-bit inputs, and for float32 inputs in float64 with
at most `shapes.MAX_CONTRACTION` items a product (the float32 rule: docs/precision.md); rows in
float64.

The chunk's memory: `chunk_width` (`CHUNK_BYTES`, or the call's `block_v`).
"""

from __future__ import annotations

import torch

from cutbce_common.shapes import MAX_CONTRACTION
from torch_cutbce import positives
from torch_cutbce.chunked.elementwise import chunk_pass, dz_view
from torch_cutbce.reduction import weighted_count_sums
from torch_cutbce.triton import interpreter

# The logits chunk's budget: a fixed cap, not a share of free memory, so that the chunking (and with
# it the bits of d_hidden's sum) is the same on every run and every device. 512 MiB is an [N, C]
# float32 chunk of 4,096 items at N 32,768; the products stay large enough for cuBLAS's peak.
CHUNK_BYTES = 512 * 1024 * 1024
CHUNK_ALIGN = 128  # the chunk width's multiple (under the budget): 16-byte rows for every dtype


def chunk_width(block_v: int | None, num_positions: int, num_items: int, itemsize: int = 4) -> int:
    """The items per chunk: the call's `block_v`, else the most that fit `CHUNK_BYTES` in multiples of
    `CHUNK_ALIGN` (at least one multiple); at most V, at least 1."""
    if block_v is None:
        fit = CHUNK_BYTES // max(1, num_positions * itemsize)
        block_v = max(CHUNK_ALIGN, fit - fit % CHUNK_ALIGN)
    return max(1, min(block_v, num_items))


def _product(a, b):
    """`a @ b` accumulated and returned in float32."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return a @ b
    if a.device.type == "cuda":
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()  # bfloat16 / float16 products are exact in float32


def _logits_into(z, h, items):
    """`z = h @ items.T` in float32 (float32 accumulation; 16-bit operands on the tensor cores on CUDA)."""
    if h.dtype != torch.float32 and h.device.type == "cuda":
        torch.mm(h, items.T, out_dtype=torch.float32, out=z)
    else:
        torch.mm(h.float(), items.float().T, out=z)  # bfloat16 / float16 products are exact in float32


class _Chunks:
    """The chunks of one call: yields `(start, stop, z, items)`, `z` the `[N, stop - start]` float32
    logits before the bias with the positives taken out, a view of one reused buffer (the positives'
    logits go to `self.positives.logits`, the bias added, unless `keep_logits` is False)."""

    def __init__(self, h, item_weight, bias, ids, width, keep_logits=True):
        self.h, self.item_weight, self.bias, self.width, self.keep_logits = h, item_weight, bias, width, keep_logits
        self.ids = ids
        self.positives = positives.TilePositives(ids, width, torch.float32)
        self.buffer = torch.empty(h.shape[0] * width, dtype=torch.float32, device=h.device)

    def __iter__(self):
        h, n = self.h, self.h.shape[0]
        for start in range(0, self.item_weight.shape[0], self.width):
            stop = min(start + self.width, self.item_weight.shape[0])
            items = self.item_weight[start:stop]
            z = self.buffer[: n * (stop - start)].view(n, stop - start)
            _logits_into(z, h, items)
            self.positives.take_out(self.buffer, start, stop, keep_logits=self.keep_logits)
            yield start, stop, z, items

    @property
    def logits(self):
        """The positives' logits `[N, L]` float32, bias included (0 at padding)."""
        logits = self.positives.logits
        if self.bias is None:
            return logits
        return torch.where(self.ids >= 0, logits + self.bias.float()[self.ids.clamp(min=0)], 0.0)


def _setup(hidden, item_weight, targets, class_weight, options):
    interpreter.check_runs_here(hidden.device)
    ids = positives.positive_ids(targets, item_weight.shape[0], options.offset)
    width = chunk_width(options.block_v, hidden.shape[0], item_weight.shape[0])
    return ids, width, hidden.contiguous(), item_weight.to(hidden.dtype), _float32(class_weight)


def _float32(x):
    return None if x is None else x.to(torch.float32).contiguous()


def _grad_buffers(h, item_weight, bias, need):
    """`(d_hidden, d_items, d_bias)`, None where not needed: `d_hidden` in float64 for float32 inputs
    (module docstring), else float32; the others float32, written chunk by chunk."""
    need_h, need_items, need_bias = need
    f32 = dict(dtype=torch.float32, device=h.device)
    carry = torch.float64 if h.dtype == torch.float32 else torch.float32
    return (torch.zeros(h.shape, dtype=carry, device=h.device) if need_h else None,
            torch.empty(item_weight.shape, **f32) if need_items else None,
            torch.empty(item_weight.shape[0], **f32) if need_bias and bias is not None else None)


def _add_chunk_grads(dz, items, h, start, stop, d_hidden, d_items, d_bias):
    """`d_hidden += dz @ items`, `d_items[chunk] = dz.T @ h`, `d_bias[chunk] = dz.sum(0)`; float32
    inputs add `d_hidden` in products of at most `MAX_CONTRACTION` items."""
    if d_hidden is not None:
        step = MAX_CONTRACTION if d_hidden.dtype == torch.float64 else dz.shape[1]
        for first in range(0, dz.shape[1], step):
            d_hidden += _product(dz[:, first:first + step], items[first:first + step])
    if d_items is not None:
        d_items[start:stop] = _product(dz.T, h)
    if d_bias is not None:
        torch.sum(dz, 0, dtype=torch.float32, out=d_bias[start:stop])


def _positive_terms(logits, ids, class_weight, pos_weight, g, loss, h, item_weight, grads):
    """Each positive's own terms (float32): their loss `[N, L]`; with `g`, their gradients are added
    to `grads`."""
    value, dz = positives.positive_terms(logits.float(), ids, class_weight, pos_weight, g, loss)
    if g is not None:
        positives.add_positive_grads(dz, ids, h, item_weight, *grads)
    return value


def _counts(false_positives, logits, ids, num_items):
    """`[4, N]` TP / FP / FN / TN: FP the chunks' count of z > 0 (negatives only), TP the positives'."""
    tp, num_pos = positives.hits(logits, ids), positives.num_positives(ids)
    return torch.stack([tp, false_positives.float(), num_pos - tp, num_items - num_pos - false_positives.float()])


def saved_shape(hidden_shape, targets_shape, hidden_grad: bool) -> tuple:
    """The shape of what `rows_forward` hands `rows_backward`: the positives' logits `[N, L]`."""
    return tuple(targets_shape)


def _forward(h, item_weight, bias, ids, cw, width, g, grads, options):
    """The chunk loop: float64 rows `[N]`, false positives `[N]` or None, the positives' logits."""
    n = h.shape[0]
    rows = torch.zeros(n, dtype=torch.float64, device=h.device)
    false_positives = torch.zeros(n, dtype=torch.int32, device=h.device) if options.compute_metrics else None
    chunks = _Chunks(h, item_weight, bias, ids, width)
    for start, stop, z, items in chunks:
        dz = dz_view(z, h.dtype)
        chunk_rows, fp = chunk_pass(z, dz, _slice(bias, start, stop), _slice(cw, start, stop), g, options.loss,
                                    with_rows=True, with_counts=options.compute_metrics)
        rows += chunk_rows
        if fp is not None:
            false_positives += fp
        if g is not None:
            _add_chunk_grads(dz, items, h, start, stop, *grads)
    return rows, false_positives, chunks.logits


def _slice(x, start, stop):
    return None if x is None else x[start:stop]


def rows_forward(hidden, item_weight, targets, bias, class_weight, pos_weight, hidden_grad, options):
    """Per-position rows (weight 1), counts `[4, N]` (or `[0, N]`), the positives' logits `[N, L]` and
    the local positive ids `[N, L]` (what the backward needs)."""
    ids, width, h, item_weight, cw = _setup(hidden, item_weight, targets, class_weight, options)
    rows, fp, logits = _forward(h, item_weight, _float32(bias), ids, cw, width, None, None, options)
    rows += _positive_terms(logits, ids, class_weight, pos_weight, None, options.loss, h, item_weight, None).sum(-1)
    if options.compute_metrics:
        counts = _counts(fp, logits, ids, item_weight.shape[0])
    else:
        counts = torch.zeros((0, h.shape[0]), dtype=torch.float32, device=h.device)
    return rows.to(torch.float32), counts, logits, ids


def rows_backward(hidden, item_weight, ids, bias, class_weight, pos_weight, logits, g, need, options):
    """Gradients of `sum_n g[n] rows[n]`: `(d_hidden, d_items, d_bias)` in float32, None where `need`
    says no; every chunk's logits recomputed."""
    interpreter.check_runs_here(hidden.device)
    width = chunk_width(options.block_v, hidden.shape[0], item_weight.shape[0])
    h, item_weight = hidden.contiguous(), item_weight.to(hidden.dtype)
    cw, bias32 = _float32(class_weight), _float32(bias)
    g = g.to(torch.float32).contiguous()
    grads = _grad_buffers(h, item_weight, bias, need)
    if any(x is not None for x in grads):
        for start, stop, z, items in _Chunks(h, item_weight, bias, ids, width, keep_logits=False):
            dz = dz_view(z, h.dtype)
            chunk_pass(z, dz, _slice(bias32, start, stop), _slice(cw, start, stop), g, options.loss,
                       with_rows=False, with_counts=False)
            _add_chunk_grads(dz, items, h, start, stop, *grads)
        _positive_terms(logits, ids, class_weight, pos_weight, g, options.loss, h, item_weight, grads)
    return _in_float32(grads)


def _in_float32(grads):
    return tuple(None if d is None else d.to(torch.float32) for d in grads)


def loss_and_grads(hidden, item_weight, targets, bias, class_weight, pos_weight, weight, divisor, need, options):
    """The 'sum' / 'mean' loss `sum_n weight[n] rows[n] / divisor` and its gradients in one forward
    (the row gradient `weight / divisor` is known): `(loss, counts [4] or [0], rows, d_hidden,
    d_items, d_bias)`, float32, None where `need` says no."""
    ids, width, h, item_weight, cw = _setup(hidden, item_weight, targets, class_weight, options)
    n = h.shape[0]
    divisor = torch.tensor(divisor, dtype=torch.float64)  # 'mean' of N = 0 is 0 / 0 = nan, as torch
    w = None if weight is None else weight.detach().to(torch.float64)
    g = ((torch.ones(n, dtype=torch.float64, device=h.device) if w is None else w) / divisor).to(torch.float32)
    grads = _grad_buffers(h, item_weight, bias, need)
    with_grads = any(x is not None for x in grads)
    rows, fp, logits = _forward(h, item_weight, _float32(bias), ids, cw, width, g if with_grads else None, grads,
                                options)
    rows += _positive_terms(logits, ids, class_weight, pos_weight, g if with_grads else None, options.loss, h,
                            item_weight, grads).sum(-1)
    weighted = rows if w is None else rows * w
    loss = (weighted.sum() / divisor).to(torch.float32)
    if options.compute_metrics:
        counts = weighted_count_sums(_counts(fp, logits, ids, item_weight.shape[0]), weight)
    else:
        counts = torch.zeros((0,), dtype=torch.float32, device=h.device)
    return (loss, counts, rows.to(torch.float32), *_in_float32(grads))
