#include "cpattn/npy.hpp"

#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include "cpattn/error.hpp"

namespace cpattn {
namespace {

[[noreturn]] void bad(const std::string& name, const std::string& what) {
  throw Error(ErrorKind::invalid_input, name, what, name + ": not a readable .npy file: " + what);
}

std::size_t element_size(NpyDType t) {
  return t == NpyDType::f64 ? 8 : 4;
}

// Finds `'key':` in the header dict and returns the text after it.
std::string value_after(const std::string& header, const std::string& key, const std::string& name) {
  const std::string pattern = "'" + key + "'";
  const auto at = header.find(pattern);
  if (at == std::string::npos) bad(name, "header has no '" + key + "'");
  auto colon = header.find(':', at + pattern.size());
  if (colon == std::string::npos) bad(name, "header key '" + key + "' has no value");
  auto start = header.find_first_not_of(' ', colon + 1);
  if (start == std::string::npos) bad(name, "header key '" + key + "' has no value");
  return header.substr(start);
}

std::vector<std::int64_t> parse_shape(const std::string& text, const std::string& name) {
  if (text.empty() || text[0] != '(') bad(name, "shape is not a tuple");
  const auto close = text.find(')');
  if (close == std::string::npos) bad(name, "shape tuple is not closed");
  std::vector<std::int64_t> shape;
  const std::string inner = text.substr(1, close - 1);
  // Python's tuple syntax: sizes separated by commas, spaces around them, one trailing comma ("(5,)"). A
  // missing or doubled comma is refused (fuzz_npy read "(5 0 7)" as a shape).
  std::size_t pos = 0;
  auto skip_spaces = [&] {
    while (pos < inner.size() && inner[pos] == ' ') ++pos;
  };
  skip_spaces();
  while (pos < inner.size()) {
    std::size_t end = pos;
    while (end < inner.size() && inner[end] >= '0' && inner[end] <= '9') ++end;
    if (end == pos || end - pos > 18) bad(name, "shape entry '" + inner.substr(pos, 20) + "' is not a size");
    shape.push_back(std::stoll(inner.substr(pos, end - pos)));
    pos = end;
    skip_spaces();
    if (pos == inner.size()) break;
    if (inner[pos] != ',') bad(name, "shape tuple is malformed: sizes must be separated by commas");
    ++pos;
    skip_spaces();
  }
  if (shape.size() > 8) bad(name, "more than 8 dimensions");
  return shape;
}

std::string header_for(const char* descr, const std::vector<std::int64_t>& shape) {
  std::string s = "{'descr': '" + std::string(descr) + "', 'fortran_order': False, 'shape': (";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    s += std::to_string(shape[i]);
    if (shape.size() == 1 || i + 1 < shape.size()) s += ",";
    if (i + 1 < shape.size()) s += " ";
  }
  s += "), }";
  const std::size_t total = 10 + s.size() + 1;
  s.append((64 - total % 64) % 64, ' ');
  s += '\n';
  return s;
}

void write_raw(const std::string& path, const char* descr, const std::vector<std::int64_t>& shape,
               const void* values, std::size_t elem) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  const std::string header = header_for(descr, shape);
  std::ofstream out(path, std::ios::binary);
  if (!out) throw Error(ErrorKind::invalid_input, path, "", path + ": cannot open for writing");
  const unsigned char preamble[8] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
  out.write(reinterpret_cast<const char*>(preamble), 8);
  const auto len = static_cast<std::uint16_t>(header.size());
  const char len_bytes[2] = {static_cast<char>(len & 0xff), static_cast<char>(len >> 8)};
  out.write(len_bytes, 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(static_cast<const char*>(values),
            static_cast<std::streamsize>(static_cast<std::size_t>(n) * elem));
  if (!out) throw Error(ErrorKind::invalid_input, path, "", path + ": write failed");
}

}  // namespace

