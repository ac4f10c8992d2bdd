#!/usr/bin/env bash
# The README's test command: set up .venv (idempotent) and run the whole test suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
export PJRT_DEVICE=${PJRT_DEVICE:-CPU}
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 tests "$@"
