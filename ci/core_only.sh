#!/usr/bin/env bash
# The core install, checked on its own, from the sdist a release would ship:
#   1. a second environment, .venv-core at the repository root (never .venv): torch 2.14.1, the top
#      of the package's torch bound, and numpy only -- no jax, no torch_xla, no example extras -- plus
#      the test extra;
#   2. `python -m build --sdist` of this checkout, installed into it with the test extra only;
#   3. the sdist's own tests/, run from the unpacked sdist with its source folders removed, so every
#      import of torch_cutbce is the installed package.
# The run fails on any error or failure: what the core install lacks must be skipped, with a reason
# (`pytest -rs` lists them). torch 2.14.1 is the newest release pip takes on these machines (a
# constraints file caps it), and the other end of the range from .venv's 2.9.0 (.venv-tpu tests
# 2.13.0). Its wheel lies on this machine's disk: a CUDA build (about 5.5 GB installed), which runs
# on the CPU; building the environment downloads only numpy, pytest, hypothesis, setuptools and build.
#
#   bash ci/core_only.sh            # build or reuse .venv-core, build the sdist, run its tests
#   bash ci/core_only.sh -k bad     # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
PY=${PYTHON:-python3.11}
venv=$root/.venv-core
stamp=$venv/.cutbce-core-stamp
core_torch=torch==2.14.1
want=$( (cat pyproject.toml ci/constraints.txt; echo "$core_torch") | sha256sum | cut -d' ' -f1)

pip_quiet() {
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored" || true; } >&2
}

# numpy, pytest and hypothesis at the versions CI tests with; the torch, torch_xla, jax and flax
# pins of ci/constraints.txt describe .venv's set and are left out.
constraints=$(mktemp)
work=$(mktemp -d)
trap 'rm -rf "$work" "$constraints"' EXIT
grep -v -E '^(torch|torch_xla|jax|jaxlib|flax)==' ci/constraints.txt > "$constraints"

if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[core-only] building .venv-core (torch 2.14.1, numpy, the test extra; no jax, no torch_xla)" >&2
  rm -rf "$venv"
  "$PY" -m venv "$venv"
  wheels=()
  if [ -d /opt/wheels ]; then wheels=(--find-links /opt/wheels); fi
  # torch first, from the wheel on disk, so that the package's `torch` requirement is met by it.
  pip_quiet "${wheels[@]}" -c "$constraints" "$core_torch" 'setuptools>=77' build
  echo "$want" > "$stamp"
fi

# --no-isolation: the build backend is .venv-core's setuptools, so a run downloads nothing.
"$venv/bin/python" -m build --sdist --no-isolation --outdir "$work/dist" . >"$work/build.log" 2>&1 \
  || { cat "$work/build.log" >&2; exit 1; }
sdist=$(ls "$work"/dist/torch_cutbce-*.tar.gz)
# The core install plus the test extra, as a user would: `pip install torch-cutbce[test]` (its
# dependencies come from the sdist's metadata; what is installed already is kept). Uninstalled
# first: the version number does not change between runs, so pip would keep the last build.
"$venv/bin/python" -m pip uninstall -q -y torch-cutbce >/dev/null 2>&1 || true
pip_quiet --no-build-isolation -c "$constraints" "$sdist[test]"
tar -xzf "$sdist" -C "$work"
unpacked=$(ls -d "$work"/torch_cutbce-*/)
rm -rf "$unpacked/torch_cutbce" "$unpacked/jax_kernels" "$unpacked/cutbce_common"

# The environment must really lack the extras, or import-time dependencies would go unnoticed.
# (Run from the unpacked sdist: from the checkout, `import torch_cutbce` would find the source.)
(cd "$unpacked" && "$venv/bin/python" - <<'PY'
import importlib.util, sys
extras = ("jax", "jaxlib", "torch_xla", "flax", "tqdm", "matplotlib")
present = [name for name in extras if importlib.util.find_spec(name)]
if present:
    sys.exit(f"[core-only] {present} are installed in .venv-core; this check needs an environment without the extras")
import torch, torch_cutbce
print(f"[core-only] torch {torch.__version__}; torch_cutbce imported from {torch_cutbce.__file__}")
PY
)

report=$work/report.txt
set +e
# -m 'not slow': the one slow test (test_torch_native_memory.py, a minute) measures memory against V, not the
# install; the main suite runs it.
# -n: the test files spread over the cores (pytest-xdist, from the test extra), as in ci/test.sh.
(cd "$unpacked" && PJRT_DEVICE=CPU "$venv/bin/python" -m pytest -q -p no:cacheprovider -rs -m "not slow" \
   -n "${CUTBCE_TEST_WORKERS:-auto}" --dist loadfile tests "$@") \
  | tee "$report"
status=${PIPESTATUS[0]}
set -e
summary=$(tail -n 1 "$report")
# pytest exits 1 on failures, 2 on collection errors, 5 when nothing ran.
if [ "$status" -ne 0 ] || grep -qE '[0-9]+ (failed|errors?)' <<<"$summary"; then
  echo "[core-only] FAIL: the core install must pass or skip every test; got: $summary" >&2
  exit 1
fi
echo "[core-only] ok: $summary" >&2
