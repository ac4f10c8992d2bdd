"""`jax_kernels.cut_bce(..., mesh=)` on simulated meshes equals the single-device `cut_bce`.

The multi-device checks need 8 CPU devices, fixed when JAX's backend starts, so they run once in a
subprocess (`_sharded_worker.py`, launched with the device count set) and the tests here assert on
its report: loss, metrics and every gradient on 1x8, 2x4 and 8x1 meshes (and 1-D, tuple-axis,
caller-padded-table and Pallas-kernel layouts), meshes with Auto, Explicit and mixed axis types, V
and N divisible by no shard count, every reduction, relative error <= 1e-5 (float32); the mesh
inferred from placed inputs, each gradient placed as its input; the compiled HLO's collectives: the
same count for block_v 64 and 512, none inside a loop; and the Pallas version of the sharded step
exported for TPU (these two on `jax.make_mesh`'s default axis types, Explicit since jax 0.8.1).
The argument checks and a one-device mesh run in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax", reason="needs jax: pip install 'torch-cutbce[jax]'")  # every test here runs JAX

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import _sharded_worker as worker  # noqa: E402
import jax_kernels  # noqa: E402
from jax_kernels.sharded import ShardedLayout, infer_mesh  # noqa: E402
from cutbce_common.options import CutBCEOptions  # noqa: E402
from parity import TOLERANCES, assert_close, jax_x64  # noqa: E402

pytestmark = pytest.mark.rung3

TESTS = Path(__file__).resolve().parent
TOL = TOLERANCES["float32"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded") / "report.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    proc = subprocess.run(
        [sys.executable, str(TESTS / "_sharded_worker.py"), str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", list(worker.CASES))
def test_sharded_equals_single_device(report, case):
    errors = report["cases"][case]["errors"]
    spec = worker.CASES[case]
    # loss, metrics, every gradient (and, for a padded table, its padding rows' gradients)
    expected = 1 + len(worker.METRICS) + 2 + len([k for k in ("bias", "weight") if k in spec["options"]])
    expected += (1 + ("bias" in spec["options"])) if spec["pad_rows"] else 0
    assert len(errors) == len(spec["reductions"]) * expected, sorted(errors)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, f"{case}: worst relative error {errors[worst]:.3g} at {worst}; all: {errors}"


@pytest.mark.parametrize("axis_types", worker.INFERENCE_AXIS_TYPES)
def test_mesh_inferred_from_named_shardings(report, axis_types):
    result = report["inference"][axis_types]
    assert result["concrete_mesh_inferred"]
    for key in ("jit_loss", "jit_d_hidden", "jit_d_item_weight"):
        assert result[key] <= TOL, result
    # Each gradient keeps its input's placement: the table's stays sharded along V.
    assert result["d_hidden_spec"] == ["data"] and result["d_item_weight_spec"] == ["model"], result


def test_explicit_mesh_eagerly_and_under_set_mesh(report):
    result = report["explicit_entries"]
    for key in ("eager", "set_mesh_plain", "set_mesh_placed"):
        assert result[key] <= TOL, result
    # reduction='none': the rows are sharded as the positions were (replicated inputs: replicated).
    assert result["eager_spec"] == result["set_mesh_placed_spec"] == ["data"], result
    assert result["set_mesh_plain_spec"] == [], result


def test_collectives_hoisted_out_of_the_tile_loop(report):
    small, large = (report["hlo"][str(b)] for b in worker.HLO_BLOCKS)
    # 'mean' computes its gradients in the loop that computes the loss (sharded_weighted_sum): one
    # loop over each shard's tiles (16 and 2), not a forward loop and a backward loop.
    assert small["while_loops"] == 1 and large["while_loops"] == 1, (small, large)
    assert small["counts"] == large["counts"], (small["counts"], large["counts"])
    assert small["in_loops"] == [] and large["in_loops"] == [], (small["in_loops"], large["in_loops"])
    # rows+counts and d_hidden over 'model', d_item_weight and d_bias over 'data', the loss and the
    # counts' sums over 'data'. Never a gather of the table.
    assert set(small["counts"]) == {"all-reduce"} and small["counts"]["all-reduce"] <= 6, small["counts"]
    assert small["d_item_weight_spec"] == ["model"], small


def test_pallas_sharded_step_lowers_for_tpu_with_the_same_collectives(report):
    """bf16, N = 8192 on a 2 x 4 mesh, V = 1e5 and 876,939 (held as 876,940 rows, num_items=V)."""
    exported = report["tpu_export"]
    for v, facts in exported.items():
        # 'mean' in one pass: the d_hidden kernel (which also sums the rows and counts) and the
        # d_item kernel, no forward kernel; their tile loops are the kernel grids.
        assert facts["tpu_custom_calls"] == 2 and facts["while_loops"] == 0 and facts["devices"] == 8, (v, facts)
    counts = {v: facts["all_reduces"] for v, facts in exported.items()}
    # rows+counts, d_hidden, d_item_weight, d_bias: the shard_map's psums, whatever V is.
    assert set(counts.values()) == {4}, counts


def test_collective_finder_sees_collectives_inside_loops():
    hlo = """
%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %x = f32[4] all-reduce(%y), to_apply=%add
}

