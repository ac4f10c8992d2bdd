#!/usr/bin/env bash
# The RePlay integration (torch_cutbce.integrations.replay) against the real package, in .venv-replay
# at the repository root: Python 3.11, replay-rec[torch] 0.22.0 with the CPU build of torch 2.13.0 and
# lightning 2.6, exactly the versions of ci/replay-constraints.txt, plus pytest; torch_cutbce from
# this checkout (PYTHONPATH, no install). Built by ci/torch_cpu_venv.sh (RePlay's dependencies: about
# 1.7 GB installed). Then tests/test_integrations_replay.py runs there: RePlay's SasRec with CutBCE
# against RePlay's own BCE (float64 truth), its Lightning training, inference with the bias.
#
#   bash ci/replay.sh              # build or reuse .venv-replay, run the RePlay tests
#   bash ci/replay.sh -k padding   # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-replay
source ci/torch_cpu_venv.sh
torch_cpu_venv replay "$venv" ci/replay-constraints.txt ci/replay.sh 'replay-rec[torch]' pytest
"$venv/bin/python" -c 'import replay, torch, lightning; print(f"[replay] replay-rec {replay.__version__}, torch {torch.__version__}, lightning {lightning.__version__}")' >&2

# -p no:cacheprovider as ci/test.sh; the conftest of tests/ needs pytest only.
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$venv/bin/python" -m pytest -q -p no:cacheprovider --durations=5 \
  tests/test_integrations_replay.py "$@"
