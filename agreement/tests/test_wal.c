/* test_wal.c - unit tests of the durable state's record format (wal.c): CRC32C, framing,
 * replay of whole records in order, a torn tail cut at every byte, a bit flip at every bit of
 * a record, a file reused by a later epoch, and the bounds-checked body reader. Recovery of
 * a whole replica from its files is tested with real processes (tests/test_agreed_durable.py). */
#include <stdlib.h>

#include "testutil.h"
#include "wal.h"

typedef struct {
    uint32_t n;
    uint8_t type[64];
    uint32_t len[64];
    uint8_t first[64]; /* first body byte, 0 for an empty body */
} seen;

static int collect(void *ctx, uint8_t type, const uint8_t *body, uint32_t len)
{
    seen *s = ctx;
    if (s->n < 64) {
        s->type[s->n] = type;
        s->len[s->n] = len;
        s->first[s->n] = len ? body[0] : 0;
    }
    s->n++;
    return 0;
}

static int refuse_third(void *ctx, uint8_t type, const uint8_t *body, uint32_t len)
{
    seen *s = ctx;
    collect(ctx, type, body, len);
    return s->n == 3 ? ZZ_WAL_CORRUPT : 0;
}

/* Record k: type 1 + k % 4, a body of k * 7 bytes valued k. Returns each record's end. */
static void build(zz_buf *b, int count, uint32_t epoch, size_t *ends)
{
    for (int k = 0; k < count; k++) {
        size_t st = zz_wal_begin(b, (uint8_t)(1 + k % 4), epoch);
        for (int i = 0; i < k * 7; i++)
            zz_put_u8(b, (uint8_t)k);
        zz_wal_end(b, st);
        ends[k] = b->len;
    }
}

