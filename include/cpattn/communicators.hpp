// The communicator backends and the one place that makes them. MPI's setup (MPI_Init under a deadline), its
// communicators, the end of a job and its teardown live here, so that the program and the Python module name
// a backend and never see MPI (nor whether this build has it).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "cpattn/comm.hpp"
#include "cpattn/transport.hpp"

namespace cpattn {

// inproc: the in-process group (ranks are threads of this process: InProcessGroup(n).run(...));
// mpi: one rank per process under mpirun (Open MPI), in builds that have it;
// transport: one rank per process of a group run outside cpattn, over its point-to-point messages
// (options.transport: the Python module's over a torch.distributed process group).
enum class Backend { inproc, mpi, transport };

const char* to_string(Backend backend);
// Whether this build has the backend (inproc always; mpi with Open MPI).
bool available(Backend backend);
// "inproc or mpi", or "inproc (this build has no MPI)": for messages and --help.
std::string available_backends();
// A backend this build has, by name; else Error(invalid_input) naming `field`, the value and the available
// ones.
Backend parse_backend(const std::string& text, const std::string& field = "backend");

struct CommunicatorOptions {
  // Every wait of the communicator (a collective's, a shift's) and its setup: past it the rank says what made
  // no progress and the job ends.
  std::chrono::milliseconds timeout = std::chrono::seconds(600);
  // mpi: a communicator made elsewhere (mpi4py's), by its Fortran handle; MPI must then be initialised by its
  // owner (else Error(invalid_config) on "comm"). Unset: the world, MPI initialised here if it is not.
  std::optional<std::int64_t> fortran_handle;
  // mpi, initialised here: with MPI_THREAD_MULTIPLE (a thread of its own polls a ring shift while the rank
  // computes), or plain MPI_Init (the collectives bench, comparing with MPI's own calls).
  bool thread_multiple = true;
  // How the setup deadline is named in its message (the program: "--comm-timeout").
  std::string timeout_name = "the communicator's timeout";
  // transport: the group's messages (required there, unused otherwise).
  std::shared_ptr<Transport> transport;
};

// This process's rank of a backend that runs one rank per process (mpi, transport). MPI initialised here is
// set up under options.timeout (MPI_Init and the communicator's first collectives: a rank that never arrives
// ends the process after it); on a communicator made elsewhere (fortran_handle) the first collectives have
// the communicator's own deadline only where they poll. inproc: Error(invalid_config), its ranks being
// threads.
std::unique_ptr<Communicator> make_communicator(Backend backend, const CommunicatorOptions& options = {});

// This process's rank in the world of a running MPI (initialised, not finalised); 0 otherwise.
int world_rank();
// Ends the whole job from this rank: under a running MPI every process of it (MPI_Abort, and this process
// within 10 s even where mpirun cannot be reached); otherwise this process. Exit code `exit_code`.
[[noreturn]] void end_job(int exit_code);
// MPI_Finalize where MPI runs; nothing otherwise.
void finish_backends();
// The backend's own all-to-all of `block` floats per peer on `comm` (MPI_Alltoall on an MPI communicator): a
// bench's baseline. False where the communicator's backend has none.
bool native_all_to_all(Communicator& comm, const float* send, float* recv, std::int64_t block);

}  // namespace cpattn
