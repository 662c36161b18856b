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

// `name` is used in error messages (usually the path).
NpyArray parse_npy(const std::string& contents, const std::string& name);
NpyArray read_npy(const std::string& path);

void write_npy(const std::string& path, const std::vector<std::int64_t>& shape, const float* values);
void write_npy(const std::string& path, const std::vector<std::int64_t>& shape, const std::int32_t* values);

}  // namespace cpattn
