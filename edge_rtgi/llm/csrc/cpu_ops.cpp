// Fused CPU kernels for the small operations of a decode step (edge_rtgi/llm/cpu_ops.py).
//
// At batch 1 a 135M-parameter model spends more time in ~40 small tensor ops per layer than in
// its matmuls: each op is a few microseconds of dispatch for a few hundred elements of work.
// These kernels do the same arithmetic in one pass each, rounding to the activation dtype at the
// points where PyTorch's eager ops round, so bf16 results match eager to the last bit except
// where a sum is accumulated in a different order (RMSNorm's mean, attention).
//
// Ops (namespace edge_rtgi, CPU only; float32 and bfloat16 activations):
//   rms_norm(x, weight, eps)                      F.rms_norm over the last dim
//   rotary_(qk, cos, signed_sin)                  in-place "rotate half" RoPE (model.apply_rope)
//   silu_mul(gate_up)                             silu(gate) * up for gate_up = [gate | up]
//   decode_attention(q, k_new, v_new, k_store, v_store, new_slots, key_slots, key_mask, scale)
//       writes each row's new key/value at its slot, then one query per row attends over the
//       slots listed for that row (grouped-query heads share their key/value head).
//   decode_attention_int4(q, k_codes, k_scale, k_zero, k_open, open_row, v_codes, v_scale, v_zero,
//                         key_slots, key_mask, scale, block_size, value_group)
//       the same attention over an int4 KIVI cache (kv/int4.py), reading its codes in place.
//   int4_mm / int8_mm(x, ...)                     weight-only matmuls for a few rows (below)
//   int4_pack_i8, int4_i8_mm                      int4 weights against int8 activations (below)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_convert_weight_to_int4pack_for_cpu.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/_weight_int8pack_mm.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define EDGE_RTGI_AVX512 1
#endif
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using at::Tensor;

// Kernels are templates over the raw element type: float, or uint16_t holding bfloat16 bits.
// Raw integers rather than c10::BFloat16 (a struct) let the compiler vectorise the loops.
using bf16_bits = uint16_t;

inline float to_f(float x) { return x; }
inline float to_f(bf16_bits x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
template <typename T>
inline T from_f(float x);
template <>
inline float from_f<float>(float x) { return x; }
template <>
inline bf16_bits from_f<bf16_bits>(float x) {
  // Round to nearest even, as PyTorch does; NaN stays a quiet NaN.
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const bool is_nan = (bits & 0x7fffffffu) > 0x7f800000u;
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return is_nan ? bf16_bits{0x7fc0} : static_cast<bf16_bits>(bits >> 16);
}

template <typename T>
const T* in_ptr(const Tensor& t) {
  if constexpr (std::is_same_v<T, float>) return t.const_data_ptr<float>();
  else return reinterpret_cast<const bf16_bits*>(t.const_data_ptr<c10::BFloat16>());
}
template <typename T>
T* out_ptr(const Tensor& t) {
  if constexpr (std::is_same_v<T, float>) return t.mutable_data_ptr<float>();
  else return reinterpret_cast<bf16_bits*>(t.mutable_data_ptr<c10::BFloat16>());
}

// exp(x) in float, within 1.4 ulp of the exact value (Cephes' expf polynomial; checked over
// [-87, 88] in steps of 1e-3), in a form the compiler vectorises: std::exp is a scalar libm call,
// and std::floor does not vectorise without -ffast-math, so n is rounded with a shifter instead.
inline float exp_f(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  constexpr float kShifter = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const float shifted = x * 1.44269504088896341f + kShifter;
  const float n = shifted - kShifter;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  uint32_t shifted_bits;
  std::memcpy(&shifted_bits, &shifted, sizeof(shifted_bits));
  const uint32_t scale_bits = (shifted_bits - 0x4b400000u + 127u) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &scale_bits, sizeof(scale));
  return p * scale;
}

// Sums over a row use this many independent partial sums: a single accumulator makes every add
// wait for the previous one (and forbids SIMD), which made a 64-element dot product latency-bound.
constexpr int64_t kLanes = 16;

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
#ifdef EDGE_RTGI_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m512 bv;
    if constexpr (std::is_same_v<T, float>) {
      bv = _mm512_loadu_ps(b + i);
    } else {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i));
      bv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    }
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), bv, acc);
  }
  total = _mm512_reduce_add_ps(acc);
#else
  float part[kLanes] = {};
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) part[l] += a[i + l] * to_f(b[i + l]);
  }
  for (int64_t l = 0; l < kLanes; ++l) total += part[l];
#endif
  for (; i < n; ++i) total += a[i] * to_f(b[i]);
  return total;
}

#ifdef EDGE_RTGI_AVX512
// 16 elements at p as floats.
template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
}

// Sums of 16 lanes of a, b, c, d -> lanes 0..3 of the result.
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] and the same for c, d
  const __m512 abcd = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  const __m512 halves = _mm512_add_ps(abcd, _mm512_shuffle_f32x4(abcd, abcd, 0x4E));
  const __m512 quarters = _mm512_add_ps(halves, _mm512_shuffle_f32x4(halves, halves, 0xB1));
  return _mm512_castps512_ps128(quarters);
}

#endif

#if defined(__AVX2__) && defined(__FMA__)
// 8 elements at p as floats.
template <typename T>
inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
}

// The sum of 8 lanes in halving order (lane i with i + 4, then + 2, + 1): sum32_halving's last steps.
inline float sum8_halving(__m256 s8) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
#endif

#if !defined(EDGE_RTGI_AVX512) && defined(__AVX2__) && defined(__FMA__)
#define EDGE_RTGI_AVX2_FMA 1

// Sums of 8 lanes of a, b, c, d -> lanes 0..3 of the result.
inline __m128 sum4_avx2(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#endif

template <typename T>
inline float sum(const T* x, int64_t n) {
  float part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) part[l] += to_f(x[i + l]);
  }
  float total = 0.f;
  for (; i < n; ++i) total += to_f(x[i]);
  for (int64_t l = 0; l < kLanes; ++l) total += part[l];
  return total;
}

// The sum of x[0..n) as if zeros followed it up to any length: the last partial block goes into the
// lanes too, so zeros appended (keys masked out at the end of a row) leave every lane, and so the
// total, bit for bit the same. Attention's softmax denominators use it: a row's output must not
// depend on how many padded keys its step gave it (other rows' lengths, drafts after it).
inline float sum_zero_padded(const float* x, int64_t n) {
  float part[kLanes] = {};
  for (int64_t i = 0; i < n; i += kLanes) {
    const int64_t lanes = std::min<int64_t>(kLanes, n - i);
    for (int64_t l = 0; l < lanes; ++l) part[l] += x[i + l];
  }
  float total = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) total += part[l];
  return total;
}

template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  float part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      const float v = to_f(x[i + l]);
      part[l] += v * v;
    }
  }
  float sum = 0.f;
  for (; i < n; ++i) sum += to_f(x[i]) * to_f(x[i]);
  for (int64_t l = 0; l < kLanes; ++l) sum += part[l];
  return sum;
}

// Elements handled per thread before a loop is split across threads: smaller loops cost less
// than waking the thread pool.
constexpr int64_t kGrainElements = 1 << 15;

inline int64_t grain_rows(int64_t elements_per_row) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, elements_per_row));
}

void check_activation(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "edge_rtgi::", name, ": CPU tensors only, got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              "edge_rtgi::", name, ": float32 or bfloat16 activations only, got ", t.scalar_type());
}

// --- RMSNorm --------------------------------------------------------------------------------

template <typename T>
void rms_norm_impl(const Tensor& x, const Tensor& weight, Tensor& out, double eps) {
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  const T* xp = in_ptr<T>(x);
  const T* wp = in_ptr<T>(weight);
  T* op = out_ptr<T>(out);
  at::parallel_for(0, rows, grain_rows(dim), [=](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * dim;
      T* outr = op + r * dim;
      const float mean_sq = sum_squares(xr, dim) / static_cast<float>(dim);
      const float inv_rms = 1.f / std::sqrt(mean_sq + static_cast<float>(eps));
      // F.rms_norm rounds once, after the weight product (HF rounds before it too).
      for (int64_t i = 0; i < dim; ++i) outr[i] = from_f<T>(to_f(xr[i]) * inv_rms * to_f(wp[i]));
    }
  });
}

Tensor rms_norm(const Tensor& x_in, const Tensor& weight, double eps) {
  check_activation(x_in, "rms_norm");
  TORCH_CHECK(weight.scalar_type() == x_in.scalar_type() && weight.dim() == 1 && weight.size(0) == x_in.size(-1),
              "edge_rtgi::rms_norm: weight must be [", x_in.size(-1), "] in ", x_in.scalar_type());
  Tensor x = x_in.contiguous(), w = weight.contiguous();
  Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) rms_norm_impl<float>(x, w, out, eps);
  else rms_norm_impl<bf16_bits>(x, w, out, eps);
  return out;
}

// --- RoPE -----------------------------------------------------------------------------------

template <typename T>
void rotary_impl(Tensor& qk, const Tensor& cos, const Tensor& sin) {
  const int64_t tokens = qk.size(0), heads = qk.size(1), dim = qk.size(2), half = dim / 2;
  const int64_t st = qk.stride(0), sh = qk.stride(1);
  T* base = out_ptr<T>(qk);
  const T* cp = in_ptr<T>(cos);
  const T* sp = in_ptr<T>(sin);
  at::parallel_for(0, tokens, grain_rows(heads * dim), [=](int64_t begin, int64_t end) {
    std::vector<float> x(dim);
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + t * dim;
      const T* s = sp + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* row = base + t * st + h * sh;
        for (int64_t i = 0; i < dim; ++i) x[i] = to_f(row[i]);
        for (int64_t i = 0; i < dim; ++i) {
          // apply_rope: addcmul(x * cos, roll(x, D/2), signed_sin), x * cos rounded first
          const float x_cos = to_f(from_f<T>(x[i] * to_f(c[i])));
          const float rolled = x[i < half ? i + half : i - half];
          row[i] = from_f<T>(x_cos + rolled * to_f(s[i]));
        }
      }
    }
  });
}

void rotary_(Tensor qk, const Tensor& cos_in, const Tensor& sin_in) {
  check_activation(qk, "rotary_");
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.size(2) % 2 == 0,
              "edge_rtgi::rotary_: qk must be [T, H, D] with contiguous, even D");
  const int64_t tokens = qk.size(0), dim = qk.size(2);
  Tensor cos = cos_in.reshape({tokens, dim}).contiguous(), sin = sin_in.reshape({tokens, dim}).contiguous();
  TORCH_CHECK(cos.scalar_type() == qk.scalar_type() && sin.scalar_type() == qk.scalar_type(),
              "edge_rtgi::rotary_: cos/sin must be in ", qk.scalar_type());
  if (qk.scalar_type() == at::kFloat) rotary_impl<float>(qk, cos, sin);
  else rotary_impl<bf16_bits>(qk, cos, sin);
}

// --- SwiGLU ---------------------------------------------------------------------------------

#if defined(__AVX2__) && defined(__FMA__)
// 8 floats rounded to bf16 and widened back, as from_f<bf16_bits> then to_f (NaN aside).
inline __m256 round_bf16_8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// x / (1 + exp_f(-x)) on 8 lanes with the scalar loop's operations as GCC builds them: exp_f
// inlined, every a * b + c contracted to one FMA, the 1 + p * 2^n of the denominator included
// (a compiler that fuses otherwise, Clang, may differ in the last bit: a test compares the two).
// GCC leaves the scalar loop unvectorised (docs/cpu_kernels.md, "silu_mul on 8 lanes").
inline __m256 silu_8(__m256 x) {
  const __m256 t = _mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), x), _mm256_set1_ps(-87.3f)),
                                 _mm256_set1_ps(88.7f));
  const __m256 shifter = _mm256_set1_ps(12582912.f);
  const __m256 shifted = _mm256_fmadd_ps(t, _mm256_set1_ps(1.44269504088896341f), shifter);
  const __m256 n = _mm256_sub_ps(shifted, shifter);
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f),
                                   _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), t));
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(1.9875691500e-4f), r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(r, _mm256_mul_ps(p, r), r), _mm256_set1_ps(1.f));
  const __m256i scale_bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_castps_si256(shifted), _mm256_set1_epi32(127 - 0x4b400000)), 23);
  const __m256 den = _mm256_fmadd_ps(p, _mm256_castsi256_ps(scale_bits), _mm256_set1_ps(1.f));
  return _mm256_div_ps(x, den);
}
#endif

template <typename T>
void silu_mul_impl(const Tensor& gate_up, Tensor& out) {
  const int64_t inter = out.size(-1), rows = out.numel() / inter;
  const T* gp = in_ptr<T>(gate_up);
  T* op = out_ptr<T>(out);
  at::parallel_for(0, rows, grain_rows(inter), [=](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gp + r * 2 * inter;
      const T* u = g + inter;
      T* o = op + r * inter;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      for (; i + 8 <= inter; i += 8) {
        if constexpr (std::is_same_v<T, float>) {
          _mm256_storeu_ps(o + i, _mm256_mul_ps(silu_8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
        } else {
          alignas(32) float y[8];
          _mm256_store_ps(y, _mm256_mul_ps(round_bf16_8(silu_8(load8(g + i))), load8(u + i)));
          for (int l = 0; l < 8; ++l) o[i + l] = from_f<T>(y[l]);
        }
      }
#endif
      for (; i < inter; ++i) {
        const float x = to_f(g[i]);
        // F.silu(gate) * up: silu rounded to the activation dtype first
        o[i] = from_f<T>(to_f(from_f<T>(x / (1.f + exp_f(-x)))) * to_f(u[i]));
      }
    }
  });
}

Tensor silu_mul(const Tensor& gate_up_in) {
  check_activation(gate_up_in, "silu_mul");
  TORCH_CHECK(gate_up_in.size(-1) % 2 == 0, "edge_rtgi::silu_mul: last dim must be even");
  Tensor gate_up = gate_up_in.contiguous();
  auto sizes = gate_up.sizes().vec();
  sizes.back() /= 2;
  Tensor out = at::empty(sizes, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) silu_mul_impl<float>(gate_up, out);
  else silu_mul_impl<bf16_bits>(gate_up, out);
  return out;
}

// --- Decode attention -----------------------------------------------------------------------

#ifdef EDGE_RTGI_AVX512
// One head's sum of p[s] * value[s] over its keys, the 16 x NV floats of the sum held in registers
// (head dims 64 and 128); masked keys are skipped, as their slots may hold anything.
template <int NV, typename T>
inline void weighted_values(const T* values, const int64_t* row_slots, const bool* row_mask, int64_t slot_stride,
                            const float* p, int64_t num_keys, float* out) {
  __m512 acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = _mm512_setzero_ps();
  for (int64_t s = 0; s < num_keys; ++s) {
    if (row_mask && !row_mask[s]) continue;
    const T* value = values + row_slots[s] * slot_stride;
    const __m512 pv = _mm512_set1_ps(p[s]);
    for (int v = 0; v < NV; ++v) acc[v] = _mm512_fmadd_ps(pv, load16(value + 16 * v), acc[v]);
  }
  for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + 16 * v, acc[v]);
}
#endif

