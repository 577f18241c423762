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
// dotted with the queries (`scores`) or stored (`reconstruct`). Vector code uses GCC vector extensions, so the
// same source builds for AVX-512, AVX2 or plain SSE; gathers use AVX-512 / AVX2 intrinsics where present.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
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
          head_start.numel() - 1, 1};
  for (int64_t h = 0; h < t.heads; ++h) t.widest = std::max<int64_t>(t.widest, t.head_start[h + 1] - t.head_start[h]);
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
      for (; k + 16 <= K; k += 16) {
        const __m512i at = _mm512_loadu_si512(t.byte + first + k);
        const __m512i bits = _mm512_i32gather_epi32(at, row, 1);
        const __m512i v = _mm512_and_si512(_mm512_srlv_epi32(bits, _mm512_loadu_si512(t.shift + first + k)),
                                           _mm512_loadu_si512(t.mask + first + k));
        _mm512_storeu_ps(out + k, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_loadu_ps(t.step + first + k),
                                                  _mm512_loadu_ps(t.offset + first + k)));
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

inline float dot(const float* a, const float* b, int64_t D) {
  int64_t i = 0;
  vf acc{};
  for (; i + VW <= D; i += VW) acc += vload(a + i) * vload(b + i);
  float s = 0.f;
  for (int v = 0; v < VW; ++v) s += acc[v];
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

// Runs `consume(b, h, n0, count, keys)` over every block of tokens and head: keys [count, D] rebuilt (and rotated
// if rope is on). Blocks are split between threads.
template <typename T, typename Consume>
void for_each_block(const T* src, int64_t B, int64_t N, int64_t W, const Table& t, const float* rows,
                    const float* mean, int64_t D, const Rope& rope, Consume&& consume) {
  const int64_t blocks = (N + BLOCK - 1) / BLOCK, H = t.heads;
  const RebuildFn fast = rebuild_for(D);
  at::parallel_for(0, B * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> coef(BLOCK * t.widest), keys(BLOCK * D);
    std::vector<uint8_t> buffer;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / blocks, n0 = (i % blocks) * BLOCK, count = std::min(BLOCK, N - n0);
      const T* block = src + (b * N + n0) * W;
      const uint8_t* pad = padded(block, W, count, buffer);
      for (int64_t h = 0; h < H; ++h) {
        const int32_t first = t.head_start[h], K = t.head_start[h + 1] - first;
        unpack_block(block, W, count, t, h, coef.data(), t.widest, pad);
        for (int64_t j = 0; j < count; j += TB) {
          const int64_t n = std::min<int64_t>(TB, count - j);
          if (fast != nullptr) fast(coef.data() + j * t.widest, t.widest, n, K, rows + first * D, mean + h * D,
                                    keys.data() + j * D);
          else rebuild_any(coef.data() + j * t.widest, t.widest, n, K, rows + first * D, mean + h * D, D,
                           keys.data() + j * D);
        }
        if (rope.on())
          for (int64_t j = 0; j < count; ++j) {
            const int64_t p = rope.positions[b * N + n0 + j];
            TORCH_CHECK(p >= 0 && p < rope.table_rows, "rope: position ", p, " outside the table");
            rotate(keys.data() + j * D, rope.cos + p * rope.width, rope.sin + p * rope.width, rope.rot, rope.width);
          }
        consume(b, h, n0, count, keys.data());
      }
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
    const int64_t blocks = (N + BLOCK - 1) / BLOCK;
    at::parallel_for(0, B * blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<uint8_t> buffer;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / blocks, n0 = (i % blocks) * BLOCK, count = std::min(BLOCK, N - n0);
        const auto* block = src + (b * N + n0) * W;
        const uint8_t* pad = padded(block, W, count, buffer);
        for (int64_t h = 0; h < H; ++h)
          unpack_block(block, W, count, t, h, o + ((b * H + h) * N + n0) * t.widest, t.widest, pad);
      }
    });
  });
  return out;
}

