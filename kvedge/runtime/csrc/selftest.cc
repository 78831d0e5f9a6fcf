// Self-test of kvedge_ops.cc's attention arithmetic, without onnxruntime: every vectorized
// (head_dim, group size) instantiation against the one-channel-at-a-time path (AttendAny), over
// random caches. With no argument, the decode path (Attend) with decode-like and prefill-like
// query blocks; with `tiled`, the prefill path (AttendPrefill) at several cache block sizes, row
// counts and lengths, and whole calls cut into work items (Work) of several tile sizes, ragged
// last tiles and past lengths that are no multiple of a tile, and decode steps whose cache is
// split into blocks (the op's own split and blocks of our own, lengths that are no multiple of a
// block, blocks a row has no position in) run on several threads. With `side`, kvedge.SideInputs'
// rows (SideRows, through SideWork's items) against block sums in double precision, the kept
// channels and the masked x exactly. With `qmm`, kvedge.QuantMatMul's compiled vector path
// (through QmmWork's items, on threads) and its scalar path against the op's formula in double
// precision. Built and run by tests/test_kv_int8.py, tests/test_side_inputs.py and
// tests/test_quant_matmul.py (natively, for other x86 paths, and for aarch64 under qemu when a
// cross compiler is present). Prints one line per case and exits non-zero on the first mismatch.

#include "kvedge_ops.cc"

#include <atomic>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>

namespace {

// The attention of AttendAny in double precision: the reference of the tiled cases, whose float
// sums run in another order than AttendAny's (a float reference would add its own rounding).
void AttendExact(int64_t d, const Block& b) {
  const int64_t group_size = d / b.groups;
  for (int64_t i = 0; i < b.n_rows; ++i) {
    const int64_t n = b.limit[i];
    std::vector<double> s(n), out(d, 0.0);
    double top = -INFINITY, sum = 0.0;
    for (int64_t p = b.first[i]; p < n; ++p) {
      double dot = 0.0;
      for (int64_t c = 0; c < d; ++c)
        dot += double(b.q[i * d + c]) * b.k_codes[p * d + c] * double(b.k_scales[p * b.groups + c / group_size]);
      top = std::max(top, s[p] = dot);
    }
    for (int64_t p = b.first[i]; p < n; ++p) sum += (s[p] = std::exp(s[p] - top));
    for (int64_t p = b.first[i]; p < n; ++p)
      for (int64_t c = 0; c < d; ++c)
        out[c] += s[p] / sum * double(b.v_scales[p * b.groups + c / group_size]) * b.v_codes[p * d + c];
    for (int64_t c = 0; c < d; ++c) b.out[i][c] = static_cast<float>(out[c]);
  }
}

// kb: the cache block of the tiled path under test, 0 for the decode path (Attend); window: keys
// per query row (its own included), 0 for none.
int Check(int64_t d, int64_t group_size, int64_t n_rows, int64_t longest, int kb, int64_t window,
          std::mt19937* rng) {
  const int64_t groups = d / group_size, cache_len = longest + 3;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> code(-127, 127);
  std::vector<int8_t> k(cache_len * d), v(cache_len * d);
  std::vector<half_t> ks(cache_len * groups), vs(cache_len * groups);
  for (auto& c : k) c = static_cast<int8_t>(code(*rng));
  for (auto& c : v) c = static_cast<int8_t>(code(*rng));
  for (auto& s : ks) s = static_cast<half_t>(0.002f + 0.01f * std::fabs(normal(*rng)));
  for (auto& s : vs) s = static_cast<half_t>(0.002f + 0.01f * std::fabs(normal(*rng)));
  std::vector<float> q(n_rows * d), want(n_rows * d), got(n_rows * d), scores(n_rows * cache_len), scratch;
  for (auto& x : q) x = normal(*rng);
  Block b;
  b.n_rows = n_rows;
  for (int64_t i = 0; i < n_rows; ++i) {
    b.limit[i] = longest - (n_rows - 1 - i) / 3;  // causal, 3 heads per token
    b.first[i] = window ? std::max<int64_t>(b.limit[i] - window, 0) : 0;
  }
  b.q = q.data();
  b.scores = scores.data();
  b.stride = cache_len;
  b.k_codes = k.data();
  b.v_codes = v.data();
  b.k_scales = ks.data();
  b.v_scales = vs.data();
  b.groups = groups;
  for (int64_t i = 0; i < n_rows; ++i) b.out[i] = want.data() + i * d;
  if (kb) AttendExact(d, b);
  else AttendAny(d, b);
  for (int64_t i = 0; i < n_rows; ++i) b.out[i] = got.data() + i * d;
  bool done = true;
  switch (kb) {
    case 0: Attend(d, b, &scratch); break;
    case 16: done = AttendPrefill<16>(d, b, &scratch); break;
    case 36: done = AttendPrefill<36>(d, b, &scratch); break;
    case kKeyBlock: done = AttendPrefill<kKeyBlock>(d, b, &scratch); break;
  }
  if (!done) {
    std::printf("FAIL no tiled path for head_dim %lld group %lld\n", static_cast<long long>(d),
                static_cast<long long>(group_size));
    return 1;
  }
  float worst = 0.0f, scale = 0.0f;
  for (size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, std::fabs(want[i] - got[i]));
    scale = std::max(scale, std::fabs(want[i]));
  }
  const bool ok = worst <= 1e-5f * std::max(1.0f, scale);
  std::printf("%s %shead_dim %lld group %lld rows %lld positions %lld window %lld: max |diff| %.3g (max |out| %.3g)\n",
              ok ? "ok  " : "FAIL", kb ? ("tiled, cache block " + std::to_string(kb) + ", ").c_str() : "",
              static_cast<long long>(d), static_cast<long long>(group_size), static_cast<long long>(n_rows),
              static_cast<long long>(longest), static_cast<long long>(window), worst, scale);
  return ok ? 0 : 1;
}

