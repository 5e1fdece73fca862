// The device mesh: coordinates and groups (include/cpattn/mesh.hpp).
#include <cpattn/error.hpp>
#include <cpattn/mesh.hpp>

#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <utility>

namespace cpattn {

namespace {

constexpr int kMaxMeshWorld = 1 << 20;

constexpr std::size_t idx(MeshAxis a) { return static_cast<std::size_t>(a); }

// a * b, saturating at int64's maximum (products of user sizes are only compared and printed).
int64_t mul_sat(int64_t a, int64_t b) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  return (b != 0 && a > kMax / b) ? kMax : a * b;
}

// "tp * cp * pp = 2*4*2 = 16", and the product.
struct Product {
  std::string text;
  int64_t value = 1;
};
Product product(std::initializer_list<std::pair<const char*, int>> factors) {
  std::string names, values;
  int64_t p = 1;
  for (const auto& [name, v] : factors) {
    if (!names.empty()) {
      names += " * ";
      values += '*';
    }
    names += name;
    values += std::to_string(v);
    p = mul_sat(p, v);
  }
  const std::string shown =
      p == std::numeric_limits<int64_t>::max() ? std::string("more than 2^63") : std::to_string(p);
  std::string text = names;
  text.append(" = ").append(values).append(" = ").append(shown);
  return {.text = std::move(text), .value = p};
}

void check_size(int value, const char* name) {
  CPATTN_CHECK(value >= 1, name, " must be >= 1, got ", value);
}

// The base axes a group of `axis` varies over.
std::vector<MeshAxis> parts(MeshAxis axis) {
  switch (axis) {
    case MeshAxis::dp_cp: return {MeshAxis::cp, MeshAxis::dp};
    case MeshAxis::tp_cp: return {MeshAxis::tp, MeshAxis::cp};
    case MeshAxis::tp_pp: return {MeshAxis::tp, MeshAxis::pp};
    case MeshAxis::etp_ep: return {MeshAxis::etp, MeshAxis::ep};
    default: return {axis};
  }
}

// Stride of a base axis in its layout (pp's is the same in both).
int stride(const MeshSizes& s, MeshAxis axis) {
  switch (axis) {
    case MeshAxis::tp: return 1;
    case MeshAxis::cp: return s.tp;
    case MeshAxis::dp: return s.tp * s.cp;
    case MeshAxis::pp: return s.tp * s.cp * s.dp;
    case MeshAxis::etp: return 1;
    case MeshAxis::ep: return s.etp;
    case MeshAxis::edp: return s.etp * s.ep;
    default: return 0;
  }
}

}  // namespace

std::string_view mesh_axis_name(MeshAxis axis) {
  switch (axis) {
    case MeshAxis::tp: return "tp";
    case MeshAxis::cp: return "cp";
    case MeshAxis::dp: return "dp";
    case MeshAxis::pp: return "pp";
    case MeshAxis::etp: return "etp";
    case MeshAxis::ep: return "ep";
    case MeshAxis::edp: return "edp";
    case MeshAxis::dp_cp: return "dp_cp";
    case MeshAxis::tp_cp: return "tp_cp";
    case MeshAxis::tp_pp: return "tp_pp";
    case MeshAxis::etp_ep: return "etp_ep";
  }
  return "?";
}

int MeshSizes::size(MeshAxis axis) const {
  switch (axis) {
    case MeshAxis::tp: return tp;
    case MeshAxis::cp: return cp;
    case MeshAxis::dp: return dp;
    case MeshAxis::pp: return pp;
    case MeshAxis::etp: return etp;
    case MeshAxis::ep: return ep;
    case MeshAxis::edp: return edp;
    case MeshAxis::dp_cp: return dp * cp;
    case MeshAxis::tp_cp: return tp * cp;
    case MeshAxis::tp_pp: return tp * pp;
    case MeshAxis::etp_ep: return etp * ep;
  }
  return 0;
}

