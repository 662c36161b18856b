// The kernels' bits as one hash: O, LSE, dQ, dK, dV of the vector path (fp32 and bf16), then of each bf16
// product path the CPU has (AVX512-BF16, AMX), over causal and packed masks, D = 64 / 80 / 128,
// S = 100 / 1000, GQA, 2 threads; printed also is the vector path's own hash. A
// kernel change that should not move a bit (a refactoring, a reordering of independent work) leaves the hash
// as it was; run it before and after, on the same machine and build flags (the SIMD target changes the bits).
//   build/bench/cpattn_kernel_bits [--verbose]
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cpattn/flash.hpp"
#include "cpattn/sequence_layout.hpp"

namespace {

struct Fnv {
  std::uint64_t h = 1469598103934665603ull;
  void add(const void* data, std::size_t bytes) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
  }
  void add(const cpattn::Tensor& t) { add(t.raw(), t.nbytes()); }
  void add(const std::vector<float>& v) { add(v.data(), v.size() * sizeof(float)); }
};

}  // namespace

int main(int argc, char** argv) {
  using namespace cpattn;
  const bool verbose = argc > 1 && std::strcmp(argv[1], "--verbose") == 0;
  Fnv all, vector_only;
  std::string product_paths;
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (Bf16Path path : {Bf16Path::vector, Bf16Path::avx512_bf16, Bf16Path::amx}) {
      FlashConfig config;
      config.threads = 2;
      config.allow_amx = path == Bf16Path::amx;
      config.allow_avx512_bf16 = path == Bf16Path::avx512_bf16;
      if (path != Bf16Path::vector && (dtype != DType::bf16 || flash_bf16_path(config) != path)) continue;
      if (path != Bf16Path::vector)
        product_paths += std::string(product_paths.empty() ? "" : ", ") + to_string(path);
      for (std::int64_t S : {100, 1000}) {
        for (std::int64_t D : {64, 80, 128}) {
          for (int mask_kind = 0; mask_kind < 3; ++mask_kind) {  // causal, causal + packed, full
            const std::int64_t B = 2, Hq = 4, Hkv = 2;
            const bool causal = mask_kind < 2;
            const Tensor q = random_normal(dtype, {B, S, Hq, D}, 11);
            const Tensor k = random_normal(dtype, {B, S, Hkv, D}, 12);
            const Tensor v = random_normal(dtype, {B, S, Hkv, D}, 13);
            const Tensor d_out = random_normal(dtype, {B, S, Hq, D}, 14);
            const auto pos = natural_positions(B, S);
            const auto seg = mask_kind == 1 ? segment_ids_from_lengths(B, {S * 3 / 5, S - S * 3 / 5})
                                            : std::vector<std::int32_t>{};
            const AttentionMask mask{pos, pos, seg, seg, causal};
            const double scale = 1.0 / std::sqrt(static_cast<double>(D));
            const auto fwd = flash_attention_forward(q, k, v, mask, scale, config);
            const auto bwd =
                flash_attention_backward(q, k, v, fwd.o, fwd.lse, d_out, mask, scale, config, dtype);
            Fnv one;
            std::vector<Fnv*> hashes = {&one, &all};
            if (path == Bf16Path::vector) hashes.push_back(&vector_only);
            for (Fnv* f : hashes) {
              f->add(fwd.o);
              f->add(fwd.lse);
              f->add(bwd.dq);
              f->add(bwd.dk);
              f->add(bwd.dv);
            }
            if (verbose) {
              std::printf("%s %s S=%lld D=%lld mask=%d %016llx\n", to_string(dtype), to_string(path),
                          static_cast<long long>(S), static_cast<long long>(D), mask_kind,
                          static_cast<unsigned long long>(one.h));
            }
          }
        }
      }
    }
  }
  std::printf(
      "kernel bits: %016llx (vector target %s; the vector path alone %016llx; bf16 product paths: %s)\n",
      static_cast<unsigned long long>(all.h), flash_vector_target().c_str(),
      static_cast<unsigned long long>(vector_only.h), product_paths.empty() ? "none" : product_paths.c_str());
  return 0;
}
