// The wire format of the ranks' agreement (cpattn::agree, src/comm/agree.cpp), without MPI:
// the simulator (src/sim) counts the bytes every CP call's agreement moves from it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cpattn {

// agree()'s first all-gather carries, per rank, kAgreementHead int64s [error length, field
// count, names hash] and kAgreementInline field values (padded; a longer field list takes a
// second all-gather, and a local error a third).
inline constexpr std::size_t kAgreementHead = 3;
inline constexpr std::size_t kAgreementInline = 48;
inline constexpr std::int64_t kAgreementBlockBytes =
    static_cast<std::int64_t>((kAgreementHead + kAgreementInline) * sizeof(std::int64_t));

}  // namespace cpattn
