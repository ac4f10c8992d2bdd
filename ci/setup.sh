#!/usr/bin/env bash
# Builds (or reuses) the project environment in .venv at the repository root.
# Idempotent: it reinstalls only when pyproject.toml or ci/constraints.txt changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
stamp=.venv/.cutbce-setup-stamp
want=$(cat pyproject.toml ci/constraints.txt | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup] building .venv (first time: several minutes, about 7 GB: torch 2.9 + torch_xla + jax)" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -U pip
.venv/bin/python -m pip install -q --disable-pip-version-check \
  -c ci/constraints.txt -e '.[xla,examples,test]'
echo "$want" > "$stamp"
