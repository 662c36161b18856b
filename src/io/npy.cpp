#include "cpattn/npy.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include "cpattn/error.hpp"
#include "cpattn/parse.hpp"

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
  // numpy reads the last of a key given twice, a reader of the first would read other data: refused.
  if (header.find(pattern, at + pattern.size()) != std::string::npos) {
    bad(name, "header gives '" + key + "' twice");
  }
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
  // stdio rather than a stream: each call that fails sets errno itself, so the reason is this file's.
  std::FILE* out = std::fopen(path.c_str(), "wb");
  if (out == nullptr) {
    throw Error(ErrorKind::invalid_input, path, "",
                path + ": cannot open for writing (" + std::strerror(errno) + ")");
  }
  const unsigned char preamble[8] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
  const auto len = static_cast<std::uint16_t>(header.size());
  const char len_bytes[2] = {static_cast<char>(len & 0xff), static_cast<char>(len >> 8)};
  const std::size_t data_bytes = static_cast<std::size_t>(n) * elem;
  int error = 0;
  auto put = [&](const void* bytes, std::size_t count) {
    if (error == 0 && count > 0 && std::fwrite(bytes, 1, count, out) != count)
      error = errno != 0 ? errno : EIO;
  };
  errno = 0;
  put(preamble, 8);
  put(len_bytes, 2);
  put(header.data(), header.size());
  put(values, data_bytes);
  // The data reaches the file at the close: a full disk shows now, not after the caller trusts it.
  if (std::fclose(out) != 0 && error == 0) error = errno != 0 ? errno : EIO;
  if (error != 0) {
    // The machine's limits (a full disk, a file size limit), not the input's fault.
    throw Error(ErrorKind::resource, path, "", path + ": write failed (" + std::strerror(error) + ")");
  }
}

}  // namespace

std::string npy_type_text(NpyDType dtype, const std::vector<std::int64_t>& shape) {
  std::string text = dtype == NpyDType::f32 ? "float32" : dtype == NpyDType::f64 ? "float64" : "int32";
  text += " (";
  for (std::size_t i = 0; i < shape.size(); ++i) text += (i == 0 ? "" : ", ") + std::to_string(shape[i]);
  return text + ")";
}

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

namespace {

// numpy writes headers of at most 64 KiB for version 1; later versions allow 4 GiB, which no real array
// needs.
constexpr std::uint64_t kMaxHeaderBytes = 1 << 20;

// The magic, version and header length; `c` holds at least the first 12 bytes of the file, or all of it.
void preamble(const std::string& c, const std::string& name, std::uint64_t& header_len,
              std::uint64_t& offset) {
  if (c.size() < 10 || static_cast<unsigned char>(c[0]) != 0x93 || c.compare(1, 5, "NUMPY") != 0) {
    bad(name, "missing the \\x93NUMPY magic");
  }
  const int major = static_cast<unsigned char>(c[6]);
  header_len = 0;
  if (major == 1) {
    header_len = static_cast<unsigned char>(c[8]) |
                 (static_cast<std::uint64_t>(static_cast<unsigned char>(c[9])) << 8);
    offset = 10;
  } else if (major == 2 || major == 3) {
    if (c.size() < 12) bad(name, "truncated header");
    for (int i = 0; i < 4; ++i)
      header_len |= static_cast<std::uint64_t>(static_cast<unsigned char>(c[8 + i])) << (8 * i);
    offset = 12;
  } else {
    bad(name, "unsupported format version " + std::to_string(major));
  }
  if (header_len > kMaxHeaderBytes) {
    bad(name, "header claims " + std::to_string(header_len) + " bytes; at most 1 MiB is read");
  }
}

}  // namespace

