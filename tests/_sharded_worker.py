"""Subprocess side of tests/test_jax_sharded.py: runs on 8 simulated CPU devices.

JAX fixes its device count when its CPU backend starts, and the pytest process may already have
started it with one device, so the multi-device checks run here, in a fresh interpreter launched as
`python tests/_sharded_worker.py OUT.json` (XLA_FLAGS is set before jax is imported). Every case
compares `jax_kernels.cut_bce(..., mesh=)` with the single-device `jax_kernels.cut_bce` on the
same float32 inputs and writes the relative errors (max |sharded - single| / max |single|, from
parity.relative_error) to OUT.json; the test asserts on them. Importing this module only defines
the case tables.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

NUM_DEVICES = 8
REDUCTIONS = ("none", "sum", "mean")
METRICS = ("tp", "fp", "fn", "tn")
ALL_OPTIONS = ("bias", "weight", "class_weight", "pos_weight")
LEAD_SHAPE, V, D, L = (3, 15), 301, 12, 5  # N = 45 and V = 301: no shard count divides them
BLOCK_V = 16



def _case(mesh, axes, vocab_axis="model", data_axis="data", *, options=ALL_OPTIONS, num_items=V,
          lead_shape=LEAD_SHAPE, reductions=("none",), impl="blocked", pad_rows=0, axis_types="auto"):
    """One layout to compare with the single device. pad_rows: garbage rows the caller appends to the
    table (passed with num_items=V), as a table held sharded in JAX must divide evenly. axis_types:
    as `make_mesh` takes it."""
    return dict(mesh=mesh, axes=axes, vocab_axis=vocab_axis, data_axis=data_axis, options=options,
                num_items=num_items, lead_shape=lead_shape, reductions=reductions, impl=impl, pad_rows=pad_rows,
                axis_types=axis_types)


DATA_MODEL = ("data", "model")
CASES = {
    "1x8": _case((1, 8), DATA_MODEL, reductions=REDUCTIONS),
    "2x4": _case((2, 4), DATA_MODEL, reductions=REDUCTIONS),
    "8x1": _case((8, 1), DATA_MODEL, reductions=REDUCTIONS),
    # Divisible sizes, no optional inputs: the path without any padding or class weight.
    "2x4_plain_divisible": _case((2, 4), DATA_MODEL, options=(), num_items=304, lead_shape=(4, 12), reductions=REDUCTIONS),
    # Other layouts: 'none' with a random upstream gradient is the most searching reduction.
    "1d_vocab_only": _case((8,), ("model",), data_axis=None),
    "1d_data_only": _case((8,), ("data",), vocab_axis=None),
    "2x4_vocab_over_both_axes": _case((2, 4), DATA_MODEL, vocab_axis=DATA_MODEL, data_axis=None),
    "2x4_caller_padded_table": _case((2, 4), DATA_MODEL, pad_rows=3),
    # The Pallas kernels (interpret mode on CPU) inside the same shard_map; 'mean' and 'sum' run
    # the one-pass kernels (sharded_weighted_sum), 'none' forward then backward.
    "2x4_pallas": _case((2, 4), DATA_MODEL, impl="pallas", reductions=REDUCTIONS),
    # Explicit axes (jax.make_mesh's default since jax 0.8.1): the loss runs under auto_axes.
    "2x4_explicit": _case((2, 4), DATA_MODEL, reductions=REDUCTIONS, axis_types="explicit"),
    "2x4_explicit_data_auto_model": _case((2, 4), DATA_MODEL, axis_types=("explicit", "auto")),
}
# mesh='infer' on inputs placed as a user holds them, on a mesh of each axis type (run_hlo and
# run_tpu_export take jax.make_mesh's default, as docs/distributed.md builds the mesh).
INFERENCE_AXIS_TYPES = ("auto", "explicit")
# Compiled-HLO check: 2 x 4 mesh, V = 4096 (1024 items per shard), block_v 64 (16 tiles) vs 512 (2).
HLO_BLOCKS = (64, 512)
COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(-start)?\(")


def make_mesh(shape, axes, axis_types="default"):
    """`jax.make_mesh` with every axis 'auto' or 'explicit', one of them per axis (a tuple), or
    'default': make_mesh's own choice (Auto axes before jax 0.8.1, Explicit since)."""
    import jax
    from jax.sharding import AxisType

    if axis_types == "default":
        return jax.make_mesh(shape, axes)
    kinds = (axis_types,) * len(axes) if isinstance(axis_types, str) else axis_types
    types = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
    return jax.make_mesh(shape, axes, axis_types=tuple(types[k] for k in kinds))


