"""GGML tensor blocks (as stored in GGUF files) decoded into MLX arrays.

Two kinds of block formats:

- **Affine on 32-element groups** (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K): every group of 32
  values is ``scale * code + bias`` with an unsigned ``bits``-bit code, which is exactly MLX's
  affine quantization with ``group_size=32``. ``affine_triple`` returns MLX's
  (weight, scales, biases) with the codes packed as ``mx.quantize`` packs them (a little-endian
  bit stream in uint32 words), so ``mx.dequantize`` of the triple reproduces the GGML values
  bit for bit (every product of a scale and a code is exact in float32).
- **16-element sub-blocks** (Q2_K, Q3_K, Q6_K): two scales in one 32-group, which MLX's affine
  layout cannot hold; ``dequantize_sub_blocks`` returns their float32 values (exact).

Block layouts follow ggml's reference C code (``ggml/src/ggml-quants.c``,
``dequantize_row_*``; https://github.com/ggml-org/llama.cpp); ``gguf.quants.dequantize`` is the
test reference. Every function takes the raw bytes of whole rows, shape [R, bytes per row],
uint8, and the row length C (values per row).
"""

from __future__ import annotations

import mlx.core as mx
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

GROUP_SIZE = 32
"""MLX group size of every affine format."""

AFFINE_BITS = {T.Q4_0: 4, T.Q4_1: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q8_0: 8, T.Q4_K: 4, T.Q5_K: 5}
"""Formats that load as MLX quantized arrays, and their bits."""

SUB_BLOCK_TYPES = (T.Q2_K, T.Q3_K, T.Q6_K)
"""Formats with 16-element sub-blocks: dequantized (or re-quantized to 8 bits) on load."""

FLOAT_TYPES = (T.F32, T.F16, T.BF16)
"""Plain float formats, loaded as they are."""

# Legacy formats' scales and biases fit float16 exactly (d is float16 and the bias a power-of-two
# multiple of it); K-quant ones are products of a float16 and a 6-bit integer and need float32.
_FLOAT16_SCALES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)


def affine_triple(raw: mx.array, kind: T, cols: int) -> tuple[mx.array, mx.array, mx.array]:
    """An affine 32-group format as MLX quantized (weight, scales, biases).

    Args:
        raw (mx.array): Row bytes, shape [R, bytes per row], uint8.
        kind (GGMLQuantizationType): One of ``AFFINE_BITS``.
        cols (int): C, values per row (a multiple of the format's block size).

    Returns:
        tuple[mx.array, mx.array, mx.array]: weight [R, C * bits / 32] uint32, scales and biases
        [R, C / 32] (float16 for the legacy formats when exact, else float32), such that
        ``mx.dequantize(weight, scales, biases, group_size=32, bits=bits)`` equals the stored values.

    Raises:
        KeyError: ``kind`` is not an affine 32-group format.
    """
    codes, scales, biases = _DECODERS[kind](_blocks(raw, kind, cols))  # [R, n, 32*k], [R, n, k]
    rows = raw.shape[0]
    codes = codes.reshape(rows, cols)
    scales, biases = scales.reshape(rows, -1), biases.reshape(rows, -1)  # [R, C/32]
    if kind in _FLOAT16_SCALES:
        scales, biases = _narrow(scales), _narrow(biases)
    return pack(codes, AFFINE_BITS[kind]), scales, biases


def dequantize_affine(raw: mx.array, kind: T, cols: int) -> mx.array:
    """An affine 32-group format as float32 values, without packing (``scale * code + bias``).

    Args:
        raw (mx.array): Row bytes, shape [R, bytes per row], uint8.
        kind (GGMLQuantizationType): One of ``AFFINE_BITS``.
        cols (int): C, values per row.

    Returns:
        mx.array: Values, shape [R, C], float32; the same as ``mx.dequantize`` of ``affine_triple``.
    """
    codes, scales, biases = _DECODERS[kind](_blocks(raw, kind, cols))
    rows = raw.shape[0]
    codes = codes.reshape(rows, -1, GROUP_SIZE).astype(mx.float32)  # [R, C/32, 32]
    values = codes * scales.reshape(rows, -1, 1) + biases.reshape(rows, -1, 1)
    return values.reshape(rows, cols)


def dequantize_sub_blocks(raw: mx.array, kind: T, cols: int) -> mx.array:
    """A 16-element sub-block format (Q2_K, Q3_K, Q6_K) as float32 values.

    Args:
        raw (mx.array): Row bytes, shape [R, bytes per row], uint8.
        kind (GGMLQuantizationType): One of ``SUB_BLOCK_TYPES``.
        cols (int): C, values per row (a multiple of 256).

    Returns:
        mx.array: Values, shape [R, C], float32 (exact: each is a float16 times two small integers).

    Raises:
        KeyError: ``kind`` is not a sub-block format.
    """
    blocks = _blocks(raw, kind, cols)  # [R, n, bytes per block]
    scale, codes, bias = _SUB_BLOCK_DECODERS[kind](blocks)  # [R, n, 16, 1] and [R, n, 16, 16]
    values = scale * codes if bias is None else scale * codes - bias
    return values.reshape(raw.shape[0], cols)