// A whole call's attention as the op runs it (Work: its items on `threads` threads taking the
// next item as they finish, as onnxruntime's pool does, then Combine) against AttendExact one
// query row at a time: batch 2 rows with different past lengths, `seq` new tokens each.
// rows_per_item / keys: a query block / cache block of our own instead of the op's (0: the op's).
// window: the op's local_window_size (-1: none); the reference reads only the window's keys.
int CheckWork(int64_t d, int64_t group_size, int64_t heads, int64_t kv_heads, int64_t seq, int64_t past0,
              bool tiled, int64_t rows_per_item, int64_t keys, int threads, int64_t window, std::mt19937* rng) {
  const int64_t batch = 2, cache_len = past0 + 9 + seq, groups = d / group_size, width = (heads + 2 * kv_heads) * d;
  const int64_t past[batch] = {past0, past0 + 9};
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> code(-127, 127);
  std::vector<int8_t> k(batch * kv_heads * cache_len * d), v(k.size());
  std::vector<half_t> ks(batch * kv_heads * cache_len * groups), vs(ks.size());
  for (auto& c : k) c = static_cast<int8_t>(code(*rng));
  for (auto& c : v) c = static_cast<int8_t>(code(*rng));
  for (auto& s : ks) s = static_cast<half_t>(0.002f + 0.01f * std::fabs(normal(*rng)));
  for (auto& s : vs) s = static_cast<half_t>(0.002f + 0.01f * std::fabs(normal(*rng)));
  std::vector<float> x(batch * seq * width), cos(cache_len * d / 2), sin(cos.size());
  for (auto& e : x) e = normal(*rng);
  for (size_t i = 0; i < cos.size(); ++i) {
    cos[i] = std::cos(0.01f * i);
    sin[i] = std::sin(0.01f * i);
  }
  std::vector<float> got(batch * seq * heads * d, NAN), want(got.size()), q(d), scores(cache_len), scratch;
  Work work;
  work.x = x.data();
  work.y = got.data();
  work.past = past;
  work.cos = cos.data();
  work.sin = sin.data();
  work.k_codes = k.data();
  work.v_codes = v.data();
  work.k_scales = ks.data();
  work.v_scales = vs.data();
  work.batch = batch;
  work.seq = seq;
  work.heads = heads;
  work.kv_heads = kv_heads;
  work.d = d;
  work.groups = groups;
  work.cache_len = cache_len;
  work.width = width;
  work.window = window;
  std::vector<float> partials;
  work.Split(&partials);
  if (rows_per_item) {  // a tile size of our own instead of the op's
    work.tiled = tiled;
    work.rows_per_item = rows_per_item;
    work.blocks = (heads / kv_heads * seq + rows_per_item - 1) / rows_per_item;
    work.SplitKeys(work.longest, &partials);
  }
  if (keys) work.SplitKeys(keys, &partials);
  std::atomic<size_t> next{0};
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i) {
    pool.emplace_back([&] {
      for (size_t item; (item = next++) < work.Items();) work.Run(item);
    });
  }
  for (std::thread& thread : pool) thread.join();
  work.Combine();
  for (int64_t r = 0; r < batch; ++r) {
    for (int64_t t = 0; t < seq; ++t) {
      for (int64_t head = 0; head < heads; ++head) {
        const int64_t pos = past[r] + t, base = (r * kv_heads + head / (heads / kv_heads)) * cache_len;
        Rotate(x.data() + (r * seq + t) * width + head * d, cos.data() + pos * d / 2, sin.data() + pos * d / 2, d,
               q.data());
        Block b;
        b.n_rows = 1;
        b.limit[0] = pos + 1;
        b.first[0] = window > 0 ? std::max<int64_t>(pos + 1 - window, 0) : 0;
        b.out[0] = want.data() + ((r * seq + t) * heads + head) * d;
        b.q = q.data();
        b.scores = scores.data();
        b.stride = cache_len;
        b.k_codes = k.data() + base * d;
        b.v_codes = v.data() + base * d;
        b.k_scales = ks.data() + base * groups;
        b.v_scales = vs.data() + base * groups;
        b.groups = groups;
        AttendExact(d, b);
      }
    }
  }
  float worst = 0.0f, scale = 0.0f;
  for (size_t i = 0; i < want.size(); ++i) {
    const float diff = std::fabs(want[i] - got[i]);
    worst = std::isnan(diff) ? INFINITY : std::max(worst, diff);  // a row never written stays NaN
    scale = std::max(scale, std::fabs(want[i]));
  }
  const bool ok = worst <= 1e-5f * std::max(1.0f, scale);
  std::printf("%s work items (%s, %lld rows each, %lld cache blocks of %lld, %d threads): head_dim %lld group %lld "
              "heads %lld/%lld new %lld past %lld, %lld window %lld: max |diff| %.3g\n",
              ok ? "ok  " : "FAIL", work.tiled ? "tiled" : "decode blocks", static_cast<long long>(work.rows_per_item),
              static_cast<long long>(work.splits), static_cast<long long>(work.span), threads,
              static_cast<long long>(d), static_cast<long long>(group_size), static_cast<long long>(heads),
              static_cast<long long>(kv_heads), static_cast<long long>(seq), static_cast<long long>(past[0]),
              static_cast<long long>(past[1]), static_cast<long long>(window), worst);
  return ok ? 0 : 1;
}

