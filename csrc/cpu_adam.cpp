#include "cpu_adam.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

namespace peakflat {
namespace {

// Per-step scalars, narrowed to float exactly as ATen's fused CPU AdamW narrows them.
struct Consts {
  float wd_mul;          // 1 - lr * wd
  bool has_wd;
  float lerp_coeff;      // w or w - 1
  bool lerp_small;       // |w| < 0.5, w = 1 - beta1
  float beta2;
  float sq_coeff;        // 1 - beta2
  float bc2_sqrt;
  float eps;
  float neg_step_size;   // -(lr / (1 - beta1^step))
};

Consts make_consts(double lr, double beta1, double beta2, double eps, double wd, double step) {
  const double bias_correction1 = 1 - std::pow(beta1, step);
  const double bias_correction2 = 1 - std::pow(beta2, step);
  const double step_size = lr / bias_correction1;
  Consts c;
  c.has_wd = wd != 0.0;
  c.wd_mul = static_cast<float>(1 - lr * wd);
  const float w = static_cast<float>(1 - beta1);
  c.lerp_small = std::abs(w) < 0.5f;
  c.lerp_coeff = c.lerp_small ? w : w - 1.0f;
  c.beta2 = static_cast<float>(beta2);
  c.sq_coeff = static_cast<float>(1 - beta2);
  c.bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  c.eps = static_cast<float>(eps);
  c.neg_step_size = static_cast<float>(-step_size);
  return c;
}

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN -> canonical, like c10::BFloat16
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Every multiply-add that should fuse is written as one; no other may be fused by the compiler,
// whatever flags the build passes (GCC contracts even intrinsics under its default -ffp-contract=fast).
#if defined(__GNUC__) && !defined(__clang__)
#define PEAKFLAT_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define PEAKFLAT_NO_CONTRACT
#pragma clang fp contract(off)
#endif

// Scalar path: the same operations as the vector path, so that both paths agree bit for bit.
PEAKFLAT_NO_CONTRACT void adam_scalar(float* p, const void* g, bool g_bf16, float* m, float* v, void* out, int out_kind,
                 int64_t n, const Consts& c) {
  for (int64_t i = 0; i < n; ++i) {
    const float gv = g_bf16 ? bf16_to_float(static_cast<const uint16_t*>(g)[i]) : static_cast<const float*>(g)[i];
    float pv = p[i];
    if (c.has_wd) pv = pv * c.wd_mul;
    const float mv0 = m[i];
    const float base = c.lerp_small ? mv0 : gv;
    const float mv = std::fma(c.lerp_coeff, gv - mv0, base);
    const float vv = std::fma(c.sq_coeff * gv, gv, v[i] * c.beta2);  // ATen's build contracts this one
    m[i] = mv;
    v[i] = vv;
    const float denom = (std::sqrt(vv) / c.bc2_sqrt) + c.eps;
    pv = pv + (c.neg_step_size * mv) / denom;
    p[i] = pv;
    if (out_kind == 1) static_cast<float*>(out)[i] = pv;
    else if (out_kind == 2) static_cast<uint16_t*>(out)[i] = float_to_bf16(pv);
  }
}

#if defined(__x86_64__) || defined(_M_X64)
#define PEAKFLAT_HAVE_AVX2_PATH 1

__attribute__((target("avx2,fma"))) inline __m256 load_grad(const void* g, bool g_bf16, int64_t i) {
  if (g_bf16) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  return _mm256_loadu_ps(static_cast<const float*>(g) + i);
}

__attribute__((target("avx2,fma"))) inline __m128i to_bf16(__m256 x) {
  // round to nearest even; NaN lanes become 0x7FC0
  __m256i u = _mm256_castps_si256(x);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
  __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
  return _mm_packus_epi32(lo, hi);
}

__attribute__((target("avx2,fma"))) PEAKFLAT_NO_CONTRACT void adam_avx2(float* p, const void* g, bool g_bf16, float* m, float* v,
                                                     void* out, int out_kind, int64_t n, const Consts& c) {
  const __m256 wd_mul = _mm256_set1_ps(c.wd_mul), coeff = _mm256_set1_ps(c.lerp_coeff);
  const __m256 beta2 = _mm256_set1_ps(c.beta2), sq = _mm256_set1_ps(c.sq_coeff);
  const __m256 bc2 = _mm256_set1_ps(c.bc2_sqrt), eps = _mm256_set1_ps(c.eps), nss = _mm256_set1_ps(c.neg_step_size);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 gv = load_grad(g, g_bf16, i);
    __m256 pv = _mm256_loadu_ps(p + i);
    if (c.has_wd) pv = _mm256_mul_ps(pv, wd_mul);
    __m256 mv = _mm256_loadu_ps(m + i);
    __m256 base = c.lerp_small ? mv : gv;
    mv = _mm256_fmadd_ps(coeff, _mm256_sub_ps(gv, mv), base);
    __m256 vv = _mm256_fmadd_ps(_mm256_mul_ps(sq, gv), gv, _mm256_mul_ps(_mm256_loadu_ps(v + i), beta2));
    _mm256_storeu_ps(m + i, mv);
    _mm256_storeu_ps(v + i, vv);
    __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vv), bc2), eps);
    pv = _mm256_add_ps(pv, _mm256_div_ps(_mm256_mul_ps(nss, mv), denom));
    _mm256_storeu_ps(p + i, pv);
    if (out_kind == 1) _mm256_storeu_ps(static_cast<float*>(out) + i, pv);
    else if (out_kind == 2) _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i), to_bf16(pv));
  }
  if (i < n) {
    const void* gt = g_bf16 ? static_cast<const void*>(static_cast<const uint16_t*>(g) + i)
                            : static_cast<const void*>(static_cast<const float*>(g) + i);
    void* ot = out == nullptr ? nullptr
             : out_kind == 1 ? static_cast<void*>(static_cast<float*>(out) + i)
                             : static_cast<void*>(static_cast<uint16_t*>(out) + i);
    adam_scalar(p + i, gt, g_bf16, m + i, v + i, ot, out_kind, n - i, c);
  }
}

