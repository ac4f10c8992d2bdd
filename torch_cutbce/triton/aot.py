"""Ahead-of-time compiles of the Triton kernels for CUDA targets, without a GPU or a driver.

What a launch would run is built here from the launcher's own flags (`launch.kernel_constexprs`) and
the argument attributes Triton's JIT gives it (`launch_attributes`):
`compile_case` turns a `Case` (pass, dtype, `Loss`, hidden size, target, `Blocks`, optional inputs)
into Triton's `ASTSource` and compiles it for `GPUTarget("cuda", capability, 32)`; `usage` runs the
ptxas bundled with Triton (`-v`) on its PTX for the registers and spill bytes, and reads the shared
memory Triton reserves (`metadata.shared`) and counts the matrix instructions in the PTX
(`instruction_class`); `check` compares them with the budget: no spill bytes, shared memory within
the target's per-block limit, and the instruction class the target's fast path needs (`FAST_PATH`:
Hopper's warpgroup MMA on sm_90, Ampere's `mma.sync` on sm_80 for 16-bit inputs; no tensor-core
instruction for float32, whose products stay IEEE).

    python -m torch_cutbce.triton.aot                 # the table of the shipped configurations
    python -m torch_cutbce.triton.aot --dump-ptx DIR  # their PTX: <kernel>.<pass>.<dtype>.d<D>.sm_<cap>.ptx
    python -m torch_cutbce.triton.aot --model         # the cost model (`cost_model.py`): a model, not a measurement

tests/test_triton_compile.py checks every shipped configuration.

Shared memory per block, NVIDIA's CUDA C++ Programming Guide, "Compute Capabilities", technical
specifications table (maximum shared memory per thread block, opt-in): 163 KiB = 166,912 bytes on
compute capability 8.0 (A100) and 227 KiB = 232,448 bytes on 9.0 (H100, H200). Capability 9.0
compiles for `sm_90a`, as Triton does.

A failure names the pass and its kernel, the dtype, the `Loss` form, the hidden size, the `Blocks`,
the target and what failed: `ResourceError`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from cutbce_common.focal import Focal
from cutbce_common.loss import Loss
from torch_cutbce.triton import cost_model, kernels, launch

CAPABILITIES = (80, 90)
GPU_NAMES = {80: "sm_80", 90: "sm_90a"}
SHARED_LIMIT_BYTES = {80: 166_912, 90: 232_448}  # module docstring
TYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# The hidden sizes a shipped configuration is checked at: one block of 64 and of 128 columns (the
# hidden block held for the whole walk), and 256 (two blocks: the logits recomputed per block).
HIDDEN_SIZES = (64, 128, 256)
TABLE_LOSS = Loss(Focal(1.5, 0.3, True), 0.2)  # focal with a fractional gamma, balanced, smoothed: the most code
# The instruction class a kernel's products must lower to, per input dtype and capability: Hopper's
# warpgroup MMA (`wgmma.mma_async`, HGMMA in SASS) on sm_90, where Ampere's `mma.sync` runs below its
# rate; `mma.sync` on sm_80; float32 (input_precision="ieee") on no tensor core at all ("fma": TF32
# would show as `mma.sync` or `wgmma` with `.tf32` operands).
FAST_PATH = {(dtype, capability): ("fma" if dtype == torch.float32 else "wgmma" if capability >= 90 else "mma.sync")
             for dtype in (torch.float32, torch.bfloat16, torch.float16) for capability in CAPABILITIES}


@dataclasses.dataclass(frozen=True)
class Case:
    """One compile: a pass (`launch.PASSES`) of its kernel for inputs of `dtype`.

    `blocks` None is the shipped `launch.blocks_for(pass_name, dtype, capability)`; the optional inputs (bias,
    class_weight, pos_weight) are all present by default, the costliest form of each kernel.
    `one_label`: one id slot per position (L = 1, next-item targets), which Triton's JIT makes a
    constant at launch (an integer argument equal to 1), so a compile of its own.
    """

    pass_name: str
    dtype: torch.dtype
    loss: Loss
    hidden_size: int
    capability: int
    blocks: launch.Blocks | None = None
    has_bias: bool = True
    has_class_weight: bool = True
    has_pos_weight: bool = True
    one_label: bool = False

    @property
    def kernel(self):
        return kernels.item_kernel if self.pass_name == "items" else kernels.row_kernel

    @property
    def launch_blocks(self) -> launch.Blocks:
        return self.blocks or launch.blocks_for(self.pass_name, self.dtype, self.capability)

    def outputs(self) -> dict[str, bool]:
        if self.pass_name == "items":
            return launch.item_outputs(True, True)
        return launch.row_outputs(self.pass_name != "grad", self.pass_name != "grad", self.pass_name != "rows")

    def constexprs(self) -> dict:
        flags = launch.kernel_constexprs(self.dtype, self.loss, self.launch_blocks, self.hidden_size,
                                         has_bias=self.has_bias, has_class_weight=self.has_class_weight,
                                         has_pos_weight=self.has_pos_weight, outputs=self.outputs())
        return dict(flags, L=1) if self.one_label else flags

    def describe(self) -> str:
        b = self.launch_blocks
        optional = [name for name, present in (("bias", self.has_bias), ("class_weight", self.has_class_weight),
                                               ("pos_weight", self.has_pos_weight)) if present]
        return (f"{self.kernel.fn.__name__} pass={self.pass_name} dtype={TYPE_NAMES[self.dtype]} "
                f"form={tuple(self.loss.form())} D={self.hidden_size} block_n={b.block_n} block_v={b.block_v} "
                f"BLOCK_D={b.block_d(self.hidden_size)} block_k={b.block_k} num_warps={b.num_warps} "
                f"num_stages={b.num_stages} "
                f"optional={'+'.join(optional) or 'none'}{' L=1' if self.one_label else ''} "
                f"arch={GPU_NAMES[self.capability]}")


@dataclasses.dataclass(frozen=True)
class Usage:
    """What one compiled kernel takes per program (thread block)."""

    registers: int  # per thread
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int  # Triton's `metadata.shared`
    wgmma: int = 0  # `wgmma.mma_async` instructions in the PTX
    mma_sync: int = 0  # `mma.sync` instructions in the PTX

    @property
    def instruction_class(self) -> str:
        """'wgmma', 'mma.sync', 'fma' (no matrix instruction) or 'mixed' (both: one product on the slow path)."""
        if self.wgmma and self.mma_sync:
            return "mixed"
        return "wgmma" if self.wgmma else "mma.sync" if self.mma_sync else "fma"


class ResourceError(RuntimeError):
    """A configuration that spills or overflows the target's shared memory (the message says which)."""


