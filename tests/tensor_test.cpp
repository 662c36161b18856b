#include <gtest/gtest.h>

#include "cpattn/flash.hpp"
#include "cpattn/tensor.hpp"

namespace cpattn {
namespace {

TEST(Tensor, RowMajorLayoutAndStrides) {
  Tensor t(DType::f32, {2, 3, 4, 5});
  EXPECT_EQ(t.numel(), 120);
  EXPECT_EQ(t.nbytes(), 480u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.raw()) % 64, 0u);
  t.set(1, 2, 3, 4, 7.5f);
  EXPECT_EQ(t.data<float>()[119], 7.5f);
  const ConstTensorRef v = cref(t);
  EXPECT_EQ(v.stride[0], 60);
  EXPECT_EQ(v.stride[1], 20);
  EXPECT_EQ(v.stride[2], 5);
  EXPECT_EQ(static_cast<const float*>(v.ptr)[v.offset(1, 2, 3) + 4], 7.5f);
  const ConstTensorRef heads = v.heads(2, 2);
  EXPECT_EQ(heads.shape.h, 2);
  EXPECT_EQ(static_cast<const float*>(heads.ptr)[heads.offset(1, 2, 1) + 4], 7.5f);
  // A head range outside the tensor is an error, not a view past its end.
  EXPECT_THROW(v.heads(3, 2), Error);
  EXPECT_THROW(v.heads(-1, 1), Error);
}

TEST(Tensor, ZeroInitializedAndDeepCopy) {
  Tensor t(DType::bf16, {1, 4, 2, 3});
  for (std::int64_t i = 0; i < t.numel(); ++i) EXPECT_EQ(t.flat(i), 0.0f);
  t.set(0, 1, 1, 2, 1.5f);
  Tensor copy = t;
  t.set(0, 1, 1, 2, 2.5f);
  EXPECT_EQ(copy.get(0, 1, 1, 2), 1.5f);
  EXPECT_EQ(t.get(0, 1, 1, 2), 2.5f);
}

TEST(Tensor, ConversionRoundsToBf16) {
  const std::vector<float> values = {1.0f, 1.00390625f, 3.14159f, -2.0f};
  Tensor t = Tensor::from_floats(DType::f32, {1, 1, 1, 4}, values);
  Tensor b = t.to(DType::bf16);
  EXPECT_EQ(b.dtype(), DType::bf16);
  EXPECT_EQ(b.flat(1), 1.0f);  // tie to even
  EXPECT_EQ(b.flat(2), round_to_bf16(3.14159f));
  EXPECT_EQ(b.to(DType::f32).flat(3), -2.0f);
}

TEST(Tensor, WrongTypedAccessIsAnError) {
  Tensor t(DType::bf16, {1, 1, 1, 1});
  EXPECT_THROW(t.data<float>(), Error);
}

TEST(Tensor, ParseDtypeNamesTheField) {
  EXPECT_EQ(parse_dtype("bfloat16"), DType::bf16);
  EXPECT_EQ(parse_dtype("fp32"), DType::f32);
  try {
    parse_dtype("fp16", "--dtype");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.items().at(0).fields.at(0), "--dtype");
    EXPECT_NE(std::string(e.what()).find("fp16"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("bf16"), std::string::npos);
  }
}

}  // namespace
}  // namespace cpattn
