#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>

#include <sys/stat.h>
#include <unistd.h>

#include "cpattn/config.hpp"
#include "cpattn/config_file.hpp"

namespace cpattn {
namespace {

AttentionSpec seed_attention() {
  AttentionSpec a;
  a.batch = 1;
  a.seq_len = 65536;
  a.num_q_heads = 32;
  a.num_kv_heads = 2;
  a.head_dim = 256;
  a.dtype = DType::bf16;
  return a;
}

ParallelSpec ulysses(std::int64_t cp) {
  ParallelSpec p;
  p.cp = cp;
  p.strategy = Strategy::ulysses;
  return p;
}

// kStrategies lists every enumerator the table handles, once, each under a name the parser reads back; a
// value cast from an integer outside it has no traits and fails validation naming the field.
TEST(StrategyTable, ListsEveryEnumerator) {
  std::set<std::string> names;
  for (int i = 0; i < 64; ++i) {
    const auto strategy = static_cast<Strategy>(i);
    const StrategyTraits traits = strategy_traits(strategy);
    const bool listed =
        std::find(std::begin(kStrategies), std::end(kStrategies), strategy) != std::end(kStrategies);
    EXPECT_EQ(traits.name != nullptr, listed) << "enumerator " << i;
    if (traits.name == nullptr) continue;
    EXPECT_EQ(traits.strategy, strategy);
    EXPECT_TRUE(names.insert(traits.name).second) << traits.name;
    EXPECT_EQ(parse_strategy(traits.name), strategy);
    EXPECT_NE(std::string(strategy_names()).find(traits.name), std::string::npos);
  }
  EXPECT_EQ(names.size(), std::size(kStrategies));
  ParallelSpec p;
  p.strategy = static_cast<Strategy>(17);
  const auto errors = validation_errors(seed_attention(), p);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].fields, std::vector<std::string>{"strategy"});
  EXPECT_NE(errors[0].message.find("strategy 17 is not a strategy"), std::string::npos) << errors[0].message;
}

// The rank decomposition every strategy shares: heads over groups of head_group_size() ranks, K/V round rings
// of ring_degree() ranks, rank c = ring_rank(c) * head_group_size() + ulysses_rank(c).
TEST(StrategyTable, RankDecomposition) {
  ParallelSpec p;
  p.cp = 12;
  const struct {
    Strategy strategy;
    std::int64_t ulysses_degree, group, ring;
  } cases[] = {{Strategy::all_gather, 0, 1, 1},
               {Strategy::ulysses, 0, 12, 1},
               {Strategy::ring, 0, 1, 12},
               {Strategy::hybrid, 4, 4, 3}};
  for (const auto& c : cases) {
    p.strategy = c.strategy;
    p.ulysses_degree = c.ulysses_degree;
    EXPECT_EQ(p.head_group_size(), c.group) << to_string(c.strategy);
    EXPECT_EQ(p.ring_degree(), c.ring) << to_string(c.strategy);
    for (std::int64_t r = 0; r < p.cp; ++r) {
      EXPECT_EQ(p.ring_rank(r) * p.head_group_size() + p.ulysses_rank(r), r) << to_string(c.strategy);
    }
  }
  p.strategy = Strategy::hybrid;
  p.ulysses_degree = 4;
  EXPECT_EQ(p.ulysses_rank(6), 2);
  EXPECT_EQ(p.ring_rank(6), 1);
}

TEST(Validation, SeedConfigurationsAreValid) {
  EXPECT_TRUE(validation_errors(seed_attention(), ulysses(4)).empty());
  EXPECT_TRUE(validation_errors(seed_attention(), ulysses(8)).empty());
  ParallelSpec ag;
  ag.cp = 4;
  ag.load_balance = true;
  EXPECT_TRUE(validation_errors(seed_attention(), ag).empty());
  EXPECT_EQ(ag.effective_layout(), ShardLayout::dual_chunk_swap);
}

TEST(Validation, UlyssesAcceptsMqaAndKvHeadsDividedByCp) {
  AttentionSpec a = seed_attention();
  a.num_kv_heads = 1;
  EXPECT_TRUE(validation_errors(a, ulysses(8)).empty());
  a.num_kv_heads = 16;
  EXPECT_TRUE(validation_errors(a, ulysses(4)).empty());
}

