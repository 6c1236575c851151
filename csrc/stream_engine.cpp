#include "stream_engine.h"

#ifdef PEAKFLAT_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

// A failed argument check is returned as a message, not thrown: the Python wrapper raises it
// (optimizer/streamer.py). An exception thrown out of this CUDA build crashed the process on the
// H200 image, so bad input never throws here; a failing CUDA call still does (C10_CUDA_CHECK).
#define PEAKFLAT_REQUIRE(cond, ...) \
  if (!(cond)) return c10::str(__VA_ARGS__)

namespace peakflat {
namespace {

cudaEvent_t new_event() {
  cudaEvent_t e = nullptr;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

}  // namespace

BucketStreamer::BucketStreamer(int64_t slots, int64_t device)
    : device_(static_cast<c10::DeviceIndex>(device)),
      up_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_)),
      down_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_)),
      free_(static_cast<size_t>(slots < 1 ? 1 : slots), nullptr) {
  c10::cuda::CUDAGuard guard(device_);
  try {
    uploaded_ = new_event();
    computed_ = new_event();
    for (auto& e : free_) e = new_event();
  } catch (...) {
    for (cudaEvent_t e : free_)
      if (e != nullptr) cudaEventDestroy(e);
    if (uploaded_ != nullptr) cudaEventDestroy(uploaded_);
    if (computed_ != nullptr) cudaEventDestroy(computed_);
    throw;
  }
}

BucketStreamer::~BucketStreamer() {
  // Pending copies keep their events alive inside the driver: destroying them does not wait.
  try {
    c10::cuda::CUDAGuard guard(device_);
    for (cudaEvent_t e : free_) C10_CUDA_CHECK_WARN(cudaEventDestroy(e));
    C10_CUDA_CHECK_WARN(cudaEventDestroy(uploaded_));
    C10_CUDA_CHECK_WARN(cudaEventDestroy(computed_));
  } catch (...) {  // at interpreter exit the driver may be gone: nothing left to release
  }
}

std::string BucketStreamer::check(const char* what, int64_t slot, const at::Tensor& state,
                           const std::vector<at::Tensor>& host, int64_t start, int64_t numel) const {
  PEAKFLAT_REQUIRE(slot >= 0 && slot < slots(), "peakflat BucketStreamer.", what, ": slot must be in [0, ", slots(),
              "), got ", slot);
  PEAKFLAT_REQUIRE(state.is_cuda() && state.device().index() == device_, "peakflat BucketStreamer.", what,
              ": state must be a CUDA tensor on cuda:", static_cast<int>(device_), ", got one on ", state.device());
  PEAKFLAT_REQUIRE(state.scalar_type() == at::kFloat, "peakflat BucketStreamer.", what, ": state must be float32, got ",
              state.scalar_type());
  PEAKFLAT_REQUIRE(state.dim() == 2 && state.size(0) == 3, "peakflat BucketStreamer.", what,
              ": state must be [3, bucket] (master, exp_avg, exp_avg_sq), got shape ", state.sizes());
  PEAKFLAT_REQUIRE(state.stride(1) == 1, "peakflat BucketStreamer.", what,
              ": state rows must be contiguous (stride 1 in dim 1), got strides ", state.strides());
  PEAKFLAT_REQUIRE(numel >= 0 && numel <= state.size(1), "peakflat BucketStreamer.", what, ": numel must be in [0, ",
              state.size(1), "] (the slot holds ", state.size(1), " elements per row), got ", numel);
  PEAKFLAT_REQUIRE(start >= 0, "peakflat BucketStreamer.", what, ": start must be >= 0, got ", start);
  PEAKFLAT_REQUIRE(host.size() == 3, "peakflat BucketStreamer.", what,
              ": host must hold 3 tensors (master, exp_avg, exp_avg_sq), got ", host.size());
  for (size_t k = 0; k < host.size(); ++k) {
    const at::Tensor& h = host[k];
    PEAKFLAT_REQUIRE(h.device().is_cpu(), "peakflat BucketStreamer.", what, ": host[", k,
                "] must be a CPU tensor, got one on ", h.device());
    PEAKFLAT_REQUIRE(h.scalar_type() == at::kFloat, "peakflat BucketStreamer.", what, ": host[", k,
                "] must be float32, got ", h.scalar_type());
    PEAKFLAT_REQUIRE(h.is_contiguous(), "peakflat BucketStreamer.", what, ": host[", k, "] must be contiguous");
    PEAKFLAT_REQUIRE(start <= h.numel() - numel, "peakflat BucketStreamer.", what, ": host[", k, "] has ", h.numel(),
                " elements, the bucket needs [", start, ", ", start + numel, ")");
    PEAKFLAT_REQUIRE(h.is_pinned(), "peakflat BucketStreamer.", what, ": host[", k,
                "] must be pinned (page-locked) memory; a pageable buffer would make every copy synchronous");
  }
  return {};
}