std::int64_t NpyArray::numel() const {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::vector<double> NpyArray::as_doubles() const {
  std::vector<double> out(static_cast<std::size_t>(numel()));
  if (dtype == NpyDType::f64) {
    // An empty array (a 0 in the shape) has null data; memcpy must not see it (found by fuzz_npy, UBSan).
    if (!out.empty()) std::memcpy(out.data(), bytes.data(), out.size() * 8);
  } else if (dtype == NpyDType::f32) {
    for (std::size_t i = 0; i < out.size(); ++i) {
      float f;
      std::memcpy(&f, bytes.data() + i * 4, 4);
      out[i] = f;
    }
  } else {
    CPATTN_ASSERT(false && "as_doubles on an int32 array");
  }
  return out;
}

std::vector<float> NpyArray::as_floats() const {
  if (dtype == NpyDType::f32) {
    std::vector<float> out(static_cast<std::size_t>(numel()));
    if (!out.empty()) std::memcpy(out.data(), bytes.data(), out.size() * 4);
    return out;
  }
  const auto d = as_doubles();
  return std::vector<float>(d.begin(), d.end());
}

std::vector<std::int32_t> NpyArray::as_int32() const {
  CPATTN_ASSERT(dtype == NpyDType::i32);
  std::vector<std::int32_t> out(static_cast<std::size_t>(numel()));
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), out.size() * 4);
  return out;
}

NpyArray parse_npy(const std::string& c, const std::string& name) {
  if (c.size() < 10 || static_cast<unsigned char>(c[0]) != 0x93 || c.compare(1, 5, "NUMPY") != 0) {
    bad(name, "missing the \\x93NUMPY magic");
  }
  const int major = static_cast<unsigned char>(c[6]);
  std::size_t header_len = 0, offset = 0;
  if (major == 1) {
    header_len =
        static_cast<unsigned char>(c[8]) | (static_cast<std::size_t>(static_cast<unsigned char>(c[9])) << 8);
    offset = 10;
  } else if (major == 2 || major == 3) {
    if (c.size() < 12) bad(name, "truncated header");
    for (int i = 0; i < 4; ++i)
      header_len |= static_cast<std::size_t>(static_cast<unsigned char>(c[8 + i])) << (8 * i);
    offset = 12;
  } else {
    bad(name, "unsupported format version " + std::to_string(major));
  }
  if (offset + header_len > c.size()) bad(name, "truncated header");
  const std::string header = c.substr(offset, header_len);

  NpyArray a;
  const std::string descr = value_after(header, "descr", name);
  if (descr.rfind("'<f4'", 0) == 0) {
    a.dtype = NpyDType::f32;
  } else if (descr.rfind("'<f8'", 0) == 0) {
    a.dtype = NpyDType::f64;
  } else if (descr.rfind("'<i4'", 0) == 0) {
    a.dtype = NpyDType::i32;
  } else if (descr.rfind("'>", 0) == 0) {
    bad(name, "big-endian data (" + descr.substr(0, descr.find(',')) + "); save it little-endian");
  } else {
    bad(name, "dtype " + descr.substr(0, descr.find(',')) + " is not supported; valid: <f4, <f8, <i4");
  }
  const std::string fortran = value_after(header, "fortran_order", name);
  if (fortran.rfind("True", 0) == 0) bad(name, "Fortran-order data; save it in C order");
  if (fortran.rfind("False", 0) != 0) bad(name, "fortran_order is neither True nor False");
  a.shape = parse_shape(value_after(header, "shape", name), name);

  std::int64_t n = 1;
  for (auto d : a.shape) {
    if (__builtin_mul_overflow(n, d, &n)) bad(name, "shape overflows");
  }
  const std::size_t elem = element_size(a.dtype);
  const std::size_t have = c.size() - offset - header_len;
  if (static_cast<std::uint64_t>(n) > std::numeric_limits<std::uint64_t>::max() / elem ||
      static_cast<std::uint64_t>(n) * elem != have) {
    bad(name, "data holds " + std::to_string(have) + " bytes, the shape needs " +
                  std::to_string(static_cast<std::uint64_t>(n) * elem) + " (truncated or wrong shape)");
  }
  a.bytes.assign(c.begin() + static_cast<std::ptrdiff_t>(offset + header_len), c.end());
  return a;
}

NpyArray read_npy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(ErrorKind::invalid_input, path, "", path + ": cannot open for reading");
  std::ostringstream ss;
  ss << in.rdbuf();
  return parse_npy(ss.str(), path);
}

void write_npy(const std::string& path, const std::vector<std::int64_t>& shape, const float* values) {
  write_raw(path, "<f4", shape, values, 4);
}

void write_npy(const std::string& path, const std::vector<std::int64_t>& shape, const std::int32_t* values) {
  write_raw(path, "<i4", shape, values, 4);
}

}  // namespace cpattn
