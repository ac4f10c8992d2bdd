"""The property-based checks (conformance_properties.py's A and B) on torch vocab parallelism:
`cut_bce_with_logits(..., vocab_parallel=...)` over 2 gloo ranks, each a long-lived subprocess
(`_properties_worker.py`) holding its slice of the table. Hypothesis stays in this process; every
drawn spec goes to both ranks, whose replies are joined (replicated results bit for bit equal,
the table's gradients concatenated). Ids >= V are checked here too (CPU tensors), so C does not apply.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from _properties_checks import check_exact, check_refused, counts_outcomes
from _properties_examples import build
from _properties_strategies import TORCH_DTYPES, budget, explicit, specs

pytestmark = pytest.mark.rung3


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


@counts_outcomes
@budget(15, shrink=False)
@given(case=split_specs(dtypes=TORCH_DTYPES, max_n=32, max_v=1000, layouts=True, refusable=True))
@example(case=(explicit("confident", "int64"), 150))
@example(case=(explicit("refused", "int64"), 150))
def test_vocab_parallel_exact_as_dense(vocab_parallel_worker, case):
    spec, split = case
    run = lambda: vocab_parallel_worker("A", spec, {"split": split})  # noqa: E731
    check_exact(run, build(spec), "torch-vocab-parallel", "torch-vocab-parallel")


@budget(8, shrink=False)
@given(case=split_specs(dtypes=("float32",), max_n=6, max_v=20, max_d=4))
def test_vocab_parallel_refuses_bad_input(vocab_parallel_worker, case):
    spec, split = case
    check_refused(lambda ex, i, o, m: vocab_parallel_worker("B", spec, {"split": split, "mutation": m}), spec)
