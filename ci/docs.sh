#!/usr/bin/env bash
# The documentation site, as CI builds it: docs/ plus the API reference read from the docstrings
# (mkdocs.yml, docs/api.md), with `mkdocs build --strict`, so a warning fails the build: a broken
# `:::` name, or a docstring that documents an argument the signature does not have (griffe reads
# Google-style docstrings statically; neither torch nor jax is installed). Builds .venv-docs at the
# repository root (Python 3.11, exactly ci/docs-constraints.txt) the first time, and again only when
# that file or this script changed (a stamp, as ci/torch_cpu_venv.sh). The site lands in site/ (git-ignored).
#
#   bash ci/docs.sh              # build or reuse .venv-docs, build the site
#   bash ci/docs.sh serve        # or any other mkdocs command, e.g. a local preview
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
venv=.venv-docs
stamp=$venv/.cutbce-docs-stamp
want=$(cat ci/docs-constraints.txt ci/docs.sh | sha256sum | cut -d' ' -f1)

if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[docs] building $venv (mkdocs, mkdocstrings-python, mkdocs-material; about 20 s)" >&2
  rm -rf "$venv"
  "$PY" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r ci/docs-constraints.txt 2>&1 \
    | { grep -v "is ignored" || true; } >&2
  echo "$want" > "$stamp"
fi
if [ $# -eq 0 ]; then
  set -- build --strict
fi
NO_MKDOCS_2_WARNING=1 "$venv/bin/mkdocs" "$@"
