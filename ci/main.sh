#!/usr/bin/env bash
# The README's first command, as CI runs it: build/reuse .venv, then train SASRec on MovieLens-100K
# (downloaded into the cache on first use) on CPU twice, same seed and epochs: with CutBCE over the
# full catalog, and with the sampled BCE of common PyTorch SASRec code (1 negative per position).
# Prints full-catalog HR@10 and NDCG@10 of both next to the popularity baseline, and their difference
# with its uncertainty. Fails if CutBCE does not beat popularity by 20%; the sampled baseline is
# reported, never a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
out=${CUTBCE_OUT_DIR:-runs/ci-default}
rm -rf "$out"
time .venv/bin/python examples/train.py --out-dir "$out/cutbce"
time .venv/bin/python examples/train.py --loss sampled --negatives 1 --out-dir "$out/sampled"
# Both runs beside popularity, and CutBCE minus sampled BCE per metric with a 95% paired bootstrap
# interval over the test users (examples/compare.py): one seed, so an interval with 0 in it is a tie.
.venv/bin/python examples/compare.py "$out/cutbce" "$out/sampled"
.venv/bin/python - "$out" <<'PY'
import json, sys
from pathlib import Path
cut = json.loads((Path(sys.argv[1]) / "cutbce" / "metrics.json").read_text())
pop = cut["popularity"]["test"]
for name in ("HR@10", "NDCG@10"):
    if not cut["test"][name] > 1.2 * pop[name]:
        sys.exit(f"FAIL: CutBCE {name} {cut['test'][name]:.4f} does not beat popularity {pop[name]:.4f} by 20%")
PY
