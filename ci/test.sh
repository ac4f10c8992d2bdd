#!/usr/bin/env bash
# The README's test command: set up .venv (idempotent) and run the whole test suite on the CPU;
# then, for the full run (no arguments), the core-only check: the sdist installed without extras
# into .venv-core (torch 2.13.0, no jax, no torch_xla) must pass or skip every test
# (ci/core_only.sh). Arguments go to pytest and run only the main suite:
#   bash ci/test.sh tests/test_l1_native_torch.py -k mean
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
export PJRT_DEVICE=${PJRT_DEVICE:-CPU}
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 tests "$@"
if [ "$#" -eq 0 ]; then
  time bash ci/core_only.sh
fi
