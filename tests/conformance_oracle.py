"""Conformance checks against the float64 oracle, row by row and in closed form (`OracleChecks`).

- the float64 oracle of the engine's framework (loss, every gradient, metrics; a random
  non-uniform upstream; odd shapes, padding, duplicates, ids past V, large logits: `parity`);
- confident rows row by row (`exact_rows_cases`), and rows of logits in the hundreds;
- zero logits against the closed form of every Loss;
- a plain `Loss` given as options (gamma 0, smoothing 0) runs the plain code bit for bit;
- infinite logits (an item row with an infinite entry) give their limits, docs/precision.md's table;
"""

from __future__ import annotations

import numpy as np

import exact_rows_cases
from conformance_engines import (
    ENGINES,
    LEAD,
    LOSSES,
    closed_form_at_zero_logits,
    inputs_for,
    oracle,
    run,
    same_dtype_dense,
)
from cutbce_common.focal import Focal
from parity import HALF_DTYPES, assert_16bit_contract, assert_close, make_upstream, relative_error


class OracleChecks:
    """The oracle family. Narrow with `dtypes`, `reductions`, `losses` (the oracle check) and
    `row_losses` (the row-by-row checks); `conformance.EngineConformance` parametrizes them."""

    engine: str
    dtypes: tuple[str, ...] = ("float32",)  # bfloat16 / float16 here: the 16-bit contract, trained-like logits too
    reductions: tuple[str, ...] = ("none", "mean", "sum")
    losses: tuple[str, ...] = tuple(LOSSES)
    row_losses: tuple[str, ...] = ("plain", "focal0.5-balanced", "smoothing0.1", "smoothing0.2-focal1.5-balanced")
    row_dtypes: tuple[str, ...] = ("float32",)
    row_sums: bool = True  # the confident rows' 'sum' too (the one-pass path) against their summed truth
    # The infinite-logit cases (test_infinite_logits_give_their_limits); the native and blocked engines
    # mark a positive with -inf in their tile and give a -inf logit at a negative a 0 slope under
    # smoothing (docs/precision.md): 'positives' only.
    infinite_cases: tuple[str, ...] = ("positives", "negatives")

    def parametrize(self, metafunc):
        """Each check over this engine's share of the matrix (`dtypes`, `reductions`, `losses`)."""
        if "row_case" in metafunc.fixturenames:
            metafunc.parametrize("row_case", self.row_matrix(), ids="-".join)
        if "loss_id" in metafunc.fixturenames:
            ids = self.row_losses if "_rows_" in metafunc.function.__name__ else self.losses
            metafunc.parametrize("loss_id", ids)
        if "dtype" in metafunc.fixturenames:
            metafunc.parametrize("dtype", self.dtypes)
        if "half_dtype" in metafunc.fixturenames:
            metafunc.parametrize("half_dtype", [d for d in self.dtypes if d in HALF_DTYPES])
        if "reduction" in metafunc.fixturenames:
            metafunc.parametrize("reduction", self.reductions)
        if "infinite_case" in metafunc.fixturenames:
            metafunc.parametrize("infinite_case", self.infinite_cases)

    def test_matches_the_float64_oracle(self, loss_id, dtype, reduction):
        """Loss, every gradient and the metrics within the dtype's tolerance of the oracle, for a
        random non-uniform upstream; bfloat16 / float16: the 16-bit contract (`check_16bit`)."""
        if dtype in HALF_DTYPES:
            self.check_16bit(loss_id, dtype, reduction, trained=False)
            return
        loss = LOSSES[loss_id]
        seed = sorted(LOSSES).index(loss_id)
        inputs = inputs_for(seed, dtype)
        upstream = make_upstream(reduction, LEAD, seed=seed, dtype=dtype)
        common = dict(upstream=upstream, reduction=reduction, loss=loss)
        assert_close(run(self.engine, inputs, dtype=dtype, **common), oracle(self.engine, inputs, **common),
                     dtype=dtype, name=f"{self.engine} {dtype} {loss_id} {reduction}")

    def test_16bit_contract_on_trained_like_logits(self, loss_id, half_dtype, reduction):
        """The 16-bit contract where dense 16-bit BCE is weakest: logits about N(-8, 3^2)."""
        self.check_16bit(loss_id, half_dtype, reduction, trained=True)

    def check_16bit(self, loss_id, dtype, reduction, *, trained):
        """The 16-bit contract (docs/precision.md; `parity.assert_16bit_contract`): every output no
        further from the float64 truth than the dense loss run in `dtype` (the loss row by row), or
        its dtype's floor; a random non-uniform upstream, every optional input."""
        loss = LOSSES[loss_id]
        seed = sorted(LOSSES).index(loss_id)
        inputs = inputs_for(seed, dtype, trained=trained)
        common = dict(upstream=make_upstream(reduction, LEAD, seed=seed, dtype=dtype), reduction=reduction, loss=loss)
        fast = run(self.engine, inputs, dtype=dtype, **common)
        dense = same_dtype_dense(self.engine, inputs, dtype=dtype, **common)
        name = f"{self.engine} {dtype} {loss_id} {reduction}{' trained-like' if trained else ''}"
        assert_16bit_contract(fast, dense, oracle(self.engine, inputs, **common), dtype=dtype, name=name)

    def test_confident_rows_row_by_row(self, row_case):
        """The rows that cancelled before issue 11 (`exact_rows_cases`: a positive at z = 5 .. 100
        among negatives at -10, single-item rows at +-31, rows whose truth is exactly 0): each row
        within the dtype's tolerance of its own float64 truth, never below zero; gradients for a
        non-uniform upstream within it of the largest; with `row_sums`, 'sum' (gradients computed
        in the forward) within it of the rows' summed truth, and exactly 0 where that is 0."""
        loss_id, dtype = row_case
        loss = LOSSES[loss_id]
        cases = exact_rows_cases.cases()
        for name in self.row_case_names(loss_id, dtype):
            case = cases[name]
            inputs = {k: case[k] for k in ("hidden", "item_weight", "targets", "pos_weight") if case[k] is not None}
            common = dict(upstream=case["g"], loss=loss, grad_names=("hidden", "item_weight"), return_metrics=False)
            # Plain BCE has a closed-form truth of its own; torch's float64 BCE is 3% off at "single".
            truth = exact_rows_truth(case) if loss.plain else oracle(self.engine, inputs, reduction="none", **common)
            fast = run(self.engine, inputs, dtype=dtype, overrides=self.small_tiles(), reduction="none", **common)
            rows, truth_rows = fast.pop("loss"), truth.pop("loss")
            label = f"{self.engine}:{name}:{loss_id}"
            exact_rows_cases.check_rows(label, rows, truth_rows, dtype)
            exact_rows_cases.check_grads(label, fast, truth, dtype)
            if self.row_sums:
                total = run(self.engine, inputs, dtype=dtype, overrides=self.small_tiles(), reduction="sum",
                            **{**common, "upstream": np.ones(()), "grad_names": ()})["loss"]
                assert float(total) >= 0, label
                assert_close(total, np.float64(truth_rows.sum()), dtype=dtype, name=f"{label}:sum")
                if name == "zero":
                    assert float(total) == 0.0, label

    def row_matrix(self) -> list[tuple[str, str]]:
        """The (loss id, dtype) pairs of the confident-rows check: `row_losses` x `row_dtypes`."""
        return [(loss_id, dtype) for loss_id in self.row_losses for dtype in self.row_dtypes]

    def row_case_names(self, loss_id: str, dtype: str) -> tuple[str, ...]:
        """The `exact_rows_cases` the engine meets for one (loss id, dtype): all of them."""
        return tuple(exact_rows_cases.cases())

    def test_large_logit_rows_row_by_row(self, loss_id):
        """Logits in the hundreds (hidden scaled by 8, one row by 64) with bias: each row within
        float32's tolerance of the float64 truth on its own, never below zero (smoothing's c |z|
        and the focal factor meet no cancellation)."""
        inputs = inputs_for(3, "float32", options=("bias",), scale=8.0)
        inputs["hidden"][0, 2] *= 8  # a power of two: still representable in the dtype
        common = dict(upstream=np.zeros(LEAD), reduction="none", loss=LOSSES[loss_id], grad_names=(),
                      return_metrics=False)
        rows = run(self.engine, inputs, dtype="float32", **common)["loss"]
        truth = oracle(self.engine, inputs, **common)["loss"]
        assert_close(rows, truth, dtype="float32", name=f"{self.engine} {loss_id} rows", elementwise=True)
        assert (np.asarray(rows) >= 0).all()

    def test_zero_logit_rows_give_the_closed_form(self, loss_id):
        """z = 0 everywhere: rows of one positive, one duplicated, none (`closed_form_at_zero_logits`)."""
        n, v = 5, 40
        targets = np.full((n, 2), -1)
        targets[1:, 0] = np.arange(1, n) * 7  # row 0: no positive
        targets[1, 1] = targets[1, 0]  # a duplicate counts once
        inputs = {"hidden": np.zeros((n, 4)), "item_weight": np.zeros((v, 4)), "targets": targets}
        loss = LOSSES[loss_id]
        rows = run(self.engine, inputs, dtype="float32", upstream=np.zeros(n), reduction="none", loss=loss,
                   grad_names=(), return_metrics=False)["loss"]
        want = closed_form_at_zero_logits(loss, v, np.minimum(np.arange(n), 1))
        assert_close(rows, want, dtype="float32", name=f"{self.engine} {loss_id} zero logits", elementwise=True)

    def test_plain_loss_options_run_the_plain_code_bit_for_bit(self):
        """`Focal(gamma=0)` without balancing and `label_smoothing=0` are plain BCE, bit for bit."""
        inputs = inputs_for(5)
        common = dict(dtype="float32", upstream=make_upstream("none", LEAD, seed=5, dtype="float32"),
                      reduction="none")
        plain = run(self.engine, inputs, **common)
        options = run(self.engine, inputs, focal=Focal(0.0, 0.9), label_smoothing=0.0, **common)
        for key in plain:
            np.testing.assert_array_equal(options[key], plain[key], err_msg=key)

    def small_tiles(self) -> dict:
        """Options that make the confident rows' V of 16-ish span several tiles, where the engine
        takes a tile width."""
        return dict(block_v=16) if "block_v" in ENGINES[self.engine][2] else {}


    def test_infinite_logits_give_their_limits(self, loss_id, dtype, reduction, infinite_case):
        """Item B's row is (-inf, 0, ...): its logit is -inf where hidden[:, 0] > 0 and +inf where it is
        < 0. 'positives': B is a positive of rows 0 and 5 (+inf: adds 0 without smoothing) and where
        its logit is -inf, a negative at +inf elsewhere: every row but 0 and 5 is +inf
        (docs/precision.md's table; the Triton engine gave NaN). 'negatives': B is a negative at -inf
        in rows 0, 2 and 5; their gradients are the limit's (smoothing's slope there is -c), their loss
        the table's: the engines that mark a positive with -inf in their tile (native, blocked) run
        'positives' only (docs/precision.md: slope 0 there).
        The limit is the float64 oracle with -1e30 for -inf: every result entry it makes infinite is
        that infinity, the others match it; d_hidden[:, 0] multiplies the infinite entry: the
        limit's infinities, or NaN (0 x inf, the table's rule)."""
        n, v, d, b = 6, 40, 4, 11
        rng = np.random.default_rng(17)
        hidden, items = rng.normal(size=(n, d)), rng.normal(size=(v, d)) / 2
        items[b] = [-np.inf, 0.0, 0.0, 0.0]
        if infinite_case == "positives":
            hidden[:, 0] = [-1.0, 0.5, -2.0, 1.5, -0.75, -1.25]
            targets = np.array([[b, 3], [b, -1], [5, 3], [b, 7], [9, -1], [b, b]])
        else:
            hidden[:, 0] = [1.0, -0.5, 2.0, 1.5, -0.75, 1.25]
            targets = np.array([[3, 4], [b, -1], [5, 3], [b, 7], [9, -1], [2, 2]])
        inputs = {"hidden": hidden, "item_weight": items, "targets": targets, "bias": rng.normal(size=v),
                  "class_weight": rng.uniform(0.5, 2.0, size=v), "pos_weight": rng.uniform(0.5, 2.0, size=v)}
        upstream = make_upstream(reduction, (n,), seed=2, dtype=dtype)
        loss = LOSSES[loss_id]
        common = dict(upstream=upstream, reduction=reduction, loss=loss, grad_names=("hidden", "item_weight", "bias"),
                      return_metrics=False)
        fast = run(self.engine, inputs, dtype=dtype, **common)
        limit = oracle(self.engine, {**inputs, "item_weight": np.where(np.isinf(items), -1e30, items)}, **common)
        if infinite_case == "negatives" and loss.label_smoothing:
            del fast["loss"], limit["loss"]  # +inf, or 0 where -inf marks a positive taken out (the table)
        name = f"{self.engine} {dtype} {loss_id} {reduction} {infinite_case}"
        tol = {"float64": 1e-9, "float32": 1e-5}.get(dtype, 2e-2)
        for key, want in limit.items():
            got, want = np.asarray(fast[key], np.float64), np.asarray(want, np.float64)
            infinite = np.abs(want) > 1e25
            may_be_nan = np.zeros(got.shape, bool)
            if key == "d_hidden":
                may_be_nan[:, 0] = True  # the entries that multiply the infinite entry
            ok = (got == np.sign(want) * np.inf) | (np.isnan(got) & may_be_nan)
            assert ok[infinite].all(), f"{name}:{key}: {got[infinite]} where the limit is {want[infinite]}"
            finite = ~infinite & ~may_be_nan
            assert np.isfinite(got[finite]).all(), f"{name}:{key}: {got} where the limit is {want}"
            if finite.any():
                err, _ = relative_error(got[finite], want[finite])
                assert err <= tol, f"{name}:{key}: {err:.3e} off the limit: {got} vs {want}"
        if reduction == "none" and infinite_case == "positives" and not loss.label_smoothing:
            assert np.isfinite(fast["loss"][[0, 5]]).all() and (fast["loss"][1:5] == np.inf).all(), fast["loss"]

def exact_rows_truth(case) -> dict:
    """`exact_rows_cases.truth` in the oracle's keys (loss, d_hidden, d_item_weight)."""
    truth = exact_rows_cases.truth(case)
    return {"loss": truth["rows"], "d_hidden": truth["d_hidden"], "d_item_weight": truth["d_item_weight"]}
