// CPU kernels for attention over the latent middle of a patchkv cache, read straight from what the cache
// stores (fixed-rate codes or packed floats): no float copy of the middle is made. PyTorch references with the
// same signatures are in kernels/reference.py (the oracle these are tested against); kernels/cpu.py builds this
// file once per machine with torch.utils.cpp_extension (-O3 -march=native).
//
// A layer's stored middle is `latents` [B, N, W]: W bytes of codes (uint8) or W packed floats per token.
// A component table says where each coefficient of each head is; the components of head h are
// head_start[h] .. head_start[h + 1] (their basis components `index[c]` are the same for every token):
//   byte[c]             codes: the byte its bits start in; floats: its column
//   shift[c], mask[c]   codes: value = (bits >> shift) & mask (mask 0: float latents)
//   step[c], offset[c]  codes: coefficient = value * step + offset
//   wide[c]             codes: 1 when its bits run into the next byte
// `rows` [C, D] float32 are the basis vectors of the components in table order, `mean` [H, D].
//
// Work is done per block of tokens and head: the block's coefficients are unpacked into a small buffer, then
// vectors are rebuilt a few tokens at a time in registers (each basis row loaded once per few tokens), then
// rotated (rotate-half RoPE over the first `rot` dims, cos/sin rows gathered by true position) and consumed:
// dotted with the queries (`attend`) or stored (`reconstruct`). Vector code uses GCC vector extensions, so the
// same source builds for AVX-512, AVX2 or plain SSE; gathers use AVX-512 / AVX2 intrinsics where present.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int VW = 16;
#elif defined(__AVX__)
constexpr int VW = 8;
#else
constexpr int VW = 4;
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));
inline vf vload(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline void vstore(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }
inline vf splat(float x) { return vf{} + x; }
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));
typedef uint16_t vhu __attribute__((vector_size(VW * 2), aligned(2)));

// n floats -> bfloat16 (round to nearest even, as torch does for finite values), VW at a time.
inline void store_bf16(at::BFloat16* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + VW <= n; i += VW) {
    const vu bits = reinterpret_cast<vu>(vload(src + i));
    const vu rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    *reinterpret_cast<vhu*>(dst + i) = __builtin_convertvector(rounded, vh);
  }
  for (; i < n; ++i) dst[i] = at::BFloat16(src[i]);
}

constexpr int64_t BLOCK = 64;  // tokens unpacked together
constexpr int TB = 4;          // tokens rebuilt together in registers

struct Table {
  const int32_t* head_start;
  const int32_t* byte;
  const int32_t* shift;
  const int32_t* mask;
  const float* step;
  const float* offset;
  const int32_t* wide;
  int64_t heads;
  int64_t widest;  // most components of any head
  bool shared;     // every head reads the same components from the same bits (a layer basis): unpacked once
};

Table make_table(const torch::Tensor& head_start, const torch::Tensor& byte, const torch::Tensor& shift,
                 const torch::Tensor& mask, const torch::Tensor& step, const torch::Tensor& offset,
                 const torch::Tensor& wide) {
  for (const auto* t : {&head_start, &byte, &shift, &mask, &wide})
    TORCH_CHECK(t->scalar_type() == torch::kInt32 && t->is_contiguous() && t->device().is_cpu(),
                "component table: int32, contiguous, on CPU");
  TORCH_CHECK(step.scalar_type() == torch::kFloat32 && offset.scalar_type() == torch::kFloat32 &&
              step.is_contiguous() && offset.is_contiguous(), "component table: float32 steps and offsets");
  Table t{head_start.data_ptr<int32_t>(), byte.data_ptr<int32_t>(), shift.data_ptr<int32_t>(),
          mask.data_ptr<int32_t>(), step.data_ptr<float>(), offset.data_ptr<float>(), wide.data_ptr<int32_t>(),
          head_start.numel() - 1, 1, false};
  for (int64_t h = 0; h < t.heads; ++h) t.widest = std::max<int64_t>(t.widest, t.head_start[h + 1] - t.head_start[h]);
  t.shared = t.heads > 1;
  for (int64_t h = 1; h < t.heads && t.shared; ++h) {
    const int32_t a = t.head_start[0], K = t.head_start[1] - a, c = t.head_start[h];
    t.shared = t.head_start[h + 1] - c == K;
    for (int32_t k = 0; k < K && t.shared; ++k)
      t.shared = t.byte[c + k] == t.byte[a + k] && t.shift[c + k] == t.shift[a + k] && t.mask[c + k] == t.mask[a + k] &&
                 t.wide[c + k] == t.wide[a + k] && t.step[c + k] == t.step[a + k] && t.offset[c + k] == t.offset[a + k];
  }
  return t;
}

void check_latents(const torch::Tensor& latents) {
  TORCH_CHECK(latents.dim() == 3 && latents.is_contiguous() && latents.device().is_cpu(),
              "latents: contiguous CPU tensor [batch, tokens, width]");
}

// ----- reading coefficients -----------------------------------------------------------------------------------

