// A fixture for the include check's negative control: core including a layout file by a relative path.
#pragma once
#include "../layout/placed.hpp"
