"""The conformance suite (`conformance.EngineConformance`) on the chunked engine (`backend='chunked'`:
torch's matmuls around one Triton elementwise kernel), its kernel run by Triton's interpreter on CPU
tensors. The interpreter is chosen when triton is first imported, so this file runs in a pytest
process of its own with `TRITON_INTERPRET=1` (`ci/test.sh`); elsewhere it skips. Its own promises
(chunk budget, memory, same bits): test_chunked.py."""

from __future__ import annotations

import os

import pytest

from conformance import CheckFamilies, EngineConformance, marks
from conformance_oracle import OracleChecks
from conformance_properties import PropertyRun

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton's interpreter: run with TRITON_INTERPRET=1 (ci/test.sh does)", allow_module_level=True)
pytest.importorskip("triton")

from torch_cutbce.chunked import elementwise  # noqa: E402  (after the skips: the interpreter must be chosen first)


class TestChunked(EngineConformance):
    pytestmark = marks("torch-chunked")
    engine = "torch-chunked"
    infinite_cases = ("positives",)  # a -inf logit at a negative: a taken-out positive (docs/precision.md)
    bad_input_entry_checks = ("test_torch_rejects_non_tensors", "test_block_v_takes_numpy_integers",
                              "test_unknown_backend", "test_torch_constant_weights_must_not_require_grad",
                              "test_torch_double_backward_of_rows_raises", "test_kernel_engine_refuses_float64",
                              "test_torch_special_rows_are_never_read")
    option_dtype = "float32"  # float64 is refused (above)
    property_runs = (PropertyRun("exact_as_dense", 12, shrink=False, dtypes=("float32", "bfloat16", "float16"),
                                 max_n=40, max_v=700, examples=("confident", "refused"), layouts=True),
                     PropertyRun("refuses_bad_input", 8, shrink=False, dtypes=("float32", "bfloat16")))


class TestChunkedHalf(CheckFamilies, OracleChecks):
    """bfloat16 against the dense reference run in bfloat16 (CCE's rule): the oracle family. float16:
    the property run's examples above, against the float64 oracle."""

    pytestmark = marks("torch-chunked")
    engine = "torch-chunked"
    infinite_cases = ("positives",)
    dtypes = ("bfloat16",)
    reductions = ("none", "sum")
    row_losses = ()


def test_a_wrong_kernel_fails_the_suite(monkeypatch):
    """The suite can fail: a kernel that drops the negatives' loss (its rows) fails the oracle check
    and the confident rows."""
    run = elementwise.chunk_pass

    def rows_dropped(*args, with_rows, with_counts):
        rows, counts = run(*args, with_rows=with_rows, with_counts=with_counts)
        return (None if rows is None else rows * 0.5), counts

    monkeypatch.setattr("torch_cutbce.chunked.passes.chunk_pass", rows_dropped)
    suite = TestChunked()
    with pytest.raises(AssertionError):
        suite.test_matches_the_float64_oracle("plain", "float32", "none")
    with pytest.raises(AssertionError):
        suite.test_confident_rows_row_by_row(("plain", "float32"))
