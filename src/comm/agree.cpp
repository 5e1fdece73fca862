// Agreement across ranks: all-gather a fingerprint of named fields, and when any differs,
// the same message on every rank naming the fields and the ranks.
#include <algorithm>
#include <sstream>

#include "cpattn/comm.hpp"
#include "cpattn/error.hpp"

namespace cpattn {

namespace {

// Ranges of consecutive ranks: {0, 1, 2, 5, 7, 8} -> "0-2,5,7,8".
std::string format_ranks(const std::vector<int>& ranks) {
  std::ostringstream os;
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (i > 0) os << ',';
    os << ranks[i];
    if (j >= i + 2) {
      os << '-' << ranks[j];
    } else if (j == i + 1) {
      os << ',' << ranks[j];
    }
    i = j + 1;
  }
  return os.str();
}

// FNV-1a over the names, each followed by a 0 byte: equal on ranks with the same field list.
std::int64_t names_hash(const Fingerprint& fp) {
  std::uint64_t h = 14695981039346656037ull;
  for (const auto& [name, value] : fp.fields) {
    for (const char c : name) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    h = (h ^ 0u) * 1099511628211ull;
  }
  return static_cast<std::int64_t>(h);
}

}  // namespace

std::optional<std::string> describe_disagreement(const Fingerprint& mine,
                                                 std::span<const std::int64_t> all_values,
                                                 int nranks, std::string_view what) {
  const auto nf = static_cast<std::int64_t>(mine.fields.size());
  CPATTN_CHECK(nranks >= 1 && static_cast<std::int64_t>(all_values.size()) == nf * nranks,
               "describe_disagreement: all_values.size() must be fields * nranks = ", nf, " * ",
               nranks, ", got ", all_values.size());
  std::ostringstream os;
  bool any = false;
  for (std::int64_t f = 0; f < nf; ++f) {
    // Values in order of the first rank holding each, with the ranks holding it.
    std::vector<std::pair<std::int64_t, std::vector<int>>> groups;
    for (int q = 0; q < nranks; ++q) {
      const std::int64_t v = all_values[q * nf + f];
      auto it = std::find_if(groups.begin(), groups.end(),
                             [v](const auto& g) { return g.first == v; });
      if (it == groups.end()) {
        groups.push_back({v, {q}});
      } else {
        it->second.push_back(q);
      }
    }
    if (groups.size() == 1) continue;
    os << (any ? "; " : "") << mine.fields[f].first << ": ";
    for (std::size_t g = 0; g < groups.size(); ++g) {
      const auto& ranks = groups[g].second;
      os << (g ? ", " : "") << (ranks.size() == 1 ? "rank " : "ranks ") << format_ranks(ranks)
         << (ranks.size() == 1 ? " has " : " have ") << groups[g].first;
    }
    any = true;
  }
  if (!any) return std::nullopt;
  return "ranks disagree on " + std::string(what) + ": " + os.str();
}

void agree(Communicator& comm, const Fingerprint& fp, std::string_view what) {
  const int p = comm.size();
  // First the shape of the fingerprint itself, so that ranks with other field lists fail here
  // rather than in an all-gather of unequal sizes.
  Fingerprint shape;
  shape.add("fingerprint field count", static_cast<std::int64_t>(fp.fields.size()))
      .add("fingerprint field names (hash)", names_hash(fp));
  std::vector<std::int64_t> mine{shape.fields[0].second, shape.fields[1].second};
  std::vector<std::int64_t> all(2 * static_cast<std::size_t>(p));
  comm.all_gather<std::int64_t>(mine, all);
  if (auto msg = describe_disagreement(shape, all, p, what)) throw Error(*msg);

  mine.clear();
  for (const auto& [name, value] : fp.fields) mine.push_back(value);
  all.assign(mine.size() * static_cast<std::size_t>(p), 0);
  comm.all_gather<std::int64_t>(mine, all);
  if (auto msg = describe_disagreement(fp, all, p, what)) throw Error(*msg);
}

}  // namespace cpattn
