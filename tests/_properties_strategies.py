"""What the property-based tests draw: hypothesis strategies of `_properties_examples.Spec`s, the
explicit examples every exactness run starts with, and the per-run settings (`budget`).

Shared by the conformance family (`conformance_properties.py`, the in-process engines) and the
sharded engines' files (`test_jax_mesh_properties.py`, `test_torch_vocab_parallel_properties.py`).
"""

from __future__ import annotations

import dataclasses
import math

from hypothesis import HealthCheck, Phase, assume, settings
from hypothesis import strategies as st

from _properties_examples import LAYOUTS, MUTATIONS, WEIGHT_KINDS, Spec

TORCH_DTYPES = ("float32", "float64", "bfloat16", "float16")
JAX_DTYPES = ("float32", "float64", "bfloat16")
IGNORED_IDS_DTYPES = ("float32", "bfloat16")  # Property C's: the dtypes users train in
# The narrow id dtypes Property A also draws, each where V fits (ids < V <= its bound): every engine
# must give int64's results (issue 46: uint8 padding ids wrapped to item 255).
NARROW_IDS = {"int8": 2**7, "uint8": 2**8, "int16": 2**15}
SHRINK_EVERYWHERE = False  # set True locally for minimal examples from the compiling paths (slow)
JAX_MUTATIONS = tuple(m for m in MUTATIONS if m != "list_item_weight")  # JAX takes array-likes (docs/precision.md)

# Every exactness run starts with CONFIDENT: rows whose positive has logit +20..+100 and whose other
# logits sit at -10..-50 (their loss is a sum of tiny terms; float32 as users run).
CONFIDENT = Spec(dtype="float32", lead_shape=(2, 3), num_items=300, hidden_size=8, num_slots=2,
                 reduction="none", return_metrics=True, bias=True, confident="all", seed=1)
# WIDE: two rows of 2**22 equal logits (one item row, expanded), the worst case of a running float32
# sum, in one tile (default block_v); the native and jitted blocked JAX runs start with it.
WIDE = Spec(dtype="float32", lead_shape=(2,), num_items=2**22, hidden_size=1, num_slots=1, reduction="none",
            layouts=(("item_weight", "expanded"),), hidden_scale=2.0, seed=3)
# WIDE_RANDOM: an ordinary random table at V = 2**22, N 3, D 2, one tile: each d_hidden entry one
# float32 product over millions of items, 3.7e-4 off on an AVX-512 Xeon where dense had 5e-7
# (issue 39); every engine but the interpreted Pallas kernels starts with it (their 4096-tile
# case: test_neutral_cpu_tile_row_sums.py).
WIDE_RANDOM = Spec(dtype="float32", lead_shape=(3,), num_items=2**22, hidden_size=2, num_slots=2, reduction="none",
                   hidden_scale=2.0, seed=7)
# REFUSED: what every engine must refuse (ValueError naming block_v) before any compute.
REFUSED = dataclasses.replace(CONFIDENT, block_v=0)
# By name, for the runs' `examples`; 'confident-float64' is a dtype the Pallas kernels refuse.
EXAMPLES = {"confident": CONFIDENT, "wide": WIDE, "wide-random": WIDE_RANDOM, "refused": REFUSED,
            "confident-float64": dataclasses.replace(CONFIDENT, dtype="float64")}
# Property C's explicit ids beside V itself: the id dtype's extremes (int64's 2**32 and -2**40 wrap
# to 0 in int32).
BAD_IDS = {"int32": (2**31 - 1, -(2**31)), "int64": (2**32, -(2**40))}


def explicit(name: str, ids: str) -> Spec:
    """`EXAMPLES[name]` with the ids a run of `ids` (see `specs`) draws: int32 under jit with x64 off."""
    spec = EXAMPLES[name]
    if ids == "jit" and spec.dtype != "float64":
        return dataclasses.replace(spec, id_dtype="int32")
    return spec


def bad_ids_example(name: str, id_dtype: str) -> tuple[Spec, tuple[int, ...]]:
    """Property C's explicit `(spec, ids)`: `EXAMPLES[name]` with ids of `id_dtype`, V and `BAD_IDS`."""
    spec = dataclasses.replace(EXAMPLES[name], id_dtype=id_dtype)
    return spec, (spec.num_items, *BAD_IDS[id_dtype])


def budget(max_examples, shrink=True):
    """Per-run settings: deterministic, no deadline (first calls compile), every distinct bug reported.

    shrink=False for the runs where every new shape compiles (eager JAX, the bridge, the
    subprocesses): shrinking there takes several minutes per failure, so those failures print the
    example as found (still reproducible: derandomized). SHRINK_EVERYWHERE = True shrinks them too.
    """
    phases = tuple(Phase) if shrink or SHRINK_EVERYWHERE else (Phase.explicit, Phase.reuse, Phase.generate)
    return settings(max_examples=max_examples, deadline=None, derandomize=True,
                    phases=phases, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                          HealthCheck.filter_too_much, HealthCheck.large_base_example])


