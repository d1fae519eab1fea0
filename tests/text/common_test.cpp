// common/: CRC-32C and the portable random generator against published or hand-computed
// vectors.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/crc32c.h"
#include "common/random.h"

namespace dflash {
namespace {

TEST(Crc32c, KnownVectors) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c("", 0), 0u);
  std::string big(1000, 'x');
  EXPECT_EQ(crc32c(big.data() + 3, 500, crc32c(big.data(), 3)), crc32c(big.data(), 503));
}

// Vigna's reference splitmix64.c seeded with 1234567.
TEST(Random, Splitmix64KnownVector) {
  uint64_t state = 1234567;
  for (uint64_t want : {6457827717110365317ull, 3203168211198807973ull, 9817491932198370423ull,
                        4593380528125082431ull, 16408922859458223821ull}) {
    EXPECT_EQ(splitmix64(state), want);
  }
}

// Expected values from a Python transcription of Lemire's method over splitmix64.
TEST(Random, UniformBelowKnownVector) {
  uint64_t state = 0;
  std::vector<uint64_t> got;
  for (uint64_t bound : {10ull, 10ull, 10ull, 1000ull, 3ull, 7ull, 1ull, (1ull << 63) + 1}) {
    got.push_back(uniform_below(state, bound));
  }
  EXPECT_EQ(got, (std::vector<uint64_t>{8, 4, 0, 970, 0, 2, 0, 7116260932800173470ull}));
}

// With bound 3 * 2^62, `draw % bound` puts half the mass below 2^62 (that range is hit twice);
// an unbiased draw puts a third there.
TEST(Random, UniformBelowIsUnbiased) {
  const uint64_t bound = 3ull << 62;
  uint64_t state = 9;
  int low = 0;
  const int n = 6000;
  for (int i = 0; i < n; ++i) {
    uint64_t v = uniform_below(state, bound);
    ASSERT_LT(v, bound);
    low += v < (1ull << 62);
  }
  EXPECT_NEAR(static_cast<double>(low) / n, 1.0 / 3, 0.03);
}

}  // namespace
}  // namespace dflash
