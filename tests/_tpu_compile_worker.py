"""Subprocess side of tests/test_jax_pallas_tpu_compile.py: compiles the Pallas kernels for real TPU chips.

Runs as `PYTHONPATH=E/libtpu-overlay:. E/bin/python tests/_tpu_compile_worker.py OUT.json [CHIP ...]`
(E: .venv or .venv-jax; no CHIP: `chips_here()`), so libtpu is loaded here and never in the
pytest process. Every case is compiled (nothing runs) with
`benchmarks.tpu_compile.compile_for`: the raw `pallas_forward`,
`pallas_backward` and `pallas_value_and_grad` (the one-pass d_hidden kernel
that also sums the rows), and `jax.value_and_grad` of `jax_kernels.cut_bce(impl='pallas')` with
respect to hidden, item_weight and bias ('mean': the one-pass kernels again, under the
custom_vjp). OUT.json gets one record per compile. Importing this module only defines the case
table.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import sys

CHIPS = ("v4", "v5e", "v5p", "v6e", "tpu7x")
# CI splits the chips between its two environments, three each (.venv compiled all four before):
# .venv (jax 0.7.1, libtpu 0.0.20, Mosaic pinned to 7) v4 and v5p, which only it covers, and v5e;
# .venv-jax (jax 0.12, libtpu 0.0.50, no pin) v5e, v6e and tpu7x, which libtpu 0.0.20 does not
# know. v5e in both: the most used chip with each pair (the temp cases below are v5e's anyway).
OLD_PAIR_CHIPS = ("v4", "v5e", "v5p")
NEWEST_CHIPS = ("v5e", "v6e", "tpu7x")
OPTIONS = ("bias", "class_weight", "pos_weight", "counts")
# Mostly odd shapes (N and V no multiple of 8 or 128) so that the ragged-tile and padding paths are
# compiled; the last is the degenerate one-row, one-item case.
SHAPES = ((37, 1001, 72), (130, 700, 40), (5, 99, 16), (61, 513, 24), (300, 2000, 64), (1, 1, 8))
# The compiles whose HBM temp bytes the test bounds, all on v5e at N 8192, V 876,939, L 8 (a few
# seconds each): the forward and value_and_grad of the issue-12 case (bfloat16, D 64: the table is
# stored with V in lanes), value_and_grad in float32, and in bfloat16 at D 256 (the table stored
# row-major, D in lanes).
TEMP_CASE = dict(n=8192, v=876_939, d=64, num_slots=8, dtype="bfloat16", options=())
TEMP_CASES = {
    "forward_temp_bound": TEMP_CASE,
    "value_and_grad_temp_bound": TEMP_CASE,
    "value_and_grad_temp_bound_f32": dict(TEMP_CASE, dtype="float32"),
    "value_and_grad_temp_bound_d256": dict(TEMP_CASE, d=256),
}


# The other Loss values (focal: issue 15; label smoothing: issue 30), on every chip: gamma 2 in
# float32, a fractional, class-balanced gamma in bfloat16 (the modulating factor's extra exp, the
# alpha weights), label smoothing with focal in float32 (the factor's log), compiled as the cases
# above under the names "loss_" + program. loss: the Loss's arguments, focal as (gamma, alpha,
# apply_class_balancing).
LOSS_CASES = (
    dict(n=37, v=1001, d=72, num_slots=3, dtype="float32", options=("bias", "counts"),
         loss=dict(focal=(2.0, 0.25, False))),
    dict(n=130, v=700, d=128, num_slots=9, dtype="bfloat16", options=("class_weight", "pos_weight"),
         loss=dict(focal=(0.5, 0.25, True))),
    dict(n=64, v=640, d=64, num_slots=5, dtype="float32", options=("bias", "pos_weight"),
         loss=dict(focal=(1.5, 0.25, True), label_smoothing=0.1)),
)


def chips_here() -> tuple[str, ...]:
    """This environment's share of the chips: NEWEST_CHIPS where the overlay's libtpu knows tpu7x,
    else OLD_PAIR_CHIPS. Reads the overlay's metadata only (libtpu is not loaded)."""
    from benchmarks import tpu_compile

    return NEWEST_CHIPS if tpu_compile.libtpu_knows("tpu7x") else OLD_PAIR_CHIPS