// kvedge.SideInputs over x [rows, k] with `n_kept` distinct kept channels (the first and the last
// among them from 2 on), split into work items of `rows_per_item` rows (0: the op's own), with or
// without the masked output: block sums equal to the float32 sums from the block's first channel to
// its last, one addition at a time, to the bit (what the standard-op graph computes); kept channels
// and masked x exact. Also printed: how far that sum is from the double-precision one.
int CheckSide(int64_t rows, int64_t k, int64_t block, int64_t n_kept, int64_t rows_per_item, bool masked,
              std::mt19937* rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(rows * k);
  for (auto& e : x) e = normal(*rng) * (1.0f + 30.0f * (std::fabs(normal(*rng)) > 2.5f));  // some outliers
  std::vector<int64_t> channels(k);
  for (int64_t c = 0; c < k; ++c) channels[c] = c;
  std::shuffle(channels.begin() + 1, channels.end() - 1, *rng);
  std::vector<int64_t> kept;
  if (n_kept >= 2) kept = {k - 1, 0};
  for (int64_t c = 1; static_cast<int64_t>(kept.size()) < n_kept; ++c) kept.push_back(channels[c]);
  const int64_t blocks = block ? k / block : 0, width = blocks + n_kept;
  std::vector<float> side(rows * width, NAN), out(masked ? rows * k : 0, NAN);
  SideWork work{x.data(), side.data(), masked ? out.data() : nullptr, kept.data(), k, block, n_kept, rows,
                rows_per_item ? rows_per_item : std::max<int64_t>(1, 32768 / k)};
  for (int64_t item = 0; item * work.rows_per_item < rows; ++item) work.Run(static_cast<size_t>(item));
  float worst = 0.0f;
  bool exact = true;
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = x.data() + r * k;
    for (int64_t b = 0; b < blocks; ++b) {
      double sum = 0.0, size = 0.0;
      float in_order = 0.0f;
      for (int64_t c = b * block; c < (b + 1) * block; ++c) {
        sum += in[c];
        size += std::fabs(in[c]);
        in_order += in[c];
      }
      exact &= side[r * width + b] == in_order;
      worst = std::max(worst, std::fabs(static_cast<float>(sum - in_order)) / static_cast<float>(size));
    }
    for (int64_t i = 0; i < n_kept; ++i) exact &= side[r * width + blocks + i] == in[kept[i]];
    for (int64_t c = 0; masked && c < k; ++c) {
      const bool zeroed = std::find(kept.begin(), kept.end(), c) != kept.end();
      exact &= out[r * k + c] == (zeroed ? 0.0f : in[c]);
    }
  }
  const bool ok = exact;
  std::printf("%s side inputs: rows %lld channels %lld block %lld kept %lld, items of %lld rows, %s: "
              "block sums, kept and masked %s (in-order sums within %.3g of the block's sum |x| of exact)\n",
              ok ? "ok  " : "FAIL", static_cast<long long>(rows), static_cast<long long>(k),
              static_cast<long long>(block), static_cast<long long>(n_kept),
              static_cast<long long>(work.rows_per_item), masked ? "masked" : "no masked output",
              exact ? "exact" : "WRONG", worst);
  return ok ? 0 : 1;
}

