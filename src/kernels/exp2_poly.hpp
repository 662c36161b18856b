// The kernels' exp2 polynomial, shared by its Highway form (flash_simd.hpp exp2_approx) and its AVX-512 one
// (exp2_avx512.hpp), which must give the same bits; the bf16 product paths' shorter one for probabilities;
// and log2(e), since the scores are base 2.
#pragma once

namespace cpattn::kernels {

inline constexpr float kLog2e = 1.4426950408889634f;
// log2(e) in double: the scale * log2(e) folded into Q is formed in double, then rounded once to float.
inline constexpr double kLog2eDouble = 1.4426950408889634;
// 2^f for f in [-0.5, 0.5]: the degree-6 minimax polynomial of the kernels' exp2 (relative error 1.9e-9
// before float rounding; Remez exchange on the relative error), coefficients of f^6 down to f^0, for Horner.
inline constexpr float kExp2Poly[7] = {1.5345812004000534e-04f,
                                       1.3399931219124377e-03f,
                                       9.618488957102513e-03f,
                                       5.5503287769656406e-02f,
                                       2.4022646890634405e-01f,
                                       6.931472057372673e-01f,
                                       1.0f};

// 2^f for f in [-0.5, 0.5] to bf16's needs: degree 3, exactly 1 at 0, relative error 1.01e-4 (Lawson
// iterations on the relative error with f^0 fixed at 1), 1/19 of bf16's half-ulp (2^-9). The bf16 product
// paths round P to bf16 before anything reads it; their statistics' rescale factors keep kExp2Poly.
inline constexpr float kExp2PolyBf16[4] = {5.500892922282219e-02f, 2.4221095442771912e-01f,
                                           6.932829022407532e-01f, 1.0f};

}  // namespace cpattn::kernels
