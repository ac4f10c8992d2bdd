"""The shipped Triton configurations compile for sm_80 and sm_90 within budget, without a GPU.

Every pass (`launch.PASSES`) x every `Loss` form the suite runs (`conformance_engines.LOSSES`) x
dtype x target, with bias, class_weight and pos_weight all present and with none (ptxas's allocation
is not monotone: a kernel with fewer inputs can spill where the fuller one does not), at D = 64, 128
(one block of gradient columns) and 256 (two, the logits recomputed per block), and with one target
per position (L = 1, its own compile) at D 128, each compiled as a launch specializes it
(`aot.launch_attributes`): ptxas reports no spill bytes, Triton's shared memory
fits the target's limit per block (`aot.py`), and the products lower to the target's fast
instruction class (`aot.FAST_PATH`: `wgmma.mma_async` on sm_90 and `mma.sync` on sm_80 for 16-bit
inputs, no tensor-core instruction for float32). Compiled once per module over the CPUs
(`aot.measure_all`); Triton's cache makes a rerun quick, and D 256 is D 128's compile. Then the checks
failing: tiles too large spill, a hidden block too deep overflows shared memory, a tile too small for
a warpgroup falls to `mma.sync` on sm_90, and the message names what failed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from conformance_engines import LOSSES  # noqa: E402
from cutbce_common.loss import Loss  # noqa: E402
from torch_cutbce.triton import aot, launch  # noqa: E402

pytestmark = pytest.mark.slow  # 1,152 configurations, 2 checks each; 2 cores: 1 min with a warm Triton cache, about 6 from an empty one

FORMS = {loss.form(): name for name, loss in reversed(LOSSES.items())}  # one name per form (all six differ)
CASES = {
    f"{pass_name}-{aot.TYPE_NAMES[dtype]}-{FORMS[form]}-{'all' if optional else 'no'}_inputs-D{hidden_size}-"
    f"{aot.GPU_NAMES[capability]}":
        aot.Case(pass_name, dtype, LOSSES[FORMS[form]], hidden_size, capability, None, optional, optional, optional)
    for pass_name in launch.PASSES for dtype in launch.DTYPES for form in FORMS for optional in (True, False)
    for hidden_size in aot.HIDDEN_SIZES for capability in aot.CAPABILITIES
}
CASES.update({  # one target per position (L = 1: a constant at launch, a compile of its own), at D 128
    f"{pass_name}-{aot.TYPE_NAMES[dtype]}-{FORMS[form]}-{'all' if optional else 'no'}_inputs-L1-"
    f"{aot.GPU_NAMES[capability]}":
        aot.Case(pass_name, dtype, LOSSES[FORMS[form]], 128, capability, None, optional, optional, optional, True)
    for pass_name in launch.PASSES for dtype in launch.DTYPES for form in FORMS for optional in (True, False)
    for capability in aot.CAPABILITIES
})
HEAVY = LOSSES["smoothing0.2-focal1.5-balanced"]


@pytest.fixture(scope="module")
def measured():
    """Every case's `Usage` (or its error), compiled once."""
    return dict(zip(CASES, aot.measure_all(list(CASES.values()))))


@pytest.mark.parametrize("case_id", CASES)
def test_shipped_configuration_fits(measured, case_id):
    found = aot.check(CASES[case_id], measured[case_id])  # raises naming the case and what failed
    assert found.registers <= 255


@pytest.mark.parametrize("case_id", CASES)
def test_products_take_the_fast_path(measured, case_id):
    """16-bit products on the target's tensor-core instruction (`aot.FAST_PATH`), float32 on none. The
    kernels before issue 47 failed it on sm_90 for grad, rows_grad and items (108 cases: mma.sync)."""
    found = measured[case_id]
    assert not isinstance(found, Exception), found
    problem = aot.off_the_fast_path(CASES[case_id], found)
    assert problem is None, problem


def test_a_tile_too_small_for_a_warpgroup_is_off_the_fast_path_on_sm_90():
    """32 x 16 tiles (the former one-pass row kernel's) give `mma.sync` on sm_90; 64 x 64 give `wgmma`."""
    small, wide = (aot.Case("rows", torch.bfloat16, Loss(), 64, 90, blocks=launch.Blocks(n, v, num_warps=4),
                            has_bias=False, has_class_weight=False, has_pos_weight=False)
                   for n, v in ((32, 16), (64, 64)))
    found_small, found_wide = aot.measure_all([small, wide])
    assert (found_small.instruction_class, found_wide.instruction_class) == ("mma.sync", "wgmma")
    message = aot.off_the_fast_path(small, found_small)
    assert "pass=rows dtype=bf16" in message and "arch=sm_90a" in message and "not wgmma" in message, message
    assert aot.off_the_fast_path(wide, found_wide) is None


