/* int4 weights times 8-bit activations (llama.cpp's Q4_1 x Q8_1 rule), in tiles of 16
 * weight rows: the layout and rule qmatmul.c (AVX2) and qmatmul_avx512.c (AVX-512 VNNI)
 * share. y [M, N] = x [M, K] @ W.T for W = (q - 8) * scale + zero in groups of 32 along K
 * (GGUF's Q4_0 / Q4_1 blocks, q in 0..15).
 *
 * x is quantized as for int8 weights (q8a8.h: per row and group of 32, d = max|x| / 127,
 * xq = x / d rounded). Since w = q * scale + c with c = zero - 8 * scale, a group's
 * product is
 *     scale * d * I + c * s,    I = sum(q * xq), exact in int32;  s = d * sum(xq)
 * and output (m, n) is computed in one vector lane, group after group:
 *     acc = fma(float(I), scale * d, acc);  acc = fma(c, s, acc)
 * with no sum across lanes. Each output's operations depend only on its own row of x and
 * weight row, in a fixed order, whatever the row count, the pass, the thread count or the
 * instruction set: a row of a k+1-row verify pass rounds as a one-row step does (what
 * lossless speculative decoding needs), and AVX2 and VNNI give the same bits.
 *
 * Layout (cpu_kernels.pack_q4 writes it): weight rows in tiles of 16 as int8's (q8a8.h; N
 * padded with zero rows to a multiple of 16), one block of Q4_BLOCK_BYTES (320) per tile t
 * and group g, at byte (t * G + g) * 320, G = K / 32. Its first 256 bytes: four chunks of
 * 64 bytes, chunk h byte 4 * i + b = q[16t + i][32g + 8h + b] (low nibble)
 * | q[16t + i][32g + 8h + 4 + b] << 4 (high nibble). A chunk's low nibbles are one
 * 16-lane vector of 4 weights per row (lane i: row 16t + i), its high nibbles the next 4,
 * so a group is 8 byte products per lane (vpdpbusd: each lane 4 weights times 4 bytes of
 * x, broadcast), summed into I before any float work. Then the 16 rows' scale and c as
 * float16 (32 bytes each): GGUF's Q4_0 / Q4_1 blocks hold float16 d and m (c = m for Q4_1,
 * -8 d for Q4_0), so a file's weights are kept exactly; quantizing a float weight rounds
 * its scale and minimum to float16 first (quant_linear.Int4Linear.from_weight).
 *
 * Why one block with float16 scales (session 42): the nibbles, scales and offsets were
 * three streams, the scales float32 (0.75 bytes a weight); a one-row step is bound by
 * reading them. One stream of 0.625 bytes a weight (Q4_1's own size): with q8a8.h's
 * blocks, whole SmolLM2 passes of 1-3 tokens ~0.8x the time (docs/quantization.md).
 *
 * Why tiles: the layout they replaced (GGUF's own blocks, one weight row after another) took
 * float32 x and dequantized each weight (a 16-entry table), then 2 FMAs per 32 weights
 * and row: a verify pass of k+1 rows was bound by float arithmetic (~1.15 ms per extra
 * row over SmolLM2's layers). Here a row's 32 weights of 16 outputs cost 8 integer
 * instructions and 4 float ones, and the weight bytes are unpacked once for all rows.
 */
#ifndef QD_Q4A8_H
#define QD_Q4A8_H

#include "q8a8.h"

#define Q4_TILE_BYTES (Q_TILE * GROUP / 2)       /* a tile's nibbles of one group */
#define Q4_SIDE_BYTES (Q_TILE * 2)               /* its 16 float16 scales (then as many offsets) */
#define Q4_BLOCK_BYTES (Q4_TILE_BYTES + 2 * Q4_SIDE_BYTES)

#endif
