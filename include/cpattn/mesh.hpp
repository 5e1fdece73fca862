// The device mesh (DESIGN.md section 8): every rank's coordinates on every parallel axis and
// every axis's process groups, as plain data. Pure functions, no MPI.
//
// Axis order. World ranks are laid out tp-cp-dp-pp, tp fastest (Megatron-Core's default order
// tp-cp-ep-dp-pp with ep taken out of the dense layout):
//
//   rank = tp_i + tp * (cp_i + cp * (dp_i + dp * pp_i))
//
// The expert axes fold over the same ranks as each pipeline stage's dense axes
// (tp * cp * dp == etp * ep * edp), laid out etp-ep-edp-pp, etp fastest:
//
//   rank = etp_i + etp * (ep_i + ep * (edp_i + edp * pp_i))
//
// so a pipeline stage is the same block of tp*cp*dp consecutive ranks in both layouts.
//
// Worked example: world 16, tp 2, cp 2, dp 2, pp 2, and ep 2 with etp 1 (so edp = 8/2 = 4):
//   rank 13 = 1 + 2*(0 + 2*(1 + 2*1)): tp 1, cp 0, dp 1, pp 1; 13 = 0 + 1*(1 + 2*(2 + 4*1)):
//   etp 0, ep 1, edp 2.
//   tp groups [0,1] [2,3] ... [14,15]; cp groups [0,2] [1,3] [4,6] [5,7] [8,10] ...;
//   dp groups [0,4] [1,5] [2,6] [3,7] [8,12] ...; pp groups [0,8] [1,9] ... [7,15];
//   dp_cp groups [0,2,4,6] [1,3,5,7] [8,10,12,14] [9,11,13,15];
//   ep groups [0,1] [2,3] ...; edp groups [0,2,4,6] [1,3,5,7] [8,10,12,14] [9,11,13,15].
//   With 8 ranks per node, only the pp groups (and tp_pp) cross nodes.
//
// Groups of an axis are listed in the order of their smallest rank, ranks ascending inside a
// group; a rank's coordinate on an axis is its position in its group, and the group's index
// is the colour that MPI_Comm_split wants (see split_color_key).
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <string_view>
#include <vector>

namespace cpattn {

// Every axis the mesh names. The first seven are the mesh's own axes; the rest are
// combinations (a group of a combination holds the ranks that agree on every other axis of
// the same layout), for the collectives that span two axes.
enum class MeshAxis {
  tp,      // tensor parallel (dense layers)
  cp,      // context parallel
  dp,      // data parallel
  pp,      // pipeline parallel: its coordinate is the stage
  etp,     // expert tensor parallel
  ep,      // expert parallel
  edp,     // expert data parallel
  dp_cp,   // dp x cp: where dense gradients are reduced (coordinate cp_i + cp * dp_i)
  tp_cp,   // tp x cp (coordinate tp_i + tp * cp_i)
  tp_pp,   // tp x pp, the model-parallel group (coordinate tp_i + tp * pp_i)
  etp_ep,  // etp x ep, the expert model-parallel group (coordinate etp_i + etp * ep_i)
};
inline constexpr std::size_t kMeshAxes = 11;
inline constexpr std::array<MeshAxis, kMeshAxes> kAllMeshAxes{
    MeshAxis::tp,  MeshAxis::cp,  MeshAxis::dp,    MeshAxis::pp,    MeshAxis::etp,   MeshAxis::ep,
    MeshAxis::edp, MeshAxis::dp_cp, MeshAxis::tp_cp, MeshAxis::tp_pp, MeshAxis::etp_ep};
// The mesh's own axes, without the combinations.
inline constexpr std::array<MeshAxis, 7> kBaseMeshAxes{MeshAxis::tp, MeshAxis::cp, MeshAxis::dp,
                                                       MeshAxis::pp, MeshAxis::etp, MeshAxis::ep,
                                                       MeshAxis::edp};

// "tp", "cp", ..., "dp_cp": the names the CLI and JSON use.
std::string_view mesh_axis_name(MeshAxis axis);

// What the user asks for. Unset optional sizes are derived.
struct MeshShape {
  int world = 1;               // ranks in all, 1 .. 2^20
  int tp = 1;                  // >= 1
  int cp = 1;                  // >= 1
  std::optional<int> dp = {};  // >= 1; unset: world / (tp * cp * pp)
  int pp = 1;                  // >= 1, pipeline stages
  std::optional<int> etp = {}; // >= 1; unset: tp (Megatron-Core's default)
  int ep = 1;                  // >= 1
  std::optional<int> edp = {}; // >= 1; unset: tp * cp * dp / (etp * ep)
  std::optional<int> ranks_per_node = {};  // >= 1; unset: no node boundaries are marked
};

// The resolved sizes: every field set and consistent.
struct MeshSizes {
  int world = 1;
  int tp = 1, cp = 1, dp = 1, pp = 1;
  int etp = 1, ep = 1, edp = 1;
  int ranks_per_node = 0;  // 0: not given
  int size(MeshAxis axis) const;  // ranks in one group of `axis`
};

// One process group: world ranks, ascending.
struct MeshGroup {
  std::vector<int> ranks;
  int nodes = 1;               // distinct nodes its ranks sit on (1 without ranks_per_node)
  bool crosses_nodes = false;  // nodes > 1: its collectives leave the node (the costly ones)
};

struct MeshRank {
  int rank = 0;
  std::array<int, kMeshAxes> coord{};  // [axis] position in its group of that axis
  std::array<int, kMeshAxes> group{};  // [axis] index of its group in Mesh::groups[axis]
};

struct Mesh {
  MeshSizes sizes;
  std::vector<MeshRank> ranks;                            // [world], ranks[r].rank == r
  std::array<std::vector<MeshGroup>, kMeshAxes> groups;   // [axis][group]
  const std::vector<MeshGroup>& groups_of(MeshAxis axis) const {
    return groups[static_cast<std::size_t>(axis)];
  }
  int coord(int rank, MeshAxis axis) const {
    return ranks[static_cast<std::size_t>(rank)].coord[static_cast<std::size_t>(axis)];
  }
};

// Validates `shape` and derives the unset sizes. Throws cpattn::Error naming the product
// that is off ("tp * cp * dp * pp = 2*4*1*2 = 16 but the world has 12 ranks"), expert axes that
// do not fold, or a size below 1.
MeshSizes resolve_mesh(const MeshShape& shape);

// Every rank's coordinates and every axis's groups.
Mesh make_mesh(const MeshShape& shape);

// MPI_Comm_split's arguments that put `rank` into its group of `axis`, ordered by coordinate:
//   auto [color, key] = split_color_key(mesh, rank, MeshAxis::dp_cp);
//   Communicator dp_cp = world_comm.split(color, key);
struct SplitColorKey {
  int color = 0;  // index of the group (the same on every rank of the group)
  int key = 0;    // the rank's coordinate in the group
};
SplitColorKey split_color_key(const Mesh& mesh, int rank, MeshAxis axis);

}  // namespace cpattn
