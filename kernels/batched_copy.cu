// CUDA library: the batched copy kernel, its C ABI (for torch via ctypes) and XLA FFI handlers
// (for JAX). Build: `make -C kernels` (see docs/kernels.md).
#include <cuda_runtime.h>

#include <vector>

#include "batched_copy.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#ifndef HB_THREADS
#define HB_THREADS 512
#endif

__global__ void __launch_bounds__(HB_THREADS) hb_kernel(const __grid_constant__ hb_table t) {
  hb_run_block(t, blockIdx.x, threadIdx.x, blockDim.x);
}

// Returns the number of launches (>= 0), -1 for an unsupported cast, -2 for a CUDA error.
extern "C" int hybrid_batched_copy(int n, const void* const* srcs, void* const* dsts,
                                   const int64_t* numels, int src_dtype, int dst_dtype,
                                   int raw_itemsize, int has_scale, double scale, void* stream) {
  hb_builder b;
  if (hb_builder_init(&b, n, srcs, dsts, numels, src_dtype, dst_dtype, raw_itemsize, has_scale, scale))
    return -1;
  hb_table t;
  int launches = 0;
  while (int blocks = hb_next_table(&b, &t)) {
    hb_kernel<<<blocks, HB_THREADS, 0, (cudaStream_t)stream>>>(t);
    ++launches;
  }
  return cudaGetLastError() == cudaSuccess ? launches : -2;
}

// ---- XLA FFI ------------------------------------------------------------------------------

static int hb_code(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return HB_F32;
    case ffi::DataType::F16: return HB_F16;
    case ffi::DataType::BF16: return HB_BF16;
    case ffi::DataType::F64: return HB_F64;
    default: return HB_RAW;
  }
}

static ffi::Error hb_status(int rc) {
  if (rc == -1) return ffi::Error::InvalidArgument("hybrid batched copy: unsupported cast or scale");
  if (rc < 0) return ffi::Error::Internal(cudaGetErrorString(cudaGetLastError()));
  return ffi::Error::Success();
}

// gather(*tensors) -> flat; offsets[i] = element offset of tensor i; gaps are zero-filled.
static ffi::Error GatherImpl(cudaStream_t stream, ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> out,
                             ffi::Span<const int64_t> offsets, double scale, int32_t has_scale) {
  size_t n = args.size();
  if (offsets.size() != n) return ffi::Error::InvalidArgument("offsets must have one entry per input");
  std::vector<const void*> srcs;
  std::vector<void*> dsts;
  std::vector<int64_t> numels;
  int sd = HB_RAW, dd = hb_code(out->element_type());
  int dsz = int(ffi::ByteWidth(out->element_type()));
  char* base = (char*)out->untyped_data();
  int64_t end = 0, length = int64_t(out->element_count());
  for (size_t i = 0; i < n; ++i) {
    auto a = args.get<ffi::AnyBuffer>(i);
    if (a.has_error()) return a.error();
    sd = hb_code(a->element_type());
    int64_t numel = int64_t(a->element_count());
    if (offsets[i] < end || offsets[i] + numel > length)
      return ffi::Error::InvalidArgument("offsets must be increasing and inside the output");
    if (offsets[i] > end) { srcs.push_back(nullptr); dsts.push_back(base + end * dsz); numels.push_back(offsets[i] - end); }
    srcs.push_back(a->untyped_data());
    dsts.push_back(base + offsets[i] * dsz);
    numels.push_back(numel);
    end = offsets[i] + numel;
  }
  if (length > end) { srcs.push_back(nullptr); dsts.push_back(base + end * dsz); numels.push_back(length - end); }
  // zero segments are written in the output dtype, so the raw path carries them whatever sd is
  int rc = hybrid_batched_copy(int(srcs.size()), srcs.data(), dsts.data(), numels.data(), n ? sd : dd, dd,
                               dsz, has_scale, scale, stream);
  return hb_status(rc);
}

// scatter(flat) -> *tensors
static ffi::Error ScatterImpl(cudaStream_t stream, ffi::AnyBuffer flat, ffi::RemainingRets rets,
                              ffi::Span<const int64_t> offsets, double scale, int32_t has_scale) {
  size_t n = rets.size();
  if (offsets.size() != n) return ffi::Error::InvalidArgument("offsets must have one entry per output");
  std::vector<const void*> srcs;
  std::vector<void*> dsts;
  std::vector<int64_t> numels;
  int sd = hb_code(flat.element_type()), dd = sd;
  int ssz = int(ffi::ByteWidth(flat.element_type()));
  const char* base = (const char*)flat.untyped_data();
  int64_t length = int64_t(flat.element_count());
  for (size_t i = 0; i < n; ++i) {
    auto r = rets.get<ffi::AnyBuffer>(i);
    if (r.has_error()) return r.error();
    dd = hb_code((*r)->element_type());
    int64_t numel = int64_t((*r)->element_count());
    if (offsets[i] < 0 || offsets[i] + numel > length)
      return ffi::Error::InvalidArgument("offsets must lie inside the flat input");
    srcs.push_back(base + offsets[i] * ssz);
    dsts.push_back((*r)->untyped_data());
    numels.push_back(numel);
  }
  int rc = hybrid_batched_copy(int(n), srcs.data(), dsts.data(), numels.data(), sd, dd, ssz, has_scale,
                               scale, stream);
  return hb_status(rc);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridGather, GatherImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("offsets")
                                  .Attr<double>("scale")
                                  .Attr<int32_t>("has_scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridScatter, ScatterImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("offsets")
                                  .Attr<double>("scale")
                                  .Attr<int32_t>("has_scale"));