def spec_entries(spec) -> list:
    """A PartitionSpec as JSON-able entries without trailing Nones (its repr differs between JAX
    releases: `PartitionSpec('model',)` before jax 0.10, `P('model',)` since)."""
    entries = [list(e) if isinstance(e, tuple) else e for e in spec]
    while entries and entries[-1] is None:
        entries.pop()
    return entries


def make_inputs(lead_shape, num_items, seed=0):
    """float32-representable numpy inputs with the parity ladder's awkward cases."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n = int(np.prod(lead_shape))
    hidden = rng.normal(size=(n, D)) * 2
    hidden[2] *= 40  # logits of magnitude ~50 and more
    targets = rng.integers(-1, num_items, size=(n, L))
    targets[:, 1] = targets[:, 0]  # duplicates
    targets[0] = -1  # a row without positives
    targets[1, :3] = num_items - 1  # the last item: it sits next to the padding of the last shard
    targets[3, :2] = (num_items // 2 - 1, num_items // 2)  # either side of a shard boundary
    f32 = lambda x: np.asarray(x, np.float32)
    return {
        "hidden": f32(hidden).reshape(*lead_shape, D),
        "item_weight": f32(rng.normal(size=(num_items, D))),
        "targets": np.asarray(targets, np.int32).reshape(*lead_shape, L),
        "bias": f32(rng.normal(size=num_items)),
        "weight": f32(np.where(np.arange(n) == 4, 0.0, rng.random(n))).reshape(lead_shape),
        "class_weight": f32(rng.random(num_items) + 0.5),
        "pos_weight": f32(rng.random(num_items) * 3 + 0.25),
    }


def _every_reduction(loss_fn, inputs, options, reductions=REDUCTIONS, impl="blocked"):
    """jit of: loss, metrics and the gradients of `sum(loss * upstream)` for each reduction."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(1)
    upstream = {"none": rng.normal(size=inputs["targets"].shape[:-1]).astype(np.float32), "sum": 0.7, "mean": -1.3}
    diff_names = ["hidden", "item_weight"] + [k for k in ("bias", "weight") if k in options]
    const = {k: jnp.asarray(inputs[k]) for k in ("class_weight", "pos_weight") if k in options}

    def run(diff, targets):
        out = {}
        for reduction in reductions:
            def scalar(diff):
                loss, metrics = loss_fn(
                    diff["hidden"], diff["item_weight"], targets, diff.get("bias"), weight=diff.get("weight"),
                    reduction=reduction, return_metrics=True, block_v=BLOCK_V, impl=impl, **const,
                )
                return (loss * upstream[reduction]).sum(), (loss, metrics)

            grads, (loss, metrics) = jax.grad(scalar, has_aux=True)(diff)
            out[reduction] = {"loss": loss, **dict(zip(METRICS, metrics)), **{f"d_{k}": g for k, g in grads.items()}}
        return out

    return jax.jit(run)({k: inputs[k] for k in diff_names}, inputs["targets"])


def run_cases(names):
    import functools

    import numpy as np

    import jax_kernels
    from parity import relative_error

    results, references = {}, {}
    for name in names:
        case = CASES[name]
        inputs = make_inputs(case["lead_shape"], case["num_items"])
        key = (case["options"], case["num_items"], case["lead_shape"])
        if key not in references:
            references[key] = _every_reduction(jax_kernels.cut_bce, inputs, case["options"])
        reference = references[key]
        start = time.perf_counter()
        mesh = make_mesh(case["mesh"], case["axes"], case["axis_types"])
        fn = functools.partial(jax_kernels.cut_bce, mesh=mesh, vocab_axis=case["vocab_axis"], data_axis=case["data_axis"])
        if case["pad_rows"]:
            inputs = _with_garbage_rows(inputs, case["pad_rows"])
            fn = functools.partial(fn, num_items=case["num_items"])
        sharded = _every_reduction(fn, inputs, case["options"], case["reductions"], case["impl"])
        errors = {}
        for reduction in case["reductions"]:
            for k, ref in reference[reduction].items():
                got = np.asarray(sharded[reduction][k])
                if k in ("d_item_weight", "d_bias") and case["pad_rows"]:
                    # The padding rows get exactly zero gradient.
                    errors[f"{reduction}:{k}:padding"] = float(np.abs(got[case["num_items"]:]).max())
                    got = got[: case["num_items"]]
                errors[f"{reduction}:{k}"] = relative_error(got, ref)[0]
        results[name] = {"errors": errors, "seconds": time.perf_counter() - start}
    return results


