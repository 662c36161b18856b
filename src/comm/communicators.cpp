// The backends' factory: the one file outside mpi_comm.cpp that knows whether this build has MPI.
#include "cpattn/communicators.hpp"

#include <pthread.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "core/start_thread.hpp"
#include "cpattn/error.hpp"
#include "cpattn/parse.hpp"
#include "cpattn/transport_comm.hpp"

#ifdef CPATTN_WITH_MPI
#include "cpattn/mpi_comm.hpp"
#endif

namespace cpattn {

const char* to_string(Backend backend) {
  switch (backend) {
    case Backend::inproc:
      return "inproc";
    case Backend::mpi:
      return "mpi";
    case Backend::transport:
      return "transport";
  }
  return "unknown backend";
}

bool available(Backend backend) {
  switch (backend) {
    case Backend::inproc:
    case Backend::transport:
      return true;
    case Backend::mpi:
#ifdef CPATTN_WITH_MPI
      return true;
#else
      return false;
#endif
  }
  return false;
}

std::string available_backends() {
  return available(Backend::mpi) ? "inproc or mpi" : "inproc (this build has no MPI)";
}

Backend parse_backend(const std::string& text, const std::string& field) {
  for (const Backend b : {Backend::inproc, Backend::mpi}) {
    if (text == to_string(b) && available(b)) return b;
  }
  throw Error(ErrorKind::invalid_input, field, text,
              field + " '" + quoted(text) + "' is not available; valid: " + available_backends());
}

#ifdef CPATTN_WITH_MPI
namespace {

bool mpi_running() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

// MPI_Init and a communicator's first collectives (MPI_Comm_dup, MPI_Comm_split_type) have no deadline of
// their own: a rank stopped before them would hold its peers there for ever. While it lives, this ends the
// process (exit 1, which makes mpirun end the job) once `limit` has passed. No rank can be named there: none
// has made progress that the others could see.
class SetupDeadline {
 public:
  SetupDeadline(std::chrono::milliseconds limit, std::string name)
      : thread_(start_thread("MPI setup's deadline", [this, limit, name = std::move(name)] {
          pthread_setname_np(pthread_self(),
                             "cpattn-setup");  // tests/mpi/cli_stopped_rank_test.sh waits on it
          std::unique_lock lock(mutex_);
          if (done_changed_.wait_for(lock, limit, [this] { return done_; })) return;
          std::fprintf(
              stderr,
              "error (communication): MPI setup (MPI_Init, the communicator's first collectives) made "
              "no progress in %.3g s (%s): a rank is stopped, dead or cannot be reached\n",
              std::chrono::duration<double>(limit).count(), name.c_str());
          std::fflush(stderr);
          std::_Exit(1);
        })) {}
  ~SetupDeadline() {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
    }
    done_changed_.notify_all();
    thread_.join();
  }
  SetupDeadline(const SetupDeadline&) = delete;
  SetupDeadline& operator=(const SetupDeadline&) = delete;

 private:
  std::mutex mutex_;
  std::condition_variable done_changed_;
  bool done_ = false;
  std::thread thread_;  // last: it starts once the members it reads exist
};

std::unique_ptr<Communicator> make_mpi(const CommunicatorOptions& options) {
  if (options.fortran_handle) {
    if (!mpi_running()) {
      throw Error(ErrorKind::invalid_config, "comm", "",
                  "comm: MPI is not initialised (import mpi4py.MPI before making ContextParallelAttention)");
    }
    const MPI_Comm comm = MPI_Comm_f2c(static_cast<MPI_Fint>(*options.fortran_handle));
    if (comm == MPI_COMM_NULL) {
      throw Error(ErrorKind::invalid_config, "comm", "COMM_NULL",
                  "comm: MPI.COMM_NULL (or a communicator already freed) is not a communicator; valid: "
                  "MPI.COMM_WORLD or one made from it (Split, Dup)");
    }
    int inter = 0;
    if (MPI_Comm_test_inter(comm, &inter) != MPI_SUCCESS || inter) {
      throw Error(ErrorKind::invalid_config, "comm", inter ? "an intercommunicator" : "not a communicator",
                  std::string("comm: ") +
                      (inter ? "an intercommunicator (two groups) cannot run one sequence's attention"
                             : "not a valid communicator") +
                      "; valid: an intracommunicator, MPI.COMM_WORLD or one made from it (Split, Dup)");
    }
    return std::make_unique<MpiCommunicator>(comm, options.timeout);
  }
  SetupDeadline setup(options.timeout, options.timeout_name);
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    if (options.thread_multiple) {
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    } else {
      MPI_Init(nullptr, nullptr);
    }
  }
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, options.timeout);
}

}  // namespace
#endif

std::unique_ptr<Communicator> make_communicator(Backend backend, const CommunicatorOptions& options) {
  switch (backend) {
    case Backend::inproc:
      throw Error(ErrorKind::invalid_config, "backend", "inproc",
                  "the in-process group's ranks are threads of one process: InProcessGroup(n).run(...) makes "
                  "them; make_communicator makes a process's rank (mpi)");
    case Backend::mpi:
#ifdef CPATTN_WITH_MPI
      return make_mpi(options);
#else
      (void)options;
      throw Error(ErrorKind::invalid_config, "backend", "mpi",
                  "this build has no MPI backend; valid: " + available_backends());
#endif
    case Backend::transport:
      if (!options.transport) {
        throw Error(ErrorKind::invalid_config, "transport", "",
                    "the transport backend needs the group's messages (CommunicatorOptions::transport)");
      }
      return std::make_unique<TransportCommunicator>(options.transport, options.timeout);
  }
  throw Error(ErrorKind::invalid_config, "backend", "", "not a backend; valid: " + available_backends());
}

int world_rank() {
#ifdef CPATTN_WITH_MPI
  if (mpi_running()) {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    return rank;
  }
#endif
  return 0;
}

void end_job(int exit_code) {
#ifdef CPATTN_WITH_MPI
  if (mpi_running()) end_mpi_job(MPI_COMM_WORLD, exit_code);
#endif
  std::fflush(nullptr);
  std::_Exit(exit_code);
}

void finish_backends() {
#ifdef CPATTN_WITH_MPI
  if (mpi_running()) MPI_Finalize();
#endif
}

bool native_all_to_all(Communicator& comm, const float* send, float* recv, std::int64_t block) {
#ifdef CPATTN_WITH_MPI
  if (auto* mpi = dynamic_cast<MpiCommunicator*>(&comm)) {
    MPI_Alltoall(send, static_cast<int>(block), MPI_FLOAT, recv, static_cast<int>(block), MPI_FLOAT,
                 mpi->comm());
    return true;
  }
#else
  (void)comm;
  (void)send;
  (void)recv;
  (void)block;
#endif
  return false;
}

}  // namespace cpattn