#ifdef EDGE_RTGI_AVX2_FMA
// The same on AVX2 for head dim 64: the 8 x 8 floats of the sum in registers.
template <typename T>
inline void weighted_values_avx2(const T* values, const int64_t* row_slots, const bool* row_mask,
                                 int64_t slot_stride, const float* p, int64_t num_keys, float* out) {
  __m256 acc[8];
  for (int v = 0; v < 8; ++v) acc[v] = _mm256_setzero_ps();
  for (int64_t s = 0; s < num_keys; ++s) {
    if (row_mask && !row_mask[s]) continue;
    const T* value = values + row_slots[s] * slot_stride;
    const __m256 pv = _mm256_set1_ps(p[s]);
    for (int v = 0; v < 8; ++v) acc[v] = _mm256_fmadd_ps(pv, load8(value + 8 * v), acc[v]);
  }
  for (int v = 0; v < 8; ++v) _mm256_storeu_ps(out + 8 * v, acc[v]);
}
#endif

// The four keys of a score block from s0: the block's last 1-3 keys repeat its first (their scores
// are not kept), so that a key's score does not depend on where it falls (the vector loops below).
template <typename T>
inline void block_keys(const T* kv_head, const int64_t* row_slots, int64_t s0, int64_t in_block,
                       int64_t slot_stride, const T* keys[4]) {
  for (int t = 0; t < 4; ++t) keys[t] = kv_head + row_slots[s0 + (t < in_block ? t : 0)] * slot_stride;
}

// Masked keys of a score block get -inf in every head's scores.
inline void mask_block_scores(float* scores, const bool* row_mask, int64_t s0, int64_t in_block, int64_t group,
                              int64_t num_keys) {
  for (int64_t t = 0; row_mask && t < in_block; ++t) {
    if (row_mask[s0 + t]) continue;
    for (int64_t j = 0; j < group; ++j) scores[j * num_keys + s0 + t] = -std::numeric_limits<float>::infinity();
  }
}

#if defined(EDGE_RTGI_AVX512) || defined(EDGE_RTGI_AVX2_FMA)
#define EDGE_RTGI_FOUR_KEY_SCORES 1
#ifdef EDGE_RTGI_AVX512
constexpr int64_t kScoreLanes = 16;
#else
constexpr int64_t kScoreLanes = 8;
#endif

// One query head's (fp32, scaled) scores against four keys, dim a multiple of kScoreLanes: one
// horizontal sum per four scores, where dot() needs one per score. `four` is 16-byte aligned.
template <typename T>
inline void four_scores(const float* q, const T* const keys[4], int64_t dim, float* four) {
#ifdef EDGE_RTGI_AVX512
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t d = 0; d < dim; d += 16) {
    const __m512 qv = _mm512_loadu_ps(q + d);
    for (int t = 0; t < 4; ++t) a[t] = _mm512_fmadd_ps(qv, load16(keys[t] + d), a[t]);
  }
  _mm_store_ps(four, sum4(a[0], a[1], a[2], a[3]));
#else
  __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t d = 0; d < dim; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int t = 0; t < 4; ++t) a[t] = _mm256_fmadd_ps(qv, load8(keys[t] + d), a[t]);
  }
  _mm_store_ps(four, sum4_avx2(a[0], a[1], a[2], a[3]));
#endif
}
#endif

template <typename T>
void decode_attention_impl(const Tensor& q, const Tensor& k_store, const Tensor& v_store,
                           const Tensor& key_slots, const c10::optional<Tensor>& key_mask,
                           double scale, Tensor& out) {
  const int64_t rows = q.size(0), num_heads = q.size(1), dim = q.size(2), q_row_stride = q.stride(0);
  const int64_t num_kv_heads = k_store.size(1), group = num_heads / num_kv_heads;
  const int64_t num_keys = key_slots.size(1);
  const int64_t slot_stride = num_kv_heads * dim;
  const T* qp = in_ptr<T>(q);
  const T* kp = in_ptr<T>(k_store);
  const T* vp = in_ptr<T>(v_store);
  const int64_t* slots = key_slots.const_data_ptr<int64_t>();
  const bool* mask = key_mask.has_value() ? key_mask->const_data_ptr<bool>() : nullptr;
  T* op = out_ptr<T>(out);
  const float sc = static_cast<float>(scale);
  const int64_t work = rows * num_kv_heads;
  at::parallel_for(0, work, grain_rows(num_keys * dim * group * 2), [=](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), scores(group * num_keys), denom(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, kvh = item % num_kv_heads;
      const int64_t* row_slots = slots + b * num_keys;
      const bool* row_mask = mask ? mask + b * num_keys : nullptr;
      for (int64_t j = 0; j < group; ++j) {
        const T* qh = qp + b * q_row_stride + (kvh * group + j) * dim;
        for (int64_t i = 0; i < dim; ++i) qf[j * dim + i] = to_f(qh[i]) * sc;
      }
      // Scores (masked keys get -inf), then each head's softmax weights, then the weighted values.
      int64_t s0 = 0;
#ifdef EDGE_RTGI_FOUR_KEY_SCORES
      if (dim % kScoreLanes == 0) {
        // Four keys at a time (four_scores). The last one to three keys take the same arithmetic (the
        // block filled up with its first key, those scores not kept), so that a key's score does not
        // depend on where it falls.
        for (; s0 < num_keys; s0 += 4) {
          const int64_t in_block = std::min<int64_t>(4, num_keys - s0);
          const T* keys[4];
          block_keys(kp + kvh * dim, row_slots, s0, in_block, slot_stride, keys);
          for (int64_t j = 0; j < group; ++j) {
            alignas(16) float four[4];
            four_scores(qf.data() + j * dim, keys, dim, four);
            std::copy(four, four + in_block, scores.data() + j * num_keys + s0);
          }
          mask_block_scores(scores.data(), row_mask, s0, in_block, group, num_keys);
        }
      }
#endif
      for (int64_t s = s0; s < num_keys; ++s) {
        if (row_mask && !row_mask[s]) {
          for (int64_t j = 0; j < group; ++j) scores[j * num_keys + s] = -std::numeric_limits<float>::infinity();
          continue;
        }
        const T* key = kp + row_slots[s] * slot_stride + kvh * dim;
        for (int64_t j = 0; j < group; ++j) scores[j * num_keys + s] = dot(qf.data() + j * dim, key, dim);
      }
      for (int64_t j = 0; j < group; ++j) {
        float* sj = scores.data() + j * num_keys;
        float row_max = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < num_keys; ++s) row_max = std::max(row_max, sj[s]);
        for (int64_t s = 0; s < num_keys; ++s) {
          sj[s] = sj[s] == -std::numeric_limits<float>::infinity() ? 0.f : exp_f(sj[s] - row_max);
        }
        denom[j] = sum_zero_padded(sj, num_keys);
      }
      const T* values = vp + kvh * dim;
#ifdef EDGE_RTGI_AVX512
      if (dim == 64 || dim == 128) {
        for (int64_t j = 0; j < group; ++j) {
          const float* sj = scores.data() + j * num_keys;
          float* aj = acc.data() + j * dim;
          if (dim == 64) weighted_values<4>(values, row_slots, row_mask, slot_stride, sj, num_keys, aj);
          else weighted_values<8>(values, row_slots, row_mask, slot_stride, sj, num_keys, aj);
        }
      } else
#elif defined(EDGE_RTGI_AVX2_FMA)
      if (dim == 64) {
        for (int64_t j = 0; j < group; ++j) {
          weighted_values_avx2(values, row_slots, row_mask, slot_stride, scores.data() + j * num_keys, num_keys,
                               acc.data() + j * dim);
        }
      } else
#endif
      {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t s = 0; s < num_keys; ++s) {
          if (row_mask && !row_mask[s]) continue;
          const T* value = values + row_slots[s] * slot_stride;
          for (int64_t j = 0; j < group; ++j) {
            const float p = scores[j * num_keys + s];
            float* aj = acc.data() + j * dim;
            for (int64_t i = 0; i < dim; ++i) aj[i] += p * to_f(value[i]);
          }
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        T* oh = op + (b * num_heads + kvh * group + j) * dim;
        // A row with every key masked out gets zeros (SDPA would give NaN); callers never pass one.
        const float inv = denom[j] > 0.f ? 1.f / denom[j] : 0.f;
        for (int64_t i = 0; i < dim; ++i) oh[i] = from_f<T>(acc[j * dim + i] * inv);
      }
    }
  });
}

template <typename T>
void write_slots(const Tensor& src, Tensor& store, const Tensor& new_slots) {
  const int64_t rows = src.size(0), row_elems = src.size(1) * src.size(2), src_stride = src.stride(0);
  const int64_t num_slots = store.size(0);
  const int64_t* slots = new_slots.const_data_ptr<int64_t>();
  const T* sp = in_ptr<T>(src);
  T* dp = out_ptr<T>(store);
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(slots[r] >= 0 && slots[r] < num_slots, "edge_rtgi::decode_attention: slot ", slots[r],
                " out of range [0, ", num_slots, ")");
    std::memcpy(dp + slots[r] * row_elems, sp + r * src_stride, row_elems * sizeof(T));
  }
}

Tensor decode_attention(const Tensor& q_in, const Tensor& k_new_in, const Tensor& v_new_in, Tensor k_store,
                        Tensor v_store, const Tensor& new_slots_in, const Tensor& key_slots_in,
                        const c10::optional<Tensor>& key_mask_in, double scale) {
  check_activation(q_in, "decode_attention");
  TORCH_CHECK(q_in.dim() == 3 && k_new_in.dim() == 3 && k_store.dim() == 3,
              "edge_rtgi::decode_attention: q [B, Hq, D], k/v [B, Hkv, D], stores [N, Hkv, D]");
  TORCH_CHECK(k_store.is_contiguous() && v_store.is_contiguous(), "edge_rtgi::decode_attention: stores must be contiguous");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&k_new_in, &v_new_in, &k_store, &v_store}) {
    TORCH_CHECK(t->scalar_type() == q_in.scalar_type(), "edge_rtgi::decode_attention: all of q, k, v and the stores must be ",
                q_in.scalar_type());
  }
  TORCH_CHECK(q_in.size(1) % k_store.size(1) == 0 && q_in.size(2) == k_store.size(2),
              "edge_rtgi::decode_attention: head counts or head dims do not match");
  const int64_t rows = q_in.size(0);
  TORCH_CHECK(v_store.sizes() == k_store.sizes(), "edge_rtgi::decode_attention: k_store ", k_store.sizes(),
              " and v_store ", v_store.sizes(), " differ");
  const std::vector<int64_t> new_shape = {rows, k_store.size(1), k_store.size(2)};
  TORCH_CHECK(k_new_in.sizes() == at::IntArrayRef(new_shape) && v_new_in.sizes() == at::IntArrayRef(new_shape),
              "edge_rtgi::decode_attention: k_new and v_new must be ", at::IntArrayRef(new_shape), ", got ",
              k_new_in.sizes(), " and ", v_new_in.sizes());
  TORCH_CHECK(key_slots_in.dim() == 2 && key_slots_in.size(0) == rows && new_slots_in.numel() == rows,
              "edge_rtgi::decode_attention: need one new slot and one row of key slots per query row");
  // q, k and v may be views of the step's qkv rows, strided between tokens: only each token's
  // heads must lie densely (a copy of all three per layer was a tenth of a 2-token step's extra time).
  auto dense_heads = [](const Tensor& t) {
    return t.stride(2) == 1 && (t.size(1) == 1 || t.stride(1) == t.size(2)) && t.stride(0) >= t.size(1) * t.size(2);
  };
  Tensor q = dense_heads(q_in) ? q_in : q_in.contiguous();
  Tensor k_new = dense_heads(k_new_in) ? k_new_in : k_new_in.contiguous();
  Tensor v_new = dense_heads(v_new_in) ? v_new_in : v_new_in.contiguous();
  Tensor new_slots = new_slots_in.to(at::kLong).contiguous(), key_slots = key_slots_in.to(at::kLong).contiguous();
  c10::optional<Tensor> key_mask;
  if (key_mask_in.has_value()) {
    key_mask = key_mask_in->to(at::kBool).reshape({rows, key_slots.size(1)}).contiguous();
  }
  const int64_t num_slots = k_store.size(0);
  const int64_t* ks = key_slots.const_data_ptr<int64_t>();
  for (int64_t i = 0, n = key_slots.numel(); i < n; ++i) {
    TORCH_CHECK(ks[i] >= 0 && ks[i] < num_slots, "edge_rtgi::decode_attention: key slot ", ks[i],
                " out of range [0, ", num_slots, ")");
  }
  Tensor out = at::empty(q.sizes(), q.options());
  if (q.scalar_type() == at::kFloat) {
    write_slots<float>(k_new, k_store, new_slots);
    write_slots<float>(v_new, v_store, new_slots);
    decode_attention_impl<float>(q, k_store, v_store, key_slots, key_mask, scale, out);
  } else {
    write_slots<bf16_bits>(k_new, k_store, new_slots);
    write_slots<bf16_bits>(v_new, v_store, new_slots);
    decode_attention_impl<bf16_bits>(q, k_store, v_store, key_slots, key_mask, scale, out);
  }
  return out;
}

// --- Decode attention over int4 KV (KIVI) ---------------------------------------------------
//
// Int4KIVIPagedKVStorage's layout (edge_rtgi/llm/kv/int4.py), read where it lies: no dequantised
// copy of the cache. Codes are packed two per byte, the even channel in the low nibble.
//   keys:   codes [N, Hkv, D/2]; fp16 scale and zero per block of block_size slots and channel
//           [NB, Hkv, D]; a block not yet full has its keys in full precision in k_open
//           [R, block_size, Hkv, D] at row open_row[block] (-1: closed, its codes are valid).
//   values: codes [N, Hkv, D/2]; fp16 scale and zero per slot and group of value_group channels
//           [N, Hkv, D/value_group].
// With k_i = c_i s_i + z_i, q.k = sum_i (q_i s_i) c_i + sum_i q_i z_i: per query head and block,
// qs = q*s and qz = q.z are formed once, then each key costs one dot of qs with its codes.
// Values likewise: acc += (p s_g) c per channel, and p z_g is summed per group and added once.

struct Int4Layer {
  const uint8_t* k_codes;
  const uint16_t* k_scale;  // fp16 bits
  const uint16_t* k_zero;
  const int64_t* open_row;
  const uint8_t* v_codes;
  const uint16_t* v_scale;
  const uint16_t* v_zero;
  int64_t num_kv_heads, block_size, value_group;
};

// fp16 bits -> float: F16C's instruction where the build has it (x86-64-v3 and up); elsewhere the
// bit manipulation that c10::Half's conversion also falls back to in an extension build.
inline float half_to_f(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// Codes of one slot and head, as floats in nibble order: the low nibbles (even channels) in
// out[0, half), the high nibbles (odd channels) in out[half, 2 half). Kept in this order through
// the dot products and the value sums; only the output goes back to channel order.
inline void unpack_codes(const uint8_t* __restrict__ codes, int64_t half, float* __restrict__ out) {
  for (int64_t i = 0; i < half; ++i) {
    out[i] = static_cast<float>(codes[i] & 15);
    out[half + i] = static_cast<float>(codes[i] >> 4);
  }
}

#ifdef EDGE_RTGI_AVX512
// 16 bytes of codes -> their low and high nibbles as 16 floats each.
inline void nibbles16(const uint8_t* p, __m512& lo, __m512& hi) {
  const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4));
}
#endif

