// The hardware profiles compiled into the library: the text of each file of src/plan/profiles, as CMake put
// it into profiles_data.cpp (src/CMakeLists.txt). Read by the same parser as `plan --profile FILE`.
#pragma once

#include <vector>

namespace cpattn::plan {

struct EmbeddedProfile {
  const char* file;  // "h200.yaml"
  const char* text;
};
const std::vector<EmbeddedProfile>& embedded_profiles();

}  // namespace cpattn::plan