// Coefficients of head h's components for `count` consecutive stored tokens starting at `src` (row stride W)
// into coef[i * stride + k]. Codes are first copied into `pad` (count * W bytes + 4) so that every 32-bit read of
// a gather stays inside the buffer.
template <typename T>
void unpack_block(const T* src, int64_t W, int64_t count, const Table& t, int64_t h, float* coef, int64_t stride,
                  const uint8_t* pad) {
  const int32_t first = t.head_start[h], K = t.head_start[h + 1] - first;
  if constexpr (std::is_same_v<T, uint8_t>) {
    for (int64_t i = 0; i < count; ++i) {
      const uint8_t* row = pad + i * W;
      float* out = coef + i * stride;
      int32_t k = 0;
#if defined(__AVX512F__)
      for (; k < K; k += 16) {  // the last 16 masked: no scalar tail
        const __mmask16 m = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
        const __m512i at = _mm512_maskz_loadu_epi32(m, t.byte + first + k);
        const __m512i bits = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, at, row, 1);
        const __m512i v = _mm512_and_si512(_mm512_srlv_epi32(bits, _mm512_maskz_loadu_epi32(m, t.shift + first + k)),
                                           _mm512_maskz_loadu_epi32(m, t.mask + first + k));
        _mm512_mask_storeu_ps(out + k, m, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v),
                                                          _mm512_maskz_loadu_ps(m, t.step + first + k),
                                                          _mm512_maskz_loadu_ps(m, t.offset + first + k)));
      }
#elif defined(__AVX2__)
      for (; k + 8 <= K; k += 8) {
        const __m256i at = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.byte + first + k));
        const __m256i bits = _mm256_i32gather_epi32(reinterpret_cast<const int*>(row), at, 1);
        const __m256i v = _mm256_and_si256(
            _mm256_srlv_epi32(bits, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.shift + first + k))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.mask + first + k)));
        _mm256_storeu_ps(out + k, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_loadu_ps(t.step + first + k),
                                                  _mm256_loadu_ps(t.offset + first + k)));
      }
#endif
      for (; k < K; ++k) {
        const int32_t c = first + k;
        uint32_t bits;
        std::memcpy(&bits, row + t.byte[c], 4);
        out[k] = float((bits >> t.shift[c]) & uint32_t(t.mask[c])) * t.step[c] + t.offset[c];
      }
    }
  } else {
    for (int64_t i = 0; i < count; ++i)
      for (int32_t k = 0; k < K; ++k) coef[i * stride + k] = float(src[i * W + t.byte[first + k]]);
  }
}

// The padded copy of `count` stored tokens that unpack_block reads codes from (float latents need none).
template <typename T>
const uint8_t* padded(const T* src, int64_t W, int64_t count, std::vector<uint8_t>& buffer) {
  if constexpr (std::is_same_v<T, uint8_t>) {
    buffer.resize(count * W + 4);
    std::memcpy(buffer.data(), src, count * W);
    std::memset(buffer.data() + count * W, 0, 4);
    return buffer.data();
  }
  return nullptr;
}

// ----- rebuilding vectors -------------------------------------------------------------------------------------

// out[j][:] = mean + sum_k coef[j * stride + k] * rows[k][:] for j < n (n <= TB tokens), D a multiple of VW.
template <int NV>
inline void rebuild(const float* coef, int64_t stride, int64_t n, int32_t K, const float* rows, const float* mean,
                    float* out) {
  constexpr int64_t D = NV * VW;
  vf acc[TB][NV];
  for (int j = 0; j < TB; ++j)
    for (int v = 0; v < NV; ++v) acc[j][v] = vload(mean + v * VW);
  if (n == TB) {
    for (int32_t k = 0; k < K; ++k) {
      vf u[NV];
      for (int v = 0; v < NV; ++v) u[v] = vload(rows + k * D + v * VW);
      for (int j = 0; j < TB; ++j) {
        const vf c = splat(coef[j * stride + k]);
        for (int v = 0; v < NV; ++v) acc[j][v] += c * u[v];
      }
    }
  } else {
    for (int32_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < n; ++j) {
        const vf c = splat(coef[j * stride + k]);
        for (int v = 0; v < NV; ++v) acc[j][v] += c * vload(rows + k * D + v * VW);
      }
  }
  for (int64_t j = 0; j < n; ++j)
    for (int v = 0; v < NV; ++v) vstore(out + j * D + v * VW, acc[j][v]);
}

// Any D (no vector multiple): the same sum, plainly.
inline void rebuild_any(const float* coef, int64_t stride, int64_t n, int32_t K, const float* rows, const float* mean,
                        int64_t D, float* out) {
  for (int64_t j = 0; j < n; ++j) {
    float* o = out + j * D;
    for (int64_t x = 0; x < D; ++x) o[x] = mean[x];
    for (int32_t k = 0; k < K; ++k) {
      const float c = coef[j * stride + k];
      for (int64_t x = 0; x < D; ++x) o[x] += c * rows[k * D + x];
    }
  }
}

using RebuildFn = void (*)(const float*, int64_t, int64_t, int32_t, const float*, const float*, float*);

