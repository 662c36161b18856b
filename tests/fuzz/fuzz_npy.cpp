// libFuzzer target: the .npy reader. Any input must either parse into a consistent array or throw
// cpattn::Error; anything else (a crash, a sanitizer report, another exception) is a bug.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "cpattn/error.hpp"
#include "cpattn/npy.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string contents(reinterpret_cast<const char*>(data), size);
  try {
    const cpattn::NpyArray a = cpattn::parse_npy(contents, "fuzz.npy");
    const std::size_t element = a.dtype == cpattn::NpyDType::f64 ? 8 : 4;
    // What parsed must be whole: as many bytes as the shape says, and readable in its own dtype.
    if (a.bytes.size() != static_cast<std::size_t>(a.numel()) * element) std::abort();
    if (a.dtype == cpattn::NpyDType::i32) {
      if (a.as_int32().size() != a.bytes.size() / 4) std::abort();
    } else if (a.as_doubles().size() != static_cast<std::size_t>(a.numel())) {
      std::abort();
    }
  } catch (const cpattn::Error&) {
  }
  return 0;
}