@pytest.mark.parametrize("capability", aot.CAPABILITIES)
def test_compiles_are_specialized_as_a_launch_is(capability):
    """D a multiple of 16 and aligned pointers (what Triton's JIT marks at a launch of such inputs): the
    tiles are copied 16 bytes at a time into shared memory, asynchronously (`cp.async`, pipelined); D
    120 has no hint on D, and its tiles are loaded element by element, as its launches would be. One
    target per position makes L a constant, as the JIT does with an integer argument of 1."""
    hinted, plain = (aot.Case("rows", torch.bfloat16, Loss(), hidden_size, capability) for hidden_size in (128, 120))
    attributes = aot.launch_attributes(hinted.kernel, aot.signature(hinted.kernel, torch.bfloat16, hinted.constexprs()),
                                       128)
    names = [hinted.kernel.arg_names[index] for (index,) in attributes]
    assert "D" in names and "h_ptr" in names and "N" not in names and "V" not in names
    assert "D" not in [hinted.kernel.arg_names[index] for (index,) in aot.launch_attributes(
        plain.kernel, aot.signature(plain.kernel, torch.bfloat16, plain.constexprs()), 120)]
    one_label = aot.Case("rows", torch.bfloat16, Loss(), 128, capability, one_label=True)
    assert aot.signature(one_label.kernel, torch.bfloat16, one_label.constexprs())["L"] == "constexpr"
    fast, slow = (aot.compile_case(case).asm["ptx"] for case in (hinted, plain))
    assert "cp.async.cg" in fast and "ld.global.b16" not in fast
    assert "cp.async" not in slow and "ld.global.b16" in slow


def test_dump_ptx_names_every_file(tmp_path):
    """`--dump-ptx`: one file per configuration, `<kernel>.<pass>.<dtype>.d<D>.sm_<cap>.ptx`, the PTX in it."""
    case = aot.Case("rows", torch.bfloat16, aot.TABLE_LOSS, 64, 90)
    assert aot.dump_ptx(str(tmp_path), [case]) == ["row_kernel.rows.bf16.d64.sm_90.ptx"]
    assert "wgmma.mma_async" in (tmp_path / "row_kernel.rows.bf16.d64.sm_90.ptx").read_text()
    assert len(aot.shipped_cases()) == len(launch.PASSES) * len(launch.DTYPES) * 3 * 2


def test_every_pass_dtype_and_target_has_a_configuration():
    for pass_name in launch.PASSES:
        for dtype in launch.DTYPES:
            for capability in (80, 86, 89, 90, 100):
                blocks = launch.blocks_for(pass_name, dtype, capability)
                assert blocks.block_d(128) == 128 and blocks.block_d(129) == launch.MAX_BLOCK_D
            hopper = launch.blocks_for(pass_name, dtype, 90)
            if dtype != torch.float32:  # a warpgroup's 64 rows on the products' M side
                assert (hopper.block_v if pass_name == "items" else hopper.block_n) >= 64
    assert launch.blocks_for("grad", torch.bfloat16, 86) == launch.blocks_for("grad", torch.bfloat16, 80)
    assert launch.row_pass(True, True, False) == launch.row_pass(True, False, False) == "rows"
    assert launch.row_pass(False, False, True) == "grad"
    assert launch.row_pass(True, True, True) == launch.row_pass(False, True, True) == "rows_grad"


def test_aot_flags_are_the_launchers():
    """The compiled constexprs are the launcher's (one function builds both)."""
    case = aot.Case("rows_grad", torch.bfloat16, HEAVY, 200, 90, has_pos_weight=False)
    flags = case.constexprs()
    blocks = launch.blocks_for("rows_grad", torch.bfloat16, 90)
    assert flags["BLOCK_D"] == blocks.block_d(200) < 200 and flags["PRECISION"] == "tf32"
    assert (flags["BLOCK_N"], flags["BLOCK_V"], flags["BLOCK_K"]) == (blocks.block_n, blocks.block_v, blocks.block_k)
    assert flags["CHUNK"] == 2048  # shapes.MAX_CONTRACTION items per float32 product
    assert flags["HAS_PW"] is False and flags["HAS_CW"] and flags["WITH_GRAD"] and flags["WITH_COUNTS"]
    assert aot.signature(case.kernel, case.dtype, flags)["h_ptr"] == "*bf16"
    assert aot.signature(case.kernel, case.dtype, flags)["dh_ptr"] == "*fp64"


