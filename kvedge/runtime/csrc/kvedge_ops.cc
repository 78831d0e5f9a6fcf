// kvedge's onnxruntime custom operators (domain "kvedge", CPU): attention over an INT8
// per-token-scaled KV cache and over a 4-bit one with a float window, the side inputs of the "ort" graph's quantized matmuls, and a
// quantized matmul of its own for decode steps.
//
// kvedge.Int8CacheAttention is the INT8-cache counterpart of
// onnxruntime's GroupQueryAttention in the "ort" export variant: one op per layer takes the fused
// QKV projection, applies RoPE, quantizes the new tokens' K and V exactly as kvedge's INT8 cache
// does (per token, per channel group: scale = max(absmax / 127, 2^-14) stored as float16, codes
// = clip(round_half_even(x / scale), -127, 127)), writes them into the cache at each row's
// valid length, and attends each query over the row's dequantized cache, causally: a decode step
// a block of query rows at a time over int8 codes (Attend), a prefill in tiles of query rows
// against blocks of dequantized cache rows with an online softmax (AttendPrefill).
//
// Why a kernel: onnxruntime's own 8-bit GroupQueryAttention cache has static scales only, and
// standard ops dequantize the whole valid cache to float32 every step (more bytes moved than the
// float32 cache itself). Here each KV head's codes are read once per step for all the query heads
// of its group, as int8: 1 byte per element instead of 4.
//
// Inputs (b = batch, s = new tokens, L = cache positions, d = head_dim, G = d / group_size):
//   0 qkv            float [b, s, (heads + 2 kv_heads) d], Q (scaled by 1/sqrt(d)), K, V unrotated
//   1 past_lengths   int64 [b], valid cache length of each row; row r's new tokens take
//                    positions past_lengths[r] .. past_lengths[r] + s - 1
//   2, 3 K, V codes  int8 [b, kv_heads, L, d]
//   4, 5 K, V scales float16 [b, kv_heads, L, G]
//   6, 7 cos, sin    float [max_positions, d / 2] (rotate_half convention)
// Outputs:
//   0 attention      float [b, s, heads d]
//   1..4             the cache tensors of inputs 2..5, same shapes, with the new tokens written.
//                    Bind each to the same buffer as its input (in place); otherwise the input is
//                    copied first.
// Attributes: num_heads, kv_num_heads (int); local_window_size (int, optional, default -1: none):
// a sliding window as GroupQueryAttention's, where the query at position q attends to the keys at
// q - local_window_size + 1 .. q only (Gemma 3's local layers; the cache stays full length);
// decode_steps (int, optional, default 1): a call of s <= decode_steps new tokens per row attends
// each of them exactly as a one-token call at its position would (one after the other: the same
// cache blocks, the same sums in the same order, so to the bit), where a longer call goes through
// the prefill tiles. A speculative verify of s tokens then gives the logits of s decode steps.
//
// kvedge.Int4CacheAttention is its 4-bit counterpart, the form of the 4-bit cache study
// (bench/results/2026-12-07-2e022be-kv-int4-study, "The best scheme measured"); kvedge/kv4.py
// states the arithmetic and is its numpy twin. Per KV head, head_dim d a power of 2 (16 .. 256)
// and H the orthonormal d-point Hadamard matrix: kr = RoPE(k) H, vr = v H, qr = RoPE(q) H. Keys
// at key_bits 5 (uniform levels u - 15.5, u in 0..31, one float16 scale a token and head searched
// over 24 multipliers of absmax / 15.5 for the least squared error) or 8 (u - 127.5, a float16
// absmax scale per 32 channels); values 4-bit Lloyd-Max levels for N(0, 1) with a searched
// scale. The query at position p attends to keys j <= p: as float rows (kr, vr) where j >= p -
// window, as codes before; output = softmax(qr . k_j) v_j H^T. A decode step reads the packed
// codes (levels through vector shifts and a 16-entry table lookup), a prefill goes through the
// same tiles as Int8CacheAttention's, the codes and the float rows as two passes of one online
// softmax.
// Inputs (b, s, L, d as above; kb = 5d/8 (key_bits 5) or d (8); kg = 1 (5) or d / min(32, d) (8);
// R = ring positions):
//   0 qkv, 1 past_lengths   as Int8CacheAttention's
//   2 K codes   uint8 [b, kv_heads, L, kb]: 5 bits: d/2 bytes of the low nibbles (byte i = code[2i]
//               | code[2i+1] << 4), then d/8 bytes, bit t of byte i bit 4 of code[8i+t]; 8 bits: u
//   3 K scales  float16 [b, kv_heads, L, kg]
//   4 V codes   uint8 [b, kv_heads, L, d / 2], nibbles as K's
//   5 V scales  float16 [b, kv_heads, L, 1]
//   6, 7 K, V window  float [b, kv_heads, R, d]: kr and vr of recent positions, position p at p % R
//   8, 9 cos, sin     as Int8CacheAttention's
// Outputs: 0 attention float [b, s, heads d]; 1..6 the state of inputs 2..7 with the new tokens'
// codes written at their positions and the last min(s, R) new tokens' kr, vr in their ring slots
// (after the call's attention read the old ones); in place as Int8CacheAttention's.
// Attributes: num_heads, kv_num_heads, key_bits (5 or 8, required); window (default 32, 0 .. R:
// the past positions attended as float rows); local_window_size and decode_steps as
// Int8CacheAttention's.
//
// kvedge.SideInputs feeds a quantized matmul of an "ort" graph (kvedge/export/quantize.py): with
// blocked weights w_hat = q * scale + offset and kept float32 input channels,
//   x @ w = (x * mask) @ (q * scale) + [block_sums(x) | x[kept]] @ [offset ; kept rows]
// where onnxruntime's MatMulNBits computes the first product and a MatMul the second. This op
// makes both inputs in one pass over x, where standard ops would multiply x by a 0/1 mask and by
// a [K, K / block + kept] float32 0/1 matrix (block-sum columns, then one column per kept channel):
// a decode step read that matrix, K (K / block + kept) floats per matmul, to add up and gather a
// row of K.
// Inputs:
//   0 x       float [..., K]
//   1 kept    int64 [kept], the float32 input channels (each in [0, K); may be empty)
// Outputs:
//   0 side    float [..., K / block_size + kept]: the sums of x over each block of block_size
//             consecutive channels (none when block_size is 0), then x at each kept channel
//   1 masked  float [..., K], optional: x with the kept channels zeroed (what MatMulNBits reads)
// Attribute: block_size (int, >= 0; 0: the weight has no block offsets, side holds x[kept] only).
//
// kvedge.QuantMatMul is a decode step's matmul (a few rows) over a blocked 4-/8-bit weight, its
// block minimums and kept float input channels fused in (kvedge/export/quantize.py:
// QuantMatMulWeight, pack_quant_matmul): per block of block_size input channels and output column,
// w_hat = scale q + offset with q = u - zc, u the stored code (0 .. 2^bits - 1), zc = 2^(bits-1).
// A step reads each matrix front to back once, as one stream (codes, float16 scales, minimums and
// the kept channels' rows together), where MatMulNBits + SideInputs + MatMul read float32 block
// offsets and kept rows besides. The integer dot is centered (q, not u) so that the int8
// activations' rounding error is MatMulNBits' own: it multiplies q scale, not u scale.
// Inputs:
//   0 x          float [..., K] (M rows: the product of the leading dims, any number)
//   1 weights    uint8 [N / 64, tile_bytes]: per tile of 64 output columns, one contiguous run of
//                its K / block_size records, block after block, then its kept channels' float16
//                rows (kept x 64 float16, in kept order: w[kept] minus the offset of the kept
//                channel's block, per column), tile_bytes = (K / block_size) record + 128 kept.
//                A record is the codes of 4 groups of 16 columns, block_size bits / 32 vectors of
//                64 bytes each (in vector v of group g, byte 4 c + t holds column 16 g + c's codes:
//                4 bits: u[8v + t] in the low nibble and u[8v + 4 + t] in the high one; 8 bits:
//                u[4v + t]: one dword per column, vpdpbusd's operand), then the 64 columns' float16
//                scales, then (attribute minimums = 1) their float16 minimums (minimum = offset -
//                zc scale, the value of u = 0)
//   2 kept       int64 [kept], optional (absent: none): distinct ascending input channels in [0, K)
//                kept in float
// Output: y float [..., N], N = 64 weights.shape[0].
// Attributes: bits (4 or 8), block_size (16, 32, 64, 128 or 256), minimums (0 or 1).
// Numerics, per row and block b: x_masked = x with the kept channels 0; amax = max |x_masked| over
// the block; xs = amax / 127; xq = round_half_even(x_masked (127 / amax)) as int8 (0 where amax is
// 0: MatMulNBits' accuracy_level 4 activations); bsum = the float32 sum of x (kept included) over b;
//   acc_b[n] = sum over k in b of xq[k] u[k, n] - zc sum over k in b of xq[k]   (exact, int32)
//   offset[b, n] = minimum[b, n] + zc scale[b, n] in float32 (0 without minimums)
//   y[n] = sum_b (scale[b, n] (xs[b] acc_b[n]) + offset[b, n] bsum[b]) + sum_j x[kept_j] kept_row_j[n]
// the float sums in any order (1e-5 of max |y| from the float64 values).

#include <onnxruntime_c_api.h>

#if defined(__AVX2__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <type_traits>
#include <vector>

namespace {

#if defined(__aarch64__) || defined(__arm__)
typedef __fp16 half_t;
#else
typedef _Float16 half_t;
#endif
static_assert(sizeof(half_t) == 2, "float16 storage");

constexpr int kMinApiVersion = 17;  // KernelContext_ParallelFor (onnxruntime >= 1.17)
constexpr float kQmax = 127.0f;
constexpr float kScaleFloor = 6.103515625e-05f;  // 2^-14: the smallest normal float16
constexpr int kQueryBlock = 12;                   // decode: query rows sharing one pass over the cache
constexpr int kTileRows = 48;     // prefill: query rows (whole tokens x a KV group's heads) per tile
constexpr int kKeyBlock = 64;     // prefill: cache positions dequantized at a time for a tile
constexpr int kMaxRows = kTileRows > kQueryBlock ? kTileRows : kQueryBlock;
constexpr int64_t kSplitKeys = 256;  // decode: fewest cache positions in a block of a split cache
constexpr int64_t kSplitItems = 24;  // decode: work items a long enough cache is split into, at least
constexpr int64_t kPrefetchKeys = 64;  // decode: cached positions per KV head asked of memory up front

const OrtApi* g_api = nullptr;

struct Tensor {
  void* data = nullptr;
  std::vector<int64_t> shape;
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  int64_t size() const {
    int64_t n = 1;
    for (int64_t v : shape) n *= v;
    return n;
  }
};

OrtStatus* Fail(const std::string& message, const char* op = "Int8CacheAttention") {
  return g_api->CreateStatus(ORT_INVALID_ARGUMENT, ("kvedge." + std::string(op) + ": " + message).c_str());
}

#define KV_RETURN_IF_ERROR(expr)            \
  do {                                      \
    OrtStatus* _status = (expr);            \
    if (_status != nullptr) return _status; \
  } while (0)

OrtStatus* Describe(const OrtValue* value, Tensor* out) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  KV_RETURN_IF_ERROR(g_api->GetTensorTypeAndShape(value, &info));
  size_t rank = 0;
  OrtStatus* status = g_api->GetDimensionsCount(info, &rank);
  if (status == nullptr) {
    out->shape.resize(rank);
    status = g_api->GetDimensions(info, out->shape.data(), rank);
  }
  if (status == nullptr) status = g_api->GetTensorElementType(info, &out->type);
  g_api->ReleaseTensorTypeAndShapeInfo(info);
  if (status != nullptr) return status;
  return g_api->GetTensorMutableData(const_cast<OrtValue*>(value), &out->data);
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

// The attributes both cache attentions take (`ReadAttention`).
struct AttentionAttributes {
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t window = -1;  // local_window_size: keys per query, itself included; -1: all before it
  int64_t decode_steps = 1;  // calls of up to this many new tokens attend them one at a time
};

struct Kernel : AttentionAttributes {
  OrtStatus* Compute(OrtKernelContext* context);
};

// The new tokens' K or V of one head, rotated or not, quantized into one cache row.
void QuantizeRow(const float* x, int64_t d, int64_t group_size, int8_t* codes, half_t* scales) {
  for (int64_t g0 = 0, g = 0; g0 < d; g0 += group_size, ++g) {
    float absmax = 0.0f;
    for (int64_t c = g0; c < g0 + group_size; ++c) absmax = std::max(absmax, std::fabs(x[c]));
    const half_t stored16 = static_cast<half_t>(std::max(absmax / kQmax, kScaleFloor));
    const float stored = static_cast<float>(stored16);
    scales[g] = stored16;
    for (int64_t c = g0; c < g0 + group_size; ++c) {
      const float level = std::nearbyint(x[c] / stored);  // the default rounding: half to even
      codes[c] = static_cast<int8_t>(std::min(kQmax, std::max(-kQmax, level)));
    }
  }
}

void Rotate(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    out[i] = x[i] * cos[i] - x[i + half] * sin[i];
    out[i + half] = x[i + half] * cos[i] + x[i] * sin[i];
  }
}

// ---- the attention arithmetic, vectorized with GCC/Clang vector extensions (AVX2 or NEON) ----

typedef float v8f __attribute__((vector_size(32)));
typedef int8_t v8b __attribute__((vector_size(8)));
typedef int32_t v8i __attribute__((vector_size(32)));
constexpr int64_t kPosBlock = 32;  // cache rows converted to float at a time (L1-resident)

inline v8f Load(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void Store(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }
inline v8f Splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }
inline v8f Codes(const int8_t* p) {  // 8 int8 codes as floats
#if defined(__AVX2__)
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  v8f v;
  std::memcpy(&v, &f, sizeof v);
  return v;
#elif defined(__ARM_NEON)
  const int16x8_t w = vmovl_s8(vld1_s8(p));
  const float32x4_t lo = vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), hi = vcvtq_f32_s32(vmovl_s16(vget_high_s16(w)));
  v8f v;
  std::memcpy(&v, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof lo, &hi, sizeof hi);
  return v;
#else
  v8b b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, v8f);
#endif
}
inline float Sum(v8f v) {
  typedef float v4f __attribute__((vector_size(16)));
  v4f lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  lo += hi;
  return (lo[0] + lo[2]) + (lo[1] + lo[3]);
}

