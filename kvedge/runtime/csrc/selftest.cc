// Self-test of kvedge_ops.cc's attention arithmetic, without onnxruntime: every vectorized
// (head_dim, group size) instantiation against the one-channel-at-a-time path (AttendAny), over
// random caches, with decode-like and prefill-like query blocks. Built and run by
// tests/test_kv_int8.py (natively, and for aarch64 under qemu when a cross compiler is present).
// Prints one line per case and exits non-zero on the first mismatch.

#include "kvedge_ops.cc"

#include <cstdio>
#include <random>

namespace {

int Check(int64_t d, int64_t group_size, int64_t n_rows, int64_t longest, std::mt19937* rng) {
  const int64_t groups = d / group_size, slots = longest + 3;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> code(-127, 127);
  std::vector<int8_t> k(slots * d), v(slots * d);
  std::vector<half_t> ks(slots * groups), vs(slots * groups);
  for (auto& c : k) c = static_cast<int8_t>(code(*rng));
  for (auto& c : v) c = static_cast<int8_t>(code(*rng));
  for (auto& s : ks) s = static_cast<half_t>(0.002f + 0.01f * std::fabs(normal(*rng)));
  for (auto& s : vs) s = static_cast<half_t>(0.002f + 0.01f * std::fabs(normal(*rng)));
  std::vector<float> q(n_rows * d), want(n_rows * d), got(n_rows * d), scores(n_rows * slots), scratch;
  for (auto& x : q) x = normal(*rng);
  Block b;
  b.n_rows = n_rows;
  for (int64_t i = 0; i < n_rows; ++i) b.limit[i] = longest - (n_rows - 1 - i) / 3;  // causal, 3 heads per token
  b.q = q.data();
  b.scores = scores.data();
  b.stride = slots;
  b.k_codes = k.data();
  b.v_codes = v.data();
  b.k_scales = ks.data();
  b.v_scales = vs.data();
  b.groups = groups;
  for (int64_t i = 0; i < n_rows; ++i) b.out[i] = want.data() + i * d;
  AttendAny(d, b);
  for (int64_t i = 0; i < n_rows; ++i) b.out[i] = got.data() + i * d;
  Attend(d, b, &scratch);
  float worst = 0.0f, scale = 0.0f;
  for (size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, std::fabs(want[i] - got[i]));
    scale = std::max(scale, std::fabs(want[i]));
  }
  const bool ok = worst <= 1e-5f * std::max(1.0f, scale);
  std::printf("%s head_dim %lld group %lld rows %lld positions %lld: max |diff| %.3g (max |out| %.3g)\n",
              ok ? "ok  " : "FAIL", static_cast<long long>(d), static_cast<long long>(group_size),
              static_cast<long long>(n_rows), static_cast<long long>(longest), worst, scale);
  return ok ? 0 : 1;
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  const int64_t dims[] = {32, 64, 96, 128, 256};
  const int64_t group_sizes[] = {16, 32, 64, 128};
  for (int64_t d : dims) {
    for (int64_t gs : group_sizes) {
      if (gs > d || d % gs) continue;
      for (auto [rows, positions] : {std::pair<int64_t, int64_t>{3, 1}, {3, 77}, {12, 300}, {7, 1100}}) {
        if (Check(d, gs, rows, positions, &rng)) return 1;
      }
    }
  }
  return 0;
}