@st.composite
def specs(draw, *, dtypes, max_n=64, max_v=5000, max_d=32, min_v=1, ids="int64", layouts=False, refusable=False,
          narrow_ids=False, infinities=False):
    """A `Spec`. ids: 'int64', 'int32', 'jit' (int32 with x64 off, int64 for float64) or 'any'.
    refusable: now and then (about 1 in 16) a block_v < 1, which every engine must refuse (Property A).
    narrow_ids: about a third of the time ids of a `NARROW_IDS` dtype that holds every id < V instead.
    infinities: a third of the time an infinite hidden or item entry (`Spec.infinite`)."""
    dtype = draw(st.sampled_from(dtypes))
    if draw(st.booleans()):
        first = draw(st.integers(0, 8))
        lead = (first, draw(st.integers(0, min(8, max_n // max(first, 1)))))
    else:
        lead = (draw(st.integers(0, max_n)),)
    v = draw(st.integers(min_v, 8) | st.integers(min_v, max_v))
    half16 = dtype == "float16"  # keep float16 gradients below its 65504 overflow
    bias = draw(st.booleans())
    id_dtype = {"jit": "int64" if dtype == "float64" else "int32", "any": None}.get(ids, ids)
    fits = [name for name, bound in NARROW_IDS.items() if v <= bound]
    if narrow_ids and fits and draw(st.integers(0, 2)) == 0:
        id_dtype = draw(st.sampled_from(fits))
    if refusable and draw(st.integers(0, 15)) == 15:
        block_v = draw(st.sampled_from((0, -1, -v)))
    else:
        block_v = draw(st.none() | st.integers(-(-v // 64), v + 3))
    infinite = draw(st.sampled_from(("none",) * 4 + ("hidden", "item"))) if infinities else "none"
    weights = WEIGHT_KINDS if infinite == "none" else ("none", "positive")  # no 0 x inf (`Spec.infinite`)
    return Spec(
        dtype=dtype, lead_shape=lead, num_items=v, hidden_size=draw(st.integers(0, max_d)),
        num_slots=draw(st.integers(0, min(v + 3, 6)) | st.integers(0, min(v + 3, 40))),
        reduction=draw(st.sampled_from(("none", "sum", "mean"))), return_metrics=draw(st.booleans()),
        block_v=block_v, bias=bias,
        weight=draw(st.sampled_from(weights)), class_weight=draw(st.sampled_from(weights)),
        pos_weight=draw(st.sampled_from(weights)),
        hidden_scale=draw(st.sampled_from((1.0, 0.0, 1e-3, 10.0) + (() if half16 else (100.0,)))),
        item_scale=draw(st.sampled_from((1.0, 0.1) + (() if half16 else (10.0,)))),
        bias_scale=draw(st.sampled_from((1.0, 30.0) + (() if half16 else (1000.0,)))) if bias else 1.0,
        confident=draw(st.sampled_from(("none", "some", "all"))), padding=draw(st.sampled_from(("-1", "mixed"))),
        duplicates=draw(st.booleans()), id_dtype=id_dtype or draw(st.sampled_from(("int64", "int32"))),
        infinite=infinite,
        layouts=tuple((name, layout) for name in ("hidden", "item_weight", "targets", "bias", "weight",
                                                  "class_weight", "pos_weight")
                      if (layout := draw(st.sampled_from(LAYOUTS))) != "contiguous") if layouts else (),
        seed=draw(st.integers(0, 2**16)),
    )


def small_specs(**kwargs):
    """Small valid bases for the bad-input property (errors come before any compute)."""
    return specs(max_n=6, max_v=20, max_d=4, **kwargs)


@st.composite
def bad_id_cases(draw, *, id_dtype, dtypes=IGNORED_IDS_DTYPES, **kwargs):
    """`(spec, ids)`: a spec with somewhere to put ids, and 1-4 ids a traced call cannot check
    (>= V and < 0 over the id dtype's whole range, and int64 ids that wrap around in int32)."""
    spec = draw(specs(dtypes=dtypes, max_d=16, ids=id_dtype, **kwargs))
    assume(math.prod(spec.lead_shape) * spec.num_slots > 0)
    v, top = spec.num_items, 2**31 - 1 if id_dtype == "int32" else 2**63 - 1
    wraps = () if id_dtype == "int32" else (2**31, 2**32, 2**32 + 1, -(2**32), -(2**31) - 1, -(2**40))
    special = st.sampled_from((v, v + 1, top, -2, -top - 1) + wraps)
    ids = draw(st.lists(special | st.integers(v, top) | st.integers(-top - 1, -1), min_size=1, max_size=4))
    return spec, tuple(ids)