// The sums of 8 vectors, as one vector: s[j] = Sum(t[j]).
inline v8f Sum8(const v8f* t) {
#if defined(__AVX2__)
  __m256 m[8];
  std::memcpy(m, t, sizeof m);
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(m[0], m[1]), _mm256_hadd_ps(m[2], m[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(m[4], m[5]), _mm256_hadd_ps(m[6], m[7]));
  const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  v8f v;
  std::memcpy(&v, &sums, sizeof v);
  return v;
#else
  v8f v;
  for (int j = 0; j < 8; ++j) v[j] = Sum(t[j]);
  return v;
#endif
}

// e^x for x <= 0 (scores minus their maximum): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p of
// degree 6 (relative error < 2e-7); below -87.3 the result is 0, as in float32.
template <typename F>  // a float vector type: v8f, or vw for the prefill tiles
inline F Exp(F x) {
  typedef int32_t I __attribute__((vector_size(sizeof(F))));
  const F n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  // round(x / ln2)
  const F r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  F p = r * (1.0f / 720) + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  I bits = (__builtin_convertvector(n, I) + 127) << 23;
  F scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.33654f ? F{} : p * scale;
}

struct Block {
  int64_t n_rows = 0;
  int64_t first[kMaxRows] = {};  // row i attends to cache positions [first[i], limit[i]): a
  int64_t limit[kMaxRows];       // sliding window starts past 0 (first[i] >= limit[i]: none)
  float* out[kMaxRows];      // where row i's context vector goes
  const float* q = nullptr;  // [n_rows, d] rotated queries
  float* scores = nullptr;   // [n_rows, stride] (the decode path's)
  int64_t stride = 0;
  const int8_t* k_codes = nullptr;  // this KV head's cache: [L, d] codes, [L, groups] scales
  const int8_t* v_codes = nullptr;
  const half_t* k_scales = nullptr;
  const half_t* v_scales = nullptr;
  int64_t groups = 0;
  // Decode over one block of a split cache (Work::SplitKeys): where set, row i's softmax is left
  // unnormalized: top[i] = its largest score in the block (-inf with no valid position), sum[i] =
  // the sum of e^(score - top[i]), out[i] = the sum of e^(score - top[i]) x V; Work::Combine
  // merges the blocks. Unset: out[i] is the attention itself.
  float* top = nullptr;  // [n_rows]
  float* sum = nullptr;  // [n_rows]
};

// A cache's rows as the attention paths read them: Row<D>(p, levels, factor) writes position p's
// D levels (its codes as floats, before any scale) and its groups' scales; level x scale is the
// dequantized value, exactly, in float32.
struct Int8Rows {  // int8 codes [L, D], float16 scales [L, groups]
  const int8_t* codes;
  const half_t* scales;
  int64_t groups;
  template <int D>
  void Row(int64_t p, float* levels, float* factor) const {
    for (int v = 0; v < D / 8; ++v) Store(levels + v * 8, Codes(codes + p * D + v * 8));
    for (int64_t g = 0; g < groups; ++g) factor[g] = static_cast<float>(scales[p * groups + g]);
  }
};

// Decode: the scores of row i's positions [from[i], to[i]) (cache positions of the block) into
// b.scores, the rows' K read through `keys` (GS channels a scale) a kPosBlock of positions at a
// time into buf: scores[i, p] = sum over groups g of scale[p, g] * (q_i . levels[p]) over g's
// channels.
template <int D, int GS, class Rows>
void SegmentScores(const Block& b, const int64_t* from, const int64_t* to, const Rows& keys, float* buf) {
  constexpr int V = D / 8, groups = D / GS, per_group = GS / 8;  // vectors per row, per group
  int64_t earliest = INT64_MAX, longest = 0;  // positions outside every row's range are never read
  for (int64_t i = 0; i < b.n_rows; ++i) {
    if (from[i] >= to[i]) continue;
    earliest = std::min(earliest, from[i]);
    longest = std::max(longest, to[i]);
  }
  float factor[kPosBlock * groups];  // a block's scales as floats, converted once for all its rows
  for (int64_t p0 = earliest; p0 < longest; p0 += kPosBlock) {
    const int64_t np = std::min(kPosBlock, longest - p0);
    for (int64_t p = 0; p < np; ++p) keys.template Row<D>(p0 + p, buf + p * D, factor + p * groups);
    for (int64_t i = 0; i < b.n_rows; ++i) {
      v8f q[V];
      for (int v = 0; v < V; ++v) q[v] = Load(b.q + i * D + v * 8);
      float* s = b.scores + i * b.stride + p0;
      const int64_t valid = std::min(np, to[i] - p0);
      auto dot = [&](int64_t p) {  // q_i . K[p0 + p], scaled per group, as 8 partial sums
        const float* k = buf + p * D;
        const float* scale = factor + p * groups;
        v8f total{};
        for (int g = 0; g < groups; ++g) {
          v8f acc{};
          for (int v = g * per_group; v < (g + 1) * per_group; ++v) acc += q[v] * Load(k + v * 8);
          total += acc * scale[g];
        }
        return total;
      };
      int64_t p = std::max<int64_t>(from[i] - p0, 0);
      for (; p + 8 <= valid; p += 8) {  // 8 positions' sums reduced together
        v8f t[8];
        for (int j = 0; j < 8; ++j) t[j] = dot(p + j);
        Store(s + p, Sum8(t));
      }
      for (; p < valid; ++p) s[p] = Sum(dot(p));
    }
  }
}

// Decode: softmax over each row's scores at [first, limit); left unnormalized where b.top is set.
void SoftmaxRows(const Block& b) {
  for (int64_t i = 0; i < b.n_rows; ++i) {
    float* s = b.scores + i * b.stride;
    const int64_t n = b.limit[i];
    // the largest score, 8 positions at a time (a maximum does not depend on the order)
    v8f tops = Splat(-INFINITY);
    int64_t p = b.first[i];
    for (; p + 8 <= n; p += 8) {
      const v8f x = Load(s + p);
      tops = tops < x ? x : tops;
    }
    float top = -INFINITY;
    for (int j = 0; j < 8; ++j) top = std::max(top, tops[j]);
    for (; p < n; ++p) top = std::max(top, s[p]);
    v8f sum{};
    p = b.first[i];
    for (; p + 8 <= n; p += 8) {
      const v8f e = Exp(Load(s + p) - top);
      Store(s + p, e);
      sum += e;
    }
    float tail = 0.0f;
    for (; p < n; ++p) tail += (s[p] = std::exp(s[p] - top));
    if (b.top != nullptr) {
      b.top[i] = top;
      b.sum[i] = Sum(sum) + tail;
      continue;
    }
    const float inv = 1.0f / (Sum(sum) + tail);
    for (p = b.first[i]; p < n; ++p) s[p] *= inv;
  }
}

// Decode: acc_i += sum over row i's positions [from[i], to[i]) of probs[i, p] * scale[p, g] *
// levels_v[p] (channels of group g), V read through `values`.
template <int D, int GS, class Rows>
void SegmentValues(const Block& b, const int64_t* from, const int64_t* to, const Rows& values, float* buf,
                   v8f (*acc)[D / 8]) {
  constexpr int V = D / 8, groups = D / GS, per_group = GS / 8;
  int64_t earliest = INT64_MAX, longest = 0;
  for (int64_t i = 0; i < b.n_rows; ++i) {
    if (from[i] >= to[i]) continue;
    earliest = std::min(earliest, from[i]);
    longest = std::max(longest, to[i]);
  }
  float factor[kPosBlock * groups];
  for (int64_t p0 = earliest; p0 < longest; p0 += kPosBlock) {
    const int64_t np = std::min(kPosBlock, longest - p0);
    for (int64_t p = 0; p < np; ++p) values.template Row<D>(p0 + p, buf + p * D, factor + p * groups);
    for (int64_t i = 0; i < b.n_rows; ++i) {
      const float* prob = b.scores + i * b.stride + p0;
      const int64_t valid = std::min(np, to[i] - p0);
      v8f a[V];
      for (int v = 0; v < V; ++v) a[v] = acc[i][v];
      for (int64_t p = std::max<int64_t>(from[i] - p0, 0); p < valid; ++p) {
        const float* val = buf + p * D;
        const float* scale = factor + p * groups;
        for (int g = 0; g < groups; ++g) {
          const float w = prob[p] * scale[g];
          for (int v = g * per_group; v < (g + 1) * per_group; ++v) a[v] += w * Load(val + v * 8);
        }
      }
      for (int v = 0; v < V; ++v) acc[i][v] = a[v];
    }
  }
}

template <int D, int GS>  // head_dim, channels per scale group (both multiples of 8)
void AttendD(const Block& b, std::vector<float>* scratch) {
  scratch->resize(kPosBlock * D);
  float* buf = scratch->data();
  SegmentScores<D, GS>(b, b.first, b.limit, Int8Rows{b.k_codes, b.k_scales, b.groups}, buf);
  SoftmaxRows(b);
  v8f acc[kMaxRows][D / 8] = {};
  SegmentValues<D, GS>(b, b.first, b.limit, Int8Rows{b.v_codes, b.v_scales, b.groups}, buf, acc);
  for (int64_t i = 0; i < b.n_rows; ++i)
    for (int v = 0; v < D / 8; ++v) Store(b.out[i] + v * 8, acc[i][v]);
}

// Prefill: a tile of query rows (whole tokens x the heads of one KV group) against blocks of KB
// cache positions. Each block's K and V codes are dequantized once, scales folded in (code x
// float16 scale is exact in float32), and serve every row of the tile through two small matrix
// products with an online softmax between them: S = K Q^T, P = e^(S - m), O = O c + P^T V, where
// m is a row's running maximum and c = e^(m_before - m) rescales what was summed under the old one.
// Vectors are as wide as the CPU's (vw: 16 floats with AVX-512, else 8); register tiles are sized
// to its registers.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kScoreRowVectors = 3, kScorePositions = 6;  // S tile: 48 rows x 6 positions
constexpr int kOutRows = 8;                               // O tile: 8 rows x 32 channels
#elif defined(__AVX2__) || defined(__ARM_NEON)
constexpr int kLanes = 8;
constexpr int kScoreRowVectors = 2, kScorePositions = 6;  // S tile: 16 rows x 6 positions
constexpr int kOutRows = 6;                               // O tile: 6 rows x 16 channels
#else  // 16 registers of 4 floats (x86-64 without AVX): smaller tiles, or they spill
constexpr int kLanes = 8;
constexpr int kScoreRowVectors = 1, kScorePositions = 4;  // S tile: 8 rows x 4 positions
constexpr int kOutRows = 2;                               // O tile: 2 rows x 16 channels
#endif
typedef float vw __attribute__((vector_size(kLanes * sizeof(float))));
inline vw LoadW(const float* p) {
  vw v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void StoreW(float* p, vw v) { std::memcpy(p, &v, sizeof v); }
inline vw SplatW(float x) {
  vw v;
  for (int i = 0; i < kLanes; ++i) v[i] = x;
  return v;
}

// A tile's running state: its queries (transposed), the running maximum m, sum l and
// unnormalized output O of each row, and room for one block of dequantized K and V. Pass() runs
// the rows over blocks of cache positions, each row over its own [first, limit), from a source
// that fills kf and vf with a block's dequantized K and V rows (fill(p0, np, kf, vf)); a cache
// read as two sources (kvedge.Int4CacheAttention: codes, then a float window) is two passes
// over the same state. Finish() writes O / l.
template <int D, int KB>
struct Tile {
  static constexpr int strip = kScoreRowVectors * kLanes, pt = kScorePositions, cw = 2 * kLanes;
  static constexpr int R = (kMaxRows + strip - 1) / strip * strip;  // row capacity: whole S strips
  static_assert(R % kOutRows == 0 && D % cw == 0, "register tiles fit the tile");
  static constexpr int kChannelChunk = 32;
  static constexpr int KP = (KB + pt - 1) / pt * pt;  // K rows, padded to whole S tiles
  int64_t n, n_strips, n_vec;
  float *qt, *kf, *vf, *st, *o, *m, *l, *lo, *lim, *corr;

  Tile(const float* q, int64_t n_rows, std::vector<float>* scratch)
      : n(n_rows), n_strips((n + strip - 1) / strip * strip), n_vec((n + kLanes - 1) / kLanes * kLanes) {
    scratch->resize(D * R + (KP + KB) * D + KP * R + R * D + 5 * R);
    qt = scratch->data();  // [D, R] queries, transposed
    kf = qt + D * R;       // [KP, D] dequantized K of the block
    vf = kf + KP * D;      // [KB, D] dequantized V
    st = vf + KB * D;      // [KP, R] scores, then probabilities
    o = st + KP * R;       // [R, D] unnormalized outputs
    m = o + R * D, l = m + R, lo = l + R, lim = lo + R, corr = lim + R;  // [R] each
    for (int64_t i = 0; i < R; ++i) {  // padding rows: zero queries, no position valid
      for (int c = 0; c < D; ++c) qt[c * R + i] = i < n ? q[i * D + c] : 0.0f;
      m[i] = -INFINITY;
      l[i] = corr[i] = 0.0f;
    }
    std::fill(o, o + R * D, 0.0f);
    std::fill(st, st + KP * R, 0.0f);
  }

  template <class Fill>
  void Pass(const int64_t* first, const int64_t* limit, Fill fill) {
    int64_t earliest = INT64_MAX, longest = 0;  // blocks before every row's range are skipped
    for (int64_t i = 0; i < R; ++i) {
      const bool valid = i < n && first[i] < limit[i];
      lo[i] = valid ? static_cast<float>(first[i]) : 0.0f;
      lim[i] = valid ? static_cast<float>(limit[i]) : 0.0f;
      if (valid) {
        earliest = std::min(earliest, first[i]);
        longest = std::max(longest, limit[i]);
      }
    }
    const vw minus_inf = SplatW(-INFINITY);
    for (int64_t p0 = earliest; p0 < longest; p0 += KB) {
      const int64_t np = std::min<int64_t>(KB, longest - p0), np_tiles = (np + pt - 1) / pt * pt;
      fill(p0, np, kf, vf);
      std::fill(kf + np * D, kf + np_tiles * D, 0.0f);
      // S = K Q^T, a strip of rows x pt positions in registers; sums of at most 32 channels added
      // up (as short as the decode path's, which the float rounding of long head_dims shows)
      for (int64_t i0 = 0; i0 < n_strips; i0 += strip) {
        for (int64_t p = 0; p < np_tiles; p += pt) {
          for (int c0 = 0; c0 < D; c0 += kChannelChunk) {
            vw a[pt][kScoreRowVectors] = {};
            for (int c = c0; c < std::min(D, c0 + kChannelChunk); ++c) {
              vw q[kScoreRowVectors];
              for (int u = 0; u < kScoreRowVectors; ++u) q[u] = LoadW(qt + c * R + i0 + u * kLanes);
              for (int j = 0; j < pt; ++j) {
                const float k = kf[(p + j) * D + c];
                for (int u = 0; u < kScoreRowVectors; ++u) a[j][u] += k * q[u];
              }
            }
            for (int j = 0; j < pt; ++j) {
              for (int u = 0; u < kScoreRowVectors; ++u) {
                float* s = st + (p + j) * R + i0 + u * kLanes;
                StoreW(s, c0 ? LoadW(s) + a[j][u] : a[j][u]);
              }
            }
          }
        }
      }
      // online softmax, a vector of rows at a time: positions before a row's first or at or past its
      // limit are masked out
      for (int64_t i0 = 0; i0 < n_vec; i0 += kLanes) {
        const vw start = LoadW(lo + i0), end = LoadW(lim + i0), before = LoadW(m + i0);
        vw top = before;
        for (int64_t p = 0; p < np; ++p) {
          vw s = LoadW(st + p * R + i0);
          const vw at = SplatW(static_cast<float>(p0 + p));
          s = (at >= start) & (at < end) ? s : minus_inf;
          StoreW(st + p * R + i0, s);
          top = s > top ? s : top;
        }
        const vw base = top == minus_inf ? vw{} : top;  // a row with nothing valid yet keeps zeros
        vw sum{};
        for (int64_t p = 0; p < np; ++p) {
          const vw e = Exp(LoadW(st + p * R + i0) - base);
          StoreW(st + p * R + i0, e);
          sum += e;
        }
        const vw c = Exp(before - base);
        StoreW(corr + i0, c);
        StoreW(m + i0, top);
        StoreW(l + i0, LoadW(l + i0) * c + sum);
      }
      // O = O c + P^T V, kOutRows rows x 2 vectors of channels in registers
      for (int64_t i0 = 0; i0 < n; i0 += kOutRows) {
        for (int c0 = 0; c0 < D; c0 += cw) {
          vw a[kOutRows][2];
          for (int r = 0; r < kOutRows; ++r) {
            a[r][0] = LoadW(o + (i0 + r) * D + c0) * corr[i0 + r];
            a[r][1] = LoadW(o + (i0 + r) * D + c0 + kLanes) * corr[i0 + r];
          }
          for (int64_t p = 0; p < np; ++p) {
            const vw v0 = LoadW(vf + p * D + c0), v1 = LoadW(vf + p * D + c0 + kLanes);
            for (int r = 0; r < kOutRows; ++r) {
              const float w = st[p * R + i0 + r];
              a[r][0] += w * v0;
              a[r][1] += w * v1;
            }
          }
          for (int r = 0; r < kOutRows; ++r) {
            StoreW(o + (i0 + r) * D + c0, a[r][0]);
            StoreW(o + (i0 + r) * D + c0 + kLanes, a[r][1]);
          }
        }
      }
    }
  }

  void Finish(float* const* out) const {
    for (int64_t i = 0; i < n; ++i) {
      const float inv = 1.0f / l[i];
      for (int v = 0; v < D / 8; ++v) Store(out[i] + v * 8, Load(o + i * D + v * 8) * inv);
    }
  }
};

// A fill for Tile::Pass: positions p0 .. p0 + np - 1 of `keys` and `values` (GS channels a scale,
// D / GS scales a row), dequantized: level x scale.
template <int D, int KGS, int VGS, class KRows, class VRows>
auto Dequantized(const KRows& keys, const VRows& values) {
  static_assert(KGS % 8 == 0 && VGS % 8 == 0, "whole vectors a scale group");
  return [&keys, &values](int64_t p0, int64_t np, float* kf, float* vf) {
    float factor[D / 8];
    for (int64_t p = 0; p < np; ++p) {
      keys.template Row<D>(p0 + p, kf + p * D, factor);
      for (int v = 0; v < D / 8; ++v) Store(kf + p * D + v * 8, Load(kf + p * D + v * 8) * factor[v * 8 / KGS]);
      values.template Row<D>(p0 + p, vf + p * D, factor);
      for (int v = 0; v < D / 8; ++v) Store(vf + p * D + v * 8, Load(vf + p * D + v * 8) * factor[v * 8 / VGS]);
    }
  };
}

template <int D, int GS, int KB>
void AttendTiled(const Block& b, std::vector<float>* scratch) {
  Tile<D, KB> tile(b.q, b.n_rows, scratch);
  const Int8Rows keys{b.k_codes, b.k_scales, b.groups}, values{b.v_codes, b.v_scales, b.groups};
  tile.Pass(b.first, b.limit, Dequantized<D, GS, GS>(keys, values));
  tile.Finish(b.out);
}

// Any head_dim: the same arithmetic, one channel at a time.
void AttendAny(int64_t d, const Block& b) {
  const int64_t group_size = d / b.groups;
  for (int64_t i = 0; i < b.n_rows; ++i) {
    const float* q = b.q + i * d;
    float* s = b.scores + i * b.stride;
    const int64_t n = b.limit[i];
    float top = -INFINITY;
    for (int64_t p = b.first[i]; p < n; ++p) {
      float total = 0.0f;
      for (int64_t g = 0; g < b.groups; ++g) {
        float dot = 0.0f;
        for (int64_t c = g * group_size; c < (g + 1) * group_size; ++c) dot += q[c] * b.k_codes[p * d + c];
        total += dot * static_cast<float>(b.k_scales[p * b.groups + g]);
      }
      top = std::max(top, s[p] = total);
    }
    float sum = 0.0f;
    for (int64_t p = b.first[i]; p < n; ++p) sum += (s[p] = std::exp(s[p] - top));
    if (b.top != nullptr) {
      b.top[i] = top;
      b.sum[i] = sum;
    }
    const float norm = b.top != nullptr ? 1.0f : sum;  // a block of a split cache: left unnormalized
    float* out = b.out[i];
    std::fill(out, out + d, 0.0f);
    for (int64_t p = b.first[i]; p < n; ++p) {
      for (int64_t c = 0; c < d; ++c)
        out[c] += s[p] / norm * static_cast<float>(b.v_scales[p * b.groups + c / group_size]) * b.v_codes[p * d + c];
    }
  }
}

template <int D>
bool AttendGrouped(int64_t group_size, const Block& b, std::vector<float>* scratch) {
  switch (group_size) {
    case 16: return AttendD<D, 16>(b, scratch), true;
    case 32: return AttendD<D, 32>(b, scratch), true;
    case 64: if constexpr (D % 64 == 0) return AttendD<D, 64>(b, scratch), true; break;
    case 128: if constexpr (D % 128 == 0) return AttendD<D, 128>(b, scratch), true; break;
  }
  return false;
}

// The vectorized path for the usual head sizes and every cache group size; otherwise AttendAny.
void Attend(int64_t d, const Block& b, std::vector<float>* scratch) {
  const int64_t gs = d / b.groups;
  bool done = false;
  switch (d) {
    case 32: done = AttendGrouped<32>(gs, b, scratch); break;
    case 64: done = AttendGrouped<64>(gs, b, scratch); break;
    case 96: done = AttendGrouped<96>(gs, b, scratch); break;
    case 128: done = AttendGrouped<128>(gs, b, scratch); break;
    case 256: done = AttendGrouped<256>(gs, b, scratch); break;
  }
  if (!done) AttendAny(d, b);
}

// The tiled prefill path for the usual head sizes and cache group sizes (KB: cache positions per
// block, a parameter for the self-test); false where only the row path covers them.
template <int KB = kKeyBlock>
bool AttendPrefill(int64_t d, const Block& b, std::vector<float>* scratch) {
  auto grouped = [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    switch (d / b.groups) {
      case 16: return AttendTiled<D, 16, KB>(b, scratch), true;
      case 32: return AttendTiled<D, 32, KB>(b, scratch), true;
      case 64: if constexpr (D % 64 == 0) return AttendTiled<D, 64, KB>(b, scratch), true; break;
      case 128: if constexpr (D % 128 == 0) return AttendTiled<D, 128, KB>(b, scratch), true; break;
    }
    return false;
  };
  switch (d) {
    case 32: return grouped(std::integral_constant<int, 32>{});
    case 64: return grouped(std::integral_constant<int, 64>{});
    case 96: return grouped(std::integral_constant<int, 96>{});
    case 128: return grouped(std::integral_constant<int, 128>{});
    case 256: return grouped(std::integral_constant<int, 256>{});
  }
  return false;
}

// Everything a work item of the attention needs (read-only while the items run).
struct Work {
  const float* x;
  float* y;
  const int64_t* past;
  const float *cos, *sin;
  const int8_t *k_codes, *v_codes;
  const half_t *k_scales, *v_scales;
  int64_t batch, seq, heads, kv_heads, d, groups, cache_len, width;
  int64_t row_tokens = 0;      // tokens of a row in x and y (0: seq); more when a call is attended
                               // a token at a time (Kernel::decode_steps), x and y from that token
  int64_t window = -1;         // Kernel::window
  bool tiled = false;          // prefill tiles (AttendPrefill) rather than decode blocks (Attend)
  int64_t rows_per_item = 0;   // query rows of one (row, KV head) per query block
  int64_t blocks = 0;          // query blocks per (row, KV head)
  int64_t origin = 0;          // the first cache position any row attends to (past 0 with a window)
  int64_t longest = 0;         // the end of the cache positions any row attends to
  int64_t splits = 1;          // decode: cache blocks per query block, each a work item of its own
  int64_t span = 0;            // decode: cache positions per cache block
  float* partial = nullptr;    // with splits > 1: per item, [rows_per_item, d] unnormalized outputs,
                               // [rows_per_item] tops, [rows_per_item] sums (Block::top)

  size_t Items() const { return static_cast<size_t>(batch * kv_heads * blocks * splits); }

  // How the query rows are cut into blocks: a call with more query rows per KV head than one
  // decode block (kQueryBlock) attends in tiles of whole tokens (kTileRows rows at most), where
  // the tiles' matrix products beat the row path (docs/PERFORMANCE.md, "Why the INT8 attention
  // kernel"); a decode step in blocks of kQueryBlock rows. A decode step has few query blocks
  // (one per KV head at batch 1: 3 for SmolLM2, while an Orin has 6-12 cores), so its cache is
  // also cut into blocks of at least kSplitKeys positions, enough for kSplitItems work items:
  // the op cannot ask onnxruntime how many threads its pool has (the custom-op C API has no such
  // call), and a fixed count that several threads divide evenly costs one thread ~nothing.
  // `partials` holds the cache blocks' partial results, kept across calls.
  void Split(std::vector<float>* partials) {
    const int64_t group = heads / kv_heads;
    tiled = group * seq > kQueryBlock && group <= kTileRows;
    rows_per_item = tiled ? kTileRows / group * group : kQueryBlock;
    blocks = (group * seq + rows_per_item - 1) / rows_per_item;
    longest = 0;
    origin = INT64_MAX;
    for (int64_t r = 0; r < batch; ++r) {
      longest = std::max(longest, past[r] + seq);
      origin = std::min(origin, First(past[r]));
    }
    const int64_t units = batch * kv_heads * blocks, n_keys = longest - origin;
    const int64_t n = tiled ? 1 : std::min((kSplitItems + units - 1) / units, n_keys / kSplitKeys);
    // blocks of whole 8-position sums; a call of no new tokens (longest 0) stays one block
    SplitKeys(n > 1 ? ((n_keys + n - 1) / n + 7) / 8 * 8 : std::max<int64_t>(n_keys, 1), partials);
  }

  // The first cache position the query at position `pos` attends to.
  int64_t First(int64_t pos) const { return window > 0 ? std::max<int64_t>(pos + 1 - window, 0) : 0; }

  // Decode: cache blocks of `keys` positions from `origin` (the last one shorter); the self-test
  // picks its own.
  void SplitKeys(int64_t keys, std::vector<float>* partials) {
    span = keys;
    splits = (longest - origin + span - 1) / span;
    if (splits == 1) return;
    partials->resize(Items() * rows_per_item * (d + 2));
    partial = partials->data();
  }

  int64_t RowTokens() const { return row_tokens > 0 ? row_tokens : seq; }

  // Where query row q (token q / group, head q % group of KV head h) of row r's output goes.
  float* Out(int64_t r, int64_t h, int64_t q) const {
    const int64_t group = heads / kv_heads;
    return y + ((r * RowTokens() + q / group) * heads + h * group + q % group) * d;
  }

  void Run(size_t item) const {
    thread_local std::vector<float> rows, scores, scratch;  // per thread, kept: steps allocate nothing
    const int64_t part = static_cast<int64_t>(item) % splits, unit = static_cast<int64_t>(item) / splits;
    const int64_t blk = unit % blocks, rh = unit / blocks;
    const int64_t r = rh / kv_heads, h = rh % kv_heads, group = heads / kv_heads, half = d / 2;
    const int64_t first = blk * rows_per_item, start = origin + part * span;
    const int64_t base = (r * kv_heads + h) * cache_len + start;  // this KV head's cache, from the block's start
    rows.resize(kMaxRows * d);
    Block block;
    block.n_rows = std::min<int64_t>(rows_per_item, group * seq - first);
    float* own = splits > 1 ? partial + item * rows_per_item * (d + 2) : nullptr;
    for (int64_t i = 0; i < block.n_rows; ++i) {
      const int64_t t = (first + i) / group, head = h * group + (first + i) % group, pos = past[r] + t;
      Rotate(x + (r * RowTokens() + t) * width + head * d, cos + pos * half, sin + pos * half, d, &rows[i * d]);
      block.limit[i] = std::min(std::max<int64_t>(pos + 1 - start, 0), splits > 1 ? span : cache_len - start);
      block.first[i] = std::min(std::max<int64_t>(First(pos) - start, 0), block.limit[i]);
      block.out[i] = own != nullptr ? own + i * d : Out(r, h, first + i);
    }
    if (own != nullptr) {
      block.top = own + rows_per_item * d;
      block.sum = block.top + rows_per_item;
    }
    block.q = rows.data();
    block.stride = cache_len;
    block.k_codes = k_codes + base * d;
    block.v_codes = v_codes + base * d;
    block.k_scales = k_scales + base * groups;
    block.v_scales = v_scales + base * groups;
    block.groups = groups;
    if (tiled && AttendPrefill(d, block, &scratch)) return;
    if (scores.size() < static_cast<size_t>(rows_per_item * cache_len)) scores.resize(rows_per_item * cache_len);
    block.scores = scores.data();
    Attend(d, block, &scratch);
  }

  // After every item has run, with splits > 1: each query row's attention from its cache blocks'
  // partial softmaxes, rescaled to the largest of their maxima M (online-softmax style):
  // out = sum_j e^(top_j - M) out_j / sum_j e^(top_j - M) sum_j. Some block holds the row's own
  // position, so M is finite; a block with no valid position (top -inf) weighs 0.
  void Combine() const {
    if (splits == 1) return;
    const int64_t group = heads / kv_heads, stride = rows_per_item * (d + 2);
    for (int64_t unit = 0; unit < batch * kv_heads * blocks; ++unit) {
      const int64_t first = unit % blocks * rows_per_item, rh = unit / blocks;
      const float* parts = partial + unit * splits * stride;  // [splits, stride]
      for (int64_t i = 0; i < std::min<int64_t>(rows_per_item, group * seq - first); ++i) {
        float top = -INFINITY, total = 0.0f;
        for (int64_t j = 0; j < splits; ++j) top = std::max(top, parts[j * stride + rows_per_item * d + i]);
        float* out = Out(rh / kv_heads, rh % kv_heads, first + i);
        std::fill(out, out + d, 0.0f);
        for (int64_t j = 0; j < splits; ++j) {
          const float* part = parts + j * stride;
          const float weight = std::exp(part[rows_per_item * d + i] - top);
          total += weight * part[rows_per_item * (d + 1) + i];
          for (int64_t c = 0; c < d; ++c) out[c] += weight * part[i * d + c];
        }
        const float inv = 1.0f / total;
        for (int64_t c = 0; c < d; ++c) out[c] *= inv;
      }
    }
  }
};

// The attention of `work`'s query rows, split into work items (Work::Split) run on onnxruntime's
// threads, then their partial results combined.
template <class W>
OrtStatus* Attention(OrtKernelContext* ctx, W* work) {
  thread_local std::vector<float> partials;
  work->Split(&partials);
  const size_t items = work->Items();
  if (items == 1) {
    work->Run(0);
    return nullptr;
  }
  KV_RETURN_IF_ERROR(g_api->KernelContext_ParallelFor(
      ctx, [](void* data, size_t item) { static_cast<const W*>(data)->Run(item); }, items, 0, work));
  work->Combine();
  return nullptr;
}

OrtStatus* Kernel::Compute(OrtKernelContext* ctx) {
  // per thread and kept across calls, as the scratch below: describing them allocates on the first call only
  thread_local Tensor in[8];
  for (size_t i = 0; i < 8; ++i) {
    const OrtValue* value = nullptr;
    KV_RETURN_IF_ERROR(g_api->KernelContext_GetInput(ctx, i, &value));
    if (value == nullptr) return Fail("input " + std::to_string(i) + " is missing");
    KV_RETURN_IF_ERROR(Describe(value, &in[i]));
  }
  const Tensor &qkv = in[0], &lengths = in[1], &cos_t = in[6], &sin_t = in[7];
  if (qkv.shape.size() != 3) return Fail("qkv must be [batch, seq, width], got " + ShapeText(qkv.shape));
  const int64_t batch = qkv.shape[0], seq = qkv.shape[1];
  const Tensor& kc = in[2];
  if (kc.shape.size() != 4 || kc.shape[0] != batch || kc.shape[1] != kv_heads)
    return Fail("K codes must be [batch, kv_heads=" + std::to_string(kv_heads) + ", positions, head_dim], got " +
                ShapeText(kc.shape));
  const int64_t cache_len = kc.shape[2], d = kc.shape[3];
  if (qkv.shape[2] != (heads + 2 * kv_heads) * d)
    return Fail("qkv width " + std::to_string(qkv.shape[2]) + " is not (heads + 2 kv_heads) * head_dim = " +
                std::to_string((heads + 2 * kv_heads) * d));
  const int64_t groups = in[4].shape.size() == 4 ? in[4].shape[3] : 0;
  if (groups <= 0 || d % groups || d % 2) return Fail("K scales must be [batch, kv_heads, positions, groups] "
                                                      "with groups dividing head_dim, got " + ShapeText(in[4].shape));
  for (int i = 3; i < 6; ++i) {
    const std::vector<int64_t>& want = i == 3 ? kc.shape : in[4].shape;
    if (in[i].shape != want) return Fail("input " + std::to_string(i) + " has shape " + ShapeText(in[i].shape) +
                                         ", expected " + ShapeText(want));
  }
  if (lengths.shape.size() != 1 || lengths.shape[0] != batch) return Fail("past_lengths must be [batch]");
  if (cos_t.shape.size() != 2 || cos_t.shape[1] != d / 2 || sin_t.shape != cos_t.shape)
    return Fail("cos/sin must be [positions, head_dim / 2], got " + ShapeText(cos_t.shape));
  const int64_t* past = static_cast<const int64_t*>(lengths.data);
  for (int64_t r = 0; r < batch; ++r) {
    if (past[r] < 0 || past[r] + seq > cache_len || past[r] + seq > cos_t.shape[0])
      return Fail("row " + std::to_string(r) + ": past length " + std::to_string(past[r]) + " + " +
                  std::to_string(seq) + " new tokens does not fit " + std::to_string(cache_len) + " positions");
  }

  // A decode step's cache lines, asked of memory before anything else touches them: in a model a
  // layer's cache rows were last used a whole step earlier and the other layers' weights have
  // evicted them since. Without this the new token's rows (written a byte at a time) stall the
  // stores until each line arrives, and the attention waits on each KV head's rows in turn; asked
  // for together, the misses overlap with each other and with onnxruntime handing over the
  // outputs (docs/PERFORMANCE.md, "Why the INT8 attention kernel"). The new rows, then K's attended rows, then V's, in the order of use;
  // at most kPrefetchKeys attended positions per KV head, the hardware prefetcher keeping a longer
  // stream coming. Written out here rather than in a function of its own, which GCC would find
  // free of side effects and drop.
  if (heads / kv_heads * seq <= kQueryBlock || seq <= decode_steps) {
    const int64_t scale_bytes = groups * static_cast<int64_t>(sizeof(half_t));
    const int64_t bytes[4] = {d, d, scale_bytes, scale_bytes};  // per position: K, V codes; K, V scales
    for (int pass = 0; pass < 3; ++pass) {
      for (int i = 0; i < 4; ++i) {
        if (pass > 0 && i % 2 != pass - 1) continue;
        for (int64_t r = 0; r < batch; ++r) {
          const int64_t first = window > 0 ? std::max<int64_t>(past[r] + 1 - window, 0) : 0;
          const int64_t from = pass == 0 ? past[r] : first;
          const int64_t count = pass == 0 ? seq : std::min(past[r] - first, kPrefetchKeys);
          for (int64_t h = 0; h < kv_heads; ++h) {
            const uintptr_t start = reinterpret_cast<uintptr_t>(in[2 + i].data) +
                                    ((r * kv_heads + h) * cache_len + from) * bytes[i];
            for (uintptr_t line = start & ~uintptr_t{63}; line < start + count * bytes[i]; line += 64) {
              if (pass == 0) __builtin_prefetch(reinterpret_cast<const void*>(line), 1);
              else __builtin_prefetch(reinterpret_cast<const void*>(line), 0);
            }
          }
        }
      }
    }
  }

  void* out[5] = {};  // the outputs' data (their shapes are the ones asked for)
  {
    const int64_t attn_shape[3] = {batch, seq, heads * d};
    OrtValue* value = nullptr;
    KV_RETURN_IF_ERROR(g_api->KernelContext_GetOutput(ctx, 0, attn_shape, 3, &value));
    KV_RETURN_IF_ERROR(g_api->GetTensorMutableData(value, &out[0]));
    for (size_t i = 1; i < 5; ++i) {
      KV_RETURN_IF_ERROR(g_api->KernelContext_GetOutput(ctx, i, in[i + 1].shape.data(), 4, &value));
      KV_RETURN_IF_ERROR(g_api->GetTensorMutableData(value, &out[i]));
      if (out[i] != in[i + 1].data)  // not bound in place: start from the past
        std::memcpy(out[i], in[i + 1].data, in[i + 1].size() * (i < 3 ? 1 : sizeof(half_t)));
    }
  }
  int8_t* k_codes = static_cast<int8_t*>(out[1]);
  int8_t* v_codes = static_cast<int8_t*>(out[2]);
  half_t* k_scales = static_cast<half_t*>(out[3]);
  half_t* v_scales = static_cast<half_t*>(out[4]);
  const float* x = static_cast<const float*>(qkv.data);
  const float* cos_p = static_cast<const float*>(cos_t.data);
  const float* sin_p = static_cast<const float*>(sin_t.data);
  float* y = static_cast<float*>(out[0]);
  const int64_t group_size = d / groups, half = d / 2, width = qkv.shape[2];

  // 1. The new tokens' K and V: rotate K, quantize both into the cache at their positions.
  // scratch per thread (onnxruntime may run one session from several threads), kept across calls
  thread_local std::vector<float> tmp;
  tmp.resize(d);
  for (int64_t r = 0; r < batch; ++r) {
    for (int64_t t = 0; t < seq; ++t) {
      const int64_t pos = past[r] + t;
      const float* token = x + (r * seq + t) * width;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t row = (r * kv_heads + h) * cache_len + pos;
        Rotate(token + (heads + h) * d, cos_p + pos * half, sin_p + pos * half, d, tmp.data());
        QuantizeRow(tmp.data(), d, group_size, k_codes + row * d, k_scales + row * groups);
        QuantizeRow(token + (heads + kv_heads + h) * d, d, group_size, v_codes + row * d, v_scales + row * groups);
      }
    }
  }

  // 2. Attention. A work item is one (row, KV head, block of query rows, Work::Split), and in a
  //    decode step with a long cache one block of its cache positions: the block's queries (its
  //    heads' `group` x the new tokens) go through the cache together, so each cached K/V row is
  //    read once per block. Items write disjoint outputs and run on onnxruntime's intra-op
  //    threads; the cache blocks' partial results are then combined on this one (Work::Combine).
  Work work;
  work.x = x;
  work.y = y;
  work.past = past;
  work.cos = cos_p;
  work.sin = sin_p;
  work.k_codes = k_codes;
  work.v_codes = v_codes;
  work.k_scales = k_scales;
  work.v_scales = v_scales;
  work.batch = batch;
  work.seq = seq;
  work.heads = heads;
  work.kv_heads = kv_heads;
  work.d = d;
  work.groups = groups;
  work.cache_len = cache_len;
  work.width = width;
  work.window = window;
  if (seq == 1 || seq > decode_steps) return Attention(ctx, &work);
  // token t as a one-token call at position past + t: all the new tokens are in the cache
  // already, and each query's limit keeps the later ones out, as they were absent in a decode step
  thread_local std::vector<int64_t> shifted;
  shifted.resize(batch);
  work.row_tokens = seq;
  work.seq = 1;
  work.past = shifted.data();
  for (int64_t t = 0; t < seq; ++t) {
    for (int64_t r = 0; r < batch; ++r) shifted[r] = past[r] + t;
    work.x = x + t * width;
    work.y = y + t * heads * d;
    KV_RETURN_IF_ERROR(Attention(ctx, &work));
  }
  return nullptr;
}

// ---- kvedge.Int4CacheAttention ----

// kvedge/kv4.py's constants: MULTS (np.linspace(0.35, 1.0, 24) as float32) and LEVELS_V (the
// 16 Lloyd-Max levels of N(0, 1), the 4-bit cache study's lloyd_max(16))
constexpr float kMults[24] = {
    0.3499999940395355f, 0.37826088070869446f, 0.406521737575531f, 0.43478259444236755f, 0.4630434811115265f,
    0.49130433797836304f, 0.519565224647522f, 0.5478261113166809f, 0.5760869383811951f, 0.604347825050354f,
    0.6326087117195129f, 0.6608695387840271f, 0.689130425453186f, 0.717391312122345f, 0.7456521987915039f,
    0.7739130258560181f, 0.802173912525177f, 0.8304347991943359f, 0.8586956262588501f, 0.886956512928009f,
    0.915217399597168f, 0.9434782862663269f, 0.9717391133308411f, 1.0f};
constexpr float kLevelsV[16] = {-2.73308468f, -2.06959891f, -1.61865211f, -1.25681007f, -0.94286567f, -0.65720135f,
                                -0.388355941f, -0.128507301f, 0.128507301f, 0.388355941f, 0.65720135f, 0.94286567f,
                                1.25681007f,   1.61865211f,   2.06959891f,   2.73308468f};
constexpr int64_t kMaxHeadDim4 = 256;  // the head sizes the op has paths for: 16, 32, ..., 256

typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint8_t v8ub __attribute__((vector_size(8)));
constexpr v8u kNibbleShifts = {0, 4, 8, 12, 16, 20, 24, 28};
constexpr v8u kBitShifts = {0, 1, 2, 3, 4, 5, 6, 7};

inline v8u Nibbles(const uint8_t* p) {  // the 8 4-bit codes of 4 bytes, code 2i + 1 in byte i's high half
  uint32_t word;
  std::memcpy(&word, p, sizeof word);
  return ((v8u{} + word) >> kNibbleShifts) & 15u;
}

// table[index] for 8 indices (0 .. 15) into 16 floats: two 8-entry table lookups of the vector unit,
// else one at a time
inline v8f Lookup16(const float* table, v8u index) {
#if defined(__AVX2__)
  __m256i i;
  std::memcpy(&i, &index, sizeof i);
  const __m256 lo = _mm256_loadu_ps(table), hi = _mm256_loadu_ps(table + 8);
#if defined(__AVX512VL__)
  const __m256 r = _mm256_permutex2var_ps(lo, i, hi);
#else  // blendv takes the sign bit: the index's bit 3 picks the upper half
  const __m256 r = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, i), _mm256_permutevar8x32_ps(hi, i),
                                    _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)));
