"""The examples of the property-based tests (conformance_properties.py, test_jax_mesh_properties.py,
test_torch_vocab_parallel_properties.py): a small frozen `Spec` (what hypothesis draws) and `build`.

A spec holds every structural choice (dtype, shapes, options, scales, layouts) and one numpy seed;
`build(spec)` turns it into arrays deterministically, so hypothesis prints (and shrinks) a short,
reproducible spec instead of arrays, and the subprocess workers rebuild the very same example from
it. `mutate` (Property B: one bad argument) and `corrupt` (Property C: out-of-range ids) are
deterministic too; `allowed_refusals` (Property A) says which errors a spec may meet on each engine.
numpy only: neither hypothesis, torch nor jax is imported here.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from parity import round_to_dtype

WEIGHT_KINDS = ("none", "positive", "zeros", "signed")
LAYOUTS = ("contiguous", "transposed", "strided", "expanded")  # torch only
OPTIONS = ("bias", "weight", "class_weight", "pos_weight")


@dataclasses.dataclass(frozen=True)
class Spec:
    """One example, drawn by hypothesis. Logits are ~ hidden_scale * item_scale (+ bias_scale).

    infinite: 'hidden' or 'item': one entry of hidden (or of the item table) is +-inf, where the other
    factor's column has no 0 and every weight is positive (no 0 x inf), so its row (or item) of logits
    is infinite; checked against the limit (`_properties_checks.check_limits`).
    confident: 'some' (rows 0, 2, 4, ...) or 'all' rows get one positive (the same item, maybe
    repeated) with logit +20..+100 while every other logit of theirs sits at -10..-50 (through the
    bias, or through hidden[:, 0] with item_weight[:, 0] as the level; not possible without bias
    for D < 2); padding: '-1', or 'mixed' (-1, -7, -2**31 and, for int64 ids, -2**40; a narrow
    dtype's most negative value; uint8 ids have none). layouts: torch only, ((argument, layout), ...)
    where not contiguous.
    """

    dtype: str = "float32"
    lead_shape: tuple[int, ...] = (1,)
    num_items: int = 1
    hidden_size: int = 0
    num_slots: int = 0
    reduction: str = "none"
    return_metrics: bool = False
    block_v: int | None = None
    bias: bool = False
    weight: str = "none"
    class_weight: str = "none"
    pos_weight: str = "none"
    hidden_scale: float = 1.0
    item_scale: float = 1.0
    bias_scale: float = 1.0
    confident: str = "none"
    padding: str = "-1"
    duplicates: bool = False
    id_dtype: str = "int64"
    layouts: tuple[tuple[str, str], ...] = ()
    infinite: str = "none"
    seed: int = 0


@dataclasses.dataclass
class Example:
    """`inputs`: float64 arrays holding values of `spec.dtype` (targets: `spec.id_dtype`), None-free."""

    spec: Spec
    inputs: dict
    upstream: np.ndarray

    @property
    def call_options(self) -> dict:
        s = self.spec
        return {"reduction": s.reduction, "return_metrics": s.return_metrics, "block_v": s.block_v}


@dataclasses.dataclass(frozen=True)
class AsDtype:
    """An argument handed over in `dtype` instead of the example's dtype (a bad-input case)."""

    value: np.ndarray
    dtype: str


@dataclasses.dataclass(frozen=True)
class AsList:
    """An argument handed over as a nested Python list instead of an array (a bad-input case)."""

    value: list


def round_to(x, dtype: str) -> np.ndarray:
    if dtype == "float16":
        return np.asarray(x, np.float64).astype(np.float16).astype(np.float64)
    return round_to_dtype(x, dtype)


def most_negative_ids(id_dtype: str) -> tuple[int, ...]:
    """The padding ids of 'mixed' beside -1 and -7: the dtype's most negative values (none for uint8)."""
    narrow = {"int8": (-(2**7),), "int16": (-(2**15),), "uint8": ()}
    if id_dtype in narrow:
        return narrow[id_dtype]
    return (-(2**31),) if id_dtype == "int32" else (-(2**31), -(2**40))


def build(spec: Spec) -> Example:
    rng = np.random.default_rng(spec.seed)
    n, v, d = math.prod(spec.lead_shape), spec.num_items, spec.hidden_size
    hidden = rng.normal(size=(n, d)) * spec.hidden_scale
    items = rng.normal(size=(v, d)) * spec.item_scale / math.sqrt(max(d, 1))
    bias = rng.normal(size=v) * spec.bias_scale if spec.bias else None
    targets = _targets(rng, spec, n, v)
    if spec.confident != "none":
        _make_confident(rng, hidden, items, bias, targets, every=2 if spec.confident == "some" else 1,
                        padded=spec.id_dtype != "uint8")
    inputs = {"hidden": hidden.reshape(*spec.lead_shape, d), "item_weight": items,
              "targets": targets.reshape(*spec.lead_shape, spec.num_slots), "bias": bias}
    inputs["weight"] = _weights(rng, spec.weight, n, (0.5, 1.5))
    inputs["class_weight"] = _weights(rng, spec.class_weight, v, (0.5, 2.0))
    inputs["pos_weight"] = _weights(rng, spec.pos_weight, v, (0.5, 3.0))
    if inputs["weight"] is not None:
        inputs["weight"] = inputs["weight"].reshape(spec.lead_shape)
    if spec.infinite != "none" and all(kind in ("none", "positive") for kind in (spec.weight, spec.class_weight,
                                                                               spec.pos_weight)):
        _make_infinite(rng, hidden if spec.infinite == "hidden" else items, items if spec.infinite == "hidden" else hidden)
    inputs = {k: x for k, x in inputs.items() if x is not None}
    for name, layout in spec.layouts:
        if layout == "expanded" and name in inputs and inputs[name].ndim and inputs[name].shape[0]:
            inputs[name] = np.broadcast_to(inputs[name][:1], inputs[name].shape).copy()
    inputs = {k: (x.astype(spec.id_dtype) if k == "targets" else round_to(x, spec.dtype)) for k, x in inputs.items()}
    if spec.reduction == "none":
        upstream = rng.normal(size=spec.lead_shape)
    else:
        upstream = np.asarray(rng.uniform(0.25, 4.0) * rng.choice((-1.0, 1.0)))
    return Example(spec, inputs, round_to(upstream, "float64" if spec.dtype == "float64" else "float32"))


def _targets(rng, spec, n, v):
    pads = (-1,) if spec.padding == "-1" else (-1, -7, *most_negative_ids(spec.id_dtype))
    pool = rng.integers(0, v, size=min(v, 3))  # few distinct ids: duplicates within a row
    targets = np.empty((n, spec.num_slots), np.int64)
    for row in range(n):
        # uint8 ids hold no padding: every slot is an id (duplicates count once)
        k = spec.num_slots if spec.id_dtype == "uint8" else int(rng.integers(0, spec.num_slots + 1))
        ids = rng.choice(pool, k) if spec.duplicates else rng.integers(0, v, k)
        padding = rng.choice(np.asarray(pads, np.int64), spec.num_slots - k)
        targets[row] = rng.permutation(np.concatenate([ids, padding]))
    return targets


def _make_confident(rng, hidden, items, bias, targets, every, padded=True):
    """Rows 0, every, 2 every, ...: item p at +20..+100, every other item at -10..-50 (see Spec). In
    place; without `padded` (uint8 ids) p fills the rows' slots."""
    n, slots = targets.shape
    (v, d), rows = items.shape, np.arange(0, n, every)
    if not rows.size or not slots or (bias is None and d < 2):
        return
    p = int(rng.integers(0, v))
    alpha, beta = rng.uniform(20, 100, size=rows.size), rng.uniform(10, 50, size=v)
    targets[rows] = -1 if padded else p
    targets[rows, 0] = p
    if slots > 1:
        targets[rows, -1] = p  # a duplicate
    if bias is not None:
        bias[:] = -beta
        spike = slice(0, d)
    else:
        items[:, 0], hidden[rows, 0] = beta, -1.0  # the level through the first coordinate
        spike = slice(1, d)
    if spike.stop - spike.start == 0:  # D = 0: the bias alone carries the positive
        bias[p] = alpha.max()
        return
    e = items[:, spike]
    e /= np.maximum(1.0, np.linalg.norm(e, axis=1, keepdims=True))
    # |e[p]| = K: h = (alpha + beta_p) e[p] / K^2 gives z[n, p] = alpha and moves others by <= 0.5.
    size, norm = 2 * (alpha.max() + beta[p]), np.linalg.norm(e[p])
    e[p] = (e[p] / norm if norm > 0 else np.eye(e.shape[1])[0]) * size
    hidden[rows, spike] = (alpha + beta[p])[:, None] * e[p] / size**2


def _make_infinite(rng, where, other):
    """One entry of `where` becomes +-inf, in a column where `other` has no 0 (its logits are then
    all infinite, none NaN); nothing where there is no such column. In place."""
    columns = np.flatnonzero((other != 0).all(axis=0)) if other.shape[0] else np.arange(other.shape[1])
    if not where.shape[0] or not columns.size:
        return
    row, column = int(rng.integers(0, where.shape[0])), int(rng.choice(columns))
    where[row, column] = rng.choice((-np.inf, np.inf))


def _weights(rng, kind, size, positive_range):
    if kind == "none":
        return None
    if kind == "signed":
        w = rng.normal(size=size)
    else:
        w = rng.uniform(*positive_range, size=size)
    if kind in ("zeros", "signed"):
        w[rng.random(size) < 0.3] = 0.0
    return w


# -- Property A: what the rules refuse of a whole spec ---------------------------------------------

KERNEL_DTYPES = ("float32", "bfloat16")  # docs/precision.md, 'What each bad input gets': impl='pallas' takes these
KERNEL_ENGINES = ("jax-pallas", "xla-pallas")  # the engines that run the Pallas kernels (impl='pallas')


@dataclasses.dataclass(frozen=True)
class Refusal:
    """An error the documented rules raise for a spec: its exact type and the argument it names."""

    error: type
    argument: str

    def __str__(self) -> str:
        return f"{self.error.__name__} naming {self.argument}"


def allowed_refusals(spec: Spec, engine: str) -> frozenset:
    """The `Refusal`s docs/precision.md's bad-input table allows for `spec` on `engine` (a name of
    `conformance_engines.ENGINES`, or 'jax-mesh', 'torch-vocab-parallel'); empty: the example must
    reach the oracle. More than one when a spec breaks several rules (the first check raises).

    Everything else a spec can draw is valid: N = 0, D = 0, L = 0, any float dtype of the engine,
    ids of any accepted integer dtype that holds them, negative padding ids of any size, signed or
    zero weights, any layout.
    """
    refusals = set()
    if spec.block_v is not None and spec.block_v < 1:
        refusals.add(Refusal(ValueError, "block_v"))
    if engine in KERNEL_ENGINES and spec.dtype not in KERNEL_DTYPES:
        refusals.add(Refusal(TypeError, "impl"))
    return frozenset(refusals)


# -- Property B: one bad argument ------------------------------------------------------------------

MUTATIONS = (
    "id_at_V", "id_far_above", "hidden_rank0", "item_weight_rank1", "item_weight_rank3", "no_items",
    "targets_missing_L", "targets_lead_mismatch", "D_mismatch", "float_targets", "bool_targets",
    "int_hidden", "int_item_weight", "int_weight", "int_bias", "int_class_weight",
    "int_pos_weight", "bad_weight_shape", "bad_bias_shape", "bad_class_weight_shape", "bad_pos_weight_shape",
    "block_v_zero", "block_v_negative", "block_v_true", "block_v_false", "block_v_float",
    "unknown_reduction", "list_item_weight",
)
ID_MUTATIONS = ("id_at_V", "id_far_above")  # checkable on CPU tensors and concrete arrays only


def mutate(inputs: dict, options: dict, mutation: str, spec: Spec, num_items: int):
    """`(inputs, options, names)`: the arguments with `mutation` applied, and the argument names an
    error message may name. `num_items` is the (global) V the ids are checked against."""
    inputs, options = dict(inputs), dict(options)
    lead = spec.lead_shape
    if mutation in ID_MUTATIONS:
        far = 2**31 + 5 if spec.id_dtype == "int64" else 2**31 - 1
        bad = num_items if mutation == "id_at_V" else max(far, num_items)
        targets = np.array(inputs["targets"], copy=True)
        if targets.size == 0:
            targets = np.full((*lead, 1), bad, targets.dtype)
        targets.reshape(-1)[-1] = bad
        inputs["targets"] = targets
        return inputs, options, ("targets",)
    if mutation.startswith("block_v_") or mutation == "unknown_reduction":
        value = {"block_v_zero": 0, "block_v_negative": -3, "block_v_true": True, "block_v_false": False,
                 "block_v_float": 2.5, "unknown_reduction": "avg"}[mutation]
        key = "reduction" if mutation == "unknown_reduction" else "block_v"
        options[key] = value
        return inputs, options, (key,)
    h, e, t = inputs["hidden"], inputs["item_weight"], inputs["targets"]
    table = {
        "hidden_rank0": ("hidden", np.asarray(0.5)),
        "item_weight_rank1": ("item_weight", e[:, 0] if e.shape[1] else np.zeros(e.shape[0])),
        "item_weight_rank3": ("item_weight", e[..., None]),
        "no_items": ("item_weight", e[:0]),
        "targets_missing_L": ("targets", t[..., 0] if t.shape[-1] else np.zeros(lead, t.dtype)),
        "targets_lead_mismatch": ("targets", np.concatenate([t, np.full((1,) + t.shape[1:], -1, t.dtype)])),
        "D_mismatch": ("item_weight", np.concatenate([e, e[:, :1] if e.shape[1] else np.ones((e.shape[0], 1))], 1)),
        "float_targets": ("targets", AsDtype(t, "float32")),
        "bool_targets": ("targets", AsDtype(t >= 0, "bool")),
        "int_hidden": ("hidden", AsDtype(h, "int32")),
        "int_item_weight": ("item_weight", AsDtype(e, "int32")),
        "list_item_weight": ("item_weight", AsList(e.tolist())),
    }
    for opt in OPTIONS:
        size = lead if opt == "weight" else (e.shape[0],)
        current = inputs.get(opt, np.ones(size))
        table[f"int_{opt}"] = (opt, AsDtype(current, "int32"))
        wrong = np.ones((*lead, 1)) if opt == "weight" else np.ones(e.shape[0] + 1)
        table[f"bad_{opt}_shape"] = (opt, wrong)
    name, value = table[mutation]
    inputs[name] = value
    names = ("hidden", "item_weight") if mutation == "D_mismatch" else (name,)
    return inputs, options, names


# -- Property C: out-of-range ids ------------------------------------------------------------------


def corrupt(targets: np.ndarray, bad_ids: tuple[int, ...], seed: int):
    """`(bad, clean)`: targets with some slots set to the `bad_ids` (cycled), and the same slots -1."""
    bad, clean = np.array(targets, copy=True), np.array(targets, copy=True)
    if not bad.size or not bad_ids:
        return bad, clean
    rng = np.random.default_rng(seed)
    slots = rng.choice(bad.size, size=min(bad.size, len(bad_ids)), replace=False)
    bad.reshape(-1)[slots] = np.asarray(bad_ids[: slots.size], np.int64).astype(bad.dtype)
    clean.reshape(-1)[slots] = -1
    return bad, clean
