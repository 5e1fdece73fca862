// `cpattn mesh`: every axis's process groups of a device mesh, as a table or JSON.
#include <cpattn/error.hpp>
#include <cpattn/mesh.hpp>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>
#include <string>

#include "commands.hpp"

namespace cpattn::cli {

namespace {

struct MeshArgs {
  int world = 0;
  int tp = 1, cp = 1, pp = 1, ep = 1;
  std::optional<int> dp, etp, edp, ranks_per_node;
  bool json = false;
};

std::string join(const std::vector<int>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(v[i]);
  }
  s += ']';
  return s;
}

void print_table(const Mesh& m) {
  const MeshSizes& s = m.sizes;
  std::printf("cpattn mesh: world %d = tp %d x cp %d x dp %d x pp %d (order tp-cp-dp-pp, tp "
              "fastest); experts: etp %d x ep %d x edp %d per stage\n",
              s.world, s.tp, s.cp, s.dp, s.pp, s.etp, s.ep, s.edp);
  if (s.ranks_per_node > 0)
    std::printf("%d ranks per node: groups marked * cross nodes\n", s.ranks_per_node);
  std::printf("\n");
  for (const MeshAxis axis : kAllMeshAxes) {
    const auto& groups = m.groups_of(axis);
    int crossing = 0;
    for (const MeshGroup& g : groups) crossing += g.crosses_nodes ? 1 : 0;
    std::printf("%-7s size %-4d %4zu groups", std::string(mesh_axis_name(axis)).c_str(),
                s.size(axis), groups.size());
    if (s.ranks_per_node > 0) std::printf(", %d cross nodes", crossing);
    std::printf(":");
    for (const MeshGroup& g : groups)
      std::printf(" %s%s", join(g.ranks).c_str(), g.crosses_nodes ? "*" : "");
    std::printf("\n");
  }
}

void print_json(const Mesh& m) {
  const MeshSizes& s = m.sizes;
  nlohmann::json j;
  j["world"] = s.world;
  j["sizes"] = {{"tp", s.tp}, {"cp", s.cp}, {"dp", s.dp}, {"pp", s.pp},
                {"etp", s.etp}, {"ep", s.ep}, {"edp", s.edp}};
  j["order"] = {{"dense", "tp-cp-dp-pp"}, {"expert", "etp-ep-edp-pp"}};
  if (s.ranks_per_node > 0) j["ranks_per_node"] = s.ranks_per_node;
  j["ranks"] = nlohmann::json::array();
  for (const MeshRank& r : m.ranks) {
    nlohmann::json coords;
    for (const MeshAxis a : kAllMeshAxes) coords[std::string(mesh_axis_name(a))] = r.coord[static_cast<std::size_t>(a)];
    j["ranks"].push_back({{"rank", r.rank}, {"coords", std::move(coords)}});
  }
  j["groups"] = nlohmann::json::object();
  j["crosses_nodes"] = nlohmann::json::object();
  for (const MeshAxis a : kAllMeshAxes) {
    nlohmann::json groups = nlohmann::json::array(), crossing = nlohmann::json::array();
    for (const MeshGroup& g : m.groups_of(a)) {
      groups.push_back(g.ranks);
      crossing.push_back(g.crosses_nodes);
    }
    j["groups"][std::string(mesh_axis_name(a))] = std::move(groups);
    j["crosses_nodes"][std::string(mesh_axis_name(a))] = std::move(crossing);
  }
  std::cout << j.dump() << '\n';
}

}  // namespace

void add_mesh_command(CLI::App& app) {
  auto args = std::make_shared<MeshArgs>();
  CLI::App* cmd = app.add_subcommand(
      "mesh",
      "The device mesh: every rank's coordinates and every axis's process groups (dense axes "
      "laid out tp-cp-dp-pp, tp fastest; expert axes etp-ep-edp folded over each pipeline "
      "stage), and which groups cross nodes. See docs/mesh.md.");
  cmd->add_option("--world", args->world, "Ranks in all")->required();
  cmd->add_option("--tp", args->tp, "Tensor-parallel size")->capture_default_str();
  cmd->add_option("--cp", args->cp, "Context-parallel size")->capture_default_str();
  cmd->add_option("--pp", args->pp, "Pipeline-parallel size (stages)")->capture_default_str();
  cmd->add_option("--dp", args->dp, "Data-parallel size (default: world / (tp*cp*pp))");
  cmd->add_option("--ep", args->ep, "Expert-parallel size")->capture_default_str();
  cmd->add_option("--etp", args->etp, "Expert tensor-parallel size (default: tp)");
  cmd->add_option("--edp", args->edp, "Expert data-parallel size (default: tp*cp*dp / (etp*ep))");
  cmd->add_option("--ranks-per-node", args->ranks_per_node,
                  "Ranks per node: mark the groups that cross nodes")->check(at_least_one());
  cmd->add_flag("--json", args->json,
                "Print one JSON object: sizes, ranks (rank, coords: axis -> coordinate), groups "
                "(axis -> list of rank lists) and crosses_nodes");
  cmd->callback([args] {
    const Mesh m = make_mesh({.world = args->world,
                              .tp = args->tp,
                              .cp = args->cp,
                              .dp = args->dp,
                              .pp = args->pp,
                              .etp = args->etp,
                              .ep = args->ep,
                              .edp = args->edp,
                              .ranks_per_node = args->ranks_per_node});
    if (args->json)
      print_json(m);
    else
      print_table(m);
  });
}

}  // namespace cpattn::cli
