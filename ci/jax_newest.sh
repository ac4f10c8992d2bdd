#!/usr/bin/env bash
# The JAX suite on the newest JAX of the [jax] extra's tested range (pyproject.toml), in .venv-jax:
# Python 3.12 (jax 0.12 needs it), exactly the versions of ci/jax-newest-constraints.txt, and no
# torch (PyPI's torch is a CUDA build of several GB): the float64 oracle is then
# jax_kernels.dense_cut_bce and the comparisons with torch's paths skip (tests/parity.py).
# Builds .venv-jax the first time, and again only when that file or this script changed (a stamp,
# as ci/setup.sh). .venv (jax 0.7.1) runs the same tests in ci/test.sh.
#
# With no arguments, a lean selection for CI:
#   - the blocked engine against the float64 oracle: every option in float64 and float32, under jit,
#     the one-pass gradient, mixed dtypes (blocked and Pallas);
#   - the Pallas kernels in interpret mode, forward and backward, float32 and bfloat16;
#   - the sharded path on 8 simulated devices (Auto, Explicit and make_mesh's default meshes);
#   - beside it, the compile-only TPU build of every kernel variant (tests/_tpu_compile_worker.py:
#     136 programs a chip) for v5e, v6e and tpu7x with libtpu 0.0.50.1, no Mosaic pin, in
#     .venv-jax/libtpu-overlay; any failed compile fails the script. .venv compiles v4, v5e and v5p
#     with libtpu 0.0.20 (tests/test_jax_pallas_tpu_compile.py), which knows no TPU7x.
# Measured on the shared host (AMD EPYC Zen 3, 2 cores, other jobs running): the first build
# 1 min 14 s (1.3 GB, libtpu 640 MB of it), a rebuild after a change of this script 15 s. The run,
# at load 3.6-4.5: pytest 9 min 21 s, the compile-only worker 11 min 50 s beside it (412 programs,
# 0 failed), 12 min 8 s in all (8 min 15 s of CPU); at load 4-8, 8 min 36 s, 10 min 52 s and
# 11 min 13 s. The worker costs about 1 min 25 s of CPU a chip (4-5 min for three), about what
# pytest costs: on an idle host each has a core. With the one v5e of before: 6 min 1 s at load 3-4.
# Arguments go to pytest in place of that selection, e.g. the compile-only test file:
#   bash ci/jax_newest.sh tests/test_jax_pallas_tpu_compile.py
set -euo pipefail
cd "$(dirname "$0")/.."

python312() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  if python3.12 -c '' 2>/dev/null; then command -v python3.12; return; fi
  # pyenv's shim names python3.12 but runs it only where a 3.12 is selected.
  if command -v pyenv >/dev/null; then
    local version
    version=$(pyenv versions --bare | grep -E '^3\.12(\.|$)' | tail -1)
    if [ -n "$version" ]; then PYENV_VERSION=$version pyenv which python3.12; return; fi
  fi
  echo "ci/jax_newest.sh: needs Python 3.12; set PYTHON=/path/to/python3.12" >&2
  exit 1
}

# pip on these machines warns about local mirror folders it skips; keep real errors visible.
pip_quiet() {
  .venv-jax/bin/python -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored" || true; } >&2
}

stamp=.venv-jax/.cutbce-jax-newest-stamp
want=$(cat ci/jax-newest-constraints.txt ci/jax_newest.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[jax-newest] building .venv-jax (first time: about a minute and 1.3 GB, libtpu included)" >&2
  [ -x .venv-jax/bin/python ] || "$(python312)" -m venv .venv-jax
  pip_quiet -c ci/jax-newest-constraints.txt jax jaxlib flatbuffers numpy pytest hypothesis
  # libtpu in a folder of its own, as ci/setup.sh does for .venv: only the compile-only processes
  # put it on PYTHONPATH (benchmarks/tpu_compile.py finds it beside the running environment).
  overlay=.venv-jax/libtpu-overlay
  rm -rf "$overlay"
  pip_quiet --no-deps --target "$overlay" -c ci/jax-newest-constraints.txt libtpu
  echo "$want" > "$stamp"
fi
.venv-jax/bin/python -c 'import jax, sys; print(f"[jax-newest] Python {sys.version.split()[0]}, jax {jax.__version__}")' >&2

pytest=(.venv-jax/bin/python -m pytest -q -p no:cacheprovider --durations=10)
if [ "$#" -gt 0 ]; then
  exec "${pytest[@]}" "$@"
fi

# Compile-only: tests/test_jax_pallas_tpu_compile.py in this environment, in a pytest process beside
# the selection below (each mostly keeps one core busy), reported after it. Here its worker compiles
# every kernel variant for v5e, v6e and tpu7x (`_tpu_compile_worker.chips_here()`: NEWEST_CHIPS where
# the overlay's libtpu knows tpu7x; .venv compiles v4, v5e and v5p) and the test fails on any failed
# or missing compile. First: the overlay must know tpu7x, or the file would quietly take the old chips.
.venv-jax/bin/python -c '
import sys; sys.path.insert(0, "tests")
import _tpu_compile_worker as worker
from benchmarks import tpu_compile
assert worker.chips_here() == worker.NEWEST_CHIPS, f"libtpu {tpu_compile.libtpu_version()} in {tpu_compile.OVERLAY} does not know tpu7x"
'
compile_log=$(mktemp)
"${pytest[@]}" tests/test_jax_pallas_tpu_compile.py > "$compile_log" 2>&1 &
compile_pid=$!

# pytest's -k takes one line: the selection above, joined with 'or'.
selection=(
  "(matches_oracle and (float64 or float32) and all)" jit one_pass value_and_grad mixed_dtypes  # blocked
  float32_matches_float64_oracle bfloat16_no_worse single_item_confident                      # Pallas
  test_jax_sharded                                                                             # sharded
)
keywords=$(printf ' or %s' "${selection[@]}")
status=0
"${pytest[@]}" tests/test_jax_blocked.py tests/test_jax_pallas.py tests/test_jax_sharded.py -k "${keywords# or }" \
  || status=$?
compile_status=0
wait "$compile_pid" || compile_status=$?
cat "$compile_log"
rm -f "$compile_log"
exit $(( status != 0 ? status : compile_status ))