RebuildFn rebuild_for(int64_t D) {
  if (D % VW != 0) return nullptr;
  switch (D / VW) {
    case 1: return rebuild<1>;
    case 2: return rebuild<2>;
    case 3: return rebuild<3>;
    case 4: return rebuild<4>;
    case 5: return rebuild<5>;
    case 6: return rebuild<6>;
    case 8: return rebuild<8>;
    case 16: return rebuild<16>;
    default: return nullptr;
  }
}

#if defined(__AVX512BF16__)
// The same sum with bfloat16 products accumulated in float32 (`vdpbf16ps`: two components per instruction):
// `pairs` holds the rows two by two, [K / 2][NV][32] bfloat16 = (row 2m, row 2m + 1) interleaved lane by lane,
// coefficients are rounded to bfloat16 in pairs. For models that compute in half precision themselves.
template <int NV>
inline void rebuild_bf16(const float* coef, int64_t stride, int64_t n, int32_t K, const uint16_t* pairs,
                         const float* mean, float* out) {
  constexpr int64_t D = NV * 16;
  __m512 acc[TB][NV];
  for (int j = 0; j < TB; ++j)
    for (int v = 0; v < NV; ++v) acc[j][v] = _mm512_loadu_ps(mean + v * 16);
  alignas(64) uint32_t packed[TB][128];  // coefficients in bfloat16, two per uint32 (K <= 256)
  for (int64_t j = 0; j < n; ++j)
    for (int32_t k = 0; k < K; k += 32) {  // 32 coefficients -> 32 bfloat16 in order: pairs (2m, 2m + 1)
      const __mmask16 lo = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
      const __mmask16 hi = K - k >= 32 ? __mmask16(0xFFFF) : K - k <= 16 ? __mmask16(0) :
                                                              __mmask16((1u << (K - k - 16)) - 1);
      const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, coef + j * stride + k + 16),
                                                _mm512_maskz_loadu_ps(lo, coef + j * stride + k));
      _mm512_store_si512(packed[j] + k / 2, reinterpret_cast<__m512i>(both));
    }
  for (int32_t m = 0; m < (K + 1) / 2; ++m) {
    __m512bh u[NV];
    for (int v = 0; v < NV; ++v) u[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(pairs + (m * NV + v) * 32));
    for (int64_t j = 0; j < n; ++j) {
      const __m512bh c = reinterpret_cast<__m512bh>(_mm512_set1_epi32(int(packed[j][m])));
      for (int v = 0; v < NV; ++v) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], c, u[v]);
    }
  }
  for (int64_t j = 0; j < n; ++j)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + j * D + v * 16, acc[j][v]);
}
#endif

// Rebuilds a head's vectors: float32 products, or bfloat16 products (`half`, where the CPU has them and head_dim
// is a multiple of 16 up to 256, with at most 256 components per head).
struct Rebuilder {
  const Table& t;
  const float* rows;
  const float* mean;
  int64_t D;
  RebuildFn fast = nullptr;
  bool half = false;
  std::vector<std::vector<uint16_t>> pairs;  // per head, for the bfloat16 path
  int nv = 0;

  Rebuilder(const Table& table, const float* rows_, const float* mean_, int64_t D_, bool want_half)
      : t(table), rows(rows_), mean(mean_), D(D_), fast(rebuild_for(D_)) {
#if defined(__AVX512BF16__)
    half = want_half && D % 16 == 0 && D / 16 <= 16 && t.widest <= 256;
    if (!half) return;
    nv = int(D / 16);
    pairs.resize(t.heads);
    for (int64_t h = 0; h < t.heads; ++h) {
      const int32_t first = t.head_start[h], K = t.head_start[h + 1] - first, M = (K + 1) / 2;
      auto& p = pairs[h];
      p.assign(size_t(M) * nv * 32, 0);
      for (int32_t m = 0; m < M; ++m)
        for (int v = 0; v < nv; ++v)
          for (int i = 0; i < 16; ++i)
            for (int e = 0; e < 2; ++e) {
              const int32_t k = 2 * m + e;
              const float x = k < K ? rows[(first + k) * D + v * 16 + i] : 0.f;
              p[((m * nv + v) * 16 + i) * 2 + e] = at::BFloat16(x).x;
            }
    }
#else
    (void)want_half;
#endif
  }

  void operator()(const float* coef, int64_t stride, int64_t n, int64_t h, float* out) const {
    const int32_t first = t.head_start[h], K = t.head_start[h + 1] - first;
#if defined(__AVX512BF16__)
    if (half) {
      const uint16_t* p = pairs[h].data();
      switch (nv) {
        case 1: return rebuild_bf16<1>(coef, stride, n, K, p, mean + h * D, out);
        case 2: return rebuild_bf16<2>(coef, stride, n, K, p, mean + h * D, out);
        case 4: return rebuild_bf16<4>(coef, stride, n, K, p, mean + h * D, out);
        case 8: return rebuild_bf16<8>(coef, stride, n, K, p, mean + h * D, out);
        default: break;
      }
    }
#endif
    if (fast != nullptr) fast(coef, stride, n, K, rows + first * D, mean + h * D, out);
    else rebuild_any(coef, stride, n, K, rows + first * D, mean + h * D, D, out);
  }
};

