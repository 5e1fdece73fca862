// The command line's shared vocabulary (docs/cli.md): the spellings of the storage type, the
// mask, the kernel path and the CP scheme, written once for `cpattn run`, `bench attention` and `train`.
// parse_* throw cpattn::Error with a one-line message that names the flag and lists the valid
// values; the *_transformer()s run them at parse time and rewrite the value to its canonical
// name (float32 -> fp32), so that reports and JSON print one spelling.
#pragma once

#include <cpattn/attention.hpp>
#include <cpattn/cp_scheme.hpp>
#include <cpattn/dtype.hpp>
#include <cpattn/error.hpp>
#include <cpattn/plan.hpp>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace cpattn::cli {

// "fp32", "fp16", "bf16".

inline std::string mask_name(MaskType m) { return m == MaskType::causal ? "causal" : "none"; }

inline std::string kernel_path_name(KernelPath p) { return std::string(to_string(p)); }
// Every KernelPath, in enum order (the names --kernel-path takes).
inline constexpr KernelPath kAllKernelPaths[] = {KernelPath::automatic,   KernelPath::portable,
                                                 KernelPath::avx2,        KernelPath::avx512,
                                                 KernelPath::avx512_bf16, KernelPath::bf16_emulated,
                                                 KernelPath::amx,         KernelPath::amx_emulated};

inline constexpr DType kAllDtypes[] = {DType::f32, DType::f16, DType::bf16};
inline constexpr DType kTrainDtypes[] = {DType::f32, DType::bf16};  // what cpattn train supports

// --dtype: fp32|fp16|bf16, or PyTorch's float32|float16|bfloat16. `allowed` is what the
// command supports; `who` names a command that supports fewer than all.
inline DType parse_dtype(std::string_view s, std::span<const DType> allowed = kAllDtypes,
                         std::string_view who = "") {
  static constexpr struct {
    std::string_view name, torch;
    DType t;
  } names[] = {{"fp32", "float32", DType::f32}, {"fp16", "float16", DType::f16}, {"bf16", "bfloat16", DType::bf16}};
  std::ostringstream ours, torch;  // (streams: GCC 12 warns on a chain of string +)
  for (const auto& n : names) {
    if (std::find(allowed.begin(), allowed.end(), n.t) == allowed.end()) continue;
    if (s == n.name || s == n.torch) return n.t;
    ours << (ours.tellp() > 0 ? ", " : "") << n.name;
    torch << (torch.tellp() > 0 ? ", " : "") << n.torch;
  }
  std::ostringstream msg;
  msg << "--dtype must be one of " << ours.str() << " (or " << torch.str() << ")";
  if (!who.empty()) msg << " (" << who << " supports only these today)";
  msg << ", got '" << s << "'";
  throw Error(msg.str());
}

inline MaskType parse_mask(std::string_view s, std::string_view flag = "--mask") {
  if (s == "causal") return MaskType::causal;
  if (s == "none") return MaskType::none;
  throw Error(std::string(flag) + " must be one of causal, none, got '" + std::string(s) + "'");
}

// The fields of `s` between the separators, empty ones kept ("a,,b," is four fields; "" one).
inline std::vector<std::string_view> split_fields(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  for (size_t at = 0;; ) {
    const size_t end = s.find(sep, at);
    out.push_back(s.substr(at, end == std::string_view::npos ? std::string_view::npos : end - at));
    if (end == std::string_view::npos) return out;
    at = end + 1;
  }
}

// --window LEFT,RIGHT (AttnOptions::window_size_left/right, -1 = unbounded): two integers >= -1.
struct Window {
  int64_t left = -1, right = -1;
};
inline Window parse_window(std::string_view s, std::string_view flag = "--window") {
  const std::string bad = std::string(flag) + " must be LEFT,RIGHT, two integers >= -1 (-1 = unbounded), got '" +
                          std::string(s) + "'";
  if (s.empty()) return {};
  const auto fields = split_fields(s, ',');
  if (fields.size() != 2) throw Error(bad);
  auto num = [&](std::string_view x) {
    if (x.empty() || x.size() > 18) throw Error(bad);
    size_t i = x[0] == '-' ? 1 : 0;
    if (i == x.size()) throw Error(bad);
    for (size_t j = i; j < x.size(); ++j)
      if (x[j] < '0' || x[j] > '9') throw Error(bad);
    const int64_t v = std::stoll(std::string(x));
    if (v < -1) throw Error(bad);
    return v;
  };
  return {num(fields[0]), num(fields[1])};
}
// --softcap X: finite and >= 0 (0 = off).
inline float check_softcap(float x, std::string_view flag = "--softcap") {
  if (!(x >= 0.0f) || x == std::numeric_limits<float>::infinity()) {
    std::ostringstream msg;
    msg << flag << " must be finite and >= 0 (0 = off), got " << x;
    throw Error(msg.str());
  }
  return x;
}

// CpAttnConfig::kv_mode's names (the enum is the MPI layer's, which this header does not need).
inline std::string parse_kv_mode(std::string_view s, std::string_view flag = "--mode") {
  if (s == "runs" || s == "index") return std::string(s);
  throw Error(std::string(flag) + " must be one of runs, index, got '" + std::string(s) + "'");
}

// --scheme (run) and --cp-scheme (train): CpScheme by its to_string name, over the library's
// kCpSchemes (cpattn/cp.hpp): a scheme added there reaches every command unchanged.
inline std::string scheme_names(std::string_view sep = ", ") {
  std::string names;
  for (const CpScheme c : kCpSchemes) (names += names.empty() ? "" : sep) += to_string(c);
  return names;
}