MeshSizes resolve_mesh(const MeshShape& shape) {
  check_size(shape.world, "world");
  check_size(shape.tp, "tp");
  check_size(shape.cp, "cp");
  check_size(shape.pp, "pp");
  check_size(shape.ep, "ep");
  if (shape.dp) check_size(*shape.dp, "dp");
  if (shape.etp) check_size(*shape.etp, "etp");
  if (shape.edp) check_size(*shape.edp, "edp");
  if (shape.ranks_per_node) check_size(*shape.ranks_per_node, "ranks_per_node");
  const int world = shape.world;
  // The mesh lists every rank on every axis: keep it to what a table can hold.
  CPATTN_CHECK(world <= kMaxMeshWorld, "world must be <= ", kMaxMeshWorld, " ranks, got ", world);

  int dp = 0;
  if (shape.dp) {
    dp = *shape.dp;
  } else {
    const Product p = product({{"tp", shape.tp}, {"cp", shape.cp}, {"pp", shape.pp}});
    CPATTN_CHECK(p.value <= world && world % p.value == 0, p.text,
                 " does not divide the world of ", world, " ranks, so dp cannot be derived");
    dp = static_cast<int>(world / p.value);
  }
  const Product dense =
      product({{"tp", shape.tp}, {"cp", shape.cp}, {"dp", dp}, {"pp", shape.pp}});
  CPATTN_CHECK(dense.value == world, dense.text, " but the world has ", world, " ranks");

  const int stage = shape.tp * shape.cp * dp;  // ranks of one pipeline stage
  const int etp = shape.etp.value_or(shape.tp);
  int edp = 0;
  if (shape.edp) {
    edp = *shape.edp;
  } else {
    const Product p = product({{"etp", etp}, {"ep", shape.ep}});
    CPATTN_CHECK(p.value <= stage && stage % p.value == 0, "expert axes do not fold: ", p.text,
                 " does not divide the ranks of one pipeline stage, tp * cp * dp = ", shape.tp,
                 "*", shape.cp, "*", dp, " = ", stage);
    edp = static_cast<int>(stage / p.value);
  }
  const Product expert = product({{"etp", etp}, {"ep", shape.ep}, {"edp", edp}});
  CPATTN_CHECK(expert.value == stage, "expert axes do not fold: ", expert.text,
               " but one pipeline stage has tp * cp * dp = ", shape.tp, "*", shape.cp, "*", dp,
               " = ", stage, " ranks");
  return {.world = world,
          .tp = shape.tp,
          .cp = shape.cp,
          .dp = dp,
          .pp = shape.pp,
          .etp = etp,
          .ep = shape.ep,
          .edp = edp,
          .ranks_per_node = shape.ranks_per_node.value_or(0)};
}

Mesh make_mesh(const MeshShape& shape) {
  Mesh mesh{.sizes = resolve_mesh(shape), .ranks = {}, .groups = {}};
  const MeshSizes& s = mesh.sizes;
  mesh.ranks.resize(static_cast<std::size_t>(s.world));
  for (int r = 0; r < s.world; ++r) mesh.ranks[static_cast<std::size_t>(r)].rank = r;

  for (const MeshAxis axis : kAllMeshAxes) {
    const std::vector<MeshAxis> varying = parts(axis);
    std::vector<MeshGroup>& groups = mesh.groups[idx(axis)];
    // The group of rank r is named by its smallest rank: r with the varying coordinates zeroed.
    std::vector<int> group_of_base(static_cast<std::size_t>(s.world), -1);
    for (int r = 0; r < s.world; ++r) {
      int base = r;
      for (const MeshAxis a : varying) {
        const int st = stride(s, a);
        base -= ((r / st) % s.size(a)) * st;
      }
      int& g = group_of_base[static_cast<std::size_t>(base)];
      if (g < 0) {
        g = static_cast<int>(groups.size());
        groups.emplace_back();
      }
      MeshGroup& group = groups[static_cast<std::size_t>(g)];
      MeshRank& mr = mesh.ranks[static_cast<std::size_t>(r)];
      mr.group[idx(axis)] = g;
      mr.coord[idx(axis)] = static_cast<int>(group.ranks.size());
      group.ranks.push_back(r);
    }
    for (MeshGroup& g : groups) {
      if (s.ranks_per_node == 0) continue;
      // Ranks ascend, so the nodes do too: count the changes.
      g.nodes = 1;
      for (std::size_t i = 1; i < g.ranks.size(); ++i)
        if (g.ranks[i] / s.ranks_per_node != g.ranks[i - 1] / s.ranks_per_node) ++g.nodes;
      g.crosses_nodes = g.nodes > 1;
    }
  }
  return mesh;
}

SplitColorKey split_color_key(const Mesh& mesh, int rank, MeshAxis axis) {
  CPATTN_CHECK(rank >= 0 && rank < mesh.sizes.world, "rank must be in [0, ", mesh.sizes.world,
               "), got ", rank);
  const MeshRank& r = mesh.ranks[static_cast<std::size_t>(rank)];
  return {.color = r.group[idx(axis)], .key = r.coord[idx(axis)]};
}

}  // namespace cpattn
