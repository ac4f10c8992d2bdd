"""Property-based tests (hypothesis) of every CutBCE path against the float64 oracle (issue 11).

Properties, each over every path (torch native and dense, JAX blocked jitted and eager, Pallas in
interpret mode, the torch_xla bridge, JAX on a 4-device mesh, torch vocab-parallel over 2 ranks):

- A (`_properties_checks.check_exact`): each example whose spec the documented rules accept
  meets `parity.assert_exact_as_dense` (loss, every row, every gradient, metrics against
  `_properties_oracle.float64_oracle`); any error there fails the test (a valid input refused). A
  spec the rules refuse (a block_v < 1, float64 on Pallas) must raise exactly one of
  `_properties_examples.allowed_refusals(spec, engine)`. Each example records its outcome
  (`hypothesis.event`: 'reached oracle' or 'refused: <argument>'; `--hypothesis-show-statistics`
  prints them) and each A test asserts that at least half of its examples, and at least 3, reached
  the oracle. Every A test first runs `CONFIDENT` (rows of confident positives) and `REFUSED`
  (CONFIDENT with block_v=0), the native and jitted blocked ones also `WIDE` (rows of 2**22 equal
  logits), Pallas also CONFIDENT in float64.
- B: every bad argument (ids >= V where they can be checked, wrong shapes, wrong dtypes, a
  non-array, block_v <= 0 or bool, an unknown reduction), one at a time on a drawn valid example,
  raises a ValueError / TypeError whose message names it.
- C: under jit (and on XLA tensors) ids >= V and ids < 0 are ignored exactly like padding: the
  results equal, bit for bit, those with -1 in their slots.

Examples are `_properties_examples.Spec`s (shapes, dtype, options, scales, layouts, one seed), so a
failure prints a short spec that `build(spec)` turns back into the arrays. JAX runs as users run it,
with x64 off (float64 examples switch it on locally). The mesh and vocab-parallel paths run in
long-lived subprocesses (`_properties_worker.py`); hypothesis stays in this process. Each test
carries the parity rung of its path as a marker (`-m rung2`: the Pallas properties).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, assume, example, given, settings
from hypothesis import strategies as st

from _properties_checks import assert_bitwise_equal, check_exact, check_refused, counts_outcomes
from _properties_examples import ID_MUTATIONS, LAYOUTS, MUTATIONS, WEIGHT_KINDS, Spec, build, corrupt
from _properties_runners import jax_results, torch_results

TORCH_DTYPES = ("float32", "float64", "bfloat16", "float16")
JAX_DTYPES = ("float32", "float64", "bfloat16")
SHRINK_EVERYWHERE = False  # set True locally for minimal examples from the compiling paths (slow)
JAX_MUTATIONS = tuple(m for m in MUTATIONS if m != "list_item_weight")  # JAX takes array-likes (docs/precision.md)
# Every exactness property also runs this example first: rows whose positive has logit +20..+100
# and whose other logits sit at -10..-50 (their loss is a sum of tiny terms; float32 as users run).
CONFIDENT = Spec(dtype="float32", lead_shape=(2, 3), num_items=300, hidden_size=8, num_slots=2,
                 reduction="none", return_metrics=True, bias=True, confident="all", seed=1)
CONFIDENT_INT32 = dataclasses.replace(CONFIDENT, id_dtype="int32")
# And this one: two rows of 2**22 equal logits (one item row, expanded), the worst case of a running
# float32 sum, in one tile (default block_v) on the native and blocked JAX paths.
WIDE = Spec(dtype="float32", lead_shape=(2,), num_items=2**22, hidden_size=1, num_slots=1, reduction="none",
            layouts=(("item_weight", "expanded"),), hidden_scale=2.0, seed=3)
WIDE_INT32 = dataclasses.replace(WIDE, id_dtype="int32")
# And this one, which every path must refuse (ValueError naming block_v) before any compute.
REFUSED = dataclasses.replace(CONFIDENT, block_v=0)
REFUSED_INT32 = dataclasses.replace(REFUSED, id_dtype="int32")
MESHES = (((2, 2), ("data", "model"), "model", "data"), ((4,), ("model",), "model", None),
          ((1, 4), ("data", "model"), "model", "data"), ((4, 1), ("data", "model"), "model", "data"))


def budget(max_examples, shrink=True):
    """Per-path settings: deterministic, no deadline (first calls compile), every distinct bug reported.

    shrink=False for the paths where every new shape compiles (eager JAX, the bridge, the
    subprocesses): shrinking there takes several minutes per failure, so those failures print the
    example as found (still reproducible: derandomized). SHRINK_EVERYWHERE = True shrinks them too.
    """
    phases = tuple(Phase) if shrink or SHRINK_EVERYWHERE else (Phase.explicit, Phase.reuse, Phase.generate)
    return settings(max_examples=max_examples, deadline=None, derandomize=True,
                    phases=phases, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                          HealthCheck.filter_too_much, HealthCheck.large_base_example])


# -- strategies ------------------------------------------------------------------------------------


@st.composite
def specs(draw, *, dtypes, max_n=64, max_v=5000, max_d=32, min_v=1, ids="int64", layouts=False, refusable=False):
    """A `Spec`. ids: 'int64', 'int32', 'jit' (int32 with x64 off, int64 for float64) or 'any'.
    refusable: now and then (about 1 in 16) a block_v < 1, which every path must refuse (Property A)."""
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
    if refusable and draw(st.integers(0, 15)) == 15:
        block_v = draw(st.sampled_from((0, -1, -v)))
    else:
        block_v = draw(st.none() | st.integers(-(-v // 64), v + 3))
    return Spec(
        dtype=dtype, lead_shape=lead, num_items=v, hidden_size=draw(st.integers(0, max_d)),
        num_slots=draw(st.integers(0, min(v + 3, 6)) | st.integers(0, min(v + 3, 40))),
        reduction=draw(st.sampled_from(("none", "sum", "mean"))), return_metrics=draw(st.booleans()),
        block_v=block_v, bias=bias,
        weight=draw(st.sampled_from(WEIGHT_KINDS)), class_weight=draw(st.sampled_from(WEIGHT_KINDS)),
        pos_weight=draw(st.sampled_from(WEIGHT_KINDS)),
        hidden_scale=draw(st.sampled_from((1.0, 0.0, 1e-3, 10.0) + (() if half16 else (100.0,)))),
        item_scale=draw(st.sampled_from((1.0, 0.1) + (() if half16 else (10.0,)))),
        bias_scale=draw(st.sampled_from((1.0, 30.0) + (() if half16 else (1000.0,)))) if bias else 1.0,
        confident=draw(st.sampled_from(("none", "some", "all"))), padding=draw(st.sampled_from(("-1", "mixed"))),
        duplicates=draw(st.booleans()), id_dtype=id_dtype or draw(st.sampled_from(("int64", "int32"))),
        layouts=tuple((name, layout) for name in ("hidden", "item_weight", "targets", "bias", "weight",
                                                  "class_weight", "pos_weight")
                      if (layout := draw(st.sampled_from(LAYOUTS))) != "contiguous") if layouts else (),
        seed=draw(st.integers(0, 2**16)),
    )


def small_specs(**kwargs):
    """Small valid bases for the bad-input property (errors come before any compute)."""
    return specs(max_n=6, max_v=20, max_d=4, **kwargs)


@st.composite
def bad_id_cases(draw, *, id_dtype, **kwargs):
    """`(spec, ids)`: a spec with somewhere to put ids, and 1-4 ids a traced call cannot check
    (>= V and < 0 over the id dtype's whole range, and int64 ids that wrap around in int32)."""
    spec = draw(specs(dtypes=("float32", "bfloat16"), max_d=16, ids=id_dtype, **kwargs))
    assume(math.prod(spec.lead_shape) * spec.num_slots > 0)
    v, top = spec.num_items, 2**31 - 1 if id_dtype == "int32" else 2**63 - 1
    wraps = () if id_dtype == "int32" else (2**31, 2**32, 2**32 + 1, -(2**32), -(2**31) - 1, -(2**40))
    special = st.sampled_from((v, v + 1, top, -2, -top - 1) + wraps)
    ids = draw(st.lists(special | st.integers(v, top) | st.integers(-top - 1, -1), min_size=1, max_size=4))
    return spec, tuple(ids)


def torch_path(backend):
    from torch_cutbce import cut_bce_with_logits

    return functools.partial(cut_bce_with_logits, backend=backend)


# -- torch native and dense ------------------------------------------------------------------------


# Not backend='dense': it is torch's own BCEWithLogitsLoss on materialized logits, the code the rule
# compares against. torch evaluates a negative's loss through a rounded log(1 + exp(-|z|)) (1e-3
# relative off at z = -10 in float32, 0 for 2e-19 at z = -43), so it does not meet the rule the
# fast paths meet (docs/precision.md, 'Precision'); its argument checks are still run below.
@pytest.mark.rung1
@pytest.mark.parametrize("backend", ["native"])
@counts_outcomes
@budget(100)
@given(spec=specs(dtypes=TORCH_DTYPES, layouts=True, refusable=True))
@example(spec=CONFIDENT)
@example(spec=WIDE)
@example(spec=REFUSED)
def test_torch_exact_as_dense(backend, spec):
    example = build(spec)
    check_exact(lambda: torch_results(example, torch_path(backend)), example, backend, backend)


@pytest.mark.parametrize("backend", [pytest.param("native", marks=pytest.mark.rung1),
                                     pytest.param("dense", marks=pytest.mark.rung0)])
@budget(25)
@given(spec=small_specs(dtypes=TORCH_DTYPES))
def test_torch_refuses_bad_input(backend, spec):
    check_refused(lambda ex, i, o, m: torch_results(ex, torch_path(backend), inputs=i, options=o), spec)


# -- JAX: blocked (jit and eager), Pallas in interpret mode ----------------------------------------


@pytest.fixture(scope="module")
def jax_kernels():
    pytest.importorskip("jax")
    return pytest.importorskip("jax_kernels")


@pytest.mark.rung1
@counts_outcomes
@budget(60)
@given(spec=specs(dtypes=JAX_DTYPES, ids="jit", refusable=True))
@example(spec=CONFIDENT_INT32)
@example(spec=WIDE_INT32)
@example(spec=REFUSED_INT32)
def test_blocked_jit_exact_as_dense(jax_kernels, spec):
    example = build(spec)
    check_exact(lambda: jax_results(example, jit=True, impl="blocked"), example, "blocked-jit", "blocked")


@pytest.mark.rung1
@counts_outcomes
@budget(12, shrink=False)
@given(spec=specs(dtypes=JAX_DTYPES, ids="any", refusable=True))
@example(spec=CONFIDENT)
@example(spec=REFUSED)
def test_blocked_eager_exact_as_dense(jax_kernels, spec):
    example = build(spec)
    check_exact(lambda: jax_results(example, jit=False, impl="blocked"), example, "blocked-eager", "blocked")


@pytest.mark.rung2
@counts_outcomes
@budget(12, shrink=False)
@given(spec=specs(dtypes=("float32", "bfloat16"), max_n=24, max_v=600, ids="jit", refusable=True))
@example(spec=CONFIDENT_INT32)
@example(spec=REFUSED_INT32)
@example(spec=dataclasses.replace(CONFIDENT, dtype="float64"))  # the kernels take float32 / bfloat16
def test_pallas_exact_as_dense(jax_kernels, spec):
    example = build(spec)
    check_exact(lambda: jax_results(example, jit=True, impl="pallas"), example, "pallas", "pallas")


@pytest.mark.rung1
@pytest.mark.rung2  # draws impl='blocked' and 'pallas'
@budget(12, shrink=False)
@given(spec=small_specs(dtypes=JAX_DTYPES, ids="any"), jit=st.booleans(), impl=st.sampled_from(("blocked", "pallas")))
def test_jax_refuses_bad_input(jax_kernels, spec, jit, impl):
    assume(impl != "pallas" or spec.dtype != "float64")  # Pallas refuses float64 (tests/test_all_bad_input.py)
    mutations = [m for m in JAX_MUTATIONS if not (jit and m in ID_MUTATIONS)]  # traced ids: property C
    check_refused(lambda ex, i, o, m: jax_results(ex, jit=jit, inputs=i, options=o, impl=impl), spec, mutations)


@pytest.mark.parametrize("impl", [pytest.param("blocked", marks=pytest.mark.rung1),
                                  pytest.param("pallas", marks=pytest.mark.rung2)])
@budget(10, shrink=False)
@given(case=bad_id_cases(id_dtype="int32", max_n=24, max_v=600))  # x64 off, as users run: int32 ids
@example(case=(CONFIDENT_INT32, (300, 2**31 - 1, -(2**31))))
def test_jax_jit_ignores_out_of_range_ids(jax_kernels, impl, case):
    spec, ids = case
    example = build(spec)
    bad, clean = corrupt(example.inputs["targets"], ids, spec.seed)
    results = jax_results(example, jit=True, impl=impl, variants=[bad, clean])
    assert_bitwise_equal(*results, name=impl)


# -- the torch_xla bridge (XLA:CPU) ----------------------------------------------------------------


@pytest.fixture(scope="module")
def xla_device():
    pytest.importorskip("jax")
    return pytest.importorskip("torch_xla").device()


def bridge_results(example, device, **kwargs):
    """The bridge in the users' JAX configuration: x64 on, thread-locally, only for float64 (the
    backward, which autograd runs on its own thread, is lowered in the forward's mode)."""
    from parity import jax_x64

    with jax_x64(example.spec.dtype):
        return torch_results(example, torch_path("xla"), device=device, **kwargs)


@pytest.mark.rung3
@pytest.mark.xla
@counts_outcomes
@budget(10, shrink=False)
@given(spec=specs(dtypes=("float32", "bfloat16", "float64"), max_n=24, max_v=600, refusable=True))
@example(spec=CONFIDENT)
@example(spec=REFUSED)
def test_bridge_exact_as_dense(xla_device, spec):
    example = build(spec)
    check_exact(lambda: bridge_results(example, xla_device), example, "bridge", "bridge")


@pytest.mark.rung3
@pytest.mark.xla
@budget(8, shrink=False)
@given(spec=small_specs(dtypes=("float32", "float64")))
def test_bridge_refuses_bad_input(xla_device, spec):
    mutations = [m for m in MUTATIONS if m not in ID_MUTATIONS]  # XLA tensors: ids are property C's
    check_refused(lambda ex, i, o, m: bridge_results(ex, xla_device, inputs=i, options=o), spec, mutations)


@pytest.mark.rung3
@pytest.mark.xla
@budget(8, shrink=False)
@given(case=bad_id_cases(id_dtype="int64", max_n=24, max_v=600))  # torch ids are int64
@example(case=(CONFIDENT, (300, 2**32, -(2**40))))
def test_bridge_ignores_out_of_range_ids(xla_device, case):
    spec, ids = case
    example = build(spec)
    bad, clean = corrupt(example.inputs["targets"], ids, spec.seed)
    runs = [bridge_results(example, xla_device, inputs={**example.inputs, "targets": t}) for t in (bad, clean)]
    assert_bitwise_equal(*runs, name="bridge")


# -- JAX on a 4-device mesh, torch vocab-parallel over 2 ranks (subprocesses) ----------------------


@pytest.fixture(scope="module")
def mesh_worker():
    pytest.importorskip("jax")
    from _properties_worker import jax_mesh_workers

    workers = jax_mesh_workers()
    yield lambda mode, spec, params: workers.call(mode, spec, params)[0]
    workers.close()


@st.composite
def mesh_params(draw, jit=None):
    shape, axes, vocab_axis, data_axis = draw(st.sampled_from(MESHES))
    return {"mesh_shape": shape, "mesh_axes": axes, "vocab_axis": vocab_axis, "data_axis": data_axis,
            "jit": draw(st.booleans()) if jit is None else jit}


MESH_2X2 = {"mesh_shape": (2, 2), "mesh_axes": ("data", "model"), "vocab_axis": "model", "data_axis": "data",
            "jit": True}


@pytest.mark.rung3
@counts_outcomes
@budget(8, shrink=False)
@given(spec=specs(dtypes=JAX_DTYPES, max_n=32, max_v=1000, ids="jit", refusable=True), params=mesh_params())
@example(spec=CONFIDENT_INT32, params=MESH_2X2)
@example(spec=REFUSED_INT32, params=MESH_2X2)
def test_mesh_exact_as_dense(mesh_worker, spec, params):
    check_exact(lambda: mesh_worker("A", spec, params), build(spec), "mesh", "mesh")


@pytest.mark.rung3
@budget(4, shrink=False)
@given(spec=small_specs(dtypes=("float32",), ids="int64"), params=mesh_params())
def test_mesh_refuses_bad_input(mesh_worker, spec, params):
    def run(example, inputs, options, mutation):  # the worker rebuilds the same mutation
        mesh_worker("B", spec, {**params, "mutation": mutation, "jit": params["jit"] and mutation not in ID_MUTATIONS})

    check_refused(run, spec, JAX_MUTATIONS)


@pytest.mark.rung3
@budget(10, shrink=False)
@given(case=bad_id_cases(id_dtype="int32", max_n=32, max_v=1000), params=mesh_params(jit=True))
def test_mesh_jit_ignores_out_of_range_ids(mesh_worker, case, params):
    spec, ids = case
    bad, clean = mesh_worker("C", spec, {**params, "bad_ids": ids})
    assert_bitwise_equal(bad, clean, name="mesh")


@pytest.fixture(scope="module")
def vocab_parallel_worker(tmp_path_factory):
    from _properties_worker import vocab_parallel_workers

    workers = vocab_parallel_workers(tmp_path_factory.mktemp("vocab_parallel"))

    def call(mode, spec, params):
        first, second = workers.call(mode, spec, params)
        for key in ("loss", "tp", "fp", "fn", "tn", "d_hidden", "d_weight"):
            if key in first:  # replicated on every rank, bit for bit (one all_reduce)
                assert np.array_equal(first[key], second[key], equal_nan=True), f"ranks differ in {key}"
        sliced = {k: np.concatenate([first[k], second[k]]) for k in ("d_item_weight", "d_bias") if k in first}
        return {**first, **sliced}

    yield call
    workers.close()


@st.composite
def split_specs(draw, **kwargs):
    """A spec with V >= 2 and where rank 1's slice starts (both slices non-empty)."""
    spec = draw(specs(min_v=2, **kwargs))
    return spec, draw(st.integers(1, spec.num_items - 1))


@pytest.mark.rung3
@counts_outcomes
@budget(15, shrink=False)
@given(case=split_specs(dtypes=TORCH_DTYPES, max_n=32, max_v=1000, layouts=True, refusable=True))
@example(case=(CONFIDENT, 150))
@example(case=(REFUSED, 150))
def test_vocab_parallel_exact_as_dense(vocab_parallel_worker, case):
    spec, split = case
    run = lambda: vocab_parallel_worker("A", spec, {"split": split})  # noqa: E731
    check_exact(run, build(spec), "vocab-parallel", "vocab-parallel")


@pytest.mark.rung3
@budget(8, shrink=False)
@given(case=split_specs(dtypes=("float32",), max_n=6, max_v=20, max_d=4))
def test_vocab_parallel_refuses_bad_input(vocab_parallel_worker, case):
    spec, split = case
    check_refused(lambda ex, i, o, m: vocab_parallel_worker("B", spec, {"split": split, "mutation": m}), spec)
