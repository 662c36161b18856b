// The strategy table alone, for tests/strategy_check/check.sh.
#include "cpattn/strategy.hpp"

static_assert(cpattn::strategy_traits(cpattn::Strategy::hybrid).sub_groups);
