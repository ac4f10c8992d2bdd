"""The float64 oracle of the exact-as-dense rule (`parity.assert_exact_as_dense`), in numpy.

`float64_oracle` computes docs/design.md's 'The math' from its definition on the materialized logits, with
the stable softplus (never softplus(z) - z) and the gradients' dz formula, and the error scales the
rule needs. `dense_same_dtype` is torch's `binary_cross_entropy_with_logits` on the materialized
logits in the dtype under test: "the dense reference in the same dtype". Neither uses the fast paths.
"""

from __future__ import annotations

import math

import numpy as np

from parity import EPSILON, GRADS, HALF_DTYPES, METRIC_NAMES, UNDERFLOW, _collect, _torch, torch_dtype


def _softplus(z):
    """log(1 + exp(z)) = max(z, 0) + log1p(exp(-|z|)): exact to rounding for every z."""
    return np.maximum(z, 0.0) + np.log1p(np.exp(-np.abs(z)))


def _sigmoid(z):
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def multi_hot_numpy(targets, num_items) -> np.ndarray:
    """Padded ids `[*S, L]` -> boolean `[N, V]` (N = prod(S)): ids outside [0, V) are ignored."""
    ids = np.asarray(targets)
    ids = ids.reshape(math.prod(ids.shape[:-1]), ids.shape[-1])
    y = np.zeros((ids.shape[0], num_items), bool)
    rows, cols = np.nonzero((ids >= 0) & (ids < num_items))
    y[rows, ids[rows, cols]] = True
    return y


class Oracle:
    """What `float64_oracle` knows of one example: the truth and the rule's error scales.

    Attributes:
      truth: {name: float64 array} with the keys of the fast path's results: loss, d_hidden,
        d_item_weight, d_bias / d_weight (when given), tp, fp, fn, tn (with metrics).
      loss_abs: A, the float64 sum of |element losses| feeding each output of `loss` (shape of loss).
      loss_sensitivity: B, sum over those elements of |d loss / d z| * (sum_d |h E| + |b|).
      count_slack: {tp, fp, fn, tn: array}: how far a count may move, from logits within rounding of
        0 (times |weight|) and the float32 rounding of weighted counts; zero where the count is exact.
      nonnegative: where every element loss feeding `loss` is >= 0 (the fast loss must be >= 0 there).
      grad_scale: {d_<name>: array}: each gradient entry's first-order rounding scale, the sum of
        |its terms| (|dz| times |E|, |h| or 1) plus their sensitivity to rounding the logits.
      flush: {name: array}: the absolute error of underflow, UNDERFLOW of the result's dtype times
        (1 + the number / size of the terms feeding it): below the smallest normal number a value
        has too few bits for a relative bound, and XLA on CPU flushes each subnormal term to zero.
    """

    def __init__(self, truth, loss_abs, loss_sensitivity, count_slack, nonnegative, grad_scale, flush):
        self.truth, self.loss_abs, self.loss_sensitivity = truth, loss_abs, loss_sensitivity
        self.count_slack, self.nonnegative, self.grad_scale = count_slack, nonnegative, grad_scale
        self.flush = flush


