// A rank that fails in the middle of context-parallel forwards, under mpirun (Open MPI 4.1 has no
// fault-tolerant MPI). `mpi_fault_main STRATEGY MODE [TIMEOUT_S]`: rank 1, at its fourth forward, either
// exits (MODE exit: mpirun ends the job, naming the rank) or stops itself with SIGSTOP (MODE stop: its peers'
// ring shifts reach their deadline, the first to give up prints which rank made no progress and ends the
// job). The promise is that the whole job ends non-zero within seconds of the fault or of the deadline, the
// failed rank named, instead of hanging. STRATEGY may also name a data collective (all_to_all, all_gather,
// reduce_scatter), called directly instead of forwards, so that a stop lands in its data exchange rather than
// in a strategy's agreement step. Checked by mpi_fault_test.sh.
#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "cpattn/context_parallel.hpp"
#include "cpattn/mpi_comm.hpp"

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  const std::string strategy = argc > 1 ? argv[1] : "ulysses", mode = argc > 2 ? argv[2] : "exit";
  const double timeout_s = argc > 3 ? std::atof(argv[3]) : 600.0;
  {
    cpattn::MpiCommunicator comm(MPI_COMM_WORLD,
                                 std::chrono::milliseconds(static_cast<long>(timeout_s * 1000)));
    if (strategy == "all_to_all" || strategy == "all_gather" || strategy == "reduce_scatter") {
      const std::int64_t n = 1 << 16;
      std::vector<float> send(static_cast<std::size_t>(n * comm.size()), 1.0f), recv(send.size());
      for (int step = 0; step < 1000; ++step) {
        if (comm.rank() == 1 && step == 3) {
          std::fprintf(stderr, "rank 1: injected fault (%s) before %s\n", mode.c_str(), strategy.c_str());
          if (mode == "stop") std::raise(SIGSTOP);
          _exit(3);
        }
        if (strategy == "all_to_all") comm.all_to_all(send.data(), recv.data(), n, cpattn::CommDType::f32);
        if (strategy == "all_gather") comm.all_gather(send.data(), recv.data(), n, cpattn::CommDType::f32);
        if (strategy == "reduce_scatter") {
          comm.reduce_scatter_sum(send.data(), recv.data(), n, cpattn::CommDType::f32);
        }
      }
      MPI_Finalize();
      return 0;
    }
    cpattn::AttentionSpec a;
    a.seq_len = 1024;
    a.num_q_heads = 8;
    a.num_kv_heads = 2;
    a.head_dim = 32;
    cpattn::ParallelSpec p;
    p.cp = comm.size();
    p.strategy = cpattn::parse_strategy(strategy);
    cpattn::ContextParallelAttention attn(a, p, comm);
    const std::int64_t sl = a.seq_len / p.cp;
    const cpattn::Tensor q = cpattn::random_normal(cpattn::DType::f32, {1, sl, 8, 32}, 1);
    const cpattn::Tensor kv = cpattn::random_normal(cpattn::DType::f32, {1, sl, 2, 32}, 2);
    try {
      for (int step = 0; step < 1000; ++step) {
        if (comm.rank() == 1 && step == 3) {
          std::fprintf(stderr, "rank 1: injected fault (%s) mid-run\n", mode.c_str());
          if (mode == "stop") {
            std::raise(SIGSTOP);
          } else {
            _exit(3);
          }
        }
        attn.forward(q, kv, kv);
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "error: %s\n", e.what());
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
  }
  MPI_Finalize();
  return 0;
}