int main(void)
{
    tctx t = {0};
    enum { N = 6 };
    size_t ends[N];
    int tail;
    uint32_t epoch;

    t_begin(&t, "CRC32C check value");
    CHECK(&t, zz_crc32c(0, "123456789", 9) == 0xE3069283u);
    CHECK(&t, zz_crc32c(0, "", 0) == 0);
    /* incremental = whole */
    CHECK(&t, zz_crc32c(zz_crc32c(0, "1234", 4), "56789", 5) == 0xE3069283u);
    t_end(&t);

    t_begin(&t, "CRC32C: the instruction and the table agree at every length and alignment");
    {
        uint8_t buf[600];
        for (size_t i = 0; i < sizeof buf; i++)
            buf[i] = (uint8_t)(i * 131u + (i >> 3) * 7u + 1u);
        int same = 1;
        for (size_t off = 0; off < 9; off++)
            for (size_t n = 0; n + off <= sizeof buf; n++)
                if (zz_crc32c(0x1234567u, buf + off, n) !=
                    zz_crc32c_table(0x1234567u, buf + off, n))
                    same = 0;
        CHECK(&t, same);
        CHECK(&t, zz_crc32c_table(0, "123456789", 9) == 0xE3069283u);
    }
    t_end(&t);

    zz_buf b;
    zz_buf_init(&b);
    build(&b, N, 7, ends);

    t_begin(&t, "replay: every record, in order, with its type and body");
    seen s = {0};
    size_t v = zz_wal_scan(b.p, b.len, collect, &s, &tail, &epoch);
    CHECK(&t, v == b.len);
    CHECK(&t, tail == ZZ_WAL_CLEAN);
    CHECK(&t, epoch == 7);
    CHECK(&t, s.n == N);
    for (uint32_t k = 0; k < N && k < s.n; k++) {
        CHECK(&t, s.type[k] == 1 + k % 4);
        CHECK(&t, s.len[k] == k * 7);
        CHECK(&t, s.first[k] == (k ? k : 0));
    }
    t_end(&t);

    t_begin(&t, "the end mark after the last write is the end");
    zz_buf z;
    zz_buf_init(&z);
    zz_put_raw(&z, b.p, b.len);
    static const uint8_t zeros[64];
    zz_put_raw(&z, zeros, sizeof zeros);
    memset(&s, 0, sizeof s);
    v = zz_wal_scan(z.p, z.len, collect, &s, &tail, &epoch);
    CHECK(&t, v == b.len && tail == ZZ_WAL_CLEAN && s.n == N);
    t_end(&t);

    t_begin(&t, "a file of zeros (or nothing) is an empty log");
    v = zz_wal_scan(zeros, sizeof zeros, collect, &s, &tail, &epoch);
    CHECK(&t, v == 0 && tail == ZZ_WAL_CLEAN && epoch == 0);
    v = zz_wal_scan(zeros, 0, collect, &s, &tail, &epoch);
    CHECK(&t, v == 0 && tail == ZZ_WAL_CLEAN);
    t_end(&t);

    t_begin(&t, "torn tail: cut at every byte, the whole records before the cut replay");
    for (size_t cut = 0; cut <= b.len; cut++) {
        size_t whole = 0;
        int nwhole = 0;
        for (int k = 0; k < N; k++)
            if (ends[k] <= cut) {
                whole = ends[k];
                nwhole = k + 1;
            }
        /* followed by zeros, as a cut-short write into a zero-filled file leaves it */
        zz_buf c;
        zz_buf_init(&c);
        zz_put_raw(&c, b.p, cut);
        zz_put_raw(&c, zeros, sizeof zeros);
        memset(&s, 0, sizeof s);
        v = zz_wal_scan(c.p, c.len, collect, &s, &tail, &epoch);
        CHECK(&t, v == whole);
        CHECK(&t, (int)s.n == nwhole);
        /* a cut inside a record's length field reads as zeros or as a bad length; a cut
         * first record (no epoch known yet) is corrupt: nothing in the file is usable */
        if (nwhole > 0)
            CHECK(&t, tail == ZZ_WAL_CLEAN || tail == ZZ_WAL_TORN);
        else
            CHECK(&t, tail == ZZ_WAL_CLEAN || tail == ZZ_WAL_CORRUPT);
        if (cut == whole)
            CHECK(&t, tail == ZZ_WAL_CLEAN);
        if (cut >= whole + 4 && cut < b.len && nwhole > 0)
            CHECK(&t, tail == ZZ_WAL_TORN);
        /* and without the zeros: the data simply ends */
        v = zz_wal_scan(b.p, cut, NULL, NULL, &tail, &epoch);
        CHECK(&t, v == whole);
        if (cut == whole)
            CHECK(&t, tail == ZZ_WAL_CLEAN);
        else if (cut >= whole + 4) /* a record's length read whole: its rest is missing */
            CHECK(&t, tail == ZZ_WAL_TORN || (nwhole == 0 && tail == ZZ_WAL_CORRUPT));
        zz_buf_free(&c);
    }
    t_end(&t);

    t_begin(&t, "bit flip: in a middle record corrupt, in the last one a torn tail");
    for (int k = 1; k < N; k++) {
        size_t from = ends[k - 1], to = ends[k];
        for (size_t at = from; at < to; at++)
            for (int bit = 0; bit < 8; bit++) {
                zz_buf c;
                zz_buf_init(&c);
                zz_put_raw(&c, b.p, b.len);
                zz_put_raw(&c, zeros, sizeof zeros);
                c.p[at] ^= (uint8_t)(1u << bit);
                memset(&s, 0, sizeof s);
                v = zz_wal_scan(c.p, c.len, collect, &s, &tail, &epoch);
                CHECK(&t, v == from);          /* nothing from the damaged record on */
                CHECK(&t, s.n == (uint32_t)k);
                /* valid records of the epoch after it: corrupt; none: torn (or, for a
                 * length flipped to zero in the last record, the end) */
                if (k < N - 1)
                    CHECK(&t, tail == ZZ_WAL_CORRUPT);
                else
                    CHECK(&t, tail == ZZ_WAL_TORN || tail == ZZ_WAL_CLEAN);
                zz_buf_free(&c);
            }
    }
    t_end(&t);

    t_begin(&t, "a length flipped to zero is damage, not the end mark");
    {
        zz_buf c;
        zz_buf_init(&c);
        zz_put_raw(&c, b.p, b.len);
        zz_put_raw(&c, zeros, sizeof zeros);
        memset(c.p + ends[1], 0, 4); /* record 2's length */
        memset(&s, 0, sizeof s);
        v = zz_wal_scan(c.p, c.len, collect, &s, &tail, &epoch);
        CHECK(&t, v == ends[1] && s.n == 2 && tail == ZZ_WAL_CORRUPT);
        zz_buf_free(&c);
    }
    t_end(&t);

    t_begin(&t, "a bad first record: corrupt, nothing replays");
    {
        zz_buf c;
        zz_buf_init(&c);
        zz_put_raw(&c, b.p, b.len);
        c.p[5] ^= 0x10; /* the first record's checksum */
        memset(&s, 0, sizeof s);
        v = zz_wal_scan(c.p, c.len, collect, &s, &tail, &epoch);
        CHECK(&t, v == 0 && s.n == 0 && tail == ZZ_WAL_CORRUPT);
        zz_buf_free(&c);
    }
    t_end(&t);

    t_begin(&t, "a reused file: a newer epoch's log ends where an older one's records begin");
    {
        zz_buf old, c;
        zz_buf_init(&old);
        zz_buf_init(&c);
        size_t oends[N];
        build(&old, N, 6, oends);
        build(&old, N, 6, oends); /* a longer old log */
        zz_put_raw(&c, old.p, old.len);
        /* the new epoch's first three records overwrite the start, as a rewrite does */
        memcpy(c.p, b.p, ends[2]);
        memset(&s, 0, sizeof s);
        v = zz_wal_scan(c.p, c.len, collect, &s, &tail, &epoch);
        CHECK(&t, v <= ends[2]);
        CHECK(&t, epoch == 7);
        /* the old bytes after ends[2] are mid-record of epoch 6: never replayed */
        CHECK(&t, s.n <= 3);
        /* with the terminator a write leaves, it is a clean end exactly there */
        memset(c.p + ends[2], 0, ZZ_WAL_HDR);
        memset(&s, 0, sizeof s);
        v = zz_wal_scan(c.p, c.len, collect, &s, &tail, &epoch);
        CHECK(&t, v == ends[2] && s.n == 3 && tail == ZZ_WAL_CLEAN);
        /* an older epoch's whole record right after the log: the end, not damage */
        zz_buf d;
        zz_buf_init(&d);
        zz_put_raw(&d, b.p, ends[2]);
        size_t e6[N];
        build(&d, 2, 6, e6);
        v = zz_wal_scan(d.p, d.len, collect, &s, &tail, &epoch);
        CHECK(&t, v == ends[2] && tail == ZZ_WAL_CLEAN);
        zz_buf_free(&d);
        zz_buf_free(&old);
        zz_buf_free(&c);
    }
    t_end(&t);

    t_begin(&t, "a record the applier refuses stops the scan there");
    memset(&s, 0, sizeof s);
    v = zz_wal_scan(b.p, b.len, refuse_third, &s, &tail, &epoch);
    CHECK(&t, v == ends[1] && tail == ZZ_WAL_CORRUPT && s.n == 3);
    t_end(&t);

    t_begin(&t, "a length over the limit is corrupt, not a read past the buffer");
    {
        zz_buf c;
        zz_buf_init(&c);
        zz_put_raw(&c, b.p, b.len);
        c.p[ends[1]] = 0xFF; /* record 2's length: > ZZ_WAL_MAX_RECORD */
        v = zz_wal_scan(c.p, c.len, NULL, NULL, &tail, &epoch);
        CHECK(&t, v == ends[1] && tail == ZZ_WAL_CORRUPT);
        zz_buf_free(&c);
    }
    t_end(&t);

    t_begin(&t, "an oversized record is never framed");
    {
        zz_buf c;
        zz_buf_init(&c);
        size_t st = zz_wal_begin(&c, ZZ_WAL_SLOT, 1);
        uint8_t *big = calloc(1, ZZ_WAL_MAX_RECORD);
        CHECK(&t, big != NULL);
        if (big)
            zz_put_raw(&c, big, ZZ_WAL_MAX_RECORD);
        zz_wal_end(&c, st);
        CHECK(&t, c.oom == 1);
        free(big);
        zz_buf_free(&c);
    }
    t_end(&t);

    t_begin(&t, "body reader: bounds checked, sticky");
    {
        const uint8_t body[] = {0, 0, 0, 2, 0xAB, 0xCD, 0, 0, 0, 9, 1};
        zz_wal_rd d = {body, sizeof body, 0, 0};
        uint32_t n;
        const uint8_t *p = zz_wal_bytes(&d, &n);
        CHECK(&t, p && n == 2 && p[0] == 0xAB && !d.bad);
        p = zz_wal_bytes(&d, &n); /* claims 9 bytes, 1 left */
        CHECK(&t, p == NULL && n == 0 && d.bad);
        CHECK(&t, zz_wal_u8(&d) == 0 && d.bad); /* sticky */
        zz_wal_rd e = {body, 3, 0, 0};
        CHECK(&t, zz_wal_u32(&e) == 0 && e.bad);
        zz_wal_rd f = {body, sizeof body, 0, 0};
        CHECK(&t, zz_wal_u64(&f) == 0x00000002ABCD0000ull && !f.bad);
        CHECK(&t, zz_wal_u16(&f) == 0x0009 && zz_wal_u8(&f) == 1 && !f.bad && f.off == f.len);
    }
    t_end(&t);

    zz_buf_free(&z);
    zz_buf_free(&b);
    return t_summary(&t);
}
