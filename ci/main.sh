#!/usr/bin/env bash
# The README's first command, as CI runs it: build/reuse .venv, then train SASRec with CutBCE on
# MovieLens-100K (downloaded into the cache on first use) on CPU and print full-catalog HR@10 and
# NDCG@10 next to the popularity baseline. Fails if the model does not beat popularity.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
out=${CUTBCE_OUT_DIR:-runs/ci-default}
rm -rf "$out"
time .venv/bin/python examples/train.py --out-dir "$out"
.venv/bin/python - "$out/metrics.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
model, pop = m["test"], m["popularity"]["test"]
for name in ("HR@10", "NDCG@10"):
    print(f"{name}: SASRec+CutBCE {model[name]:.4f}  popularity {pop[name]:.4f}")
    if not model[name] > 1.2 * pop[name]:
        sys.exit(f"FAIL: {name} {model[name]:.4f} does not beat popularity {pop[name]:.4f} by 20%")
print(f"wall {m['wall_s']:.0f}s, CPU {m['cpu_s']:.0f}s, peak RSS {m['peak_rss_mib']:.0f} MiB")
PY