def pack(codes: mx.array, bits: int) -> mx.array:
    """Pack unsigned codes the way ``mx.quantize`` does: a little-endian bit stream per row.

    Args:
        codes (mx.array): Codes in [0, 2**bits), shape [R, C], any integer dtype; C * bits must be a
            multiple of 32.
        bits (int): Bits per code, 2 to 8.

    Returns:
        mx.array: Shape [R, C * bits / 32], uint32.
    """
    rows, cols = codes.shape
    codes = codes.astype(mx.uint32)
    if 32 % bits == 0:  # whole codes per word: shift each into place
        per_word = 32 // bits
        shifts = mx.arange(per_word, dtype=mx.uint32) * bits
        words = codes.reshape(rows, -1, per_word) << shifts  # [R, C*bits/32, 32/bits]
        return _sum_bits(words)
    stream = (codes[..., None] >> mx.arange(bits, dtype=mx.uint32)) & 1  # [R, C, bits]
    stream = stream.reshape(rows, -1, 32) << mx.arange(32, dtype=mx.uint32)  # [R, C*bits/32, 32]
    return _sum_bits(stream)


def _sum_bits(parts: mx.array) -> mx.array:
    """OR of disjoint bit fields along the last axis (a sum, since no two overlap)."""
    return parts.sum(axis=-1).astype(mx.uint32)


