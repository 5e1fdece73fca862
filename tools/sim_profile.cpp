// Machine profiles as JSON (sim_profile.hpp).
#include "sim_profile.hpp"

#include <cpattn/error.hpp>
#include <cpattn/file.hpp>

#include <algorithm>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace cpattn::cli {

namespace {

constexpr DType kDtypes[] = {DType::f32, DType::f16, DType::bf16};

const nlohmann::json& field(const nlohmann::json& obj, const char* key, const std::string& where,
                            const std::string& path) {
  CPATTN_CHECK(obj.contains(key), where, ": missing field profile.", path, key);
  return obj.at(key);
}

double number(const nlohmann::json& obj, const char* key, const std::string& where, const std::string& path) {
  const nlohmann::json& v = field(obj, key, where, path);
  CPATTN_CHECK(v.is_number(), where, ": profile.", path, key, " must be a number, got ", v.dump());
  return v.get<double>();
}

void only_keys(const nlohmann::json& obj, std::initializer_list<const char*> keys, const std::string& where,
               const std::string& path) {
  CPATTN_CHECK(obj.is_object(), where, ": profile", path.empty() ? "" : ".", path.substr(0, path.size() ? path.size() - 1 : 0),
               " must be a JSON object, got ", obj.dump());
  for (const auto& [k, v] : obj.items()) {
    bool known = false;
    for (const char* want : keys) known = known || k == want;
    std::string names;
    for (const char* want : keys) names += (names.empty() ? "" : ", ") + std::string(want);
    CPATTN_CHECK(known, where, ": unknown field profile.", path, k, " (profile.", path, "* fields: ", names, ")");
  }
}

SimLink parse_link(const nlohmann::json& j, const char* key, const std::string& where) {
  const std::string path = std::string(key) + ".";
  const nlohmann::json& l = field(j, key, where, "");
  only_keys(l, {"bandwidth_gbs", "latency_us"}, where, path);
  return {.bandwidth_gbs = number(l, "bandwidth_gbs", where, path), .latency_us = number(l, "latency_us", where, path)};
}

// {"fp32": x, "bf16": y, ...}: unknown dtypes are an error; absent ones stay 0 (unknown).
void parse_rates(const nlohmann::json& j, const char* dir, const std::string& where, std::array<double, 3>& out) {
  const std::string path = std::string("compute.") + dir + ".";
  const nlohmann::json& r = field(j, dir, where, "compute.");
  CPATTN_CHECK(r.is_object(), where, ": profile.compute.", dir, " must be an object of dtype: GFLOP/s, got ", r.dump());
  for (const auto& [k, v] : r.items()) {
    bool known = false;
    for (const DType t : kDtypes)
      if (k == to_string(t)) {
        CPATTN_CHECK(v.is_number(), where, ": profile.", path, k, " must be a number (GFLOP/s), got ", v.dump());
        out[static_cast<std::size_t>(t)] = v.get<double>();
        known = true;
      }
    CPATTN_CHECK(known, where, ": profile.", path, k, ": unknown dtype '", k, "' (fp32, fp16, bf16)");
  }
}

// {"fwd": {"fp32": {"allgather": x, ...}, ...}, "bwd": {...}}: optional at every level (absent:
// 0, the kernels alone); unknown directions, dtypes and schemes are errors.
void parse_overhead(const nlohmann::json& j, const std::string& where, MachineProfile& p) {
  if (!j.contains("cp_overhead")) return;
  const nlohmann::json& o = j.at("cp_overhead");
  only_keys(o, {"fwd", "bwd"}, where, "cp_overhead.");
  for (const auto& [dir, by_dtype] : o.items()) {
    auto& out = dir == "fwd" ? p.fwd_overhead : p.bwd_overhead;
    const std::string path = "cp_overhead." + dir + ".";
    CPATTN_CHECK(by_dtype.is_object(), where, ": profile.cp_overhead.", dir,
                 " must be an object of dtype: {scheme: fraction}, got ", by_dtype.dump());
    for (const auto& [k, by_scheme] : by_dtype.items()) {
      const std::string dtype = k;  // a copy: lambdas capture no structured binding before clang 16
      const DType* t = std::find_if(std::begin(kDtypes), std::end(kDtypes), [&](DType d) { return dtype == to_string(d); });
      CPATTN_CHECK(t != std::end(kDtypes), where, ": profile.", path, k, ": unknown dtype '", k, "' (fp32, fp16, bf16)");
      CPATTN_CHECK(by_scheme.is_object(), where, ": profile.", path, k,
                   " must be an object of scheme: fraction of the kernel time, got ", by_scheme.dump());
      for (const auto& [name, v] : by_scheme.items()) {
        const std::string scheme = name;
        const CpScheme* s = std::find_if(std::begin(kCpSchemes), std::end(kCpSchemes),
                                         [&](CpScheme x) { return scheme == to_string(x); });
        CPATTN_CHECK(s != std::end(kCpSchemes), where, ": profile.", path, k, ".", name, ": unknown scheme '", name,
                     "' (allgather, ring, pass-q, a2a, hybrid)");
        CPATTN_CHECK(v.is_number(), where, ": profile.", path, k, ".", name,
                     " must be a number (a fraction of the kernel time), got ", v.dump());
        out[static_cast<std::size_t>(*t)][static_cast<std::size_t>(*s)] = v.get<double>();
      }
    }
  }
}

}  // namespace

