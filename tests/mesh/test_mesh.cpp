// The mesh against hand-worked tables (include/cpattn/mesh.hpp), and its invariants.
#include <cpattn/error.hpp>
#include <cpattn/mesh.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

namespace cpattn {
namespace {

using Groups = std::vector<std::vector<int>>;

Groups ranks_of(const Mesh& m, MeshAxis axis) {
  Groups out;
  for (const MeshGroup& g : m.groups_of(axis)) out.push_back(g.ranks);
  return out;
}

std::vector<bool> crossing(const Mesh& m, MeshAxis axis) {
  std::vector<bool> out;
  for (const MeshGroup& g : m.groups_of(axis)) out.push_back(g.crosses_nodes);
  return out;
}

std::string error_of(const MeshShape& shape) {
  try {
    (void)make_mesh(shape);
  } catch (const Error& e) {
    return e.message();
  }
  return "no error";
}

// world 16 = tp 2 x cp 4 x pp 2 (dp derived: 1): rank = tp + 2*cp + 8*pp.
TEST(Mesh, Tp2Cp4Pp2) {
  const Mesh m = make_mesh({.world = 16, .tp = 2, .cp = 4, .pp = 2, .ranks_per_node = 8});
  EXPECT_EQ(m.sizes.dp, 1);
  EXPECT_EQ(m.sizes.etp, 2);  // expert tp defaults to tp
  EXPECT_EQ(m.sizes.edp, 4);  // 8 / (2 * 1)
  // rank: tp cp dp pp
  const int table[16][4] = {{0, 0, 0, 0}, {1, 0, 0, 0}, {0, 1, 0, 0}, {1, 1, 0, 0},
                            {0, 2, 0, 0}, {1, 2, 0, 0}, {0, 3, 0, 0}, {1, 3, 0, 0},
                            {0, 0, 0, 1}, {1, 0, 0, 1}, {0, 1, 0, 1}, {1, 1, 0, 1},
                            {0, 2, 0, 1}, {1, 2, 0, 1}, {0, 3, 0, 1}, {1, 3, 0, 1}};
  for (int r = 0; r < 16; ++r) {
    EXPECT_EQ(m.coord(r, MeshAxis::tp), table[r][0]) << r;
    EXPECT_EQ(m.coord(r, MeshAxis::cp), table[r][1]) << r;
    EXPECT_EQ(m.coord(r, MeshAxis::dp), table[r][2]) << r;
    EXPECT_EQ(m.coord(r, MeshAxis::pp), table[r][3]) << r;
  }
  EXPECT_EQ(ranks_of(m, MeshAxis::tp),
            (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(ranks_of(m, MeshAxis::cp),
            (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}));
  EXPECT_EQ(ranks_of(m, MeshAxis::pp), (Groups{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12},
                                               {5, 13}, {6, 14}, {7, 15}}));
  EXPECT_EQ(ranks_of(m, MeshAxis::dp).size(), 16u);
  EXPECT_EQ(ranks_of(m, MeshAxis::dp_cp), ranks_of(m, MeshAxis::cp));
  EXPECT_EQ(ranks_of(m, MeshAxis::tp_cp), (Groups{{0, 1, 2, 3, 4, 5, 6, 7},
                                                  {8, 9, 10, 11, 12, 13, 14, 15}}));
  EXPECT_EQ(ranks_of(m, MeshAxis::tp_pp),
            (Groups{{0, 1, 8, 9}, {2, 3, 10, 11}, {4, 5, 12, 13}, {6, 7, 14, 15}}));
  // 8 ranks per node: a stage is a node, so only groups spanning stages leave it.
  for (const MeshAxis a : {MeshAxis::tp, MeshAxis::cp, MeshAxis::dp, MeshAxis::dp_cp,
                           MeshAxis::tp_cp, MeshAxis::etp, MeshAxis::ep, MeshAxis::edp})
    for (const MeshGroup& g : m.groups_of(a)) EXPECT_FALSE(g.crosses_nodes) << mesh_axis_name(a);
  for (const MeshAxis a : {MeshAxis::pp, MeshAxis::tp_pp})
    for (const MeshGroup& g : m.groups_of(a)) {
      EXPECT_TRUE(g.crosses_nodes) << mesh_axis_name(a);
      EXPECT_EQ(g.nodes, 2);
    }
}

// The same shape on nodes of 4: every cp group now spans two nodes, tp groups never do.
TEST(Mesh, NodeSizeSplitsCpGroups) {
  const Mesh m = make_mesh({.world = 16, .tp = 2, .cp = 4, .pp = 2, .ranks_per_node = 4});
  EXPECT_EQ(crossing(m, MeshAxis::cp), (std::vector<bool>{true, true, true, true}));
  EXPECT_EQ(m.groups_of(MeshAxis::cp)[0].nodes, 2);  // {0,2} on node 0, {4,6} on node 1
  EXPECT_EQ(crossing(m, MeshAxis::tp), std::vector<bool>(8, false));
  EXPECT_EQ(m.groups_of(MeshAxis::tp_cp)[1].nodes, 2);
  // Nodes of 3 (not dividing the world): tp group {2,3} splits, {0,1} and {4,5} do not.
  const Mesh odd = make_mesh({.world = 16, .tp = 2, .cp = 4, .pp = 2, .ranks_per_node = 3});
  EXPECT_EQ(crossing(odd, MeshAxis::tp),
            (std::vector<bool>{false, true, false, false, true, false, false, true}));
  // Without a node size nothing is marked.
  const Mesh none = make_mesh({.world = 16, .tp = 2, .cp = 4, .pp = 2});
  EXPECT_EQ(crossing(none, MeshAxis::pp), std::vector<bool>(8, false));
}

// The header's worked example: every axis, expert ones included.
TEST(Mesh, WorkedExampleWithExpertAxes) {
  const Mesh m = make_mesh(
      {.world = 16, .tp = 2, .cp = 2, .dp = 2, .pp = 2, .etp = 1, .ep = 2, .ranks_per_node = 8});
  EXPECT_EQ(m.sizes.edp, 4);
  EXPECT_EQ(m.coord(13, MeshAxis::tp), 1);
  EXPECT_EQ(m.coord(13, MeshAxis::cp), 0);
  EXPECT_EQ(m.coord(13, MeshAxis::dp), 1);
  EXPECT_EQ(m.coord(13, MeshAxis::pp), 1);
  EXPECT_EQ(m.coord(13, MeshAxis::etp), 0);
  EXPECT_EQ(m.coord(13, MeshAxis::ep), 1);
  EXPECT_EQ(m.coord(13, MeshAxis::edp), 2);
  EXPECT_EQ(m.coord(13, MeshAxis::dp_cp), 2);  // cp + 2 * dp
  EXPECT_EQ(ranks_of(m, MeshAxis::cp), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10},
                                               {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(ranks_of(m, MeshAxis::dp), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12},
                                               {9, 13}, {10, 14}, {11, 15}}));
  EXPECT_EQ(ranks_of(m, MeshAxis::dp_cp),
            (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}));
  EXPECT_EQ(ranks_of(m, MeshAxis::etp).size(), 16u);
  EXPECT_EQ(ranks_of(m, MeshAxis::ep), ranks_of(m, MeshAxis::tp));
  EXPECT_EQ(ranks_of(m, MeshAxis::edp), ranks_of(m, MeshAxis::dp_cp));
  EXPECT_EQ(ranks_of(m, MeshAxis::etp_ep), ranks_of(m, MeshAxis::tp));
}