def _blocks(raw: mx.array, kind: T, cols: int) -> mx.array:
    block, nbytes = GGML_QUANT_SIZES[kind]
    return raw.reshape(raw.shape[0], cols // block, nbytes)  # [R, n, bytes per block]


def _f16(x: mx.array) -> mx.array:
    """Little-endian float16 fields [..., 2] uint8 as float32 [..., 1]."""
    return mx.view(x, mx.float16).astype(mx.float32)


def _u32(x: mx.array) -> mx.array:
    """Little-endian uint32 fields [..., 4] uint8 as [..., 1] uint32."""
    return mx.view(x, mx.uint32)


def _narrow(x: mx.array) -> mx.array:
    """float16 when that loses nothing (finite, representable), else float32."""
    half = x.astype(mx.float16)
    return half if mx.array_equal(half.astype(mx.float32), x).item() else x


def _nibbles(qs: mx.array) -> mx.array:
    """Bytes [..., 16] to 32 codes: low nibbles are values 0-15, high nibbles 16-31."""
    return mx.concatenate([qs & 15, qs >> 4], axis=-1).astype(mx.uint32)


def _high_bits(qh: mx.array) -> mx.array:
    """A uint32 field [..., 1] to its 32 bits [..., 32]: bit j is the fifth bit of value j."""
    return (qh >> mx.arange(32, dtype=mx.uint32)) & 1


def _q4_0(b):  # d: f16, qs[16]; x = d * (q - 8)
    d = _f16(b[..., 0:2])
    return _nibbles(b[..., 2:18]), d, -8 * d


def _q4_1(b):  # d, m: f16, qs[16]; x = d * q + m
    return _nibbles(b[..., 4:20]), _f16(b[..., 0:2]), _f16(b[..., 2:4])


def _q5_0(b):  # d: f16, qh: u32, qs[16]; x = d * (q - 16)
    d = _f16(b[..., 0:2])
    return _nibbles(b[..., 6:22]) | (_high_bits(_u32(b[..., 2:6])) << 4), d, -16 * d


def _q5_1(b):  # d, m: f16, qh: u32, qs[16]; x = d * q + m
    codes = _nibbles(b[..., 8:24]) | (_high_bits(_u32(b[..., 4:8])) << 4)
    return codes, _f16(b[..., 0:2]), _f16(b[..., 2:4])


def _q8_0(b):  # d: f16, qs: int8[32]; x = d * q, stored here as d * (q + 128) - 128 d
    d = _f16(b[..., 0:2])
    codes = (mx.view(b[..., 2:34], mx.int8).astype(mx.int32) + 128).astype(mx.uint32)
    return codes, d, -128 * d


def _k_scales(s: mx.array) -> tuple[mx.array, mx.array]:
    """Q4_K/Q5_K's 12 scale bytes to eight 6-bit scales and mins ([..., 8] each; ggml's
    ``get_scale_min_k4``): bytes 0-3 and 4-7 hold scales and mins 0-3 in their low 6 bits; bytes
    8-11 hold the low 4 bits of scales/mins 4-7, whose top 2 bits are bytes 0-7's top bits."""
    s = s.astype(mx.uint32)
    low, mid, top = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scales = mx.concatenate([low & 63, (top & 15) | ((low >> 6) << 4)], axis=-1)
    mins = mx.concatenate([mid & 63, (top >> 4) | ((mid >> 6) << 4)], axis=-1)
    return scales.astype(mx.float32), mins.astype(mx.float32)


def _k_nibbles(qs: mx.array) -> mx.array:
    """Q4_K/Q5_K's 128 code bytes to [..., 8, 32] low 4 bits: each 32 bytes give sub-block 2c in
    their low nibbles and sub-block 2c + 1 in their high nibbles."""
    qs = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return ((qs >> mx.array([[0], [4]], dtype=mx.uint8)) & 15).reshape(*qs.shape[:-3], 8, 32)


def _q4_k(b):  # d, dmin: f16, scales[12], qs[128]; x = d * sc * q - dmin * m per 32 values
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _k_scales(b[..., 4:16])
    codes = _k_nibbles(b[..., 16:144]).astype(mx.uint32)  # [R, n, 8, 32]
    return codes.reshape(*b.shape[:-1], 256), d * sc, -(dmin * m)


def _q5_k(b):  # d, dmin, scales[12], qh[32], qs[128]; sub-block k's fifth bits are bit k of qh
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _k_scales(b[..., 4:16])
    qh = b[..., None, 16:48] >> mx.arange(8, dtype=mx.uint8)[:, None]  # [R, n, 8, 32]
    codes = _k_nibbles(b[..., 48:176]).astype(mx.uint32) | ((qh & 1).astype(mx.uint32) << 4)
    return codes.reshape(*b.shape[:-1], 256), d * sc, -(dmin * m)


_SHIFTS = mx.array([[0], [2], [4], [6]], dtype=mx.uint8)


def _two_bit_planes(q: mx.array) -> mx.array:
    """32 code bytes per 128 values [..., 2, 32] to [..., 16, 16] 2-bit codes: value
    128 h + 32 j + l is bits 2j..2j+1 of byte l of half h (Q2_K, Q3_K)."""
    planes = (q[..., None, :] >> _SHIFTS) & 3  # [R, n, 2, 4, 32]
    return planes.reshape(*q.shape[:-2], 16, 16)


def _q2_k(b):  # scales[16] (low 4 bits scale, high 4 bits min), qs[64], d, dmin: f16
    d, dmin = _f16(b[..., 80:82])[..., None], _f16(b[..., 82:84])[..., None]
    s = b[..., 0:16, None]  # [R, n, 16, 1]
    codes = _two_bit_planes(b[..., 16:80].reshape(*b.shape[:-1], 2, 32)).astype(mx.float32)
    return d * (s & 15).astype(mx.float32), codes, dmin * (s >> 4).astype(mx.float32)


def _q3_scales(s: mx.array) -> mx.array:
    """Q3_K's 12 scale bytes to sixteen 6-bit scales minus 32, [..., 16] float32: low 4 bits from
    the nibbles of bytes 0-7 (low nibbles first), top 2 bits from the bit pairs of bytes 8-11."""
    s = s.astype(mx.int32)
    low = mx.concatenate([s[..., 0:8] & 15, s[..., 0:8] >> 4], axis=-1)  # [.., 16]
    top = (s[..., None, 8:12] >> mx.array([[0], [2], [4], [6]])) & 3  # [.., 4, 4]
    return ((low | (top.reshape(*s.shape[:-1], 16) << 4)) - 32).astype(mx.float32)


def _q3_k(b):  # hmask[32], qs[64], scales[12], d: f16; x = d * sc * (q2 - 4 * (1 - hbit))
    d = _f16(b[..., 108:110])[..., None]
    scales = _q3_scales(b[..., 96:108])[..., None]  # [R, n, 16, 1]
    low = _two_bit_planes(b[..., 32:96].reshape(*b.shape[:-1], 2, 32)).astype(mx.int32)
    hmask = b[..., None, 0:32] >> mx.arange(8, dtype=mx.uint8)[:, None]  # [R, n, 8, 32]: bit 4h + j
    high = (hmask & 1).reshape(*b.shape[:-1], 16, 16).astype(mx.int32)
    return d * scales, (low - 4 * (1 - high)).astype(mx.float32), None


def _q6_k(b):  # ql[128], qh[64], scales int8[16], d: f16; x = d * sc * (q - 32)
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(*lead, 2, 1, 64) >> mx.array([[0], [4]], dtype=mx.uint8)
    ql = (ql & 15).reshape(*lead, 2, 4, 32)  # half h, quarter k: ql byte (32 k + l) % 64, nibble k // 2
    qh = (b[..., 128:192].reshape(*lead, 2, 1, 32) >> _SHIFTS) & 3  # [R, n, 2, 4, 32]
    codes = (ql.astype(mx.int32) | (qh.astype(mx.int32) << 4)) - 32
    scales = mx.view(b[..., 192:208], mx.int8).astype(mx.float32)[..., None]  # [R, n, 16, 1]
    d = _f16(b[..., 208:210])[..., None]
    return d * scales, codes.reshape(*lead, 16, 16).astype(mx.float32), None


_DECODERS = {
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q8_0: _q8_0,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
}
_SUB_BLOCK_DECODERS = {T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q6_K: _q6_k}