MachineProfile parse_profile(const nlohmann::json& j, const std::string& where) {
  only_keys(j, {"name", "source", "compute", "intra_node", "inter_node", "ranks_per_node", "memory_gb", "cp_overhead",
             "measured"},
            where, "");
  MachineProfile p;
  if (j.contains("name")) {
    CPATTN_CHECK(j["name"].is_string(), where, ": profile.name must be a string");
    p.name = j["name"].get<std::string>();
  }
  const nlohmann::json& c = field(j, "compute", where, "");
  only_keys(c, {"fwd", "bwd"}, where, "compute.");
  parse_rates(c, "fwd", where, p.fwd_gflops);
  parse_rates(c, "bwd", where, p.bwd_gflops);
  p.intra = parse_link(j, "intra_node", where);
  p.inter = parse_link(j, "inter_node", where);
  const nlohmann::json& rpn = field(j, "ranks_per_node", where, "");
  CPATTN_CHECK(rpn.is_number_integer(), where, ": profile.ranks_per_node must be an integer, got ", rpn.dump());
  CPATTN_CHECK(rpn.get<int64_t>() >= 1 && rpn.get<int64_t>() <= (1 << 20), where,
               ": profile.ranks_per_node must be in [1, 2^20], got ", rpn.dump());
  p.ranks_per_node = rpn.get<int>();
  p.memory_gb = number(j, "memory_gb", where, "");
  parse_overhead(j, where, p);
  try {
    check_machine_profile(p);
  } catch (const Error& e) {
    throw Error(where + ": " + e.message());
  }
  return p;
}

MachineProfile parse_profile_text(std::string_view text, const std::string& where) {
  // A key twice in one object: the parser keeps the last one, silently, so a value added again
  // below instead of changed (a profile edited by hand) was read as the one the reader did not
  // see first. Such a profile is refused, naming the field (profile.inter_node.latency_us; an
  // array's elements as []).
  struct Open {
    bool array = false;
    std::set<std::string> keys;  // an object's keys so far
    std::string key;             // the last of them: the field the parser is in
  };
  std::vector<Open> open;
  std::string twice;
  const auto each = [&](int, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if (event == Event::object_start || event == Event::array_start) {
      open.push_back({.array = event == Event::array_start, .keys = {}, .key = {}});
    } else if ((event == Event::object_end || event == Event::array_end) && !open.empty()) {
      open.pop_back();
    } else if (event == Event::key && !open.empty()) {
      open.back().key = parsed.get<std::string>();
      if (!open.back().keys.insert(open.back().key).second && twice.empty()) {
        twice = "profile";
        for (const Open& o : open) twice += o.array ? "[]" : "." + o.key;
      }
    }
    return true;
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text, each);
  } catch (const nlohmann::json::exception& e) {
    throw Error(where + ": not valid JSON: " + e.what());
  }
  CPATTN_CHECK(twice.empty(), where, ": ", twice, " appears twice in its object: give each key once");
  return parse_profile(j, where);
}

