"""An option costs its type, its math, its oracles and its tests (issue 30): the footprint, held.

The loss options (`cutbce_common/loss.py`: `Loss` and its `Focal`) are read by name only in
the files that own them: the options type, the branch math of each language, the two dense
oracles, and the entries that take them as keyword arguments. Every other library file (engines,
launchers, kernels, the C kernel's gate, the bridges, the layouts) passes a `Loss` through
unopened, so its Python code holds none of their names (`tokenize`: code, not comments or
docstrings; module paths in imports are not names of options).
"""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torch_cutbce", "jax_kernels", "cutbce_common")
OPTION_NAMES = {"focal", "gamma", "alpha", "apply_class_balancing", "label_smoothing"}
# The files that may name an option: its type, its math per language, its oracles, its entries.
OWNERS = {
    "cutbce_common/focal.py", "cutbce_common/loss.py",  # the options type
    "jax_kernels/branch_math.py", "torch_cutbce/branch_math.py",  # the math, per language
    "torch_cutbce/triton/tile_math.py",  # and in Triton
    "jax_kernels/reference.py", "torch_cutbce/reference.py",  # the two float64 oracles
    "jax_kernels/api.py", "torch_cutbce/functional.py", "torch_cutbce/module.py",  # the entries' keywords
}
MAX_FILES_PER_OPTION = 8


def library_files(suffixes=(".py", ".c", ".cc")) -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*") if p.suffix in suffixes)


def option_names_in_code(path: Path) -> list[tuple[int, str]]:
    """`(line, name)` of every option name among the code tokens of a Python file (imports' module
    paths left out)."""
    found, in_import = [], False
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type == tokenize.NAME and token.string in ("import", "from"):
            in_import = token.string == "from" or in_import
        if token.type in (tokenize.NEWLINE, tokenize.NL):
            in_import = False
        if token.type == tokenize.NAME and token.string in OPTION_NAMES and not in_import:
            found.append((token.start[0], token.string))
    return found


def test_engine_code_names_no_option():
    """Engines, launchers, kernels, bridges and layouts hand the `Loss` on whole."""
    leaks = {str(p.relative_to(ROOT)): option_names_in_code(p) for p in library_files((".py",))
             if str(p.relative_to(ROOT)) not in OWNERS}
    leaks = {path: names for path, names in leaks.items() if names}
    assert not leaks, f"option names outside their owners (pass the Loss whole instead): {leaks}"


def test_label_smoothing_lives_in_at_most_eight_library_files():
    """The option added last, by text (comments too): a measure of what the next one costs."""
    files = [str(p.relative_to(ROOT)) for p in library_files() if "label_smoothing" in p.read_text()]
    assert len(files) <= MAX_FILES_PER_OPTION, files
    assert set(files) <= OWNERS, set(files) - OWNERS


def test_the_scan_sees_a_leak(tmp_path):
    """The token scan is not blind: a name in code counts, the same word in a comment or a
    docstring or an import path does not."""
    sample = tmp_path / "sample.py"
    sample.write_text('"""focal in a docstring."""\nfrom cutbce_common.focal import Focal\n'
                      "# gamma in a comment\nx = options.loss.focal\n")
    assert option_names_in_code(sample) == [(4, "focal")]