// Every (Hq, Hkv, cp) with Hq % Hkv == 0 and cp <= Hq: no divisibility between heads and cp.
TEST(Validation, UlyssesAcceptsAnyHeadCountsUpToOneQHeadPerRank) {
  struct Shape {
    std::int64_t hq, hkv, cp;
  };
  for (const Shape& s : {Shape{28, 4, 8},
                         {40, 10, 4},
                         {24, 3, 4},
                         {7, 7, 4},
                         {12, 3, 8},
                         {6, 1, 4},
                         {32, 2, 4},
                         {40, 8, 16},
                         {7, 1, 7}}) {
    AttentionSpec a = seed_attention();
    a.num_q_heads = s.hq;
    a.num_kv_heads = s.hkv;
    a.seq_len = 1024 * s.cp;
    EXPECT_TRUE(validation_errors(a, ulysses(s.cp)).empty()) << s.hq << "," << s.hkv << "," << s.cp;
  }
  AttentionSpec a = seed_attention();
  a.num_q_heads = 7;
  a.num_kv_heads = 7;
  const auto errors = validation_errors(a, ulysses(8));
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].fields, (std::vector<std::string>{"cp", "num_q_heads"}));
}

struct BadCase {
  const char* name;
  AttentionSpec attention;
  ParallelSpec parallel;
  std::vector<std::string> fields;   // the main field of each expected error, in order
  std::vector<std::string> phrases;  // one phrase each message must contain
};

