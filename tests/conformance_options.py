"""Each loss option's own definitions on an engine and at its entry (`OptionChecks`).

- focal's gamma at its bounds against the oracle, loss and gradients (issue 31);
- the accepted extremes together (issue 39): the smallest smoothing with balanced focal at alpha 0
  and 1, gamma 0, at its bounds and 2, rows and gradients against the oracle;
- gamma 0 with balancing is plain BCE with pos_weight x alpha / (1 - alpha), scaled by 1 - alpha;
- Keras' definition of label smoothing and focal (`keras_reference`), row by row: float64 within
  1e-12 where the engine takes float64, float32 within float32's tolerance;
- at full smoothing no row below V ln 2, large logits included;
- a focal that is not a `Focal`, or one changed after construction, is a clear error at the entry
  and at its framework's oracle.
- a bad `label_smoothing` (outside [0, 1], below 2**-100, not a finite real number) is a clear error at
  the entry.

A check family of the conformance suite (`conformance.py`). What is no engine's: the transcription
and both oracles against Keras and torchvision (test_option_definitions.py), the native compiled
and eager tiles (test_torch_native_tiles.py), the JAX mesh (test_jax_sharded.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance_engines import LEAD, V, inputs_for, oracle, run
from cutbce_common.focal import MAX_GAMMA, MIN_GAMMA, Focal
from cutbce_common.loss import MIN_LABEL_SMOOTHING, Loss
from keras_reference import KERAS_CASES, KERAS_FLOAT64_BOUND, KERAS_OPTIONS, keras_rows
from parity import GRADS, TOLERANCES, assert_close, make_upstream, relative_error

# Issue 31: a gamma float32 could not hold gave NaN rows; the largest and the smallest taken, the
# latter also as a fraction of 2**-126 on 1, which float32 rounds away.
GAMMA_BOUNDS = {
    "largest": Focal(MAX_GAMMA),
    "smallest": Focal(MIN_GAMMA),
    "one-plus-smallest-balanced": Focal(MIN_GAMMA + 1.0, 0.25, True),
}
# Issue 39: every accepted extreme at once. At alpha 1 (0) with smoothing, the negatives' (positives')
# scale is the smoothing's half c alone; at 3e-38 XLA:CPU flushed every such term, whole rows 3e-3 to
# 100% off.
EXTREMES = {f"alpha{alpha:g}-gamma{name}": Loss(Focal(gamma, alpha, True), MIN_LABEL_SMOOTHING)
            for alpha in (0.0, 1.0)
            for name, gamma in (("0", 0.0), ("smallest", MIN_GAMMA), ("2", 2.0), ("largest", MAX_GAMMA))}
# How an entry is called, beyond the engine's options: JAX's `cut_bce` also checks focal before it
# looks for a mesh.
ENTRY_VARIANTS = {"entry": {}, "mesh": {"mesh": "infer"}}


def _changed(field, value) -> Focal:
    """`Focal(2.0)` with `field` set to `value` after its checks ran."""
    focal = Focal(2.0)
    object.__setattr__(focal, field, value)
    return focal


# (the bad focal, the error, what it says)
BAD_FOCALS = [
    (2.0, TypeError, "focal must be None or a Focal"),
    ({"gamma": 2.0}, TypeError, "focal must be None or a Focal"),
    (_changed("gamma", -1.0), ValueError, "focal gamma must be >= 0"),
    (_changed("alpha", 2.0), ValueError, r"focal alpha must be in \[0, 1\]"),
    (_changed("gamma", float("inf")), TypeError, "focal gamma must be a finite real number"),
]
NO_GRADS = dict(upstream=np.zeros(LEAD), reduction="none", grad_names=(), return_metrics=False)


def _bound(dtype: str) -> float:
    """Against Keras' float64 formula: 1e-12 in float64 (`KERAS_FLOAT64_BOUND`), else the dtype's
    parity tolerance."""
    return KERAS_FLOAT64_BOUND if dtype == "float64" else TOLERANCES[dtype]


class OptionChecks:
    """The options family. Narrow with `option_gammas` (`GAMMA_BOUNDS` ids), `option_scaled_dtypes`
    (gamma 0), `option_keras_cases` (`KERAS_CASES` ids), `option_dtype` (of the Keras and V ln 2
    checks: 'float64' where the engine takes it), `option_entries` (`ENTRY_VARIANTS` ids) and `option_grads` (the gradients the
    gamma checks take: none where the backward is another engine's, checked there)."""

    engine: str
    option_gammas: tuple[str, ...] = tuple(GAMMA_BOUNDS)
    option_extremes: tuple[str, ...] = tuple(EXTREMES)
    option_scaled_dtypes: tuple[str, ...] = ("float32",)
    option_keras_cases: tuple[str, ...] = tuple(KERAS_CASES)
    option_dtype: str = "float64"
    option_entries: tuple[str, ...] = ("entry",)
    option_grads: tuple[str, ...] = GRADS

    def parametrize(self, metafunc):
        """Each check over this engine's share of its cases (the class attributes above)."""
        for name, ids in (("option_gamma", self.option_gammas), ("option_extreme", self.option_extremes),
                          ("option_scaled_dtype", self.option_scaled_dtypes),
                          ("option_keras_case", self.option_keras_cases), ("option_entry", self.option_entries)):
            if name in metafunc.fixturenames:
                metafunc.parametrize(name, ids)

    def test_gamma_at_its_bounds_matches_the_oracle(self, option_gamma):
        """Rows and the recomputing backward ('none': every branch-math call): finite, and within
        float32's tolerance of the oracle (`Focal(1e39)` once gave [nan, nan, 0] for [0, 0, 0])."""
        inputs = inputs_for(3, "float32")
        common = dict(upstream=make_upstream("none", LEAD, seed=3, dtype="float32"), reduction="none",
                      loss=Loss(GAMMA_BOUNDS[option_gamma]), grad_names=self.option_grads)
        fast = run(self.engine, inputs, dtype="float32", **common)
        assert all(np.isfinite(np.asarray(v)).all() for v in fast.values()), fast
        assert_close(fast, oracle(self.engine, inputs, **common), dtype="float32",
                     name=f"{self.engine} gamma {option_gamma}")

    def test_accepted_extremes_match_the_oracle(self, option_extreme):
        """Each row within float32's tolerance of the oracle, relative (the first 7 rows have no
        positives: at alpha 1 every term of theirs is scaled by c, and at the old floor, 2**-125, XLA
        flushed them all); at gamma 32, whose (1 - p_t)^32 underflows with or without smoothing,
        plus float32's smallest normal number per term (`_properties_oracle.Oracle.flush`). The
        gradients as the gamma bounds' ('none', a random upstream: every branch-math call)."""
        inputs = inputs_for(5, "float32")
        inputs["targets"] = inputs["targets"].copy()
        inputs["targets"][0] = -1
        common = dict(upstream=make_upstream("none", LEAD, seed=5, dtype="float32"), reduction="none",
                      loss=EXTREMES[option_extreme], grad_names=self.option_grads)
        fast, truth = run(self.engine, inputs, dtype="float32", **common), oracle(self.engine, inputs, **common)
        rows, want = np.asarray(fast["loss"], np.float64), np.asarray(truth["loss"], np.float64)
        underflow = (1 + V) * 2.0**-126 if EXTREMES[option_extreme].focal.gamma == MAX_GAMMA else 0.0
        bound = TOLERANCES["float32"] * np.abs(want) + underflow
        worst = np.unravel_index(np.argmax(np.abs(rows - want) / bound), rows.shape)
        assert (np.abs(rows - want) <= bound).all(), (
            f"{self.engine} {option_extreme}: row {worst}: fast {rows[worst]!r}, truth {want[worst]!r}")
        assert_close(fast, truth, dtype="float32", name=f"{self.engine} {option_extreme}")

    def test_gamma_zero_with_balancing_is_plain_bce_scaled(self, option_scaled_dtype):
        """gamma = 0 with balancing runs the focal code: positives times alpha, negatives times
        1 - alpha, i.e. (1 - alpha) x plain BCE with pos_weight x alpha / (1 - alpha) (the oracles
        meet it too: test_option_definitions.py)."""
        alpha, dtype = 0.3, option_scaled_dtype
        inputs = inputs_for(6, dtype)
        common = dict(upstream=1.0, reduction="sum", grad_names=self.option_grads, return_metrics=False)
        scaled = {**inputs, "pos_weight": inputs["pos_weight"] * alpha / (1 - alpha)}
        plain = {k: x * (1 - alpha) for k, x in oracle(self.engine, scaled, **common).items()}
        fast = run(self.engine, inputs, dtype=dtype, loss=Loss(Focal(0.0, alpha, True)), **common)
        assert_close(fast, plain, dtype=dtype, name=f"{self.engine} gamma 0 balanced")

    def test_matches_keras_definition(self, option_keras_case):
        """Each row against Keras' formula on the same inputs (logits within +-12: no probability
        rounds)."""
        loss, dtype = KERAS_CASES[option_keras_case], self.option_dtype
        inputs = inputs_for(11, dtype, KERAS_OPTIONS, large_logits=False)
        rows = np.asarray(run(self.engine, inputs, dtype=dtype, loss=loss, **NO_GRADS)["loss"])
        keras = keras_rows(inputs, loss)
        err, where = relative_error(rows, keras, elementwise=True)
        assert err <= _bound(dtype), (f"{self.engine} {dtype} vs Keras {option_keras_case}: {err:.3e} at {where}: "
                                      f"ours {rows[where]!r}, Keras {keras[where]!r}")

    def test_full_smoothing_rows_are_at_least_v_ln_2(self):
        """eps = 1: every target is 1/2, so every element is at least ln 2 (at z = 0), whatever the
        logit. Logits about 0.01 put rows 1e-5 above the floor (eps = 0.9 falls below it), three
        rows have |z| up to 80 (where Keras' formula would take the log of a rounded 0)."""
        dtype = self.option_dtype
        inputs = inputs_for(2, dtype, (), scale=0.01)
        rows = run(self.engine, inputs, dtype=dtype, loss=Loss(label_smoothing=1.0), **NO_GRADS)["loss"]
        floor = V * np.log(2) * (1 - _bound(dtype))
        assert (np.asarray(rows) >= floor).all(), f"{self.engine} {dtype}: rows {np.asarray(rows).min()!r} < {floor!r}"

    @pytest.mark.parametrize("bad,error,match", [
        (-0.1, ValueError, r"label_smoothing must be in \[0, 1\]"),
        (1.5, ValueError, r"label_smoothing must be in \[0, 1\]"),
        (1e-40, ValueError, "label_smoothing must be 0 or at least"),
        (3e-38, ValueError, r"label_smoothing must be 0 or at least 2\*\*-100"),
        (float("nan"), TypeError, "label_smoothing must be a finite real number"),
        ("0.1", TypeError, "label_smoothing must be a finite real number"),
        (True, TypeError, "label_smoothing must be a finite real number"),
        (np.bool_(False), TypeError, "label_smoothing must be a finite real number"),
    ])
    def test_a_bad_label_smoothing_is_a_clear_error(self, bad, error, match):
        inputs = inputs_for(0, options=())
        with pytest.raises(error, match=match):
            run(self.engine, inputs, dtype="float32", upstream=np.zeros(LEAD), reduction="none",
                label_smoothing=bad, grad_names=(), return_metrics=False)

    def test_a_bad_focal_is_a_clear_error(self, option_entry):
        """Not a `Focal`, or one changed after construction (a frozen dataclass can still be changed
        through object.__setattr__): each call checks again, at the entry as the engine is called
        (and JAX's with a mesh to infer) and at its framework's oracle."""
        inputs = inputs_for(0, options=())
        for focal, error, match in BAD_FOCALS:
            with pytest.raises(error, match=match):
                run(self.engine, inputs, dtype="float32", focal=focal, overrides=ENTRY_VARIANTS[option_entry],
                    **NO_GRADS)
            with pytest.raises(error, match=match):
                oracle(self.engine, inputs, focal=focal, **NO_GRADS)