// One key's scores: out[j * stride] = qz[j] + qs_j . codes for the query heads j < group (qs:
// [group, 2 half], nibble order). scratch: 2 half floats for the portable loop.
inline void int4_key_scores(const uint8_t* codes, const float* qs, const float* qz, int64_t group, int64_t half,
                            float* out, int64_t stride, float* scratch) {
#ifdef EDGE_RTGI_AVX512
  if (half % 16 == 0) {  // codes unpacked in registers once for all heads; the compiler's loop
    constexpr int64_t kHeads = 4;  // unpacked to memory and reduced each head separately
    for (int64_t j0 = 0; j0 < group; j0 += kHeads) {
      const int64_t nj = std::min(kHeads, group - j0);
      __m512 acc[kHeads] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t i = 0; i < half; i += 16) {
        __m512 lo, hi;
        nibbles16(codes + i, lo, hi);
        for (int64_t j = 0; j < nj; ++j) {
          const float* q = qs + (j0 + j) * 2 * half;
          acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), lo, acc[j]);
          acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + half + i), hi, acc[j]);
        }
      }
      for (int64_t j = 0; j < nj; ++j) out[(j0 + j) * stride] = qz[j0 + j] + _mm512_reduce_add_ps(acc[j]);
    }
    return;
  }
#endif
  unpack_codes(codes, half, scratch);
  for (int64_t j = 0; j < group; ++j) out[j * stride] = qz[j] + dot(qs + j * 2 * half, scratch, 2 * half);
}

// One value's share: acc_j += ps[j * vgroups + g] * codes of channel group g, for the query heads
// j < group (acc: [group, 2 half], nibble order; group g is bytes [g half_vg, (g + 1) half_vg)).
inline void int4_value_axpy(const uint8_t* codes, const float* ps, int64_t group, int64_t half, int64_t half_vg,
                            int64_t vgroups, float* acc, float* scratch) {
#ifdef EDGE_RTGI_AVX512
  if (half_vg % 16 == 0) {
    for (int64_t i = 0; i < half; i += 16) {
      __m512 lo, hi;
      nibbles16(codes + i, lo, hi);
      const int64_t g = i / half_vg;
      for (int64_t j = 0; j < group; ++j) {
        const __m512 w = _mm512_set1_ps(ps[j * vgroups + g]);
        float* a = acc + j * 2 * half;
        _mm512_storeu_ps(a + i, _mm512_fmadd_ps(w, lo, _mm512_loadu_ps(a + i)));
        _mm512_storeu_ps(a + half + i, _mm512_fmadd_ps(w, hi, _mm512_loadu_ps(a + half + i)));
      }
    }
    return;
  }
#endif
  unpack_codes(codes, half, scratch);
  const float* __restrict__ c = scratch;
  for (int64_t j = 0; j < group; ++j) {
    float* __restrict__ a = acc + j * 2 * half;
    for (int64_t g = 0; g < vgroups; ++g) {
      const float w = ps[j * vgroups + g];
      for (int64_t i = g * half_vg; i < (g + 1) * half_vg; ++i) {
        a[i] += w * c[i];
        a[half + i] += w * c[half + i];
      }
    }
  }
}

template <typename T>
void decode_attention_int4_impl(const Tensor& q, const Int4Layer& kv, const T* k_open, const Tensor& key_slots,
                                const c10::optional<Tensor>& key_mask, double scale, Tensor& out) {
  const int64_t rows = q.size(0), num_heads = q.size(1), dim = q.size(2), half = dim / 2;
  const int64_t num_kv_heads = kv.num_kv_heads, group = num_heads / num_kv_heads;
  const int64_t num_keys = key_slots.size(1), bs = kv.block_size;
  const int64_t vgroups = dim / kv.value_group, half_vg = kv.value_group / 2;
  const int64_t code_stride = num_kv_heads * half;
  const T* qp = in_ptr<T>(q);
  const int64_t* slots = key_slots.const_data_ptr<int64_t>();
  const bool* mask = key_mask.has_value() ? key_mask->const_data_ptr<bool>() : nullptr;
  T* op = out_ptr<T>(out);
  const float sc = static_cast<float>(scale);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  // Work items: (row, kv head, stretch of keys). At batch 1 there are only a few KV heads (3 for
  // SmolLM2), which would leave a core idle part of the time; stretches give every thread several
  // items. Their partial softmax sums are merged at the end (flash-decoding), which changes only
  // the order of the sums. A stretch is a whole number of blocks, so a block's qs/qz is formed once.
  const int64_t heads_total = rows * num_kv_heads;
  const int64_t want_items = 8 * static_cast<int64_t>(at::get_num_threads());
  int64_t splits = std::min((want_items + heads_total - 1) / heads_total, std::max<int64_t>(1, num_keys / 128));
  splits = std::max<int64_t>(1, splits);
  const int64_t stretch = std::max<int64_t>(1, ((num_keys + splits - 1) / splits + bs - 1) / bs * bs);
  splits = std::max<int64_t>(1, (num_keys + stretch - 1) / stretch);
  const int64_t work = heads_total * splits;
  std::vector<float> part_max(work * group), part_sum(work * group), part_acc(work * group * dim);
  float* pmax = part_max.data();
  float* psum = part_sum.data();
  float* pacc = part_acc.data();
  at::parallel_for(0, work, grain_rows(stretch * dim * group * 2), [=](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), qs(group * dim), qz(group), sz(2 * dim), codes(dim);
    std::vector<float> scores(group * stretch), acc(group * dim), zacc(group * vgroups), vsz(2 * vgroups),
        ps(group * vgroups);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t split = item % splits, bh = item / splits;
      const int64_t b = bh / num_kv_heads, h = bh % num_kv_heads;
      const int64_t s0 = split * stretch, n = std::min(num_keys, s0 + stretch) - s0;
      const int64_t* row_slots = slots + b * num_keys + s0;
      const bool* row_mask = mask ? mask + b * num_keys + s0 : nullptr;
      for (int64_t j = 0; j < group; ++j) {
        const T* qh = qp + (b * num_heads + h * group + j) * dim;
        for (int64_t i = 0; i < dim; ++i) qf[j * dim + i] = to_f(qh[i]) * sc;
      }
      // Scores (masked keys -inf).
      int64_t cur_block = -1, cur_row = -1;
      for (int64_t s = 0; s < n; ++s) {
        if (row_mask && !row_mask[s]) {
          for (int64_t j = 0; j < group; ++j) scores[j * stretch + s] = kNegInf;
          continue;
        }
        const int64_t slot = row_slots[s], block = slot / bs;
        if (block != cur_block) {
          cur_block = block;
          cur_row = kv.open_row[block];
          if (cur_row < 0) {  // a closed block: its per-channel scale and zero, folded into q
            const uint16_t* ks = kv.k_scale + (block * num_kv_heads + h) * dim;
            const uint16_t* kz = kv.k_zero + (block * num_kv_heads + h) * dim;
            for (int64_t i = 0; i < half; ++i) {  // nibble order, as unpack_codes
              sz[i] = half_to_f(ks[2 * i]);
              sz[half + i] = half_to_f(ks[2 * i + 1]);
            }
            for (int64_t i = 0; i < dim; ++i) sz[dim + i] = half_to_f(kz[i]);
            for (int64_t j = 0; j < group; ++j) {
              const float* qj = qf.data() + j * dim;
              float* qsj = qs.data() + j * dim;
              for (int64_t i = 0; i < half; ++i) {
                qsj[i] = qj[2 * i] * sz[i];
                qsj[half + i] = qj[2 * i + 1] * sz[half + i];
              }
              qz[j] = dot(qj, sz.data() + dim, dim);
            }
          }
        }
        if (cur_row >= 0) {  // an open block: full-precision keys
          const T* key = k_open + ((cur_row * bs + slot % bs) * num_kv_heads + h) * dim;
          for (int64_t j = 0; j < group; ++j) scores[j * stretch + s] = dot(qf.data() + j * dim, key, dim);
        } else {
          int4_key_scores(kv.k_codes + slot * code_stride + h * half, qs.data(), qz.data(), group, half,
                          scores.data() + s, stretch, codes.data());
        }
      }
      // Each head's softmax weights over the stretch, relative to the stretch's maximum.
      for (int64_t j = 0; j < group; ++j) {
        float* sj = scores.data() + j * stretch;
        float row_max = kNegInf;
        for (int64_t s = 0; s < n; ++s) row_max = std::max(row_max, sj[s]);
        for (int64_t s = 0; s < n; ++s) sj[s] = sj[s] == kNegInf ? 0.f : exp_f(sj[s] - row_max);
        pmax[item * group + j] = row_max;
        psum[item * group + j] = sum(sj, n);
      }
      // Weighted values: codes times (p * scale) per channel, p * zero per group.
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(zacc.begin(), zacc.end(), 0.f);
      for (int64_t s = 0; s < n; ++s) {
        if (row_mask && !row_mask[s]) continue;
        const int64_t slot = row_slots[s];
        const uint16_t* vs = kv.v_scale + (slot * num_kv_heads + h) * vgroups;
        const uint16_t* vz = kv.v_zero + (slot * num_kv_heads + h) * vgroups;
        for (int64_t g = 0; g < vgroups; ++g) {
          vsz[g] = half_to_f(vs[g]);
          vsz[vgroups + g] = half_to_f(vz[g]);
        }
        for (int64_t j = 0; j < group; ++j) {
          const float p = scores[j * stretch + s];
          for (int64_t g = 0; g < vgroups; ++g) {
            ps[j * vgroups + g] = p * vsz[g];
            zacc[j * vgroups + g] += p * vsz[vgroups + g];
          }
        }
        int4_value_axpy(kv.v_codes + slot * code_stride + h * half, ps.data(), group, half, half_vg, vgroups,
                        acc.data(), codes.data());
      }
      for (int64_t j = 0; j < group; ++j) {  // back to channel order, plus the zeros' share
        const float* aj = acc.data() + j * dim;
        float* pj = pacc + (item * group + j) * dim;
        for (int64_t i = 0; i < half; ++i) {
          const float z = zacc[j * vgroups + i / half_vg];
          pj[2 * i] = aj[i] + z;
          pj[2 * i + 1] = aj[half + i] + z;
        }
      }
    }
  });
  // Merge the stretches of each (row, query head).
  for (int64_t bh = 0; bh < heads_total; ++bh) {
    const int64_t b = bh / num_kv_heads, h = bh % num_kv_heads;
    for (int64_t j = 0; j < group; ++j) {
      float top = kNegInf;
      for (int64_t k = 0; k < splits; ++k) top = std::max(top, pmax[(bh * splits + k) * group + j]);
      float denom = 0.f;
      std::vector<float> o(dim, 0.f);
      for (int64_t k = 0; k < splits && top != kNegInf; ++k) {
        const int64_t idx = (bh * splits + k) * group + j;
        if (pmax[idx] == kNegInf) continue;
        const float w = exp_f(pmax[idx] - top);
        denom += w * psum[idx];
        for (int64_t i = 0; i < dim; ++i) o[i] += w * pacc[idx * dim + i];
      }
      // A row with every key masked out gets zeros (as decode_attention); callers never pass one.
      const float inv = denom > 0.f ? 1.f / denom : 0.f;
      T* oh = op + (b * num_heads + h * group + j) * dim;
      for (int64_t i = 0; i < dim; ++i) oh[i] = from_f<T>(o[i] * inv);
    }
  }
}

Tensor decode_attention_int4(const Tensor& q_in, const Tensor& k_codes, const Tensor& k_scale, const Tensor& k_zero,
                             const Tensor& k_open, const Tensor& open_row, const Tensor& v_codes,
                             const Tensor& v_scale, const Tensor& v_zero, const Tensor& key_slots_in,
                             const c10::optional<Tensor>& key_mask_in, double scale, int64_t block_size,
                             int64_t value_group) {
  const char* op = "edge_rtgi::decode_attention_int4: ";
  check_activation(q_in, "decode_attention_int4");
  TORCH_CHECK(q_in.dim() == 3, op, "q must be [B, Hq, D], got ", q_in.sizes());
  TORCH_CHECK(q_in.size(0) > 0 && q_in.size(1) > 0, op, "q needs at least one row and one head, got ", q_in.sizes());
  TORCH_CHECK(k_codes.dim() == 3, op, "k_codes must be [N, Hkv, D/2], got ", k_codes.sizes());
  const int64_t rows = q_in.size(0), dim = q_in.size(2);
  const int64_t num_slots = k_codes.size(0), num_kv_heads = k_codes.size(1);
  TORCH_CHECK(dim % 2 == 0 && k_codes.size(2) * 2 == dim, op, "k_codes must hold two channels per byte of q's ",
              "head dim ", dim, " (even): [N, Hkv, ", dim / 2, "], got ", k_codes.sizes());
  TORCH_CHECK(num_kv_heads > 0 && q_in.size(1) % num_kv_heads == 0, op, "the ", q_in.size(1),
              " query heads are not a multiple of the ", num_kv_heads, " KV heads");
  TORCH_CHECK(block_size > 0 && num_slots % block_size == 0, op, "block_size ", block_size,
              " must be positive and divide the ", num_slots, " slots");
  TORCH_CHECK(value_group > 0 && value_group % 2 == 0 && dim % value_group == 0, op, "value_group ", value_group,
              " must be even and divide the head dim ", dim);
  TORCH_CHECK(k_open.dim() == 4, op, "k_open must be [R, block_size, Hkv, D], got ", k_open.sizes());
  const int64_t num_blocks = num_slots / block_size, open_rows = k_open.size(0);
  auto expect = [&](const Tensor& t, const char* name, at::ScalarType type, std::vector<int64_t> shape) {
    TORCH_CHECK(t.device().is_cpu(), op, name, " must be a CPU tensor, got ", t.device());
    TORCH_CHECK(t.scalar_type() == type, op, name, " must be ", type, ", got ", t.scalar_type());
    TORCH_CHECK(t.sizes() == at::IntArrayRef(shape), op, name, " must be ", at::IntArrayRef(shape), ", got ",
                t.sizes());
    TORCH_CHECK(t.is_contiguous(), op, name, " must be contiguous");
  };
  expect(k_codes, "k_codes", at::kByte, {num_slots, num_kv_heads, dim / 2});
  expect(v_codes, "v_codes", at::kByte, {num_slots, num_kv_heads, dim / 2});
  expect(k_scale, "k_scale", at::kHalf, {num_blocks, num_kv_heads, dim});
  expect(k_zero, "k_zero", at::kHalf, {num_blocks, num_kv_heads, dim});
  expect(v_scale, "v_scale", at::kHalf, {num_slots, num_kv_heads, dim / value_group});
  expect(v_zero, "v_zero", at::kHalf, {num_slots, num_kv_heads, dim / value_group});
  expect(k_open, "k_open", q_in.scalar_type(), {open_rows, block_size, num_kv_heads, dim});
  expect(open_row, "open_row", at::kLong, {num_blocks});
  const int64_t* rows_of = open_row.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < num_blocks; ++b) {
    TORCH_CHECK(rows_of[b] >= -1 && rows_of[b] < open_rows, op, "open_row[", b, "] = ", rows_of[b],
                " is outside [-1, ", open_rows, ")");
  }
  TORCH_CHECK(key_slots_in.dim() == 2 && key_slots_in.size(0) == rows, op, "key_slots must be [B, S] with B = ",
              rows, " (one row per query row), got ", key_slots_in.sizes());
  Tensor q = q_in.contiguous(), key_slots = key_slots_in.to(at::kLong).contiguous();
  const int64_t num_keys = key_slots.size(1);
  c10::optional<Tensor> key_mask;
  if (key_mask_in.has_value()) {
    TORCH_CHECK(key_mask_in->numel() == rows * num_keys, op, "key_mask must have one flag per key slot ([B, S] or ",
                "[B, 1, 1, S] with B, S = ", rows, ", ", num_keys, "), got ", key_mask_in->sizes());
    key_mask = key_mask_in->to(at::kBool).reshape({rows, num_keys}).contiguous();
  }
  const int64_t* ks = key_slots.const_data_ptr<int64_t>();
  for (int64_t i = 0, n = key_slots.numel(); i < n; ++i) {
    TORCH_CHECK(ks[i] >= 0 && ks[i] < num_slots, op, "key slot ", ks[i], " out of range [0, ", num_slots, ")");
  }
  auto bits = [](const Tensor& t) { return reinterpret_cast<const uint16_t*>(t.const_data_ptr<at::Half>()); };
  const Int4Layer kv{k_codes.const_data_ptr<uint8_t>(), bits(k_scale), bits(k_zero), rows_of,
                     v_codes.const_data_ptr<uint8_t>(), bits(v_scale), bits(v_zero), num_kv_heads,
                     block_size, value_group};
  Tensor out = at::empty(q.sizes(), q.options());
  if (q.scalar_type() == at::kFloat) {
    decode_attention_int4_impl<float>(q, kv, in_ptr<float>(k_open), key_slots, key_mask, scale, out);
  } else {
    decode_attention_int4_impl<bf16_bits>(q, kv, in_ptr<bf16_bits>(k_open), key_slots, key_mask, scale, out);
  }
  return out;
}

