"""Dense reference for CutBCE in JAX: materializes the `[N, V]` logits (a test oracle only).

The loss, stated once for the whole project (docs/design.md, 'The math'). For position n and item v:

    z[n, v] = hidden[n] . item_weight[v] + bias[v]
    y[n, v] = 1 if v in set(targets[n]) else 0           (negative ids are padding)
    w[n, v] = weight[n] * class_weight[v]
    l[n, v] = w[n, v] * (pos_weight[v] * y * softplus(-z) + (1 - y) * softplus(z))
    row[n]  = sum_v l[n, v]

which is `BCEWithLogitsLoss(weight=w, pos_weight=pos_weight, reduction='none')` on the materialized
logits, summed over items. Reductions: 'none' -> row (shape S), 'sum' -> sum_n row[n],
'mean' -> sum_n row[n] / (N * V) (the mean over every element, as BCEWithLogitsLoss computes it).

Focal CutBCE (`focal=Focal(gamma, alpha, apply_class_balancing)`, cutbce_common/focal.py; Keras'
`BinaryFocalCrossentropy`): each element's BCE term is scaled by `(1 - p_t)^gamma`, p_t the
probability given to the element's own label. In logit space, with `u = -z` at a positive and
`u = z` elsewhere (so the plain term is softplus(u)):

    l[n, v] = w[n, v] * s[n, v] * sigmoid(u)^gamma * softplus(u),   sigmoid(u)^gamma = exp(-gamma softplus(-u))
    s[n, v] = pos_weight[v] * (alpha if balancing else 1) if y else (1 - alpha if balancing else 1)

gamma = 0 without balancing is the plain loss above.

Label smoothing (`label_smoothing=eps`, Keras' `label_smoothing` of `binary_crossentropy` and of
`BinaryFocalCrossentropy`): every element's target is `t = y (1 - eps) + eps / 2`, c = eps / 2:

    l[n, v] = w[n, v] * (pos_weight[v] if y else 1) * a * q^gamma * B
    B = t softplus(-z) + (1 - t) softplus(z)                    (BCE of the soft target)
    q = 1 - p_t = t sigmoid(-z) + (1 - t) sigmoid(z)            (gamma = 0 without focal)
    a = t alpha + (1 - t)(1 - alpha) with class balancing, else 1

so `pos_weight` scales a positive's whole term, as it does under focal.

Metrics: predicted positive iff z > 0; per position TP, FP, FN, TN counts times weight[n],
summed over positions unless reduction is 'none'.

Every other implementation in `jax_kernels` and `torch_cutbce` points here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_kernels.arguments import prepare
from cutbce_common.focal import check_focal
from cutbce_common.loss import check_label_smoothing
from jax_kernels.reduction import reduce_rows  # the tail shared with the entries: no engine in it


def multi_hot(targets: jax.Array, num_items: int, dtype=jnp.float32) -> jax.Array:
    """Turns padded ids `[N, L]` into a dense set indicator `[N, V]` (duplicates count once)."""
    valid = (targets >= 0) & (targets < num_items)
    safe_ids = jnp.where(valid, targets, 0)
    hits = jax.nn.one_hot(safe_ids, num_items, dtype=jnp.bool_) & valid[..., None]
    return jnp.any(hits, axis=-2).astype(dtype)


def dense_cut_bce(
    hidden,
    item_weight,
    targets,
    bias=None,
    *,
    weight=None,
    class_weight=None,
    pos_weight=None,
    reduction: str = "mean",
    return_metrics: bool = False,
    compute_dtype=None,
    focal=None,
    label_smoothing: float = 0.0,
):
    """The materializing reference of the module docstring's formula.

    Validates and converts its arguments as `jax_kernels.cut_bce` does (array-likes accepted;
    concrete ids >= V raise, concrete int64 ids are checked before JAX narrows them).

    Args:
      hidden: `[*S, D]` (N = prod(S) = 0 and D = 0 work). item_weight: `[V, D]`.
      targets: `[*S, L]` integer ids, negative = padding.
      bias: `[V]` or None. weight: `[*S]` or None. class_weight, pos_weight: `[V]` or None. All
        floats are cast to compute_dtype, whatever their own float dtype.
      reduction: 'none' | 'sum' | 'mean' ('mean' of N = 0 positions is nan, as torch's).
      return_metrics: also return `(tp, fp, fn, tn)`.
      compute_dtype: dtype of the logits and the loss (default: float32, or float64 for float64
        inputs). bfloat16 here reproduces "the dense reference run in the same dtype".
      focal: a `jax_kernels.Focal`: the focal loss of the module docstring, from its definition on
        the materialized logits; None: plain BCE.
      label_smoothing: eps in [0, 1]: the module docstring's smoothed target (Keras').

    Returns:
      The loss (shape S for 'none', else a scalar), and with `return_metrics` a tuple of counts.
      Gradients come back in each input's dtype.
    """
    focal = check_focal(focal)
    label_smoothing = check_label_smoothing(label_smoothing)
    size, a = prepare(hidden, item_weight, targets, bias, weight, class_weight, pos_weight,
                      reduction=reduction, block_v=None)
    hidden, item_weight, targets, bias = a["hidden"], a["item_weight"], a["targets"], a["bias"]
    weight, class_weight, pos_weight = a["weight"], a["class_weight"], a["pos_weight"]
    lead_shape, num_items = size.lead_shape, size.num_items
    if compute_dtype is None:
        compute_dtype = jnp.float64 if hidden.dtype == jnp.float64 else jnp.float32
    # Explicit sizes: reshape(-1, D) is ambiguous when N = 0 or D = 0.
    h = hidden.reshape(size.num_positions, size.hidden_size).astype(compute_dtype)
    z = h @ item_weight.astype(compute_dtype).T
    if bias is not None:
        z = z + bias.astype(compute_dtype)
    y = multi_hot(targets.reshape(size.num_positions, size.num_slots), num_items, compute_dtype)
    w = jnp.ones_like(z)
    if weight is not None:
        w = w * weight.reshape(-1, 1).astype(compute_dtype)
    if class_weight is not None:
        w = w * class_weight.astype(compute_dtype)
    pw = 1.0 if pos_weight is None else pos_weight.astype(compute_dtype)
    if focal is None and not label_smoothing:
        elementwise = w * (pw * y * jax.nn.softplus(-z) + (1 - y) * jax.nn.softplus(z))
    else:
        elementwise = w * _smoothed_focal_elements(z, y, pw, focal, label_smoothing)
    rows = elementwise.sum(-1)
    loss = reduce_rows(rows, reduction, num_items).reshape(lead_shape if reduction == "none" else ())
    if not return_metrics:
        return loss
    predicted = z > 0
    truth = y > 0
    position_weight = jnp.ones(h.shape[0], compute_dtype) if weight is None else weight.reshape(-1)
    counts = [
        (predicted & truth).sum(-1),
        (predicted & ~truth).sum(-1),
        (~predicted & truth).sum(-1),
        (~predicted & ~truth).sum(-1),
    ]
    counts = [c.astype(jnp.float32) * position_weight.astype(jnp.float32) for c in counts]
    if reduction == "none":
        counts = [c.reshape(lead_shape) for c in counts]
    else:
        counts = [c.sum() for c in counts]
    return loss, tuple(counts)


def _smoothed_focal_elements(z, y, pw, focal, label_smoothing):
    """`(pw if y else 1) a q^gamma B` of the module docstring, Keras' definition in logit space:
    softplus never overflows, and `q^gamma = exp(gamma logaddexp(log t + log sigmoid(-z),
    log(1 - t) + log sigmoid(z)))` is never a power of a rounded probability (no 0^gamma)."""
    # t and 1 - t each from its own branch (eps / 2 or 1 - eps / 2): 1 - t formed from t rounds
    # eps / 2 < 2**-53 away at a positive, the smoothed term of every confident positive with it.
    half = label_smoothing / 2
    high, low = jnp.full_like(z, 1 - half), jnp.full_like(z, half)
    t, rest = jnp.where(y > 0, high, low), jnp.where(y > 0, low, high)
    elements = t * jax.nn.softplus(-z) + rest * jax.nn.softplus(z)
    if focal is not None:
        log_q = jnp.logaddexp(jnp.log(t) + jax.nn.log_sigmoid(-z), jnp.log(rest) + jax.nn.log_sigmoid(z))
        elements = elements * jnp.exp(focal.gamma * log_q)
        if focal.apply_class_balancing:
            elements = elements * (t * focal.alpha + rest * (1 - focal.alpha))
    return elements * jnp.where(y > 0, pw, 1.0)