struct Rope {
  const float* cos = nullptr;  // [P, rot] or, with half_table, [P, rot / 2] (both halves the same rotation)
  const float* sin = nullptr;
  const int32_t* positions = nullptr;  // [B, N]
  int64_t rot = 0, width = 0, table_rows = 0;
  bool on() const { return cos != nullptr; }
};

Rope make_rope(const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& positions, int64_t rot) {
  Rope r;
  if (positions.numel() == 0) return r;
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
              sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes(),
              "rope: float32 contiguous cos, sin [positions, rotary dims]");
  TORCH_CHECK(positions.scalar_type() == torch::kInt32 && positions.is_contiguous(), "rope: int32 positions");
  TORCH_CHECK(cos.size(1) == rot || 2 * cos.size(1) == rot, "rope: tables of rot or rot / 2 columns");
  r.cos = cos.data_ptr<float>();
  r.sin = sin.data_ptr<float>();
  r.positions = positions.data_ptr<int32_t>();
  r.rot = rot;
  r.width = cos.size(1);
  r.table_rows = cos.size(0);
  return r;
}

// RoPE in place on one vector: x[i] cos[i] - x[i + half] sin[i] for i < half, x[i] cos[i] + x[i - half] sin[i] for
// half <= i < rot; dims past rot pass through.
inline void rotate(float* x, const float* cos, const float* sin, int64_t rot, int64_t width) {
  const int64_t half = rot / 2;
  const int64_t second = width == rot ? half : 0;  // column of the second half's cos/sin in the table
  int64_t i = 0;
  for (; i + VW <= half; i += VW) {
    const vf a = vload(x + i), b = vload(x + half + i);
    vstore(x + i, a * vload(cos + i) - b * vload(sin + i));
    vstore(x + half + i, b * vload(cos + second + i) + a * vload(sin + second + i));
  }
  for (; i < half; ++i) {
    const float a = x[i], b = x[half + i];
    x[i] = a * cos[i] - b * sin[i];
    x[half + i] = b * cos[second + i] + a * sin[second + i];
  }
}

inline float hsum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#elif defined(__AVX__)
  const __m256 x = reinterpret_cast<__m256>(v);
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
#else
  float s = 0.f;
  for (int i = 0; i < VW; ++i) s += v[i];
  return s;
#endif
}

// exp(x) for VW lanes: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial (relative error
// below 2e-7 on [-ln2/2, ln2/2]), 2^n by the exponent bits; x below -87 gives 0 (as the masks' -3.4e38 must).
inline vf vexp(vf x) {
  typedef int32_t vi __attribute__((vector_size(VW * 4)));
  const vf lo = splat(-87.0f), hi = splat(88.0f);
  const vi dead = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vf n = (x * splat(1.44269504f) + splat(12582912.f)) - splat(12582912.f);  // round to nearest (1.5 * 2^23)
  const vf r = x - n * splat(0.693145752f) - n * splat(1.42860677e-6f);
  vf poly = splat(1.f / 720.f);
  poly = poly * r + splat(1.f / 120.f);
  poly = poly * r + splat(1.f / 24.f);
  poly = poly * r + splat(1.f / 6.f);
  poly = poly * r + splat(0.5f);
  poly = poly * r + splat(1.f);
  poly = poly * r + splat(1.f);
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  const vf out = poly * reinterpret_cast<vf>(bits);
  return dead ? splat(0.f) : out;
}

// p[j] = exp(p[j] - shift) for j < n, and their sum.
inline float exp_shifted(float* p, int64_t n, float shift) {
  int64_t j = 0;
  vf total{};
  for (; j + VW <= n; j += VW) {
    const vf e = vexp(vload(p + j) - splat(shift));
    vstore(p + j, e);
    total += e;
  }
  float sum = hsum(total);
  for (; j < n; ++j) {
    p[j] = std::exp(p[j] - shift);
    sum += p[j];
  }
  return sum;
}

inline float dot(const float* a, const float* b, int64_t D) {
  int64_t i = 0;
  vf acc{};
  for (; i + VW <= D; i += VW) acc += vload(a + i) * vload(b + i);
  float s = hsum(acc);
  for (; i < D; ++i) s += a[i] * b[i];
  return s;
}

template <typename Fn>
void dispatch_latents(const torch::Tensor& latents, Fn&& fn) {
  switch (latents.scalar_type()) {
    case torch::kUInt8: fn(latents.data_ptr<uint8_t>()); break;
    case torch::kFloat32: fn(latents.data_ptr<float>()); break;
    case torch::kBFloat16: fn(latents.data_ptr<at::BFloat16>()); break;
    case torch::kHalf: fn(latents.data_ptr<at::Half>()); break;
    case torch::kFloat64: fn(latents.data_ptr<double>()); break;
    default: TORCH_CHECK(false, "latents: uint8 codes or floating point, got ", latents.scalar_type());
  }
}