// --- Weight-only int4 / int8 matmuls for a few rows ---------------------------------------------
//
// ATen's weight-only kernels cost time in proportion to their rows (docs/cpu_kernels.md): each
// row pays the weight read and the dequantisation again. A verification step (k+1 rows of one
// request) or a decode batch of a few sequences should cost little more than one row, so these
// read each block of weights once, dequantise it once into a small buffer that stays in L1, and
// apply it to every row (up to kBf16RowTile rows in registers at a time). Same weight layouts as
// ATen's kernels (the prepared weights are unchanged):
//   int4: _convert_weight_to_int4pack_for_cpu's layout: blocks of B output rows (B = 64 where ATen
//         runs its AVX-512 code, 32 elsewhere: int4_pack_layout), each [K, B/2] bytes with row n
//         at column n % (B/2), in the high nibble when n % B >= B/2 (ATen's generic code: rows 2i
//         and 2i+1 in the low / high nibble of byte i, `adjacent_pairs`); a last block of fewer
//         rows is [K, rows/2] with rows 2i / 2i+1 in the low / high nibble of byte i. The AVX-512
//         loops read the 64-row pack only; other packs take the plain loops.
//         w = (code - 8) * scale + zero with [K/G, N, 2] (scale, zero) pairs.
//   int8: [N, K] int8 with a scale per output row.
// int4 sums are factored per group: sum_k x w = scale * sum_k x (code - 8) + zero * sum_k x, so
// the inner loop multiplies by small integers that bf16 holds exactly; only the order of the
// fp32 sums differs from dequantise-then-matmul.

constexpr int64_t kInt4BlockRows = 64;
constexpr int64_t kMaxRowChunk = 16;  // rows held per pass over the weights (more: another pass)
// With AMX, two 16-row activation tiles share one pass: the codes are decoded once for both.
constexpr int64_t kAmxRowChunk = 32;
constexpr int64_t kMaxBf16Group = 128;  // the largest int4 group the AVX-512 BF16 loop buffers
// How far ahead of the kernels' reads the weights are fetched: they stream through once, and their
// loads were the multi-row kernels' largest stall (perf, docs/cpu_kernels.md).
constexpr int64_t kPrefetchBytes = 2048;
// Inputs of 2..kMultiRowMax rows take these kernels in the layer loop and in Int4/Int8Linear;
// one row stays on ATen's kernels, which are as fast there but against an int8 LM head (Python
// decides: cpu_ops.int8_kernel_usable; docs/cpu_kernels.md). 17..32 rows were measured against
// ATen and the dense copies with the AVX-512 BF16 loops (AMX or not) and, on a build for AVX2
// without AVX-512, for int4_i8_mm, the fp32 int8 head and int4_mm's plain loops; other builds stop
// at 16.
#if (defined(EDGE_RTGI_AVX512) && defined(__AVX512BF16__)) || defined(EDGE_RTGI_AVX2_FMA)
constexpr int64_t kMultiRowMax = 32;
#else
constexpr int64_t kMultiRowMax = 16;
#endif
// Calls of int4_mm / int8_mm, so that tests can check the layer loop really used them.
std::atomic<int64_t> g_multi_row_calls{0};

// How ATen's CPU int4 pack lays out output rows. ATen picks the layout by the CPU it runs on:
// blocks of 64 rows with AVX-512, of 32 with AVX2, in either rows d and d + block/2 share byte d of a
// column; its generic code (ATEN_CPU_CAPABILITY=default, and presumably Arm) packs blocks of 32
// whose byte d holds rows 2d and 2d + 1. block 0: a layout this file does not know.
struct Int4PackLayout {
  int64_t block = 0;
  bool adjacent_pairs = false;  // byte d holds rows 2d, 2d + 1 (not d, d + block/2)
};

// This process's layout, read off a packed probe once (the int4 kernels refuse to run on block 0).
const Int4PackLayout& int4_pack_layout();

struct Int4Weights {
  const uint8_t* packed;
  int64_t n, k, group;
  // ATen's pack: blocks of `pack.block` rows one after another, each [K, block/2] bytes with rows d
  // and d + block/2 in the low and high nibble of byte d, or rows 2d and 2d + 1 (`adjacent_pairs`);
  // a last block of fewer rows is [K, rows/2] with rows 2i / 2i+1 in the low / high nibble of byte i
  // (docs/cpu_kernels.md)
  Int4PackLayout pack = int4_pack_layout();
};

void check_int4_pack(const char* name) {
  TORCH_CHECK(int4_pack_layout().block != 0, "edge_rtgi::", name, ": this PyTorch packs int4 for the CPU in ",
              "a layout these kernels do not know; use quant int8 or update edge-rtgi");
}

// Codes minus 8 of output rows [n0, n0 + rows) at input k, as floats (the portable path); n0 is a
// multiple of the pack's block.
inline void int4_codes(const Int4Weights& w, int64_t n0, int64_t rows, int64_t k, float* out) {
  const int64_t block = w.pack.block;
  for (int64_t b0 = n0; b0 < n0 + rows; b0 += block) {
    const int64_t block_rows = std::min(block, w.n - b0);
    const uint8_t* base = w.packed + b0 * w.k / 2;  // blocks are stored one after another
    float* o = out + (b0 - n0);
    if (block_rows == block && !w.pack.adjacent_pairs) {
      const int64_t half = block / 2;
      const uint8_t* col = base + k * half;
      for (int64_t j = 0; j < half; ++j) {
        o[j] = static_cast<float>(col[j] & 0x0F) - 8.f;
        o[j + half] = static_cast<float>(col[j] >> 4) - 8.f;
      }
    } else {
      const uint8_t* col = base + k * (block_rows / 2);
      for (int64_t i = 0; i < block_rows / 2; ++i) {
        o[2 * i] = static_cast<float>(col[i] & 0x0F) - 8.f;
        o[2 * i + 1] = static_cast<float>(col[i] >> 4) - 8.f;
      }
    }
  }
}

const Int4PackLayout& int4_pack_layout() {
  // the first known layout under which int4_codes, the kernels' own reader, gives the probe's codes
  static const Int4PackLayout layout = [] {
    const int64_t n = 64, k = 32;
    const Tensor codes = at::arange(n * k, at::kInt).remainder(13).reshape({n, k});
    const Tensor packed = at::_convert_weight_to_int4pack_for_cpu(codes, 1).contiguous();
    if (packed.scalar_type() != at::kByte || packed.numel() != n * k / 2) return Int4PackLayout{};
    const int32_t* c = codes.const_data_ptr<int32_t>();
    float read[n];
    for (const Int4PackLayout candidate : {Int4PackLayout{64, false}, Int4PackLayout{32, false},
                                           Int4PackLayout{32, true}}) {
      const Int4Weights w{packed.const_data_ptr<uint8_t>(), n, k, k, candidate};
      bool same = true;
      for (int64_t kk = 0; kk < k && same; ++kk) {
        int4_codes(w, 0, n, kk, read);
        for (int64_t j = 0; j < n && same; ++j) same = read[j] + 8.f == static_cast<float>(c[j * k + kk]);
      }
      if (same) return candidate;
    }
    return Int4PackLayout{};
  }();
  return layout;
}

// One block of int4 output rows for `m` activation rows, plain loops the compiler vectorises.
template <typename T>
void int4_block_portable(const Int4Weights& w, const T* sz, const float* xf, const float* xsum, int64_t m,
                         int64_t n0, int64_t rows, T* out) {
  const int64_t groups = w.k / w.group;
  float total[kMaxRowChunk][kInt4BlockRows] = {};
  float acc[kMaxRowChunk][kInt4BlockRows];
  float codes[kInt4BlockRows];
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t r = 0; r < m; ++r) std::fill(acc[r], acc[r] + rows, 0.f);
    for (int64_t k = g * w.group; k < (g + 1) * w.group; ++k) {
      int4_codes(w, n0, rows, k, codes);
      for (int64_t r = 0; r < m; ++r) {
        const float xv = xf[r * w.k + k];
        for (int64_t j = 0; j < rows; ++j) acc[r][j] += xv * codes[j];
      }
    }
    const T* pairs = sz + (g * w.n + n0) * 2;
    for (int64_t r = 0; r < m; ++r) {
      const float xs = xsum[r * groups + g];
      for (int64_t j = 0; j < rows; ++j) {
        total[r][j] += to_f(pairs[2 * j]) * acc[r][j] + to_f(pairs[2 * j + 1]) * xs;
      }
    }
  }
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t j = 0; j < rows; ++j) out[r * w.n + n0 + j] = from_f<T>(total[r][j]);
  }
}

#if defined(EDGE_RTGI_AVX512) && defined(__AVX512BF16__)
#define EDGE_RTGI_AVX512_BF16 1

// One group of a 64-row int4 block decoded to bf16 (code - 8) pairs, [G/2][4 vectors of 16 output
// rows][2 inputs] (the B-tile layout AMX wants, and what the AVX-512 BF16 loop reads).
inline void int4_decode_group(const uint8_t* block, const Int4Weights& w, int64_t g, __m512i* codes) {
  // bf16 of (code - 8) for code 0..15, indexed by the code in each 16-bit lane.
  static const __m512i lut = [] {
    alignas(64) bf16_bits values[32];
    for (int c = 0; c < 32; ++c) values[c] = from_f<bf16_bits>(static_cast<float>((c & 15) - 8));
    return _mm512_load_si512(values);
  }();
  const __m512i low_nibble = _mm512_set1_epi16(0x0F);
  const int64_t pairs = w.group / 2;
  const uint8_t* first = block + g * w.group * 32;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint8_t* col = first + 2 * p * 32;  // input k; input k + 1 follows
    _mm_prefetch(reinterpret_cast<const char*>(col + kPrefetchBytes), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(col + 16 * h));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(col + 32 + 16 * h));
      // bytes of rows 16h..16h+15 at k and k+1, interleaved: one 32-bit pair per output row
      const __m256i both = _mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b));
      const __m512i words = _mm512_cvtepu8_epi16(both);
      codes[4 * p + h] = _mm512_permutexvar_epi16(_mm512_and_si512(words, low_nibble), lut);
      codes[4 * p + 2 + h] = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), lut);
    }
  }
}

// Rows [r0, r0 + R) of one int4 group: `codes` holds the group's codes minus 8 as bf16 pairs,
// [G/2][4 vectors of 16 output rows][2 inputs]; each step broadcasts a pair of activations and
// adds both products into 16 output rows with one dot-product instruction.
template <int R>
inline void int4_group_rows(const __m512i* codes, int64_t pairs, const bf16_bits* x, int64_t k_stride, int64_t k0,
                            const float* xsum, int64_t groups, int64_t g, const __m512* scale, const __m512* zero,
                            float* total) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512i* c = codes + 4 * p;
    for (int r = 0; r < R; ++r) {
      int32_t both;
      std::memcpy(&both, x + r * k_stride + k0 + 2 * p, sizeof(both));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(both);
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, (__m512bh)c[v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 xs = _mm512_set1_ps(xsum[r * groups + g]);
    float* t = total + r * kInt4BlockRows;
    for (int v = 0; v < 4; ++v) {
      __m512 tv = _mm512_loadu_ps(t + 16 * v);
      tv = _mm512_fmadd_ps(acc[r][v], scale[v], tv);
      _mm512_storeu_ps(t + 16 * v, _mm512_fmadd_ps(zero[v], xs, tv));
    }
  }
}

// The AVX-512 BF16 loops take rows in passes of up to kBf16RowTile (4 x R accumulators, 4 weight
// vectors and a broadcast fit the 32 registers at R = 6), split as evenly as they go: 5 rows in
// one pass rather than 4 + 1, 8 as 4 + 4 (docs/cpu_kernels.md, "Row passes without AMX").
constexpr int64_t kBf16RowTile = 6;

// The rows of pass `i` of `passes` over `m` rows starting at row `r` (the rest split evenly).
inline int64_t pass_rows(int64_t m, int64_t r, int64_t i, int64_t passes) { return (m - r) / (passes - i); }

// f(std::integral_constant<int, rows>{}) for rows in 1..kBf16RowTile: the pass's row count as a
// compile-time constant, so that its accumulators are a fixed set of registers.
template <typename F>
inline void with_row_tile(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    default: TORCH_CHECK(false, "a pass of ", rows, " rows: the AVX-512 BF16 loops take 1..", kBf16RowTile);
  }
}