def cases(chips=CHIPS):
    """(chip, case) pairs: on every chip, every subset of OPTIONS with L = 0 and with L > 0 (32
    cases), the dtype alternating with the parity of the options on, so that each chip compiles
    both dtypes for every L and every option on and off; the shapes rotate through SHAPES."""
    out = []
    for c, chip in enumerate(chips):
        for i, mask in enumerate(itertools.product((False, True), repeat=len(OPTIONS))):
            for num_slots in (0, 3 + 6 * (i % 3)):
                k = 2 * i + (num_slots > 0) + c
                n, v, d = SHAPES[k % len(SHAPES)]
                out.append((chip, dict(n=n, v=v, d=d, num_slots=num_slots,
                                       dtype=("float32", "bfloat16")[(sum(mask) + c + (num_slots > 0)) % 2],
                                       options=tuple(o for o, on in zip(OPTIONS, mask) if on))))
    return out


def _structs(case):
    import jax.numpy as jnp

    n, v, d, dtype = case["n"], case["v"], case["d"], jnp.dtype(case["dtype"])
    opt = lambda name: ((v,), jnp.float32) if name in case["options"] else None
    return dict(hidden=((n, d), dtype), item_weight=((v, d), dtype), bias=opt("bias"),
                class_weight=opt("class_weight"), pos_weight=opt("pos_weight"),
                ids=((n, case["num_slots"]), jnp.int32), g=((n,), jnp.float32))


def _loss(case):
    """The case's `Loss` (plain without a "loss" entry)."""
    from cutbce_common.focal import Focal
    from cutbce_common.loss import Loss

    arguments = dict(case.get("loss", {}))
    if "focal" in arguments:
        arguments["focal"] = Focal(*arguments["focal"])
    return Loss(**arguments)


def _loss_and_grads(hidden, item_weight, targets, bias, class_weight, pos_weight, *, counts, loss_value=None):
    import jax

    import jax_kernels

    arguments = {} if loss_value is None else loss_value.arguments()

    def loss(h, w, b):
        out = jax_kernels.cut_bce(h, w, targets, b, class_weight=class_weight, pos_weight=pos_weight,
                                  return_metrics=counts, impl="pallas", **arguments)
        return (out[0], out[1]) if counts else (out, ())

    return jax.value_and_grad(loss, argnums=(0, 1, 2) if bias is not None else (0, 1),
                              has_aux=True)(hidden, item_weight, bias)


def compile_case(chip, case):
    """The four compiles of one case, as JSON-ready records."""
    from benchmarks import tpu_compile
    from jax_kernels.pallas.launch import (
        pallas_backward,
        pallas_forward,
        pallas_value_and_grad,
    )

    s = _structs(case)
    counts = "counts" in case["options"]
    loss = _loss(case)
    prefix = "" if loss.plain else "loss_"
    common = (s["hidden"], s["item_weight"], s["ids"], s["bias"], s["class_weight"], s["pos_weight"])
    jobs = {
        "forward": (functools.partial(pallas_forward, compute_counts=counts, loss=loss), common),
        "backward": (functools.partial(pallas_backward, loss=loss), common + (s["g"],)),
        "value_and_grad": (functools.partial(pallas_value_and_grad, compute_counts=counts, loss=loss),
                           common + (s["g"],)),
        "cut_bce_value_and_grad": (functools.partial(_loss_and_grads, counts=counts, loss_value=loss),
                                   (s["hidden"], s["item_weight"], s["ids"], s["bias"],
                                    s["class_weight"], s["pos_weight"])),
    }
    return [dict(case, what=prefix + what, **dataclasses.asdict(tpu_compile.compile_for(chip, fn, *args)))
            for what, (fn, args) in jobs.items()]


def main(out_path, chips):
    from benchmarks import tpu_compile
    from jax_kernels.pallas.launch import pallas_forward

    tpu_compile.pin_mosaic_version()  # only with libtpu 0.0.20/0.0.21 (.venv), which needs it
    records = []
    loss_cases = [(chip, case) for chip in chips for case in LOSS_CASES]
    for chip, case in cases(chips) + loss_cases:
        records += compile_case(chip, case)
        print(chip, case, [(r["what"], round(r["seconds"], 1), r["error"] and r["error"][:200])
                           for r in records[-4:]], flush=True)
    for what, case in TEMP_CASES.items():
        s = _structs(case)
        if what.startswith("forward"):
            fn = functools.partial(pallas_forward, compute_counts=False)
            args = (s["hidden"], s["item_weight"], s["ids"], None, None, None)
        else:
            fn = functools.partial(_loss_and_grads, counts=False)
            args = (s["hidden"], s["item_weight"], s["ids"], None, None, None)
        result = tpu_compile.compile_for("v5e", fn, *args)
        records.append(dict(case, what=what, **dataclasses.asdict(result)))
        print(what, case, round(result.seconds, 1), result.temp_bytes, result.error, flush=True)
    with open(out_path, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], tuple(sys.argv[2:]) or chips_here())
