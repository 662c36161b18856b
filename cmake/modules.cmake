# The modules of cpattn and the direction of their includes (docs/design.md, "Modules"). One place: the include
# check (cmake/check_includes.cmake, run by the test suite) reads it. A source file belongs to the module of its
# directory under src/; a public header to the module that lists it here.
set(CPATTN_MODULES core layout kernels comm io cp plan documents harness)
# The folders outside src/ that the check reads too: the program, the Python module, the benches. They own no
# public header; the Python module may not include the program's files (its answers are the library's).
set(CPATTN_OUTER_MODULES tools python bench)

# module -> the modules it may include (besides itself)
set(CPATTN_MAY_INCLUDE_core "")
set(CPATTN_MAY_INCLUDE_layout core)
set(CPATTN_MAY_INCLUDE_kernels core layout)
set(CPATTN_MAY_INCLUDE_comm core)
set(CPATTN_MAY_INCLUDE_io core)
set(CPATTN_MAY_INCLUDE_cp core layout kernels comm)
set(CPATTN_MAY_INCLUDE_plan core layout kernels)
set(CPATTN_MAY_INCLUDE_documents core layout kernels plan)
set(CPATTN_MAY_INCLUDE_harness core layout kernels comm io cp plan documents)
set(CPATTN_MAY_INCLUDE_tools core layout kernels comm io cp plan documents harness)
set(CPATTN_MAY_INCLUDE_python core layout kernels comm io cp plan documents)
set(CPATTN_MAY_INCLUDE_bench core layout kernels comm io cp plan documents harness)

# module -> its public headers (include/cpattn/)
set(CPATTN_HEADERS_core bf16.hpp collectives.hpp config.hpp config_file.hpp error.hpp interrupt.hpp mask.hpp parse.hpp strategy.hpp trace.hpp
                         tensor.hpp)
set(CPATTN_HEADERS_layout placement.hpp schedule.hpp sequence_layout.hpp shard.hpp)
set(CPATTN_HEADERS_kernels flash.hpp reference.hpp)
set(CPATTN_HEADERS_comm agreement.hpp comm.hpp communicators.hpp inproc.hpp mpi_comm.hpp transport.hpp transport_comm.hpp)
set(CPATTN_HEADERS_io npy.hpp)
set(CPATTN_HEADERS_cp context_parallel.hpp)
set(CPATTN_HEADERS_plan planner.hpp)
set(CPATTN_HEADERS_documents documents.hpp)
set(CPATTN_HEADERS_harness "")
