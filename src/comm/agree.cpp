// Agreement across ranks: all-gather a fingerprint of named fields, and when any differs,
// the same message on every rank naming the fields and the ranks.
#include <algorithm>
#include <memory>
#include <sstream>

#include "cpattn/agreement.hpp"
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
// The field names and which fields are reduced, and how: a field one rank adds with add_min and
// another with add compared on one rank and was reduced on the other, which went on alone.
std::int64_t names_hash(const Fingerprint& fp) {
  std::uint64_t h = 14695981039346656037ull;
  const auto mix = [&h](std::uint64_t x) { h = (h ^ x) * 1099511628211ull; };
  for (const auto& [name, value] : fp.fields) {
    for (const char c : name) mix(static_cast<unsigned char>(c));
    mix(0);
  }
  for (const auto& [field, by_min] : fp.reduced) {
    mix(field + 1);
    mix(by_min ? 2 : 1);
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
    if (std::any_of(mine.reduced.begin(), mine.reduced.end(),
                    [f](const auto& r) { return r.first == static_cast<std::size_t>(f); }))
      continue;
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

std::vector<std::int64_t> agree(Communicator& comm, const Fingerprint& fp, std::string_view what,
                                std::string_view local_error) {
  const int p = comm.size();
  // One all-gather in the common case: [error length, field count, names hash, values...]
  // per rank, the values padded to kInline slots (cpattn/agreement.hpp). The field count and
  // names come first, so that ranks with other field lists fail here rather than in
  // all-gathers of unequal sizes.
  constexpr std::size_t kInline = kAgreementInline;
  constexpr std::size_t kHead = kAgreementHead;
  const std::size_t nf = fp.fields.size();
  // The receive buffers are shared with the communicator when a collective times out in
  // throw_error mode, so that a late rank's data never lands in freed memory.
  struct Buffers {
    std::vector<std::int64_t> all, values;
    std::string text;
  };
  auto buf = std::make_shared<Buffers>();
  const auto gather = [&](auto&& collective) {
    try {
      collective();
    } catch (...) {
      comm.keep_if_poisoned(buf);
      throw;
    }
  };
  std::vector<std::int64_t> mine(kHead + kInline, 0);
  mine[0] = static_cast<std::int64_t>(local_error.size());
  mine[1] = static_cast<std::int64_t>(nf);
  mine[2] = names_hash(fp);
  for (std::size_t f = 0; f < std::min(nf, kInline); ++f) mine[kHead + f] = fp.fields[f].second;
  std::vector<std::int64_t>& all = buf->all;
  all.assign(mine.size() * static_cast<std::size_t>(p), 0);
  gather([&] { comm.all_gather<std::int64_t>(mine, all); });
  const auto at = [&](int q, std::size_t i) { return all[static_cast<std::size_t>(q) * mine.size() + i]; };

  // Local errors first: a rank with one may hold a meaningless fingerprint.
  std::vector<std::int64_t> lens(static_cast<std::size_t>(p));
  std::int64_t total = 0;
  for (int q = 0; q < p; ++q) total += lens[q] = at(q, 0);
  if (total > 0) {
    std::string& text = buf->text;
    text.assign(static_cast<std::size_t>(total), '\0');
    gather([&] {
      comm.all_gather_v<std::byte>(std::as_bytes(std::span(local_error)), lens,
                                   std::as_writable_bytes(std::span(text)));
    });
    // Identical messages once, with the ranks that raised them: "[ranks 0-3] ..."
    std::vector<std::pair<std::string, std::vector<int>>> groups;
    std::size_t off = 0;
    for (int q = 0; q < p; ++q) {
      const auto n = static_cast<std::size_t>(lens[q]);
      if (n == 0) continue;
      std::string m = text.substr(off, n);
      off += n;
      auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == m; });
      if (it == groups.end()) groups.push_back({std::move(m), {q}});
      else it->second.push_back(q);
    }
    std::string msg = std::string(what) + " rejected its arguments:";
    for (const auto& [m, ranks] : groups)
      msg += (ranks.size() == 1 ? " [rank " : " [ranks ") + format_ranks(ranks) + "] " + m;
    throw Error(msg);
  }

  Fingerprint shape;
  shape.add("fingerprint field count", static_cast<std::int64_t>(nf))
      .add("fingerprint field names and reductions (hash)", mine[2]);
  std::vector<std::int64_t> shapes;
  for (int q = 0; q < p; ++q) shapes.insert(shapes.end(), {at(q, 1), at(q, 2)});
  if (auto msg = describe_disagreement(shape, shapes, p, what)) throw Error(*msg);

  std::vector<std::int64_t>& values = buf->values;
  if (nf <= kInline) {
    for (int q = 0; q < p; ++q)
      for (std::size_t f = 0; f < nf; ++f) values.push_back(at(q, kHead + f));
  } else {  // every rank has the same long field list: one more all-gather
    std::vector<std::int64_t> v;
    for (const auto& [name, value] : fp.fields) v.push_back(value);
    values.assign(nf * static_cast<std::size_t>(p), 0);
    gather([&] { comm.all_gather<std::int64_t>(v, values); });
  }
  if (auto msg = describe_disagreement(fp, values, p, what)) throw Error(*msg);
  std::vector<std::int64_t> minima;
  for (const auto& [f, by_min] : fp.reduced) {
    std::int64_t m = values[f];
    for (int q = 1; q < p; ++q) {
      const std::int64_t x = values[static_cast<std::size_t>(q) * nf + f];
      m = by_min ? std::min(m, x) : (m & x);
    }
    minima.push_back(m);
  }
  return minima;
}

void rethrow_agreed(Communicator& comm, const std::string& local_error) {
  const int n = comm.size(), rank = comm.rank();
  // The collectives' buffers, kept alive past a timeout (throw_error mode) while their requests
  // may still write them (they were this frame's: a late rank's data landed in a reused stack).
  struct Buffers {
    int64_t flag = 0, len = 0;
    std::string msg;
  };
  auto b = std::make_shared<Buffers>();
  try {
    b->flag = local_error.empty() ? 0 : n - rank;  // the lowest failing rank wins
    comm.all_reduce<int64_t>(std::span(&b->flag, 1), ReduceOp::max);
    if (b->flag == 0) return;
    const int root = static_cast<int>(n - b->flag);
    b->len = rank == root ? static_cast<int64_t>(local_error.size()) : 0;
    comm.broadcast<int64_t>(std::span(&b->len, 1), root);
    b->msg.assign(static_cast<std::size_t>(b->len), '\0');
    if (rank == root) b->msg = local_error;
    comm.broadcast<std::byte>(std::as_writable_bytes(std::span(b->msg)), root);
  } catch (...) {
    comm.keep_if_poisoned(b);
    throw;
  }
  throw Error(b->msg);
}

}  // namespace cpattn
