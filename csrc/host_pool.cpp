#include "host_pool.h"

#include <ATen/ops/from_blob.h>

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#ifdef PEAKFLAT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace peakflat {

std::shared_ptr<HostPool> HostPool::create(int64_t bytes, bool pin) {
  TORCH_CHECK(bytes > 0, "peakflat HostPool: bytes must be positive, got ", bytes);
  std::shared_ptr<HostPool> pool(new HostPool());
  // Anonymous mmap: zero pages, page aligned, returned to the OS on munmap.
  void* p = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(p != MAP_FAILED, "peakflat HostPool: mmap of ", bytes, " bytes failed: ", std::strerror(errno));
#ifdef MADV_HUGEPAGE
  madvise(p, static_cast<size_t>(bytes), MADV_HUGEPAGE);
#endif
  pool->base_ = p;
  pool->capacity_ = bytes;
  if (pin) {
#ifdef PEAKFLAT_WITH_CUDA
    int ndev = 0;
    cudaError_t err = cudaGetDeviceCount(&ndev);
    if (err == cudaSuccess && ndev > 0) {
      err = cudaHostRegister(p, static_cast<size_t>(bytes), cudaHostRegisterDefault);
    } else if (err == cudaSuccess) {
      err = cudaErrorNoDevice;
    }
    if (err == cudaSuccess) {
      pool->pinned_ = true;
    } else {
      pool->pin_error_ = std::string("cudaHostRegister failed: ") + cudaGetErrorString(err);
      cudaGetLastError();  // clear the error so that later CUDA calls do not report it
    }
#else
    pool->pin_error_ = "extension built without CUDA (no PEAKFLAT_WITH_CUDA)";
#endif
  }
  return pool;
}

HostPool::~HostPool() {
  if (base_ == nullptr) return;
#ifdef PEAKFLAT_WITH_CUDA
  if (pinned_) cudaHostUnregister(base_);
#endif
  munmap(base_, static_cast<size_t>(capacity_));
}

int64_t HostPool::used() const {
  std::lock_guard<std::mutex> g(mu_);
  return used_;
}

at::Tensor HostPool::carve(int64_t numel, at::ScalarType dtype) {
  TORCH_CHECK(numel >= 0, "peakflat HostPool.carve: numel must be >= 0, got ", numel);
  const int64_t elsize = static_cast<int64_t>(c10::elementSize(dtype));
  constexpr int64_t kAlign = 256;
  int64_t off;
  int64_t bytes;
  {
    std::lock_guard<std::mutex> g(mu_);
    off = (used_ + kAlign - 1) / kAlign * kAlign;
    // compared before multiplying: numel * elsize may not fit in 64 bits
    TORCH_CHECK(off <= capacity_ && numel <= (capacity_ - off) / elsize, "peakflat HostPool.carve: ", numel,
                " elements of ", elsize, " bytes requested at offset ", off, " exceed the pool's ", capacity_, " bytes");
    bytes = numel * elsize;
    used_ = off + bytes;
  }
  auto keep = shared_from_this();
  void* ptr = static_cast<char*>(base_) + off;
  return at::from_blob(ptr, {numel}, [keep](void*) {}, at::TensorOptions().dtype(dtype).device(at::kCPU));
}

}  // namespace peakflat
