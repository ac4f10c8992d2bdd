#!/usr/bin/env bash
# The TorchTPU bridge's checks (tests/test_torch_tpu_bridge.py, and its multi-chip route on a fake process
# group, tests/test_torch_tpu_dtensor.py), and the static TPU cost model's check against libtpu 0.0.52's
# simulator (tests/test_tpu_cost.py), in their own environment, .venv-tpu:
# torch 2.13 (CPU), torch_tpu, jax/jaxlib 0.10.2 and libtpu (ci/torch-tpu-constraints.txt). Builds
# it when missing or when the pins changed (a stamp, as ci/setup.sh), then runs the test file in a
# pytest process of its own: TorchTPU autoloads when torch is imported unless
# TORCH_DEVICE_BACKEND_AUTOLOAD=0, and an autoloaded TorchTPU off a TPU tries to find a device.
# The repository is installed editable with the [torch-tpu,test] extras. Arguments go to pytest:
#   bash ci/torch_tpu.sh -k opcheck
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
stamp=.venv-tpu/.cutbce-torch-tpu-stamp
want=$(cat ci/torch-tpu-constraints.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if ! { [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; }; then
  echo "[torch_tpu] building .venv-tpu (torch 2.13 CPU, torch_tpu, jax 0.10.2, libtpu)" >&2
  [ -x .venv-tpu/bin/python ] || "$PY" -m venv .venv-tpu
  pip_quiet() {
    .venv-tpu/bin/python -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored" || true; } >&2
  }
  # The CPU build of torch from /opt/wheels where present (these machines keep it there); elsewhere
  # pip takes torch 2.13.0 from the index (on Linux x86_64 a CUDA build, several GB more).
  wheels=()
  if [ -d /opt/wheels ]; then wheels=(--find-links /opt/wheels); fi
  # The [torch-tpu] and [test] extras, resolved against the pins: what a user's
  # `pip install 'torch-cutbce[torch-tpu]'` gets, at the versions CI tests.
  pip_quiet "${wheels[@]}" -c ci/torch-tpu-constraints.txt -r ci/torch-tpu-constraints.txt -e '.[torch-tpu,test]'
  echo "$want" > "$stamp"
  echo "[torch_tpu] .venv-tpu ready" >&2
fi
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONWARNINGS="ignore:<TorchTpu/Performance/TcMalloc/"
unset JAX_PLATFORMS  # the test module sets cpu for itself; its compile-only child needs the TPU plugin
.venv-tpu/bin/python -m pytest -q -p no:cacheprovider --durations=10 tests/test_torch_tpu_bridge.py tests/test_torch_tpu_dtensor.py \
  tests/test_tpu_cost.py "$@"
