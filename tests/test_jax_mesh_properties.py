"""The property-based checks (conformance_properties.py's A, B, C) on `jax_kernels.cut_bce(mesh=...)`
over 4 simulated CPU devices, in a long-lived subprocess (`_properties_worker.py`): the device count
is fixed when JAX's backend starts. Hypothesis stays in this process (it shrinks and prints as
usual); the worker rebuilds each drawn spec's example and runs it on a drawn mesh layout.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from _properties_checks import assert_bitwise_equal, check_exact, check_refused, counts_outcomes
from _properties_examples import ID_MUTATIONS, build
from _properties_strategies import (
    JAX_DTYPES,
    JAX_MUTATIONS,
    bad_id_cases,
    budget,
    explicit,
    small_specs,
    specs,
)

pytestmark = [pytest.mark.jax, pytest.mark.rung3]

# (mesh shape, axis names, vocab axis, data axis): 2-D, 1-D, and 2-D with one axis of size 1.
MESHES = (((2, 2), ("data", "model"), "model", "data"), ((4,), ("model",), "model", None),
          ((1, 4), ("data", "model"), "model", "data"), ((4, 1), ("data", "model"), "model", "data"))
MESH_2X2 = {"mesh_shape": (2, 2), "mesh_axes": ("data", "model"), "vocab_axis": "model", "data_axis": "data",
            "jit": True}


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


@counts_outcomes
@budget(8, shrink=False)
@given(spec=specs(dtypes=JAX_DTYPES, max_n=32, max_v=1000, ids="jit", refusable=True), params=mesh_params())
@example(spec=explicit("confident", "jit"), params=MESH_2X2)
@example(spec=explicit("refused", "jit"), params=MESH_2X2)
def test_mesh_exact_as_dense(mesh_worker, spec, params):
    check_exact(lambda: mesh_worker("A", spec, params), build(spec), "jax-mesh", "jax-mesh")


@budget(4, shrink=False)
@given(spec=small_specs(dtypes=("float32",), ids="int64"), params=mesh_params())
def test_mesh_refuses_bad_input(mesh_worker, spec, params):
    def run(example, inputs, options, mutation):  # the worker rebuilds the same mutation
        mesh_worker("B", spec, {**params, "mutation": mutation, "jit": params["jit"] and mutation not in ID_MUTATIONS})

    check_refused(run, spec, JAX_MUTATIONS)


@budget(10, shrink=False)
@given(case=bad_id_cases(id_dtype="int32", max_n=32, max_v=1000), params=mesh_params(jit=True))
def test_mesh_jit_ignores_out_of_range_ids(mesh_worker, case, params):
    spec, ids = case
    bad, clean = mesh_worker("C", spec, {**params, "bad_ids": ids})
    assert_bitwise_equal(bad, clean, name="jax-mesh")