def float64_oracle(inputs, *, dtype, reduction, upstream, return_metrics=True):
    """docs/design.md's 'The math' in numpy float64 on the materialized logits, with its gradients.

    `inputs`: numpy arrays hidden `[*S, D]`, item_weight `[V, D]`, targets `[*S, L]` and any of
    bias, weight, class_weight, pos_weight, holding values already rounded to `dtype` (the fast
    path sees the same numbers). For float64 inputs the logits are accumulated in long double
    (numpy's float64 matmul would err as much as the rule allows the fast path). `upstream`: the
    gradient of the loss (shape S for 'none', a scalar otherwise). The loss uses the stable
    softplus, never softplus(z) - z; the gradient dz[n, v] = g[n] w (sigmoid(z) for negatives,
    -pos_weight sigmoid(-z) for positives); d_weight[n] = g[n] * (row[n] / weight[n]).
    """
    hidden, item_weight, targets = inputs["hidden"], inputs["item_weight"], inputs["targets"]
    lead_shape = hidden.shape[:-1]
    n, (v, d) = math.prod(lead_shape), item_weight.shape
    h = np.asarray(hidden, np.float64).reshape(n, d)
    items = np.asarray(item_weight, np.float64)
    bias = np.zeros(v) if inputs.get("bias") is None else np.asarray(inputs["bias"], np.float64)
    wide = np.longdouble if dtype == "float64" else np.float64
    z = (h.astype(wide) @ items.T.astype(wide) + bias.astype(wide)).astype(np.float64)
    magnitude = np.abs(h) @ np.abs(items).T + np.abs(bias)  # the scale each logit is rounded at
    y = multi_hot_numpy(targets, v)
    ones = lambda size: np.ones(size)
    row_weight = ones(n) if inputs.get("weight") is None else np.asarray(inputs["weight"], np.float64).reshape(n)
    class_weight = ones(v) if inputs.get("class_weight") is None else np.asarray(inputs["class_weight"], np.float64)
    pos_weight = ones(v) if inputs.get("pos_weight") is None else np.asarray(inputs["pos_weight"], np.float64)
    item_loss = class_weight * np.where(y, pos_weight * _softplus(-z), _softplus(z))  # l / weight[n]
    item_slope = class_weight * np.where(y, -pos_weight * _sigmoid(-z), _sigmoid(z))  # (dl/dz) / weight[n]
    elem_loss = row_weight[:, None] * item_loss
    elem_slope = np.abs(row_weight[:, None] * item_slope) * magnitude
    per_row = [elem_loss.sum(1), np.abs(elem_loss).sum(1), elem_slope.sum(1), (elem_loss >= 0).all(1)]
    divisor = n * v if reduction == "mean" else 1
    with np.errstate(invalid="ignore", divide="ignore"):
        if reduction == "none":
            loss, loss_abs, sensitivity, nonnegative = (x.reshape(lead_shape) for x in per_row)
            g = np.asarray(upstream, np.float64).reshape(n)
        else:
            loss, loss_abs, sensitivity = (np.asarray(x.sum() / divisor) for x in per_row[:3])
            nonnegative = np.asarray(per_row[3].all())
            g = np.full(n, np.float64(upstream) / divisor)
    gw = g[:, None] * row_weight[:, None]
    dz = gw * item_slope
    # |dz| and its change when z moves by its rounding: d dz / dz = g w pw^y sigmoid(z) sigmoid(-z).
    curvature = class_weight * np.where(y, pos_weight, 1.0) * _sigmoid(z) * _sigmoid(-z)
    dz_scale = np.abs(dz) + np.abs(gw * curvature) * magnitude
    truth = {"loss": loss, "d_hidden": (dz @ items).reshape(*lead_shape, d), "d_item_weight": dz.T @ h}
    scale = {"d_hidden": (dz_scale @ np.abs(items)).reshape(*lead_shape, d), "d_item_weight": dz_scale.T @ np.abs(h)}
    if inputs.get("bias") is not None:
        truth["d_bias"], scale["d_bias"] = dz.sum(0), dz_scale.sum(0)
    if inputs.get("weight") is not None:
        truth["d_weight"] = (g * item_loss.sum(1)).reshape(lead_shape)
        row_scale = np.abs(item_loss).sum(1) + (np.abs(item_slope) * magnitude).sum(1)
        scale["d_weight"] = (np.abs(g) * row_scale).reshape(lead_shape)
    tiny, loss_tiny = UNDERFLOW[dtype], UNDERFLOW["float64" if dtype == "float64" else "float32"]
    terms = {"none": v, "sum": n * v, "mean": 1}[reduction]  # mean: n v flushed terms / (n v)
    flush = {"loss": np.full(np.shape(loss), loss_tiny * (1 + terms)),
             "d_hidden": np.broadcast_to(tiny * (1 + np.abs(items).sum(0)), truth["d_hidden"].shape),
             "d_item_weight": np.broadcast_to(tiny * (1 + np.abs(h).sum(0)), truth["d_item_weight"].shape),
             "d_bias": np.full(v, tiny * (1 + n)), "d_weight": np.full(lead_shape, tiny * (1 + v))}
    slack = {}
    if return_metrics:
        predicted = z > 0
        # A logit within rounding of 0 may fall on either side: the fast path rounds z at the
        # accumulation precision, float32 for every dtype but float64, with at most D + 1 roundings.
        acc_eps = EPSILON["float64" if dtype == "float64" else "float32"]
        unsure = (np.abs(z) <= (d + 2) * acc_eps * magnitude).sum(1)
        eps32 = EPSILON["float32"]
        for name, hit in zip(METRIC_NAMES, (predicted & y, predicted & ~y, ~predicted & y, ~predicted & ~y)):
            counts = hit.sum(1) * row_weight
            weighted = inputs.get("weight") is not None
            rounding = eps32 * np.abs(counts) if weighted else np.zeros(n)
            move = unsure * np.abs(row_weight) + rounding
            if reduction == "none":
                truth[name], slack[name] = counts.reshape(lead_shape), move.reshape(lead_shape)
            else:
                total = move.sum() + (n * eps32 * np.abs(counts).sum() if weighted else 0.0)
                truth[name], slack[name] = np.asarray(counts.sum()), np.asarray(total)
    return Oracle(truth, np.asarray(loss_abs), np.asarray(sensitivity), slack, np.asarray(nonnegative), scale, flush)


