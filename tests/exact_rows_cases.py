"""The rows that cancelled before issue 11, as numpy inputs with their float64 truth (shared by
the conformance suite (`conformance_oracle.py`) and tests/test_sharded_exact_rows.py with its worker, which
runs the sharded JAX and vocab-parallel paths).

- "confident": one positive at logit +z (z = 5, 10, 31, 50, 100) and 49 negatives at -10, the
  positive first or last in the catalog (two tiles / shards);
- "single": V = 1, the only item a positive at z = 31 (truth softplus(-31) = 3.4e-14) or a
  negative at z = -31;
- "zero": pos_weight = 0 and every item a positive: the truth of every row is exactly 0.
"""

from __future__ import annotations

import numpy as np

from parity import TOLERANCES, assert_close

CONFIDENT_LOGITS = (5.0, 10.0, 31.0, 50.0, 100.0)


def _softplus(x):
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


def cases() -> dict[str, dict]:
    """name -> dict(hidden, item_weight, targets, pos_weight or None, g (row upstream gradient))."""
    rng = np.random.default_rng(11)
    v = 50
    items = np.zeros((v, 3))
    items[0, 0], items[v - 1, 2], items[1 : v - 1, 1] = 1, 1, 1
    hidden, targets = [], []
    for first in (True, False):
        for z in CONFIDENT_LOGITS:
            hidden.append([z, -10, -10] if first else [-10, -10, z])
            targets.append([0 if first else v - 1, -1])
    out = {
        "confident": dict(hidden=np.array(hidden), item_weight=items, targets=np.array(targets), pos_weight=None),
        "single": dict(hidden=np.array([[31.0], [-31.0]]), item_weight=np.ones((1, 1)),
                       targets=np.array([[0], [-1]]), pos_weight=None),
        "zero": dict(hidden=rng.standard_normal((4, 3)) * 5, item_weight=rng.standard_normal((3, 3)),
                     targets=np.tile(np.arange(3), (4, 1)), pos_weight=np.zeros(3)),
    }
    for case in out.values():
        case["g"] = rng.uniform(0.5, 2.0, size=case["hidden"].shape[0])  # non-uniform upstream gradient
    return out


def truth(case) -> dict[str, np.ndarray]:
    """float64 rows and the gradients of `sum_n g[n] rows[n]` (docs/design.md, 'The math'), branch by branch."""
    h, e = case["hidden"], case["item_weight"]
    z = h @ e.T
    y = np.zeros_like(z, dtype=bool)
    for n, ids in enumerate(case["targets"]):
        y[n, ids[ids >= 0]] = True
    pw = np.ones(e.shape[0]) if case["pos_weight"] is None else case["pos_weight"]
    loss = np.where(y, pw * _softplus(-z), _softplus(z))
    # sigmoid(z) - 1 = -sigmoid(-z): the second form keeps its digits when z >> 0.
    dz = case["g"][:, None] * np.where(y, -pw / (1 + np.exp(z)), 1 / (1 + np.exp(-z)))
    return {"rows": loss.sum(-1), "d_hidden": dz @ e, "d_item_weight": dz.T @ h}


def check_rows(name, rows, truth_rows, dtype) -> None:
    """Each row within the dtype's tolerance (parity.TOLERANCES: 1e-5 float32, 1e-10 float64) of the
    truth, relative to the row itself, and never below zero (every truth here is >= 0). Below the
    dtype's smallest normal number a value has no relative precision: there it must be within that
    number of the truth."""
    rows = np.asarray(rows, np.float64)
    rtol = TOLERANCES[dtype]
    floor = np.finfo(np.float64 if dtype == "float64" else np.float32).tiny
    err = np.abs(rows - truth_rows)
    bad = ~(err <= rtol * np.abs(truth_rows) + floor) | (rows < 0)
    assert not bad.any(), (
        f"{name} [{dtype}]: rows {np.flatnonzero(bad).tolist()}: fast {rows[bad].tolist()} "
        f"vs truth {truth_rows[bad].tolist()}"
    )


def check_grads(name, grads: dict, want: dict, dtype) -> None:
    """Gradients: max |fast - truth| / max |truth| within the dtype's tolerance, per tensor
    (parity.assert_close)."""
    for key, fast in grads.items():
        assert_close(fast, want[key], dtype=dtype, name=f"{name}:{key}")
