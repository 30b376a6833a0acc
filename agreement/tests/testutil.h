/* testutil.h - a minimal test harness for the agreement unit tests (no framework needed).
 * A test case is a named group of checks; the runner in the Makefile sums the final summary. */
#ifndef ZZ_TESTUTIL_H
#define ZZ_TESTUTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* All counters live in a context passed around explicitly (no global state). */
typedef struct {
    int passed;
    int failed;
    int case_failures; /* checks failed in the current case */
    const char *name;  /* current case */
} tctx;

static inline void t_begin(tctx *t, const char *name)
{
    t->name = name;
    t->case_failures = 0;
}

static inline void t_end(tctx *t)
{
    if (t->case_failures) {
        t->failed++;
        printf("FAIL %s\n", t->name);
    } else {
        t->passed++;
    }
}

static inline int t_check(tctx *t, int ok, const char *expr, const char *file, int line)
{
    if (!ok) {
        t->case_failures++;
        if (t->case_failures <= 8) /* a truncation loop must not flood the log */
            printf("  %s:%d: [%s] check failed: %s\n", file, line, t->name, expr);
    }
    return ok;
}

#define CHECK(t, cond) t_check((t), (cond) ? 1 : 0, #cond, __FILE__, __LINE__)

static inline int t_summary(const tctx *t)
{
    printf("%d passed, %d failed\n", t->passed, t->failed);
    return t->failed ? 1 : 0;
}

/* Hex helpers. Returns the number of bytes decoded, or -1 on bad hex or overflow. */
static inline int t_hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

static inline long t_unhex(const char *s, size_t slen, uint8_t *out, size_t cap)
{
    if (slen % 2 || slen / 2 > cap)
        return -1;
    for (size_t i = 0; i < slen / 2; i++) {
        int hi = t_hexval(s[2 * i]), lo = t_hexval(s[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return -1;
        out[i] = (uint8_t)(hi << 4 | lo);
    }
    return (long)(slen / 2);
}

static inline void t_hex(const uint8_t *p, size_t n, char *out)
{
    static const char hx[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = hx[p[i] >> 4];
        out[2 * i + 1] = hx[p[i] & 15];
    }
    out[2 * n] = '\0';
}

#endif
