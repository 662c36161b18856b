#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cpattn/comm.hpp"
#include "cpattn/error.hpp"

namespace cpattn {

void check_block_layout(const BlockShape& shape, const BlockStrides& send, const BlockStrides& recv) {
  const std::pair<const char*, std::int64_t> fields[] = {
      {"shape.outer", shape.outer}, {"shape.inner", shape.inner}, {"shape.row", shape.row},
      {"send.block", send.block},   {"send.outer", send.outer},   {"send.inner", send.inner},
      {"recv.block", recv.block},   {"recv.outer", recv.outer},   {"recv.inner", recv.inner}};
  for (const auto& [name, value] : fields) {
    if (value < 0) {
      throw Error(ErrorKind::invalid_input, name, std::to_string(value),
                  std::string("all_to_all_strided: ") + name + " = " + std::to_string(value) +
                      " is negative (valid: >= 0)");
    }
  }
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  if ((shape.outer > 0 && shape.inner > kMax / shape.outer) ||
      (shape.outer * shape.inner > 0 && shape.row > kMax / (shape.outer * shape.inner))) {
    throw Error(
        ErrorKind::invalid_input, "shape",
        std::to_string(shape.outer) + "x" + std::to_string(shape.inner) + "x" + std::to_string(shape.row),
        "all_to_all_strided: the block's element count overflows int64");
  }
}

std::string block_disagreement(int sender, int receiver, const BlockShape& sent, const BlockShape& expected) {
  auto rows = [](const BlockShape& b) {
    return std::to_string(b.outer) + "x" + std::to_string(b.inner) + " rows of " + std::to_string(b.row);
  };
  return "rank " + std::to_string(sender) + " sends rank " + std::to_string(receiver) + " a block of " +
         rows(sent) + " but rank " + std::to_string(receiver) + " expects " + rows(expected);
}

void throw_block_mismatch(int me, int sender, int receiver, const std::string& seen) {
  throw Error(ErrorKind::communication, "collective", "all_to_all_v",
              "collective mismatch in all_to_all_v (rank " + std::to_string(me) + "): " +
                  (seen.empty() ? "the block rank " + std::to_string(sender) + " sends rank " +
                                      std::to_string(receiver) + " is not the block rank " +
                                      std::to_string(receiver) + " expects"
                                : seen));
}

void check_block_list(const BlockList& list, int ranks, const char* side) {
  const std::string where = std::string("all_to_all_v: ") + side;
  if (static_cast<int>(list.shape.size()) != ranks || static_cast<int>(list.offset.size()) != ranks) {
    throw Error(ErrorKind::invalid_input, std::string(side) + ".shape",
                std::to_string(list.shape.size()) + "," + std::to_string(list.offset.size()),
                where + " lists " + std::to_string(list.shape.size()) + " shapes and " +
                    std::to_string(list.offset.size()) + " offsets; expected one of each per rank (" +
                    std::to_string(ranks) + ")");
  }
  const BlockStrides strides{0, list.outer, list.inner};
  for (int p = 0; p < ranks; ++p) {
    check_block_layout(list.shape[p], strides, strides);
    if (list.offset[p] < 0) {
      throw Error(ErrorKind::invalid_input, std::string(side) + ".offset", std::to_string(list.offset[p]),
                  where + " offset of block " + std::to_string(p) + " = " + std::to_string(list.offset[p]) +
                      " is negative (valid: >= 0)");
    }
  }
}

void copy_block(const void* src, const BlockStrides& from, void* dst, const BlockStrides& to,
                const BlockShape& shape, std::size_t element_size) {
  const auto e = static_cast<std::int64_t>(element_size);
  const std::size_t row_bytes = static_cast<std::size_t>(shape.row * e);
  if (shape.count() == 0) return;  // the buffers may be null
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  // Rows that follow each other in both layouts are copied as one run.
  const bool inner_runs = from.inner == shape.row && to.inner == shape.row;
  const bool all_runs =
      inner_runs &&
      (shape.outer == 1 || (from.outer == shape.inner * shape.row && to.outer == shape.inner * shape.row));
  if (all_runs) {
    std::memcpy(d, s, static_cast<std::size_t>(shape.count() * e));
    return;
  }
  for (std::int64_t i = 0; i < shape.outer; ++i) {
    const unsigned char* si = s + i * from.outer * e;
    unsigned char* di = d + i * to.outer * e;
    if (inner_runs) {
      std::memcpy(di, si, row_bytes * static_cast<std::size_t>(shape.inner));
      continue;
    }
    for (std::int64_t j = 0; j < shape.inner; ++j) {
      std::memcpy(di + j * to.inner * e, si + j * from.inner * e, row_bytes);
    }
  }
}

// Kept between calls: a fresh 2 x 64 MiB per call costs more in page faults than the copies.
struct Communicator::PackBuffers {
  std::vector<unsigned char> send, recv;
};

Communicator::Communicator() : pack_(std::make_unique<PackBuffers>()) {}
Communicator::~Communicator() = default;

void Communicator::all_to_all_strided(const void* send, const BlockStrides& send_strides, void* recv,
                                      const BlockStrides& recv_strides, const BlockShape& shape,
                                      CommDType dtype) {
  check_block_layout(shape, send_strides, recv_strides);
  const std::size_t e = comm_dtype_size(dtype);
  const std::int64_t count = shape.count();
  const BlockStrides packed{count, shape.inner * shape.row, shape.row};
  const std::size_t total = static_cast<std::size_t>(count * size()) * e;
  if (pack_->send.size() < total) {
    pack_->send.resize(total);
    pack_->recv.resize(total);
  }
  unsigned char* a = pack_->send.data();
  unsigned char* b = pack_->recv.data();
  for (int p = 0; p < size(); ++p) {
    copy_block(
        static_cast<const unsigned char*>(send) + p * send_strides.block * static_cast<std::int64_t>(e),
        send_strides, a + p * count * static_cast<std::int64_t>(e), packed, shape, e);
  }
  all_to_all(a, b, count, dtype);
  for (int p = 0; p < size(); ++p) {
    copy_block(b + p * count * static_cast<std::int64_t>(e), packed,
               static_cast<unsigned char*>(recv) + p * recv_strides.block * static_cast<std::int64_t>(e),
               recv_strides, shape, e);
  }
}

}  // namespace cpattn
