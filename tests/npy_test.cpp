#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include <sys/stat.h>
#include <unistd.h>

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

// Headers that lie or are cut short are refused before anything trusts them.
TEST(Npy, RefusesHeadersThatLie) {
  const std::string four(16, '\0');
  // A header whose dict is never closed (the padding ends it where '}' should be).
  EXPECT_NE(expect_rejected(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (4,), ", four))
                .find("closed by '}'"),
            std::string::npos);
  // A version-2 header length of 4 GiB - 1: refused from the length alone.
  std::string v2 = npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }", four, 2);
  v2[8] = v2[9] = v2[10] = v2[11] = '\xff';
  EXPECT_NE(expect_rejected(v2).find("at most 1 MiB"), std::string::npos);
  // More data than the shape promises is as wrong as less.
  EXPECT_NE(expect_rejected(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", four))
                .find("the header's float32 (2) needs 8"),
            std::string::npos);
  // A shape whose byte count overflows int64 although its element count does not.
  expect_rejected(
      npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (4611686018427387904,), }", four));
  // The header alone is enough to learn the shape: no data needed.
  const NpyHeader h = parse_npy_header(
      npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (1000000, 1000), }", ""), "h.npy");
  EXPECT_EQ(h.shape, (std::vector<std::int64_t>{1000000, 1000}));
  EXPECT_EQ(h.data_bytes, 8000000000u);
  EXPECT_EQ(h.data_offset, 128u);
}

// Only regular files are opened: a FIFO would block the open for ever, /dev/zero would never end.
TEST(Npy, ReadsOnlyRegularFiles) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("cpattn_npy_files_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string fifo = (dir / "fifo.npy").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto refused = [](const std::string& path, const std::string& phrase) {
    try {
      read_npy(path);
      ADD_FAILURE() << path << " was read";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::invalid_input);
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(phrase), std::string::npos) << e.what();
    }
  };
  refused(fifo, "is a FIFO");
  refused("/dev/zero", "is a device");
  refused(dir.string(), "is a directory");
  refused((dir / "absent.npy").string(), "No such file");
  // A 16 GiB file whose header is true but whose data is sparse: the header reads at once, and nothing of the
  // data is read or allocated for it.
  const std::string big = (dir / "big.npy").string();
  {
    std::ofstream out(big, std::ios::binary);
    out << npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (4194304, 1024), }", "");
  }
  fs::resize_file(big, 128 + (std::uintmax_t{1} << 34));
  const NpyHeader h = read_npy_header(big);
  EXPECT_EQ(h.data_bytes, std::uint64_t{1} << 34);
  // And one byte short of its promise: refused from the size, before any read.
  fs::resize_file(big, 127 + (std::uintmax_t{1} << 34));
  refused(big, "truncated or wrong shape");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace cpattn