def test_tiles_too_large_spill_and_the_message_says_where():
    """The former default (64 x 64 tiles, 8 warps) spills the one-pass row kernel."""
    case = aot.Case("rows_grad", torch.float32, HEAVY, 128, 80, blocks=launch.Blocks(64, 64, num_warps=8))
    with pytest.raises(aot.ResourceError) as error:
        aot.check(case)
    message = str(error.value)
    for part in ("row_kernel", "pass=rows_grad", "dtype=fp32", "block_n=64 block_v=64", "num_warps=8",
                 "arch=sm_80", "spills", f"form={tuple(HEAVY.form())}"):
        assert part in message, message


def test_a_hidden_step_too_deep_overflows_shared_memory_on_sm_80_only():
    """The logits' step over D of 512 (`block_k`) over 32 + 64 rows of float32 tiles, one stage:
    196,608 bytes of shared memory, over sm_80's 166,912 and within sm_90's 232,448 (it spills too:
    the blocks pass through registers)."""
    blocks = launch.Blocks(32, 64, max_block_d=512, num_stages=1, block_k=512)
    cases = [aot.Case("rows", torch.float32, Loss(), 512, capability, blocks=blocks, has_bias=False,
                      has_class_weight=False, has_pos_weight=False) for capability in (80, 90)]
    sm_80, sm_90 = aot.measure_all(cases)
    assert sm_80.shared_bytes == sm_90.shared_bytes == (32 + 64) * 512 * 4
    with pytest.raises(aot.ResourceError, match=r"block_k=512 .*arch=sm_80: .*needs 196608 bytes of shared memory "
                                                r"\(the limit per block is 166912\)"):
        aot.check(cases[0], sm_80)
    assert not [problem for problem in aot.failures(cases[1], sm_90) if "shared memory" in problem]


def test_an_invalid_configuration_is_refused():
    with pytest.raises(ValueError, match="block_n=48"):
        launch.Blocks(48, 32)
    with pytest.raises(aot.ResourceError, match=r"does not compile: .*boom"):
        aot.check(aot.Case("items", torch.float16, Loss(), 64, 90), RuntimeError("boom"))


def test_the_cost_model_says_it_is_one_and_counts_four_products():
    """`--model`'s table: labelled a model, four logit-sized products per 'mean' step against the floor's
    three, and the native engine beside it (instruction classes given: no compile)."""
    from torch_cutbce.triton import cost_model

    classes = {(name, dtype): "wgmma" if dtype == torch.bfloat16 else "fma"
               for name in cost_model.STEP_PASSES for dtype in cost_model.DTYPES}
    report = cost_model.report(classes)
    assert report.startswith("A MODEL, not a measurement")
    steps = [line.split() for line in report.splitlines() if " step " in line]
    assert len(steps) == 4 and all(fields[3] == "4" for fields in steps), report
    rows = [line.split()[2] for line in report.splitlines()[4:]]
    assert rows.count("native") == rows.count("floor") == 4
    wide = cost_model.pass_cost("rows_grad", torch.bfloat16, 2**20, "wgmma")
    assert wide.flops == 2 * 2.0 * cost_model.N * 2**20 * cost_model.D


def test_the_cost_models_instruction_counts_are_the_compiled_ones():
    """`cost_model.INSTRUCTIONS_PER_LOGIT` within 10% of what the shipped kernels compile to (sm_90 SASS):
    a change to the tile math that costs instructions changes the model's estimate, or fails here."""
    from torch_cutbce.triton import cost_model

    for name, recorded in cost_model.INSTRUCTIONS_PER_LOGIT.items():
        counted = aot.instructions_per_logit(name)
        assert abs(counted - recorded) <= 0.1 * recorded, f"{name}: {counted:.1f} instructions per logit in the " \
            f"sm_90 SASS, the model says {recorded}"