// A full block of 64 int4 output rows for `m` bf16 activation rows (AVX-512 BF16).
void int4_block_bf16(const Int4Weights& w, const bf16_bits* sz, const bf16_bits* x, const float* xsum, int64_t m,
                     int64_t n0, bf16_bits* out) {
  const int64_t groups = w.k / w.group, pairs = w.group / 2;
  alignas(64) float total[kMaxRowChunk * kInt4BlockRows];
  std::fill(total, total + m * kInt4BlockRows, 0.f);  // only the rows in use: this runs per block
  __m512i codes[4 * kMaxBf16Group / 2];
  const uint8_t* block = w.packed + n0 * w.k / 2;
  for (int64_t g = 0; g < groups; ++g) {
    int4_decode_group(block, w, g, codes);
    __m512 scale[4], zero[4];
    const bf16_bits* sz_row = sz + (g * w.n + n0) * 2;
    for (int v = 0; v < 4; ++v) {
      // 16 (scale, zero) bf16 pairs: the scale in the low half of each 32-bit lane
      const __m512i sp = _mm512_loadu_si512(sz_row + 32 * v);
      scale[v] = _mm512_castsi512_ps(_mm512_slli_epi32(sp, 16));
      zero[v] = _mm512_castsi512_ps(_mm512_and_si512(sp, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
    }
    const int64_t passes = (m + kBf16RowTile - 1) / kBf16RowTile;
    for (int64_t i = 0, r = 0; i < passes; ++i) {
      const int64_t rows = pass_rows(m, r, i, passes);
      with_row_tile(rows, [&](auto tile) {
        int4_group_rows<decltype(tile)::value>(codes, pairs, x + r * w.k, w.k, g * w.group, xsum + r * groups, groups,
                                               g, scale, zero, total + r * kInt4BlockRows);
      });
      r += rows;
    }
  }
  for (int64_t r = 0; r < m; ++r) {
    for (int v = 0; v < 4; v += 2) {
      const __m512bh two = _mm512_cvtne2ps_pbh(_mm512_load_ps(total + r * kInt4BlockRows + 16 * (v + 1)),
                                               _mm512_load_ps(total + r * kInt4BlockRows + 16 * v));
      _mm512_storeu_si512(out + r * w.n + n0 + 16 * v, (__m512i)two);
    }
  }
}

// Rows [r0, r0 + R) against 4 int8 output rows held as bf16 in `wb` ([4][K]).
template <int R>
inline void int8_tile_rows(const bf16_bits* wb, const bf16_bits* x, int64_t k, float* dots /*[R][4]*/) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 32) {
    __m512bh wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wb + j * k + i);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * k + i);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
  for (int r = 0; r < R; ++r) _mm_storeu_ps(dots + 4 * r, sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
}

// Output rows [n0, n1) of an int8 matmul for `m` bf16 activation rows (K a multiple of 32), in bf16
// or, for logits, float (O).
template <typename O>
void int8_rows_bf16(const int8_t* q, const bf16_bits* scales, const bf16_bits* x, int64_t m, int64_t n, int64_t k,
                    int64_t n0, int64_t n1, O* out) {
  std::vector<bf16_bits> wb(4 * k);
  float dots[kBf16RowTile * 4];
  for (int64_t t = n0; t < n1; t += 4) {
    // The tile's 4 weight rows as bf16 (int8 is exact in bf16), once for every activation row;
    // a last tile past N repeats row N - 1 and its results are not stored.
    for (int j = 0; j < 4; ++j) {
      const int8_t* row = q + std::min(t + j, n - 1) * k;
      for (int64_t i = 0; i < k; i += 32) {
        _mm_prefetch(reinterpret_cast<const char*>(row + i + kPrefetchBytes), _MM_HINT_T0);  // rows lie in order
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i))));
        const __m512 hi =
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i + 16))));
        _mm512_storeu_si512(wb.data() + j * k + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
    }
    const int64_t cols = std::min<int64_t>(4, n - t);
    float sc[4];
    for (int j = 0; j < 4; ++j) sc[j] = to_f(scales[std::min(t + j, n - 1)]);
    const int64_t passes = (m + kBf16RowTile - 1) / kBf16RowTile;
    for (int64_t pass = 0, r = 0; pass < passes; ++pass) {
      const int64_t tile = pass_rows(m, r, pass, passes);
      with_row_tile(tile, [&](auto rows) { int8_tile_rows<decltype(rows)::value>(wb.data(), x + r * k, k, dots); });
      for (int64_t i = 0; i < tile; ++i) {
        // ATen's int8 kernel also applies the scale to the finished fp32 dot product.
        for (int64_t j = 0; j < cols; ++j) out[(r + i) * n + t + j] = from_f<O>(dots[4 * i + j] * sc[j]);
      }
      r += tile;
    }
  }
}
#endif

#if defined(EDGE_RTGI_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define EDGE_RTGI_AMX 1

// AMX: one tile instruction multiplies up to 16 rows by 32 inputs by 16 outputs (8,192 products),
// where the AVX-512 BF16 loop above does 32 per instruction and grows with the rows. The kernel
// must ask Linux for the tile state once per process; where that fails the AVX-512 loops run.
bool amx_ready() {
  static const bool ready = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // arch_prctl(2), asm/prctl.h
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void set(int tile, int tile_rows, int bytes_per_row) {
    rows[tile] = static_cast<uint8_t>(tile_rows);
    colsb[tile] = static_cast<uint16_t>(bytes_per_row);
  }
};

// int4, a block of 64 output rows for m (2..32) bf16 activation rows. Tiles: 0 = activations
// [16 rows at most, 32 inputs], 1 and 6 = decoded codes [16 input pairs, 16 outputs x 2], 2..5 =
// sums [rows, 16]. Above 16 rows the codes decoded for a group serve both 16-row tiles of `x`,
// which then must hold 32 rows (the caller pads it with zeros), as the tiles are set for 16.
// The codes buffer is laid out as the tile unit wants its B operand: [input pair][output][2].
void int4_block_amx(const Int4Weights& w, const bf16_bits* sz, const bf16_bits* x, const float* xsum, int64_t m,
                    int64_t n0, bf16_bits* out) {
  const int64_t groups = w.k / w.group, pairs = w.group / 2;
  alignas(64) float total[kAmxRowChunk * kInt4BlockRows];
  std::fill(total, total + m * kInt4BlockRows, 0.f);  // only the rows in use: this runs per block
  alignas(64) float sums[4][kMaxRowChunk * 16];
  alignas(64) __m512i codes[4 * kMaxBf16Group / 2];
  const uint8_t* block = w.packed + n0 * w.k / 2;
  const int64_t x_stride = w.k * static_cast<int64_t>(sizeof(bf16_bits));
  for (int64_t g = 0; g < groups; ++g) {
    int4_decode_group(block, w, g, codes);
    const bf16_bits* sz_row = sz + (g * w.n + n0) * 2;
    for (int64_t r0 = 0; r0 < m; r0 += kMaxRowChunk) {
      _tile_zero(2);
      _tile_zero(3);
      _tile_zero(4);
      _tile_zero(5);
      for (int64_t s = 0; s < pairs / 16; ++s) {
        const int64_t k0 = g * w.group + 32 * s;
        const char* b = reinterpret_cast<const char*>(codes + 4 * 16 * s);  // rows of 256 bytes
        _tile_loadd(0, x + r0 * w.k + k0, x_stride);
        _tile_loadd(1, b, 256);
        _tile_dpbf16ps(2, 0, 1);
        _tile_loadd(6, b + 64, 256);
        _tile_dpbf16ps(3, 0, 6);
        _tile_loadd(1, b + 128, 256);
        _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(6, b + 192, 256);
        _tile_dpbf16ps(5, 0, 6);
      }
      _tile_stored(2, sums[0], 64);
      _tile_stored(3, sums[1], 64);
      _tile_stored(4, sums[2], 64);
      _tile_stored(5, sums[3], 64);
      const int64_t r1 = std::min(m, r0 + kMaxRowChunk);
      for (int v = 0; v < 4; ++v) {
        const __m512i sp = _mm512_loadu_si512(sz_row + 32 * v);
        const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(sp, 16));
        const __m512 zero =
            _mm512_castsi512_ps(_mm512_and_si512(sp, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
        for (int64_t r = r0; r < r1; ++r) {
          float* t = total + r * kInt4BlockRows + 16 * v;
          __m512 tv = _mm512_fmadd_ps(_mm512_load_ps(sums[v] + 16 * (r - r0)), scale, _mm512_load_ps(t));
          _mm512_store_ps(t, _mm512_fmadd_ps(zero, _mm512_set1_ps(xsum[r * groups + g]), tv));
        }
      }
    }
  }
  for (int64_t r = 0; r < m; ++r) {
    for (int v = 0; v < 4; v += 2) {
      const __m512bh two = _mm512_cvtne2ps_pbh(_mm512_load_ps(total + r * kInt4BlockRows + 16 * (v + 1)),
                                               _mm512_load_ps(total + r * kInt4BlockRows + 16 * v));
      _mm512_storeu_si512(out + r * w.n + n0 + 16 * v, (__m512i)two);
    }
  }
}

// Tiles of min(m, 16) rows: above 16 rows the kernel runs 16-row tiles over padded activations.
TileConfig int4_tile_config(int64_t m) {
  m = std::min(m, kMaxRowChunk);
  TileConfig cfg;
  cfg.set(0, static_cast<int>(m), 64);
  cfg.set(1, 16, 64);
  cfg.set(6, 16, 64);
  for (int t = 2; t <= 5; ++t) cfg.set(t, static_cast<int>(m), 64);
  return cfg;
}

// int8, output rows [n0, n1) (a multiple of 32 apart, but for the last run) for m (2..32) bf16
// activation rows. Here the weights are the tile unit's A operand ([16 outputs, 32 inputs], rows
// as stored, widened to bf16) and the activations its B operand (`xpairs`: for each chunk of up to
// 16 rows, [K/2][rows] pairs of inputs), so the int8 rows need no transposing; the sums come out
// as [outputs, rows]. Tiles: 0 and 3 = weights, 1 and 4 = the two row chunks, 2, 5, 6, 7 = sums.
template <typename O>
void int8_rows_amx(const int8_t* q, const bf16_bits* scales, const uint32_t* xpairs, int64_t m, int64_t n, int64_t k,
                   int64_t n0, int64_t n1, O* out) {
  std::vector<bf16_bits> wb(32 * k);
  alignas(64) float sums[4][16 * 16];
  const int64_t m0 = std::min(m, kMaxRowChunk), m1 = m - m0;
  const uint32_t* xpairs1 = xpairs + k / 2 * m0;
  const int64_t w_stride = k * static_cast<int64_t>(sizeof(bf16_bits)), x_stride0 = m0 * 4, x_stride1 = m1 * 4;
  for (int64_t t = n0; t < n1; t += 32) {
    for (int64_t j = 0; j < 32; ++j) {
      const int8_t* row = q + std::min(t + j, n - 1) * k;  // rows past N repeat the last, unstored
      for (int64_t i = 0; i < k; i += 32) {
        _mm_prefetch(reinterpret_cast<const char*>(row + i + kPrefetchBytes), _MM_HINT_T0);  // rows lie in order
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i))));
        const __m512 hi =
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i + 16))));
        _mm512_storeu_si512(wb.data() + j * k + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
    }
    _tile_zero(2);
    _tile_zero(5);
    if (m1 > 0) {
      _tile_zero(6);
      _tile_zero(7);
    }
    for (int64_t i = 0; i < k; i += 32) {
      _tile_loadd(1, xpairs + (i / 2) * m0, x_stride0);
      _tile_loadd(0, wb.data() + i, w_stride);
      _tile_dpbf16ps(2, 0, 1);
      _tile_loadd(3, wb.data() + 16 * k + i, w_stride);
      _tile_dpbf16ps(5, 3, 1);
      if (m1 > 0) {
        _tile_loadd(4, xpairs1 + (i / 2) * m1, x_stride1);
        _tile_dpbf16ps(6, 0, 4);
        _tile_dpbf16ps(7, 3, 4);
      }
    }
    _tile_stored(2, sums[0], 64);
    _tile_stored(5, sums[1], 64);
    if (m1 > 0) {
      _tile_stored(6, sums[2], 64);
      _tile_stored(7, sums[3], 64);
    }
    for (int64_t j = 0; j < std::min<int64_t>(32, n - t); ++j) {
      const float sc = to_f(scales[t + j]);
      const float* s0 = sums[j / 16] + (j % 16) * 16;
      for (int64_t r = 0; r < m0; ++r) out[r * n + t + j] = from_f<O>(s0[r] * sc);
      const float* s1 = sums[2 + j / 16] + (j % 16) * 16;
      for (int64_t r = 0; r < m1; ++r) out[(m0 + r) * n + t + j] = from_f<O>(s1[r] * sc);
    }
  }
}

TileConfig int8_tile_config(int64_t m) {
  const int64_t m0 = std::min(m, kMaxRowChunk), m1 = m - m0;
  TileConfig cfg;
  cfg.set(0, 16, 64);
  cfg.set(3, 16, 64);
  cfg.set(1, 16, static_cast<int>(m0 * 4));
  cfg.set(2, 16, static_cast<int>(m0 * 4));
  cfg.set(5, 16, static_cast<int>(m0 * 4));
  if (m1 > 0) {
    cfg.set(4, 16, static_cast<int>(m1 * 4));
    cfg.set(6, 16, static_cast<int>(m1 * 4));
    cfg.set(7, 16, static_cast<int>(m1 * 4));
  }
  return cfg;
}
#endif

// Output rows [n0, n1) of an int8 matmul for `m` activation rows, plain loops.
template <typename T, typename O>
void int8_rows_portable(const int8_t* q, const T* scales, const float* xf, int64_t m, int64_t n, int64_t k,
                        int64_t n0, int64_t n1, O* out) {
  std::vector<float> wf(k);
  for (int64_t j = n0; j < n1; ++j) {
    const int8_t* row = q + j * k;
    for (int64_t i = 0; i < k; ++i) wf[i] = static_cast<float>(row[i]);
    const float sc = to_f(scales[j]);
    for (int64_t r = 0; r < m; ++r) out[r * n + j] = from_f<O>(dot(xf + r * k, wf.data(), k) * sc);
  }
}

#if !defined(EDGE_RTGI_AVX512) && defined(__AVX2__) && defined(__FMA__)
#define EDGE_RTGI_INT8_F32_AVX2 1

// fp32 activations against int8 weights on AVX2 (an LM head on a CPU without AVX-512): four output
// rows at a time, each weight widened in registers once and used for up to R activation rows at once,
// so the weights stream through once per call instead of being written out as floats first. Each
// activation row's sums take the same operations in the same order whatever R is: the same bits.
// Not inlined: inlined at R = 1, GCC kept the four sums in memory, a store per FMA.
template <int R, typename O>
__attribute__((noinline)) void int8_rows_f32_avx2_block(const int8_t* q, const float* scales, const float* xf,
                                                        int64_t r0, int64_t n, int64_t k, int64_t j, O* out) {
  const int64_t k8 = k / 8 * 8;
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < 4; ++u) acc[r][u] = _mm256_setzero_ps();
  // the weight rows 8 ahead (two blocks on), a line every other step: without it one row ran at half
  // the memory's speed, and a few rows were no faster (docs/cpu_kernels.md)
  const char* ahead = reinterpret_cast<const char*>(q + std::min(j + 8, n - 4) * k);
  for (int64_t i = 0; i < k8; i += 8) {
    _mm_prefetch(ahead + 4 * i, _MM_HINT_T0);
    __m256 w[4];
    for (int u = 0; u < 4; ++u)
      w[u] = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + (j + u) * k + i))));
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(xf + (r0 + r) * k + i);
      for (int u = 0; u < 4; ++u) acc[r][u] = _mm256_fmadd_ps(w[u], xv, acc[r][u]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float* x = xf + (r0 + r) * k;
    for (int u = 0; u < 4; ++u) {
      const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[r][u]), _mm256_extractf128_ps(acc[r][u], 1));
      const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
      float total = _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
      for (int64_t i = k8; i < k; ++i) total += x[i] * static_cast<float>(q[(j + u) * k + i]);
      out[(r0 + r) * n + j + u] = from_f<O>(total * scales[j + u]);
    }
  }
}

