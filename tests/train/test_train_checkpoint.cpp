// The checkpoint format (src/train/checkpoint.hpp) against an independent writer: the fuzz
// seeds that tests/fuzz/make_checkpoint_seeds.py writes by hand from the documented layout
// (Python's struct and its own FNV-1a) must read as their names say, the valid one back to the
// exact bytes format_checkpoint writes. No MPI.
#include <cpattn/error.hpp>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "checkpoint.hpp"

namespace cpattn::train {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// fuzz_checkpoint.cpp's and make_checkpoint_seeds.py's configuration.
const CheckpointConfig kConfig{.model = {.layers = 1, .dim = 8, .heads = 2, .kv_heads = 1},
                               .n_params = 3,
                               .optim = {},
                               .seed = 1,
                               .attn_dtype = DType::f32,
                               .id = {.seq_len = 64, .data_hash = 0x1234abcdULL}};

// A seed's file: its bytes after the fuzzer's mode byte.
std::vector<std::byte> seed(const std::string& name) {
  std::ifstream in(std::string(CPATTN_CHECKPOINT_SEEDS) + "/" + name, std::ios::binary);
  EXPECT_TRUE(in.good()) << name;
  const std::vector<char> all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> file;
  for (std::size_t i = 1; i < all.size(); ++i) file.push_back(static_cast<std::byte>(all[i]));
  return file;
}

std::string refusal(const std::string& name) {
  try {
    (void)parse_checkpoint(seed(name), name, kConfig);
  } catch (const Error& e) {
    return e.message();
  }
  ADD_FAILURE() << name << " was accepted";
  return {};
}

TEST(CheckpointFormat, TheHandWrittenValidSeedReadsAndFormatsBackToItsBytes) {
  const std::vector<std::byte> file = seed("valid");
  const CheckpointState s = parse_checkpoint(file, "valid", kConfig);
  EXPECT_EQ(s.step, 5);
  EXPECT_EQ(s.data, (DataPosition{.doc = 0, .offset = 17, .epoch = 0}));
  EXPECT_THAT(s.params, ElementsAre(0.5f, -1.25f, 2.0f));
  EXPECT_THAT(s.m, ElementsAre(0.01f, -0.02f, 0.03f));
  EXPECT_THAT(s.v, ElementsAre(1e-4f, 0.0f, 2e-3f));
  EXPECT_EQ(format_checkpoint(kConfig, s.step, s.data, s.params, s.m, s.v), file);
}

TEST(CheckpointFormat, EveryBadSeedIsRefusedNamingItsProblem) {
  EXPECT_THAT(refusal("truncated"), HasSubstr("is truncated: 287 bytes, its header says 292"));
  EXPECT_THAT(refusal("header_only"), HasSubstr("is truncated: 256 bytes, its header says 292"));
  EXPECT_THAT(refusal("trailing"), HasSubstr("has 4 trailing bytes after its data (292 bytes expected)"));
  EXPECT_THAT(refusal("bad_checksum"), HasSubstr("fails its checksum"));
  EXPECT_THAT(refusal("version1"), HasSubstr("has version 1, this cpattn reads version 3"));
  EXPECT_THAT(refusal("other_lr"), HasSubstr("has lr 0.001, this run 0.0005"));
  EXPECT_THAT(refusal("negative_step"), HasSubstr("has a negative step (-1)"));
  EXPECT_THAT(refusal("nan_weight"), HasSubstr("has a non-finite weight at parameter 1"));
  EXPECT_THAT(refusal("negative_moment"), HasSubstr("has a negative second moment at parameter 1"));
  EXPECT_THAT(refusal("not_a_checkpoint"), HasSubstr("is not a cpattn training checkpoint"));
}

}  // namespace
}  // namespace cpattn::train