bool cpu_has_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}
#endif

void adam_range(float* p, const void* g, bool g_bf16, float* m, float* v, void* out, int out_kind, int64_t n,
                const Consts& c) {
#ifdef PEAKFLAT_HAVE_AVX2_PATH
  if (cpu_has_avx2()) return adam_avx2(p, g, g_bf16, m, v, out, out_kind, n, c);
#endif
  adam_scalar(p, g, g_bf16, m, v, out, out_kind, n, c);
}

void check_arg(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu(), "peakflat adamw_step: ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), "peakflat adamw_step: ", name, " must be contiguous");
  TORCH_CHECK(t.numel() == n, "peakflat adamw_step: ", name, " has ", t.numel(), " elements, param has ", n);
}

}  // namespace

std::string adamw_isa() {
#ifdef PEAKFLAT_HAVE_AVX2_PATH
  if (cpu_has_avx2()) return "avx2";
#endif
  return "scalar";
}

void adamw_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                const at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& param_out, double lr,
                double beta1, double beta2, double eps, double weight_decay, double step,
                int64_t threads) {
  const int64_t n = param.numel();
  check_arg(param, "param", n);
  check_arg(grad, "grad", n);
  check_arg(exp_avg, "exp_avg", n);
  check_arg(exp_avg_sq, "exp_avg_sq", n);
  TORCH_CHECK(param.scalar_type() == at::kFloat && exp_avg.scalar_type() == at::kFloat &&
                  exp_avg_sq.scalar_type() == at::kFloat,
              "peakflat adamw_step: param, exp_avg and exp_avg_sq must be float32");
  TORCH_CHECK(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16,
              "peakflat adamw_step: grad must be float32 or bfloat16, got ", grad.scalar_type());
  TORCH_CHECK(step >= 1, "peakflat adamw_step: step must be >= 1, got ", step);
  int out_kind = 0;
  void* out = nullptr;
  if (param_out.has_value() && param_out->defined()) {
    check_arg(*param_out, "param_out", n);
    TORCH_CHECK(param_out->scalar_type() == at::kFloat || param_out->scalar_type() == at::kBFloat16,
                "peakflat adamw_step: param_out must be float32 or bfloat16");
    out_kind = param_out->scalar_type() == at::kFloat ? 1 : 2;
    out = param_out->data_ptr();
  }
  const Consts c = make_consts(lr, beta1, beta2, eps, weight_decay, step);
  float* p = param.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  const bool g_bf16 = grad.scalar_type() == at::kBFloat16;
  const char* g = static_cast<const char*>(grad.data_ptr());
  const int64_t gsz = g_bf16 ? 2 : 4, osz = out_kind == 2 ? 2 : 4;

  int64_t nt = threads > 0 ? threads : std::max<int64_t>(1, std::thread::hardware_concurrency());
  constexpr int64_t kAlign = 16;          // one 64-byte line of floats per unit of work
  constexpr int64_t kMinPerThread = 1 << 15;
  nt = std::max<int64_t>(1, std::min<int64_t>(nt, n / kMinPerThread));
  auto run = [&](int64_t b, int64_t e) {
    if (e <= b) return;
    adam_range(p + b, g + b * gsz, g_bf16, m + b, v + b,
               out ? static_cast<void*>(static_cast<char*>(out) + b * osz) : nullptr, out_kind, e - b, c);
  };
  if (nt == 1) {
    run(0, n);
    return;
  }
  const int64_t per = ((n + nt - 1) / nt + kAlign - 1) / kAlign * kAlign;
  std::vector<std::thread> pool;
  pool.reserve(nt - 1);
  int64_t t = 1;
  try {
    for (; t < nt; ++t) {
      const int64_t b = std::min(n, t * per), e = std::min(n, (t + 1) * per);
      pool.emplace_back(run, b, e);
    }
  } catch (const std::exception&) {
    // no thread for ranges t.. (a thread limit or no memory for a stack): this thread runs them; the split
    // stays the same, so the result is the same
  }
  run(0, std::min(n, per));
  for (; t < nt; ++t) run(std::min(n, t * per), std::min(n, (t + 1) * per));
  for (auto& th : pool) th.join();
}

}  // namespace peakflat