#endif
  v8f v;
  std::memcpy(&v, &r, sizeof v);
  return v;
#else
  v8f v;
  for (int j = 0; j < 8; ++j) v[j] = table[index[j]];
  return v;
#endif
}

inline v8f ValueLevels(v8u code) { return Lookup16(kLevelsV, code); }  // LEVELS_V[code] for 8 codes

inline v8f Unsigned(const uint8_t* p) {  // 8 uint8 codes as floats
#if defined(__AVX2__)
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  v8f v;
  std::memcpy(&v, &f, sizeof v);
  return v;
#else
  v8ub u;
  std::memcpy(&u, p, sizeof u);
  return __builtin_convertvector(u, v8f);
#endif
}

// The row sources of the 4-bit cache (Int8Rows' interface): levels before the scale.
struct Key5Rows {  // [L, 5 D / 8] packed 5-bit codes, levels u - 15.5; [L, 1] scales
  const uint8_t* codes;
  const half_t* scales;
  template <int D>
  void Row(int64_t p, float* levels, float* factor) const {
    const uint8_t* c = codes + p * (5 * D / 8);
    for (int v = 0; v < D / 8; ++v) {
      const v8u high = ((v8u{} + uint32_t{c[D / 2 + v]}) >> kBitShifts) & 1u;
      const v8u u = Nibbles(c + 4 * v) | (high << 4);
      Store(levels + v * 8, __builtin_convertvector(u, v8f) - 15.5f);
    }
    factor[0] = static_cast<float>(scales[p]);
  }
};