// Runs fn(b, n0, count, block, pad, scratch) over every block of `BLOCK` stored tokens of each sequence (`block`
// its first token's row, `pad` its padded copy for unpack_block), blocks split between threads; `scratch()` makes
// each thread's working buffers once.
template <typename T, typename Scratch, typename Fn>
void over_blocks(const T* src, int64_t B, int64_t N, int64_t W, Scratch&& scratch, Fn&& fn) {
  const int64_t blocks = (N + BLOCK - 1) / BLOCK;
  at::parallel_for(0, B * blocks, 1, [&](int64_t begin, int64_t end) {
    auto buffers = scratch();
    std::vector<uint8_t> copy;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / blocks, n0 = (i % blocks) * BLOCK, count = std::min(BLOCK, N - n0);
      const T* block = src + (b * N + n0) * W;
      fn(b, n0, count, block, padded(block, W, count, copy), buffers);
    }
  });
}

// Runs `consume(b, h, n0, count, keys)` over every block of tokens and head: keys [count, D] rebuilt (and rotated
// if rope is on). Blocks are split between threads.
template <typename T, typename Consume>
void for_each_block(const T* src, int64_t B, int64_t N, int64_t W, const Table& t, const Rebuilder& rebuild,
                    int64_t D, const Rope& rope, Consume&& consume) {
  struct Buffers { std::vector<float> coef, keys; };
  over_blocks(src, B, N, W, [&] { return Buffers{std::vector<float>(BLOCK * t.widest), std::vector<float>(BLOCK * D)}; },
              [&](int64_t b, int64_t n0, int64_t count, const T* block, const uint8_t* pad, Buffers& s) {
    for (int64_t h = 0; h < t.heads; ++h) {
      if (h == 0 || !t.shared) unpack_block(block, W, count, t, h, s.coef.data(), t.widest, pad);
      for (int64_t j = 0; j < count; j += TB)
        rebuild(s.coef.data() + j * t.widest, t.widest, std::min<int64_t>(TB, count - j), h, s.keys.data() + j * D);
      if (rope.on())
        for (int64_t j = 0; j < count; ++j) {
          const int64_t p = rope.positions[b * N + n0 + j];
          TORCH_CHECK(p >= 0 && p < rope.table_rows, "rope: position ", p, " outside the table");
          rotate(s.keys.data() + j * D, rope.cos + p * rope.width, rope.sin + p * rope.width, rope.rot, rope.width);
        }
      consume(b, h, n0, count, s.keys.data(), block, pad);
    }
  });
}

void check_basis(const torch::Tensor& rows, const torch::Tensor& mean, const Table& t) {
  TORCH_CHECK(rows.scalar_type() == torch::kFloat32 && rows.is_contiguous() && rows.dim() == 2 &&
              rows.size(0) == t.head_start[t.heads], "rows: float32 contiguous [components, head_dim]");
  TORCH_CHECK(mean.scalar_type() == torch::kFloat32 && mean.is_contiguous() && mean.dim() == 2 &&
              mean.size(0) == t.heads && mean.size(1) == rows.size(1), "mean: float32 contiguous [heads, head_dim]");
}

// ----- unpack: stored latents -> coefficients [B, H, N, C_h] in table order, zero-padded to the widest head ----
torch::Tensor unpack(torch::Tensor latents, torch::Tensor head_start, torch::Tensor byte, torch::Tensor shift,
                     torch::Tensor mask, torch::Tensor step, torch::Tensor offset, torch::Tensor wide) {
  check_latents(latents);
  const Table t = make_table(head_start, byte, shift, mask, step, offset, wide);
  const int64_t B = latents.size(0), N = latents.size(1), W = latents.size(2), H = t.heads;
  auto out = torch::zeros({B, H, N, t.widest}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  dispatch_latents(latents, [&](auto* src) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(src)>>;
    over_blocks(src, B, N, W, [] { return 0; },
                [&](int64_t b, int64_t n0, int64_t count, const T* block, const uint8_t* pad, int) {
      for (int64_t h = 0; h < H; ++h)
        unpack_block(block, W, count, t, h, o + ((b * H + h) * N + n0) * t.widest, t.widest, pad);
    });
  });
  return out;
}

// ----- reconstruct: stored latents -> vectors [B, H, N, D] (rotated by their positions if rope is given) ------
torch::Tensor reconstruct(torch::Tensor latents, torch::Tensor head_start, torch::Tensor byte, torch::Tensor shift,
                          torch::Tensor mask, torch::Tensor step, torch::Tensor offset, torch::Tensor wide,
                          torch::Tensor rows, torch::Tensor mean, torch::Tensor cos, torch::Tensor sin,
                          torch::Tensor positions, int64_t rot, at::ScalarType out_dtype, bool half) {
  check_latents(latents);
  const Table t = make_table(head_start, byte, shift, mask, step, offset, wide);
  check_basis(rows, mean, t);
  const Rope rope = make_rope(cos, sin, positions, rot);
  const int64_t B = latents.size(0), N = latents.size(1), W = latents.size(2), H = t.heads, D = rows.size(1);
  auto out = torch::empty({B, H, N, D}, torch::dtype(out_dtype));
  dispatch_latents(latents, [&](auto* src) {
    auto run = [&](auto* o) {
      using Out = std::remove_pointer_t<decltype(o)>;
      const Rebuilder rebuild(t, rows.data_ptr<float>(), mean.data_ptr<float>(), D, half);
      for_each_block(src, B, N, W, t, rebuild, D, rope,
                     [&](int64_t b, int64_t h, int64_t n0, int64_t count, const float* keys, const auto*,
                         const uint8_t*) {
                       Out* dst = o + ((b * H + h) * N + n0) * D;
                       if constexpr (std::is_same_v<Out, float>) std::memcpy(dst, keys, count * D * sizeof(float));
                       else if constexpr (std::is_same_v<Out, at::BFloat16>) store_bf16(dst, keys, count * D);
                       else for (int64_t x = 0; x < count * D; ++x) dst[x] = Out(keys[x]);
                     });
    };
    switch (out_dtype) {
      case torch::kFloat32: run(out.data_ptr<float>()); break;
      case torch::kBFloat16: run(out.data_ptr<at::BFloat16>()); break;
      case torch::kHalf: run(out.data_ptr<at::Half>()); break;
      default: TORCH_CHECK(false, "reconstruct: out dtype float32, bfloat16 or float16");
    }
  });
  return out;
}