def signature(kernel, dtype: torch.dtype, constexprs: dict) -> dict[str, str]:
    """Triton's signature of `kernel`: the inputs' pointers in `dtype`, ids and counts int32, `d_hidden`
    float64 (its carry across chunks), every other pointer float32, sizes int32 (the `Loss`'s numbers: a float32 pointer)."""
    types = {}
    for name in kernel.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in ("h_ptr", "w_ptr"):
            types[name] = "*" + TYPE_NAMES[dtype]
        elif name in ("ids_ptr", "counts_ptr"):
            types[name] = "*i32"
        elif name == "dh_ptr":
            types[name] = "*fp64"
        elif name.endswith("_ptr"):
            types[name] = "*fp32"
        elif name in ("N", "V", "D", "L"):
            types[name] = "i32"
        else:
            types[name] = "fp32"
    return types


def launch_attributes(kernel, types: dict[str, str], hidden_size: int) -> dict:
    """The argument attributes Triton's JIT gives a launch: `JITFunction.run` marks a pointer whose
    address, and an integer whose value, is a multiple of 16 (`tt.divisibility` 16). Here, for
    contiguous operands with D a multiple of 16: every pointer (fresh allocations, and views that
    start on a whole row of such a D), and D when it is one; N, V and L are not assumed. Without
    them the tiles' loads are per element (a 64-bit address each), not 16-byte vectors, and not
    pipelined: another program than the one a launch runs. Other hidden sizes compile without D's
    hint, as their launches do."""
    hinted = [name for name, kind in types.items() if kind.startswith("*")]
    if hidden_size % 16 == 0:
        hinted.append("D")
    names = list(kernel.arg_names)
    return {(names.index(name),): [["tt.divisibility", 16]] for name in hinted}


def compile_case(case: Case):
    """Triton's `CompiledKernel` of `case` (its PTX in `.asm["ptx"]`), specialized as its launch is
    (`launch_attributes`); no device is touched."""
    constexprs = case.constexprs()
    types = signature(case.kernel, case.dtype, constexprs)
    source = ASTSource(fn=case.kernel, signature=types, constexprs=constexprs,
                       attrs=launch_attributes(case.kernel, types, case.hidden_size))
    return triton.compile(source, target=GPUTarget("cuda", case.capability, 32),
                          options=launch.compile_options(case.launch_blocks))


