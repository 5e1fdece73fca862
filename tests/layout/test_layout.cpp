#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>

#include "error_of.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace cpattn {
namespace {

using ::testing::HasSubstr;
using V = std::vector<int64_t>;

using testing::error_of;

TEST(Layout, BothSpellingsGiveTheSameBoundaries) {
  EXPECT_EQ(cu_seqlens_from_ends(V{16, 40}), (V{0, 16, 40}));
  EXPECT_EQ(ends_from_cu_seqlens(V{0, 16, 40}), (V{16, 40}));
  EXPECT_EQ(cu_seqlens_from_lengths(V{16, 24}), (V{0, 16, 40}));
  EXPECT_NO_THROW(check_cu_seqlens(V{0, 16, 40}, 40));
  EXPECT_NO_THROW(check_cu_seqlens(V{0, 1}, 1));  // one 1-token document
}

TEST(Layout, PaddingToMultiplesOfTwoCp) {
  // cp = 1: one chunk per document, no padding.
  EXPECT_EQ(chunks_per_document(1), 1);
  EXPECT_EQ(chunks_per_document(3), 6);
  EXPECT_EQ(padded_length(1, 1), 1);
  EXPECT_EQ(padded_length(17, 1), 17);
  EXPECT_EQ(pad_cu_seqlens(V{0, 1, 4, 17}, 1), (V{0, 1, 4, 17}));
  EXPECT_EQ(padded_length(1, 2), 4);
  EXPECT_EQ(padded_length(16, 2), 16);
  EXPECT_EQ(padded_length(17, 2), 20);
  EXPECT_EQ(padded_length(5, 3), 6);
  EXPECT_EQ(padded_length(7, 3), 12);
  EXPECT_EQ(pad_cu_seqlens(V{0, 5, 16}, 2), (V{0, 8, 20}));
  EXPECT_EQ(pad_cu_seqlens(V{0, 16, 40}, 2), (V{0, 16, 40}));  // already aligned
  EXPECT_EQ(pad_cu_seqlens(V{0, 1, 2, 3}, 4), (V{0, 8, 16, 24}));
}

TEST(Layout, EachBadBoundaryRuleHasItsOwnMessage) {
  EXPECT_THAT(error_of([] { check_cu_seqlens(V{}); }), HasSubstr("at least one document"));
  EXPECT_THAT(error_of([] { check_cu_seqlens(V{0}); }), HasSubstr("at least one document"));
  EXPECT_THAT(error_of([] { check_cu_seqlens(V{1, 5}); }), HasSubstr("cu_seqlens[0] must be 0, got 1"));
  EXPECT_THAT(error_of([] { check_cu_seqlens(V{0, 4, 4, 8}); }),
              HasSubstr("cu_seqlens[1] = 4 and cu_seqlens[2] = 4"));
  EXPECT_THAT(error_of([] { check_cu_seqlens(V{0, 8, 4}); }), HasSubstr("strictly increasing"));
  EXPECT_THAT(error_of([] { check_cu_seqlens(V{0, -3}); }),
              HasSubstr("cu_seqlens[1] must not be negative, got -3"));
  EXPECT_THAT(error_of([] { check_cu_seqlens(V{0, 4, 8}, 9); }),
              HasSubstr("must end at the token count 9, but its last entry cu_seqlens[2] is 8"));
  EXPECT_THAT(error_of([] { check_cu_seqlens(V{0, 4, 2}, kUnknownTokens, "cu_seqlens_q"); }),
              HasSubstr("cu_seqlens_q[1] = 4 and cu_seqlens_q[2] = 2"));
}

TEST(Layout, EndsFormErrorsPointAtTheCallersEntries) {
  EXPECT_THAT(error_of([] { cu_seqlens_from_ends(V{}); }), HasSubstr("ends must hold at least one"));
  EXPECT_THAT(error_of([] { cu_seqlens_from_ends(V{0, 8}); }),
              HasSubstr("ends[0] = 0 follows 0"));
  EXPECT_THAT(error_of([] { cu_seqlens_from_ends(V{8, 8}); }), HasSubstr("ends[1] = 8 follows 8"));
  EXPECT_THAT(error_of([] { cu_seqlens_from_ends(V{8, -1}); }),
              HasSubstr("ends[1] must not be negative, got -1"));
  EXPECT_THAT(error_of([] { cu_seqlens_from_ends(V{8, 16}, 20, "actual_seq_qlen"); }),
              HasSubstr("actual_seq_qlen must end at the token count 20"));
  EXPECT_THAT(error_of([] { cu_seqlens_from_lengths(V{3, 0}); }),
              HasSubstr("lengths[1] must be >= 1 (no empty document), got 0"));
  EXPECT_THAT(error_of([] { pad_cu_seqlens(V{0, 4}, 0); }), HasSubstr("cp must be >= 1, got 0"));
}

// int32 boundaries (PyTorch's and FlashAttention's dtype) behave exactly as int64 ones.
TEST(Layout, Int32BoundariesAreAcceptedAndCheckedTheSame) {
  using V32 = std::vector<int32_t>;
  EXPECT_NO_THROW(check_cu_seqlens(V32{0, 16, 40}, 40));
  EXPECT_EQ(cu_seqlens_from_ends(V32{16, 40}), (V{0, 16, 40}));
  EXPECT_EQ(cu_seqlens_from_ends(V32{16, 40}, 40, "actual_seq_qlen"), (V{0, 16, 40}));
  EXPECT_EQ(widen_boundaries(V32{0, 2147483647}), (V{0, 2147483647}));
  // The same messages, naming the caller's argument and entries.
  EXPECT_EQ(error_of([] { check_cu_seqlens(V32{0, 4, 4, 8}); }),
            error_of([] { check_cu_seqlens(V{0, 4, 4, 8}); }));
  EXPECT_THAT(error_of([] { check_cu_seqlens(V32{0, 4, 8}, 9, "cu_seqlens_k"); }),
              HasSubstr("cu_seqlens_k must end at the token count 9, but its last entry cu_seqlens_k[2] is 8"));
  EXPECT_THAT(error_of([] { check_cu_seqlens(V32{0, -3}); }),
              HasSubstr("cu_seqlens[1] must not be negative, got -3"));
  EXPECT_THAT(error_of([] { cu_seqlens_from_ends(V32{8, 8}); }), HasSubstr("ends[1] = 8 follows 8"));
  EXPECT_THAT(error_of([] { cu_seqlens_from_ends(V32{}); }), HasSubstr("ends must hold at least one"));
}

TEST(Layout, ErrorCarriesItsLocation) {
  try {
    check_cu_seqlens(V{});
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("layout.cpp:"));
    EXPECT_THAT(std::string(e.what()), HasSubstr(e.message()));
  }
}

}  // namespace
}  // namespace cpattn
