// One large host allocation, registered (pinned) with CUDA once, carved into aligned buckets.
#pragma once

#include <ATen/core/Tensor.h>  // not torch/extension.h: bindings.cpp alone needs pybind11 and the rest of torch

#include <memory>
#include <mutex>
#include <string>

namespace peakflat {

// A bump allocator over one mmap'ed region. `pin` asks for a single cudaHostRegister of the whole
// region (builds with PEAKFLAT_WITH_CUDA); when that fails or CUDA is absent, the region stays
// pageable and `pin_error()` says why. Tensors carved from the pool keep it alive.
class HostPool : public std::enable_shared_from_this<HostPool> {
 public:
  static std::shared_ptr<HostPool> create(int64_t bytes, bool pin);
  ~HostPool();

  // A zero-filled tensor of `numel` elements of `dtype`, 256-byte aligned inside the pool.
  at::Tensor carve(int64_t numel, at::ScalarType dtype);

  int64_t capacity() const { return capacity_; }
  int64_t used() const;
  bool pinned() const { return pinned_; }
  const std::string& pin_error() const { return pin_error_; }
  int64_t base_address() const { return reinterpret_cast<int64_t>(base_); }

 private:
  HostPool() = default;
  void* base_ = nullptr;
  int64_t capacity_ = 0;
  int64_t used_ = 0;
  bool pinned_ = false;
  std::string pin_error_;
  mutable std::mutex mu_;
};

}  // namespace peakflat
