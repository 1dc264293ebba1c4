// FastDiv (csrc/cuda/common.cuh) against integer division, on the host: every divisor up to
// 4096, the powers of two and their neighbours, and random divisors up to 2^31; for each, the
// numerators around multiples of it across [0, 2^31) and random ones. Prints the first mismatch
// and exits 1; prints the count of checks and exits 0 when all agree.
#include <cstdio>
#include <random>
#include <vector>

#include "cuda/common.cuh"

int main() {
  constexpr uint32_t kLimit = uint32_t{1} << 31;  // numerators below, divisors up to
  std::vector<uint32_t> divisors;
  for (uint32_t d = 1; d <= 4096; ++d) divisors.push_back(d);
  for (int k = 12; k <= 31; ++k)
    for (int64_t d = (int64_t{1} << k) - 1; d <= (int64_t{1} << k) + 1; ++d)
      if (d <= kLimit) divisors.push_back(static_cast<uint32_t>(d));
  std::mt19937 rng(1234);
  std::uniform_int_distribution<uint32_t> any_d(1, kLimit), any_n(0, kLimit - 1);
  for (int r = 0; r < 20000; ++r) divisors.push_back(any_d(rng));
  uint64_t checks = 0;
  for (const uint32_t d : divisors) {
    const trimul::FastDiv f(d);
    auto check = [&](int64_t n) {
      if (n < 0 || n >= kLimit) return true;
      ++checks;
      const uint32_t got = f.div(static_cast<uint32_t>(n)), want = static_cast<uint32_t>(n) / d;
      if (got == want) return true;
      std::printf("mismatch: %lld / %u = %u, FastDiv gives %u (m %u, shift %u)\n", static_cast<long long>(n), d,
                  want, got, f.m, f.shift);
      return false;
    };
    const int64_t top = (kLimit - 1) / d;  // the largest multiple's quotient
    std::uniform_int_distribution<int64_t> any_q(0, top);
    for (int r = 0; r < 64; ++r) {
      const int64_t q = r < 8 ? r : r < 16 ? top - (r - 8) : any_q(rng);
      for (int64_t e = -1; e <= 1; ++e)
        if (!check(q * d + e)) return 1;
      if (!check(q * d + d - 1)) return 1;
    }
    for (int r = 0; r < 64; ++r)
      if (!check(any_n(rng))) return 1;
    if (!check(kLimit - 1)) return 1;
  }
  std::printf("%llu checks agree\n", static_cast<unsigned long long>(checks));
  return 0;
}