def ptxas_path() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def ptx_name(case: Case) -> str:
    """`<kernel>.<pass>.<dtype>.d<D>.sm_<cap>.ptx`, the `--dump-ptx` file of `case`."""
    return (f"{case.kernel.fn.__name__}.{case.pass_name}.{TYPE_NAMES[case.dtype]}.d{case.hidden_size}"
            f".sm_{case.capability}.ptx")


def matrix_instructions(ptx: str) -> tuple[int, int]:
    """`(wgmma.mma_async, mma.sync)` instructions in `ptx`."""
    return len(re.findall(r"\bwgmma\.mma_async\b", ptx)), len(re.findall(r"\bmma\.sync\b", ptx))


def usage(compiled, capability: int) -> Usage:
    """Registers and spill bytes from `ptxas -v` on the compiled PTX, Triton's shared bytes and the
    PTX's matrix instructions."""
    with tempfile.TemporaryDirectory() as folder:
        ptx = os.path.join(folder, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        result = subprocess.run([ptxas_path(), "-v", f"--gpu-name={GPU_NAMES[capability]}", ptx, "-o",
                                 os.path.join(folder, "kernel.cubin")], capture_output=True, text=True)
    if result.returncode:
        raise ResourceError(f"ptxas failed ({result.returncode}): {result.stderr.strip()}")
    number = lambda pattern: int(re.search(pattern, result.stderr).group(1))  # noqa: E731
    return Usage(number(r"Used (\d+) registers"), number(r"(\d+) bytes spill stores"),
                 number(r"(\d+) bytes spill loads"), int(compiled.metadata.shared),
                 *matrix_instructions(compiled.asm["ptx"]))


def measure(case: Case) -> Usage | Exception:
    """`case` compiled and measured, or what went wrong (returned, so that a pool's other cases go on)."""
    try:
        return usage(compile_case(case), case.capability)
    except Exception as error:  # noqa: BLE001 (Triton's own: e.g. out of resources, an invalid layout)
        return error


def measure_all(cases: list[Case], workers: int | None = None) -> list[Usage | Exception]:
    """`measure` of each case, over `workers` processes (default: the CPUs this process may use)."""
    return _spawned_map(measure, cases, workers)


def _spawned_map(call, cases: list, workers: int | None = None) -> list:
    """`[call(case) for case in cases]` over `workers` processes (default: the CPUs this process may
    use), in order. Spawned, not forked: the caller may hold torch's thread pools."""
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if workers <= 1 or len(cases) <= 1:
        return [call(case) for case in cases]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(workers, len(cases)), mp_context=context) as pool:
        return list(pool.map(call, cases, chunksize=4))


def failures(case: Case, found: Usage) -> list[str]:
    """What `found` breaks of `case`'s budget (empty: within it)."""
    problems = []
    if found.spill_store_bytes or found.spill_load_bytes:
        problems.append(f"spills {found.spill_store_bytes} bytes stored / {found.spill_load_bytes} loaded "
                        f"({found.registers} registers)")
    limit = SHARED_LIMIT_BYTES[case.capability]
    if found.shared_bytes > limit:
        problems.append(f"needs {found.shared_bytes} bytes of shared memory (the limit per block is {limit})")
    return problems


def off_the_fast_path(case: Case, found: Usage) -> str | None:
    """What is wrong with `found`'s instruction class for `case` (`FAST_PATH`), or None."""
    wanted = FAST_PATH[case.dtype, case.capability]
    if found.instruction_class == wanted:
        return None
    return (f"{case.describe()}: its products lower to {found.instruction_class} ({found.wgmma} wgmma.mma_async, "
            f"{found.mma_sync} mma.sync), not {wanted}")


def check(case: Case, found: Usage | Exception | None = None) -> Usage:
    """`case`'s `Usage` (`measure`d here unless given), or a `ResourceError` saying what failed."""
    found = found or measure(case)
    if isinstance(found, Exception):
        raise ResourceError(f"{case.describe()}: does not compile: {type(found).__name__}: {found}") from found
    problems = failures(case, found)
    if problems:
        raise ResourceError(f"{case.describe()}: " + "; ".join(problems))
    return found


def shipped_cases() -> list[Case]:
    """Every shipped configuration at `TABLE_LOSS` with every optional input: pass x dtype x D x target."""
    return [Case(pass_name, dtype, TABLE_LOSS, hidden_size, capability) for pass_name in launch.PASSES
            for dtype in launch.DTYPES for hidden_size in HIDDEN_SIZES for capability in CAPABILITIES]