// kvedge.QuantMatMul over x [rows, k] and a random weight of n columns (tiles packed here from
// u [k, n] the way pack_quant_matmul packs them: records, then the kept rows), `n_kept` kept
// channels (the first and the last among them from 2 on), with or without minimums: the vector
// path (QmmWork's items of `per_item` tiles, 0: the op's own, on `threads` threads) and the scalar
// path (QmmScalar), each within 1e-5 of max |y| of the formula in double precision over the op's
// quantized activations. Row 0's first block is constant (every xq 127) and every group's column 1
// holds the largest code, where int16 pair sums would saturate; row 0's second block is zero
// (amax 0).
int CheckQmm(int bits, int64_t block, int64_t rows, int64_t k, int64_t n, int64_t n_kept, bool with_min,
             int64_t per_item, int threads, std::mt19937* rng) {
  const int64_t tiles = n / kQmmTile, blocks = k / block, top = (1 << bits) - 1, zc = 1 << (bits - 1);
  QmmWork work{};
  work.bits = bits;
  work.block = block;
  work.minimums = with_min;
  work.blocks = blocks;
  work.n_kept = n_kept;
  const int64_t group_bytes = work.GroupBytes(), record = work.RecordBytes(), tile_bytes = work.TileBytes();
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> code(0, static_cast<int>(top));
  std::vector<uint8_t> u(k * n), weights(tiles * tile_bytes);  // u: [k, n]
  for (int64_t c = 0; c < k; ++c)
    for (int64_t j = 0; j < n; ++j) u[c * n + j] = static_cast<uint8_t>(j % 16 == 1 ? top : code(*rng));
  std::vector<float> scales(blocks * n), minimums(blocks * n);  // [blocks, n], float16 values
  for (auto& s : scales) s = static_cast<half_t>((0.002f + 0.01f * std::fabs(normal(*rng))) * (bits == 4 ? 16 : 1));
  for (size_t i = 0; i < minimums.size(); ++i)
    minimums[i] = static_cast<half_t>(-scales[i] * zc + (with_min ? 0.01f * normal(*rng) : 0.0f));
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* out = weights.data() + t * tile_bytes + b * record;
      for (int64_t col = 0; col < kQmmTile; ++col) {
        const int64_t g = col / 16, i = col % 16, j = t * kQmmTile + col;
        for (int64_t c = 0; c < block; ++c) {
          const uint8_t value = u[(b * block + c) * n + j];
          if (bits == 4) out[g * group_bytes + (c / 8) * 64 + 4 * i + c % 4] |= (c % 8) < 4 ? value : value << 4;
          else out[g * group_bytes + (c / 4) * 64 + 4 * i + c % 4] = value;
        }
        half_t* params = reinterpret_cast<half_t*>(out + 4 * group_bytes);
        params[col] = static_cast<half_t>(scales[b * n + j]);
        if (with_min) params[kQmmTile + col] = static_cast<half_t>(minimums[b * n + j]);
      }
    }
  }
  std::vector<int64_t> channels(k), kept;
  for (int64_t c = 0; c < k; ++c) channels[c] = c;
  std::shuffle(channels.begin() + 1, channels.end() - 1, *rng);
  if (n_kept >= 2) kept = {0, k - 1};
  for (int64_t c = 1; static_cast<int64_t>(kept.size()) < n_kept; ++c) kept.push_back(channels[c]);
  std::sort(kept.begin(), kept.end());
  std::vector<float> kept_rows(n_kept * n);  // [n_kept, n] float16 values, each tile's after its records
  for (int64_t t = 0; t < tiles; ++t) {
    half_t* out = reinterpret_cast<half_t*>(weights.data() + t * tile_bytes + blocks * record);
    for (int64_t j = 0; j < n_kept; ++j) {
      for (int64_t col = 0; col < kQmmTile; ++col) {
        out[j * kQmmTile + col] = static_cast<half_t>(0.1f * normal(*rng));
        kept_rows[j * n + t * kQmmTile + col] = out[j * kQmmTile + col];
      }
    }
  }
  std::vector<float> x(rows * k);
  for (auto& e : x) e = normal(*rng) * (1.0f + 30.0f * (std::fabs(normal(*rng)) > 2.5f));  // some outliers
  for (int64_t c = 0; c < block; ++c) x[c] = 0.75f;
  for (int64_t c = block; c < 2 * block && blocks > 1; ++c) x[c] = 0.0f;

  std::vector<float> masked(k), scale_sum(2 * rows * blocks), kept_x(rows * n_kept);
  std::vector<int8_t> xq(rows * k);
  std::vector<int32_t> xqsum(rows * blocks);
  float *xs = scale_sum.data(), *bsum = xs + rows * blocks;
  for (int64_t r = 0; r < rows; ++r)
    QmmQuantize(x.data(), k, block, kept.data(), n_kept, r, masked.data(), xq.data(), xs, bsum, xqsum.data(),
                kept_x.data());
  std::vector<float> got(rows * n, NAN), scalar(rows * n, NAN);
  work.weights = weights.data();
  work.xq = xq.data();
  work.xs = xs;
  work.bsum = bsum;
  work.xqsum = xqsum.data();
  work.kept_x = kept_x.data();
  work.y = got.data();
  work.rows = rows;
  work.k = k;
  work.tiles = tiles;
  work.tiles_per_item = per_item ? per_item : QmmTilesPerItem(tile_bytes);
  const int64_t items = (tiles + work.tiles_per_item - 1) / work.tiles_per_item;
  std::atomic<int64_t> next{0};
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i) {
    pool.emplace_back([&] {
      for (int64_t item; (item = next++) < items;) work.Run(static_cast<size_t>(item));
    });
  }
  for (std::thread& thread : pool) thread.join();
  work.y = scalar.data();
  QmmRange(work, 0, tiles, false);

  float worst = 0.0f, worst_scalar = 0.0f, size = 0.0f;
  std::vector<double> want(rows * n);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < n; ++j) {
      double y = 0.0;
      for (int64_t b = 0; b < blocks; ++b) {
        int64_t dot = 0;
        for (int64_t c = b * block; c < (b + 1) * block; ++c) dot += int64_t{xq[r * k + c]} * (u[c * n + j] - zc);
        const double scale = scales[b * n + j];
        const double offset = with_min ? double(float(minimums[b * n + j] + zc * scales[b * n + j])) : 0.0;
        y += scale * double(xs[r * blocks + b]) * double(dot) + offset * double(bsum[r * blocks + b]);
      }
      for (int64_t t = 0; t < n_kept; ++t) y += double(x[r * k + kept[t]]) * double(kept_rows[t * n + j]);
      want[r * n + j] = y;
      size = std::max(size, static_cast<float>(std::fabs(y)));
    }
  }
  for (int64_t i = 0; i < rows * n; ++i) {
    const float diff = std::fabs(static_cast<float>(want[i] - got[i]));
    const float diff_scalar = std::fabs(static_cast<float>(want[i] - scalar[i]));
    worst = std::isnan(diff) ? INFINITY : std::max(worst, diff);  // a column never written stays NaN
    worst_scalar = std::isnan(diff_scalar) ? INFINITY : std::max(worst_scalar, diff_scalar);
  }
  const bool ok = worst <= 1e-5f * size && worst_scalar <= 1e-5f * size;
  std::printf("%s quant matmul (%s): bits %d block %lld rows %lld k %lld n %lld kept %lld %s, items of %lld tiles "
              "on %d threads: max |diff| %.3g, scalar %.3g (max |y| %.3g)\n",
              ok ? "ok  " : "FAIL", kQmmPath, bits, static_cast<long long>(block), static_cast<long long>(rows),
              static_cast<long long>(k), static_cast<long long>(n), static_cast<long long>(n_kept),
              with_min ? "minimums" : "no minimums", static_cast<long long>(work.tiles_per_item), threads, worst,
              worst_scalar, size);
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::mt19937 rng(7);
  if (argc > 1 && std::strcmp(argv[1], "side") == 0) {
    // SmolLM2's matmuls (576 and 1536 channels, blocks of 32, 32 kept; the LM head: no offsets);
    // every export block size; a block that is no multiple of 8 (the tail path); channels that are
    // no multiple of 8 without blocks; one kept channel; rows cut into items of 1 and 3 (ragged)
    struct SideCase {
      int64_t rows, k, block, kept, rows_per_item;
      bool masked;
    };
    const SideCase cases[] = {
        {1, 576, 32, 32, 0, true},  {1, 576, 32, 0, 0, false}, {5, 1536, 32, 32, 0, true}, {1, 576, 0, 32, 0, true},
        {3, 64, 16, 2, 0, true},    {2, 128, 64, 5, 0, true},  {2, 256, 128, 3, 0, true},  {2, 512, 256, 7, 0, true},
        {2, 96, 12, 4, 0, true},    {3, 40, 0, 5, 0, true},    {2, 64, 16, 1, 0, true},    {7, 576, 32, 32, 3, true},
        {7, 576, 32, 0, 1, false},  {70, 576, 32, 32, 0, true},
    };
    for (const SideCase& c : cases) {
      if (CheckSide(c.rows, c.k, c.block, c.kept, c.rows_per_item, c.masked, &rng)) return 1;
    }
    return 0;
  }
  if (argc > 1 && std::strcmp(argv[1], "qmm") == 0) {
    // bits x block sizes x rows (one, several) x kept channels (none, one, several) x n (one tile,
    // several, a long row of 17 tiles cut into the op's items) x minimums or not
    int cases = 0;
    for (int bits : {4, 8}) {
      for (int64_t block : {16, 32, 64, 128}) {
        for (int64_t rows : {1, 3, 6}) {  // row tiles of 1, 3, and 4 then 2
          for (int64_t n_kept : {0, 1, 7}) {
            for (int64_t n : {64, 192, 1088}) {
              for (bool with_min : {true, false}) {
                const int64_t k = block * (block <= 32 ? 6 : 3);
                if (CheckQmm(bits, block, rows, k, n, n_kept, with_min, 0, 1, &rng)) return 1;
                ++cases;
              }
            }
          }
        }
      }
    }
    // SmolLM2-135M's shapes (4 bits, blocks of 32, 32 kept, minimums; the LM head's 8 bits without),
    // blocks of 256, and items of 1, 3 and 5 tiles on 2 and 3 threads
    struct QmmCase {
      int bits;
      int64_t block, rows, k, n, kept;
      bool with_min;
      int64_t per_item;
      int threads;
    };
    const QmmCase more[] = {
        {4, 32, 1, 576, 960, 32, true, 0, 1},    {4, 32, 1, 1536, 576, 32, true, 0, 2},
        {8, 32, 1, 576, 2048, 32, false, 0, 2},  {4, 32, 8, 576, 960, 32, true, 0, 1},
        {4, 256, 3, 512, 128, 5, true, 0, 1},    {8, 256, 2, 768, 64, 0, false, 0, 1},
        {4, 32, 2, 576, 448, 3, true, 1, 3},     {8, 64, 5, 256, 448, 3, true, 3, 2},
        {4, 16, 1, 96, 448, 2, false, 5, 3},
    };
    for (const QmmCase& c : more) {
      if (CheckQmm(c.bits, c.block, c.rows, c.k, c.n, c.kept, c.with_min, c.per_item, c.threads, &rng)) return 1;
      ++cases;
    }
    std::printf("%d quant matmul cases\n", cases);
    return 0;
  }
  const bool tiled = argc > 1 && std::strcmp(argv[1], "tiled") == 0;
  const int64_t dims[] = {32, 64, 96, 128, 256};
  const int64_t group_sizes[] = {16, 32, 64, 128};
  for (int64_t d : dims) {
    for (int64_t gs : group_sizes) {
      if (gs > d || d % gs) continue;
      // (rows, positions, window); windows: below 8 positions (one sum of 8), mid-way in and at a
      // whole block of positions, as long as the cache (no effect)
      if (!tiled) {
        for (auto [rows, positions, window] : {std::tuple<int64_t, int64_t, int64_t>{3, 1, 0}, {3, 77, 0},
                                               {12, 300, 0}, {7, 1100, 0}, {12, 300, 7}, {12, 40, 33},
                                               {7, 1100, 64}, {3, 77, 77}}) {
          if (Check(d, gs, rows, positions, 0, window, &rng)) return 1;
        }
        continue;
      }
      // cache blocks of 16, 36 (not a power of two) and the op's own; one row, a ragged strip, a full tile;
      // lengths below, at and past a block, ending mid-block; windows smaller than a block (the tile's
      // rows starting at different positions, blocks before every row's window skipped), of one
      // 16-position block, longer than a block, and longer than the cache (no effect)
      for (int kb : {16, 36, kKeyBlock}) {
        for (auto [rows, positions, window] :
             {std::tuple<int64_t, int64_t, int64_t>{1, 1, 0}, {5, 36, 0}, {17, 64, 0}, {kTileRows, 65, 0},
              {kTileRows - 1, 1100, 0}, {kTileRows, 65, 5}, {17, 64, 16}, {kTileRows - 1, 1100, 100},
              {5, 36, 40}}) {
          if (Check(d, gs, rows, positions, kb, window, &rng)) return 1;
        }
      }
    }
  }
  if (!tiled) return 0;
  // whole calls: SmolLM2's heads, a KV group of 2 and of 1, head_dim 16 (the generic path); the op's
  // own split and tiles of 1, 2 and 5 tokens; new tokens that leave the last tile ragged; past
  // lengths that are no multiple of a tile or a cache block
  // Then decode steps with a split cache: the op's own split of a long cache (4 blocks of 504 at
  // batch 2) on 1, 2 and 3 threads; blocks of 37 and 40 positions ending mid-way in both rows;
  // blocks of 16 with 3 new tokens (rows of different lengths; the last block holds no position
  // of batch row 0); blocks of 8; KV groups of 2 and 1; head_dim 16 (the generic path, split by the op).
  // Then the same with a sliding window (the last field; -1: none): prefill chunks straddling the
  // window's start, windows smaller than a tile, the generic path; decode steps whose split covers
  // only the window (the op's own), blocks partly in a row's window, blocks wholly before batch row
  // 1's window (its past is 9 longer), a window starting at a block boundary, one smaller than a
  // block; windows at least as long as the context (no effect).
  struct Case {
    int64_t d, gs, heads, kv_heads, seq, past;
    bool tiled;
    int64_t rows_per_item, keys;
    int threads;
    int64_t window = -1;
  };
  const Case cases[] = {
      {64, 32, 9, 3, 50, 0, true, 0, 0, 1},    {64, 32, 9, 3, 50, 70, true, 0, 0, 1},
      {64, 32, 9, 3, 17, 5, true, 3, 0, 1},    {64, 32, 9, 3, 17, 5, true, 6, 0, 1},
      {64, 32, 9, 3, 17, 130, true, 15, 0, 1}, {64, 32, 9, 3, 1, 70, false, 0, 0, 1},
      {64, 32, 9, 3, 17, 5, false, 12, 0, 1},  {64, 32, 9, 3, 3, 70, false, 0, 0, 1},
      {32, 16, 2, 1, 37, 11, true, 0, 0, 1},   {32, 16, 4, 4, 29, 64, true, 0, 0, 1},
      {16, 16, 4, 2, 20, 3, true, 0, 0, 1},
      {64, 32, 9, 3, 1, 2000, false, 0, 0, 1}, {64, 32, 9, 3, 1, 2000, false, 0, 0, 2},
      {64, 32, 9, 3, 1, 2000, false, 0, 0, 3}, {64, 32, 9, 3, 1, 300, false, 0, 37, 2},
      {64, 32, 9, 3, 1, 301, false, 0, 40, 3}, {64, 32, 9, 3, 3, 70, false, 0, 16, 4},
      {64, 16, 9, 3, 1, 131, false, 0, 8, 5},  {32, 16, 4, 2, 2, 1000, false, 0, 100, 2},
      {128, 64, 4, 4, 1, 700, false, 0, 0, 2}, {16, 16, 4, 2, 1, 600, false, 0, 0, 2},
      {64, 32, 9, 3, 50, 70, true, 0, 0, 1, 8},      {64, 32, 9, 3, 50, 0, true, 0, 0, 2, 20},
      {64, 32, 9, 3, 17, 130, true, 15, 0, 3, 64},   {32, 16, 2, 1, 37, 11, true, 0, 0, 1, 16},
      {16, 16, 4, 2, 20, 3, true, 0, 0, 1, 5},       {64, 32, 9, 3, 50, 70, true, 0, 0, 2, 200},
      {64, 32, 9, 3, 17, 5, false, 12, 0, 1, 6},     {64, 32, 9, 3, 1, 2000, false, 0, 0, 3, 512},
      {64, 32, 9, 3, 1, 2000, false, 0, 0, 2, 5000}, {64, 32, 9, 3, 1, 300, false, 0, 37, 2, 100},
      {64, 32, 9, 3, 1, 301, false, 0, 8, 4, 16},    {64, 32, 9, 3, 3, 70, false, 0, 16, 4, 10},
      {64, 16, 9, 3, 1, 131, false, 0, 8, 5, 7},     {16, 16, 4, 2, 1, 600, false, 0, 0, 2, 300},
      {128, 64, 4, 4, 1, 700, false, 0, 0, 2, 256},
  };
  for (const Case& c : cases) {
    if (CheckWork(c.d, c.gs, c.heads, c.kv_heads, c.seq, c.past, c.tiled, c.rows_per_item, c.keys, c.threads,
                  c.window, &rng))
      return 1;
  }
  return 0;
}
