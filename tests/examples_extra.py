"""What the examples' tests need before they import `examples`: the folder on the path (it is a
folder of scripts, not an installed package) and the [examples] extra (the training script's
progress bar and curves); without the extra the test module is skipped, naming the install."""

import sys
from pathlib import Path

import pytest

EXAMPLES_EXTRA = "examples/train.py needs the [examples] extra: pip install 'torch-cutbce[examples]'"


def require_examples(extra: bool = True) -> None:
    """Put the repository root on sys.path and, with `extra`, skip the calling module without tqdm
    and matplotlib."""
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    if extra:
        for module in ("tqdm", "matplotlib"):
            pytest.importorskip(module, reason=EXAMPLES_EXTRA)
