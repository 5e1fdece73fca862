// Checkpoint files (checkpoint.hpp).
#include "checkpoint.hpp"

#include <cpattn/error.hpp>

#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace cpattn::train {

namespace {

constexpr char kMagic[8] = {'C', 'P', 'A', 'T', 'T', 'N', 'T', 'R'};
constexpr int64_t kVersion = 1;
constexpr std::size_t kHeaderFields = 13;

// The header's int64 fields after the magic.
std::vector<int64_t> header_fields(const ModelConfig& mc, int64_t n_params, int64_t step, const DataPosition& d) {
  return {kVersion,     mc.vocab, mc.layers, mc.dim,  mc.heads, mc.kv_heads, mc.ffn_dim(),
          std::bit_cast<int32_t>(mc.rope_theta), n_params, step, d.doc, d.offset, d.epoch};
}

}  // namespace

void save_checkpoint(const std::string& path, const ModelConfig& mc, int64_t step, const DataPosition& data,
                     std::span<const float> params, std::span<const float> m, std::span<const float> v) {
  const std::string tmp = path + ".tmp";
  const auto n = static_cast<int64_t>(params.size());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    CPATTN_CHECK(out.good(), "checkpoint '", path, "': cannot write '", tmp, "'");
    const std::vector<int64_t> h = header_fields(mc, n, step, data);
    out.write(kMagic, sizeof kMagic);
    out.write(reinterpret_cast<const char*>(h.data()), static_cast<std::streamsize>(h.size() * sizeof(int64_t)));
    for (const std::span<const float> a : {params, m, v})
      out.write(reinterpret_cast<const char*>(a.data()), static_cast<std::streamsize>(n * sizeof(float)));
    CPATTN_CHECK(out.good(), "checkpoint '", path, "': error while writing '", tmp, "'");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  CPATTN_CHECK(!ec, "checkpoint '", path, "': cannot rename '", tmp, "' to it: ", ec.message());
}

CheckpointState load_checkpoint(const std::string& path, const ModelConfig& mc, int64_t n_params) {
  std::ifstream in(path, std::ios::binary);
  CPATTN_CHECK(in.good(), "checkpoint '", path, "': cannot read it");
  char magic[8] = {};
  std::vector<int64_t> h(kHeaderFields);
  in.read(magic, sizeof magic);
  CPATTN_CHECK(in.good() && std::memcmp(magic, kMagic, sizeof kMagic) == 0, "checkpoint '", path,
               "' is not a cpattn training checkpoint");
  in.read(reinterpret_cast<char*>(h.data()), static_cast<std::streamsize>(h.size() * sizeof(int64_t)));
  CPATTN_CHECK(in.good() && h[0] == kVersion, "checkpoint '", path, "' has an unknown version");
  const std::vector<int64_t> want = header_fields(mc, n_params, 0, {});
  const char* names[] = {"version", "vocab", "layers", "dim", "heads", "kv_heads", "ffn", "rope_theta", "parameters"};
  for (std::size_t i = 1; i < 9; ++i)
    CPATTN_CHECK(h[i] == want[i], "checkpoint '", path, "' holds a model with ", names[i], " = ", h[i],
                 ", this run has ", want[i]);
  CheckpointState s;
  s.params.resize(n_params);
  s.m.resize(n_params);
  s.v.resize(n_params);
  for (std::vector<float>* a : {&s.params, &s.m, &s.v})
    in.read(reinterpret_cast<char*>(a->data()), static_cast<std::streamsize>(n_params * sizeof(float)));
  CPATTN_CHECK(in.good(), "checkpoint '", path, "' is truncated");
  s.step = h[9];
  s.data = {h[10], h[11], h[12]};
  return s;
}

}  // namespace cpattn::train
