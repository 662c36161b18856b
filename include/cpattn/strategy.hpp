// The strategies and each one's facts, in one table: validation, the head placement, the schedules, the
// harness, the planner, the program, the benches and Python read a strategy's traits here instead of
// comparing enumerators. A new enumerator must be handled in strategy_traits (a switch without default,
// -Wswitch an error here whatever the build's flags) and in every other switch over Strategy (the build's
// -Werror), and listed in kStrategies (StrategyTable.ListsEveryEnumerator); docs/development.md, "A new
// strategy", names the rest.
#pragma once

#include <cstdint>
#include <string>

namespace cpattn {

// hybrid: ulysses inside groups of ulysses_degree ranks, ring across the groups (docs/design.md, "Ring
// attention and the hybrid strategy").
enum class Strategy {
  all_gather,
  ulysses,
  ring,
  hybrid
#ifdef CPATTN_TEST_EXTRA_STRATEGY
  ,
  CPATTN_TEST_EXTRA_STRATEGY  // tests/strategy_check: an enumerator the table does not handle must not build
#endif
};

// Every strategy, in the order the program lists them.
inline constexpr Strategy kStrategies[] = {Strategy::all_gather, Strategy::ulysses, Strategy::ring,
                                           Strategy::hybrid};

// How a strategy's ranks hold the heads: every rank all of them (its sequence shard's), or split over a
// ulysses group (ulysses: the whole group of cp ranks; hybrid: groups of ulysses_degree ranks).
enum class HeadSplit { none, whole_group, ulysses_groups };

struct StrategyTraits {
  Strategy strategy;
  const char* name;  // as the program, YAML and Python spell it
  HeadSplit heads;
  // K/V passed round a ring of ranks, each step's kernel results merged in ring order (not one kernel call
  // over the whole sequence): the forward is bit-identical to the single-device kernel only where the ring
  // has one rank.
  bool ring;
  // Takes load_balance (the dual-chunk-swap layout). ulysses gives every rank the same work per head.
  bool load_balance;
  // Has something to recompute in backward with remat (all_gather re-gathers K/V, ulysses redoes its
  // all-to-alls); the ring's backward re-receives K/V anyway.
  bool remat;
  // Splits the communicator in sub-groups of ulysses_degree ranks (and is planned per factorisation of cp).
  bool sub_groups;
  // remat, in words, for the refusal when it means nothing here
  const char* remat_note;
};

// The traits of one strategy. An enumerator outside kStrategies (a value cast from an integer) gets name
// nullptr.
#pragma GCC diagnostic push
#pragma GCC diagnostic error "-Wswitch"
constexpr StrategyTraits strategy_traits(Strategy strategy) {
  switch (strategy) {
    case Strategy::all_gather:
      return {.strategy = strategy,
              .name = "all_gather",
              .heads = HeadSplit::none,
              .ring = false,
              .load_balance = true,
              .remat = true,
              .sub_groups = false,
              .remat_note = ""};
    case Strategy::ulysses:
      return {.strategy = strategy,
              .name = "ulysses",
              .heads = HeadSplit::whole_group,
              .ring = false,
              .load_balance = false,
              .remat = true,
              .sub_groups = false,
              .remat_note = ""};
    case Strategy::ring:
      return {.strategy = strategy,
              .name = "ring",
              .heads = HeadSplit::none,
              .ring = true,
              .load_balance = true,
              .remat = false,
              .sub_groups = false,
              .remat_note =
                  "its backward re-receives K/V round the ring and keeps only its rows' Q, K, V, O and LSE"};
    case Strategy::hybrid:
      return {.strategy = strategy,
              .name = "hybrid",
              .heads = HeadSplit::ulysses_groups,
              .ring = true,
              .load_balance = true,
              .remat = false,
              .sub_groups = true,
              .remat_note =
                  "its backward re-receives K/V round the ring and keeps only its rows' Q, K, V, O and LSE"};
  }
  return {.strategy = strategy,
          .name = nullptr,
          .heads = HeadSplit::none,
          .ring = false,
          .load_balance = false,
          .remat = false,
          .sub_groups = false,
          .remat_note = ""};
}
#pragma GCC diagnostic pop

// The names of every strategy, for messages: "all_gather, ulysses, ring or hybrid"; with a flag of the
// traits, of those that have it: strategy_names(&StrategyTraits::load_balance) is "all_gather, ring or
// hybrid".
const char* strategy_names();
std::string strategy_names(bool StrategyTraits::*flag);

}  // namespace cpattn