// Activation rows in threes (12 sums and 4 widened weights fill the 16 registers), the last one or two
// together.
template <typename O>
void int8_rows_f32_avx2(const int8_t* q, const float* scales, const float* xf, int64_t m, int64_t n,
                        int64_t k, int64_t n0, int64_t n1, O* out) {
  int64_t j = n0;
  for (; j + 4 <= n1; j += 4) {
    int64_t r = 0;
    for (; r + 3 <= m; r += 3) int8_rows_f32_avx2_block<3, O>(q, scales, xf, r, n, k, j, out);
    if (m - r == 2) int8_rows_f32_avx2_block<2, O>(q, scales, xf, r, n, k, j, out);
    else if (m - r == 1) int8_rows_f32_avx2_block<1, O>(q, scales, xf, r, n, k, j, out);
  }
  for (; j < n1; ++j) {
    for (int64_t r = 0; r < m; ++r) {
      float total = 0.f;
      for (int64_t i = 0; i < k; ++i) total += xf[r * k + i] * static_cast<float>(q[j * k + i]);
      out[r * n + j] = from_f<O>(total * scales[j]);
    }
  }
}
#endif

// Which loops a call runs: the best this build and CPU have for its dtype and shape, or the ones a
// test asks for ("best", "avx512": the AVX-512 BF16 loops without AMX, "portable": plain loops).
enum class Loops { kAmx, kAvx512Bf16, kAvx2, kPortable };  // kAvx2: fp32 activations (int8_mm)

Loops choose_loops(const Tensor& x, int64_t k, int64_t m, const std::string& requested) {
  TORCH_CHECK(requested == "best" || requested == "avx512" || requested == "portable",
              "edge_rtgi: loops must be \"best\", \"avx512\" or \"portable\", got \"", requested, "\"");
#ifdef EDGE_RTGI_AVX512_BF16
  if (requested == "portable" || x.scalar_type() != at::kBFloat16 || k % 32 != 0) return Loops::kPortable;
#ifdef EDGE_RTGI_AMX
  if (requested == "best" && m >= 2 && amx_ready()) return Loops::kAmx;
#endif
  (void)m;
  return Loops::kAvx512Bf16;
#else
  (void)x, (void)k, (void)m, (void)requested;
  return Loops::kPortable;
#endif
}

Tensor activations_f32(const Tensor& x) { return x.scalar_type() == at::kFloat ? x : x.to(at::kFloat); }

template <typename T>
void int4_mm_impl(const Tensor& x, const Tensor& qweight, int64_t group, const Tensor& sz, Loops loops,
                  Tensor& out) {
  const int64_t m_all = x.size(0), k = x.size(1), n = out.size(1), groups = k / group;
  const Int4Weights w{qweight.const_data_ptr<uint8_t>(), n, k, group};
  const T* xp_all = in_ptr<T>(x);
  // Sum of each row's activations over each group, for the zero term.
  std::vector<float> xsum_all(m_all * groups);
  for (int64_t r = 0; r < m_all; ++r)
    for (int64_t g = 0; g < groups; ++g) xsum_all[r * groups + g] = sum(xp_all + r * k + g * group, group);
  // fp32 activations only for the plain loops (fp32 inputs, a short last block, no AVX-512 BF16):
  // the copy cost as much as a small matmul's own work at every multi-row call.
  check_int4_pack("int4_mm");
  // the AVX-512 loops read the pack of 64-row blocks that ATen makes on AVX-512 CPUs
  const bool wide_pack = w.pack.block == kInt4BlockRows && !w.pack.adjacent_pairs;
  const bool plain_loops = loops == Loops::kPortable || n % kInt4BlockRows != 0 || !wide_pack;
  const Tensor xf_t = plain_loops ? activations_f32(x) : Tensor();
  const float* xf_all = plain_loops ? xf_t.const_data_ptr<float>() : nullptr;
  const T* szp = in_ptr<T>(sz);
  T* op_all = out_ptr<T>(out);
  const int64_t blocks = (n + kInt4BlockRows - 1) / kInt4BlockRows;
  const int64_t row_chunk = loops == Loops::kAmx ? kAmxRowChunk : kMaxRowChunk;
  std::vector<T> x_padded;  // AMX above 16 rows: the chunk's rows and zeros up to 32
  for (int64_t r0 = 0; r0 < m_all; r0 += row_chunk) {
    const int64_t m = std::min(row_chunk, m_all - r0);
    const float* xf = plain_loops ? xf_all + r0 * k : nullptr;
    const float* xsum = xsum_all.data() + r0 * groups;
    const T* xp = xp_all + r0 * k;
    T* op = op_all + r0 * n;
    if (loops == Loops::kAmx && m > kMaxRowChunk) {
      x_padded.assign(kAmxRowChunk * k, T{});
      std::copy(xp, xp + m * k, x_padded.begin());
      xp = x_padded.data();
    }
    at::parallel_for(0, blocks, grain_rows(kInt4BlockRows * k), [&](int64_t begin, int64_t end) {
#ifdef EDGE_RTGI_AMX
      const bool amx = loops == Loops::kAmx && m >= 2;
      if (amx) {
        const TileConfig cfg = int4_tile_config(m);
        _tile_loadconfig(&cfg);  // per thread: the tile configuration is thread state
      }
#endif
      for (int64_t b = begin; b < end; ++b) {
        const int64_t n0 = b * kInt4BlockRows, rows = std::min(kInt4BlockRows, n - n0);
#ifdef EDGE_RTGI_AVX512_BF16
        if constexpr (std::is_same_v<T, bf16_bits>) {
          if (loops != Loops::kPortable && rows == kInt4BlockRows && wide_pack) {
#ifdef EDGE_RTGI_AMX
            if (amx) {
              int4_block_amx(w, szp, xp, xsum, m, n0, op);
              continue;
            }
#endif
            int4_block_bf16(w, szp, xp, xsum, m, n0, op);  // m <= 16: AMX alone takes 32-row chunks
            continue;
          }
        }
#endif
        // A last block of fewer than 64 outputs (or fp32): plain loops, 16 rows at a time.
        for (int64_t s0 = 0; s0 < m; s0 += kMaxRowChunk) {
          int4_block_portable<T>(w, szp, xf + s0 * k, xsum + s0 * groups, std::min(kMaxRowChunk, m - s0), n0, rows,
                                 op + s0 * n);
        }
      }
#ifdef EDGE_RTGI_AMX
      if (amx) _tile_release();
#endif
    });
  }
  (void)loops;
  (void)xp_all;
}

// T: the activations' and scales' type; O: the output's (T, or float for logits).
template <typename T, typename O>
void int8_mm_impl(const Tensor& x, const Tensor& qweight, const Tensor& scales, Loops loops, Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  const int8_t* q = qweight.const_data_ptr<int8_t>();
  const T* sp = in_ptr<T>(scales);
  O* op = out_ptr<O>(out);
  // Output rows are split across threads in runs of 64 (a multiple of every tile).
  const int64_t chunks = (n + 63) / 64;
#ifdef EDGE_RTGI_AVX512_BF16
  if constexpr (std::is_same_v<T, bf16_bits>) {
    const bf16_bits* xp = in_ptr<bf16_bits>(x);
#ifdef EDGE_RTGI_AMX
    if (loops == Loops::kAmx && m >= 2 && m <= kAmxRowChunk) {
      // The activations as the tile unit's B operand: per chunk of up to 16 rows, [K/2][rows]
      // pairs of consecutive inputs.
      std::vector<uint32_t> xpairs(k / 2 * m);
      for (int64_t c0 = 0; c0 < m; c0 += kMaxRowChunk) {
        const int64_t rows = std::min(kMaxRowChunk, m - c0);
        uint32_t* chunk = xpairs.data() + k / 2 * c0;
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t i = 0; i < k / 2; ++i) std::memcpy(&chunk[i * rows + r], xp + (c0 + r) * k + 2 * i, 4);
      }
      at::parallel_for(0, chunks, grain_rows(64 * k), [&](int64_t begin, int64_t end) {
        const TileConfig cfg = int8_tile_config(m);
        _tile_loadconfig(&cfg);
        int8_rows_amx(q, sp, xpairs.data(), m, n, k, begin * 64, std::min(n, end * 64), op);
        _tile_release();
      });
      return;
    }
#endif
    if (loops != Loops::kPortable) {
      at::parallel_for(0, chunks, grain_rows(64 * k), [&](int64_t begin, int64_t end) {
        int8_rows_bf16(q, sp, xp, m, n, k, begin * 64, std::min(n, end * 64), op);
      });
      return;
    }
  }
#endif
  const Tensor xf_t = activations_f32(x);
  const float* xf = xf_t.const_data_ptr<float>();
#ifdef EDGE_RTGI_INT8_F32_AVX2
  if constexpr (std::is_same_v<T, float>) {
    if (loops != Loops::kPortable) {
      at::parallel_for(0, chunks, grain_rows(64 * k), [&](int64_t begin, int64_t end) {
        int8_rows_f32_avx2<O>(q, sp, xf, m, n, k, begin * 64, std::min(n, end * 64), op);
      });
      return;
    }
  }
#endif
  (void)loops;
  at::parallel_for(0, chunks, grain_rows(64 * k), [&](int64_t begin, int64_t end) {
    int8_rows_portable<T, O>(q, sp, xf, m, n, k, begin * 64, std::min(n, end * 64), op);
  });
}

void check_quant_input(const Tensor& x, const Tensor& scales, const char* name) {
  check_activation(x, name);
  TORCH_CHECK(x.dim() == 2, "edge_rtgi::", name, ": x must be [rows, K], got ", x.sizes());
  TORCH_CHECK(scales.scalar_type() == x.scalar_type(), "edge_rtgi::", name, ": scales must be in ", x.scalar_type(),
              " like x, got ", scales.scalar_type());
}

Tensor int4_mm(const Tensor& x_in, const Tensor& qweight_in, int64_t group_size, const Tensor& sz_in,
               c10::string_view loops_name) {
  check_quant_input(x_in, sz_in, "int4_mm");
  const int64_t k = x_in.size(1);
  TORCH_CHECK(group_size > 0 && group_size % 2 == 0 && k % group_size == 0, "edge_rtgi::int4_mm: K = ", k,
              " must be a multiple of the (even) group size ", group_size);
  TORCH_CHECK(sz_in.dim() == 3 && sz_in.size(0) == k / group_size && sz_in.size(2) == 2,
              "edge_rtgi::int4_mm: scales_and_zeros must be [K/G, N, 2], got ", sz_in.sizes());
  const int64_t n = sz_in.size(1);
  TORCH_CHECK(qweight_in.scalar_type() == at::kByte && qweight_in.numel() == n * k / 2 && n % 2 == 0,
              "edge_rtgi::int4_mm: qweight must be ATen's CPU int4 pack of [", n, ", ", k, "] (", n * k / 2,
              " uint8), got ", qweight_in.sizes(), " ", qweight_in.scalar_type());
  Tensor x = x_in.contiguous(), qweight = qweight_in.contiguous(), sz = sz_in.contiguous();
  Tensor out = at::empty({x.size(0), n}, x.options());
  g_multi_row_calls.fetch_add(1, std::memory_order_relaxed);
  Loops loops = choose_loops(x, k, x.size(0), std::string(loops_name));
  // The group's decoded codes live in a fixed buffer; AMX also needs whole 32-input tiles.
  if (group_size > kMaxBf16Group || (loops == Loops::kAmx && group_size % 32 != 0)) loops = Loops::kPortable;
  if (x.scalar_type() == at::kFloat) int4_mm_impl<float>(x, qweight, group_size, sz, Loops::kPortable, out);
  else int4_mm_impl<bf16_bits>(x, qweight, group_size, sz, loops, out);
  return out;
}

Tensor int8_mm(const Tensor& x_in, const Tensor& qweight_in, const Tensor& scales_in, c10::string_view loops_name,
               bool float_out) {
  check_quant_input(x_in, scales_in, "int8_mm");
  const int64_t k = x_in.size(1);
  TORCH_CHECK(qweight_in.scalar_type() == at::kChar && qweight_in.dim() == 2 && qweight_in.size(1) == k,
              "edge_rtgi::int8_mm: qweight must be int8 [N, ", k, "], got ", qweight_in.sizes(), " ",
              qweight_in.scalar_type());
  const int64_t n = qweight_in.size(0);
  TORCH_CHECK(scales_in.numel() == n, "edge_rtgi::int8_mm: need one scale per output row (", n, "), got ",
              scales_in.numel());
  Tensor x = x_in.contiguous(), qweight = qweight_in.contiguous(), scales = scales_in.contiguous();
  Tensor out = at::empty({x.size(0), n}, float_out ? x.options().dtype(at::kFloat) : x.options());
  g_multi_row_calls.fetch_add(1, std::memory_order_relaxed);
  const Loops loops = choose_loops(x, k, x.size(0), std::string(loops_name));
  if (x.scalar_type() == at::kFloat) {
    // choose_loops gives fp32 the plain loops; AVX2 builds have their own unless a test asks for those
    const Loops f32 = std::string(loops_name) == "portable" ? Loops::kPortable : Loops::kAvx2;
    int8_mm_impl<float, float>(x, qweight, scales, f32, out);
  }
  else if (float_out) int8_mm_impl<bf16_bits, float>(x, qweight, scales, loops, out);
  else int8_mm_impl<bf16_bits, bf16_bits>(x, qweight, scales, loops, out);
  return out;
}

// --- int4 weights against int8 activations (`int8_activations`) -------------------------------
//
// At one row the bf16 loops above and ATen's are bound by instructions, not by the memory
// (docs/cpu_kernels.md, "One row is far from the memory bound"): decoding 128 codes to bf16 pairs
// takes about 20 instructions for 4 dot products. Here the activations are rounded to int8 per 32
// inputs (as llama.cpp's Q8_0 does) and the codes stay integers: one load and three bit operations
// give 128 codes, and one VNNI instruction adds 64 products into exact int32 sums. The weights,
// scales and zeros are those of the int4 layer, repacked once at load (int4_pack_i8) so that each
// thread reads one sequential stream (no software prefetch: the hardware's alone was faster,
// docs/cpu_kernels.md):
//   tiles of 64 output rows, one after another; in a tile, per group g of G inputs:
//     64 (scale, zero) bf16 pairs (256 bytes), then G/8 chunks of 256 bytes: 4 vectors of 16
//     outputs x 4 bytes, byte b of output j in chunk c = code(j, 8c + b) | code(j, 8c + 4 + b) << 4.
// Per 32 inputs of a row: s = max|x| / 127, q = round(x * 127 / max|x|) (ties to even), and the
// sum of x (fp32, a fixed order); then for every output
//   y += scale_g * (s * (sum_k code_k q_k - 8 sum_k q_k)) + zero_g * sum_k x_k
// in that order in both loops, so the VNNI and the plain loops give the same bits.

constexpr int64_t kI8Block = 32;        // activations share one int8 scale per 32 inputs
constexpr int64_t kI8TileRows = 64;     // output rows per tile
constexpr int64_t kI8PairBytes = kI8TileRows * 4;  // a group's (scale, zero) bf16 pairs in a tile
constexpr int64_t kI8ChunkBytes = 256;  // 8 inputs x 64 outputs x 4 bits
constexpr int64_t kI8PassRows = 4;      // activation rows per pass over a tile (VNNI loops)