std::vector<BadCase> bad_cases() {
  std::vector<BadCase> cases;
  auto add = [&](const char* name, auto&& edit, std::vector<std::string> fields,
                 std::vector<std::string> phrases) {
    BadCase c{name, seed_attention(), ulysses(4), std::move(fields), std::move(phrases)};
    edit(c.attention, c.parallel);
    cases.push_back(std::move(c));
  };
  add("zero_batch", [](AttentionSpec& a, ParallelSpec&) { a.batch = 0; }, {"batch"},
      {"batch (0) must be a positive"});
  add("negative_seq", [](AttentionSpec& a, ParallelSpec&) { a.seq_len = -4; }, {"seq_len"}, {"seq_len (-4)"});
  add("zero_heads_and_dim",
      [](AttentionSpec& a, ParallelSpec&) {
        a.num_q_heads = 0;
        a.head_dim = 0;
      },
      {"num_q_heads", "head_dim"}, {"num_q_heads (0)", "head_dim (0)"});
  add("zero_cp", [](AttentionSpec&, ParallelSpec& p) { p.cp = 0; }, {"cp"}, {"cp (0)"});
  add("negative_window", [](AttentionSpec& a, ParallelSpec&) { a.window_left = -1; }, {"window_left"},
      {"window_left (-1) is not a window side; valid: 0..2147483647"});
  add("window_side_past_int32",
      [](AttentionSpec& a, ParallelSpec&) {
        a.causal = false;
        a.window_left = 5;
        a.window_right = std::int64_t{1} << 31;
      },
      {"window_right"}, {"window_right (2147483648)"});
  add("window_right_with_causal", [](AttentionSpec& a, ParallelSpec&) { a.window_right = 4; },
      {"window_right"}, {"for non-causal attention"});
  add("zero_softcap", [](AttentionSpec& a, ParallelSpec&) { a.softcap = 0.0; }, {"softcap"},
      {"softcap (0) is not a soft-cap"});
  add("nan_softcap", [](AttentionSpec& a, ParallelSpec&) { a.softcap = std::nan(""); }, {"softcap"},
      {"softcap (nan)"});
  add("head_dim_too_large", [](AttentionSpec& a, ParallelSpec&) { a.head_dim = 513; }, {"head_dim"},
      {"1..512"});
  add("too_many_heads",
      [](AttentionSpec& a, ParallelSpec&) {
        a.num_q_heads =
            2 * 65537;  // the tensor-size product fits at small B, S, D: the bound is its own rule
        a.num_kv_heads = 65537;
        a.seq_len = 64;
        a.head_dim = 8;
      },
      {"num_q_heads", "num_kv_heads"}, {"num_q_heads (131074)", "num_kv_heads (65537)", "1..65536"});
  add("gqa_indivisible",
      [](AttentionSpec& a, ParallelSpec& p) {
        a.num_kv_heads = 3;
        p.strategy = Strategy::all_gather;
      },
      {"num_q_heads"}, {"num_kv_heads (3) must divide num_q_heads (32)"});
  add("seq_not_divisible", [](AttentionSpec& a, ParallelSpec&) { a.seq_len = 65537; }, {"seq_len"},
      {"seq_len (65537) must be divisible by cp (4)"});
  add("load_balance_needs_2cp",
      [](AttentionSpec& a, ParallelSpec& p) {
        a.seq_len = 12;
        p.strategy = Strategy::all_gather;
        p.load_balance = true;
      },
      {"seq_len"}, {"divisible by 2*cp (8)"});
  add("ulysses_more_ranks_than_q_heads",
      [](AttentionSpec& a, ParallelSpec& p) {
        a.num_q_heads = 6;
        a.num_kv_heads = 2;
        p.cp = 8;
        a.seq_len = 64;
      },
      {"cp"}, {"ulysses needs cp (8) <= num_q_heads (6)", "hybrid strategy"});
  add("ulysses_load_balance", [](AttentionSpec&, ParallelSpec& p) { p.load_balance = true; },
      {"load_balance"}, {"for all_gather, ring or hybrid"});
  add("tp_does_not_divide", [](AttentionSpec&, ParallelSpec& p) { p.tp = 3; }, {"tp", "tp"},
      {"tp (3) must divide num_q_heads (32)", "tp (3) must divide num_kv_heads (2)"});
  add("tp_local_heads_break_ulysses",
      [](AttentionSpec& a, ParallelSpec& p) {
        a.num_q_heads = 8;
        p.tp = 2;
        p.cp = 8;
      },
      {"cp"}, {"cp (8) <= num_q_heads per tp rank (heads / tp, tp=2) (4)"});
  add("layout_without_load_balance",
      [](AttentionSpec&, ParallelSpec& p) {
        p.strategy = Strategy::all_gather;
        p.layout = ShardLayout::dual_chunk_swap;
      },
      {"layout"}, {"dual_chunk_swap needs all_gather, ring or hybrid with load_balance"});
  add("bad_scale", [](AttentionSpec& a, ParallelSpec&) { a.softmax_scale = -1.0; }, {"softmax_scale"},
      {"finite and positive"});
  add("overflowing_sizes",
      [](AttentionSpec& a, ParallelSpec& p) {
        a.batch = 1 << 20;
        a.seq_len = 1 << 30;
        a.num_q_heads = 1 << 10;
        a.num_kv_heads = 1 << 10;
        p.cp = 1;
      },
      {"batch"}, {"overflows"});
  add("seq_too_long_for_int32_positions",
      [](AttentionSpec& a, ParallelSpec& p) {
        a.seq_len = 1ll << 32;
        a.num_q_heads = 4;
        a.head_dim = 1;
        p.cp = 4;
      },
      {"seq_len"}, {"int32"});
  // Found by fuzz_validator: 2*cp overflowed int64 in the load-balance rule (UBSan). Ranks are ints.
  add("cp_beyond_any_group",
      [](AttentionSpec&, ParallelSpec& p) {
        p.cp = 6744426282650261709;
        p.strategy = Strategy::all_gather;
        p.load_balance = true;
      },
      {"cp"}, {"cp (6744426282650261709) is more ranks than cpattn supports; valid: 1..65536"});
  add("cp_just_beyond_the_bound", [](AttentionSpec&, ParallelSpec& p) { p.cp = 65537; }, {"cp"},
      {"cp (65537) is more ranks than cpattn supports"});
  add("tp_beyond_any_group", [](AttentionSpec&, ParallelSpec& p) { p.tp = 1ll << 40; }, {"tp"},
      {"more ranks than cpattn supports"});
  add("hybrid_without_ulysses_degree", [](AttentionSpec&, ParallelSpec& p) { p.strategy = Strategy::hybrid; },
      {"ulysses_degree"}, {"hybrid needs ulysses_degree", "--ulysses-degree"});
  add("hybrid_degree_not_a_divisor_and_above_q_heads",
      [](AttentionSpec& a, ParallelSpec& p) {
        a.num_q_heads = 2;
        p.cp = 6;
        a.seq_len = 60;
        p.strategy = Strategy::hybrid;
        p.ulysses_degree = 4;
      },
      {"ulysses_degree", "ulysses_degree"},
      {"ulysses_degree (4) to be a divisor of cp (6)", "ulysses_degree (4) <= num_q_heads (2)"});
  // One bad size hides no other broken rule: each is judged where the sizes it reads are valid.
  add("every_rule_at_once",
      [](AttentionSpec& a, ParallelSpec& p) {
        a.batch = 0;
        a.seq_len = 1001;
        a.num_q_heads = 2;
        a.num_kv_heads = 3;
        a.head_dim = 600;
        p.cp = 4;
        p.tp = 1;
        p.strategy = Strategy::ulysses;
      },
      {"batch", "head_dim", "num_q_heads", "seq_len", "cp"},
      {"batch (0)", "head_dim (600)", "num_kv_heads (3) must divide num_q_heads (2)",
       "seq_len (1001) must be divisible by cp (4)", "ulysses needs cp (4) <= num_q_heads"});
  add("zero_tp_with_hybrid",
      [](AttentionSpec& a, ParallelSpec& p) {
        a.seq_len = 64;
        p.cp = 4;
        p.tp = 0;
        p.strategy = Strategy::hybrid;
        p.ulysses_degree = 3;
      },
      {"tp", "ulysses_degree"}, {"tp (0)", "ulysses_degree (3) to be a divisor of cp (4)"});
  add("ulysses_degree_without_hybrid", [](AttentionSpec&, ParallelSpec& p) { p.ulysses_degree = 2; },
      {"ulysses_degree"}, {"ulysses_degree (2) is for the hybrid strategy; strategy is ulysses"});
  return cases;
}

