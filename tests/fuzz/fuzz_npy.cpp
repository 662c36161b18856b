// libFuzzer target: the .npy reader. Any input must either parse into a consistent array or throw
// cpattn::Error (the corpus holds headers that lie: shapes larger than the data, lengths past the end, dicts
// never closed); anything else (a crash, a sanitizer report, another exception) is a bug.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "cpattn/error.hpp"
#include "cpattn/npy.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string contents(reinterpret_cast<const char*>(data), size);
  try {
    // The header alone (what read_npy_header trusts before reading data) must promise what parse_npy returns.
    const cpattn::NpyHeader h = cpattn::parse_npy_header(contents, "fuzz.npy");
    if (h.data_offset > contents.size()) std::abort();
    const cpattn::NpyArray a = cpattn::parse_npy(contents, "fuzz.npy");
    if (a.shape != h.shape || a.dtype != h.dtype || a.bytes.size() != h.data_bytes) std::abort();
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