struct Key8Rows {  // [L, D] 8-bit codes, levels u - 127.5; [L, groups] scales
  const uint8_t* codes;
  const half_t* scales;
  int64_t groups;
  template <int D>
  void Row(int64_t p, float* levels, float* factor) const {
    for (int v = 0; v < D / 8; ++v) Store(levels + v * 8, Unsigned(codes + p * D + v * 8) - 127.5f);
    for (int64_t g = 0; g < groups; ++g) factor[g] = static_cast<float>(scales[p * groups + g]);
  }
};

struct Value4Rows {  // [L, D / 2] packed 4-bit codes, levels LEVELS_V[code]; [L, 1] scales
  const uint8_t* codes;
  const half_t* scales;
  template <int D>
  void Row(int64_t p, float* levels, float* factor) const {
    for (int v = 0; v < D / 8; ++v) Store(levels + v * 8, ValueLevels(Nibbles(codes + p * (D / 2) + 4 * v)));
    factor[0] = static_cast<float>(scales[p]);
  }
};

struct FloatRows {  // float rows, position p's at rows + (p + offset) D; one scale of 1
  const float* rows;
  int64_t offset;
  template <int D>
  void Row(int64_t p, float* levels, float* factor) const {
    std::memcpy(levels, rows + (p + offset) * D, D * sizeof(float));
    factor[0] = 1.0f;
  }
};

// Rounding toward +inf, lane by lane.
inline v8f Ceil(v8f y) {
#if defined(__AVX2__)
  __m256 m;
  std::memcpy(&m, &y, sizeof m);
  m = _mm256_round_ps(m, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
  std::memcpy(&y, &m, sizeof y);
  return y;
#elif defined(__aarch64__)
  float32x4_t half[2];
  std::memcpy(half, &y, sizeof half);
  half[0] = vrndpq_f32(half[0]);
  half[1] = vrndpq_f32(half[1]);
  std::memcpy(&y, half, sizeof y);
  return y;
#else
  for (int j = 0; j < 8; ++j) y[j] = std::ceil(y[j]);
  return y;
#endif
}

// The butterflies of span H (1, 2 or 4) inside one vector of 8: lane j takes v[j] + v[j + H] where
// bit H of j is clear, v[j - H] - v[j] where it is set.
template <int H>
inline v8f Butterfly(v8f v) {
#if defined(__clang__)
  v8f out;
  for (int j = 0; j < 8; ++j) out[j] = (j & H) ? v[j - H] - v[j] : v[j] + v[j + H];
  return out;
#else
  constexpr v8i lo = {0 & ~H, 1 & ~H, 2 & ~H, 3 & ~H, 4 & ~H, 5 & ~H, 6 & ~H, 7 & ~H};
  constexpr v8i pick = {0 | (0 & H ? 8 : 0), 1 | (1 & H ? 8 : 0), 2 | (2 & H ? 8 : 0), 3 | (3 & H ? 8 : 0),
                        4 | (4 & H ? 8 : 0), 5 | (5 & H ? 8 : 0), 6 | (6 & H ? 8 : 0), 7 | (7 & H ? 8 : 0)};
  const v8f a = __builtin_shuffle(v, lo), b = __builtin_shuffle(v, lo + H);
  return __builtin_shuffle(a + b, a - b, pick);
#endif
}

// x @ H in place, H the orthonormal Sylvester Hadamard matrix of order D (kvedge.quant.hadamard):
// the butterflies of span 1, 2, ..., D / 2, then 1 / sqrt(D); every value the same additions in
// the same order as one butterfly at a time. H is its own inverse.
template <int D>
void HadamardDim(float* x) {
  v8f v[D / 8];
  for (int i = 0; i < D / 8; ++i) v[i] = Butterfly<4>(Butterfly<2>(Butterfly<1>(Load(x + 8 * i))));
  for (int h = 1; h < D / 8; h *= 2) {
    for (int i = 0; i < D / 8; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const v8f a = v[j], b = v[j + h];
        v[j] = a + b;
        v[j + h] = a - b;
      }
    }
  }
  const float norm = 1.0f / std::sqrt(static_cast<float>(D));
  for (int i = 0; i < D / 8; ++i) Store(x + 8 * i, v[i] * norm);
}

void Hadamard(float* x, int64_t d) {  // d: a head size the op has paths for
  switch (d) {
    case 16: return HadamardDim<16>(x);
    case 32: return HadamardDim<32>(x);
    case 64: return HadamardDim<64>(x);
    case 128: return HadamardDim<128>(x);
    case 256: return HadamardDim<256>(x);
  }
}

// The two roundings of the scale search, 8 values y = x / s at a time: each one's code and level.
struct Key5Rounding {  // u = clip(ceil(y) + 15, 0, 31): the nearest level u - 15.5, ties down
  static constexpr float kCmax = 15.5f;
  static void Round(v8f y, v8f* level, v8u* code) {
    const v8f q = Ceil(y) + 15.0f, zero = {}, top = Splat(31.0f);
    const v8f u = q < top ? (zero < q ? q : zero) : top;  // std::min(31, std::max(0, q))
    *level = u - 15.5f;
    *code = __builtin_convertvector(__builtin_convertvector(u, v8i), v8u);
  }
};

// kvedge/kv4.py's MIDPOINTS_V (float32 sums, halved), ascending; a 16th entry for Lookup16
constexpr float kMidsV[16] = {
    (kLevelsV[0] + kLevelsV[1]) / 2.0f,   (kLevelsV[1] + kLevelsV[2]) / 2.0f,   (kLevelsV[2] + kLevelsV[3]) / 2.0f,
    (kLevelsV[3] + kLevelsV[4]) / 2.0f,   (kLevelsV[4] + kLevelsV[5]) / 2.0f,   (kLevelsV[5] + kLevelsV[6]) / 2.0f,
    (kLevelsV[6] + kLevelsV[7]) / 2.0f,   (kLevelsV[7] + kLevelsV[8]) / 2.0f,   (kLevelsV[8] + kLevelsV[9]) / 2.0f,
    (kLevelsV[9] + kLevelsV[10]) / 2.0f,  (kLevelsV[10] + kLevelsV[11]) / 2.0f, (kLevelsV[11] + kLevelsV[12]) / 2.0f,
    (kLevelsV[12] + kLevelsV[13]) / 2.0f, (kLevelsV[13] + kLevelsV[14]) / 2.0f, (kLevelsV[14] + kLevelsV[15]) / 2.0f,
    INFINITY};

struct Value4Rounding {  // the number of midpoints strictly below y
  static constexpr float kCmax = kLevelsV[15];
  static void Round(v8f y, v8f* level, v8u* code) {
#if defined(__AVX2__)  // a binary search of the sorted midpoints: 3 table lookups, not 15 compares
    v8u k = (v8u)(Splat(kMidsV[7]) < y) & 8u;
    k += (v8u)(Lookup16(kMidsV, k + 3u) < y) & 4u;
    k += (v8u)(Lookup16(kMidsV, k + 1u) < y) & 2u;
    k += (v8u)(Lookup16(kMidsV, k) < y) & 1u;
#else
    v8u k = {};
    for (int i = 0; i < 15; ++i) k -= (v8u)(Splat(kMidsV[i]) < y);  // true is all ones
#endif
    *code = k;
    *level = ValueLevels(k);
  }
};

// The scale search of 5-bit keys and 4-bit values (kvedge/kv4.py): for each of kMults in order
// s = f16(max(absmax m / cmax, 2^-14)), codes by `round(x / s)` -> (code, level), and the first
// multiplier with the strictly least squared error wins. Codes [d] and the scale are returned.
// The 24 multipliers go 8 to a vector, each one's error summed over x in order (as one multiplier
// at a time would); then the winner's codes.
template <class Rounding>
void Searched(const float* x, int64_t d, uint8_t* codes, half_t* scale) {
  float absmax = 0.0f;
  for (int64_t c = 0; c < d; ++c) absmax = std::max(absmax, std::fabs(x[c]));
  half_t s16[24];
  v8f s[3];
  for (int i = 0; i < 24; ++i) {
    s16[i] = static_cast<half_t>(std::max(absmax * kMults[i] / Rounding::kCmax, kScaleFloor));
    s[i / 8][i % 8] = static_cast<float>(s16[i]);
  }
  v8f sums[3] = {}, level;
  v8u code;
  for (int64_t c = 0; c < d; ++c) {
    const v8f xc = Splat(x[c]);
    for (int k = 0; k < 3; ++k) {
      Rounding::Round(xc / s[k], &level, &code);
      const v8f e = level * s[k] - xc;
      sums[k] += e * e;
    }
  }
  float err[24];
  std::memcpy(err, sums, sizeof err);
  int best = 0;
  for (int i = 1; i < 24; ++i)
    if (err[i] < err[best]) best = i;
  *scale = s16[best];
  const v8f sb = Splat(static_cast<float>(s16[best]));
  for (int64_t c = 0; c < d; c += 8) {
    Rounding::Round(Load(x + c) / sb, &level, &code);
    for (int j = 0; j < 8; ++j) codes[c + j] = static_cast<uint8_t>(code[j]);
  }
}

