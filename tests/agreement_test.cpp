// The ranks' agreement before any data moves: what must match, compared in one collective, and a difference
// named on every rank (the field, each value, the ranks holding it), never computed.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "cp_harness.hpp"
#include "cpattn/agreement.hpp"
#include "cpattn/context_parallel.hpp"
#include "cpattn/error.hpp"
#include "cpattn/inproc.hpp"
#include "cpattn/sequence_layout.hpp"
#include "cpattn/shard.hpp"

namespace cpattn {
namespace {

using testing::CpCase;

// Runs `fn` on every rank of an n-rank group and returns each rank's error (empty where it raised none).
std::vector<Error> errors_of(int n, const std::function<void(Communicator&)>& fn) {
  std::vector<std::vector<Error>> caught(static_cast<std::size_t>(n));
  InProcessGroup group(n);
  try {
    group.run([&](Communicator& comm) {
      try {
        fn(comm);
      } catch (const Error& e) {
        caught[comm.rank()].push_back(e);
        throw;
      }
    });
  } catch (const Error&) {
  }
  std::vector<Error> out;
  for (auto& c : caught) {
    out.push_back(c.empty() ? Error(ErrorKind::internal, "none", "", "") : c.front());
  }
  return out;
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(Agreement, RanksThatAgreeGoOn) {
  InProcessGroup group(4);
  group.run([](Communicator& comm) {
    Agreement a;
    a.add("causal", true).add("seq_len", std::int64_t{4096}).add("scale", 0.125).add_text("save", "/tmp/out");
    agree(comm, a);
    agree(comm, Agreement());  // nothing to agree on
  });
}

TEST(Agreement, ADifferenceIsNamedOnEveryRankWithEachValueAndItsRanks) {
  const auto errors = errors_of(4, [](Communicator& comm) {
    Agreement a;
    a.add("seq_len", std::int64_t{4096}).add("causal", comm.rank() != 1);
    agree(comm, a);
  });
  for (const Error& e : errors) {
    EXPECT_EQ(e.kind(), ErrorKind::invalid_config) << e.what();
    ASSERT_EQ(e.items().size(), 1u) << e.what();
    EXPECT_EQ(e.items()[0].fields.front(), "causal");
    EXPECT_TRUE(has(e.what(), "the ranks disagree on causal: true on ranks 0, 2..3; false on rank 1"))
        << e.what();
  }
  EXPECT_EQ(errors[1].items()[0].value, "false");
  EXPECT_EQ(errors[0].items()[0].value, "true");
}

TEST(Agreement, EveryDifferingFieldIsAnItem) {
  const auto errors = errors_of(3, [](Communicator& comm) {
    Agreement a;
    a.add("seq_len", std::int64_t{64} << (comm.rank() == 2 ? 1 : 0))
        .add("head_dim", std::int64_t{64})
        .add("scale", comm.rank() == 0 ? 0.5 : 0.25);
    agree(comm, a);
  });
  for (const Error& e : errors) {
    ASSERT_EQ(e.items().size(), 2u) << e.what();
    EXPECT_TRUE(has(e.items()[0].message, "seq_len: 64 on ranks 0..1; 128 on rank 2")) << e.what();
    EXPECT_TRUE(has(e.items()[1].message, "scale: 0.5 on rank 0; 0.25 on ranks 1..2")) << e.what();
  }
}

TEST(Agreement, TextIsComparedWholeAndShownCut) {
  // Two paths alike in their first 100 bytes: the hash tells them apart; the message shows each cut.
  const std::string stem(100, 'a');
  const auto errors = errors_of(2, [&](Communicator& comm) {
    Agreement a;
    a.add_text("--save", stem + (comm.rank() == 0 ? "/x" : "/y"));
    agree(comm, a);
  });
  for (const Error& e : errors) {
    EXPECT_EQ(e.items().at(0).fields.front(), "--save");
    EXPECT_TRUE(has(e.what(), "'" + std::string(60, 'a') + "...")) << e.what();
  }
}

TEST(Agreement, RanksAddingOtherFieldsAreNamedAsSuch) {
  const auto errors = errors_of(2, [](Communicator& comm) {
    Agreement a;
    a.add("causal", true);
    if (comm.rank() == 1) a.add("window", std::int64_t{128});
    agree(comm, a);
  });
  for (const Error& e : errors) {
    EXPECT_EQ(e.items().at(0).fields.front(), "fields") << e.what();
    EXPECT_TRUE(has(e.what(), "1 fields, hash ")) << e.what();
    EXPECT_TRUE(has(e.what(), "causal, on rank 0; 2 fields, hash ")) << e.what();
    EXPECT_TRUE(has(e.what(), "causal,window, on rank 1")) << e.what();
  }
}

TEST(Agreement, ManyValuesAreSummarised) {
  const auto errors = errors_of(8, [](Communicator& comm) {
    Agreement a;
    a.add("seed", static_cast<std::int64_t>(comm.rank()));
    agree(comm, a);
  });
  for (const Error& e : errors) {
    EXPECT_TRUE(
        has(e.what(), "0 on rank 0; 1 on rank 1; 2 on rank 2; 3 on rank 3; 4 other values on 4 ranks"))
        << e.what();
  }
}

// One option changed on rank 1 of a case that runs when every rank holds it alike.
struct Disagreement {
  const char* field;
  std::function<void(AttentionSpec&, ParallelSpec&, ContextParallelOptions&)> change;
};

// Each option a rank could hold otherwise: refused on every rank when the object is made, before any data
// moves (nothing counted), naming the option.
TEST(Agreement, AnOptionOneRankHoldsOtherwiseIsRefusedOnEveryRankBeforeDataMoves) {
  const std::vector<Disagreement> cases = {
      {"causal", [](AttentionSpec& a, ParallelSpec&, ContextParallelOptions&) { a.causal = false; }},
      {"softmax_scale",
       [](AttentionSpec& a, ParallelSpec&, ContextParallelOptions&) { a.softmax_scale = 0.1; }},
      {"strategy",
       [](AttentionSpec&, ParallelSpec& p, ContextParallelOptions&) { p.strategy = Strategy::ulysses; }},
      {"load_balance",
       [](AttentionSpec&, ParallelSpec& p, ContextParallelOptions&) { p.load_balance = false; }},
      {"layout",
       [](AttentionSpec&, ParallelSpec& p, ContextParallelOptions&) { p.layout = ShardLayout::contiguous; }},
      {"dtype", [](AttentionSpec& a, ParallelSpec&, ContextParallelOptions&) { a.dtype = DType::bf16; }},
      {"seq_len", [](AttentionSpec& a, ParallelSpec&, ContextParallelOptions&) { a.seq_len = 128; }},
      {"cp", [](AttentionSpec&, ParallelSpec& p, ContextParallelOptions&) { p.cp = 2; }},
      {"remat", [](AttentionSpec&, ParallelSpec&, ContextParallelOptions& o) { o.remat = true; }},
      {"kernel.block_q",
       [](AttentionSpec&, ParallelSpec&, ContextParallelOptions& o) { o.kernel.block_q = 32; }},
      {"kernel.block_kv",
       [](AttentionSpec&, ParallelSpec&, ContextParallelOptions& o) { o.kernel.block_kv = 128; }},
      {"kernel.allow_amx",
       [](AttentionSpec&, ParallelSpec&, ContextParallelOptions& o) { o.kernel.allow_amx = false; }},
      {"kernel.allow_avx512_bf16",
       [](AttentionSpec&, ParallelSpec&, ContextParallelOptions& o) { o.kernel.allow_avx512_bf16 = false; }},
      {"num_q_heads", [](AttentionSpec& a, ParallelSpec&, ContextParallelOptions&) { a.num_q_heads = 8; }},
      {"num_kv_heads", [](AttentionSpec& a, ParallelSpec&, ContextParallelOptions&) { a.num_kv_heads = 4; }},
      {"head_dim", [](AttentionSpec& a, ParallelSpec&, ContextParallelOptions&) { a.head_dim = 32; }},
      {"batch", [](AttentionSpec& a, ParallelSpec&, ContextParallelOptions&) { a.batch = 2; }},
      {"tp", [](AttentionSpec&, ParallelSpec& p, ContextParallelOptions&) { p.tp = 2; }},
      {"ulysses_degree",
       [](AttentionSpec&, ParallelSpec& p, ContextParallelOptions&) {
         p.strategy = Strategy::hybrid;
         p.ulysses_degree = 2;
       }},
  };
  CpCase c;
  c.strategy = Strategy::ring;
  c.load_balance = true;
  c.cp = 4;
  c.hq = 4;
  c.hkv = 2;
  c.dim = 16;
  c.seq = 64;
  for (const Disagreement& d : cases) {
    std::vector<std::size_t> counted(4, 1);
    const auto errors = errors_of(4, [&](Communicator& comm) {
      AttentionSpec a = c.attention();
      ParallelSpec p = c.parallel();
      ContextParallelOptions o;
      if (comm.rank() == 1) d.change(a, p, o);
      try {
        ContextParallelAttention attn(a, p, comm, o);
      } catch (...) {
        counted[comm.rank()] = comm.counters().records().size();
        throw;
      }
    });
    for (int r = 0; r < 4; ++r) {
      const Error& e = errors[static_cast<std::size_t>(r)];
      EXPECT_EQ(e.kind(), ErrorKind::invalid_config) << d.field << " rank " << r << ": " << e.what();
      ASSERT_FALSE(e.items().empty());
      const bool named = std::any_of(e.items().begin(), e.items().end(),
                                     [&](const ErrorItem& item) { return item.fields.front() == d.field; });
      EXPECT_TRUE(named) << d.field << ": " << e.what();
      EXPECT_TRUE(has(e.what(), "on rank 1")) << e.what();
      EXPECT_EQ(counted[static_cast<std::size_t>(r)], 0u) << d.field << ": data moved on rank " << r;
    }
  }
}

// Per call: whether segments are given and whether state is kept, refused on every rank.
TEST(Agreement, ForwardOnlyOnOneRankIsRefusedOnEveryRank) {
  CpCase c;
  c.strategy = Strategy::all_gather;
  c.cp = 2;
  c.hq = 4;
  c.hkv = 2;
  c.dim = 16;
  c.seq = 64;
  const auto in = testing::make_whole_inputs(c, 3);
  const auto errors = errors_of(2, [&](Communicator& comm) {
    ContextParallelAttention attn(c.attention(), c.parallel(), comm);
    const auto at = local_positions(c.parallel().effective_layout(), c.seq, c.cp, comm.rank());
    attn.forward(take_tokens(in.q, at), take_tokens(in.k, at), take_tokens(in.v, at), {}, comm.rank() == 0);
  });
  for (const Error& e : errors) {
    EXPECT_EQ(e.items().at(0).fields.front(), "forward_only") << e.what();
    EXPECT_TRUE(has(e.what(), "the ranks disagree on forward_only")) << e.what();
  }
}

}  // namespace
}  // namespace cpattn
