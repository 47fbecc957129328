/* CRC32C (Castagnoli), as used by Kafka RecordBatch v2 and the .kfs footer.
 * Uses the SSE4.2 crc32 instruction when the CPU has it (three interleaved
 * streams to hide its latency), otherwise a slicing-by-8 table. */
#ifndef KAFSCALE_CRC32C_IMPL_H
#define KAFSCALE_CRC32C_IMPL_H
#include <stdint.h>
#include <stddef.h>
#include <string.h>

static uint32_t ks_crc_table[8][256];
static int ks_crc_ready = 0;
static int ks_crc_hw = 0;
#define KS_CRC_BLOCK 8192  /* bytes per stream per round of the 3-way loop */
static uint32_t ks_shift_block[32];  /* operator: advance over KS_CRC_BLOCK zero bytes */

static void ks_crc32c_init(void) {
    if (ks_crc_ready) return;
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        ks_crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = ks_crc_table[0][i];
        for (int t = 1; t < 8; t++) {
            c = ks_crc_table[0][c & 0xff] ^ (c >> 8);
            ks_crc_table[t][i] = c;
        }
    }
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    ks_crc_hw = __builtin_cpu_supports("sse4.2");
#endif
    ks_crc_ready = 1;
}

static uint32_t ks_gf2_times(const uint32_t *m, uint32_t v) {
    uint32_t s = 0;
    while (v) { if (v & 1) s ^= *m; v >>= 1; m++; }
    return s;
}

static uint32_t ks_crc32c_sw(uint32_t crc, const uint8_t *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) { crc = ks_crc_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8); n--; }
    while (n >= 8) {
        uint64_t w; memcpy(&w, p, 8);
        w ^= crc;
        crc = ks_crc_table[7][w & 0xff] ^ ks_crc_table[6][(w >> 8) & 0xff] ^
              ks_crc_table[5][(w >> 16) & 0xff] ^ ks_crc_table[4][(w >> 24) & 0xff] ^
              ks_crc_table[3][(w >> 32) & 0xff] ^ ks_crc_table[2][(w >> 40) & 0xff] ^
              ks_crc_table[1][(w >> 48) & 0xff] ^ ks_crc_table[0][w >> 56];
        p += 8; n -= 8;
    }
    while (n--) crc = ks_crc_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return crc;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* Advance a raw CRC register over `len` zero bytes (zlib's crc32_combine
 * matrix method), so three independent streams can be merged. */
static uint32_t ks_crc_shift(uint32_t crc, size_t len) {
    uint32_t mat[32], sq[32];
    /* operator for one zero bit */
    mat[0] = 0x82F63B78u;
    uint32_t row = 1;
    for (int i = 1; i < 32; i++) { mat[i] = row; row <<= 1; }
    /* square to get 2 bits, 4 bits (mat now = 4 bits) */
    #define GF2_TIMES(m, v, out) do { uint32_t _v = (v), _s = 0; const uint32_t *_m = (m); \
        while (_v) { if (_v & 1) _s ^= *_m; _v >>= 1; _m++; } (out) = _s; } while (0)
    #define GF2_SQUARE(sqr, m) do { for (int _i = 0; _i < 32; _i++) GF2_TIMES(m, (m)[_i], (sqr)[_i]); } while (0)
    GF2_SQUARE(sq, mat);   /* 2 zero bits */
    GF2_SQUARE(mat, sq);   /* 4 zero bits */
    do {
        GF2_SQUARE(sq, mat);          /* 8 bits = 1 byte, then 4 bytes ... */
        if (len & 1) GF2_TIMES(sq, crc, crc);
        len >>= 1;
        if (!len) break;
        GF2_SQUARE(mat, sq);
        if (len & 1) GF2_TIMES(mat, crc, crc);
        len >>= 1;
    } while (len);
    #undef GF2_TIMES
    #undef GF2_SQUARE
    return crc;
}

__attribute__((target("sse4.2")))
static uint32_t ks_crc32c_hw(uint32_t crc, const uint8_t *p, size_t n) {
    uint64_t c0 = crc;
    while (n && ((uintptr_t)p & 7)) { c0 = __builtin_ia32_crc32qi((uint32_t)c0, *p++); n--; }
    const size_t block = KS_CRC_BLOCK;
    while (n >= 3 * block) {
        uint64_t c1 = 0, c2 = 0;
        const uint8_t *p1 = p + block, *p2 = p + 2 * block;
        for (size_t i = 0; i < block; i += 8) {
            uint64_t w0, w1, w2;
            memcpy(&w0, p + i, 8); memcpy(&w1, p1 + i, 8); memcpy(&w2, p2 + i, 8);
            c0 = __builtin_ia32_crc32di(c0, w0);
            c1 = __builtin_ia32_crc32di(c1, w1);
            c2 = __builtin_ia32_crc32di(c2, w2);
        }
        c0 = ks_gf2_times(ks_shift_block, (uint32_t)c0) ^ (uint32_t)c1;
        c0 = ks_gf2_times(ks_shift_block, (uint32_t)c0) ^ (uint32_t)c2;
        p += 3 * block; n -= 3 * block;
    }
    while (n >= 8) { uint64_t w; memcpy(&w, p, 8); c0 = __builtin_ia32_crc32di(c0, w); p += 8; n -= 8; }
    while (n--) c0 = __builtin_ia32_crc32qi((uint32_t)c0, *p++);
    return (uint32_t)c0;
}
#endif

static void ks_crc32c_setup(void) {
    if (ks_crc_ready) return;
    ks_crc32c_init();
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    for (int i = 0; i < 32; i++) ks_shift_block[i] = ks_crc_shift(1u << i, KS_CRC_BLOCK);
#endif
}

/* crc is the running value in "finalized" form (start with 0). */
static uint32_t ks_crc32c(uint32_t crc, const uint8_t *p, size_t n, int force_sw) {
    ks_crc32c_setup();
    crc = ~crc;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (ks_crc_hw && !force_sw) return ~ks_crc32c_hw(crc, p, n);
#endif
    return ~ks_crc32c_sw(crc, p, n);
}
#endif