// One token's rotated K row of one head -> its packed codes and scales at key_bits 5 or 8.
void QuantizeKey4(const float* x, int64_t d, int64_t key_bits, uint8_t* out, half_t* scales) {
  uint8_t u[kMaxHeadDim4];
  if (key_bits == 8) {
    const int64_t g = std::min<int64_t>(32, d);
    for (int64_t g0 = 0; g0 < d; g0 += g) {
      float absmax = 0.0f;
      for (int64_t c = g0; c < g0 + g; ++c) absmax = std::max(absmax, std::fabs(x[c]));
      const half_t s16 = static_cast<half_t>(std::max(absmax / 127.5f, kScaleFloor));
      const float s = static_cast<float>(s16);
      scales[g0 / g] = s16;
      for (int64_t c = g0; c < g0 + g; ++c) out[c] = static_cast<uint8_t>(std::min(255.0f, std::max(0.0f, std::ceil(x[c] / s) + 127.0f)));
    }
    return;
  }
  Searched<Key5Rounding>(x, d, u, scales);
  for (int64_t i = 0; i < d / 2; ++i) out[i] = (u[2 * i] & 15) | (u[2 * i + 1] & 15) << 4;
  for (int64_t i = 0; i < d / 8; ++i) {
    uint8_t high = 0;
    for (int t = 0; t < 8; ++t) high |= ((u[8 * i + t] >> 4) & 1) << t;
    out[d / 2 + i] = high;
  }
}

// One token's rotated V row of one head -> d / 2 bytes of 4-bit codes and its scale.
void QuantizeValue4(const float* x, int64_t d, uint8_t* out, half_t* scale) {
  uint8_t code[kMaxHeadDim4];
  Searched<Value4Rounding>(x, d, code, scale);
  for (int64_t i = 0; i < d / 2; ++i) out[i] = code[2 * i] | code[2 * i + 1] << 4;
}

// A query block of the 4-bit cache: Block's rows, where row i reads positions [first, split) as
// codes and [split, limit) as float rows.
struct Kv4Block : Block {
  int64_t split[kMaxRows];
  const uint8_t* kc = nullptr;  // this KV head's codes and scales from the block's start
  const half_t* ks = nullptr;
  const uint8_t* vc = nullptr;
  const half_t* vs = nullptr;
  int64_t key_bits = 5;
  FloatRows fk{}, fv{};
};

template <int D, int KGS, class KRows>
void Attend4Rows(const Kv4Block& b, const KRows& keys, std::vector<float>* scratch) {
  scratch->resize(kPosBlock * D);
  float* buf = scratch->data();
  const Value4Rows values{b.vc, b.vs};
  SegmentScores<D, KGS>(b, b.first, b.split, keys, buf);
  SegmentScores<D, D>(b, b.split, b.limit, b.fk, buf);
  SoftmaxRows(b);
  v8f acc[kMaxRows][D / 8] = {};
  SegmentValues<D, D>(b, b.first, b.split, values, buf, acc);
  SegmentValues<D, D>(b, b.split, b.limit, b.fv, buf, acc);
  for (int64_t i = 0; i < b.n_rows; ++i)
    for (int v = 0; v < D / 8; ++v) Store(b.out[i] + v * 8, acc[i][v]);
}

template <int D, int KGS, class KRows>
void Attend4Tiled(const Kv4Block& b, const KRows& keys, std::vector<float>* scratch) {
  Tile<D, kKeyBlock> tile(b.q, b.n_rows, scratch);
  const Value4Rows values{b.vc, b.vs};
  tile.Pass(b.first, b.split, Dequantized<D, KGS, D>(keys, values));
  tile.Pass(b.split, b.limit, Dequantized<D, D, D>(b.fk, b.fv));
  tile.Finish(b.out);
}

// Whether head_dim D goes through the prefill tiles (Tile's register tiles fit it).
constexpr bool Tileable(int64_t d) { return d % (2 * kLanes) == 0; }

template <int D>
void Attend4Dim(const Kv4Block& b, bool tiled, std::vector<float>* scratch) {
  auto run = [&](auto group, const auto& keys) {
    constexpr int KGS = decltype(group)::value;
    if constexpr (Tileable(D)) {
      if (tiled) return Attend4Tiled<D, KGS>(b, keys, scratch);
    }
    Attend4Rows<D, KGS>(b, keys, scratch);
  };
  constexpr int kGroup8 = D < 32 ? D : 32;
  if (b.key_bits == 5) run(std::integral_constant<int, D>{}, Key5Rows{b.kc, b.ks});
  else run(std::integral_constant<int, kGroup8>{}, Key8Rows{b.kc, b.ks, D / kGroup8});
}

// The decode rows (Attend's structure) or, where `tiled`, the prefill tiles (AttendTiled's).
void Attend4(int64_t d, const Kv4Block& b, bool tiled, std::vector<float>* scratch) {
  switch (d) {
    case 16: return Attend4Dim<16>(b, tiled, scratch);
    case 32: return Attend4Dim<32>(b, tiled, scratch);
    case 64: return Attend4Dim<64>(b, tiled, scratch);
    case 128: return Attend4Dim<128>(b, tiled, scratch);
    case 256: return Attend4Dim<256>(b, tiled, scratch);
  }
}

// Work's split and items over the 4-bit cache: the query rows rotated by RoPE and H, each row's
// float positions read from `fk`/`fv`, the call's float rows gathered per (row, KV head).
struct Kv4Work : Work {
  const uint8_t *kc4 = nullptr, *vc4 = nullptr;
  const half_t *ks4 = nullptr, *vs4 = nullptr;
  int64_t key_bits = 5, key_row = 0, key_groups = 1;
  int64_t float_window = 0;     // Kv4Kernel::float_window
  int64_t float_rows = 0;       // rows per (row, KV head) of fk / fv: float_window + the call's tokens
  const float *fk = nullptr, *fv = nullptr;  // [batch, kv_heads, float_rows, d]: row j - (p0 - window)
  const int64_t* call_past = nullptr;        // the call's past lengths p0 (past is shifted per token)

  void Run(size_t item) const {
    thread_local std::vector<float> rows, scores, scratch;
    const int64_t part = static_cast<int64_t>(item) % splits, unit = static_cast<int64_t>(item) / splits;
    const int64_t blk = unit % blocks, rh = unit / blocks;
    const int64_t r = rh / kv_heads, h = rh % kv_heads, group = heads / kv_heads, half = d / 2;
    const int64_t first = blk * rows_per_item, start = origin + part * span;
    const int64_t base = (r * kv_heads + h) * cache_len + start;
    rows.resize(kMaxRows * d);
    Kv4Block block;
    block.n_rows = std::min<int64_t>(rows_per_item, group * seq - first);
    float* own = splits > 1 ? partial + item * rows_per_item * (d + 2) : nullptr;
    for (int64_t i = 0; i < block.n_rows; ++i) {
      const int64_t t = (first + i) / group, head = h * group + (first + i) % group, pos = past[r] + t;
      Rotate(x + (r * RowTokens() + t) * width + head * d, cos + pos * half, sin + pos * half, d, &rows[i * d]);
      Hadamard(&rows[i * d], d);
      block.limit[i] = std::min(std::max<int64_t>(pos + 1 - start, 0), splits > 1 ? span : cache_len - start);
      block.first[i] = std::min(std::max<int64_t>(First(pos) - start, 0), block.limit[i]);
      block.split[i] = std::min(std::max(pos - float_window - start, block.first[i]), block.limit[i]);
      block.out[i] = own != nullptr ? own + i * d : Out(r, h, first + i);
    }
    if (own != nullptr) {
      block.top = own + rows_per_item * d;
      block.sum = block.top + rows_per_item;
    }
    block.q = rows.data();
    block.stride = cache_len;
    block.kc = kc4 + base * key_row;
    block.ks = ks4 + base * key_groups;
    block.vc = vc4 + base * (d / 2);
    block.vs = vs4 + base;
    block.key_bits = key_bits;
    const int64_t offset = start - (call_past[r] - float_window);
    block.fk = FloatRows{fk + (r * kv_heads + h) * float_rows * d, offset};
    block.fv = FloatRows{fv + (r * kv_heads + h) * float_rows * d, offset};
    const bool tile = tiled && Tileable(d);
    if (!tile && scores.size() < static_cast<size_t>(rows_per_item * cache_len)) scores.resize(rows_per_item * cache_len);
    block.scores = scores.data();
    Attend4(d, block, tile, &scratch);
  }
};

struct Kv4Kernel : AttentionAttributes {
  int64_t key_bits = 0;
  int64_t float_window = 32;  // the `window` attribute: past positions attended as float rows

  OrtStatus* Compute(OrtKernelContext* context);
};

OrtStatus* Kv4Kernel::Compute(OrtKernelContext* ctx) {
  constexpr const char* op = "Int4CacheAttention";
  thread_local Tensor in[10];
  for (size_t i = 0; i < 10; ++i) {
    const OrtValue* value = nullptr;
    KV_RETURN_IF_ERROR(g_api->KernelContext_GetInput(ctx, i, &value));
    if (value == nullptr) return Fail("input " + std::to_string(i) + " is missing", op);
    KV_RETURN_IF_ERROR(Describe(value, &in[i]));
  }
  const Tensor &qkv = in[0], &lengths = in[1], &kw = in[6], &cos_t = in[8], &sin_t = in[9];
  if (qkv.shape.size() != 3) return Fail("qkv must be [batch, seq, width], got " + ShapeText(qkv.shape), op);
  const int64_t batch = qkv.shape[0], seq = qkv.shape[1];
  if (kw.shape.size() != 4 || kw.shape[0] != batch || kw.shape[1] != kv_heads)
    return Fail("K window must be [batch, kv_heads=" + std::to_string(kv_heads) + ", ring, head_dim], got " +
                ShapeText(kw.shape), op);
  const int64_t ring = kw.shape[2], d = kw.shape[3];
  if (d < 16 || d > kMaxHeadDim4 || (d & (d - 1)))
    return Fail("head_dim " + std::to_string(d) + " is not supported; allowed: 16, 32, 64, 128, 256", op);
  if (float_window > ring)
    return Fail("window " + std::to_string(float_window) + " is more than the ring's " + std::to_string(ring) +
                " positions (inputs 6, 7)", op);
  if (qkv.shape[2] != (heads + 2 * kv_heads) * d)
    return Fail("qkv width " + std::to_string(qkv.shape[2]) + " is not (heads + 2 kv_heads) * head_dim = " +
                std::to_string((heads + 2 * kv_heads) * d), op);
  if (in[2].shape.size() != 4) return Fail("K codes must be [batch, kv_heads, positions, bytes]", op);
  const int64_t cache_len = in[2].shape[2], key_row = key_bits == 5 ? 5 * d / 8 : d;
  const int64_t key_groups = key_bits == 5 ? 1 : d / std::min<int64_t>(32, d);
  const std::vector<int64_t> want[6] = {{batch, kv_heads, cache_len, key_row}, {batch, kv_heads, cache_len, key_groups},
                                        {batch, kv_heads, cache_len, d / 2},   {batch, kv_heads, cache_len, 1},
                                        {batch, kv_heads, ring, d},            {batch, kv_heads, ring, d}};
  for (int i = 0; i < 6; ++i) {
    if (in[2 + i].shape != want[i])
      return Fail("input " + std::to_string(2 + i) + " has shape " + ShapeText(in[2 + i].shape) + ", expected " +
                  ShapeText(want[i]) + " (key_bits " + std::to_string(key_bits) + ")", op);
  }
  if (lengths.shape.size() != 1 || lengths.shape[0] != batch) return Fail("past_lengths must be [batch]", op);
  if (cos_t.shape.size() != 2 || cos_t.shape[1] != d / 2 || sin_t.shape != cos_t.shape)
    return Fail("cos/sin must be [positions, head_dim / 2], got " + ShapeText(cos_t.shape), op);
  const int64_t* past = static_cast<const int64_t*>(lengths.data);
  for (int64_t r = 0; r < batch; ++r) {
    if (past[r] < 0 || past[r] + seq > cache_len || past[r] + seq > cos_t.shape[0])
      return Fail("row " + std::to_string(r) + ": past length " + std::to_string(past[r]) + " + " +
                  std::to_string(seq) + " new tokens does not fit " + std::to_string(cache_len) + " positions", op);
  }

  void* out[7] = {};
  {
    constexpr size_t bytes[7] = {4, 1, 2, 1, 2, 4, 4};
    const int64_t attn_shape[3] = {batch, seq, heads * d};
    OrtValue* value = nullptr;
    KV_RETURN_IF_ERROR(g_api->KernelContext_GetOutput(ctx, 0, attn_shape, 3, &value));
    KV_RETURN_IF_ERROR(g_api->GetTensorMutableData(value, &out[0]));
    for (size_t i = 1; i < 7; ++i) {
      KV_RETURN_IF_ERROR(g_api->KernelContext_GetOutput(ctx, i, in[i + 1].shape.data(), 4, &value));
      KV_RETURN_IF_ERROR(g_api->GetTensorMutableData(value, &out[i]));
      if (out[i] != in[i + 1].data)  // not bound in place: start from the past
        std::memcpy(out[i], in[i + 1].data, in[i + 1].size() * bytes[i]);
    }
  }
  uint8_t* k_codes = static_cast<uint8_t*>(out[1]);
  half_t* k_scales = static_cast<half_t*>(out[2]);
  uint8_t* v_codes = static_cast<uint8_t*>(out[3]);
  half_t* v_scales = static_cast<half_t*>(out[4]);
  float* k_ring = static_cast<float*>(out[5]);  // [batch, kv_heads, ring, d]
  float* v_ring = static_cast<float*>(out[6]);
  const float* x = static_cast<const float*>(qkv.data);
  const float* cos_p = static_cast<const float*>(cos_t.data);
  const float* sin_p = static_cast<const float*>(sin_t.data);
  float* y = static_cast<float*>(out[0]);
  const int64_t half = d / 2, width = qkv.shape[2], float_rows = float_window + seq;

  // 1. The new tokens' kr = RoPE(k) H and vr = v H: quantized into the cache at their positions and
  //    kept as the float rows of the call (fk, fv: per (row, KV head) float_rows rows, position j at
  //    j - (past - float_window)) after the ring's rows of the window before them, read before the
  //    ring is overwritten; then the last min(seq, ring) of them go into the ring.
  thread_local std::vector<float> floats;  // kept across calls
  floats.resize(2 * batch * kv_heads * float_rows * d);
  float* fk = floats.data();
  float* fv = fk + batch * kv_heads * float_rows * d;
  for (int64_t r = 0; r < batch; ++r) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t rh = r * kv_heads + h;
      for (int64_t j = std::max<int64_t>(past[r] - float_window, 0); j < past[r]; ++j) {
        const int64_t at = (rh * float_rows + j - past[r] + float_window) * d, slot = (rh * ring + j % ring) * d;
        std::memcpy(fk + at, k_ring + slot, d * sizeof(float));
        std::memcpy(fv + at, v_ring + slot, d * sizeof(float));
      }
      for (int64_t t = 0; t < seq; ++t) {
        const int64_t pos = past[r] + t, row = rh * cache_len + pos;
        const float* token = x + (r * seq + t) * width;
        float* kr = fk + (rh * float_rows + float_window + t) * d;
        float* vr = fv + (rh * float_rows + float_window + t) * d;
        Rotate(token + (heads + h) * d, cos_p + pos * half, sin_p + pos * half, d, kr);
        Hadamard(kr, d);
        std::memcpy(vr, token + (heads + kv_heads + h) * d, d * sizeof(float));
        Hadamard(vr, d);
        QuantizeKey4(kr, d, key_bits, k_codes + row * key_row, k_scales + row * key_groups);
        QuantizeValue4(vr, d, v_codes + row * (d / 2), v_scales + row);
      }
      for (int64_t t = std::max<int64_t>(seq - ring, 0); t < seq; ++t) {
        const int64_t at = (rh * float_rows + float_window + t) * d, slot = (rh * ring + (past[r] + t) % ring) * d;
        std::memcpy(k_ring + slot, fk + at, d * sizeof(float));
        std::memcpy(v_ring + slot, fv + at, d * sizeof(float));
      }
    }
  }

  // 2. Attention in rotated coordinates, split into work items as Int8CacheAttention's.
  Kv4Work work;
  work.x = x;
  work.y = y;
  work.past = past;
  work.cos = cos_p;
  work.sin = sin_p;
  work.batch = batch;
  work.seq = seq;
  work.heads = heads;
  work.kv_heads = kv_heads;
  work.d = d;
  work.cache_len = cache_len;
  work.width = width;
  work.window = window;
  work.kc4 = k_codes;
  work.ks4 = k_scales;
  work.vc4 = v_codes;
  work.vs4 = v_scales;
  work.key_bits = key_bits;
  work.key_row = key_row;
  work.key_groups = key_groups;
  work.float_window = float_window;
  work.float_rows = float_rows;
  work.fk = fk;
  work.fv = fv;
  work.call_past = past;
  if (seq == 1 || seq > decode_steps) {
    KV_RETURN_IF_ERROR(Attention(ctx, &work));
  } else {  // token t as a one-token call at position past + t (Kernel::Compute says why this is exact)
    thread_local std::vector<int64_t> shifted;
    shifted.resize(batch);
    work.row_tokens = seq;
    work.seq = 1;
    work.past = shifted.data();
    for (int64_t t = 0; t < seq; ++t) {
      for (int64_t r = 0; r < batch; ++r) shifted[r] = past[r] + t;
      work.x = x + t * width;
      work.y = y + t * heads * d;
      KV_RETURN_IF_ERROR(Attention(ctx, &work));
    }
  }
  // 3. Back from the rotated basis: out_r H^T = out_r H.
  for (int64_t i = 0; i < batch * seq * heads; ++i) Hadamard(y + i * d, d);
  return nullptr;
}

