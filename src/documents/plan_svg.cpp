// plan --svg: one attention layer per strategy as a timeline per rank, from the plan's own estimates: each
// rank's compute, then what it waits for the straggler, then the communication no compute hides (ring and
// hybrid: their exposed time after the rank's compute, hops and waiting together, as the model prices them).
#include <algorithm>
#include <cstdio>
#include <sstream>

#include "documents/plan_svg.hpp"

namespace cpattn {
namespace {

constexpr double kWidth = 760, kLeft = 90, kRow = 9, kPanelGap = 34;
constexpr std::size_t kMostRanks = 64;  // ranks drawn per strategy (the rest summarised in its title)

std::string number(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%.4g", x);
  return text;
}

std::string escaped(const std::string& text) {
  std::string out;
  for (const char c : text) {
    if (c == '&')
      out += "&amp;";
    else if (c == '<')
      out += "&lt;";
    else if (c == '>')
      out += "&gt;";
    else if (c == '"')
      out += "&quot;";
    else
      out += c;
  }
  return out;
}

void bar(std::ostringstream& out, const char* kind, double x, double w, double y) {
  if (w <= 0) return;
  out << "  <rect class=\"" << kind << "\" x=\"" << number(x) << "\" y=\"" << number(y) << "\" width=\""
      << number(w) << "\" height=\"" << number(kRow - 2) << "\"/>\n";
}

}  // namespace

std::string plan_svg(const PlanRequest& req, const Plan& plan) {
  double longest = 0, panels_height = 0;
  for (const StrategyPlan& s : plan.strategies) {
    if (!s.possible) continue;
    longest = std::max(longest, s.layer_seconds);
    panels_height +=
        static_cast<double>(std::min(s.compute_seconds_per_rank.size(), kMostRanks)) * kRow + kPanelGap;
  }
  const double scale = longest > 0 ? kWidth / longest : 0;  // pixels per second
  const double height = 60 + panels_height;
  std::ostringstream out;
  out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << number(kLeft + kWidth + 20) << "\" height=\""
      << number(height) << "\" font-family=\"sans-serif\" font-size=\"11\">\n"
      << "  <style>.compute{fill:#4477aa}.waiting{fill:#cccccc}.communication{fill:#ee7733}"
         ".exposed{fill:#bb5566}.recommended{font-weight:bold}</style>\n"
      << "  <text x=\"4\" y=\"16\">one attention layer per rank: compute (blue), waiting for the straggler "
         "(grey), "
         "communication not hidden (orange); ring and hybrid: exposed after compute (red)</text>\n"
      << "  <text x=\"4\" y=\"32\">" << escaped(req.model.name) << ", S=" << req.attention.seq_len
      << ", cp=" << req.parallel.cp << ", " << escaped(req.hardware.name)
      << (req.forward_only ? ", forward only (prefill)" : "") << "; full width " << number(longest * 1e3)
      << " ms</text>\n";
  double y = 60;
  for (std::size_t i = 0; i < plan.strategies.size(); ++i) {
    const StrategyPlan& s = plan.strategies[i];
    if (!s.possible) continue;
    const bool recommended = i == plan.recommended;
    const std::size_t ranks = s.compute_seconds_per_rank.size(), drawn = std::min(ranks, kMostRanks);
    out << "  <g class=\"strategy\" data-name=\"" << escaped(s.name) << "\" data-layer-seconds=\""
        << number(s.layer_seconds) << "\"" << (recommended ? " data-recommended=\"true\"" : "") << ">\n";
    out << "  <text" << (recommended ? " class=\"recommended\"" : "") << " x=\"4\" y=\"" << number(y - 6)
        << "\">" << escaped(s.name) << ": " << number(s.layer_seconds * 1e3) << " ms"
        << (recommended ? " (recommended)" : "")
        << (drawn < ranks ? ", ranks 0.." + std::to_string(drawn - 1) + " of " + std::to_string(ranks) : "")
        << "</text>\n";
    const double slowest =
        *std::max_element(s.compute_seconds_per_rank.begin(), s.compute_seconds_per_rank.end());
    const bool ring = s.ring_degree > 1;
    for (std::size_t r = 0; r < drawn; ++r) {
      const double compute = s.compute_seconds_per_rank[r];
      out << "  <text x=\"" << number(kLeft - 6) << "\" y=\"" << number(y + kRow - 2)
          << "\" text-anchor=\"end\" font-size=\"8\">rank " << r << "</text>\n";
      bar(out, "compute", kLeft, compute * scale, y);
      if (ring) {
        bar(out, "exposed", kLeft + compute * scale, (s.layer_seconds - compute) * scale, y);
      } else {
        bar(out, "waiting", kLeft + compute * scale, (slowest - compute) * scale, y);
        bar(out, "communication", kLeft + slowest * scale, s.communication_seconds * scale, y);
      }
      y += kRow;
    }
    out << "  </g>\n";
    y += kPanelGap;
  }
  out << "</svg>\n";
  return out.str();
}

}  // namespace cpattn
