// Tensors: owning buffers and strided views over [B, S, H, D] (row-major by default), fp32 or bf16 storage.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <type_traits>

#include "cpattn/bf16.hpp"
#include "cpattn/error.hpp"

namespace cpattn {

enum class DType { f32, bf16 };

const char* to_string(DType dtype);
std::size_t dtype_size(DType dtype);
// Parses "fp32"/"float32"/"f32" and "bf16"/"bfloat16"; throws Error naming `field` otherwise.
DType parse_dtype(const std::string& text, const std::string& field = "dtype");

// [B, S, H, D]
struct Shape4 {
  std::int64_t b = 0, s = 0, h = 0, d = 0;
  std::int64_t numel() const { return b * s * h * d; }
  bool operator==(const Shape4&) const = default;
};
std::string to_string(const Shape4& shape);

// Owning, 64-byte aligned, row-major, zero-initialized. Copies are deep.
class Tensor {
 public:
  Tensor() = default;
  Tensor(DType dtype, Shape4 shape);
  Tensor(const Tensor& other);
  Tensor& operator=(const Tensor& other);
  Tensor(Tensor&&) noexcept = default;
  Tensor& operator=(Tensor&&) noexcept = default;

  // From float values (rounded to nearest even when dtype is bf16).
  static Tensor from_floats(DType dtype, Shape4 shape, std::span<const float> values);

  DType dtype() const { return dtype_; }
  const Shape4& shape() const { return shape_; }
  std::int64_t numel() const { return shape_.numel(); }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype_); }
  bool empty() const { return numel() == 0; }

  void* raw() { return storage_.get(); }
  const void* raw() const { return storage_.get(); }
  // Typed access; T must match dtype() (float for fp32, bf16 for bf16).
  template <class T>
  T* data() {
    check_dtype<T>();
    return reinterpret_cast<T*>(storage_.get());
  }
  template <class T>
  const T* data() const {
    check_dtype<T>();
    return reinterpret_cast<const T*>(storage_.get());
  }
  float get(std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t d) const;
  void set(std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t d, float value);
  float flat(std::int64_t i) const;

  std::vector<float> to_floats() const;
  std::vector<double> to_doubles() const;
  Tensor to(DType dtype) const;

 private:
  template <class T>
  void check_dtype() const {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, bf16>);
    CPATTN_ASSERT((std::is_same_v<T, float> ? DType::f32 : DType::bf16) == dtype_);
  }
  struct FreeAligned {
    void operator()(std::byte* p) const;
  };
  DType dtype_ = DType::f32;
  Shape4 shape_;
  std::unique_ptr<std::byte[], FreeAligned> storage_;
};

// Deterministic inputs: standard normal values (times `scale`) from a fixed-seed mt19937, rounded to dtype.
Tensor random_normal(DType dtype, Shape4 shape, std::uint32_t seed, float scale = 1.0f);

}  // namespace cpattn
