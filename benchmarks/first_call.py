"""The first native call of a process: how long until the loss and its gradients are back.

    export TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)"
    .venv/bin/python benchmarks/first_call.py cold      # an empty inductor cache: the tiles compile
    .venv/bin/python benchmarks/first_call.py warm      # the same cache: loaded from disk, dynamo traces

N 4096, V 32,768, D 64, L 8, float32, 'mean', forward + backward (NOTES.md section 10).
"""

import sys
import time

start = time.perf_counter()
import torch  # noqa: E402

import torch_cutbce  # noqa: E402
from provenance import stamp  # noqa: E402
from torch_cutbce import fused_tile  # noqa: E402

hidden = torch.randn(4096, 64, requires_grad=True)
items = torch.randn(32768, 64, requires_grad=True)
targets = torch.randint(0, 32768, (4096, 8))
imported = time.perf_counter()
torch_cutbce.cut_bce_with_logits(hidden, items, targets).backward()
first = time.perf_counter()
torch_cutbce.cut_bce_with_logits(hidden, items, targets).backward()
second = time.perf_counter()
label = sys.argv[1] if len(sys.argv) > 1 else "run"
print(stamp())
print(f"{label}: import {imported - start:.1f} s, first call {first - imported:.1f} s "
      f"(compile {sum(fused_tile.compile_seconds().values()):.1f} s), second call {second - first:.2f} s")