// ---- kvedge.SideInputs ----

// Rows [first, last) of x [rows, k]: side [rows, k / block + n_kept] and, where masked is set,
// masked [rows, k]. Each block is summed from its first channel to its last, one addition at a
// time, as onnxruntime's float32 MatMul with a 0/1 column adds it up (its products by 0 add exact
// zeros), so the side input is the standard-op graph's to the bit: MatMulNBits rounds activations
// to int8, where one changed rounding moves an output by a whole int8 level and the change grows
// layer by layer (a block sum in another order changed SmolLM2's logits by 0.18). Eight blocks go
// at a time, as eight independent chains of additions.
void SideRows(const float* x, int64_t k, int64_t block, const int64_t* kept, int64_t n_kept, int64_t first,
              int64_t last, float* side, float* masked) {
  const int64_t blocks = block > 0 ? k / block : 0, width = blocks + n_kept;
  for (int64_t r = first; r < last; ++r) {
    const float* in = x + r * k;
    float* s = side + r * width;
    float* m = masked != nullptr ? masked + r * k : nullptr;
    if (m != nullptr) std::memcpy(m, in, k * sizeof(float));
    int64_t b0 = 0;
    for (; b0 + 8 <= blocks; b0 += 8) {
      float acc[8] = {};
      for (int64_t c = 0; c < block; ++c)
        for (int j = 0; j < 8; ++j) acc[j] += in[(b0 + j) * block + c];
      for (int j = 0; j < 8; ++j) s[b0 + j] = acc[j];
    }
    for (; b0 < blocks; ++b0) {
      float acc = 0.0f;
      for (int64_t c = 0; c < block; ++c) acc += in[b0 * block + c];
      s[b0] = acc;
    }
    for (int64_t i = 0; i < n_kept; ++i) {
      s[blocks + i] = in[kept[i]];
      if (m != nullptr) m[kept[i]] = 0.0f;
    }
  }
}

struct SideKernel {
  int64_t block = 0;  // block_size

  OrtStatus* Compute(OrtKernelContext* context) const;
};

// Everything a work item of SideInputs needs: rows [item * rows_per_item, ...) of x.
struct SideWork {
  const float* x;
  float *side, *masked;
  const int64_t* kept;
  int64_t k, block, n_kept, rows, rows_per_item;

  void Run(size_t item) const {
    const int64_t first = static_cast<int64_t>(item) * rows_per_item;
    SideRows(x, k, block, kept, n_kept, first, std::min(rows, first + rows_per_item), side, masked);
  }
};

OrtStatus* SideKernel::Compute(OrtKernelContext* ctx) const {
  constexpr const char* op = "SideInputs";
  Tensor in[2];
  for (size_t i = 0; i < 2; ++i) {
    const OrtValue* value = nullptr;
    KV_RETURN_IF_ERROR(g_api->KernelContext_GetInput(ctx, i, &value));
    if (value == nullptr) return Fail("input " + std::to_string(i) + " is missing", op);
    KV_RETURN_IF_ERROR(Describe(value, &in[i]));
  }
  const Tensor &x = in[0], &kept = in[1];
  if (x.shape.empty()) return Fail("x must have at least one dimension (its channels)", op);
  if (kept.shape.size() != 1) return Fail("kept must be [kept], got " + ShapeText(kept.shape), op);
  const int64_t k = x.shape.back(), n_kept = kept.shape[0], rows = k > 0 ? x.size() / k : 0;
  if (block > 0 && k % block)
    return Fail("x has " + std::to_string(k) + " channels, not a multiple of block_size " + std::to_string(block), op);
  const int64_t* channels = static_cast<const int64_t*>(kept.data);
  for (int64_t i = 0; i < n_kept; ++i) {
    if (channels[i] < 0 || channels[i] >= k)
      return Fail("kept channel " + std::to_string(channels[i]) + " is outside x's " + std::to_string(k) +
                  " channels", op);
  }
  size_t n_outputs = 0;
  KV_RETURN_IF_ERROR(g_api->KernelContext_GetOutputCount(ctx, &n_outputs));
  std::vector<int64_t> shape = x.shape;
  shape.back() = (block > 0 ? k / block : 0) + n_kept;
  OrtValue* value = nullptr;
  Tensor side, masked;
  KV_RETURN_IF_ERROR(g_api->KernelContext_GetOutput(ctx, 0, shape.data(), shape.size(), &value));
  KV_RETURN_IF_ERROR(Describe(value, &side));
  if (n_outputs > 1) {
    value = nullptr;
    KV_RETURN_IF_ERROR(g_api->KernelContext_GetOutput(ctx, 1, x.shape.data(), x.shape.size(), &value));
    if (value != nullptr) KV_RETURN_IF_ERROR(Describe(value, &masked));  // null: the output is unused
  }
  // items of ~128 KiB of x: a decode step's row runs here, a prefill's rows on onnxruntime's threads
  SideWork work{static_cast<const float*>(x.data), static_cast<float*>(side.data), static_cast<float*>(masked.data),
                channels, k, block, n_kept, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(k, 1))};
  const size_t items = static_cast<size_t>((rows + work.rows_per_item - 1) / work.rows_per_item);
  if (items <= 1) {
    if (items == 1) work.Run(0);
    return nullptr;
  }
  return g_api->KernelContext_ParallelFor(
      ctx, [](void* data, size_t item) { static_cast<const SideWork*>(data)->Run(item); }, items, 0, &work);
}

// ---- kvedge.QuantMatMul ----

constexpr int64_t kQmmTile = 64;           // output columns per record: 4 groups of 16
constexpr int64_t kQmmItemBytes = 131072;  // weights per work item, at least one tile
constexpr int64_t kQmmPrefetch = 5120;     // bytes read ahead of the record in use (10240 did alike)

// One call: its activations quantized once per row (QmmQuantize) and the weight.
struct QmmWork {
  const uint8_t* weights;   // [tiles, tile_bytes]: a tile's blocks' records, then its kept rows
  const int8_t* xq;         // [rows, k] x with the kept channels zeroed, as int8 per block
  const float* xs;          // [rows, blocks] each block's activation scale, amax / 127
  const float* bsum;        // [rows, blocks] each block's sum of x, kept channels included
  const int32_t* xqsum;     // [rows, blocks] each block's sum of xq
  const float* kept_x;      // [rows, n_kept] x at the kept channels
  float* y;                 // [rows, tiles * 64]
  int64_t rows, k, block, blocks, tiles, n_kept, tiles_per_item;
  int bits;
  bool minimums;

  int64_t GroupBytes() const { return 2 * block * bits; }  // one group's codes in a record
  int64_t RecordBytes() const { return 4 * GroupBytes() + (minimums ? 2 : 1) * kQmmTile * 2; }
  int64_t TileBytes() const { return blocks * RecordBytes() + n_kept * kQmmTile * 2; }
  const uint8_t* Tile(int64_t t) const { return weights + t * TileBytes(); }
  // [n_kept, 64] tile t's kept rows, after its records
  const half_t* KeptRows(int64_t t) const {
    return reinterpret_cast<const half_t*>(Tile(t) + blocks * RecordBytes());
  }
  void Run(size_t item) const;
};

// Row r of x [rows, k] into QmmWork's activation buffers: xq = round_half_even(x_masked * (127 /
// amax)) per block (MatMulNBits' accuracy_level 4 quantization; all 0 where amax is 0).
void QmmQuantize(const float* x, int64_t k, int64_t block, const int64_t* kept, int64_t n_kept, int64_t r,
                 float* masked, int8_t* xq, float* xs, float* bsum, int32_t* xqsum, float* kept_x) {
  const float* in = x + r * k;
  const int64_t blocks = k / block;
  std::memcpy(masked, in, k * sizeof(float));
  for (int64_t j = 0; j < n_kept; ++j) {
    kept_x[r * n_kept + j] = in[kept[j]];
    masked[kept[j]] = 0.0f;
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const float* m = masked + b * block;
    const float* full = in + b * block;
    float amax = 0.0f, sum = 0.0f;
    for (int64_t c = 0; c < block; ++c) {
      amax = std::max(amax, std::fabs(m[c]));
      sum += full[c];
    }
    const float inverse = amax > 0.0f ? kQmax / amax : 0.0f;
    int8_t* q = xq + r * k + b * block;
    int32_t total = 0;
    for (int64_t c = 0; c < block; ++c) {
      q[c] = static_cast<int8_t>(std::nearbyint(m[c] * inverse));  // |level| <= 127: amax maps on 127
      total += q[c];
    }
    xs[r * blocks + b] = amax / kQmax;
    bsum[r * blocks + b] = sum;
    xqsum[r * blocks + b] = total;
  }
}

// The reference path, one column and one block at a time (also the path of CPUs without one of
// the vector paths below): tiles [first, last) of every row.
void QmmScalar(const QmmWork& a, int64_t first, int64_t last) {
  const int zc = 1 << (a.bits - 1);
  const int64_t group_bytes = a.GroupBytes(), record = a.RecordBytes(), n = a.tiles * kQmmTile;
  for (int64_t t = first; t < last; ++t) {
    for (int64_t r = 0; r < a.rows; ++r) {
      for (int64_t col = 0; col < kQmmTile; ++col) {
        const int64_t g = col / 16, i = col % 16;
        float acc = 0.0f;
        for (int64_t b = 0; b < a.blocks; ++b) {
          const uint8_t* rec = a.Tile(t) + b * record;
          const uint8_t* codes = rec + g * group_bytes;
          const int8_t* xq = a.xq + r * a.k + b * a.block;
          int32_t dot = 0;
          for (int64_t c = 0; c < a.block; ++c) {
            int u;
            if (a.bits == 4) {  // c = 8 v + 4 h + t: byte 64 v + 4 i + t, nibble h
              const uint8_t byte = codes[(c / 8) * 64 + 4 * i + c % 4];
              u = (c % 8) < 4 ? byte & 15 : byte >> 4;
            } else {  // c = 4 v + t: byte 64 v + 4 i + t
              u = codes[(c / 4) * 64 + 4 * i + c % 4];
            }
            dot += xq[c] * u;
          }
          dot -= zc * a.xqsum[r * a.blocks + b];
          const half_t* params = reinterpret_cast<const half_t*>(rec + 4 * group_bytes);  // scales, minimums
          const float scale = static_cast<float>(params[col]);
          acc += scale * (a.xs[r * a.blocks + b] * static_cast<float>(dot));
          if (a.minimums) acc += (static_cast<float>(params[kQmmTile + col]) + zc * scale) * a.bsum[r * a.blocks + b];
        }
        for (int64_t j = 0; j < a.n_kept; ++j)
          acc += a.kept_x[r * a.n_kept + j] * static_cast<float>(a.KeptRows(t)[j * kQmmTile + col]);
        a.y[r * n + t * kQmmTile + col] = acc;
      }
    }
  }
}

inline int32_t QmmDword(const int8_t* p) {  // 4 activations as one int32, to broadcast
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Tile t's kept row j, with the stream kQmmPrefetch bytes past it asked of memory: the rest of
// the kept rows and the next tile's first records (the records' prefetch ran into the first
// kQmmPrefetch bytes of the kept rows already).
inline const half_t* QmmKeptRow(const QmmWork& a, int64_t t, int64_t j) {
  const half_t* row = a.KeptRows(t) + j * kQmmTile;
  const char* ahead = reinterpret_cast<const char*>(row) + kQmmPrefetch;
  __builtin_prefetch(ahead);
  __builtin_prefetch(ahead + 64);
  return row;
}

// The vector paths: QmmTile<BITS, BS, MIN, R> computes one tile (64 columns) of rows r .. r + R - 1
// (R of 1 to 4), reading its records and then its kept rows in order with a software
// prefetch kQmmPrefetch bytes ahead (the tiles of a matrix are one sequential stream:
// docs/PERFORMANCE.md, "Two forms of the weights"). A tile (K / block_size records and
// the kept rows, ~27 KiB for K = 576 at 4 bits) stays in L1/L2 for the call's other rows. Each
// block's int32 dot products are exact; scale, xs and offset bsum are applied once per block and
// column in float32.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KV_QMM_VECTOR 1
constexpr const char* kQmmPath = "avx512-vnni";
constexpr int kQmmRowTile = 4;  // rows sharing each code vector loaded (32 registers)

// vpdpbusd: u8 codes x s8 activations, 4 products per int32 lane: one lane per column, a group of
// 16 columns per register. Rows r .. r + R - 1 go together: each code vector is loaded and
// unpacked once for all of them. Two chains per row and group: vpdpbusd's latency.
template <int BITS, int BS, bool MIN, int R>
void QmmTile(const QmmWork& a, int64_t t, int64_t r) {
  constexpr int64_t group_bytes = 2 * BS * BITS, vectors = group_bytes / 64, zc = 1 << (BITS - 1);
  const int64_t record = a.RecordBytes();
  const uint8_t* p = a.Tile(t);
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R][4];
  for (int m = 0; m < R; ++m)
    for (int g = 0; g < 4; ++g) acc[m][g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b, p += record) {
    for (int64_t line = 0; line < record; line += 64) __builtin_prefetch(p + kQmmPrefetch + line);
    const int8_t* x[R];
    for (int m = 0; m < R; ++m) x[m] = a.xq + (r + m) * a.k + b * BS;
    const half_t* params = reinterpret_cast<const half_t*>(p + 4 * group_bytes);
    for (int g = 0; g < 4; ++g) {
      const uint8_t* c = p + g * group_bytes;
      __m512i d[R][2];
      for (int m = 0; m < R; ++m) {
        d[m][0] = _mm512_set1_epi32(static_cast<int32_t>(-zc * a.xqsum[(r + m) * a.blocks + b]));
        d[m][1] = _mm512_setzero_si512();
      }
      for (int64_t v = 0; v < vectors; v += 2) {
        const __m512i w0 = _mm512_loadu_si512(c + 64 * v), w1 = _mm512_loadu_si512(c + 64 * v + 64);
        if (BITS == 4) {  // vector v: low nibbles k = 8v..8v+3, high nibbles 8v+4..8v+7
          const __m512i l0 = _mm512_and_si512(w0, low), h0 = _mm512_and_si512(_mm512_srli_epi16(w0, 4), low);
          const __m512i l1 = _mm512_and_si512(w1, low), h1 = _mm512_and_si512(_mm512_srli_epi16(w1, 4), low);
          for (int m = 0; m < R; ++m) {
            d[m][0] = _mm512_dpbusd_epi32(d[m][0], l0, _mm512_set1_epi32(QmmDword(x[m] + 8 * v)));
            d[m][1] = _mm512_dpbusd_epi32(d[m][1], h0, _mm512_set1_epi32(QmmDword(x[m] + 8 * v + 4)));
            d[m][0] = _mm512_dpbusd_epi32(d[m][0], l1, _mm512_set1_epi32(QmmDword(x[m] + 8 * v + 8)));
            d[m][1] = _mm512_dpbusd_epi32(d[m][1], h1, _mm512_set1_epi32(QmmDword(x[m] + 8 * v + 12)));
          }
        } else {  // vector v: k = 4v..4v+3
          for (int m = 0; m < R; ++m) {
            d[m][0] = _mm512_dpbusd_epi32(d[m][0], w0, _mm512_set1_epi32(QmmDword(x[m] + 4 * v)));
            d[m][1] = _mm512_dpbusd_epi32(d[m][1], w1, _mm512_set1_epi32(QmmDword(x[m] + 4 * v + 4)));
          }
        }
      }
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(params + 16 * g)));
      __m512 offset = _mm512_setzero_ps();
      if (MIN) {
        const __m512 minimum =
            _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(params + kQmmTile + 16 * g)));
        offset = _mm512_fmadd_ps(_mm512_set1_ps(zc), scale, minimum);
      }
      for (int m = 0; m < R; ++m) {
        const int64_t rb = (r + m) * a.blocks + b;
        const __m512i sum = _mm512_add_epi32(d[m][0], d[m][1]);
        const __m512 dot = _mm512_mul_ps(_mm512_set1_ps(a.xs[rb]), _mm512_cvtepi32_ps(sum));
        acc[m][g] = _mm512_fmadd_ps(scale, dot, acc[m][g]);
        if (MIN) acc[m][g] = _mm512_fmadd_ps(offset, _mm512_set1_ps(a.bsum[rb]), acc[m][g]);
      }
    }
  }
  for (int64_t j = 0; j < a.n_kept; ++j) {
    const half_t* row = QmmKeptRow(a, t, j);
    for (int g = 0; g < 4; ++g) {
      const __m512 w = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * g)));
      for (int m = 0; m < R; ++m)
        acc[m][g] = _mm512_fmadd_ps(w, _mm512_set1_ps(a.kept_x[(r + m) * a.n_kept + j]), acc[m][g]);
    }
  }
  for (int m = 0; m < R; ++m) {
    float* y = a.y + (r + m) * a.tiles * kQmmTile + t * kQmmTile;
    for (int g = 0; g < 4; ++g) _mm512_storeu_ps(y + 16 * g, acc[m][g]);
  }
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KV_QMM_VECTOR 1
#if defined(__AVXVNNI__)
constexpr const char* kQmmPath = "avx2-vnni";
#else
constexpr const char* kQmmPath = "avx2";
#endif

