// A rank that dies in the middle of a context-parallel forward, under mpirun (Open MPI 4.1 has no
// fault-tolerant MPI). Rank 1 exits while the others are inside the ulysses all-to-alls; the promise is that
// the whole job ends non-zero within seconds, with mpirun naming the rank, instead of hanging. Checked by
// mpi_fault_test.sh.
#include <mpi.h>
#include <unistd.h>

#include <cstdio>

#include "cpattn/context_parallel.hpp"
#include "cpattn/mpi_comm.hpp"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  {
    cpattn::MpiCommunicator comm;
    cpattn::AttentionSpec a;
    a.seq_len = 1024;
    a.num_q_heads = 8;
    a.num_kv_heads = 2;
    a.head_dim = 32;
    cpattn::ParallelSpec p;
    p.cp = comm.size();
    p.strategy = cpattn::Strategy::ulysses;
    cpattn::ContextParallelAttention attn(a, p, comm);
    const std::int64_t sl = a.seq_len / p.cp;
    const cpattn::Tensor q = cpattn::random_normal(cpattn::DType::f32, {1, sl, 8, 32}, 1);
    const cpattn::Tensor kv = cpattn::random_normal(cpattn::DType::f32, {1, sl, 2, 32}, 2);
    for (int step = 0; step < 1000; ++step) {
      if (comm.rank() == 1 && step == 3) {
        std::fprintf(stderr, "rank 1: injected fault, exiting mid-run\n");
        _exit(3);
      }
      attn.forward(q, kv, kv);
    }
  }
  MPI_Finalize();
  return 0;
}
