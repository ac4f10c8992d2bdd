#!/usr/bin/env bash
# The README's first command, as CI runs it: build/reuse .venv, then train SASRec on MovieLens-100K
# (downloaded into the cache on first use) on CPU twice, same seed and epochs: with CutBCE over the
# full catalog, and with the sampled BCE of common PyTorch SASRec code (1 negative per position).
# Prints full-catalog HR@10 and NDCG@10 of both next to the popularity baseline. Fails if CutBCE
# does not beat popularity by 20%; the sampled baseline is reported, never a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
out=${CUTBCE_OUT_DIR:-runs/ci-default}
rm -rf "$out"
time .venv/bin/python examples/train.py --out-dir "$out/cutbce"
time .venv/bin/python examples/train.py --loss sampled --negatives 1 --out-dir "$out/sampled"
.venv/bin/python - "$out" <<'PY'
import json, sys
from pathlib import Path
cut, sampled = (json.loads((Path(sys.argv[1]) / run / "metrics.json").read_text()) for run in ("cutbce", "sampled"))
pop = cut["popularity"]["test"]
rows = [(f"SASRec + CutBCE (full catalog, k = {cut['config']['k']})", cut["test"], cut),
        (f"SASRec + sampled BCE ({sampled['config']['negatives']} negative)", sampled["test"], sampled),
        ("popularity", pop, None)]
print(f"\ntest split, full ranking of {cut['data']['items']} items, {cut['config']['epochs']} epochs each:")
print(f"{'':44} {'HR@10':>7} {'NDCG@10':>8} {'wall s':>7} {'CPU s':>6}")
for name, metrics, run in rows:
    cost = f"{run['wall_s']:7.0f} {run['cpu_s']:6.0f}" if run else f"{'':7} {'':6}"
    print(f"{name:44} {metrics['HR@10']:7.4f} {metrics['NDCG@10']:8.4f} {cost}")
for name in ("HR@10", "NDCG@10"):
    if not cut["test"][name] > 1.2 * pop[name]:
        sys.exit(f"FAIL: CutBCE {name} {cut['test'][name]:.4f} does not beat popularity {pop[name]:.4f} by 20%")
PY