// ----- reconstruct: stored latents -> vectors [B, H, N, D] (rotated by their positions if rope is given) ------
torch::Tensor reconstruct(torch::Tensor latents, torch::Tensor head_start, torch::Tensor byte, torch::Tensor shift,
                          torch::Tensor mask, torch::Tensor step, torch::Tensor offset, torch::Tensor wide,
                          torch::Tensor rows, torch::Tensor mean, torch::Tensor cos, torch::Tensor sin,
                          torch::Tensor positions, int64_t rot, at::ScalarType out_dtype) {
  check_latents(latents);
  const Table t = make_table(head_start, byte, shift, mask, step, offset, wide);
  check_basis(rows, mean, t);
  const Rope rope = make_rope(cos, sin, positions, rot);
  const int64_t B = latents.size(0), N = latents.size(1), W = latents.size(2), H = t.heads, D = rows.size(1);
  auto out = torch::empty({B, H, N, D}, torch::dtype(out_dtype));
  dispatch_latents(latents, [&](auto* src) {
    auto run = [&](auto* o) {
      using Out = std::remove_pointer_t<decltype(o)>;
      for_each_block(src, B, N, W, t, rows.data_ptr<float>(), mean.data_ptr<float>(), D, rope,
                     [&](int64_t b, int64_t h, int64_t n0, int64_t count, const float* keys) {
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

// ----- scores: queries q [B, H, G, D] against every stored token -> [B, H, G, N] float32 -----------------------
// Each key is rebuilt (and rotated by its position if rope is given) and dotted with the G queries of its head.
torch::Tensor scores(torch::Tensor latents, torch::Tensor head_start, torch::Tensor byte, torch::Tensor shift,
                     torch::Tensor mask, torch::Tensor step, torch::Tensor offset, torch::Tensor wide,
                     torch::Tensor rows, torch::Tensor mean, torch::Tensor cos, torch::Tensor sin,
                     torch::Tensor positions, int64_t rot, torch::Tensor q) {
  check_latents(latents);
  const Table t = make_table(head_start, byte, shift, mask, step, offset, wide);
  check_basis(rows, mean, t);
  const Rope rope = make_rope(cos, sin, positions, rot);
  const int64_t B = latents.size(0), N = latents.size(1), W = latents.size(2), H = t.heads, D = rows.size(1);
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && q.is_contiguous() && q.dim() == 4 && q.size(0) == B &&
              q.size(1) == H && q.size(3) == D, "q: float32 contiguous [B, H, G, head_dim]");
  const int64_t G = q.size(2);
  auto out = torch::empty({B, H, G, N}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  dispatch_latents(latents, [&](auto* src) {
    for_each_block(src, B, N, W, t, rows.data_ptr<float>(), mean.data_ptr<float>(), D, rope,
                   [&](int64_t b, int64_t h, int64_t n0, int64_t count, const float* keys) {
                     for (int64_t g = 0; g < G; ++g) {
                       const float* qg = qp + ((b * H + h) * G + g) * D;
                       float* dst = o + ((b * H + h) * G + g) * N + n0;
                       for (int64_t j = 0; j < count; ++j) dst[j] = dot(qg, keys + j * D, D);
                     }
                   });
  });
  return out;
}

// ----- weighted sums: sum_n p[b, h, g, n] c[b, h, n, :] -> [B, H, G, C_h] float32, in table order --------------
torch::Tensor weighted_sums(torch::Tensor latents, torch::Tensor head_start, torch::Tensor byte, torch::Tensor shift,
                            torch::Tensor mask, torch::Tensor step, torch::Tensor offset, torch::Tensor wide,
                            torch::Tensor p) {
  check_latents(latents);
  const Table t = make_table(head_start, byte, shift, mask, step, offset, wide);
  const int64_t B = latents.size(0), N = latents.size(1), W = latents.size(2), H = t.heads;
  TORCH_CHECK(p.scalar_type() == torch::kFloat32 && p.is_contiguous() && p.dim() == 4 && p.size(0) == B &&
              p.size(1) == H && p.size(3) == N, "p: float32 contiguous [B, H, G, tokens]");
  const int64_t G = p.size(2), blocks = (N + BLOCK - 1) / BLOCK, S = t.widest;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks));
  auto partial = torch::zeros({parts, B, H, G, S}, torch::kFloat32);
  float* part = partial.data_ptr<float>();
  const float* pp = p.data_ptr<float>();
  dispatch_latents(latents, [&](auto* src) {
    at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> coef(BLOCK * S);
      std::vector<uint8_t> buffer;
      for (int64_t part_i = begin; part_i < end; ++part_i) {
        float* acc = part + part_i * B * H * G * S;
        for (int64_t i = B * blocks * part_i / parts; i < B * blocks * (part_i + 1) / parts; ++i) {
          const int64_t b = i / blocks, n0 = (i % blocks) * BLOCK, count = std::min(BLOCK, N - n0);
          const auto* block = src + (b * N + n0) * W;
          const uint8_t* pad = padded(block, W, count, buffer);
          for (int64_t h = 0; h < H; ++h) {
            const int32_t K = t.head_start[h + 1] - t.head_start[h];
            unpack_block(block, W, count, t, h, coef.data(), S, pad);
            for (int64_t g = 0; g < G; ++g) {
              float* a = acc + ((b * H + h) * G + g) * S;
              const float* w = pp + ((b * H + h) * G + g) * N + n0;
              for (int64_t j = 0; j < count; ++j) {
                const float wj = w[j];
                const float* c = coef.data() + j * S;
                int32_t k = 0;
                for (; k + VW <= K; k += VW) vstore(a + k, vload(a + k) + splat(wj) * vload(c + k));
                for (; k < K; ++k) a[k] += wj * c[k];
              }
            }
          }
        }
      }
    });
  });
  return partial.sum(0);
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
  m.def("scores", &scores, "queries [B, H, G, D] against every stored token -> [B, H, G, N]");
  m.def("encode", &encode, "coefficients [B, H, N, R] -> fixed-rate codes [B, N, W]");
  m.def("weighted_sums", &weighted_sums, "sum_n p_n c_n over stored tokens -> [B, H, G, C_h] in table order");
}