// ----- attend: one decode step's attention over the middle, in one pass over its codes -------------------------
// Scores of the G queries of each head against every stored token (keys rebuilt and rotated, or in the latent
// space: q [B, H, G, C_h] in table order plus q_bias [B, H, G]), times `scaling`, plus `bias` [B, N] or per head
// [B, H, N] (the mask's columns for the middle; empty: none), and the softmax-weighted sum of the tokens' value coefficients, online
// (flash-decoding: a running max per query, partial states per thread, merged at the end). Returns the running
// max m [B, H, G], the sum l = sum_n exp(s_n - m) and sums [B, H, G, C_v] = sum_n exp(s_n - m) c_n (value table
// order): the caller merges them with the exact regions' scores and values.
std::vector<torch::Tensor> attend(
    torch::Tensor latents, torch::Tensor head_start, torch::Tensor byte, torch::Tensor shift, torch::Tensor mask,
    torch::Tensor step, torch::Tensor offset, torch::Tensor wide, torch::Tensor rows, torch::Tensor mean,
    torch::Tensor cos, torch::Tensor sin, torch::Tensor positions, int64_t rot, torch::Tensor q, torch::Tensor q_bias,
    torch::Tensor bias, double scaling, torch::Tensor value_latents, torch::Tensor v_head_start, torch::Tensor v_byte,
    torch::Tensor v_shift, torch::Tensor v_mask, torch::Tensor v_step, torch::Tensor v_offset, torch::Tensor v_wide,
    bool latent_space, bool half) {
  check_latents(latents);
  check_latents(value_latents);
  TORCH_CHECK(value_latents.scalar_type() == latents.scalar_type() && value_latents.size(0) == latents.size(0) &&
              value_latents.size(1) == latents.size(1), "value latents: the keys' dtype, batch and tokens");
  const Table t = make_table(head_start, byte, shift, mask, step, offset, wide);
  const Table tv = make_table(v_head_start, v_byte, v_shift, v_mask, v_step, v_offset, v_wide);
  const Rope rope = make_rope(cos, sin, positions, rot);
  const int64_t B = latents.size(0), N = latents.size(1), W = latents.size(2), WV = value_latents.size(2);
  const int64_t H = t.heads, D = rows.size(1), G = q.size(2), SV = tv.widest;
  TORCH_CHECK(tv.heads == H, "value table: the keys' heads");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && q.is_contiguous() && q.dim() == 4 && q.size(0) == B &&
              q.size(1) == H && q.size(3) == (latent_space ? t.widest : D), "q: float32 contiguous [B, H, G, D]");
  if (!latent_space) check_basis(rows, mean, t);
  const float* qb = latent_space ? q_bias.data_ptr<float>() : nullptr;
  const float* mb = bias.numel() ? bias.data_ptr<float>() : nullptr;
  TORCH_CHECK(mb == nullptr || (bias.scalar_type() == torch::kFloat32 && bias.is_contiguous() &&
                                 (bias.numel() == B * N || bias.numel() == B * H * N)),
              "bias: float32 contiguous [B, N] or [B, H, N]");
  const int64_t bias_head = mb != nullptr && bias.numel() == B * H * N ? N : 0;  // per head, or shared
  const int64_t blocks = (N + BLOCK - 1) / BLOCK, threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t states = B * H * G;
  std::vector<float> m_part(threads * states, -INFINITY), l_part(threads * states, 0.f);
  std::vector<float> acc_part(threads * states * SV, 0.f);
  const float* qp = q.data_ptr<float>();
  const float scale = float(scaling);
  dispatch_latents(latents, [&](auto* src) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(src)>>;
    const T* vsrc = value_latents.data_ptr<T>();
    const Rebuilder rebuild(t, latent_space ? nullptr : rows.data_ptr<float>(),
                            latent_space ? nullptr : mean.data_ptr<float>(), D, half && !latent_space);
    at::parallel_for(0, B * blocks, 1, [&](int64_t begin, int64_t end) {
      const int64_t tid = std::min<int64_t>(at::get_thread_num(), threads - 1);
      float* m_state = m_part.data() + tid * states;
      float* l_state = l_part.data() + tid * states;
      float* acc_state = acc_part.data() + tid * states * SV;
      std::vector<float> coef(BLOCK * t.widest), keys(latent_space ? 0 : BLOCK * D), vcoef(BLOCK * SV), p(BLOCK);
      std::vector<float> sc(BLOCK * G);
      std::vector<uint8_t> kbuf, vbuf;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / blocks, n0 = (i % blocks) * BLOCK, count = std::min(BLOCK, N - n0);
        const T* kblock = src + (b * N + n0) * W;
        const T* vblock = vsrc + (b * N + n0) * WV;
        const uint8_t* kpad = padded(kblock, W, count, kbuf);
        const uint8_t* vpad = padded(vblock, WV, count, vbuf);
        for (int64_t h = 0; h < H; ++h) {
          if (h == 0 || !t.shared) unpack_block(kblock, W, count, t, h, coef.data(), t.widest, kpad);
          const float* qh = qp + (b * H + h) * G * (latent_space ? t.widest : D);
          if (latent_space) {
            const int64_t K = t.head_start[h + 1] - t.head_start[h];
            for (int64_t j = 0; j < count; ++j)
              for (int64_t g = 0; g < G; ++g)
                sc[j * G + g] = dot(qh + g * t.widest, coef.data() + j * t.widest, K) + qb[(b * H + h) * G + g];
          } else {
            for (int64_t j = 0; j < count; j += TB)
              rebuild(coef.data() + j * t.widest, t.widest, std::min<int64_t>(TB, count - j), h, keys.data() + j * D);
            for (int64_t j = 0; j < count; ++j) {
              float* key = keys.data() + j * D;
              if (rope.on()) {
                const int64_t pos = rope.positions[b * N + n0 + j];
                TORCH_CHECK(pos >= 0 && pos < rope.table_rows, "rope: position ", pos, " outside the table");
                rotate(key, rope.cos + pos * rope.width, rope.sin + pos * rope.width, rope.rot, rope.width);
              }
              for (int64_t g = 0; g < G; ++g) sc[j * G + g] = dot(qh + g * D, key, D);
            }
          }
          if (h == 0 || !tv.shared) unpack_block(vblock, WV, count, tv, h, vcoef.data(), SV, vpad);
          const int32_t KV = tv.head_start[h + 1] - tv.head_start[h];
          for (int64_t g = 0; g < G; ++g) {
            const int64_t state = (b * H + h) * G + g;
            float block_max = -INFINITY;
            for (int64_t j = 0; j < count; ++j) {
              const float x = sc[j * G + g] * scale + (mb ? mb[(b * (bias_head ? H : 1) + (bias_head ? h : 0)) * N +
                                                                 n0 + j] : 0.f);
              p[j] = x;
              block_max = std::max(block_max, x);
            }
            const float old = m_state[state], now = std::max(old, block_max);
            const float keep = old == -INFINITY ? 0.f : std::exp(old - now);
            const float total = exp_shifted(p.data(), count, now);
            float* acc = acc_state + state * SV;
            if (keep != 1.f)
              for (int32_t k = 0; k < KV; ++k) acc[k] *= keep;
            for (int64_t j = 0; j < count; ++j) {
              const vf w = splat(p[j]);
              const float* c = vcoef.data() + j * SV;
              int32_t k = 0;
              for (; k + VW <= KV; k += VW) vstore(acc + k, vload(acc + k) + w * vload(c + k));
              for (; k < KV; ++k) acc[k] += p[j] * c[k];
            }
            l_state[state] = l_state[state] * keep + total;
            m_state[state] = now;
          }
        }
      }
    });
  });
  auto m_out = torch::full({B, H, G}, -INFINITY, torch::kFloat32);
  auto l_out = torch::zeros({B, H, G}, torch::kFloat32);
  auto sums = torch::zeros({B, H, G, SV}, torch::kFloat32);
  float* mo = m_out.data_ptr<float>();
  float* lo = l_out.data_ptr<float>();
  float* so = sums.data_ptr<float>();
  for (int64_t state = 0; state < states; ++state) {
    float top = -INFINITY;
    for (int64_t th = 0; th < threads; ++th) top = std::max(top, m_part[th * states + state]);
    mo[state] = top;
    if (top == -INFINITY) continue;
    for (int64_t th = 0; th < threads; ++th) {
      const float mt = m_part[th * states + state];
      if (mt == -INFINITY) continue;
      const float w = std::exp(mt - top);
      lo[state] += w * l_part[th * states + state];
      const float* a = acc_part.data() + (th * states + state) * SV;
      for (int64_t k = 0; k < SV; ++k) so[state * SV + k] += w * a[k];
    }
  }
  return {m_out, l_out, sums};
}

