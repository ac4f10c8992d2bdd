"""Triton's interpreter (`TRITON_INTERPRET=1`): CPU tensors through the same kernels, for checking them
without a GPU. Read when `triton` is first imported; the route into it is `engines.py`'s.

`make_compatible()` fixes three faults of triton 3.5's interpreter (the one torch 2.9 ships), only
while interpreting, only in the interpreter's own code:
- with numpy >= 2.4 a loop bound such as `range(0, V, BLOCK_V)` is turned into a Python int by
  `int()` of a one-element array, which numpy 2.4 refuses ("only 0-dimensional arrays can be
  converted to Python scalars"; triton-lang/triton#9171, fixed upstream by #9172 with the same
  `squeeze()` as here);
- `tl.dot` of bfloat16 operands multiplies their bit patterns (numpy has no bfloat16: the
  interpreter holds them as 16-bit integers), 5e10 off on a [16, 32] product. The fix widens them to
  float32 first, which is the product the GPU computes: a product of two bfloat16 numbers is exact
  in float32, and the tensor cores accumulate in float32;
- float32 -> bfloat16 casts truncate (1.005859375 -> 1.0), where the GPU rounds to nearest even
  (1.0078125): a gradient came back up to one bfloat16 ulp off, and truncating dz before a product
  biased it, which failed the 16-bit contract (docs/precision.md). The fix rounds to nearest even.
"""

from __future__ import annotations

import functools
import inspect
import os


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (set before `triton` is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_runs_here(device) -> None:
    """A ValueError naming backend='triton' and the device where CPU tensors cannot run: only Triton's
    interpreter runs them, and it is chosen when triton is first imported (triton's own errors were
    "0 active drivers", or an InterpreterError when the variable was set after that import)."""
    if device.type != "cpu":
        return
    from triton.runtime.interpreter import InterpretedFunction
    import triton.language as tl

    from torch_cutbce.triton import kernels

    if isinstance(tl.standard.cdiv, InterpretedFunction) and isinstance(kernels.row_kernel, InterpretedFunction):
        return
    why = ("TRITON_INTERPRET=1 was set after triton was first imported" if interpreting()
           else "TRITON_INTERPRET is not 1 in this process")
    raise ValueError(f"backend='triton' got tensors on {device}: CPU tensors run only in Triton's interpreter, "
                     f"and it is off ({why}); set TRITON_INTERPRET=1 in the environment before triton is first "
                     f"imported (before importing torch), or pass CUDA tensors")


@functools.cache
def make_compatible() -> None:
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor
    if len(inspect.signature(patch_tensor).parameters) == 1:  # triton 3.5's; newer ones are fixed

        def patched(tensor):
            patch_tensor(tensor)
            tensor.__index__ = lambda self: int(self.handle.data.squeeze())

        interpreter._patch_lang_tensor = patched
    _widen_bfloat16_dots(interpreter)
    _round_bfloat16_casts(interpreter)


def _widen_bfloat16_dots(interpreter) -> None:
    import numpy as np
    import triton.language as tl

    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot_widened(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot_widened


def _round_bfloat16_casts(interpreter) -> None:
    import numpy as np
    import triton.language as tl

    builder = interpreter.InterpreterBuilder
    cast = builder.cast_impl

    def cast_rounded(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return cast(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
        # Round to nearest even on the upper half: add 0x7FFF plus the lowest kept bit (carries into
        # the exponent as the GPU's cvt.rn.bf16.f32 does; the largest finite values round to inf).
        rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        nan = np.isnan(src.data)
        rounded = np.where(nan, (bits >> np.uint32(16)) | np.uint32(0x40), rounded)  # NaN stays a quiet NaN
        return interpreter.TensorHandle(rounded.astype(np.uint16), tl.bfloat16)

    builder.cast_impl = cast_rounded  # create_fp_trunc, and every other cast, calls self.cast_impl