def _with_garbage_rows(inputs, pad_rows):
    """The table and the [V] vectors with `pad_rows` random rows appended (they must not matter)."""
    import numpy as np

    rng = np.random.default_rng(7)
    out = dict(inputs)
    for k in ("item_weight", "bias", "class_weight", "pos_weight"):
        extra = rng.normal(size=(pad_rows,) + inputs[k].shape[1:]) * 3 + 1
        out[k] = np.concatenate([inputs[k], extra.astype(np.float32)])
    return out


def _placed(mesh, inputs):
    """Inputs on the mesh as a user would hold them: positions over 'data', the table over 'model'."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    specs = {"hidden": P("data"), "targets": P("data"), "item_weight": P("model"), "bias": P("model")}
    return {k: jax.device_put(inputs[k], NamedSharding(mesh, spec)) for k, spec in specs.items()}


def run_inference(axis_types):
    """mesh='infer': the mesh comes from the inputs' NamedSharding (concrete) or abstract mesh (under jit)."""
    import jax

    import jax_kernels
    from jax_kernels.sharded import infer_mesh
    from parity import relative_error

    mesh = make_mesh((2, 4), ("data", "model"), axis_types)
    inputs = make_inputs((4, 12), 304)
    placed = _placed(mesh, inputs)
    args = (placed["hidden"], placed["item_weight"], placed["targets"], placed["bias"])
    grad_fn = jax.jit(jax.value_and_grad(lambda h, e, t, b: jax_kernels.cut_bce(h, e, t, b, block_v=BLOCK_V, mesh="infer"), (0, 1)))
    loss, (d_hidden, d_items) = grad_fn(*args)
    reference = jax.value_and_grad(
        lambda h, e: jax_kernels.cut_bce(h, e, inputs["targets"], inputs["bias"], block_v=BLOCK_V, impl="blocked"), (0, 1)
    )
    ref_loss, ref_grads = reference(inputs["hidden"], inputs["item_weight"])
    return {
        "concrete_mesh_inferred": infer_mesh(placed["item_weight"]) == mesh,
        "jit_loss": relative_error(loss, ref_loss)[0],
        "jit_d_hidden": relative_error(d_hidden, ref_grads[0])[0],
        "jit_d_item_weight": relative_error(d_items, ref_grads[1])[0],
        "d_hidden_spec": spec_entries(d_hidden.sharding.spec),
        "d_item_weight_spec": spec_entries(d_items.sharding.spec),
    }


def run_explicit_entries():
    """An Explicit mesh's other entries: eager with mesh=, and mesh='infer' under jax.set_mesh with
    plain and placed inputs ('none': the rows come back sharded as the positions)."""
    import jax

    import jax_kernels
    from parity import relative_error

    mesh = make_mesh((2, 4), ("data", "model"), "explicit")
    inputs = make_inputs((4, 12), 304)
    placed = _placed(mesh, inputs)
    names = ("hidden", "item_weight", "targets", "bias")
    kwargs = dict(reduction="none", block_v=BLOCK_V)
    reference = jax_kernels.cut_bce(*(inputs[k] for k in names), **kwargs)
    eager = jax_kernels.cut_bce(*(placed[k] for k in names), mesh=mesh, **kwargs)
    out = {"eager": relative_error(eager, reference)[0], "eager_spec": spec_entries(eager.sharding.spec)}
    with jax.set_mesh(mesh):
        step = jax.jit(lambda *args: jax_kernels.cut_bce(*args, mesh="infer", **kwargs))
        for label, arrays in (("plain", inputs), ("placed", placed)):
            rows = step(*(arrays[k] for k in names))
            out[f"set_mesh_{label}"] = relative_error(rows, reference)[0]
            out[f"set_mesh_{label}_spec"] = spec_entries(rows.sharding.spec)
    return out