// ----- leading_scores: top-k's candidate scores, straight from the stored codes ---------------------------------
// Scores of the G queries of each head against every stored token's coefficients (the table's components, for
// top-k the leading ones), one query per chunk of `chunk` consecutive tokens: q [B, H, G, chunks, widest] float32
// in table order, q_bias [B, H, G, chunks]; out [B, H * G, N] = q[b, h, g, n / chunk] . c[b, h, n] +
// q_bias[b, h, g, n / chunk]. Coefficients are unpacked a block at a time: no float copy of the middle is made.
torch::Tensor leading_scores(torch::Tensor latents, torch::Tensor head_start, torch::Tensor byte, torch::Tensor shift,
                             torch::Tensor mask, torch::Tensor step, torch::Tensor offset, torch::Tensor wide,
                             torch::Tensor q, torch::Tensor q_bias, int64_t chunk) {
  check_latents(latents);
  const Table t = make_table(head_start, byte, shift, mask, step, offset, wide);
  const int64_t B = latents.size(0), N = latents.size(1), W = latents.size(2), H = t.heads;
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && q.is_contiguous() && q.dim() == 5 && q.size(0) == B &&
              q.size(1) == H && q.size(4) == t.widest, "q: float32 contiguous [B, H, G, chunks, widest]");
  const int64_t G = q.size(2), chunks = q.size(3);
  TORCH_CHECK(chunk > 0 && chunks * chunk >= N, "chunk: ", chunks, " chunks of ", chunk, " do not cover ", N,
              " tokens");
  TORCH_CHECK(q_bias.scalar_type() == torch::kFloat32 && q_bias.is_contiguous() && q_bias.numel() == B * H * G * chunks,
              "q_bias: float32 contiguous [B, H, G, chunks]");
  auto out = torch::empty({B, H * G, N}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  const float* qb = q_bias.data_ptr<float>();
  dispatch_latents(latents, [&](auto* src) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(src)>>;
    over_blocks(src, B, N, W, [&] { return std::vector<float>(BLOCK * t.widest); },
                [&](int64_t b, int64_t n0, int64_t count, const T* block, const uint8_t* pad, std::vector<float>& coef) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t K = t.head_start[h + 1] - t.head_start[h];
        unpack_block(block, W, count, t, h, coef.data(), t.widest, pad);
        for (int64_t g = 0; g < G; ++g) {
          const int64_t row = (b * H + h) * G + g;
          float* scores = o + row * N + n0;
          for (int64_t j = 0; j < count; ++j) {
            const int64_t c = (n0 + j) / chunk;
            scores[j] = dot(qp + (row * chunks + c) * t.widest, coef.data() + j * t.widest, K) + qb[row * chunks + c];
          }
        }
      }
    });
  });
  return out;
}

