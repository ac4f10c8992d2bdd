#!/usr/bin/env bash
# The RecTools integration (torch_cutbce.integrations.rectools) against the real package, and the core
# on numpy 1.x, in .venv-rectools at the repository root: Python 3.11, rectools[torch] 0.19.0 with the
# CPU build of torch 2.13.0, pytorch-lightning 2.5 and numpy 1.26, exactly the versions of
# ci/rectools-constraints.txt, plus pytest and hypothesis (built by ci/torch_cpu_venv.sh); torch_cutbce
# from this checkout (PYTHONPATH, no install). Then, there: tests/test_integrations_rectools.py (SASRec
# and BERT4Rec against a float64 dense BCE, Lightning fits, recommend(), the validation split,
# save/load) and the core files below, which need torch and numpy only: the library's numpy 1.x check.
#
#   bash ci/rectools.sh              # build or reuse .venv-rectools, run the tests
#   bash ci/rectools.sh -k bert4rec  # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-rectools
source ci/torch_cpu_venv.sh
torch_cpu_venv rectools "$venv" ci/rectools-constraints.txt ci/rectools.sh 'rectools[torch]' numpy pytest hypothesis
"$venv/bin/python" -c 'import rectools, torch, numpy, pytorch_lightning as pl; print(f"[rectools] rectools {rectools.__version__}, torch {torch.__version__}, numpy {numpy.__version__}, pytorch-lightning {pl.__version__}")' >&2

# -p no:cacheprovider as ci/test.sh; the conftest of tests/ needs pytest only. Deselected: a torch.compile
# check of the branch math (85 s of Inductor here, nothing of numpy; the main suite runs it).
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$venv/bin/python" -m pytest -q -p no:cacheprovider --durations=5 \
  tests/test_integrations_rectools.py \
  tests/test_reference.py tests/test_branch_math.py tests/test_neutral_options.py tests/test_torch_native.py \
  tests/test_torch_engines.py tests/test_torch_topk.py tests/test_special_rows.py tests/test_conformance_torch.py \
  --deselect tests/test_branch_math.py::test_torch_compiled_within_the_ulp_bound "$@"
