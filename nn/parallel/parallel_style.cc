#include "dtensor/nn/parallel/parallel_style.h"

#include <cstdlib>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dtensor/tensor/status.h"

namespace dtensor::nn {
namespace {

// "name(k=v, k=v)" -> name and the arguments in order.
struct Call {
  std::string name;
  std::vector<std::pair<std::string, std::string>> args;
};

absl::StatusOr<Call> SplitCall(const std::string& text) {
  Call c;
  const std::string t(absl::StripAsciiWhitespace(text));
  const size_t open = t.find('(');
  c.name = std::string(absl::StripAsciiWhitespace(t.substr(0, open)));
  if (open == std::string::npos) return c;
  if (t.back() != ')') return InvalidArg("ParseStyle", "'", text, "' does not end with ')'");
  const std::string inner = t.substr(open + 1, t.size() - open - 2);
  // Split on commas outside parentheses (values such as S(1) hold their own).
  std::vector<std::string> parts;
  int depth = 0;
  std::string cur;
  for (char ch : inner) {
    if (ch == '(') ++depth;
    if (ch == ')') --depth;
    if (ch == ',' && depth == 0) {
      parts.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(ch);
    }
  }
  if (!absl::StripAsciiWhitespace(cur).empty() || !parts.empty()) parts.push_back(cur);
  for (const std::string& p : parts) {
    const size_t eq = p.find('=');
    if (eq == std::string::npos)
      return InvalidArg("ParseStyle", "argument '", p, "' of '", text, "' is not name=value");
    const std::string name(absl::StripAsciiWhitespace(p.substr(0, eq)));
    for (const auto& [seen, value] : c.args) {
      if (seen == name) return InvalidArg("ParseStyle", "argument '", name, "' given twice in '", text, "'");
    }
    c.args.emplace_back(name, std::string(absl::StripAsciiWhitespace(p.substr(eq + 1))));
  }
  return c;
}

absl::StatusOr<bool> ParseBool(const std::string& v, const std::string& text) {
  if (v == "true") return true;
  if (v == "false") return false;
  return InvalidArg("ParseStyle", "'", v, "' in '", text, "' is not true or false");
}

}  // namespace

absl::StatusOr<Placement> ParsePlacement(const std::string& text) {
  const std::string t(absl::StripAsciiWhitespace(text));
  if (t == "R") return Placement(Replicate());
  if (t.size() > 3 && t.substr(0, 2) == "S(" && t.back() == ')') {
    int64_t d = 0;
    if (absl::SimpleAtoi(t.substr(2, t.size() - 3), &d)) return Placement(Shard(d));
  }
  for (PartialOp op : {PartialOp::kSum, PartialOp::kAvg, PartialOp::kMax, PartialOp::kMin}) {
    if (t == absl::StrCat("P(", PartialOpName(op), ")")) return Placement(Partial(op));
  }
  return InvalidArg("ParsePlacement", "'", text, "' is no placement (S(d), R, P(sum|avg|max|min))");
}

std::string StyleToString(const ParallelStyle& style) {
  std::vector<std::string> args;
  auto arg = [&](bool differs, const char* name, const std::string& value) {
    if (differs) args.push_back(absl::StrCat(name, "=", value));
  };
  std::string name;
  if (const auto* c = std::get_if<ColwiseParallel>(&style)) {
    const ColwiseParallel d;
    name = "ColwiseParallel";
    arg(c->input_layout != d.input_layout, "input", c->input_layout.ToString());
    arg(c->output_layout != d.output_layout, "output", c->output_layout.ToString());
    arg(c->use_local_output, "use_local_output", "true");
    arg(c->fused != d.fused, "fused", absl::StrCat(c->fused));
  } else if (const auto* r = std::get_if<RowwiseParallel>(&style)) {
    const RowwiseParallel d;
    name = "RowwiseParallel";
    arg(r->input_layout != d.input_layout, "input", r->input_layout.ToString());
    arg(r->output_layout != d.output_layout, "output", r->output_layout.ToString());
    arg(r->use_local_output, "use_local_output", "true");
  } else if (const auto* s = std::get_if<SequenceParallel>(&style)) {
    name = "SequenceParallel";
    arg(s->sequence_dim != 1, "dim", absl::StrCat(s->sequence_dim));
    arg(s->use_local_output, "use_local_output", "true");
  } else if (const auto* i = std::get_if<PrepareModuleInput>(&style)) {
    name = "PrepareModuleInput";
    args = {absl::StrCat("input=", i->input_layout.ToString()),
            absl::StrCat("desired=", i->desired_input_layout.ToString())};
  } else if (const auto* o = std::get_if<PrepareModuleOutput>(&style)) {
    name = "PrepareModuleOutput";
    args = {absl::StrCat("output=", o->output_layout.ToString()),
            absl::StrCat("desired=", o->desired_output_layout.ToString())};
  }
  return args.empty() ? name : absl::StrCat(name, "(", absl::StrJoin(args, ", "), ")");
}

absl::StatusOr<ParallelStyle> ParseStyle(const std::string& text) {
  DT_ASSIGN_OR_RETURN(Call c, SplitCall(text));
  auto unknown = [&](const std::string& key) {
    return InvalidArg("ParseStyle", "'", text, "': ", c.name, " has no argument '", key, "'");
  };
  // Colwise and Rowwise share input=, output= and use_local_output= (Colwise adds fused=).
  auto linear_style = [&](auto s) -> absl::StatusOr<ParallelStyle> {
    for (const auto& [k, v] : c.args) {
      if (k == "input") {
        DT_ASSIGN_OR_RETURN(s.input_layout, ParsePlacement(v));
      } else if (k == "output") {
        DT_ASSIGN_OR_RETURN(s.output_layout, ParsePlacement(v));
      } else if (k == "use_local_output") {
        DT_ASSIGN_OR_RETURN(s.use_local_output, ParseBool(v, text));
      } else if (k == "fused" && std::is_same_v<decltype(s), ColwiseParallel>) {
        int64_t fused = 0;
        if (!absl::SimpleAtoi(v, &fused) || fused < 1) {
          return InvalidArg("ParseStyle", "'", text, "': fused must be a positive integer");
        }
        if constexpr (std::is_same_v<decltype(s), ColwiseParallel>) s.fused = fused;
      } else {
        return unknown(k);
      }
    }
    return ParallelStyle(s);
  };
  if (c.name == "ColwiseParallel") return linear_style(ColwiseParallel{});
  if (c.name == "RowwiseParallel") return linear_style(RowwiseParallel{});
  if (c.name == "SequenceParallel") {
    SequenceParallel s;
    for (const auto& [k, v] : c.args) {
      if (k == "dim") {
        if (!absl::SimpleAtoi(v, &s.sequence_dim)) return InvalidArg("ParseStyle", "'", text, "': dim is no integer");
      } else if (k == "use_local_output") {
        DT_ASSIGN_OR_RETURN(s.use_local_output, ParseBool(v, text));
      } else {
        return unknown(k);
      }
    }
    return ParallelStyle(s);
  }
  if (c.name == "PrepareModuleInput" || c.name == "PrepareModuleOutput") {
    const bool in = c.name == "PrepareModuleInput";
    Placement from, to;
    bool have_from = false, have_to = false;
    for (const auto& [k, v] : c.args) {
      if (k == (in ? "input" : "output")) {
        DT_ASSIGN_OR_RETURN(from, ParsePlacement(v));
        have_from = true;
      } else if (k == "desired") {
        DT_ASSIGN_OR_RETURN(to, ParsePlacement(v));
        have_to = true;
      } else {
        return unknown(k);
      }
    }
    if (!have_from || !have_to) {
      return InvalidArg("ParseStyle", "'", text, "': ", c.name, " needs ", in ? "input" : "output", "= and desired=");
    }
    if (in) return ParallelStyle(PrepareModuleInput{from, to});
    return ParallelStyle(PrepareModuleOutput{from, to});
  }
  return InvalidArg("ParseStyle", "'", text,
                    "' is no style (ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput, "
                    "PrepareModuleOutput)");
}

}  // namespace dtensor::nn