// ----- encode: coefficients [B, H, N, R] float32 -> fixed-rate codes [B, N, W] ---------------------------------
// Component c (flat index components[c] = h * R + j) gets idx = clamp(floor(x / step + levels / 2), 0, mask)
// (step 0 reads as 1), its bits written from bit `shift` of byte `byte` on (least significant first).
torch::Tensor encode(torch::Tensor coeffs, torch::Tensor head_start, torch::Tensor byte, torch::Tensor shift,
                     torch::Tensor mask, torch::Tensor step, torch::Tensor offset, torch::Tensor wide,
                     torch::Tensor components, int64_t width) {
  TORCH_CHECK(coeffs.scalar_type() == torch::kFloat32 && coeffs.is_contiguous() && coeffs.dim() == 4,
              "coeffs: float32 contiguous [B, H, N, R]");
  TORCH_CHECK(components.scalar_type() == torch::kInt32 && components.is_contiguous(), "components: int32");
  const Table t = make_table(head_start, byte, shift, mask, step, offset, wide);
  const int64_t B = coeffs.size(0), H = coeffs.size(1), N = coeffs.size(2), R = coeffs.size(3);
  const int64_t C = components.numel();
  auto out = torch::zeros({B, N, width}, torch::kUInt8);
  uint8_t* o = out.data_ptr<uint8_t>();
  const float* x = coeffs.data_ptr<float>();
  const int32_t* comp = components.data_ptr<int32_t>();
  at::parallel_for(0, B * N, 256, [&](int64_t begin, int64_t end) {
    for (int64_t bn = begin; bn < end; ++bn) {
      const int64_t b = bn / N, n = bn % N;
      uint8_t* row = o + bn * width;
      for (int64_t c = 0; c < C; ++c) {
        const int64_t h = comp[c] / R, j = comp[c] % R;
        const float value = x[((b * H + h) * N + n) * R + j];
        const float levels = float(t.mask[c]) + 1.f;
        const float size = t.step[c] > 0.f ? t.step[c] : 1.f;
        const float level = std::min(std::max(std::floor(value / size + levels / 2.f), 0.f), levels - 1.f);
        const uint32_t bits = uint32_t(level) << t.shift[c];
        row[t.byte[c]] |= uint8_t(bits & 0xFF);
        if (t.wide[c]) row[t.byte[c] + 1] |= uint8_t(bits >> 8);
      }
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("unpack", &unpack, "stored latents -> coefficients [B, H, N, C_h] in table order");
  m.def("reconstruct", &reconstruct, "stored latents -> vectors [B, H, N, D], rotated by position if rope is given");
  m.def("attend", &attend, "one decode step over the stored middle: running max, sum and value sums");
  m.def("encode", &encode, "coefficients [B, H, N, R] -> fixed-rate codes [B, N, W]");
  m.def("leading_scores", &leading_scores, "one query per chunk of tokens against the stored coefficients");
}
