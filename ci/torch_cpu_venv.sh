# Sourced by the scripts that test an integration against the real package in an environment of its
# own (ci/replay.sh, ci/rectools.sh): Python 3.11 (PYTHON overrides), the CPU build of torch 2.13.0
# (from /opt/wheels where a machine has it, else from PyTorch's CPU index) and the packages asked
# for, at the versions of the script's constraints file. Built the first time, and again only when
# that file, the script or this one changed (a stamp in the environment).
#
#   torch_cpu_venv NAME VENV CONSTRAINTS SCRIPT PACKAGE...

pip_quiet() {  # VENV ARG...: pip install, quiet; pip here warns about mirror folders it skips
  local venv=$1
  shift
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored" || true; } >&2
}

torch_cpu_venv() {
  local name=$1 venv=$2 constraints=$3 script=$4
  shift 4
  local stamp=$venv/.cutbce-$name-stamp want source
  want=$(cat "$constraints" "$script" ci/torch_cpu_venv.sh | sha256sum | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return
  fi
  echo "[$name] building $venv (torch 2.13.0+cpu, $*; a minute or two)" >&2
  rm -rf "$venv"
  "${PYTHON:-python3.11}" -m venv "$venv"
  if compgen -G "/opt/wheels/torch-2.13.0+cpu-*.whl" >/dev/null; then
    source=(--find-links /opt/wheels)
  else
    source=(--extra-index-url https://download.pytorch.org/whl/cpu)
  fi
  pip_quiet "$venv" "${source[@]}" -c "$constraints" 'torch==2.13.0+cpu' "$@"
  echo "$want" > "$stamp"
}