def computations(hlo_text: str) -> dict[str, str]:
    """Splits HLO text into {computation name: body text}."""
    found, name, lines = {}, None, []
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header and not line.startswith(" "):
            name, lines = header.group(1), []
        elif line.startswith("}") and name is not None:
            found[name], name = "\n".join(lines), None
        elif name is not None:
            lines.append(line)
    return found


def collectives_in_loops(hlo_text: str) -> list[str]:
    """Collective ops in any computation a while loop runs (its body, condition, and what they call)."""
    bodies = computations(hlo_text)
    callees = {n: set(re.findall(r"(?:condition|body|to_apply|calls)=%?([\w.\-]+)", b)) for n, b in bodies.items()}
    loop_roots = set(re.findall(r"while\(.*?(?:condition|body)=%?([\w.\-]+).*?(?:condition|body)=%?([\w.\-]+)", hlo_text))
    stack, seen = [c for pair in loop_roots for c in pair], set()
    while stack:
        name = stack.pop()
        if name in seen or name not in bodies:
            continue
        seen.add(name)
        stack.extend(callees[name])
    return [f"{n}: {m.group(0)}" for n in sorted(seen) for m in COLLECTIVE.finditer(bodies[n])]


def run_hlo():
    """Collective counts of the compiled forward + backward for each block_v, and where they are."""
    import jax

    from jax_kernels import cut_bce

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    inputs = make_inputs((4, 16), 4096)
    placed = _placed(mesh, inputs)
    out = {}
    for block_v in HLO_BLOCKS:
        def loss(hidden, items, bias, targets, block_v=block_v):
            value, metrics = cut_bce(hidden, items, targets, bias, mesh=mesh, block_v=block_v, return_metrics=True)
            return value, metrics

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
        args = (placed["hidden"], placed["item_weight"], placed["bias"], placed["targets"])
        compiled = step.lower(*args).compile()
        text = compiled.as_text()
        kinds = [m.group(1) for m in COLLECTIVE.finditer(text)]
        d_items_sharding = compiled.output_shardings[1][1]
        out[str(block_v)] = {
            "counts": {k: kinds.count(k) for k in sorted(set(kinds))},
            "while_loops": len(re.findall(r"\bwhile\(", text)),
            "in_loops": collectives_in_loops(text),
            "d_item_weight_spec": spec_entries(d_items_sharding.spec),
        }
    return out


def run_tpu_export():
    """The sharded forward + backward with the Pallas kernels, exported for TPU (nothing runs).

    Mosaic kernels loop over their tiles inside the kernel grid, so the HLO has no while loop and
    the shard_map's all-reduces are the only collectives, the same number for every V.
    """
    import jax
    import jax.numpy as jnp
    from jax import export
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_kernels import cut_bce

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    sds = lambda shape, dtype, spec: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
    out = {}
    for num_items in (100_000, 876_939):
        rows = -(-num_items // 4) * 4  # a table held sharded must divide: 876,939 items in 876,940 rows

        def loss(hidden, items, targets, bias, num_items=num_items):
            return cut_bce(hidden, items, targets, bias, mesh=mesh, impl="pallas", return_metrics=True,
                           num_items=num_items)

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 3), has_aux=True))
        exported = export.export(step, platforms=["tpu"])(
            sds((8192, 64), jnp.bfloat16, P("data")), sds((rows, 64), jnp.bfloat16, P("model")),
            sds((8192, 8), jnp.int32, P("data")), sds((rows,), jnp.float32, P("model")),
        )
        text = exported.mlir_module()
        out[str(num_items)] = {
            "tpu_custom_calls": text.count("tpu_custom_call"),
            "all_reduces": len(re.findall(r"stablehlo\.all_reduce|\"stablehlo\.all_reduce\"", text)),
            "while_loops": text.count("stablehlo.while"),
            "devices": exported.nr_devices,
        }
    return out


def main(out_path: str) -> None:
    flag = f"--xla_force_host_platform_device_count={NUM_DEVICES}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    import jax

    assert jax.device_count() == NUM_DEVICES, jax.devices()
    start = time.perf_counter()
    report = {"cases": run_cases(list(CASES)),
              "inference": {types: run_inference(types) for types in INFERENCE_AXIS_TYPES},
              "explicit_entries": run_explicit_entries(), "hlo": run_hlo(),
              "tpu_export": run_tpu_export()}
    report["seconds"] = time.perf_counter() - start
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