std::string BucketStreamer::upload(int64_t slot, const at::Tensor& state, const std::vector<at::Tensor>& host,
                                   int64_t start, int64_t numel) {
  std::string error = check("upload", slot, state, host, start, numel);
  if (!error.empty()) return error;
  std::lock_guard<std::mutex> lock(mu_);
  c10::cuda::CUDAGuard guard(device_);
  const cudaStream_t up = up_.stream();
  const size_t bytes = static_cast<size_t>(numel) * sizeof(float);
  float* dst = state.mutable_data_ptr<float>();
  // A slot is overwritten only after its previous bucket has left (a never-recorded event does not block).
  C10_CUDA_CHECK(cudaStreamWaitEvent(up, free_[slot], 0));
  for (int64_t k = 0; k < 3; ++k) {
    C10_CUDA_CHECK(cudaMemcpyAsync(dst + k * state.stride(0), host[k].const_data_ptr<float>() + start, bytes,
                                   cudaMemcpyHostToDevice, up));
  }
  C10_CUDA_CHECK(cudaEventRecord(uploaded_, up));
  C10_CUDA_CHECK(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(device_).stream(), uploaded_, 0));
  return {};
}

std::string BucketStreamer::write_back(int64_t slot, const at::Tensor& state, const std::vector<at::Tensor>& host,
                                       int64_t start, int64_t numel) {
  std::string error = check("write_back", slot, state, host, start, numel);
  if (!error.empty()) return error;
  std::lock_guard<std::mutex> lock(mu_);
  c10::cuda::CUDAGuard guard(device_);
  const cudaStream_t down = down_.stream();
  const size_t bytes = static_cast<size_t>(numel) * sizeof(float);
  const float* src = state.const_data_ptr<float>();
  C10_CUDA_CHECK(cudaEventRecord(computed_, c10::cuda::getCurrentCUDAStream(device_).stream()));
  C10_CUDA_CHECK(cudaStreamWaitEvent(down, computed_, 0));
  for (int64_t k = 0; k < 3; ++k) {
    C10_CUDA_CHECK(cudaMemcpyAsync(host[k].mutable_data_ptr<float>() + start, src + k * state.stride(0), bytes,
                                   cudaMemcpyDeviceToHost, down));
  }
  C10_CUDA_CHECK(cudaEventRecord(free_[slot], down));
  return {};
}

std::string BucketStreamer::synchronize(int64_t slot) {
  if (!(slot >= -1 && slot < slots()))
    return c10::str("peakflat BucketStreamer.synchronize: slot must be -1 (all) or in [0, ", slots(), "), got ", slot);
  c10::cuda::CUDAGuard guard(device_);
  if (slot >= 0) {
    C10_CUDA_CHECK(cudaEventSynchronize(free_[slot]));
    return {};
  }
  C10_CUDA_CHECK(cudaEventSynchronize(uploaded_));
  for (cudaEvent_t e : free_) C10_CUDA_CHECK(cudaEventSynchronize(e));
  return {};
}

}  // namespace peakflat
#endif  // PEAKFLAT_WITH_CUDA
