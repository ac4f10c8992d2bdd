#!/usr/bin/env bash
# The RecBole integration (torch_cutbce.integrations.recbole) against the real package, in .venv-recbole at
# the repository root: Python 3.11, recbole 1.2.1 with the CPU build of torch 2.13.0, numpy 1.26 and
# pandas 2.3, exactly the versions of ci/recbole-constraints.txt, plus pytest (built by
# ci/torch_cpu_venv.sh); torch_cutbce from this checkout (PYTHONPATH, no install). Then, there:
# tests/test_integrations_recbole.py (RecBole's SASRec and BERT4Rec against a float64 dense BCE, its
# Trainer with loss_type="CutBCE", full-sort and predict with the bias, save and load, the ML-100K
# example on a few users). ML-100K is the copy inside the recbole wheel: nothing is downloaded.
#
#   bash ci/recbole.sh              # build or reuse .venv-recbole, run the tests
#   bash ci/recbole.sh -k bert4rec  # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-recbole
source ci/torch_cpu_venv.sh
torch_cpu_venv recbole "$venv" ci/recbole-constraints.txt ci/recbole.sh recbole numpy pandas setuptools pytest
"$venv/bin/python" -c 'import recbole, torch, numpy, pandas; print(f"[recbole] recbole {recbole.__version__}, torch {torch.__version__}, numpy {numpy.__version__}, pandas {pandas.__version__}")' >&2

# -p no:cacheprovider as ci/test.sh; the conftest of tests/ needs pytest only.
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$venv/bin/python" -m pytest -q -p no:cacheprovider --durations=5 \
  tests/test_integrations_recbole.py "$@"
