// Host emulation of the CUDA library: the same table builder and per-block body as
// batched_copy.cu, run by a host loop over blocks and threads. Tests load it with ctypes and
// compare against numpy. Build: g++ -O2 -shared -fPIC host_emulation.cc -o host_emulation.so
#include "batched_copy.cuh"

// Same ABI as hybrid_batched_copy; stream is ignored and `nthreads` emulated threads per block.
extern "C" int hybrid_batched_copy_host(int n, const void* const* srcs, void* const* dsts,
                                        const int64_t* numels, int src_dtype, int dst_dtype,
                                        int raw_itemsize, int has_scale, double scale, int nthreads) {
  hb_builder b;
  if (hb_builder_init(&b, n, srcs, dsts, numels, src_dtype, dst_dtype, raw_itemsize, has_scale, scale))
    return -1;
  static hb_table t;
  int launches = 0;
  while (int blocks = hb_next_table(&b, &t)) {
    for (int blk = 0; blk < blocks; ++blk)
      for (int tid = 0; tid < nthreads; ++tid) hb_run_block(t, blk, tid, nthreads);
    ++launches;
  }
  return launches;
}

extern "C" int hybrid_table_bytes() { return int(sizeof(hb_table)); }
