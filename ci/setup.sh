#!/usr/bin/env bash
# Builds (or reuses) the project environment in .venv at the repository root.
# Idempotent: it reinstalls only when pyproject.toml, ci/constraints.txt or
# ci/tpu-compile-constraints.txt changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
stamp=.venv/.cutbce-setup-stamp
want=$(cat pyproject.toml ci/constraints.txt ci/tpu-compile-constraints.txt | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

# pip on these machines warns about local mirror folders it skips; keep real errors visible.
pip_quiet() {
  .venv/bin/python -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored" || true; } >&2
}

echo "[setup] building .venv (first time: a few minutes and about 7 GB: torch 2.9, torch_xla, jax)" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip_quiet -U pip
# torch 2.9.0 (what torch_xla 2.9.0 is built against), torch_xla[pallas] with jax/jaxlib 0.7.1,
# flax for torch_xla's bundled torchax, and the example and test extras.
pip_quiet -c ci/constraints.txt -e '.[xla,examples,test]'
# torchvision, only for the focal loss's comparison with torchvision.ops.sigmoid_focal_loss
# (tests/test_option_definitions.py; skipped without it). --no-deps: it must not move torch off 2.9.0.
pip_quiet --no-deps -c ci/constraints.txt torchvision
# libtpu (about 350 MB) in a folder of its own, not in site-packages: JAX finds libtpu by importing
# it, so only processes that add this folder to PYTHONPATH (the compile-only TPU checks) see it; the
# rest of the suite, torch_xla included, keeps the CPU backend exactly as without it.
overlay=.venv/libtpu-overlay
rm -rf "$overlay"
pip_quiet --no-deps --target "$overlay" -r ci/tpu-compile-constraints.txt
echo "$want" > "$stamp"
echo "[setup] .venv ready" >&2
