// XLA FFI handlers around cpu_tile.c, for the blocked loop on the CPU (jax_kernels/blocked/negative_tile.py).
//
//   cutbce_rows(z [n, v], cw [v])              -> rows [n]
//   cutbce_rows_grad(z [n, v], cw [v], g [n])  -> dz [n, v], rows [n]    (dz may alias z)
//   cutbce_grad(z [n, v], cw [v], g [n])       -> dz [n, v]              (dz may alias z)
//
// All float32; attribute `threads` (int32): OpenMP threads over rows. The shapes were checked when
// the call was built; they are checked here again, so a wrong call fails with a message, not a crash.
#include "xla/ffi/api/ffi.h"

#include "cpu_tile.c"

namespace ffi = xla::ffi;

namespace {

ffi::Error CheckShapes(const ffi::Buffer<ffi::F32>& z, const ffi::Buffer<ffi::F32>& cw, int64_t* n, int64_t* v) {
    auto dims = z.dimensions();
    if (dims.size() != 2) return ffi::Error::InvalidArgument("cutbce tile: z must be [n, v]");
    *n = dims[0];
    *v = dims[1];
    if (cw.dimensions().size() != 1 || cw.dimensions()[0] != *v)
        return ffi::Error::InvalidArgument("cutbce tile: cw must be [v]");
    return ffi::Error::Success();
}

ffi::Error Rows(ffi::Buffer<ffi::F32> z, ffi::Buffer<ffi::F32> cw, ffi::ResultBuffer<ffi::F32> rows, int32_t threads) {
    int64_t n, v;
    if (auto error = CheckShapes(z, cw, &n, &v); error.failure()) return error;
    cutbce_tile(z.typed_data(), cw.typed_data(), nullptr, nullptr, rows->typed_data(), n, v, threads);
    return ffi::Error::Success();
}

ffi::Error RowsGrad(ffi::Buffer<ffi::F32> z, ffi::Buffer<ffi::F32> cw, ffi::Buffer<ffi::F32> g,
                    ffi::ResultBuffer<ffi::F32> dz, ffi::ResultBuffer<ffi::F32> rows, int32_t threads) {
    int64_t n, v;
    if (auto error = CheckShapes(z, cw, &n, &v); error.failure()) return error;
    cutbce_tile(z.typed_data(), cw.typed_data(), g.typed_data(), dz->typed_data(), rows->typed_data(), n, v, threads);
    return ffi::Error::Success();
}

ffi::Error Grad(ffi::Buffer<ffi::F32> z, ffi::Buffer<ffi::F32> cw, ffi::Buffer<ffi::F32> g,
                ffi::ResultBuffer<ffi::F32> dz, int32_t threads) {
    int64_t n, v;
    if (auto error = CheckShapes(z, cw, &n, &v); error.failure()) return error;
    cutbce_tile(z.typed_data(), cw.typed_data(), g.typed_data(), dz->typed_data(), nullptr, n, v, threads);
    return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(cutbce_rows, Rows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(cutbce_rows_grad, RowsGrad,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(cutbce_grad, Grad,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("threads"));