NpyHeader parse_npy_header(const std::string& c, const std::string& name) {
  std::uint64_t header_len = 0, offset = 0;
  preamble(c, name, header_len, offset);
  if (offset + header_len > c.size()) bad(name, "truncated header");
  const std::string header = c.substr(offset, header_len);
  // A dict, closed: '{' ... '}' then only padding (spaces, one newline). A header cut short is refused here,
  // not read as far as its keys happen to go.
  const auto first = header.find_first_not_of(' ');
  const auto last = header.find_last_not_of(" \n");
  if (first == std::string::npos || header[first] != '{' || header[last] != '}') {
    bad(name, "header is not a dict closed by '}'");
  }

  NpyHeader h;
  const std::string descr = value_after(header, "descr", name);
  if (descr.rfind("'<f4'", 0) == 0) {
    h.dtype = NpyDType::f32;
  } else if (descr.rfind("'<f8'", 0) == 0) {
    h.dtype = NpyDType::f64;
  } else if (descr.rfind("'<i4'", 0) == 0) {
    h.dtype = NpyDType::i32;
  } else if (descr.rfind("'>", 0) == 0) {
    bad(name, "big-endian data (" + descr.substr(0, descr.find(',')) + "); save it little-endian");
  } else {
    bad(name, "dtype " + descr.substr(0, descr.find(',')) + " is not supported; valid: <f4, <f8, <i4");
  }
  const std::string fortran = value_after(header, "fortran_order", name);
  if (fortran.rfind("True", 0) == 0) bad(name, "Fortran-order data; save it in C order");
  if (fortran.rfind("False", 0) != 0) bad(name, "fortran_order is neither True nor False");
  h.shape = parse_shape(value_after(header, "shape", name), name);

  std::int64_t n = 1;
  for (auto d : h.shape) {
    if (__builtin_mul_overflow(n, d, &n)) bad(name, "shape overflows");
  }
  const std::uint64_t elem = element_size(h.dtype);
  if (static_cast<std::uint64_t>(n) > std::numeric_limits<std::int64_t>::max() / elem) {
    bad(name, "shape overflows");
  }
  h.data_offset = offset + header_len;
  h.data_bytes = static_cast<std::uint64_t>(n) * elem;
  return h;
}

namespace {

void check_data_size(const NpyHeader& h, std::uint64_t have, const std::string& name) {
  if (have != h.data_bytes) {
    bad(name, "data holds " + std::to_string(have) + " bytes, the header's " +
                  npy_type_text(h.dtype, h.shape) + " needs " + std::to_string(h.data_bytes) +
                  " (truncated or wrong shape)");
  }
}

}  // namespace

NpyArray parse_npy(const std::string& c, const std::string& name) {
  const NpyHeader h = parse_npy_header(c, name);
  check_data_size(h, c.size() - h.data_offset, name);
  NpyArray a;
  a.dtype = h.dtype;
  a.shape = h.shape;
  a.bytes.assign(c.begin() + static_cast<std::ptrdiff_t>(h.data_offset), c.end());
  return a;
}

namespace {

NpyHeader read_header(const std::string& path, std::ifstream& in) {
  const std::uint64_t size = open_input_file(path, in);
  std::string prefix(static_cast<std::size_t>(std::min<std::uint64_t>(size, 12)), '\0');
  in.read(prefix.data(), static_cast<std::streamsize>(prefix.size()));
  std::uint64_t header_len = 0, offset = 0;
  preamble(prefix, path, header_len, offset);
  if (offset + header_len > size) bad(path, "truncated header");
  prefix.resize(static_cast<std::size_t>(offset + header_len));
  in.seekg(0);
  in.read(prefix.data(), static_cast<std::streamsize>(prefix.size()));
  if (!in) bad(path, "read failed");
  const NpyHeader h = parse_npy_header(prefix, path);
  check_data_size(h, size - h.data_offset, path);
  return h;
}

}  // namespace

NpyHeader read_npy_header(const std::string& path) {
  std::ifstream in;
  return read_header(path, in);
}

NpyArray read_npy(const std::string& path) {
  std::ifstream in;
  const NpyHeader h = read_header(path, in);
  NpyArray a;
  a.dtype = h.dtype;
  a.shape = h.shape;
  try {
    a.bytes.resize(static_cast<std::size_t>(h.data_bytes));
  } catch (const std::bad_alloc&) {
    fail_allocation(static_cast<std::size_t>(h.data_bytes), path);
  }
  in.read(reinterpret_cast<char*>(a.bytes.data()), static_cast<std::streamsize>(a.bytes.size()));
  if (!in) bad(path, "read failed (the file shrank while it was read)");
  return a;
}

void write_npy(const std::string& path, const std::vector<std::int64_t>& shape, const float* values) {
  write_raw(path, "<f4", shape, values, 4);
}

void write_npy(const std::string& path, const std::vector<std::int64_t>& shape, const std::int32_t* values) {
  write_raw(path, "<i4", shape, values, 4);
}

}  // namespace cpattn