TEST(Validation, BadConfigsNameTheFieldAndTheFix) {
  for (const auto& c : bad_cases()) {
    SCOPED_TRACE(c.name);
    const auto errors = validation_errors(c.attention, c.parallel);
    ASSERT_EQ(errors.size(), c.fields.size());
    for (std::size_t i = 0; i < errors.size(); ++i) {
      EXPECT_EQ(errors[i].fields.at(0), c.fields[i]) << errors[i].message;
      EXPECT_NE(errors[i].message.find(c.phrases[i]), std::string::npos) << errors[i].message;
    }
    EXPECT_THROW(validate(c.attention, c.parallel), Error);
  }
}

// More ranks than q heads: hybrid takes them (Hq = 8 at cp = 16 as 8 x 2), ulysses cannot.
TEST(Validation, HybridTakesMoreRanksThanQHeads) {
  AttentionSpec a = seed_attention();
  a.num_q_heads = 8;
  ParallelSpec p;
  p.cp = 16;
  p.strategy = Strategy::hybrid;
  p.ulysses_degree = 8;
  p.load_balance = true;
  EXPECT_TRUE(validation_errors(a, p).empty());
  EXPECT_EQ(p.ring_degree(), 2);
  p.strategy = Strategy::ulysses;
  p.ulysses_degree = 0;
  p.load_balance = false;
  EXPECT_FALSE(validation_errors(a, p).empty());
}

TEST(Validation, ReportsEveryBrokenRuleAtOnce) {
  AttentionSpec a = seed_attention();
  a.num_q_heads = 2;  // not a multiple of the kv heads, and fewer than the ranks
  a.num_kv_heads = 3;
  a.seq_len = 65537;
  const auto errors = validation_errors(a, ulysses(4));
  ASSERT_EQ(errors.size(), 3u);
  try {
    validate(a, ulysses(4));
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::invalid_config);
    EXPECT_EQ(e.items().size(), 3u);
  }
}