constexpr int kQmmRowTile = 4;  // rows sharing each code vector loaded and unpacked

// 8 columns per register: the 64-byte vectors go as two halves (h). Rows r .. r + R - 1 go
// together: each code vector is loaded and unpacked once for all of them (the accumulators live
// in L1, as one row's already did: 16 registers hold the codes, the row sums and constants).
//
// Without AVX-VNNI, vpmaddubsw makes pairs of u8 x s8 products into int16, at most 2 x 15 x 127
// = 3810 with 4-bit codes (8-bit ones go as their two nibbles, u = low + 16 high). Up to 8 of
// them add up in int16 (30480 < 32767) before one vpmaddwd widens the sum: a multiply per 32
// products, not two (vpmaddubsw and vpmaddwd share one port on AMD's Zen 2, two on Intel's).
template <int BITS, int BS, bool MIN, int R>
void QmmTile(const QmmWork& a, int64_t t, int64_t r) {
  constexpr int64_t group_bytes = 2 * BS * BITS, vectors = group_bytes / 64, zc = 1 << (BITS - 1);
#if defined(__AVXVNNI__)
  constexpr int64_t per_widening = vectors;  // vpdpbusd adds in int32
#else
  constexpr int64_t per_widening = BITS == 4 ? 4 : 8;  // vectors: 8 pair sums in each int16 lane
#endif
  // the code vectors a step of 2 vectors unpacks, once for all R rows, and the activations (a
  // dword at x + offset) each is multiplied by: 4-bit codes as low and high nibbles; 8-bit ones
  // whole (AVX-VNNI) or as nibbles, low and high with the same activations (chains 0 and 1,
  // widened apart: u = low + 16 high)
#if defined(__AVXVNNI__)
  constexpr int parts = BITS == 4 ? 4 : 2;
#else
  constexpr int parts = 4;
#endif
  const int64_t record = a.RecordBytes();
  const uint8_t* p = a.Tile(t);
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[R][8];
  for (int m = 0; m < R; ++m)
    for (int h = 0; h < 8; ++h) acc[m][h] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b, p += record) {
    for (int64_t line = 0; line < record; line += 64) __builtin_prefetch(p + kQmmPrefetch + line);
    const int8_t* x[R];
    for (int m = 0; m < R; ++m) x[m] = a.xq + (r + m) * a.k + b * BS;
    const half_t* params = reinterpret_cast<const half_t*>(p + 4 * group_bytes);
    for (int h = 0; h < 8; ++h) {  // columns 8h .. 8h + 7: group h / 2, half h % 2
      const uint8_t* c = p + (h / 2) * group_bytes + 32 * (h % 2);
      __m256i d[R][2];  // two chains: vpdpbusd's latency
      for (int m = 0; m < R; ++m) {
        d[m][0] = _mm256_set1_epi32(static_cast<int32_t>(-zc * a.xqsum[(r + m) * a.blocks + b]));
        d[m][1] = _mm256_setzero_si256();
      }
      for (int64_t first = 0; first < vectors; first += per_widening) {
        __m256i s[R][2];
        for (int m = 0; m < R; ++m) s[m][0] = s[m][1] = _mm256_setzero_si256();
        for (int64_t v = first; v < std::min(vectors, first + per_widening); v += 2) {
          const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * v));
          const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * v + 64));
          __m256i q[parts];
          int64_t at[parts];
          if constexpr (BITS == 4 || parts == 4) {
            q[0] = _mm256_and_si256(w0, low), q[1] = _mm256_and_si256(_mm256_srli_epi16(w0, 4), low);
            q[2] = _mm256_and_si256(w1, low), q[3] = _mm256_and_si256(_mm256_srli_epi16(w1, 4), low);
          } else {
            q[0] = w0, q[1] = w1;
          }
          if constexpr (BITS == 4) {
            at[0] = 8 * v, at[1] = 8 * v + 4, at[2] = 8 * v + 8, at[3] = 8 * v + 12;
          } else if constexpr (parts == 4) {
            at[0] = at[1] = 4 * v, at[2] = at[3] = 4 * v + 4;
          } else {
            at[0] = 4 * v, at[1] = 4 * v + 4;
          }
          for (int m = 0; m < R; ++m) {
            for (int i = 0; i < parts; ++i) {
              const __m256i xv = _mm256_set1_epi32(QmmDword(x[m] + at[i]));
#if defined(__AVXVNNI__)
              d[m][i % 2] = _mm256_dpbusd_avx_epi32(d[m][i % 2], q[i], xv);
#else  // between widenings, 4 sums in each chain at 4 bits (added before widening), 8 at 8 bits
              s[m][i % 2] = _mm256_add_epi16(s[m][i % 2], _mm256_maddubs_epi16(q[i], xv));
#endif
            }
          }
        }
#if !defined(__AVXVNNI__)
        for (int m = 0; m < R; ++m) {
          if constexpr (BITS == 4) {
            d[m][0] = _mm256_add_epi32(d[m][0], _mm256_madd_epi16(_mm256_add_epi16(s[m][0], s[m][1]),
                                                                  _mm256_set1_epi16(1)));
          } else {
            d[m][0] = _mm256_add_epi32(d[m][0], _mm256_madd_epi16(s[m][0], _mm256_set1_epi16(1)));
            d[m][1] = _mm256_add_epi32(d[m][1], _mm256_madd_epi16(s[m][1], _mm256_set1_epi16(16)));
          }
        }
#endif
      }
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(params + 8 * h)));
      __m256 offset = _mm256_setzero_ps();
      if (MIN) {
        const __m256 minimum =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(params + kQmmTile + 8 * h)));
        offset = _mm256_fmadd_ps(_mm256_set1_ps(zc), scale, minimum);
      }
      for (int m = 0; m < R; ++m) {
        const int64_t rb = (r + m) * a.blocks + b;
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(d[m][0], d[m][1]));
        acc[m][h] = _mm256_fmadd_ps(scale, _mm256_mul_ps(_mm256_set1_ps(a.xs[rb]), dot), acc[m][h]);
        if (MIN) acc[m][h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(a.bsum[rb]), acc[m][h]);
      }
    }
  }
  for (int64_t j = 0; j < a.n_kept; ++j) {
    const half_t* row = QmmKeptRow(a, t, j);
    for (int h = 0; h < 8; ++h) {
      const __m256 w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 8 * h)));
      for (int m = 0; m < R; ++m)
        acc[m][h] = _mm256_fmadd_ps(w, _mm256_set1_ps(a.kept_x[(r + m) * a.n_kept + j]), acc[m][h]);
    }
  }
  for (int m = 0; m < R; ++m) {
    float* y = a.y + (r + m) * a.tiles * kQmmTile + t * kQmmTile;
    for (int h = 0; h < 8; ++h) _mm256_storeu_ps(y + 8 * h, acc[m][h]);
  }
}

#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define KV_QMM_VECTOR 1
constexpr const char* kQmmPath = "neon-dotprod";

constexpr int kQmmRowTile = 4;  // rows sharing each code vector loaded and unpacked

// sdot is s8 x s8 with 4 products per int32 lane, the 4 activations by lane of a 16-byte register.
// 8-bit codes go centred (u xor 0x80 = q); 4-bit ones (0..15) as they are, less zc sum(xq) after.
// 4 columns per register: the 64-byte vectors go as quarters (q). Rows r .. r + R - 1 go together:
// each quarter is loaded and unpacked once for all of them (one row's 64 columns take 16 of the 32
// registers; with more rows the accumulators live in L1, the int32 sums in registers).
template <int BITS, int BS, bool MIN, int R>
void QmmTile(const QmmWork& a, int64_t t, int64_t r) {
  constexpr int64_t group_bytes = 2 * BS * BITS, vectors = group_bytes / 64, zc = 1 << (BITS - 1);
  const int64_t record = a.RecordBytes();
  const uint8_t* p = a.Tile(t);
  float32x4_t acc[R][16];
  for (int m = 0; m < R; ++m)
    for (int q = 0; q < 16; ++q) acc[m][q] = vdupq_n_f32(0.0f);
  for (int64_t b = 0; b < a.blocks; ++b, p += record) {
    for (int64_t line = 0; line < record; line += 64) __builtin_prefetch(p + kQmmPrefetch + line);
    const int8_t* x[R];
    int32x4_t centre[R];
    for (int m = 0; m < R; ++m) {
      x[m] = a.xq + (r + m) * a.k + b * BS;
      const int64_t rb = (r + m) * a.blocks + b;
      centre[m] = vdupq_n_s32(BITS == 4 ? static_cast<int32_t>(-zc * a.xqsum[rb]) : 0);
    }
    const half_t* params = reinterpret_cast<const half_t*>(p + 4 * group_bytes);
    for (int g = 0; g < 4; ++g) {
      const uint8_t* c = p + g * group_bytes;
      int32x4_t d[R][4];
      for (int m = 0; m < R; ++m)
        for (int q = 0; q < 4; ++q) d[m][q] = centre[m];
      // 16 activation bytes serve two vectors at 4 bits, four at 8
      for (int64_t v = 0; v < vectors; v += (BITS == 4 ? 2 : 4)) {
        int8x16_t xv[R];
        for (int m = 0; m < R; ++m) xv[m] = vld1q_s8(x[m] + v * (BITS == 4 ? 8 : 4));
        for (int q = 0; q < 4; ++q) {
          int8x16_t u[4];  // the codes each lane of xv multiplies
          if (BITS == 4) {
            const uint8x16_t w0 = vld1q_u8(c + 64 * v + 16 * q), w1 = vld1q_u8(c + 64 * v + 64 + 16 * q);
            u[0] = vreinterpretq_s8_u8(vandq_u8(w0, vdupq_n_u8(0x0F)));
            u[1] = vreinterpretq_s8_u8(vshrq_n_u8(w0, 4));
            u[2] = vreinterpretq_s8_u8(vandq_u8(w1, vdupq_n_u8(0x0F)));
            u[3] = vreinterpretq_s8_u8(vshrq_n_u8(w1, 4));
          } else {
            const uint8_t* cq = c + 64 * v + 16 * q;
            const uint8x16_t flip = vdupq_n_u8(0x80);
            for (int i = 0; i < 4; ++i) u[i] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(cq + 64 * i), flip));
          }
          for (int m = 0; m < R; ++m) {
            d[m][q] = vdotq_laneq_s32(d[m][q], u[0], xv[m], 0);
            d[m][q] = vdotq_laneq_s32(d[m][q], u[1], xv[m], 1);
            d[m][q] = vdotq_laneq_s32(d[m][q], u[2], xv[m], 2);
            d[m][q] = vdotq_laneq_s32(d[m][q], u[3], xv[m], 3);
          }
        }
      }
      for (int q = 0; q < 4; ++q) {
        const int col = 16 * g + 4 * q;
        const float32x4_t scale = vcvt_f32_f16(vld1_f16(params + col));
        float32x4_t offset = vdupq_n_f32(0.0f);
        if (MIN) offset = vfmaq_n_f32(vcvt_f32_f16(vld1_f16(params + kQmmTile + col)), scale, zc);
        for (int m = 0; m < R; ++m) {
          const int64_t rb = (r + m) * a.blocks + b;
          acc[m][4 * g + q] = vfmaq_f32(acc[m][4 * g + q], scale, vmulq_n_f32(vcvtq_f32_s32(d[m][q]), a.xs[rb]));
          if (MIN) acc[m][4 * g + q] = vfmaq_n_f32(acc[m][4 * g + q], offset, a.bsum[rb]);
        }
      }
    }
  }
  for (int64_t j = 0; j < a.n_kept; ++j) {
    const half_t* row = QmmKeptRow(a, t, j);
    for (int q = 0; q < 16; ++q) {
      const float32x4_t w = vcvt_f32_f16(vld1_f16(row + 4 * q));
      for (int m = 0; m < R; ++m) acc[m][q] = vfmaq_n_f32(acc[m][q], w, a.kept_x[(r + m) * a.n_kept + j]);
    }
  }
  for (int m = 0; m < R; ++m) {
    float* y = a.y + (r + m) * a.tiles * kQmmTile + t * kQmmTile;
    for (int q = 0; q < 16; ++q) vst1q_f32(y + 4 * q, acc[m][q]);
  }
}

#else
constexpr const char* kQmmPath = "scalar";
#endif

#if defined(KV_QMM_VECTOR)
// Tile by tile, each tile for every row, kQmmRowTile rows at a time where the path has registers
// for them (the tile's records still in cache for the rows after the first).
template <int BITS, int BS, bool MIN>
void QmmTiles(const QmmWork& a, int64_t first, int64_t last) {
  for (int64_t t = first; t < last; ++t) {
    int64_t r = 0;
    if constexpr (kQmmRowTile >= 4)
      for (; r + 4 <= a.rows; r += 4) QmmTile<BITS, BS, MIN, 4>(a, t, r);
    if constexpr (kQmmRowTile >= 4)  // 3 rows in one pass, not 2 + 1: the tile's codes unpacked once
      if (a.rows - r == 3) QmmTile<BITS, BS, MIN, 3>(a, t, r), r += 3;
    if constexpr (kQmmRowTile >= 2)
      for (; r + 2 <= a.rows; r += 2) QmmTile<BITS, BS, MIN, 2>(a, t, r);
    for (; r < a.rows; ++r) QmmTile<BITS, BS, MIN, 1>(a, t, r);
  }
}

template <int BITS, bool MIN>
void QmmVector(const QmmWork& a, int64_t first, int64_t last) {
  switch (a.block) {
    case 16: return QmmTiles<BITS, 16, MIN>(a, first, last);
    case 32: return QmmTiles<BITS, 32, MIN>(a, first, last);
    case 64: return QmmTiles<BITS, 64, MIN>(a, first, last);
    case 128: return QmmTiles<BITS, 128, MIN>(a, first, last);
    case 256: return QmmTiles<BITS, 256, MIN>(a, first, last);
  }
}
#endif

// Tiles [first, last) of every row, on the compiled vector path (`vector`; the scalar one without).
void QmmRange(const QmmWork& a, int64_t first, int64_t last, bool vector) {
#if defined(KV_QMM_VECTOR)
  if (vector) {
    if (a.bits == 4) a.minimums ? QmmVector<4, true>(a, first, last) : QmmVector<4, false>(a, first, last);
    else a.minimums ? QmmVector<8, true>(a, first, last) : QmmVector<8, false>(a, first, last);
    return;
  }
#endif
  (void)vector;
  QmmScalar(a, first, last);
}

// Work items of ~128 KiB of weights, whole tiles: onnxruntime's threads split N.
int64_t QmmTilesPerItem(int64_t tile_bytes) { return std::max<int64_t>(1, kQmmItemBytes / tile_bytes); }

