"""Live tensor bytes of a torch process, counted by the CPU allocator itself (torch keeps no CPU
allocator statistics): the bytes held by tensors allocated since :func:`install`, and their peak.

A ~60-line C++ allocator wraps torch's CPU allocator and counts every allocation and free on
every thread. Threads matter: a collective's Work keeps its tensors, and the backend's thread
often drops them last, which the profiler's memory events (recorded per thread) never see, so
they would count those tensors as live forever. The library is built with the system C++
compiler on first use (about 2 s) into ``~/.cache/hybrid``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess

import torch

_SOURCE = r"""
#include <c10/core/CPUAllocator.h>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace {
std::atomic<int64_t> live{0}, peak{0};
c10::Allocator* base = nullptr;

// Each live block by its address: the DataPtr torch's own allocator gave (which frees it) and its
// size. The DataPtrs handed out carry the address as their context too, as torch's CPU allocator
// does, so raw_allocate / raw_deallocate (used inside some CPU kernels) work through this one.
struct Block { c10::DataPtr inner; int64_t n; };
std::mutex mutex;
auto* blocks = new std::unordered_map<void*, Block>();  // never destroyed: frees may come at exit

void release(void* p) {
  if (p == nullptr) return;
  Block block;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = blocks->find(p);
    if (it == blocks->end()) return;
    block = std::move(it->second);
    blocks->erase(it);
  }
  live.fetch_sub(block.n);
}  // block.inner frees the memory through torch's own allocator here

struct Counting final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return {nullptr, nullptr, &release, c10::Device(c10::DeviceType::CPU)};
    {
      std::lock_guard<std::mutex> lock(mutex);
      (*blocks)[data] = Block{std::move(inner), static_cast<int64_t>(n)};
    }
    int64_t now = live.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
    int64_t seen = peak.load();
    while (now > seen && !peak.compare_exchange_weak(seen, now)) {}
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};
Counting counting;
}  // namespace

extern "C" {
void hybrid_live_install() {
  if (base == nullptr) {
    base = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&counting, /*priority=*/100);
  }
}
int64_t hybrid_live_bytes() { return live.load(); }
int64_t hybrid_live_peak() { return peak.load(); }
void hybrid_live_reset_peak() { peak.store(live.load()); }
}
"""

_lib = None


def _build() -> pathlib.Path:
    torch_dir = pathlib.Path(torch.__file__).parent
    key = hashlib.sha256(f"{_SOURCE}{torch.__version__}{torch_dir}".encode()).hexdigest()[:16]
    out = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "hybrid" / f"live-{key}.so"
    if out.exists():
        return out
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("hybrid.bench._live needs a C++ compiler (g++ or $CXX) to count live tensor bytes")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Per-process names: ranks (or test workers) building at once never read a half-written source.
    src = out.with_suffix(f".{os.getpid()}.cpp")
    src.write_text(_SOURCE)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    subprocess.run([cxx, "-O2", "-shared", "-fPIC", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                    f"-I{torch_dir / 'include'}", str(src), f"-L{torch_dir / 'lib'}", "-lc10",
                    f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", str(tmp)], check=True, capture_output=True)
    os.replace(tmp, out)  # atomic: concurrent ranks building at once each get a whole library
    src.unlink()
    return out


def install() -> None:
    """Count from now on: tensors allocated before are neither counted nor discounted."""
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(str(_build()))
        lib.hybrid_live_bytes.restype = lib.hybrid_live_peak.restype = ctypes.c_int64
        lib.hybrid_live_install()
        _lib = lib


def live_bytes() -> int:
    """Bytes held now by CPU tensors allocated since :func:`install`.

    >>> install(); before = live_bytes()
    >>> a = torch.empty(1000)
    >>> live_bytes() - before
    4000
    """
    return int(_lib.hybrid_live_bytes())


def peak_bytes() -> int:
    """The most :func:`live_bytes` held at once since :func:`reset_peak` (or :func:`install`).

    >>> install(); reset_peak(); before = live_bytes()
    >>> b = torch.empty(500); del b
    >>> peak_bytes() - before
    2000
    """
    return int(_lib.hybrid_live_peak())


def reset_peak() -> None:
    _lib.hybrid_live_reset_peak()
