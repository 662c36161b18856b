// plan --svg: the plan's estimates for one attention layer drawn per strategy and rank (SVG text).
#pragma once

#include <string>

#include "cpattn/planner.hpp"

namespace cpattn {

// Each possible strategy a group (data-name, data-layer-seconds, data-recommended on the recommended one)
// with one row per rank (at most 64): rects of class compute, waiting and communication (ring and hybrid:
// compute and exposed), widths proportional to seconds on one scale for every strategy.
std::string plan_svg(const PlanRequest& request, const Plan& plan);

}  // namespace cpattn
