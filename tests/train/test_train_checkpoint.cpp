// The checkpoint format (src/train/checkpoint.hpp) against an independent writer: the fuzz
// seeds that tests/fuzz/make_checkpoint_seeds.py writes by hand from the documented layout
// (Python's struct and its own FNV-1a) must read as their names say, the valid version 6 ones
// back to the exact bytes format_checkpoint writes, the valid version 3 to 5 ones to the
// version 6 file of the same run. No MPI.
#include <cpattn/error.hpp>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "checkpoint.hpp"
#include "checkpoint_seed_configs.hpp"

namespace cpattn::train {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// fuzz_checkpoint.cpp's and make_checkpoint_seeds.py's configurations: a dense model and one
// with experts.
const CheckpointConfig& kConfig = seed_configs::kDense;
const CheckpointConfig& kMoe = seed_configs::kMoe;

// A seed's file: its bytes after the fuzzer's mode byte.
std::vector<std::byte> seed(const std::string& name) {
  std::ifstream in(std::string(CPATTN_CHECKPOINT_SEEDS) + "/" + name, std::ios::binary);
  EXPECT_TRUE(in.good()) << name;
  const std::vector<char> all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> file;
  for (std::size_t i = 1; i < all.size(); ++i) file.push_back(static_cast<std::byte>(all[i]));
  return file;
}

std::string refusal(const std::string& name, const CheckpointConfig& cfg = kConfig) {
  try {
    (void)parse_checkpoint(seed(name), name, cfg);
  } catch (const Error& e) {
    return e.message();
  }
  ADD_FAILURE() << name << " was accepted";
  return {};
}

void expect_seed_state(const CheckpointState& s, int64_t skipped = 0) {
  EXPECT_EQ(s.step, 5);
  EXPECT_EQ(s.skipped, skipped);
  EXPECT_EQ(s.data, (DataPosition{.doc = 0, .offset = 17, .epoch = 0}));
  EXPECT_THAT(s.params, ElementsAre(0.5f, -1.25f, 2.0f));
  EXPECT_THAT(s.m, ElementsAre(0.01f, -0.02f, 0.03f));
  EXPECT_THAT(s.v, ElementsAre(1e-4f, 0.0f, 2e-3f));
}

TEST(CheckpointFormat, TheHandWrittenValidSeedReadsAndFormatsBackToItsBytes) {
  const std::vector<std::byte> file = seed("valid");
  const CheckpointState s = parse_checkpoint(file, "valid", kConfig);
  expect_seed_state(s);
  EXPECT_EQ(format_checkpoint(kConfig, s.step, s.skipped, s.data, s.params, s.m, s.v), file);
}

TEST(CheckpointFormat, TheModelWithExpertsReadsAndFormatsBackToItsBytes) {
  const std::vector<std::byte> file = seed("valid_moe");
  const CheckpointState s = parse_checkpoint(file, "valid_moe", kMoe);
  expect_seed_state(s);
  EXPECT_EQ(format_checkpoint(kMoe, s.step, s.skipped, s.data, s.params, s.m, s.v), file);
  // The same file is not the dense run's: the first MoE field is named.
  EXPECT_THAT(refusal("valid_moe"), HasSubstr("holds a model with experts = 4, this run has 0"));
}

TEST(CheckpointFormat, Versions3To5ReadAsTheDenseModelWithoutDropoutAndAreWrittenAsVersion6) {
  for (const char* name : {"valid_v3", "valid_v4", "valid_v5"}) {
    SCOPED_TRACE(name);
    const CheckpointState s = parse_checkpoint(seed(name), name, kConfig);
    expect_seed_state(s);
    EXPECT_EQ(s.micro, 0);  // not recorded: any run's matches
    // The hand-written version 6 file of the same run, byte for byte.
    EXPECT_EQ(format_checkpoint(kConfig, s.step, s.skipped, s.data, s.params, s.m, s.v), seed("valid"));
    // No dropout recorded (version 5: dropout 0): a run with dropout does not resume from it.
    CheckpointConfig with_dropout = kConfig;
    with_dropout.model.dropout = 0.25f;
    EXPECT_THROW((void)parse_checkpoint(seed(name), name, with_dropout), Error);
  }
}

// Version 6: the skipped steps are state (AdamW's bias correction counts the updates), micro
// is part of the run (0 in a file, or in the run, is not recorded and matches any).
TEST(CheckpointFormat, TheSkippedStepsAndMicroAreRecorded) {
  const CheckpointState s = parse_checkpoint(seed("valid_skipped"), "valid_skipped", kConfig);
  expect_seed_state(s, 2);
  EXPECT_EQ(format_checkpoint(kConfig, s.step, s.skipped, s.data, s.params, s.m, s.v), seed("valid_skipped"));
  EXPECT_THAT(refusal("other_micro"), HasSubstr("has micro 3, this run 2"));
  CheckpointConfig unrecorded = kConfig;
  unrecorded.id.micro = 0;
  EXPECT_EQ(parse_checkpoint(seed("other_micro"), "other_micro", unrecorded).micro, 3);
  EXPECT_EQ(parse_checkpoint(seed("valid_no_micro"), "valid_no_micro", kConfig).micro, 0);
  EXPECT_THAT(refusal("skipped_past_step"), HasSubstr("has 6 skipped steps of 5"));
}

TEST(CheckpointFormat, TheDropoutIsPartOfTheModel) {
  EXPECT_THAT(refusal("other_dropout"), HasSubstr("holds a model with dropout = 0.25, this run has 0"));
  CheckpointConfig with_dropout = kConfig;
  with_dropout.model.dropout = 0.25f;
  const CheckpointState s = parse_checkpoint(seed("other_dropout"), "other_dropout", with_dropout);
  expect_seed_state(s);
  EXPECT_EQ(format_checkpoint(with_dropout, s.step, s.skipped, s.data, s.params, s.m, s.v), seed("other_dropout"));
}

TEST(CheckpointFormat, EveryBadSeedIsRefusedNamingItsProblem) {
  // Version 6: 8 (magic) + 8 x (2 + 38 fields) + 8 (checksum) + 36 (payload) = 372 bytes.
  EXPECT_THAT(refusal("truncated"), HasSubstr("is truncated: 367 bytes, its header says 372"));
  EXPECT_THAT(refusal("header_only"), HasSubstr("is truncated: 336 bytes, its header says 372"));
  EXPECT_THAT(refusal("trailing"), HasSubstr("has 4 trailing bytes after its data (372 bytes expected)"));
  EXPECT_THAT(refusal("bad_checksum"), HasSubstr("fails its checksum"));
  EXPECT_THAT(refusal("version1"), HasSubstr("has version 1, this cpattn reads versions 3 to 6 (version 1 has no "
                                             "checksum"));
  EXPECT_THAT(refusal("version2"), HasSubstr("has version 2, this cpattn reads versions 3 to 6 (version 2 has no "
                                             "attention masks"));
  EXPECT_THAT(refusal("v3_count_of_v4"), HasSubstr("has 35 header fields, want 28"));
  EXPECT_THAT(refusal("v4_count_of_v5"), HasSubstr("has 36 header fields, want 35"));
  EXPECT_THAT(refusal("v5_count_of_v6"), HasSubstr("has 38 header fields, want 36"));
  EXPECT_THAT(refusal("other_lr"), HasSubstr("has lr 0.001, this run 0.0005"));
  EXPECT_THAT(refusal("moe_other_router", kMoe), HasSubstr("holds a model with router = sigmoid-bias, this run has "
                                                           "softmax"));
  EXPECT_THAT(refusal("dense_against_moe", kMoe), HasSubstr("holds a model with experts = 0, this run has 4"));
  EXPECT_THAT(refusal("negative_step"), HasSubstr("has a negative step (-1)"));
  EXPECT_THAT(refusal("nan_weight"), HasSubstr("has a non-finite weight at parameter 1"));
  EXPECT_THAT(refusal("negative_moment"), HasSubstr("has a negative second moment at parameter 1"));
  EXPECT_THAT(refusal("not_a_checkpoint"), HasSubstr("is not a cpattn training checkpoint"));
}

}  // namespace
}  // namespace cpattn::train
