#pragma once
// Whole arrays of float32 <-> float16 / bfloat16 (DDP's wire compression): the same values as the
// scalar functions of half.h (round to nearest even), vectorized. NaNs stay NaNs (a float16 NaN's
// payload may differ from float_to_half's canonical one).

#include <cstddef>
#include <cstdint>

namespace cohort {

void floats_to_bf16(const float* src, uint16_t* dst, size_t n);
void bf16_to_floats(const uint16_t* src, float* dst, size_t n);
void floats_to_half(const float* src, uint16_t* dst, size_t n);
void half_to_floats(const uint16_t* src, float* dst, size_t n);

}  // namespace cohort
