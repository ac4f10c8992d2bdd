"""The conformance suite (`conformance.EngineConformance`) on the Triton kernels, run by Triton's
interpreter on CPU tensors. The interpreter is chosen when triton is first imported, so this file runs
in a pytest process of its own with `TRITON_INTERPRET=1` (`ci/test.sh`); elsewhere it skips.
Compiled for sm_80 / sm_90: test_triton_compile.py."""

from __future__ import annotations

import os

import pytest

from conformance import CheckFamilies, EngineConformance, marks
from conformance_oracle import OracleChecks
from conformance_properties import PropertyRun

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton's interpreter: run with TRITON_INTERPRET=1 (ci/test.sh does)", allow_module_level=True)
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402  (after the skips: the interpreter must be chosen first)

from torch_cutbce.triton import kernels, launch, tile_math  # noqa: E402


class TestTriton(EngineConformance):
    pytestmark = marks("torch-triton")
    engine = "torch-triton"
    bad_input_entry_checks = ("test_torch_rejects_non_tensors", "test_unknown_backend",
                              "test_torch_constant_weights_must_not_require_grad",
                              "test_torch_double_backward_of_rows_raises", "test_kernel_engine_refuses_float64",
                              "test_torch_special_rows_are_never_read")
    option_dtype = "float32"  # float64 is refused (above)

    def test_narrow_id_dtypes_with_a_catalog_beyond_their_range(self, monkeypatch):
        """The family's check on its V = 40,000 catalog, in wide tiles: it is about ids, not tiles, and
        1,250 of the shipped tiles take the interpreter minutes per call."""
        monkeypatch.setattr(launch, "blocks_for", lambda *_: launch.Blocks(16, 2048, 128, 4))
        super().test_narrow_id_dtypes_with_a_catalog_beyond_their_range()
    # The interpreter runs a program at a time: small shapes, and no V = 2**22 example (its wide sums:
    # test_triton_interpreter.py, over 2,048 tiles).
    property_runs = (PropertyRun("exact_as_dense", 12, shrink=False, dtypes=("float32", "bfloat16", "float16"),
                                 max_n=40, max_v=700, examples=("confident", "refused")),
                     PropertyRun("refuses_bad_input", 8, shrink=False, dtypes=("float32", "bfloat16")))


class TestTritonHalf(CheckFamilies, OracleChecks):
    """The 16-bit contract (docs/precision.md), bfloat16 and float16, ordinary and trained-like logits:
    the oracle family."""

    pytestmark = marks("torch-triton")
    engine = "torch-triton"
    dtypes = ("bfloat16", "float16")
    reductions = ("none", "sum")
    row_losses = ()



@triton.jit
def _labels_dropped(z, y, numbers_ptr, FOCAL: tl.constexpr, POWER: tl.constexpr, FRACTION: tl.constexpr,
                    SMOOTHING: tl.constexpr, BALANCED: tl.constexpr, FAST: tl.constexpr):
    """`tile_math.labelled_terms` with every label false: a kernel that forgot its positives."""
    return tile_math.labelled_terms(z, y & (z != z), numbers_ptr, FOCAL, POWER, FRACTION, SMOOTHING, BALANCED,
                                    FAST)


def test_a_wrong_kernel_fails_the_suite(monkeypatch):
    """The suite can fail: kernels that score every logit as a negative fail the oracle check and the
    confident rows."""
    monkeypatch.setattr(kernels, "labelled_terms", _labels_dropped)
    suite = TestTriton()
    with pytest.raises(AssertionError):
        suite.test_matches_the_float64_oracle("plain", "float32", "none")
    with pytest.raises(AssertionError):
        suite.test_confident_rows_row_by_row(("plain", "float32"))