// Pure data parallel with experts: ep 4 of 8 ranks, edp 2.
TEST(Mesh, DataParallelWithExperts) {
  const Mesh m = make_mesh({.world = 8, .ep = 4});
  EXPECT_EQ(m.sizes.dp, 8);
  EXPECT_EQ(m.sizes.edp, 2);
  EXPECT_EQ(ranks_of(m, MeshAxis::dp), (Groups{{0, 1, 2, 3, 4, 5, 6, 7}}));
  EXPECT_EQ(ranks_of(m, MeshAxis::ep), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(ranks_of(m, MeshAxis::edp), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  // Expert tp 2 x ep 2 x edp 2 over tp 2 x dp 4.
  const Mesh e = make_mesh({.world = 8, .tp = 2, .etp = 2, .ep = 2});
  EXPECT_EQ(e.sizes.edp, 2);
  EXPECT_EQ(ranks_of(e, MeshAxis::ep), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(ranks_of(e, MeshAxis::edp), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(ranks_of(e, MeshAxis::etp_ep), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
}

// Every axis of every shape: groups partition the world, have the axis's size, and the
// coordinates agree with the documented layout; split_color_key names the group and place.
TEST(Mesh, InvariantsOverShapes) {
  for (int tp : {1, 2, 3})
    for (int cp : {1, 2, 4})
      for (int dp : {1, 2, 3})
        for (int pp : {1, 2, 3})
          for (int ep : {1, 2, 3}) {
            const int stage = tp * cp * dp;
            if (stage % ep != 0) continue;
            const int world = stage * pp;
            const Mesh m = make_mesh(
                {.world = world, .tp = tp, .cp = cp, .dp = dp, .pp = pp, .etp = 1, .ep = ep});
            for (int r = 0; r < world; ++r) {
              const int dense = m.coord(r, MeshAxis::tp) +
                                tp * (m.coord(r, MeshAxis::cp) +
                                      cp * (m.coord(r, MeshAxis::dp) + dp * m.coord(r, MeshAxis::pp)));
              EXPECT_EQ(dense, r);
              const int expert = m.coord(r, MeshAxis::ep) +
                                 ep * (m.coord(r, MeshAxis::edp) + (stage / ep) * m.coord(r, MeshAxis::pp));
              EXPECT_EQ(expert, r);
            }
            for (const MeshAxis axis : kAllMeshAxes) {
              std::vector<int> seen(static_cast<std::size_t>(world), 0);
              const auto& groups = m.groups_of(axis);
              EXPECT_EQ(static_cast<int>(groups.size()) * m.sizes.size(axis), world);
              for (std::size_t g = 0; g < groups.size(); ++g) {
                EXPECT_EQ(static_cast<int>(groups[g].ranks.size()), m.sizes.size(axis));
                EXPECT_TRUE(std::is_sorted(groups[g].ranks.begin(), groups[g].ranks.end()));
                for (std::size_t i = 0; i < groups[g].ranks.size(); ++i) {
                  const int r = groups[g].ranks[i];
                  ++seen[static_cast<std::size_t>(r)];
                  const SplitColorKey ck = split_color_key(m, r, axis);
                  EXPECT_EQ(ck.color, static_cast<int>(g));
                  EXPECT_EQ(ck.key, static_cast<int>(i));
                }
              }
              EXPECT_EQ(seen, std::vector<int>(static_cast<std::size_t>(world), 1));
            }
          }
}

TEST(Mesh, ErrorsSayWhichProductIsOff) {
  EXPECT_NE(error_of({.world = 12, .tp = 2, .cp = 4, .dp = 1, .pp = 2})
                .find("tp * cp * dp * pp = 2*4*1*2 = 16 but the world has 12 ranks"),
            std::string::npos);
  EXPECT_NE(error_of({.world = 12, .tp = 2, .cp = 4, .pp = 2})
                .find("tp * cp * pp = 2*4*2 = 16 does not divide the world of 12 ranks"),
            std::string::npos);
  EXPECT_NE(error_of({.world = 8, .tp = 2, .cp = 2, .ep = 3})
                .find("expert axes do not fold: etp * ep = 2*3 = 6 does not divide the ranks of "
                      "one pipeline stage, tp * cp * dp = 2*2*2 = 8"),
            std::string::npos);
  EXPECT_NE(error_of({.world = 8, .tp = 2, .cp = 2, .etp = 1, .ep = 2, .edp = 2})
                .find("expert axes do not fold: etp * ep * edp = 1*2*2 = 4 but one pipeline stage "
                      "has tp * cp * dp = 2*2*2 = 8 ranks"),
            std::string::npos);
  EXPECT_NE(error_of({.world = 8, .tp = 0}).find("tp must be >= 1, got 0"), std::string::npos);
  EXPECT_NE(error_of({.world = 8, .cp = -2}).find("cp must be >= 1, got -2"), std::string::npos);
  EXPECT_NE(error_of({.world = 8, .dp = 0}).find("dp must be >= 1, got 0"), std::string::npos);
  EXPECT_NE(error_of({.world = 0}).find("world must be >= 1"), std::string::npos);
  EXPECT_NE(error_of({.world = (1 << 20) + 1}).find("world must be <= 1048576"), std::string::npos);
  EXPECT_NE(error_of({.world = 8, .ep = 0}).find("ep must be >= 1"), std::string::npos);
  EXPECT_NE(error_of({.world = 8, .ranks_per_node = 0}).find("ranks_per_node must be >= 1"),
            std::string::npos);
  // Huge sizes do not overflow the product.
  EXPECT_NE(error_of({.world = 8, .tp = 1 << 30, .cp = 1 << 30, .dp = 1 << 30, .pp = 1 << 30})
                .find("but the world has 8 ranks"),
            std::string::npos);
  const Mesh m = make_mesh({.world = 4, .tp = 2});
  EXPECT_THROW((void)split_color_key(m, 4, MeshAxis::tp), Error);
}

}  // namespace
}  // namespace cpattn
