// Checkpoint files (checkpoint.hpp).
#include "checkpoint.hpp"

#include <cpattn/error.hpp>
#include <cpattn/file.hpp>

#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>

namespace cpattn::train {

namespace {

constexpr char kMagic[8] = {'C', 'P', 'A', 'T', 'T', 'N', 'T', 'R'};
constexpr int64_t kVersion = 6;

// model_real64: a double's bits; capacity: the same, 0 shown as "none" (an unset capacity
// factor); router and drop_policy: the enums, shown by name.
enum class Kind { model, model_real, model_real64, capacity, router, drop_policy, integer, real, hash, dtype, state };
struct FieldName {
  const char* name;
  Kind kind;
};
// The fields after the version and count, in file order. Model fields keep version 1's
// message ("holds a model with layers = 1, this run has 2").
constexpr FieldName kFields[] = {
    {"vocab", Kind::model},         {"layers", Kind::model},       {"dim", Kind::model},
    {"heads", Kind::model},         {"kv_heads", Kind::model},     {"ffn", Kind::model},
    {"rope_theta", Kind::model_real}, {"norm_eps", Kind::model_real}, {"parameters", Kind::model},
    {"window_left", Kind::model},   {"window_right", Kind::model}, {"softcap", Kind::model_real},
    {"alibi", Kind::model},
    {"experts", Kind::model},       {"top_k", Kind::model},        {"router", Kind::router},
    {"capacity_factor", Kind::capacity}, {"drop_policy", Kind::drop_policy},
    {"aux_loss_coeff", Kind::model_real64},  {"bias_update_rate", Kind::model_real64},
    {"dropout", Kind::model_real},
    {"lr", Kind::real},             {"warmup", Kind::integer},     {"weight_decay", Kind::real},
    {"clip", Kind::real},           {"beta1", Kind::real},         {"beta2", Kind::real},
    {"eps", Kind::real},            {"seed", Kind::integer},       {"attention dtype", Kind::dtype},
    {"seq_len", Kind::integer},     {"data", Kind::hash},          {"micro", Kind::integer},
    {"step", Kind::state},          {"data doc", Kind::state},     {"data offset", Kind::state},
    {"data epoch", Kind::state},    {"skipped steps", Kind::state}};
constexpr int64_t kFieldCount = std::size(kFields);
constexpr int64_t kConfigFields = 33;  // before the state
constexpr int64_t kParamsField = 8;
constexpr int64_t kMoeFirst = 13, kMoeFields = 7;  // experts .. bias_update_rate, new in version 4
constexpr int64_t kDropoutField = 20;               // new in version 5
constexpr int64_t kMicroField = 32, kSkippedField = 37;  // new in version 6

// Whether field i (of kFields) is in a file of `version` (3 to 6): version 5 has no micro and
// no skipped steps, version 4 no dropout either, version 3 no MoE fields either. A missing
// field reads as 0 (no experts, no dropout, micro not recorded, no step skipped).
bool in_version(int64_t i, int64_t version) {
  if (i == kMicroField || i == kSkippedField) return version >= 6;
  if (i == kDropoutField) return version >= 5;
  if (i >= kMoeFirst && i < kMoeFirst + kMoeFields) return version >= 4;
  return true;
}
int64_t fields_in_version(int64_t version) {
  int64_t n = 0;
  for (int64_t i = 0; i < kFieldCount; ++i) n += in_version(i, version);
  return n;
}

int64_t bits(float x) { return std::bit_cast<int32_t>(x); }
int64_t bits64(double x) { return std::bit_cast<int64_t>(x); }

std::vector<int64_t> fields_of(const CheckpointConfig& c, int64_t step, int64_t skipped, const DataPosition& d) {
  const ModelConfig& m = c.model;
  const OptimConfig& o = c.optim;
  // Without experts the MoE fields mean nothing: recorded as 0, whatever they hold.
  const bool moe = m.moe();
  return {m.vocab,         m.layers,   m.dim,           m.heads,          m.kv_heads,
          m.ffn_dim(),     bits(m.rope_theta), bits(m.norm_eps), c.n_params,
          m.window_left,   m.window_right, bits(m.softcap), m.alibi ? 1 : 0,
          moe ? m.experts : 0, moe ? m.top_k : 0, moe ? static_cast<int64_t>(m.router) : 0,
          moe ? bits64(m.capacity_factor.value_or(0.0)) : 0, moe ? static_cast<int64_t>(m.drop_policy) : 0,
          moe ? bits64(m.aux_loss_coeff) : 0, moe ? bits64(m.bias_update_rate) : 0, bits(m.dropout),
          bits(o.lr),      o.warmup,   bits(o.weight_decay), bits(o.clip), bits(o.beta1),
          bits(o.beta2),   bits(o.eps), static_cast<int64_t>(c.seed), static_cast<int64_t>(c.attn_dtype),
          c.id.seq_len,    static_cast<int64_t>(c.id.data_hash), c.id.micro,
          step,            d.doc,      d.offset,        d.epoch,  skipped};
}

std::string shown(Kind k, int64_t v) {
  char b[64];
  if (k == Kind::real || k == Kind::model_real) {  // the shortest text that reads back as the same float
    const float x = std::bit_cast<float>(static_cast<int32_t>(v));
    for (int digits = 6; digits <= 9; ++digits) {
      std::snprintf(b, sizeof b, "%.*g", digits, x);
      if (std::strtof(b, nullptr) == x) break;
    }
  } else if (k == Kind::model_real64 || k == Kind::capacity) {
    const double x = std::bit_cast<double>(v);
    if (x == 0 && k == Kind::capacity) return "none";
    std::snprintf(b, sizeof b, "%.17g", x);
  } else if (k == Kind::router && (v == 0 || v == 1)) {  // a corrupt value is shown as its number
    return static_cast<MoeRouter>(v) == MoeRouter::softmax ? "softmax" : "sigmoid-bias";
  } else if (k == Kind::drop_policy && (v == 0 || v == 1)) {
    return static_cast<MoeDropPolicy>(v) == MoeDropPolicy::by_position ? "position" : "probability";
  } else if (k == Kind::hash) {
    std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  } else if (k == Kind::dtype) {
    return std::string(to_string(static_cast<DType>(v)));
  } else {
    std::snprintf(b, sizeof b, "%lld", static_cast<long long>(v));
  }
  return b;
}

}  // namespace

uint64_t fnv1a64(std::span<const std::byte> bytes, uint64_t h) {
  for (const std::byte b : bytes) {
    h ^= static_cast<uint8_t>(b);
    h *= 1099511628211ull;
  }
  return h;
}

std::vector<std::byte> format_checkpoint(const CheckpointConfig& cfg, int64_t step, int64_t skipped,
                                         const DataPosition& data, std::span<const float> params,
                                         std::span<const float> m, std::span<const float> v) {
  const std::vector<int64_t> f = fields_of(cfg, step, skipped, data);
  std::vector<int64_t> head = {kVersion, kFieldCount};
  head.insert(head.end(), f.begin(), f.end());
  const std::size_t n = params.size();
  CPATTN_CHECK(m.size() == n && v.size() == n, "format_checkpoint: m (", m.size(), ") and v (", v.size(),
               ") must have the parameters' size ", n);
  std::vector<std::byte> out(sizeof kMagic + head.size() * 8 + 8 + 3 * n * sizeof(float));
  std::byte* p = out.data();
  std::memcpy(p, kMagic, sizeof kMagic);
  std::memcpy(p + 8, head.data(), head.size() * 8);
  std::byte* payload = p + 8 + head.size() * 8 + 8;
  for (std::size_t i = 0; const std::span<const float> a : {params, m, v})
    if (n > 0) std::memcpy(payload + (i++) * n * sizeof(float), a.data(), n * sizeof(float));
  uint64_t h = fnv1a64(std::span(p + 8, head.size() * 8));
  h = fnv1a64(std::span(payload, 3 * n * sizeof(float)), h);
  std::memcpy(p + 8 + head.size() * 8, &h, 8);
  return out;
}

void save_checkpoint(const std::string& path, const CheckpointConfig& cfg, int64_t step, int64_t skipped,
                     const DataPosition& data, std::span<const float> params, std::span<const float> m,
                     std::span<const float> v) {
  const std::vector<std::byte> out = format_checkpoint(cfg, step, skipped, data, params, m, v);
  try {
    write_file_atomically(path, out);
  } catch (const Error& e) {
    throw Error("checkpoint " + e.message());
  }
}

CheckpointState load_checkpoint(const std::string& path, const CheckpointConfig& cfg) {
  std::vector<std::byte> file;
  try {
    file = read_regular_file(path);
  } catch (const Error& e) {
    throw Error("checkpoint " + e.message());
  }
  return parse_checkpoint(file, path, cfg);
}

CheckpointState parse_checkpoint(std::span<const std::byte> file, const std::string& path, const CheckpointConfig& cfg) {
  const std::size_t size = file.size();
  CPATTN_CHECK(size >= 8 && std::memcmp(file.data(), kMagic, sizeof kMagic) == 0, "checkpoint '", path,
               "' is not a cpattn training checkpoint");
  const auto at = [&](std::size_t i) {
    int64_t x = 0;
    std::memcpy(&x, file.data() + 8 + 8 * i, 8);
    return x;
  };
  CPATTN_CHECK(size >= 24, "checkpoint '", path, "' is truncated (", size, " bytes)");
  const int64_t version = at(0);
  // Version 5 is version 6 without micro and the skipped steps, version 4 without dropout too,
  // version 3 without the mixture-of-experts fields too: read as a model without dropout (and
  // experts), what version 6 records for one, micro unchecked and no step skipped, so that
  // their runs resume.
  CPATTN_CHECK(version >= 3 && version <= kVersion, "checkpoint '", path, "' has version ", version,
               ", this cpattn reads versions 3 to ", kVersion,
               version == 1   ? " (version 1 has no checksum and no configuration: train again)"
               : version == 2 ? " (version 2 has no attention masks in its configuration: train again)"
                              : "");
  const int64_t file_fields = fields_in_version(version);
  CPATTN_CHECK(at(1) == file_fields, "checkpoint '", path, "' has ", at(1), " header fields, want ", file_fields);
  const std::size_t header = 8 + 8 * (2 + file_fields) + 8;
  CPATTN_CHECK(size >= header, "checkpoint '", path, "' is truncated (", size, " bytes, its header alone is ", header,
               ")");
  std::vector<int64_t> got(kFieldCount, 0);
  for (int64_t i = 0, j = 0; i < kFieldCount; ++i)
    if (in_version(i, version)) got[i] = at(2 + j++);
  const int64_t n_file = got[kParamsField];
  CPATTN_CHECK(n_file >= 0 && n_file < (int64_t{1} << 40), "checkpoint '", path, "' has a parameter count of ",
               n_file);
  const std::size_t want_size = header + 3 * static_cast<std::size_t>(n_file) * sizeof(float);
  CPATTN_CHECK(size >= want_size, "checkpoint '", path, "' is truncated: ", size, " bytes, its header says ",
               want_size);
  CPATTN_CHECK(size == want_size, "checkpoint '", path, "' has ", size - want_size,
               " trailing bytes after its data (", want_size, " bytes expected)");
  const std::byte* bytes = file.data();
  uint64_t h = fnv1a64(std::span(bytes + 8, header - 16));
  h = fnv1a64(std::span(bytes + header, size - header), h);
  uint64_t stored = 0;
  std::memcpy(&stored, bytes + header - 8, 8);
  CPATTN_CHECK(h == stored, "checkpoint '", path, "' fails its checksum (the file is corrupt)");

  const std::vector<int64_t> want = fields_of(cfg, 0, 0, {});
  // The parameter count last: a field that explains it (experts, dim, ...) is the better message.
  for (int64_t k = 0; k < kConfigFields; ++k) {
    const int64_t i = k == kConfigFields - 1 ? kParamsField : k < kParamsField ? k : k + 1;
    const FieldName& f = kFields[i];
    if (got[i] == want[i]) continue;
    if (i == kMicroField && (got[i] == 0 || want[i] == 0)) continue;  // not recorded on one side
    if (f.kind == Kind::model || f.kind == Kind::model_real || f.kind == Kind::model_real64 ||
        f.kind == Kind::capacity || f.kind == Kind::router || f.kind == Kind::drop_policy)
      CPATTN_CHECK(false, "checkpoint '", path, "' holds a model with ", f.name, " = ", shown(f.kind, got[i]),
                   ", this run has ", shown(f.kind, want[i]));
    CPATTN_CHECK(false, "checkpoint '", path, "' has ", f.name, " ", shown(f.kind, got[i]), ", this run ",
                 shown(f.kind, want[i]));
  }
  for (int64_t i = kConfigFields; i < kFieldCount; ++i)
    CPATTN_CHECK(got[i] >= 0, "checkpoint '", path, "' has a negative ", kFields[i].name, " (", got[i], ")");
  CPATTN_CHECK(got[kMicroField] >= 0, "checkpoint '", path, "' has a negative micro (", got[kMicroField], ")");
  CheckpointState s;
  s.checksum = stored;
  s.step = got[kConfigFields];
  s.data = {got[kConfigFields + 1], got[kConfigFields + 2], got[kConfigFields + 3]};
  s.skipped = got[kSkippedField];
  s.micro = got[kMicroField];
  CPATTN_CHECK(s.skipped <= s.step, "checkpoint '", path, "' has ", s.skipped, " skipped steps of ", s.step);
  const std::size_t n = static_cast<std::size_t>(n_file);
  const char* names[] = {"weight", "first moment", "second moment"};
  int which = 0;
  for (std::vector<float>* a : {&s.params, &s.m, &s.v}) {
    a->resize(n);
    std::memcpy(a->data(), bytes + header + which * n * sizeof(float), n * sizeof(float));
    for (std::size_t i = 0; i < n; ++i)
      CPATTN_CHECK(std::isfinite((*a)[i]) && (which < 2 || (*a)[i] >= 0), "checkpoint '", path, "' has a ",
                   std::isfinite((*a)[i]) ? "negative" : "non-finite", " ", names[which], " at parameter ", i, " (",
                   (*a)[i], ")");
    ++which;
  }
  return s;
}

}  // namespace cpattn::train