def _dump(case: Case, folder: str) -> str:
    with open(os.path.join(folder, ptx_name(case)), "w") as f:
        f.write(compile_case(case).asm["ptx"])
    return ptx_name(case)


def dump_ptx(folder: str, cases: list[Case] | None = None) -> list[str]:
    """Write the PTX of `cases` (default: `shipped_cases()`) into `folder`; the file names."""
    os.makedirs(folder, exist_ok=True)
    cases = shipped_cases() if cases is None else cases
    return _spawned_map(functools.partial(_dump, folder=folder), cases)


def table() -> None:
    """The table of the shipped configurations: every optional input, `TABLE_LOSS`, `HIDDEN_SIZES`."""
    cases = shipped_cases()
    print(f"Loss form {tuple(TABLE_LOSS.form())}, bias + class_weight + pos_weight; spills: bytes stored")
    print(f"{'kernel':<12}{'pass':<11}{'dtype':<6}{'D':>5}  {'blocks':<16}{'arch':<8}{'regs':>5}{'spills':>8}"
          f"{'shared':>8}  {'products':<9}")
    for case, found in zip(cases, measure_all(cases)):
        b = case.launch_blocks
        blocks = f"{b.block_n}x{b.block_v}x{b.block_d(case.hidden_size)}/{b.num_warps}w/{b.num_stages}s"
        numbers = (f"{found.registers:>5}{found.spill_store_bytes:>8}{found.shared_bytes:>8}  "
                   f"{found.instruction_class:<9}" if isinstance(found, Usage) else f"  {type(found).__name__}: {found}")
        print(f"{case.kernel.fn.__name__:<12}{case.pass_name:<11}{TYPE_NAMES[case.dtype]:<6}{case.hidden_size:>5}  "
              f"{blocks:<16}{GPU_NAMES[case.capability]:<8}{numbers}")


def opcodes(compiled) -> list[str]:
    """The SASS opcodes of a compiled kernel, in order (nvdisasm, bundled with Triton beside ptxas)."""
    nvdisasm = os.path.join(os.path.dirname(ptxas_path()), "nvdisasm")
    with tempfile.TemporaryDirectory() as folder:
        cubin = os.path.join(folder, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        listing = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    return re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", listing)


def instructions_per_logit(pass_name: str, dtype: torch.dtype = torch.bfloat16, capability: int = 90) -> float:
    """SASS instructions one logit costs in a pass of the plain loss: two compiles (D 128, no optional
    input) whose tiles differ only in 16 more columns (the item pass: 16 more positions), the
    difference of their instruction counts over the logits each thread gains. A tile's elementwise
    code is unrolled per thread and runs once per tile, so this is its cost per logit: the loss
    math, one label slot (L is a run-time loop), the slope's conversion and the products' share."""
    shipped = launch.blocks_for(pass_name, dtype, capability)
    side = shipped.block_v if pass_name == "items" else shipped.block_n  # the products' M side, kept

    def count(width: int) -> int:
        tile = (width, side) if pass_name == "items" else (side, width)
        blocks = launch.Blocks(*tile, num_warps=shipped.num_warps, num_stages=1, block_k=16)
        case = Case(pass_name, dtype, Loss(), 128, capability, blocks, False, False, False)
        return len(opcodes(compile_case(case)))

    return (count(32) - count(16)) / (side * 16 / (32 * shipped.num_warps))


def step_instruction_classes() -> dict:
    """`(pass, dtype) -> instruction class` of the cost model's passes, compiled for sm_90."""
    cases = [Case(name, dtype, TABLE_LOSS, cost_model.D, 90)
             for name in cost_model.STEP_PASSES for dtype in cost_model.DTYPES]
    return {(case.pass_name, case.dtype): usage.instruction_class if isinstance(usage, Usage) else "?"
            for case, usage in zip(cases, measure_all(cases))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m torch_cutbce.triton.aot", description=__doc__.split("\n")[0])
    parser.add_argument("--dump-ptx", metavar="DIR", help="write the PTX of every shipped configuration into DIR")
    parser.add_argument("--model", action="store_true", help="print the cost model (an estimate, not a measurement)")
    args = parser.parse_args(argv)
    if args.model:
        counted = {name: instructions_per_logit(name) for name in cost_model.STEP_PASSES}
        print(cost_model.report(step_instruction_classes(), counted))
    elif args.dump_ptx:
        names = dump_ptx(args.dump_ptx)
        print(f"{len(names)} PTX files in {args.dump_ptx}")
    else:
        table()


if __name__ == "__main__":
    sys.exit(main())
