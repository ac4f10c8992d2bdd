"""What the CPU tile kernel compiles to at each x86-64 ISA level, without timing anything.

`cutbce_common/cpu_tile.c` is built for x86-64-v3 (AVX2 + FMA) and x86-64-v4 (AVX-512) with the
product's own flags (`cpu_tile_build.flags`), whatever CPU runs the test:

- the disassembly of `cutbce_tile` does its exp, divisions and multiply-adds on full vectors of
  that level (ymm / zmm registers), and no scalar float division is left anywhere in it;
- `cutbce_lanes()` reports the vector width the build chose (8 / 16 floats), where the host can run it;
- under valgrind's callgrind (instruction counts are repeatable on a loaded machine; valgrind runs
  AVX2 but not AVX-512), the v3 build spends at most 10 instructions per element of a rows + grad
  tile. The plain-loop kernel it replaced spent about 50 there: gcc 12 left it scalar for AVX2.
"""

from __future__ import annotations

import ctypes
import platform
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from cutbce_common import cpu_tile_build

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which("objdump") is None,
    reason="the ISA checks compile for x86-64 levels and read the code with objdump",
)
pytestmark = [pytestmark, pytest.mark.rung1]

LEVELS = {"x86-64-v3": ("ymm", 8, "avx2"), "x86-64-v4": ("zmm", 16, "avx512f")}
SOURCE = Path(cpu_tile_build.__file__).with_name("cpu_tile.c")


def _compiler() -> str:
    try:
        return cpu_tile_build.c_compiler()
    except cpu_tile_build.BuildError as error:
        pytest.skip(f"no C compiler: {error}")


def _build(march: str, folder: Path) -> Path:
    library = folder / f"cpu_tile-{march}.so"
    command = [_compiler(), *cpu_tile_build.flags(march), *cpu_tile_build.C_FLAGS, str(SOURCE), "-o", str(library)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return library


def _function_code(library: Path, name: str) -> list[str]:
    """The instructions of `name` (and of the OpenMP bodies outlined from it), one per line."""
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)], check=True,
                          capture_output=True, text=True).stdout
    functions = re.split(r"\n(?=[0-9a-f]+ <)", text)
    bodies = [f for f in functions if re.match(rf"[0-9a-f]+ <{name}(\._omp_fn\.\d+)?>:", f)]
    assert bodies, f"{name} not found in {library}"
    return [line for body in bodies for line in body.splitlines()[1:]]


def _host_has(flag: str) -> bool:
    try:
        return any(line.startswith("flags") and f" {flag} " in f"{line} " for line in open("/proc/cpuinfo"))
    except OSError:
        return False


@pytest.mark.parametrize("march", LEVELS)
def test_the_tile_runs_on_full_vectors(march, tmp_path):
    register, lanes, host_flag = LEVELS[march]
    code = _function_code(_build(march, tmp_path), "cutbce_tile")
    packed = {op: [line for line in code if re.search(rf"\b{op}\b.*%{register}", line)]
              for op in ("vdivps", "vfmadd\\w*ps", "vpslld")}
    for op, lines in packed.items():
        assert lines, f"{march}: no {op} on %{register} in cutbce_tile: the exp/sigmoid loop is not vectorized"
    scalar_divisions = [line for line in code if re.search(r"\bv?divss\b", line)]
    assert not scalar_divisions, f"{march}: scalar divisions left in cutbce_tile:\n" + "\n".join(scalar_divisions[:5])
    if _host_has(host_flag):
        assert ctypes.CDLL(str(tmp_path / f"cpu_tile-{march}.so")).cutbce_lanes() == lanes


@pytest.mark.skipif(shutil.which("valgrind") is None or not _host_has("avx2"), reason="needs valgrind and AVX2")
def test_the_avx2_build_spends_few_instructions_per_element(tmp_path):
    library = _build("x86-64-v3", tmp_path)
    driver = tmp_path / "driver.c"
    driver.write_text(textwrap.dedent("""
        #include <dlfcn.h>
        #include <stdio.h>
        #include <stdlib.h>
        typedef void (*tile_fn)(const float *, const float *, const float *, float *, float *, long, long, int);
        int main(int argc, char **argv) {
            void *lib = dlopen(argv[1], RTLD_NOW);
            if (!lib) { puts(dlerror()); return 1; }
            tile_fn tile = (tile_fn)dlsym(lib, "cutbce_tile");
            long n = atol(argv[2]), v = atol(argv[3]);
            float *z = malloc(n * v * sizeof(float)), *g = malloc(n * sizeof(float)), *rows = malloc(n * sizeof(float));
            for (long i = 0; i < n * v; ++i) z[i] = (float)((i * 2654435761u) % 2000) / 100.0f - 10.0f;
            for (long i = 0; i < n; ++i) g[i] = 1.0f;
            tile(z, 0, g, z, rows, n, v, 1);  /* rows and the gradient written over the logits */
            printf("%g\\n", rows[0]);
            return 0;
        }
    """))
    subprocess.run([_compiler(), "-O1", str(driver), "-o", str(tmp_path / "driver"), "-ldl"], check=True)

    def instructions(n, v):
        result = subprocess.run(
            ["valgrind", "--tool=callgrind", "--toggle-collect=cutbce_tile",
             f"--callgrind-out-file={tmp_path / 'callgrind.out'}", str(tmp_path / "driver"), str(library), str(n), str(v)],
            capture_output=True, text=True, check=True)
        return int(re.search(r"Collected : (\d+)", result.stderr).group(1))

    # The difference of two widths cancels the per-row and per-call overhead.
    per_element = (instructions(64, 4099) - instructions(64, 1027)) / (64 * 3072)
    assert per_element <= 10, f"{per_element:.1f} instructions per element: the AVX2 build is not vectorized"