TEST(ConfigFile, ReadsTheSeedKeysAndBothSpellings) {
  const auto v = parse_config_yaml(R"(
context_parallel_strategy: "ulysses"
ici_context_parallelism: 4
base_num_query_heads: 32
base_num_kv_heads: 2
head_dim: 256
max_target_length: 65536
per_device_batch_size: 1.0
context_parallel_load_balance: false
base_emb_dim: 4096
base_num_decoder_layers: 60
inhomogeneous_layer_cycle_interval: 4
dtype: bfloat16
)",
                                   "test.yml");
  EXPECT_EQ(v.strategy.value(), "ulysses");
  EXPECT_EQ(v.cp.value(), 4);
  EXPECT_EQ(v.num_q_heads.value(), 32);
  EXPECT_EQ(v.num_kv_heads.value(), 2);
  EXPECT_EQ(v.batch.value(), 1);
  EXPECT_EQ(v.emb_dim.value(), 4096);
  EXPECT_EQ(v.attention_every.value(), 4);
  std::vector<ErrorItem> errors;
  const Specs s = to_specs(v, errors);
  EXPECT_TRUE(errors.empty());
  EXPECT_EQ(s.attention.dtype, DType::bf16);
  EXPECT_EQ(s.parallel.strategy, Strategy::ulysses);
  EXPECT_TRUE(validation_errors(s.attention, s.parallel).empty());
}

// sliding_window_size W is W keys back, the query's included: window_left W - 1 (and window_right W - 1
// without the causal mask); 0 is none (the seed framework's default); a negative one is refused naming the
// key.
TEST(ConfigFile, SlidingWindowSizeIsTheKeysAQuerySees) {
  EXPECT_EQ(parse_config_yaml("sliding_window_size: 1024\n", "w.yml").sliding_window.value(), 1024);
  EXPECT_FALSE(parse_config_yaml("sliding_window_size: 0\n", "w.yml").sliding_window.has_value());
  for (const char* text : {"sliding_window_size: -3\n", "sliding_window_size: 2147483649\n"}) {
    try {
      parse_config_yaml(text, "w.yml");
      ADD_FAILURE() << text;
    } catch (const Error& e) {
      EXPECT_EQ(e.items().at(0).fields.at(0), "sliding_window_size") << e.what();
    }
  }
  ConfigValues v = parse_config_yaml("sliding_window_size: 4096\nmax_target_length: 65536\n", "w.yml");
  v.num_q_heads = 8;
  v.num_kv_heads = 8;
  v.head_dim = 64;
  Specs specs;
  EXPECT_TRUE(all_config_errors(v, specs).empty());
  EXPECT_EQ(specs.attention.window_left.value(), 4095);
  EXPECT_FALSE(specs.attention.window_right.has_value());
  EXPECT_EQ(specs.attention.band().left, 4095);
  EXPECT_EQ(specs.attention.band().right, 0);
  // Without the causal mask both sides; --window (window_left/right) wins over the key.
  v.causal = false;
  EXPECT_TRUE(all_config_errors(v, specs).empty());
  EXPECT_EQ(specs.attention.window_left.value(), 4095);
  EXPECT_EQ(specs.attention.window_right.value(), 4095);
  v.window_left = 7;
  v.window_right = 3;
  EXPECT_TRUE(all_config_errors(v, specs).empty());
  EXPECT_EQ(specs.attention.window_left.value(), 7);
  EXPECT_EQ(specs.attention.window_right.value(), 3);
}

// attn_logits_soft_cap C: the soft-cap (0: none, the seed framework's default); a negative or non-numeric one
// is refused naming the key.
TEST(ConfigFile, AttnLogitsSoftCapIsTheSoftCap) {
  EXPECT_EQ(parse_config_yaml("attn_logits_soft_cap: 50.0\n", "c.yml").softcap.value(), 50.0);
  EXPECT_FALSE(parse_config_yaml("attn_logits_soft_cap: 0\n", "c.yml").softcap.has_value());
  for (const char* text :
       {"attn_logits_soft_cap: -3\n", "attn_logits_soft_cap: fifty\n", "attn_logits_soft_cap: [1]\n"}) {
    try {
      parse_config_yaml(text, "c.yml");
      ADD_FAILURE() << text;
    } catch (const Error& e) {
      EXPECT_EQ(e.items().at(0).fields.at(0), "attn_logits_soft_cap") << e.what();
    }
  }
}

