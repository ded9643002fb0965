#include "dtensor/nn/parallel/plan_file.h"

#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "dtensor/tensor/json_nesting.h"
#include "dtensor/tensor/status.h"
#include "nlohmann/json.hpp"

namespace dtensor::nn {
namespace {

constexpr const char* kOp = "PlanFile";
using Json = nlohmann::ordered_json;

}  // namespace

absl::StatusOr<ParallelDims> ParallelDims::Resolve(int64_t world) const {
  ParallelDims d = *this;
  // Each known degree is checked against world / (the product so far), so the product of the
  // degrees never exceeds world and cannot overflow.
  int64_t known = 1, unknown = 0;
  bool ok = world >= 1;
  for (int64_t* x : {&d.dp_replicate, &d.dp_shard, &d.tp}) {
    if (*x == -1) {
      ++unknown;
    } else if (*x < 1 || world < 1 || *x > world / known) {
      ok = false;
    } else {
      known *= *x;
    }
  }
  ok = ok && unknown <= 1;
  if (ok && unknown == 1) {
    ok = world % known == 0;
    for (int64_t* x : {&d.dp_replicate, &d.dp_shard, &d.tp}) {
      if (*x == -1) *x = world / known;
    }
  }
  if (!ok || d.dp_replicate * d.dp_shard * d.tp != world) {
    return absl::InvalidArgumentError(absl::StrCat("[ParallelDims] dp_replicate ", dp_replicate, " x dp_shard ",
                                                   dp_shard, " x tp ", tp, " does not make the world size ", world));
  }
  return d;
}

absl::StatusOr<PlanFile> ParsePlanFile(const std::string& json, const std::string& source) {
  // A plan nests 3 deep; a text nested far deeper would overflow the stack when parsed.
  constexpr int64_t kMaxNesting = 16;
  if (JsonNesting(json) > kMaxNesting) return InvalidArg(kOp, source, ": nests deeper than ", kMaxNesting, " levels");
  // A key given twice in one object would otherwise silently take its last value.
  std::vector<std::set<std::string>> keys;  // of each object open
  std::string twice;
  Json::parser_callback_t check = [&](int /*depth*/, Json::parse_event_t event, Json& parsed) {
    if (event == Json::parse_event_t::object_start) keys.emplace_back();
    if (event == Json::parse_event_t::object_end && !keys.empty()) keys.pop_back();
    if (event == Json::parse_event_t::key && !keys.empty() && !keys.back().insert(parsed.get<std::string>()).second &&
        twice.empty()) {
      twice = parsed.get<std::string>();
    }
    return true;
  };
  Json j = Json::parse(json, check, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return InvalidArg(kOp, source, ": not a JSON object");
  if (!twice.empty()) return InvalidArg(kOp, source, ": key \"", twice, "\" appears twice in one object");
  PlanFile f;
  f.plan.every_parameter = true;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() != "mesh" && it.key() != "rules" && it.key() != "every_parameter") {
      return InvalidArg(kOp, source, ": unknown key \"", it.key(),
                        "\" (a plan has \"mesh\", \"rules\" and optionally \"every_parameter\")");
    }
  }
  if (j.contains("every_parameter")) {
    if (!j["every_parameter"].is_boolean())
      return InvalidArg(kOp, source, ": \"every_parameter\" must be true or false");
    f.plan.every_parameter = j["every_parameter"].get<bool>();
  }
  if (j.contains("mesh")) {
    const Json& m = j["mesh"];
    if (!m.is_object()) return InvalidArg(kOp, source, ": \"mesh\" must map dim names to degrees");
    for (auto it = m.begin(); it != m.end(); ++it) {
      if (!it.value().is_number_integer()) {
        return InvalidArg(kOp, source, ": mesh dim ", it.key(), " has degree ", it.value().dump(), ", not an integer");
      }
      // (An unsigned number past int64's range read as int64 wraps: 2^64 - 1 became -1, "the
      // ranks left over".)
      if (it.value().is_number_unsigned() &&
          it.value().get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return InvalidArg(kOp, source, ": mesh dim ", it.key(), " has degree ", it.value().dump(), ", out of range");
      }
      const int64_t v = it.value().get<int64_t>();
      if (it.key() == "dp_replicate") {
        f.dims.dp_replicate = v;
      } else if (it.key() == "dp_shard") {
        f.dims.dp_shard = v;
      } else if (it.key() == "tp") {
        f.dims.tp = v;
      } else {
        return InvalidArg(kOp, source, ": unknown mesh dim \"", it.key(), "\" (dp_replicate, dp_shard, tp)");
      }
    }
  }
  if (!j.contains("rules") || !j["rules"].is_array()) return InvalidArg(kOp, source, ": \"rules\" must be a list");
  for (const Json& r : j["rules"]) {
    const std::string text = r.dump();
    if (!r.is_object()) return InvalidArg(kOp, source, ": rule ", text, " is not an object");
    if (r.contains("module")) {
      if (r.size() != 2 || !r.contains("style") || !r["module"].is_string() || !r["style"].is_string()) {
        return InvalidArg(kOp, source, ": rule ", text, " must be {\"module\": pattern, \"style\": text}");
      }
      absl::StatusOr<ParallelStyle> style = ParseStyle(r["style"].get<std::string>());
      if (!style.ok()) return InvalidArg(kOp, source, ": rule ", text, ": ", style.status().message());
      f.plan.rules.emplace_back(r["module"].get<std::string>(), *style);
    } else if (r.contains("param")) {
      if (r.size() != 2 || !r.contains("placements") || !r["param"].is_string() || !r["placements"].is_object()) {
        return InvalidArg(kOp, source, ": rule ", text,
                          " must be {\"param\": pattern, \"placements\": {dim: placement}}");
      }
      ParamPlacements p{r["param"].get<std::string>(), {}, text};
      for (auto it = r["placements"].begin(); it != r["placements"].end(); ++it) {
        if (it.key() != "dp_replicate" && it.key() != "dp_shard" && it.key() != "tp") {
          return InvalidArg(kOp, source, ": rule ", text, ": unknown mesh dim \"", it.key(), "\"");
        }
        if (!it.value().is_string()) return InvalidArg(kOp, source, ": rule ", text, ": placements are strings");
        absl::StatusOr<Placement> pl = ParsePlacement(it.value().get<std::string>());
        if (!pl.ok()) return InvalidArg(kOp, source, ": rule ", text, ": ", pl.status().message());
        p.placements.emplace_back(it.key(), *pl);
      }
      f.plan.params.push_back(std::move(p));
    } else {
      return InvalidArg(kOp, source, ": rule ", text, " names neither a \"module\" nor a \"param\"");
    }
  }
  return f;
}

absl::StatusOr<PlanFile> ReadPlanFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("[PlanFile] cannot open ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ParsePlanFile(ss.str(), path);
}

std::string PlanFileToJson(const PlanFile& file) {
  Json j;
  j["mesh"] = {{"dp_replicate", file.dims.dp_replicate}, {"dp_shard", file.dims.dp_shard}, {"tp", file.dims.tp}};
  if (!file.plan.every_parameter) j["every_parameter"] = false;  // files default to true
  j["rules"] = Json::array();
  for (const auto& [pattern, style] : file.plan.rules) {
    j["rules"].push_back({{"module", pattern}, {"style", StyleToString(style)}});
  }
  for (const ParamPlacements& p : file.plan.params) {
    Json placements = Json::object();
    for (const auto& [dim, placement] : p.placements) placements[dim] = placement.ToString();
    j["rules"].push_back({{"param", p.pattern}, {"placements", placements}});
  }
  return j.dump(2) + "\n";
}

}  // namespace dtensor::nn
