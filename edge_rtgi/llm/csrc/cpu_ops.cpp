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

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/_weight_int8pack_mm.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define EDGE_RTGI_AVX512 1
#endif

#include <algorithm>
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

inline float sum(const float* x, int64_t n) {
  float part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) part[l] += x[i + l];
  }
  float total = 0.f;
  for (; i < n; ++i) total += x[i];
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
      for (int64_t i = 0; i < inter; ++i) {
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

template <typename T>
void decode_attention_impl(const Tensor& q, const Tensor& k_store, const Tensor& v_store,
                           const Tensor& key_slots, const c10::optional<Tensor>& key_mask,
                           double scale, Tensor& out) {
  const int64_t rows = q.size(0), num_heads = q.size(1), dim = q.size(2);
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
        const T* qh = qp + (b * num_heads + kvh * group + j) * dim;
        for (int64_t i = 0; i < dim; ++i) qf[j * dim + i] = to_f(qh[i]) * sc;
      }
      // Scores (masked keys get -inf), then each head's softmax weights, then the weighted values.
      for (int64_t s = 0; s < num_keys; ++s) {
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
        denom[j] = sum(sj, num_keys);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t s = 0; s < num_keys; ++s) {
        if (row_mask && !row_mask[s]) continue;
        const T* value = vp + row_slots[s] * slot_stride + kvh * dim;
        for (int64_t j = 0; j < group; ++j) {
          const float p = scores[j * num_keys + s];
          float* aj = acc.data() + j * dim;
          for (int64_t i = 0; i < dim; ++i) aj[i] += p * to_f(value[i]);
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
  const int64_t rows = src.size(0), row_elems = src.size(1) * src.size(2);
  const int64_t num_slots = store.size(0);
  const int64_t* slots = new_slots.const_data_ptr<int64_t>();
  const T* sp = in_ptr<T>(src);
  T* dp = out_ptr<T>(store);
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(slots[r] >= 0 && slots[r] < num_slots, "edge_rtgi::decode_attention: slot ", slots[r],
                " out of range [0, ", num_slots, ")");
    std::memcpy(dp + slots[r] * row_elems, sp + r * row_elems, row_elems * sizeof(T));
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
  Tensor q = q_in.contiguous(), k_new = k_new_in.contiguous(), v_new = v_new_in.contiguous();
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

constexpr int64_t kParamsPerLayer = 14, kMetaPerLayer = 8;

Tensor apply_linear(const Tensor& x, int64_t kind, int64_t group_size, const c10::optional<Tensor>& a,
                    const c10::optional<Tensor>& b, const c10::optional<Tensor>& bias) {
  TORCH_CHECK(a.has_value() && (kind == 0 || b.has_value()),
              "edge_rtgi::decode_layers: a linear layer of kind ", kind, " lacks its weight or scales");
  Tensor y;
  if (kind == 0) {
    return at::linear(x, *a, bias);
  } else if (kind == 1) {
    y = at::_weight_int8pack_mm(x, *a, *b);
  } else if (kind == 2) {
    y = at::_weight_int4pack_mm_for_cpu(x, *a, group_size, *b);
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

std::string build_info() {
#ifdef EDGE_RTGI_AVX512
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
}

// build_info takes no tensor, so it is registered for every dispatch key.
TORCH_LIBRARY_FRAGMENT(edge_rtgi, m) { m.impl("build_info", TORCH_FN(build_info)); }

TORCH_LIBRARY_IMPL(edge_rtgi, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_", &rotary_);
  m.impl("silu_mul", &silu_mul);
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_layers", &decode_layers);
}
