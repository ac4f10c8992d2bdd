#!/usr/bin/env bash
# The README's test command: set up .venv (idempotent) and run the whole test suite on the CPU;
# then, for the full run (no arguments), the suites that need environments of their own, each built
# or reused by its script:
#   ci/core_only.sh   the sdist installed without extras into .venv-core (torch 2.13.0, no jax, no
#                     torch_xla): it must pass or skip every test;
#   ci/jax_newest.sh  the JAX suite on the newest JAX of the [jax] range, Python 3.12 (.venv-jax);
#   ci/torch_tpu.sh   the TorchTPU bridge's checks: torch 2.13, torch_tpu, jax 0.10.2, libtpu (.venv-tpu).
#   ci/replay.sh      the RePlay integration against replay-rec 0.22 (torch 2.13 CPU, lightning; .venv-replay);
#   ci/rectools.sh    the RecTools integration against rectools 0.19 and the core's torch-only tests on
#                     numpy 1.26 (torch 2.13 CPU; .venv-rectools);
#   ci/recbole.sh     the RecBole integration against recbole 1.2.1 (torch 2.13 CPU, numpy 1.26; .venv-recbole);
#   ci/docs.sh        the API reference and the guides as a site, mkdocs build --strict (.venv-docs).
# The full run starts with the linter (ruff, configured in pyproject.toml).
# Then the Triton kernels in Triton's interpreter (TRITON_INTERPRET=1, a process of its own).
# Arguments go to pytest and run only the main suite, in one process:
#   bash ci/test.sh tests/test_torch_native.py -k mean
# The full run spreads whole test files over the CPU cores (pytest-xdist, `--dist loadfile`: a file's
# module fixtures are built once; CUTBCE_TEST_WORKERS sets the count, 0 runs in one process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
export PJRT_DEVICE=${PJRT_DEVICE:-CPU}
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15)
if [ "$#" -gt 0 ]; then
  exec "${pytest[@]}" "$@"
fi
.venv/bin/ruff check .  # the linter first ([tool.ruff] in pyproject.toml): seconds, and it names the line
"${pytest[@]}" -n "${CUTBCE_TEST_WORKERS:-auto}" --dist loadfile tests
# The Triton kernels in Triton's interpreter (CPU tensors): a process of its own, since the
# interpreter is chosen when triton is first imported (in the run above these files skip).
TRITON_INTERPRET=1 "${pytest[@]}" -n "${CUTBCE_TEST_WORKERS:-auto}" --dist loadfile \
  tests/test_conformance_triton.py tests/test_triton_interpreter.py \
  tests/test_conformance_chunked.py tests/test_chunked.py
time bash ci/core_only.sh
time bash ci/jax_newest.sh
time bash ci/torch_tpu.sh
time bash ci/replay.sh
time bash ci/rectools.sh
time bash ci/recbole.sh
time bash ci/docs.sh
