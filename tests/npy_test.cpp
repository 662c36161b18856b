#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "cpattn/error.hpp"
#include "cpattn/npy.hpp"

namespace cpattn {
namespace {

std::string npy_bytes(const std::string& header_dict, const std::string& payload, int version = 1) {
  std::string h = header_dict;
  const std::size_t pre = version == 1 ? 10 : 12;
  h.append((64 - (pre + h.size() + 1) % 64) % 64, ' ');
  h += '\n';
  std::string out = "\x93NUMPY";
  out += static_cast<char>(version);
  out += '\0';
  if (version == 1) {
    out += static_cast<char>(h.size() & 0xff);
    out += static_cast<char>(h.size() >> 8);
  } else {
    for (int i = 0; i < 4; ++i) out += static_cast<char>((h.size() >> (8 * i)) & 0xff);
  }
  return out + h + payload;
}

std::string expect_rejected(const std::string& contents) {
  try {
    parse_npy(contents, "case.npy");
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::invalid_input);
    EXPECT_NE(std::string(e.what()).find("case.npy"), std::string::npos) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "accepted";
  return "";
}

TEST(Npy, WriteThenReadRoundTrips) {
  const auto path = (std::filesystem::temp_directory_path() / "cpattn_npy_roundtrip.npy").string();
  const std::vector<float> values = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f, 8.0f};
  write_npy(path, {2, 3}, values.data());
  const NpyArray a = read_npy(path);
  EXPECT_EQ(a.dtype, NpyDType::f32);
  EXPECT_EQ(a.shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(a.as_floats(), values);
  const std::vector<std::int32_t> ints = {5, -1, 7};
  write_npy(path, {3}, ints.data());
  EXPECT_EQ(read_npy(path).as_int32(), ints);
  std::remove(path.c_str());
}

TEST(Npy, ReadsVersion2AndFloat64) {
  double d[2] = {1.25, -3.5};
  const std::string bytes(reinterpret_cast<const char*>(d), sizeof(d));
  const NpyArray a =
      parse_npy(npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }", bytes, 2), "v2");
  EXPECT_EQ(a.as_doubles(), (std::vector<double>{1.25, -3.5}));
}

// Found by fuzz_npy: an empty array (a 0 in the shape) made as_doubles/as_floats/as_int32 pass a null pointer
// to memcpy (UBSan in the sanitizer build).
TEST(Npy, EmptyArraysReadAsEmpty) {
  for (const char* descr : {"<f8", "<f4", "<i4"}) {
    const NpyArray a = parse_npy(
        npy_bytes(std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (5, 0, 3), }",
                  ""),
        "empty");
    EXPECT_EQ(a.numel(), 0);
    if (std::string(descr) == "<i4") {
      EXPECT_TRUE(a.as_int32().empty());
    } else {
      EXPECT_TRUE(a.as_doubles().empty());
      EXPECT_TRUE(a.as_floats().empty());
    }
  }
}

TEST(Npy, RefusesWhatItCannotRead) {
  const std::string four(16, '\0');
  // Found by fuzz_npy: sizes without commas were read as a shape.
  for (const char* shape : {"(2 2)", "(2,, 2)", "(,4)", "(4 ,, )"}) {
    EXPECT_NE(expect_rejected(
                  npy_bytes(std::string("{'descr': '<f4', 'fortran_order': False, 'shape': ") + shape + ", }",
                            four))
                  .find("shape"),
              std::string::npos)
        << shape;
  }
  for (const char* shape : {"(4,)", "(2, 2)", "( 2 , 2 , )", "()"}) {
    const std::string payload = std::string(shape) == "()" ? std::string(4, '\0') : four;
    EXPECT_NO_THROW(parse_npy(
        npy_bytes(std::string("{'descr': '<f4', 'fortran_order': False, 'shape': ") + shape + ", }", payload),
        "ok"))
        << shape;
  }
  EXPECT_NE(expect_rejected("not an npy file at all").find("magic"), std::string::npos);
  EXPECT_NE(expect_rejected(npy_bytes("{'descr': '>f4', 'fortran_order': False, 'shape': (4,), }", four))
                .find("big-endian"),
            std::string::npos);
  EXPECT_NE(expect_rejected(npy_bytes("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }", four))
                .find("Fortran"),
            std::string::npos);
  EXPECT_NE(expect_rejected(npy_bytes("{'descr': '<f2', 'fortran_order': False, 'shape': (8,), }", four))
                .find("not supported"),
            std::string::npos);
  EXPECT_NE(expect_rejected(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (5,), }", four))
                .find("truncated"),
            std::string::npos);
  EXPECT_NE(expect_rejected(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (x,), }", four))
                .find("shape"),
            std::string::npos);
  expect_rejected(npy_bytes(
      "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999, 99999999999, 999999999), }", four));
  expect_rejected(npy_bytes("{'descr': '<f4', 'fortran_order': False, }", four));
  std::string cut = npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }", four);
  expect_rejected(cut.substr(0, 30));
  EXPECT_THROW(read_npy("/nonexistent/dir/x.npy"), Error);
}

}  // namespace
}  // namespace cpattn
