// The bucket stream engine of OffloadStreamAdamW's GPU engine: state uploads and write-backs on their
// own CUDA streams, ordered by per-slot events (builds with PEAKFLAT_WITH_CUDA only).
#pragma once

#ifdef PEAKFLAT_WITH_CUDA
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <mutex>
#include <string>
#include <vector>

namespace peakflat {

// Moves one bucket's fp32 state (master, exp_avg, exp_avg_sq) between pinned host buffers and a GPU
// staging slot [3, bucket], with the ordering of megatron_peakflat/optimizer/engines.py's Python streams:
//   upload(s):     upload stream waits for slot s's last write-back, copies host -> slot, and the caller's
//                  current stream waits for those copies (the update then runs on the current stream);
//   write_back(s): download stream waits for the current stream's work so far, copies slot -> host and
//                  records slot s's 'free' event (the next upload into slot s waits for it).
// Nothing blocks the host except synchronize(). The streams come from torch's pool on `device`; the
// events are the streamer's own and persist across steps, so step t+1's uploads wait for step t's
// write-backs. Every call checks its arguments and returns what is wrong as a message (the Python wrapper
// raises it) and is thread safe; the bindings release the GIL around them. A failing CUDA call throws.
class BucketStreamer {
 public:
  BucketStreamer(int64_t slots, int64_t device);
  ~BucketStreamer();
  BucketStreamer(const BucketStreamer&) = delete;
  BucketStreamer& operator=(const BucketStreamer&) = delete;

  // state: CUDA float32 [3, >= numel] on `device` with unit stride in its last dimension; host: 3 pinned,
  // contiguous CPU float32 tensors; row k of state <-> host[k][start : start + numel].
  // Each returns "" when done, else what is wrong with the arguments (and does nothing).
  std::string upload(int64_t slot, const at::Tensor& state, const std::vector<at::Tensor>& host, int64_t start,
                     int64_t numel);
  std::string write_back(int64_t slot, const at::Tensor& state, const std::vector<at::Tensor>& host, int64_t start,
                         int64_t numel);
  // Block the host until slot `slot`'s last write-back has finished (slot -1: every upload and write-back).
  std::string synchronize(int64_t slot);

  // The argument checks of upload/write_back, run first inside each (the GIL already released): a failed
  // check returns its message before any copy is queued.
  std::string check(const char* what, int64_t slot, const at::Tensor& state, const std::vector<at::Tensor>& host,
             int64_t start, int64_t numel) const;

  int64_t slots() const { return static_cast<int64_t>(free_.size()); }
  int64_t device() const { return device_; }
  // The raw cudaStream_t handles, as torch.cuda.ExternalStream takes them (tests, profiling).
  int64_t upload_stream() const { return reinterpret_cast<int64_t>(up_.stream()); }
  int64_t download_stream() const { return reinterpret_cast<int64_t>(down_.stream()); }

 private:
  c10::DeviceIndex device_;
  c10::cuda::CUDAStream up_;
  c10::cuda::CUDAStream down_;
  cudaEvent_t uploaded_ = nullptr;   // the last upload's copies (the current stream waits on it)
  cudaEvent_t computed_ = nullptr;   // the current stream's work before a write-back
  std::vector<cudaEvent_t> free_;    // per slot: its last write-back has finished
  std::mutex mu_;
};

}  // namespace peakflat
#endif  // PEAKFLAT_WITH_CUDA