inline CpScheme parse_scheme(std::string_view s, std::string_view flag = "--scheme") {
  for (const CpScheme c : kCpSchemes)
    if (s == to_string(c)) return c;
  throw Error(std::string(flag) + " must be one of " + scheme_names() + ", got '" + std::string(s) + "'");
}

// cpattn run's --scheme: one scheme, or "all" (every scheme on the same batch, in kCpSchemes'
// order).
inline std::vector<CpScheme> parse_run_schemes(std::string_view s) {
  if (s == "all") return {std::begin(kCpSchemes), std::end(kCpSchemes)};
  try {
    return {parse_scheme(s)};
  } catch (const Error&) {
    throw Error("--scheme must be one of " + scheme_names() + ", all, got '" + std::string(s) + "'");
  }
}

// CpSplit's names: "padded", "padding-free" (also "padding_free", the enum's spelling).
inline CpSplit parse_split(std::string_view s, std::string_view flag = "--split") {
  if (s == "padded") return CpSplit::padded;
  if (s == "padding-free" || s == "padding_free") return CpSplit::padding_free;
  throw Error(std::string(flag) + " must be one of padded, padding-free, got '" + std::string(s) + "'");
}

inline KernelPath parse_kernel_path(std::string_view s, std::string_view flag = "--kernel-path") {
  for (const KernelPath p : kAllKernelPaths)
    if (s == to_string(p)) return p;
  std::string names;
  for (const KernelPath p : kAllKernelPaths) names += (names.empty() ? "" : ", ") + std::string(to_string(p));
  throw Error(std::string(flag) + " must be one of " + names + ", got '" + std::string(s) + "'");
}

// A forced path this CPU cannot run is bad input too (exit 2), caught before any kernel runs.
inline void check_kernel_path_supported(KernelPath p, std::string_view flag = "--kernel-path") {
  CPATTN_CHECK(kernel_path_supported(p), flag, " ", to_string(p), " cannot run on this CPU (",
               p == KernelPath::amx ? "it needs AVX-512, AVX512_BF16, AMX-TILE, AMX-BF16 and the OS's permission "
                                      "for tile data"
                                    : "the CPU lacks its instructions",
               "; automatic picks ", to_string(best_kernel_path()), ")");
}

namespace detail {
// Runs `canonical` on the value at parse time: rewrites it, or rejects it as a parse error
// (exit 2, one line, the message as written above).
template <class F>
CLI::Validator vocab_transformer(F canonical, std::string desc) {
  return CLI::Validator(
      [canonical](std::string& value) -> std::string {
        try {
          value = canonical(value);
        } catch (const Error& e) {
          throw CLI::ConversionError(e.message());
        }
        return {};
      },
      std::move(desc));
}
}  // namespace detail

inline CLI::Validator dtype_transformer(std::span<const DType> allowed = kAllDtypes, std::string who = "") {
  std::string desc = "{";
  for (const DType t : allowed) {
    if (desc.size() > 1) desc += '|';
    desc += to_string(t);
  }
  desc += '}';
  return detail::vocab_transformer(
      [allowed, who](const std::string& v) { return std::string(to_string(parse_dtype(v, allowed, who))); }, std::move(desc));
}

inline CLI::Validator mask_transformer() {
  return detail::vocab_transformer([](const std::string& v) { return mask_name(parse_mask(v)); },
                                   "{causal|none}");
}

inline CLI::Validator kv_mode_transformer() {
  return detail::vocab_transformer(
      [](const std::string& v) { return parse_kv_mode(v); },
      "{runs|index}");
}

inline CLI::Validator scheme_transformer(std::string flag = "--scheme") {
  return detail::vocab_transformer([flag](const std::string& v) { return std::string(to_string(parse_scheme(v, flag))); },
                                   "{" + scheme_names("|") + "}");
}

// cpattn run's --scheme, which also takes "all".
inline CLI::Validator run_scheme_transformer() {
  return detail::vocab_transformer(
      [](const std::string& v) {
        const auto s = parse_run_schemes(v);
        return s.size() == 1 && v != "all" ? std::string(to_string(s.front())) : std::string("all");
      },
      "{" + scheme_names("|") + "|all}");
}

inline CLI::Validator split_transformer() {
  return detail::vocab_transformer([](const std::string& v) { return std::string(to_string(parse_split(v))); },
                                   "{padded|padding-free}");
}

// --timeout SECONDS of the MPI commands (docs/cli.md, Deadlines). Unset, the deadline is
// CPATTN_COMM_TIMEOUT_S, else 300 s: the Communicator resolves it (with CommOptions::timeout_name
// "--timeout", so that its messages name the flag) and checks the value.
inline CLI::Option* add_timeout_option(CLI::App* cmd, std::optional<double>& timeout) {
  return cmd->add_option_function<double>(
      "--timeout", [&timeout](const double& s) { timeout = s; },
      "Deadline of each collective, seconds (beats the CPATTN_COMM_TIMEOUT_S variable; default 300)");
}

inline CLI::Validator kernel_path_transformer() {
  std::string desc;
  for (const KernelPath p : kAllKernelPaths) desc += (desc.empty() ? "{" : "|") + std::string(to_string(p));
  return detail::vocab_transformer([](const std::string& v) { return kernel_path_name(parse_kernel_path(v)); },
                                   desc + "}");
}

}  // namespace cpattn::cli
