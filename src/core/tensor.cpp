#include "cpattn/tensor.hpp"

#include <cstdlib>
#include <cstring>
#include <new>
#include <random>

#include "cpattn/error.hpp"
#include "cpattn/parse.hpp"

namespace cpattn {

const char* to_string(DType dtype) {
  return dtype == DType::f32 ? "fp32" : "bf16";
}

std::size_t dtype_size(DType dtype) {
  return dtype == DType::f32 ? 4 : 2;
}

DType parse_dtype(const std::string& text, const std::string& field) {
  if (text == "fp32" || text == "float32" || text == "f32" || text == "float") return DType::f32;
  if (text == "bf16" || text == "bfloat16") return DType::bf16;
  throw Error(ErrorKind::invalid_config, field, text,
              field + " '" + quoted(text) + "' is not supported; valid: fp32 (float32) or bf16 (bfloat16)");
}

std::string to_string(const Shape4& shape) {
  return "[" + std::to_string(shape.b) + ", " + std::to_string(shape.s) + ", " + std::to_string(shape.h) +
         ", " + std::to_string(shape.d) + "]";
}

void Tensor::FreeAligned::operator()(std::byte* p) const {
  std::free(p);
}

Tensor::Tensor(DType dtype, Shape4 shape) : dtype_(dtype), shape_(shape) {
  CPATTN_ASSERT(shape.b >= 0 && shape.s >= 0 && shape.h >= 0 && shape.d >= 0);
  const std::size_t bytes = nbytes();
  if (bytes == 0) return;
  const std::size_t rounded = (bytes + 63) / 64 * 64;
  auto* p = static_cast<std::byte*>(std::aligned_alloc(64, rounded));
  if (p == nullptr)
    fail_allocation(rounded, std::string("a ") + to_string(shape) + " " + to_string(dtype) + " tensor");
  std::memset(p, 0, rounded);
  storage_.reset(p);
}

Tensor::Tensor(const Tensor& other) : Tensor(other.dtype_, other.shape_) {
  if (other.nbytes() > 0) std::memcpy(storage_.get(), other.storage_.get(), other.nbytes());
}

Tensor& Tensor::operator=(const Tensor& other) {
  if (this != &other) *this = Tensor(other);
  return *this;
}

Tensor Tensor::from_floats(DType dtype, Shape4 shape, std::span<const float> values) {
  CPATTN_ASSERT(static_cast<std::int64_t>(values.size()) == shape.numel());
  Tensor t(dtype, shape);
  if (dtype == DType::f32) {
    if (!values.empty()) std::memcpy(t.raw(), values.data(), values.size() * 4);
  } else {
    bf16* out = t.data<bf16>();
    for (std::size_t i = 0; i < values.size(); ++i) out[i] = float_to_bf16(values[i]);
  }
  return t;
}

float Tensor::flat(std::int64_t i) const {
  return dtype_ == DType::f32 ? data<float>()[i] : bf16_to_float(data<bf16>()[i]);
}

float Tensor::get(std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t d) const {
  return flat(((b * shape_.s + s) * shape_.h + h) * shape_.d + d);
}

void Tensor::set(std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t d, float value) {
  const std::int64_t i = ((b * shape_.s + s) * shape_.h + h) * shape_.d + d;
  if (dtype_ == DType::f32) {
    data<float>()[i] = value;
  } else {
    data<bf16>()[i] = float_to_bf16(value);
  }
}

std::vector<float> Tensor::to_floats() const {
  std::vector<float> out(static_cast<std::size_t>(numel()));
  for (std::int64_t i = 0; i < numel(); ++i) out[i] = flat(i);
  return out;
}

std::vector<double> Tensor::to_doubles() const {
  std::vector<double> out(static_cast<std::size_t>(numel()));
  for (std::int64_t i = 0; i < numel(); ++i) out[i] = flat(i);
  return out;
}

Tensor Tensor::to(DType dtype) const {
  if (dtype == dtype_) return *this;
  const std::vector<float> values = to_floats();
  return from_floats(dtype, shape_, values);
}

Tensor random_normal(DType dtype, Shape4 shape, std::uint32_t seed, float scale) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> values(static_cast<std::size_t>(shape.numel()));
  for (auto& x : values) x = dist(gen);
  return Tensor::from_floats(dtype, shape, values);
}

}  // namespace cpattn