// Attention's own key decides where it is given (the seed: GDN contiguous, attention balanced); the general
// key otherwise.
TEST(ConfigFile, TheAttentionLoadBalanceKeyDecidesWhereGiven) {
  auto v = parse_config_yaml("context_parallel_attention_load_balance: true\n", "a.yml");
  EXPECT_TRUE(v.attention_balanced());
  v = parse_config_yaml(
      "context_parallel_load_balance: false\ncontext_parallel_attention_load_balance: true\n", "a.yml");
  EXPECT_TRUE(v.attention_balanced());
  v = parse_config_yaml(
      "context_parallel_load_balance: true\ncontext_parallel_attention_load_balance: false\n", "a.yml");
  EXPECT_FALSE(v.attention_balanced());
  v = parse_config_yaml("context_parallel_load_balance: true\n", "a.yml");
  EXPECT_TRUE(v.attention_balanced());
  v = parse_config_yaml("context_parallel_load_balance: false\n", "a.yml");
  EXPECT_FALSE(v.attention_balanced());
}

// context_parallel_layout names the layout, and a named layout decides load balance (the dual chunk swap is
// its other name); a name that is no layout is an error naming the field and the valid ones.
TEST(ConfigFile, TheLayoutKeyNamesTheLayoutAndDecidesLoadBalance) {
  const std::string sizes =
      "context_parallel_strategy: ring\nici_context_parallelism: 4\nnum_query_heads: 8\nnum_kv_heads: 2\n"
      "head_dim: 16\nmax_target_length: 256\n";
  std::vector<ErrorItem> errors;
  Specs s =
      to_specs(parse_config_yaml(
                   sizes + "context_parallel_layout: solver\ncontext_parallel_attention_load_balance: true\n",
                   "a.yml"),
               errors);
  EXPECT_TRUE(errors.empty());
  EXPECT_EQ(s.parallel.layout, ShardLayout::solver);
  EXPECT_FALSE(s.parallel.load_balance);
  EXPECT_TRUE(validation_errors(s.attention, s.parallel).empty());
  s = to_specs(parse_config_yaml(sizes + "context_parallel_layout: dual_chunk_swap\n", "a.yml"), errors);
  EXPECT_TRUE(s.parallel.load_balance);
  EXPECT_EQ(s.parallel.effective_layout(), ShardLayout::dual_chunk_swap);
  errors.clear();
  to_specs(parse_config_yaml(sizes + "context_parallel_layout: zigzag\n", "a.yml"), errors);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].fields.front(), "layout");
  EXPECT_NE(errors[0].message.find("per_document or solver"), std::string::npos) << errors[0].message;
}

TEST(ConfigFile, ASecondYamlDocumentIsRefused) {
  try {
    parse_config_yaml("num_query_heads: 32\n---\nnum_qery_heads: 8\n", "two.yml");
    FAIL() << "a second document was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::invalid_input);
    EXPECT_NE(std::string(e.what()).find("two.yml: holds 2 YAML documents"), std::string::npos) << e.what();
  }
  // One document with its optional markers is one document.
  EXPECT_EQ(parse_config_yaml("---\nnum_query_heads: 32\n...\n", "one.yml").num_q_heads.value(), 32);
}

TEST(ConfigFile, LaterSourcesWin) {
  auto base = parse_config_yaml("ici_context_parallelism: 4\nnum_query_heads: 32\n", "a.yml");
  base.merge_from(parse_config_yaml("ici_context_parallelism: 8\n", "b.yml"));
  EXPECT_EQ(base.cp.value(), 8);
  EXPECT_EQ(base.num_q_heads.value(), 32);
}

