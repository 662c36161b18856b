// numpy's .npy format (versions 1, 2 and 3): little-endian, C-order arrays of float32, float64 and int32.
// Anything else (big-endian, Fortran order, other dtypes, truncated or malformed files) is refused with an
// Error(invalid_input) that names the file and what is wrong.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace cpattn {

enum class NpyDType { f32, f64, i32 };

struct NpyArray {
  NpyDType dtype = NpyDType::f32;
  std::vector<std::int64_t> shape;
  std::vector<unsigned char> bytes;  // numel * element size, little-endian

  std::int64_t numel() const;
  std::vector<float> as_floats() const;        // f32 or f64 (rounded)
  std::vector<double> as_doubles() const;      // f32 or f64
  std::vector<std::int32_t> as_int32() const;  // i32 only
};

// What a header promises: the array's type and shape, where its data starts and how many bytes it holds.
struct NpyHeader {
  NpyDType dtype = NpyDType::f32;
  std::vector<std::int64_t> shape;
  std::uint64_t data_offset = 0;  // bytes before the data: magic, version, header length, header
  std::uint64_t data_bytes = 0;   // numel * element size
};

// The header at the start of `prefix` (which need hold no data). `name` is used in error messages (usually
// the path). The header is checked whole (magic, version, length, a dict closed by '}', dtype, order,
// shape) before anything trusts it.
NpyHeader parse_npy_header(const std::string& prefix, const std::string& name);
// The whole file's contents: its header, then exactly the bytes it promises (no more, no fewer).
NpyArray parse_npy(const std::string& contents, const std::string& name);
// "float64 (1, 64, 2, 8)": an array's type and shape as messages name them.
std::string npy_type_text(NpyDType dtype, const std::vector<std::int64_t>& shape);
// A regular file only (parse.hpp's open_input_file): reads the header alone, and refuses a file whose size
// is not the header's promise, so nothing is read or allocated beyond what a valid header states.
NpyHeader read_npy_header(const std::string& path);
// read_npy_header, then exactly its data bytes.
NpyArray read_npy(const std::string& path);

void write_npy(const std::string& path, const std::vector<std::int64_t>& shape, const float* values);
void write_npy(const std::string& path, const std::vector<std::int64_t>& shape, const std::int32_t* values);

}  // namespace cpattn