inline int64_t i8_group_bytes(int64_t group) { return kI8PairBytes + group / 8 * kI8ChunkBytes; }

// Activation rows rounded to int8 per block of 32 inputs.
struct Int8Rows {
  std::vector<int8_t> q;         // [m][k]
  std::vector<float> scale;      // [m][k/32]: max|x| / 127
  std::vector<float> sum;        // [m][k/32]: the fp32 sum of x in sum32_halving's order (zero term)
  std::vector<int32_t> q_sum;    // [m][k/32]: the sum of q
};

// The sum of 32 floats in a fixed order (halving: lane i with i + 16, then + 8, + 4, + 2, + 1),
// the order the AVX-512 reduction below takes.
inline float sum32_halving(const float* v) {
  float s[16];
  for (int i = 0; i < 16; ++i) s[i] = v[i] + v[i + 16];
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) s[i] = s[i] + s[i + w];
  return s[0];
}

// 127 / max|x|, or 0 where that is not finite (all zeros, or so small that the quotient overflows:
// then every q is 0 in both loops rather than saturated).
inline float i8_inverse_step(float top) {
  const float inv = 127.f / top;
  return top > 0.f && std::isfinite(inv) ? inv : 0.f;
}

template <typename T>
void quantize_rows_i8(const T* x, int64_t m, int64_t k, Int8Rows& out) {
  const int64_t blocks = k / kI8Block;
  out.q.resize(m * k);
  out.scale.resize(m * blocks);
  out.sum.resize(m * blocks);
  out.q_sum.resize(m * blocks);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const T* p = x + r * k + b * kI8Block;
      int8_t* q = out.q.data() + r * k + b * kI8Block;
      const int64_t i = r * blocks + b;
#ifdef EDGE_RTGI_AVX512
      const __m512 f0 = load16(p), f1 = load16(p + 16);
      const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(f0), _mm512_abs_ps(f1)));
      const __m512 inv = _mm512_set1_ps(i8_inverse_step(top));
      const __m512i lowest = _mm512_set1_epi32(-128), highest = _mm512_set1_epi32(127);
      // round to nearest even; the clamp only acts on non-finite inputs (the conversion gives
      // INT_MIN), so that q_sum stays the codes' sum and 8 * q_sum cannot overflow
      const __m512i q0 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(f0, inv)), lowest), highest);
      const __m512i q1 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(f1, inv)), lowest), highest);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(q1));
      out.q_sum[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
      // the halving order of sum32_halving
      const __m512 s16 = _mm512_add_ps(f0, f1);
      out.sum[i] = sum8_halving(_mm256_add_ps(_mm512_castps512_ps256(s16),
                                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s16), 1))));
#elif defined(EDGE_RTGI_AVX2_FMA)
      // The plain loop's arithmetic on 8 lanes (it runs serially, before the threads start):
      // the same products, rounded to nearest even, and the same halving order for the sum.
      const __m256 f0 = load8(p), f1 = load8(p + 8), f2 = load8(p + 16), f3 = load8(p + 24);
      const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
      const __m256 m8 = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(f0, magnitude), _mm256_and_ps(f1, magnitude)),
                                      _mm256_max_ps(_mm256_and_ps(f2, magnitude), _mm256_and_ps(f3, magnitude)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      const float top = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
      const __m256 inv = _mm256_set1_ps(i8_inverse_step(top));
      // clamped as on AVX-512 (only non-finite inputs reach the bounds)
      const __m256i lowest = _mm256_set1_epi32(-128), highest = _mm256_set1_epi32(127);
      auto code = [&](__m256 f) {
        return _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(f, inv)), lowest), highest);
      };
      const __m256i q0 = code(f0), q1 = code(f1), q2 = code(f2), q3 = code(f3);
      // the packs interleave 4-lane groups per 128-bit half; the permutation puts them in order
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                          _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      const __m256i q8 = _mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3));
      __m128i q4 = _mm_add_epi32(_mm256_castsi256_si128(q8), _mm256_extracti128_si256(q8, 1));
      q4 = _mm_add_epi32(q4, _mm_shuffle_epi32(q4, 0x4E));
      out.q_sum[i] = _mm_cvtsi128_si32(_mm_add_epi32(q4, _mm_shuffle_epi32(q4, 0xB1)));
      // lanes i + 16, then i + 8, then the rest
      out.sum[i] = sum8_halving(_mm256_add_ps(_mm256_add_ps(f0, f2), _mm256_add_ps(f1, f3)));
#else
      float f[kI8Block], top = 0.f;
      for (int64_t j = 0; j < kI8Block; ++j) {
        f[j] = to_f(p[j]);
        top = std::max(top, std::fabs(f[j]));
      }
      const float inv = i8_inverse_step(top);
      int32_t q_sum = 0;
      for (int64_t j = 0; j < kI8Block; ++j) {
        float v = std::nearbyint(f[j] * inv);
        if (v != v) v = 0.f;  // NaN activations (the vector paths give -128 here: INT_MIN, saturated)
        q[j] = static_cast<int8_t>(std::clamp(v, -128.f, 127.f));
        q_sum += q[j];
      }
      out.q_sum[i] = q_sum;
      out.sum[i] = sum32_halving(f);
#endif
      out.scale[i] = top / 127.f;
    }
  }
}

// Totals of one tile (64 outputs) for one activation row, plain loops.
void int4_i8_tile_portable(const uint8_t* tile, int64_t k, int64_t group, const Int8Rows& x, int64_t r,
                           float* total /*[64]*/) {
  const int64_t blocks = k / kI8Block, per_group = group / kI8Block;
  std::fill(total, total + kI8TileRows, 0.f);
  for (int64_t g = 0; g < k / group; ++g) {
    const uint8_t* group_start = tile + g * i8_group_bytes(group);
    const bf16_bits* pairs = reinterpret_cast<const bf16_bits*>(group_start);
    for (int64_t bg = 0; bg < per_group; ++bg) {
      const int64_t b = g * per_group + bg, i = r * blocks + b;
      int32_t acc[kI8TileRows] = {};
      for (int64_t c = 0; c < kI8Block / 8; ++c) {
        const uint8_t* chunk = group_start + kI8PairBytes + (bg * kI8Block / 8 + c) * kI8ChunkBytes;
        const int8_t* q = x.q.data() + r * k + b * kI8Block + 8 * c;
        for (int64_t j = 0; j < kI8TileRows; ++j) {
          for (int64_t byte = 0; byte < 4; ++byte) {
            const uint8_t v = chunk[j * 4 + byte];
            acc[j] += (v & 0x0F) * q[byte] + (v >> 4) * q[4 + byte];
          }
        }
      }
      for (int64_t j = 0; j < kI8TileRows; ++j) {
        const float f = static_cast<float>(acc[j] - 8 * x.q_sum[i]) * x.scale[i];
        total[j] = std::fma(f, to_f(pairs[2 * j]), total[j]);
        total[j] = std::fma(to_f(pairs[2 * j + 1]), x.sum[i], total[j]);
      }
    }
  }
}

#if defined(EDGE_RTGI_AVX512) && defined(__AVX512VNNI__)
#define EDGE_RTGI_VNNI 1

// Totals of one tile for R activation rows (R <= 4: 4 R accumulators and 2 R broadcast activations
// stay in registers; the totals and the group's scales and zeros are read once per 32 inputs).
template <int R>
void int4_i8_tile_vnni(const uint8_t* tile, int64_t k, int64_t group, const Int8Rows& x, int64_t r0,
                       float* total /*[R][64]*/) {
  static_assert(R >= 1 && R <= kI8PassRows, "int4_i8_mm's totals hold kI8PassRows rows");
  const int64_t blocks = k / kI8Block, per_group = group / kI8Block, chunks = kI8Block / 8;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 tot[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) tot[r][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < k / group; ++g) {
    const uint8_t* group_start = tile + g * i8_group_bytes(group);
    __m512 scale[4], zero[4];
    for (int v = 0; v < 4; ++v) {
      // 16 (scale, zero) pairs: the scale in the low half of each 32-bit lane
      const __m512i sp = _mm512_loadu_si512(group_start + 64 * v);
      scale[v] = _mm512_castsi512_ps(_mm512_slli_epi32(sp, 16));
      zero[v] = _mm512_castsi512_ps(_mm512_and_si512(sp, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
    }
    for (int64_t bg = 0; bg < per_group; ++bg) {
      const int64_t b = g * per_group + bg;
      const uint8_t* first = group_start + kI8PairBytes + bg * chunks * kI8ChunkBytes;
      __m512i acc[R][4];
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_si512();
      for (int64_t c = 0; c < chunks; ++c) {
        __m512i xlo[R], xhi[R];
        for (int r = 0; r < R; ++r) {
          int32_t lo4, hi4;  // 4 int8 activations for the low nibbles, 4 for the high ones
          const int8_t* q = x.q.data() + (r0 + r) * k + b * kI8Block + 8 * c;
          std::memcpy(&lo4, q, 4);
          std::memcpy(&hi4, q + 4, 4);
          xlo[r] = _mm512_set1_epi32(lo4);
          xhi[r] = _mm512_set1_epi32(hi4);
        }
        const uint8_t* chunk = first + c * kI8ChunkBytes;
        for (int v = 0; v < 4; ++v) {
          const __m512i w = _mm512_loadu_si512(chunk + 64 * v);
          const __m512i wlo = _mm512_and_si512(w, low);
          const __m512i whi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
          for (int r = 0; r < R; ++r) {
            acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], wlo, xlo[r]);
            acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], whi, xhi[r]);
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * blocks + b;
        const __m512i eight_q = _mm512_set1_epi32(8 * x.q_sum[i]);
        const __m512 s = _mm512_set1_ps(x.scale[i]), xs = _mm512_set1_ps(x.sum[i]);
        for (int v = 0; v < 4; ++v) {
          const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][v], eight_q)), s);
          tot[r][v] = _mm512_fmadd_ps(f, scale[v], tot[r][v]);
          tot[r][v] = _mm512_fmadd_ps(zero[v], xs, tot[r][v]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(total + r * kI8TileRows + 16 * v, tot[r][v]);
}
#endif

#if !defined(EDGE_RTGI_VNNI) && defined(__AVX2__) && defined(__FMA__)
#define EDGE_RTGI_I8_AVX2 1

// The same totals on AVX2, which has no VNNI: vpmaddubsw multiplies the unsigned codes by the
// signed activations and adds pairs into int16 (at most 2 * 15 * 128 in magnitude), the eight of a
// block of 32 inputs still fit int16 (30,720), and one vpmaddwd per block widens them to the exact
// int32 sums: the same integers, then the same float operations, so the same bits as the plain loops.
// V of the tile's 8 output vectors from v0 on, R rows: R * V int16 sums stay in the 16 registers.
template <int R, int V>
void int4_i8_tile_avx2(const uint8_t* tile, int64_t k, int64_t group, const Int8Rows& x, int64_t r0,
                       int v0, float* total /*[R][64]*/) {
  const int64_t blocks = k / kI8Block, per_group = group / kI8Block, chunks = kI8Block / 8;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i zero_half = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 tot[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) tot[r][v] = _mm256_setzero_ps();
  for (int64_t g = 0; g < k / group; ++g) {
    const uint8_t* group_start = tile + g * i8_group_bytes(group);
    for (int64_t bg = 0; bg < per_group; ++bg) {
      const int64_t b = g * per_group + bg;
      const uint8_t* first = group_start + kI8PairBytes + bg * chunks * kI8ChunkBytes;
      __m256i acc[R][V];
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_si256();
      for (int64_t c = 0; c < chunks; ++c) {
        __m256i xlo[R], xhi[R];
        for (int r = 0; r < R; ++r) {
          int32_t lo4, hi4;  // 4 int8 activations for the low nibbles, 4 for the high ones
          const int8_t* q = x.q.data() + (r0 + r) * k + b * kI8Block + 8 * c;
          std::memcpy(&lo4, q, 4);
          std::memcpy(&hi4, q + 4, 4);
          xlo[r] = _mm256_set1_epi32(lo4);
          xhi[r] = _mm256_set1_epi32(hi4);
        }
        const uint8_t* chunk = first + c * kI8ChunkBytes;
        for (int v = 0; v < V; ++v) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32 * (v0 + v)));
          const __m256i wlo = _mm256_and_si256(w, low);
          const __m256i whi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
          for (int r = 0; r < R; ++r) {
            acc[r][v] = _mm256_add_epi16(acc[r][v], _mm256_maddubs_epi16(wlo, xlo[r]));
            acc[r][v] = _mm256_add_epi16(acc[r][v], _mm256_maddubs_epi16(whi, xhi[r]));
            // Pins the sum in a register here: otherwise GCC reassociates the block's int16 adds,
            // computes all its products first and spills them to the stack.
            asm("" : "+x"(acc[r][v]));
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * blocks + b;
        const __m256i eight_q = _mm256_set1_epi32(8 * x.q_sum[i]);
        const __m256 s = _mm256_set1_ps(x.scale[i]), xs = _mm256_set1_ps(x.sum[i]);
        for (int v = 0; v < V; ++v) {
          // 8 (scale, zero) pairs: the scale in the low half of each 32-bit lane
          const __m256i sp = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group_start + 32 * (v0 + v)));
          const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(sp, 16));
          const __m256 zero = _mm256_castsi256_ps(_mm256_and_si256(sp, zero_half));
          const __m256i sums = _mm256_madd_epi16(acc[r][v], ones);
          const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sums, eight_q)), s);
          tot[r][v] = _mm256_fmadd_ps(f, scale, tot[r][v]);
          tot[r][v] = _mm256_fmadd_ps(zero, xs, tot[r][v]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(total + r * kI8TileRows + 8 * (v0 + v), tot[r][v]);
}
#endif