def dense_same_dtype(inputs, *, dtype, reduction, upstream):
    """torch's `binary_cross_entropy_with_logits` on the materialized logits, in `dtype`.

    The "dense reference in the same dtype" of the exact-as-dense rule: float32 / float64 inputs
    compute everything in their dtype; bfloat16 / float16 inputs are upcast to float32 before the
    matmul (logits, loss and sums in float32) and their gradients come back in the half dtype, as
    the fast paths do. Returns the loss and the gradients d_<name> of hidden, item_weight, bias and
    weight (those given) for the cotangent `upstream`, as float64 numpy arrays.
    """
    torch = _torch()
    import torch.nn.functional as F

    leaves = {k: torch.tensor(np.asarray(inputs[k], np.float64)).to(torch_dtype(dtype)).requires_grad_(True)
              for k in GRADS if inputs.get(k) is not None}
    compute = torch.float32 if dtype in HALF_DTYPES else torch_dtype(dtype)
    const = {k: torch.tensor(np.asarray(inputs[k], np.float64)).to(torch_dtype(dtype)).to(compute)
             for k in ("class_weight", "pos_weight") if inputs.get(k) is not None}
    up = {k: x.to(compute) for k, x in leaves.items()}
    logits = F.linear(up["hidden"], up["item_weight"], up.get("bias"))
    multi_hot = multi_hot_numpy(inputs["targets"], logits.shape[-1]).reshape(logits.shape)
    elementwise = F.binary_cross_entropy_with_logits(
        logits, torch.tensor(multi_hot, dtype=compute), pos_weight=const.get("pos_weight"), reduction="none")
    if "weight" in up:
        elementwise = elementwise * up["weight"].unsqueeze(-1)
    if "class_weight" in const:
        elementwise = elementwise * const["class_weight"]
    loss = {"none": lambda e: e.sum(-1), "sum": torch.sum, "mean": torch.mean}[reduction](elementwise)
    g = torch.tensor(np.asarray(upstream, np.float64), dtype=loss.dtype)
    grads = torch.autograd.grad(loss, list(leaves.values()), grad_outputs=g, allow_unused=True, materialize_grads=True)
    return _collect(loss, None, {f"d_{k}": x for k, x in zip(leaves, grads)})
