#include "cpattn/shard.hpp"

#include <cstring>

#include "cpattn/error.hpp"

namespace cpattn {

Tensor take_tokens(const Tensor& whole, const std::vector<std::int64_t>& positions) {
  const Shape4 s = whole.shape();
  const std::int64_t n = static_cast<std::int64_t>(positions.size());
  Tensor out(whole.dtype(), {s.b, n, s.h, s.d});
  const std::size_t run = static_cast<std::size_t>(s.h * s.d) * dtype_size(whole.dtype());
  const auto* src = static_cast<const unsigned char*>(whole.raw());
  auto* dst = static_cast<unsigned char*>(out.raw());
  for (std::int64_t b = 0; b < s.b; ++b) {
    for (std::int64_t i = 0; i < n; ++i) {
      CPATTN_ASSERT(positions[i] >= 0 && positions[i] < s.s);
      std::memcpy(dst + (b * n + i) * run, src + (b * s.s + positions[i]) * run, run);
    }
  }
  return out;
}

void put_tokens(Tensor& whole, const Tensor& local, const std::vector<std::int64_t>& positions) {
  const Shape4 s = whole.shape();
  const std::int64_t n = static_cast<std::int64_t>(positions.size());
  CPATTN_ASSERT(local.dtype() == whole.dtype() && local.shape() == (Shape4{s.b, n, s.h, s.d}));
  const std::size_t run = static_cast<std::size_t>(s.h * s.d) * dtype_size(whole.dtype());
  const auto* src = static_cast<const unsigned char*>(local.raw());
  auto* dst = static_cast<unsigned char*>(whole.raw());
  for (std::int64_t b = 0; b < s.b; ++b) {
    for (std::int64_t i = 0; i < n; ++i)
      std::memcpy(dst + (b * s.s + positions[i]) * run, src + (b * n + i) * run, run);
  }
}

std::vector<std::int32_t> take_tokens(const std::vector<std::int32_t>& ids, std::int64_t batch,
                                      const std::vector<std::int64_t>& positions) {
  std::vector<std::int32_t> out;
  if (ids.empty()) return out;
  const std::int64_t seq = static_cast<std::int64_t>(ids.size()) / batch;
  for (std::int64_t b = 0; b < batch; ++b) {
    for (auto p : positions) out.push_back(ids[b * seq + p]);
  }
  return out;
}

}  // namespace cpattn