MachineProfile read_profile(const std::string& path) {
  // A regular file only (a FIFO or a device such as /dev/zero is refused before any read), of at
  // most kMaxProfileBytes (a profile is a few hundred bytes: a larger file is a wrong path, refused
  // by its size after reading no more than that); errors name the file and the reason (errno).
  constexpr std::size_t kMaxProfileBytes = std::size_t{1} << 20;
  std::uint64_t size = 0;
  const std::vector<std::byte> bytes = rewrite_errors(
      [&] {
        std::vector<std::byte> b = read_file_prefix(path, kMaxProfileBytes, size);
        CPATTN_CHECK(size <= kMaxProfileBytes, "'", path, "' is ", size, " bytes, more than a machine profile's limit of ",
                     kMaxProfileBytes, " bytes (a JSON object of a few fields; docs/simulate.md)");
        return b;
      },
      [](const std::string& m) { return "--profile: " + m; });
  return parse_profile_text(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
                            "--profile " + path);
}

nlohmann::json profile_json(const MachineProfile& p, const std::string& source) {
  nlohmann::json j;
  j["name"] = p.name;
  j["source"] = source;
  nlohmann::json fwd = nlohmann::json::object(), bwd = nlohmann::json::object();
  for (const DType t : kDtypes) {
    const auto i = static_cast<std::size_t>(t);
    if (p.fwd_gflops[i] > 0) fwd[std::string(to_string(t))] = p.fwd_gflops[i];
    if (p.bwd_gflops[i] > 0) bwd[std::string(to_string(t))] = p.bwd_gflops[i];
  }
  j["compute"] = {{"fwd", fwd}, {"bwd", bwd}};
  j["intra_node"] = {{"bandwidth_gbs", p.intra.bandwidth_gbs}, {"latency_us", p.intra.latency_us}};
  j["inter_node"] = {{"bandwidth_gbs", p.inter.bandwidth_gbs}, {"latency_us", p.inter.latency_us}};
  j["ranks_per_node"] = p.ranks_per_node;
  j["memory_gb"] = p.memory_gb;
  // The overheads of a dtype with any nonzero one (every scheme's, 0 included); none: left out.
  nlohmann::json over = nlohmann::json::object();
  for (const bool backward : {false, true}) {
    const auto& o = backward ? p.bwd_overhead : p.fwd_overhead;
    for (const DType t : kDtypes) {
      const auto& row = o[static_cast<std::size_t>(t)];
      if (std::all_of(row.begin(), row.end(), [](double x) { return x == 0; })) continue;
      for (const CpScheme s : kCpSchemes)
        over[backward ? "bwd" : "fwd"][std::string(to_string(t))][std::string(to_string(s))] =
            row[static_cast<std::size_t>(s)];
    }
  }
  if (!over.empty()) j["cp_overhead"] = over;
  return j;
}

MachineProfile default_profile() {
  // Nominal figures, see examples/profiles/gpu-8x-nvlink-400g.json's "source".
  return {.name = "gpu-8x-nvlink-400g",
          .fwd_gflops = {33500, 495000, 495000},
          .bwd_gflops = {33500, 495000, 495000},
          .intra = {.bandwidth_gbs = 450, .latency_us = 3},
          .inter = {.bandwidth_gbs = 50, .latency_us = 5},
          .ranks_per_node = 8,
          .memory_gb = 80};
}

}  // namespace cpattn::cli
