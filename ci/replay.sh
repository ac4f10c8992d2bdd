#!/usr/bin/env bash
# The RePlay integration (torch_cutbce.integrations.replay) against the real package, in .venv-replay
# at the repository root: Python 3.11, replay-rec[torch] 0.22.0 with the CPU build of torch 2.13.0 and
# lightning 2.6, exactly the versions of ci/replay-constraints.txt, plus pytest; torch_cutbce from
# this checkout (PYTHONPATH, no install). Built the first time, and again only when that file or
# this script changed (a stamp, as ci/core_only.sh). The build downloads RePlay's dependencies
# (about 1.7 GB installed); the torch CPU wheel comes from /opt/wheels where a machine has it, else
# from PyTorch's CPU index. Then tests/test_integrations_replay.py runs there: RePlay's SasRec with
# CutBCE against RePlay's own BCE (float64 truth), its Lightning training, inference with the bias.
#
#   bash ci/replay.sh              # build or reuse .venv-replay, run the RePlay tests
#   bash ci/replay.sh -k padding   # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
venv=.venv-replay
stamp=$venv/.cutbce-replay-stamp
want=$(cat ci/replay-constraints.txt ci/replay.sh | sha256sum | cut -d' ' -f1)

pip_quiet() {
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored" || true; } >&2
}

if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[replay] building $venv (replay-rec 0.22.0, torch 2.13.0+cpu, lightning; about 1.5 min)" >&2
  rm -rf "$venv"
  "$PY" -m venv "$venv"
  if compgen -G "/opt/wheels/torch-2.13.0+cpu-*.whl" >/dev/null; then
    source=(--find-links /opt/wheels)
  else
    source=(--extra-index-url https://download.pytorch.org/whl/cpu)
  fi
  pip_quiet "${source[@]}" -c ci/replay-constraints.txt 'torch==2.13.0+cpu' 'replay-rec[torch]' pytest
  echo "$want" > "$stamp"
fi
"$venv/bin/python" -c 'import replay, torch, lightning; print(f"[replay] replay-rec {replay.__version__}, torch {torch.__version__}, lightning {lightning.__version__}")' >&2

# -p no:cacheprovider as ci/test.sh; the conftest of tests/ needs pytest only.
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$venv/bin/python" -m pytest -q -p no:cacheprovider --durations=5 \
  tests/test_integrations_replay.py "$@"