// Which loops int4_i8_mm runs with loops="best": "avx512-vnni", "avx2" or "portable".
std::string i8_loops() {
#if defined(EDGE_RTGI_VNNI)
  return "avx512-vnni";
#elif defined(EDGE_RTGI_I8_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

bool vnni_built() {
#ifdef EDGE_RTGI_VNNI
  return true;
#else
  return false;
#endif
}

void check_i8_shape(int64_t n, int64_t k, int64_t group, const char* name) {
  TORCH_CHECK(group > 0 && group % kI8Block == 0 && k % group == 0, "edge_rtgi::", name, ": K = ", k,
              " must be a multiple of the group size ", group, ", itself a multiple of ", kI8Block);
  TORCH_CHECK(n > 0 && n % kI8TileRows == 0, "edge_rtgi::", name, ": N = ", n, " must be a multiple of ",
              kI8TileRows);
}

// ATen's CPU int4 pack and its [K/G, N, 2] bf16 scales and zeros -> the layout above.
Tensor int4_pack_i8(const Tensor& qweight_in, int64_t group, const Tensor& sz_in) {
  TORCH_CHECK(sz_in.scalar_type() == at::kBFloat16 && sz_in.dim() == 3 && sz_in.size(2) == 2,
              "edge_rtgi::int4_pack_i8: scales_and_zeros must be bf16 [K/G, N, 2], got ", sz_in.sizes(), " ",
              sz_in.scalar_type());
  const int64_t n = sz_in.size(1), k = sz_in.size(0) * group;
  check_i8_shape(n, k, group, "int4_pack_i8");
  check_int4_pack("int4_pack_i8");
  TORCH_CHECK(qweight_in.scalar_type() == at::kByte && qweight_in.numel() == n * k / 2,
              "edge_rtgi::int4_pack_i8: qweight must be ATen's CPU int4 pack of [", n, ", ", k, "], got ",
              qweight_in.sizes(), " ", qweight_in.scalar_type());
  const Tensor qweight = qweight_in.contiguous(), sz = sz_in.contiguous();
  const Int4Weights w{qweight.const_data_ptr<uint8_t>(), n, k, group};
  const bf16_bits* szp = in_ptr<bf16_bits>(sz);
  const int64_t groups = k / group, tile_bytes = groups * i8_group_bytes(group);
  Tensor out = at::empty({n / kI8TileRows * tile_bytes}, qweight.options());
  uint8_t* op = out.mutable_data_ptr<uint8_t>();
  at::parallel_for(0, n / kI8TileRows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> codes(kI8TileRows * k);  // [k][64] codes minus 8, as int4_codes gives them
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kI8TileRows;
      for (int64_t kk = 0; kk < k; ++kk) int4_codes(w, n0, kI8TileRows, kk, codes.data() + kk * kI8TileRows);
      uint8_t* tile = op + t * tile_bytes;
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* group_start = tile + g * i8_group_bytes(group);
        std::memcpy(group_start, szp + (g * n + n0) * 2, kI8PairBytes);
        for (int64_t c = 0; c < group / 8; ++c) {
          uint8_t* chunk = group_start + kI8PairBytes + c * kI8ChunkBytes;
          const int64_t k0 = g * group + 8 * c;
          for (int64_t j = 0; j < kI8TileRows; ++j) {
            for (int64_t byte = 0; byte < 4; ++byte) {
              const int lo = static_cast<int>(codes[(k0 + byte) * kI8TileRows + j]) + 8;
              const int hi = static_cast<int>(codes[(k0 + 4 + byte) * kI8TileRows + j]) + 8;
              chunk[j * 4 + byte] = static_cast<uint8_t>(lo | hi << 4);
            }
          }
        }
      }
    }
  });
  return out;
}

// x [M, K] (bf16 or fp32) against int4_pack_i8's layout -> [M, N] in x's dtype.
Tensor int4_i8_mm(const Tensor& x_in, const Tensor& packed_in, int64_t group, int64_t n,
                  c10::string_view loops_name) {
  check_activation(x_in, "int4_i8_mm");
  TORCH_CHECK(x_in.dim() == 2, "edge_rtgi::int4_i8_mm: x must be [rows, K], got ", x_in.sizes());
  const int64_t m = x_in.size(0), k = x_in.size(1);
  check_i8_shape(n, k, group, "int4_i8_mm");
  const int64_t tile_bytes = k / group * i8_group_bytes(group);
  TORCH_CHECK(packed_in.scalar_type() == at::kByte && packed_in.numel() == n / kI8TileRows * tile_bytes,
              "edge_rtgi::int4_i8_mm: packed must be int4_pack_i8's layout of [", n, ", ", k, "] (",
              n / kI8TileRows * tile_bytes, " uint8), got ", packed_in.sizes(), " ", packed_in.scalar_type());
  const std::string loops(loops_name);
  TORCH_CHECK(loops == "best" || loops == "portable", "edge_rtgi::int4_i8_mm: loops must be \"best\" or ",
              "\"portable\", got \"", loops, "\"");
  const Tensor x = x_in.contiguous(), packed = packed_in.contiguous();
  Tensor out = at::empty({m, n}, x.options());
  g_multi_row_calls.fetch_add(1, std::memory_order_relaxed);
  Int8Rows rows;
  if (x.scalar_type() == at::kFloat) quantize_rows_i8(in_ptr<float>(x), m, k, rows);
  else quantize_rows_i8(in_ptr<bf16_bits>(x), m, k, rows);
  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
  const bool fast = i8_loops() != "portable" && loops == "best";
  auto store = [&](const float* total, int64_t r, int64_t n0) {
    if (x.scalar_type() == at::kFloat) {
      std::copy(total, total + kI8TileRows, out.mutable_data_ptr<float>() + r * n + n0);
    } else {
      bf16_bits* o = out_ptr<bf16_bits>(out) + r * n + n0;
      for (int64_t j = 0; j < kI8TileRows; ++j) o[j] = from_f<bf16_bits>(total[j]);
    }
  };
  at::parallel_for(0, n / kI8TileRows, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float total[kI8PassRows * kI8TileRows];
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = wp + t * tile_bytes;
      const int64_t n0 = t * kI8TileRows;
      int64_t r = 0;
#ifdef EDGE_RTGI_VNNI
      if (fast) {
        // up to 4 rows per pass over the tile, the passes as even as can be (5 rows: 3 + 2): each
        // further pass reads its codes from L1 or L2 again and decodes them again
        for (; r < m;) {
          const int64_t passes = (m - r + kI8PassRows - 1) / kI8PassRows;
          const int64_t pass = (m - r + passes - 1) / passes;
          switch (pass) {
            case 4: int4_i8_tile_vnni<4>(tile, k, group, rows, r, total); break;
            case 3: int4_i8_tile_vnni<3>(tile, k, group, rows, r, total); break;
            case 2: int4_i8_tile_vnni<2>(tile, k, group, rows, r, total); break;
            default: int4_i8_tile_vnni<1>(tile, k, group, rows, r, total); break;
          }
          for (int64_t i = 0; i < pass; ++i) store(total + i * kI8TileRows, r + i, n0);
          r += pass;
        }
      }
#elif defined(EDGE_RTGI_I8_AVX2)
      if (fast) {
        // rows in pairs, each pair in two passes of half the tile (the int16 sums fill the
        // registers); one row alone takes the whole tile in one pass
        for (; r + 2 <= m; r += 2) {
          int4_i8_tile_avx2<2, 4>(tile, k, group, rows, r, 0, total);
          int4_i8_tile_avx2<2, 4>(tile, k, group, rows, r, 4, total);
          store(total, r, n0);
          store(total + kI8TileRows, r + 1, n0);
        }
        if (r < m) {
          int4_i8_tile_avx2<1, 8>(tile, k, group, rows, r, 0, total);
          store(total, r, n0);
          ++r;
        }
      }
#endif
      for (; r < m; ++r) {
        int4_i8_tile_portable(tile, k, group, rows, r, total);
        store(total, r, n0);
      }
    }
  });
  (void)fast;
  return out;
}

// --- The layer stack of a one-token decode step -------------------------------------------------
//
// model.py's DecoderLayer.forward, layer after layer, for one query row, calling the kernels above
// and ATen's matmuls directly: at batch 1 the Python around ~15 ops per layer (module calls,
// attribute lookups, views) cost about as much as the small ops themselves. The Python model stays
// the reference; cpu_ops.decode_layers builds the arguments and tests compare the two.
//
// Per layer, `params` holds 14 entries: input_layernorm.weight, post_attention_layernorm.weight,
// then for qkv, o, gate_up, down: (a, b, bias) with `meta` giving (kind, group size) per linear:
//   kind 0, dense:  a = weight [N, K]                     (F.linear)
//   kind 1, int8:   a = int8 weight [N, K], b = scales [N] (aten._weight_int8pack_mm)
//   kind 2, int4:   a = CPU-packed int4, b = scales_and_zeros [K/G, N, 2] (aten._weight_int4pack_mm_for_cpu)
//   kind 3, int4 with int8 activations: a = int4_pack_i8's layout (scales inside), b unused (int4_i8_mm)

constexpr int64_t kParamsPerLayer = 14, kMetaPerLayer = 8;

Tensor apply_linear(const Tensor& x, int64_t kind, int64_t group_size, const c10::optional<Tensor>& a,
                    const c10::optional<Tensor>& b, const c10::optional<Tensor>& bias) {
  TORCH_CHECK(a.has_value() && (kind == 0 || kind == 3 || b.has_value()),
              "edge_rtgi::decode_layers: a linear layer of kind ", kind, " lacks its weight or scales");
  Tensor y;
  if (kind == 0) {
    return at::linear(x, *a, bias);
  }
  const int64_t rows = x.size(0);
  const bool multi_row = rows >= 2 && rows <= kMultiRowMax;
  if (kind == 1) {
    // one fp32 row too, as Int8Linear does: ATen's kernel takes ~10x as long for fp32 activations
    const bool ours = multi_row || (rows == 1 && x.scalar_type() == at::kFloat);
    y = ours ? int8_mm(x, *a, *b, "best", false) : at::_weight_int8pack_mm(x, *a, *b);
  } else if (kind == 2) {
    y = multi_row ? int4_mm(x, *a, group_size, *b, "best") : at::_weight_int4pack_mm_for_cpu(x, *a, group_size, *b);
  } else if (kind == 3) {
    // the Python layers take int4_i8_mm for as many rows (int8_activation_rows_usable), so both agree
    TORCH_CHECK(rows <= kMultiRowMax, "edge_rtgi::decode_layers: ", rows, " rows on an int8-activation layer, ",
                "which takes 1..", kMultiRowMax, " (cpu_ops caps the layer loop's rows)");
    const int64_t k = x.size(1);
    TORCH_CHECK(group_size > 0 && group_size % kI8Block == 0 && k % group_size == 0,
                "edge_rtgi::decode_layers: int8-activation layer with K = ", k, " and group size ", group_size);
    const int64_t n = a->numel() / (k / group_size * i8_group_bytes(group_size)) * kI8TileRows;
    y = int4_i8_mm(x, *a, group_size, n, "best");
  } else {
    TORCH_CHECK(false, "edge_rtgi::decode_layers: unknown linear kind ", kind);
  }
  return bias.has_value() ? at::add(y, *bias) : y;
}

Tensor decode_layers(const Tensor& x_in, const Tensor& cos, const Tensor& signed_sin,
                     const c10::List<c10::optional<Tensor>>& params, at::IntArrayRef meta, at::TensorList k_stores,
                     at::TensorList v_stores, const Tensor& new_slots, const Tensor& key_slots,
                     const c10::optional<Tensor>& key_mask, int64_t num_heads, int64_t num_kv_heads, double eps,
                     double scale) {
  check_activation(x_in, "decode_layers");
  const int64_t num_layers = static_cast<int64_t>(k_stores.size());
  TORCH_CHECK(num_layers > 0, "edge_rtgi::decode_layers: no layers");
  TORCH_CHECK(static_cast<int64_t>(params.size()) == num_layers * kParamsPerLayer &&
                  static_cast<int64_t>(meta.size()) == num_layers * kMetaPerLayer &&
                  static_cast<int64_t>(v_stores.size()) == num_layers,
              "edge_rtgi::decode_layers: ", num_layers, " layers need ", num_layers * kParamsPerLayer, " params and ",
              num_layers * kMetaPerLayer, " meta entries");
  const int64_t tokens = x_in.size(0), head_dim = k_stores[0].size(2);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  Tensor x = x_in;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    auto param = [&](int64_t i) { return params.get(layer * kParamsPerLayer + i); };
    auto linear = [&](const Tensor& input, int64_t which) {
      const int64_t p = 2 + 3 * which, m = layer * kMetaPerLayer + 2 * which;
      return apply_linear(input, meta[m], meta[m + 1], param(p), param(p + 1), param(p + 2));
    };
    TORCH_CHECK(param(0).has_value() && param(1).has_value(), "edge_rtgi::decode_layers: layer ", layer,
                " lacks a norm weight");
    Tensor h = rms_norm(x, *param(0), eps);
    Tensor qkv = linear(h, 0);  // [T, (Hq + 2 Hkv) D]
    Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({tokens, num_heads + num_kv_heads, head_dim});
    rotary_(qk, cos, signed_sin);
    Tensor attn = decode_attention(qk.narrow(1, 0, num_heads), qk.narrow(1, num_heads, num_kv_heads),
                                   qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim}),
                                   k_stores[layer], v_stores[layer], new_slots, key_slots, key_mask, scale);
    x = at::add(x, linear(attn.view({tokens, q_size}), 1));
    h = rms_norm(x, *param(1), eps);
    x = at::add(x, linear(silu_mul(linear(h, 2)), 3));
  }
  return x;
}

int64_t multi_row_calls() { return g_multi_row_calls.load(std::memory_order_relaxed); }

int64_t multi_row_max() { return kMultiRowMax; }

std::string build_info() {
#if defined(EDGE_RTGI_AMX)
  return amx_ready() ? "avx512-bf16-amx" : "avx512-bf16";
#elif defined(EDGE_RTGI_AVX512_BF16)
  return "avx512-bf16";
#elif defined(EDGE_RTGI_AVX512)
  return "avx512";
#else
  return "portable";
#endif
}

}  // namespace

TORCH_LIBRARY(edge_rtgi, m) {
  m.def("build_info() -> str");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) qk, Tensor cos, Tensor signed_sin) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("decode_layers(Tensor x, Tensor cos, Tensor signed_sin, Tensor?[] params, int[] meta, Tensor[] k_stores, "
        "Tensor[] v_stores, Tensor new_slots, Tensor key_slots, Tensor? key_mask, int num_heads, int num_kv_heads, "
        "float eps, float scale) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!) k_store, Tensor(b!) v_store, "
        "Tensor new_slots, Tensor key_slots, Tensor? key_mask, float scale) -> Tensor");
  m.def("decode_attention_int4(Tensor q, Tensor k_codes, Tensor k_scale, Tensor k_zero, Tensor k_open, "
        "Tensor open_row, Tensor v_codes, Tensor v_scale, Tensor v_zero, Tensor key_slots, Tensor? key_mask, "
        "float scale, int block_size, int value_group) -> Tensor");
  m.def("int4_mm(Tensor x, Tensor qweight, int group_size, Tensor scales_and_zeros, str loops=\"best\") -> Tensor");
  m.def("int8_mm(Tensor x, Tensor qweight, Tensor scales, str loops=\"best\", bool float_out=False) -> Tensor");
  m.def("int4_pack_i8(Tensor qweight, int group_size, Tensor scales_and_zeros) -> Tensor");
  m.def("int4_i8_mm(Tensor x, Tensor packed, int group_size, int n, str loops=\"best\") -> Tensor");
  m.def("vnni_built() -> bool");
  m.def("i8_loops() -> str");
  m.def("multi_row_calls() -> int");
  m.def("multi_row_max() -> int");
}

// build_info takes no tensor, so it is registered for every dispatch key.
TORCH_LIBRARY_FRAGMENT(edge_rtgi, m) {
  m.impl("build_info", TORCH_FN(build_info));
  m.impl("multi_row_calls", TORCH_FN(multi_row_calls));
  m.impl("multi_row_max", TORCH_FN(multi_row_max));
  m.impl("vnni_built", TORCH_FN(vnni_built));
  m.impl("i8_loops", TORCH_FN(i8_loops));
}

TORCH_LIBRARY_IMPL(edge_rtgi, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_", &rotary_);
  m.impl("silu_mul", &silu_mul);
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_attention_int4", &decode_attention_int4);
  m.impl("decode_layers", &decode_layers);
  m.impl("int4_mm", &int4_mm);
  m.impl("int8_mm", &int8_mm);
  m.impl("int4_pack_i8", &int4_pack_i8);
  m.impl("int4_i8_mm", &int4_i8_mm);
}
