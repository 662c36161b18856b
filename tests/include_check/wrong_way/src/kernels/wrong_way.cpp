// A fixture for the include check's negative control: kernels including a strategy header is a wrong-way
// include, which the check must report.
#include "cpattn/context_parallel.hpp"
