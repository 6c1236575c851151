// Multi-threaded, vectorised AdamW over flat fp32 host buffers (the host engine of OffloadStreamAdamW).
#pragma once

// ATen's tensor and check headers only: torch/extension.h (pybind11, all of torch) took ~28 s of CPU to compile
// here and bindings.cpp alone needs it
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

namespace peakflat {

// One AdamW step, in place, on contiguous CPU tensors of equal length:
//   param, exp_avg, exp_avg_sq: float32; grad: float32 or bfloat16;
//   param_out (optional): float32 or bfloat16, receives the updated param (what is uploaded).
// The arithmetic follows ATen's fused CPU AdamW (decoupled weight decay, lerp for exp_avg, amsgrad off)
// operation for operation, including the multiply-adds that ATen's vector body fuses. The results equal
// torch._fused_adamw_'s bitwise except on a few elements per call, by an ulp, where the two builds fuse a
// multiply-add differently; which buffer and elements depends on the CPU's vector width (on an AVX-512 CPU:
// exp_avg_sq in ATen's scalar tail, the last n mod 16 elements of a call).
// `threads` <= 0 means std::thread::hardware_concurrency(). Releases no Python state: the binding
// drops the GIL around it.
void adamw_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                const at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& param_out, double lr,
                double beta1, double beta2, double eps, double weight_decay, double step,
                int64_t threads);

// Which code path adamw_step takes on this CPU: "avx2" or "scalar".
std::string adamw_isa();

}  // namespace peakflat
