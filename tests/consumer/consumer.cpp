// The README's library example, built against the installed package (tests/consumer/run.sh): it must compile
// from the installed headers alone and run. Exits 0 when every rank got outputs of the documented shapes.
#include <atomic>
#include <iostream>

// README snippet begins
#include <cpattn/context_parallel.hpp>
#include <cpattn/inproc.hpp>  // or <cpattn/mpi_comm.hpp>: cpattn::MpiCommunicator, one process per rank
// README snippet ends

int main() {
  std::atomic<int> ranks_ok{0};
  // README snippet begins
  cpattn::AttentionSpec attention{
      .batch = 1, .seq_len = 4096, .num_q_heads = 32, .num_kv_heads = 2, .head_dim = 128};
  cpattn::ParallelSpec parallel{.cp = 4, .strategy = cpattn::Strategy::ulysses};
  cpattn::InProcessGroup group(4);
  group.run([&](cpattn::Communicator& comm) {  // every rank, with its own shard of S/cp tokens
    cpattn::ContextParallelAttention attn(attention, parallel, comm);
    const std::int64_t tokens = attention.seq_len / parallel.cp;
    auto q = cpattn::random_normal(cpattn::DType::f32, {1, tokens, 32, 128}, 1 + comm.rank());
    auto kv = cpattn::random_normal(cpattn::DType::f32, {1, tokens, 2, 128}, 9 + comm.rank());
    cpattn::AttentionOutput out = attn.forward(q, kv, kv);  // o [B, S/cp, Hq, D], lse [B, Hq, S/cp]
    cpattn::AttentionGradients g = attn.backward(out.o);    // d_out -> dq, dk, dv in q's and k's shapes
    // README snippet ends
    const bool ok = out.o.shape() == q.shape() && out.lse.size() == static_cast<std::size_t>(32 * tokens) &&
                    g.dq.shape() == q.shape() && g.dk.shape() == kv.shape() && g.dv.shape() == kv.shape();
    ranks_ok += ok ? 1 : 0;
    // README snippet begins
  });
  // README snippet ends
  std::cout << "consumer: " << ranks_ok << " of 4 ranks ran forward and backward\n";
  return ranks_ok == 4 ? 0 : 1;
}
