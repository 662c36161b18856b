// A fixture: the Python module including a file of the program, which the table forbids.
#include "flags.hpp"