void QmmWork::Run(size_t item) const {
  const int64_t first = static_cast<int64_t>(item) * tiles_per_item;
  QmmRange(*this, first, std::min(tiles, first + tiles_per_item), true);
}

struct QmmKernel {
  int64_t bits = 0, block = 0, minimums = 0;

  OrtStatus* Compute(OrtKernelContext* context) const;
};

OrtStatus* QmmKernel::Compute(OrtKernelContext* ctx) const {
  constexpr const char* op = "QuantMatMul";
  constexpr const char* names[3] = {"x", "weights", "kept"};
  size_t n_inputs = 0;
  KV_RETURN_IF_ERROR(g_api->KernelContext_GetInputCount(ctx, &n_inputs));
  // per thread, kept: their shape vectors are reused, so a decode step allocates nothing
  thread_local Tensor in[3], y;
  thread_local std::vector<int64_t> shape;
  bool present[3] = {};
  for (size_t i = 0; i < 3 && i < n_inputs; ++i) {
    const OrtValue* value = nullptr;
    KV_RETURN_IF_ERROR(g_api->KernelContext_GetInput(ctx, i, &value));
    if (value == nullptr) continue;  // an optional input left out
    KV_RETURN_IF_ERROR(Describe(value, &in[i]));
    present[i] = true;
  }
  for (size_t i = 0; i < 2; ++i)
    if (!present[i]) return Fail(std::string("input ") + names[i] + " is missing", op);
  const Tensor &x = in[0], &weights = in[1], &kept = in[2];
  if (x.shape.empty()) return Fail("x must have at least one dimension (its channels)", op);
  const int64_t k = x.shape.back(), rows = k > 0 ? x.size() / k : 0;
  if (k <= 0 || k % block)
    return Fail("x has " + std::to_string(k) + " channels, not a positive multiple of block_size " +
                std::to_string(block), op);
  int64_t n_kept = 0;
  if (present[2]) {
    if (kept.shape.size() != 1) return Fail("kept must be [kept], got " + ShapeText(kept.shape), op);
    n_kept = kept.shape[0];
  }
  const int64_t* channels = static_cast<const int64_t*>(kept.data);
  for (int64_t j = 0; j < n_kept; ++j) {
    if (channels[j] < 0 || channels[j] >= k || (j > 0 && channels[j] <= channels[j - 1]))
      return Fail("kept channel " + std::to_string(channels[j]) + " (position " + std::to_string(j) +
                  ") is outside x's " + std::to_string(k) + " channels or not above the one before", op);
  }
  QmmWork work{};
  work.bits = static_cast<int>(bits);
  work.block = block;
  work.minimums = minimums != 0;
  work.blocks = k / block;
  work.n_kept = n_kept;
  const int64_t blocks = work.blocks, record = work.RecordBytes(), tile_bytes = work.TileBytes();
  if (weights.shape.size() != 2 || weights.shape[0] <= 0 || weights.shape[1] != tile_bytes)
    return Fail("weights must be [N / 64, " + std::to_string(tile_bytes) + "] (" + std::to_string(blocks) +
                " records of " + std::to_string(record) + " bytes, then " + std::to_string(n_kept) +
                " kept rows of 128) for " + std::to_string(k) + " channels at bits " + std::to_string(bits) +
                ", block_size " + std::to_string(block) + ", minimums " + std::to_string(minimums) + ", got " +
                ShapeText(weights.shape), op);
  const int64_t tiles = weights.shape[0];

  shape.assign(x.shape.begin(), x.shape.end());
  shape.back() = tiles * kQmmTile;
  OrtValue* value = nullptr;
  KV_RETURN_IF_ERROR(g_api->KernelContext_GetOutput(ctx, 0, shape.data(), shape.size(), &value));
  KV_RETURN_IF_ERROR(Describe(value, &y));
  if (rows == 0) return nullptr;

  // the activations, quantized once per call, into per-thread buffers kept like the above
  thread_local std::vector<float> masked, scale_sum, kept_x;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<int32_t> xqsum;
  const float* input = static_cast<const float*>(x.data);  // [rows, k]
  masked.resize(k);
  scale_sum.resize(2 * rows * blocks);
  kept_x.resize(rows * n_kept);
  xq.resize(rows * k);
  xqsum.resize(rows * blocks);
  float *xs = scale_sum.data(), *bsum = xs + rows * blocks;
  for (int64_t r = 0; r < rows; ++r)
    QmmQuantize(input, k, block, channels, n_kept, r, masked.data(), xq.data(), xs, bsum, xqsum.data(), kept_x.data());

  work.weights = static_cast<const uint8_t*>(weights.data);
  work.xq = xq.data();
  work.xs = xs;
  work.bsum = bsum;
  work.xqsum = xqsum.data();
  work.kept_x = kept_x.data();
  work.y = static_cast<float*>(y.data);
  work.rows = rows;
  work.k = k;
  work.tiles = tiles;
  work.tiles_per_item = QmmTilesPerItem(tile_bytes);
  const size_t items = static_cast<size_t>((tiles + work.tiles_per_item - 1) / work.tiles_per_item);
  if (items == 1) {
    work.Run(0);
    return nullptr;
  }
  return g_api->KernelContext_ParallelFor(
      ctx, [](void* data, size_t item) { static_cast<const QmmWork*>(data)->Run(item); }, items, 0, &work);
}

// ---- OrtCustomOp plumbing (C API) ----

const ONNXTensorElementDataType kInputTypes[8] = {
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,   ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8,    ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,   ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
const ONNXTensorElementDataType kOutputTypes[5] = {
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16};

// The end of every Create*Kernel: `k` handed to onnxruntime, or deleted with the failure.
template <typename K>
OrtStatus* Handed(K* k, OrtStatus* status, void** kernel) {
  if (status != nullptr) {
    delete k;
    return status;
  }
  *kernel = k;
  return nullptr;
}

// num_heads and kv_num_heads (required), local_window_size (default -1: none) and decode_steps
// (default 1: one-token calls only) into `a`, checked; the error names `op`.
OrtStatus* ReadAttention(const OrtApi* api, const OrtKernelInfo* info, const char* op, AttentionAttributes* a) {
  for (auto [name, target] : {std::pair<const char*, int64_t*>{"num_heads", &a->heads}, {"kv_num_heads", &a->kv_heads}}) {
    OrtStatus* absent = api->KernelInfoGetAttribute_int64(info, name, target);
    if (absent != nullptr) {
      api->ReleaseStatus(absent);
      return Fail(std::string("attribute ") + name + " is required", op);
    }
  }
  if (a->kv_heads <= 0 || a->heads <= 0 || a->heads % a->kv_heads)
    return Fail("num_heads " + std::to_string(a->heads) + " is not a positive multiple of kv_num_heads " +
                std::to_string(a->kv_heads), op);
  for (auto [name, target, fallback] : {std::tuple<const char*, int64_t*, int64_t>{"local_window_size", &a->window, -1},
                                        {"decode_steps", &a->decode_steps, 1}}) {
    OrtStatus* absent = api->KernelInfoGetAttribute_int64(info, name, target);
    if (absent != nullptr) {
      api->ReleaseStatus(absent);
      *target = fallback;
    }
  }
  if (a->window == 0 || a->window < -1)
    return Fail("local_window_size " + std::to_string(a->window) + " must be -1 (no window) or positive", op);
  if (a->decode_steps < 1)
    return Fail("decode_steps " + std::to_string(a->decode_steps) + " must be 1 or more", op);
  return nullptr;
}

OrtStatusPtr ORT_API_CALL CreateKernelV2(const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo* info,
                                         void** kernel) {
  auto* k = new Kernel();
  OrtStatus* status = ReadAttention(api, info, "Int8CacheAttention", k);
  return Handed(k, status, kernel);
}

OrtStatusPtr ORT_API_CALL KernelComputeV2(void* kernel, OrtKernelContext* context) {
  return static_cast<Kernel*>(kernel)->Compute(context);
}

void ORT_API_CALL KernelDestroy(void* kernel) { delete static_cast<Kernel*>(kernel); }

// What every kvedge op declares alike: CPU, this C API version, every opset, default memory, no
// variadic inputs or outputs. Each op below sets its name, types, characteristics and kernel.
struct CpuOp : OrtCustomOp {
  CpuOp() {
    std::memset(static_cast<OrtCustomOp*>(this), 0, sizeof(OrtCustomOp));
    version = kMinApiVersion;
    GetExecutionProviderType = [](const OrtCustomOp*) { return "CPUExecutionProvider"; };
    GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
    GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
    GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
    GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
    GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
    GetStartVersion = [](const OrtCustomOp*) { return 1; };
    GetEndVersion = [](const OrtCustomOp*) { return 2147483647; };
  }
};

struct Int8CacheAttentionOp : CpuOp {
  Int8CacheAttentionOp() {
    GetName = [](const OrtCustomOp*) { return "Int8CacheAttention"; };
    GetInputType = [](const OrtCustomOp*, size_t i) { return kInputTypes[i]; };
    GetInputTypeCount = [](const OrtCustomOp*) { return size_t{8}; };
    GetOutputType = [](const OrtCustomOp*, size_t i) { return kOutputTypes[i]; };
    GetOutputTypeCount = [](const OrtCustomOp*) { return size_t{5}; };
    KernelDestroy = ::KernelDestroy;
    GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
    GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
    CreateKernelV2 = ::CreateKernelV2;
    KernelComputeV2 = ::KernelComputeV2;
  }
};

const ONNXTensorElementDataType kSideInputTypes[2] = {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
                                                     ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64};

OrtStatusPtr ORT_API_CALL CreateSideKernel(const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo* info,
                                           void** kernel) {
  auto* k = new SideKernel();
  OrtStatus* status = api->KernelInfoGetAttribute_int64(info, "block_size", &k->block);
  if (status == nullptr && k->block < 0)
    status = Fail("block_size " + std::to_string(k->block) + " must be 0 (no block sums) or positive", "SideInputs");
  return Handed(k, status, kernel);
}

struct SideInputsOp : CpuOp {
  SideInputsOp() {
    GetName = [](const OrtCustomOp*) { return "SideInputs"; };
    GetInputType = [](const OrtCustomOp*, size_t i) { return kSideInputTypes[i]; };
    GetInputTypeCount = [](const OrtCustomOp*) { return size_t{2}; };
    GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; };
    GetOutputTypeCount = [](const OrtCustomOp*) { return size_t{2}; };
    KernelDestroy = [](void* kernel) { delete static_cast<SideKernel*>(kernel); };
    GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
    GetOutputCharacteristic = [](const OrtCustomOp*, size_t i) {
      return i == 0 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;  // masked: only with kept channels
    };
    CreateKernelV2 = CreateSideKernel;
    KernelComputeV2 = [](void* kernel, OrtKernelContext* context) {
      return static_cast<SideKernel*>(kernel)->Compute(context);
    };
  }
};

const ONNXTensorElementDataType kQmmInputTypes[3] = {
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64};

OrtStatusPtr ORT_API_CALL CreateQmmKernel(const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo* info,
                                          void** kernel) {
  auto* k = new QmmKernel();
  OrtStatus* status = nullptr;
  for (auto [name, target] : {std::pair<const char*, int64_t*>{"bits", &k->bits}, {"block_size", &k->block},
                               {"minimums", &k->minimums}}) {
    OrtStatus* absent = api->KernelInfoGetAttribute_int64(info, name, target);
    if (absent != nullptr) {
      api->ReleaseStatus(absent);
      status = Fail(std::string("attribute ") + name + " is required", "QuantMatMul");
      break;
    }
  }
  if (status == nullptr && k->bits != 4 && k->bits != 8)
    status = Fail("bits " + std::to_string(k->bits) + " is not supported; allowed: 4, 8", "QuantMatMul");
  if (status == nullptr && k->block != 16 && k->block != 32 && k->block != 64 && k->block != 128 && k->block != 256)
    status = Fail("block_size " + std::to_string(k->block) + " is not supported; allowed: 16, 32, 64, 128, 256",
                  "QuantMatMul");
  if (status == nullptr && k->minimums != 0 && k->minimums != 1)
    status = Fail("minimums " + std::to_string(k->minimums) + " is not supported; allowed: 0, 1", "QuantMatMul");
  return Handed(k, status, kernel);
}

struct QuantMatMulOp : CpuOp {
  QuantMatMulOp() {
    GetName = [](const OrtCustomOp*) { return "QuantMatMul"; };
    GetInputType = [](const OrtCustomOp*, size_t i) { return kQmmInputTypes[i]; };
    GetInputTypeCount = [](const OrtCustomOp*) { return size_t{3}; };
    GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; };
    GetOutputTypeCount = [](const OrtCustomOp*) { return size_t{1}; };
    KernelDestroy = [](void* kernel) { delete static_cast<QmmKernel*>(kernel); };
    GetInputCharacteristic = [](const OrtCustomOp*, size_t i) {
      return i < 2 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;  // kept
    };
    GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
    CreateKernelV2 = CreateQmmKernel;
    KernelComputeV2 = [](void* kernel, OrtKernelContext* context) {
      return static_cast<QmmKernel*>(kernel)->Compute(context);
    };
  }
};

const ONNXTensorElementDataType kKv4InputTypes[10] = {
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,   ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16, ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,   ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
    ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};

OrtStatusPtr ORT_API_CALL CreateKv4Kernel(const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo* info,
                                          void** kernel) {
  constexpr const char* op = "Int4CacheAttention";
  auto* k = new Kv4Kernel();
  OrtStatus* status = ReadAttention(api, info, op, k);
  if (status == nullptr) {
    OrtStatus* absent = api->KernelInfoGetAttribute_int64(info, "key_bits", &k->key_bits);
    if (absent != nullptr) {
      api->ReleaseStatus(absent);
      status = Fail("attribute key_bits is required", op);
    } else if (k->key_bits != 5 && k->key_bits != 8) {
      status = Fail("key_bits " + std::to_string(k->key_bits) + " is not supported; allowed: 5, 8", op);
    }
  }
  if (status == nullptr) {  // optional: absent means 32
    OrtStatus* absent = api->KernelInfoGetAttribute_int64(info, "window", &k->float_window);
    if (absent != nullptr) {
      api->ReleaseStatus(absent);
      k->float_window = 32;
    } else if (k->float_window < 0) {
      status = Fail("window " + std::to_string(k->float_window) + " must be 0 or more", op);
    }
  }
  return Handed(k, status, kernel);
}

struct Int4CacheAttentionOp : CpuOp {
  Int4CacheAttentionOp() {
    GetName = [](const OrtCustomOp*) { return "Int4CacheAttention"; };
    GetInputType = [](const OrtCustomOp*, size_t i) { return kKv4InputTypes[i]; };
    GetInputTypeCount = [](const OrtCustomOp*) { return size_t{10}; };
    GetOutputType = [](const OrtCustomOp*, size_t i) { return kKv4InputTypes[i == 0 ? 0 : i + 1]; };
    GetOutputTypeCount = [](const OrtCustomOp*) { return size_t{7}; };
    KernelDestroy = [](void* kernel) { delete static_cast<Kv4Kernel*>(kernel); };
    GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
    GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
    CreateKernelV2 = CreateKv4Kernel;
    KernelComputeV2 = [](void* kernel, OrtKernelContext* context) {
      return static_cast<Kv4Kernel*>(kernel)->Compute(context);
    };
  }
};

Int8CacheAttentionOp g_op;
Int4CacheAttentionOp g_kv4_op;
SideInputsOp g_side_op;
QuantMatMulOp g_qmm_op;

}  // namespace

extern "C" {

// The entry point onnxruntime looks up (SessionOptions.register_custom_ops_library).
__attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                                                const OrtApiBase* api_base) {
  g_api = api_base->GetApi(kMinApiVersion);
  if (g_api == nullptr) return nullptr;  // onnxruntime older than 1.17: the session then reports the op unknown
  // One domain for the process (it must outlive every session that uses it), made on first use.
  static OrtCustomOpDomain* domain = nullptr;
  static OrtStatus* made = [] {
    OrtStatus* status = g_api->CreateCustomOpDomain("kvedge", &domain);
    if (status == nullptr) status = g_api->CustomOpDomain_Add(domain, &g_op);
    if (status == nullptr) status = g_api->CustomOpDomain_Add(domain, &g_kv4_op);
    if (status == nullptr) status = g_api->CustomOpDomain_Add(domain, &g_side_op);
    return status != nullptr ? status : g_api->CustomOpDomain_Add(domain, &g_qmm_op);
  }();
  if (made != nullptr) return g_api->CreateStatus(g_api->GetErrorCode(made), g_api->GetErrorMessage(made));
  return g_api->AddCustomOpDomain(options, domain);
}

// The library's format version: the Python side refuses a library built from other sources.
__attribute__((visibility("default"))) int kvedge_ops_version() { return 9; }

}  // extern "C"