%cond (p: (s32[], f32[4])) -> pred[] {
  %c = pred[] constant(true)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %w = (s32[], f32[4]) while(%t), condition=%cond, body=%body
  %z = f32[4] all-reduce(%a), to_apply=%add
}
"""
    assert worker.collectives_in_loops(hlo) == ["body: all-reduce("]


def test_loss_options_on_a_mesh_match_the_single_device(tmp_path):
    """Focal, and label smoothing with focal, on 2 x 2 CPU devices (`_sharded_loss_worker.py`, a
    process of its own): blocked 'none' and Pallas 'mean', N and V divisible by neither axis."""
    out = tmp_path / "loss_options.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    proc = subprocess.run([sys.executable, str(TESTS / "_sharded_loss_worker.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    errors = json.loads(out.read_text())
    assert len(errors) == 3, sorted(errors)
    worst = max(((case, key, err) for case, e in errors.items() for key, err in e.items()), key=lambda x: x[2])
    assert worst[2] <= TOL, (worst, errors)


# In-process checks: JAX here has one CPU device, so a 1 x 1 mesh (the shard_map path itself).


def _inputs(dtype=np.float32):
    inputs = worker.make_inputs((5, 7), 53)
    return {k: (v.astype(dtype) if v.dtype.kind == "f" else v) for k, v in inputs.items()}


@pytest.fixture
def x64():
    """JAX's x64 mode for one float64 test (the session runs with it off)."""
    with jax_x64("float64"):
        yield


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_one_device_mesh_float64_matches_cut_bce(x64, axis_types):
    inputs = _inputs(np.float64)
    mesh = worker.make_mesh((1, 1), ("data", "model"), axis_types)
    kwargs = dict(weight=inputs["weight"], class_weight=jnp.asarray(inputs["class_weight"]),
                  pos_weight=jnp.asarray(inputs["pos_weight"]), reduction="none", return_metrics=True,
                  block_v=8)
    args = (inputs["hidden"], inputs["item_weight"], inputs["targets"], inputs["bias"])
    upstream = np.random.default_rng(2).normal(size=inputs["targets"].shape[:-1])

    def run(fn, **extra):
        def scalar(h, e, b):
            loss, metrics = fn(h, e, args[2], b, **kwargs, **extra)
            return (loss * upstream).sum(), (loss, metrics)

        (_, aux), grads = jax.jit(jax.value_and_grad(scalar, (0, 1, 2), has_aux=True))(args[0], args[1], args[3])
        return aux, grads

    (sharded_loss, sharded_metrics), sharded_grads = run(jax_kernels.cut_bce, mesh=mesh, impl="blocked")
    (loss, metrics), grads = run(jax_kernels.cut_bce, impl="blocked")
    assert_close(sharded_loss, loss, dtype="float64", name="loss")
    for name, a, b in zip(worker.METRICS, sharded_metrics, metrics):
        assert_close(a, b, dtype="float32", name=name)
    for name, a, b in zip(("d_hidden", "d_item_weight", "d_bias"), sharded_grads, grads):
        assert_close(a, b, dtype="float64", name=name)


def test_argument_errors():
    inputs = _inputs()
    args = (inputs["hidden"], inputs["item_weight"], inputs["targets"])
    mesh = jax.make_mesh((1, 1), ("data", "model"))
    with pytest.raises(ValueError, match="vocab_axis='vocab' is not an axis of the mesh"):
        jax_kernels.cut_bce(*args, mesh=mesh, vocab_axis="vocab")
    with pytest.raises(ValueError, match="share mesh axes"):
        jax_kernels.cut_bce(*args, mesh=mesh, vocab_axis="model", data_axis=("data", "model"))
    with pytest.raises(ValueError, match="found no mesh"):
        jax_kernels.cut_bce(*args, mesh="infer")
    bad = inputs["targets"].copy()
    bad[0, 0] = 53
    with pytest.raises(ValueError, match="item id 53"):
        jax_kernels.cut_bce(args[0], args[1], bad, mesh=mesh)
    with pytest.raises(ValueError, match="are not the layout's mesh"):  # options of another mesh
        ShardedLayout(mesh, CutBCEOptions(block_v=8, impl="blocked", mesh_shape=(1,), mesh_axes=("model",)))


def test_explicit_mesh_under_another_context_mesh_is_an_error():
    inputs = _inputs()
    mesh = worker.make_mesh((1, 1), ("data", "model"), "explicit")
    with jax.set_mesh(worker.make_mesh((1, 1), ("rows", "items"), "explicit")):
        with pytest.raises(ValueError, match=r"inside jax.set_mesh of another mesh .*Explicit axes \('data', 'model'\)"):
            jax_kernels.cut_bce(inputs["hidden"], inputs["item_weight"], inputs["targets"], mesh=mesh)


def test_manual_axes_are_an_error():
    """Inside the caller's own shard_map the mesh's axes are Manual: cut_bce(mesh=) cannot nest."""
    inputs = _inputs()
    mesh = worker.make_mesh((1, 1), ("data", "model"), "auto")

    def body(hidden):
        return jax_kernels.cut_bce(hidden, inputs["item_weight"], inputs["targets"], mesh="infer")

    spec = jax.sharding.PartitionSpec()
    with pytest.raises(ValueError, match=r"Manual axes \('data', 'model'\)"):
        jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(jnp.asarray(inputs["hidden"]))


def test_infer_mesh_reads_named_sharding_and_ignores_plain_arrays():
    mesh = jax.make_mesh((1, 1), ("data", "model"))
    placed = jax.device_put(np.ones((4, 2), np.float32), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("model")))
    assert infer_mesh(None, placed) == mesh
    assert infer_mesh(np.ones(3), jnp.ones(3)) is None