TEST(ConfigFile, WrongTypesNameTheKeyAndFile) {
  const std::pair<const char*, const char*> cases[] = {
      {"ici_context_parallelism: four\n", "ici_context_parallelism"},
      {"num_kv_heads: [1, 2]\n", "num_kv_heads"},
      {"context_parallel_load_balance: maybe\n", "context_parallel_load_balance"},
      {"head_dim: 2.5\n", "head_dim"},
      {"context_parallel_strategy: {a: 1}\n", "context_parallel_strategy"},
      // Found by fuzz_config_yaml: a whole float beyond int64 was converted before its range was checked
      // (UB).
      {"max_target_length: 92233720368546854775807\n", "max_target_length"},
      {"max_target_length: -1e300\n", "max_target_length"},
  };
  for (const auto& [text, key] : cases) {
    try {
      parse_config_yaml(text, "bad.yml");
      ADD_FAILURE() << text;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::invalid_input);
      EXPECT_EQ(e.items().at(0).fields.at(0), key);
      EXPECT_NE(std::string(e.what()).find("bad.yml"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(parse_config_yaml("- just\n- a list\n", "list.yml"), Error);
  EXPECT_THROW(parse_config_yaml("key: [unclosed\n", "broken.yml"), Error);
}

TEST(ConfigFile, MissingSizesAndBadStringsAreReportedTogether) {
  ConfigValues v;
  v.strategy = "rings";
  v.num_q_heads = 8;
  Specs specs;
  const auto errors = all_config_errors(v, specs);
  ASSERT_EQ(errors.size(), 4u);  // seq_len, num_kv_heads, head_dim unset; strategy unknown
  EXPECT_EQ(errors[0].fields[0], "seq_len");
  EXPECT_NE(errors[3].message.find("'rings' is not a strategy"), std::string::npos);
}

// A key cpattn does not read is refused, not ignored: a misspelt key would otherwise leave its default in
// place without a word.
TEST(ConfigFile, RefusesUnknownAndRepeatedKeys) {
  auto refused = [](const std::string& text, const std::string& field, const std::string& phrase) {
    try {
      parse_config_yaml(text, "k.yml");
      ADD_FAILURE() << text << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::invalid_input);
      EXPECT_EQ(e.items().at(0).fields.at(0), field) << e.what();
      EXPECT_NE(std::string(e.what()).find("k.yml"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(phrase), std::string::npos) << e.what();
    }
  };
  refused("ici_context_paralelism: 4\n", "ici_context_paralelism",
          "unknown key 'ici_context_paralelism'; did you mean 'ici_context_parallelism'?");
  refused("head_dims: 128\n", "head_dims", "did you mean 'head_dim'?");
  refused("some_unknown_key: {nested: [1, 2]}\n", "some_unknown_key",
          "valid keys: context_parallel_strategy");
  refused("ici_context_parallelism: 4\nici_context_parallelism: 8\n", "ici_context_parallelism",
          "given twice");
  refused("\"bad\\x01key\": 1\n", "bad\x01key", "unknown key 'bad\\x01key'");
  refused("[a, b]: 1\n", "k.yml", "not a plain word");
  refused("num_query_heads: 32\nbase_num_query_heads: 16\n", "base_num_query_heads", "its other spelling");
  refused("head_dim:\n", "head_dim", "no value (null)");
  refused("bogus: 1\n", "bogus", "'bogus'; valid keys: ");
}

// Integers read as the flags read them: decimal digits only (a leading zero is not octal, 0x is not hex), and
// whole floats as the seed framework writes them.
TEST(ConfigFile, IntegersAreDecimal) {
  EXPECT_EQ(parse_config_yaml("ici_context_parallelism: 010\n", "a.yml").cp.value(), 10);
  EXPECT_EQ(parse_config_yaml("ici_context_parallelism: +8\n", "a.yml").cp.value(), 8);
  EXPECT_EQ(parse_config_yaml("per_device_batch_size: 2.0\n", "a.yml").batch.value(), 2);
  for (const char* text : {"ici_context_parallelism: 0x10\n", "ici_context_parallelism: 0o10\n",
                           "ici_context_parallelism: ''\n", "ici_context_parallelism: 1e400\n",
                           "ici_context_parallelism: .inf\n", "ici_context_parallelism: 4 4\n"}) {
    try {
      const auto v = parse_config_yaml(text, "a.yml");
      ADD_FAILURE() << text << " read as " << v.cp.value_or(-1);
    } catch (const Error& e) {
      EXPECT_EQ(e.items().at(0).fields.at(0), "ici_context_parallelism");
      EXPECT_NE(std::string(e.what()).find("written in decimal digits"), std::string::npos) << e.what();
    }
  }
}

TEST(ConfigFile, ReadsOnlySmallRegularFiles) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("cpattn_config_files_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string fifo = (dir / "fifo.yml").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string big = (dir / "big.yml").string();
  std::ofstream(big) << "# " << std::string(2 << 20, 'x') << "\n";
  const std::pair<std::string, std::string> cases[] = {{fifo, "is a FIFO"},
                                                       {"/dev/zero", "is a device"},
                                                       {dir.string(), "is a directory"},
                                                       {big, "at most 1 MiB"}};
  for (const auto& [path, phrase] : cases) {
    try {
      read_config_file(path);
      ADD_FAILURE() << path;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(phrase), std::string::npos) << e.what();
    }
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace cpattn
