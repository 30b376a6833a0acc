/* test_limits.c - the size invariant of docs/wire.md "Size limits": a batch encoding of at
 * most ZZ_MAX_BATCH_BYTES (and so any batch a replica accepts, batch_bytes <= that) fits
 * every message that carries it, with the largest authenticator the decoder admits; the
 * echo state of every client's largest result fits one FETCH-REPLY; the conf refuses a
 * max_request that cannot fit a batch alone. VIEW-CHANGE and NEW-VIEW carry digests only
 * (docs/wire.md), so their size does not depend on any batch. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "replica.h"
#include "testutil.h"
#include "wire.h"



static const uint8_t D1[ZZ_DIGEST_LEN] = {1};

/* A MAC vector of `count` entries (zero MACs: only the size matters here). */
static void put_macs(zz_buf *b, uint32_t count)
{
    zz_put_u16(b, (uint16_t)count);
    for (uint32_t i = 0; i < count; i++) {
        zz_put_u32(b, i);
        uint8_t mac[ZZ_MAC_LEN] = {0};
        zz_put_raw(b, mac, sizeof mac);
    }
}

/* The finished message [st, len) fits a frame and decodes. */
static int fits(zz_buf *b, size_t st, uint8_t type)
{
    if (b->oom || b->len - st > ZZ_MAX_MSG)
        return 0;
    zz_msg m;
    return zz_decode(b->p + st, b->len - st, &m) == ZZ_OK && m.type == type;
}

/* A batch encoding of exactly `len` bytes: nd_time, nd_seed, one request padding it out. */
static uint8_t *max_batch(uint32_t len)
{
    uint8_t *p = calloc(1, len);
    if (!p)
        return NULL;
    p[19] = 1;                                 /* count = 1 */
    uint32_t rl = len - ZZ_BATCH_HDR_LEN - 4;  /* the request's bytes */
    p[20] = (uint8_t)(rl >> 24);
    p[21] = (uint8_t)(rl >> 16);
    p[22] = (uint8_t)(rl >> 8);
    p[23] = (uint8_t)rl;
    return p;
}

static void test_batch_messages(tctx *t)
{
    const uint32_t B = ZZ_MAX_BATCH_BYTES;
    uint8_t *batch = max_batch(B);
    zz_buf b;
    zz_buf_init(&b);
    t_begin(t, "a batch of ZZ_MAX_BATCH_BYTES fits PRE-PREPARE, EXEC-COMMIT, FETCH-REPLY 1");
    if (!CHECK(t, batch != NULL)) {
        t_end(t);
        return;
    }
    size_t st = zz_enc_pre_prepare(&b, 1, 0, UINT32_MAX, UINT64_MAX, batch, B);
    zz_end_body(&b, st);
    put_macs(&b, ZZ_MAX_MACS);
    CHECK(t, fits(&b, st, ZZ_PRE_PREPARE));
    zz_buf_reset(&b);
    st = zz_enc_exec_commit(&b, 1, 0, UINT32_MAX, UINT64_MAX, D1, batch, B);
    zz_end_body(&b, st);
    put_macs(&b, ZZ_MAX_MACS);
    CHECK(t, fits(&b, st, ZZ_EXEC_COMMIT));
    zz_buf_reset(&b);
    st = zz_enc_fetch_reply(&b, 1, 0, ZZ_FETCH_BATCH, UINT64_MAX, D1, batch, B);
    zz_end_body(&b, st);
    put_macs(&b, ZZ_MAX_MACS);
    CHECK(t, fits(&b, st, ZZ_FETCH_REPLY));
    /* one byte more would not fit every carrier: the bound is tight enough to matter */
    CHECK(t, (uint64_t)ZZ_LOG_REPLY_SOFT + ZZ_MAX_BATCH_BYTES + ZZ_MSG_OVERHEAD_MAX <= ZZ_MAX_MSG);
    t_end(t);

    /* FETCH-REPLY kind 3 (checkpoint.c encode_log): entries are added while the data is at
     * most ZZ_LOG_REPLY_SOFT bytes, so the worst case is a log just at the soft cap plus
     * one batch of the maximum size. */
    t_begin(t, "the committed-log reply: soft cap plus one maximal batch fits a frame");
    zz_buf log;
    zz_buf_init(&log);
    zz_put_u64(&log, 0);
    zz_put_u32(&log, 2);
    uint32_t first = ZZ_LOG_REPLY_SOFT - (uint32_t)log.len - (8 + ZZ_DIGEST_LEN + 4);
    uint8_t *filler = max_batch(first);
    CHECK(t, filler != NULL);
    if (filler) {
        zz_put_u64(&log, 1);
        zz_put_raw(&log, D1, ZZ_DIGEST_LEN);
        zz_put_bytes(&log, filler, first);
        CHECK(t, log.len == ZZ_LOG_REPLY_SOFT); /* not over: encode_log adds one more */
        zz_put_u64(&log, 2);
        zz_put_raw(&log, D1, ZZ_DIGEST_LEN);
        zz_put_bytes(&log, batch, B);
        zz_buf_reset(&b);
        st = zz_enc_fetch_reply(&b, 1, 0, ZZ_FETCH_LOG, UINT64_MAX, D1, log.p,
                                (uint32_t)log.len);
        zz_end_body(&b, st);
        put_macs(&b, ZZ_MAX_MACS);
        CHECK(t, fits(&b, st, ZZ_FETCH_REPLY));
    }
    free(filler);
    zz_buf_free(&log);
    t_end(t);
    free(batch);
    zz_buf_free(&b);
}

/* The echo state encoding (checkpoint.c zz_encode_state) with every client at its largest
 * result (an op is shorter than its request, which zz_request_limit bounds). */
static void test_echo_state(tctx *t)
{
    static zz_conf c;
    static zz_replica r;
    memset(&c, 0, sizeof c);
    memset(&r, 0, sizeof r);
    c.max_request = ZZ_DEFAULT_MAX_REQUEST;
    c.batch_bytes = ZZ_DEFAULT_BATCH_BYTES;
    r.conf = &c;
    static const uint32_t counts[] = {1, 4, 16, 64, 1000, ZZ_MAX_PRINCIPALS - 64};
    t_begin(t, "echo: every client's largest result fits one state transfer");
    for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++) {
        c.nkeys = counts[k] + 4;
        for (uint32_t i = 0; i < c.nkeys; i++)
            c.keys[i].id = i < 4 ? i : ZZ_PRINCIPAL_CLIENT + i;
        uint32_t lim = zz_request_limit(&r);
        CHECK(t, lim <= c.max_request && lim + ZZ_BATCH_HDR_LEN + 4 <= c.batch_bytes);
        uint64_t state = 8 + ZZ_DIGEST_LEN + 4 + (uint64_t)counts[k] * (16 + lim);
        CHECK(t, state + ZZ_MSG_OVERHEAD_MAX <= ZZ_MAX_MSG);
        if (counts[k] <= 4)
            CHECK(t, lim == ZZ_DEFAULT_MAX_REQUEST); /* few clients: the configured one */
    }
    c.external_exec = 1; /* no results in the agreement state: only max_request binds */
    CHECK(t, zz_request_limit(&r) == ZZ_DEFAULT_MAX_REQUEST);
    t_end(t);
}

static int write_conf(const char *path, const char *extra)
{
    FILE *f = fopen(path, "w");
    if (!f)
        return -1;
    fprintf(f, "service 1\nid 0\ng 1\nlisten 127.0.0.1 1\nsecret /nonexistent\n"
               "public /nonexistent\npeer 0 127.0.0.1 1\npeer 1 127.0.0.1 2\n"
               "peer 2 127.0.0.1 3\npeer 3 127.0.0.1 4\n%s",
            extra);
    return fclose(f);
}

static void test_conf(tctx *t)
{
    char path[] = "/tmp/zz-test-limits-XXXXXX";
    int fd = mkstemp(path);
    static zz_conf c;
    char err[512];
    t_begin(t, "conf: defaults, and max_request must fit batch_bytes");
    if (!CHECK(t, fd >= 0)) {
        t_end(t);
        return;
    }
    close(fd);
    /* The files named by secret/public do not exist: a conf whose limits pass fails later,
     * at the keys, with the values already parsed. */
    CHECK(t, write_conf(path, "") == 0 && zz_conf_load(path, &c, err, sizeof err) < 0 &&
                 strstr(err, "secret"));
    CHECK(t, c.max_request == ZZ_DEFAULT_MAX_REQUEST && c.batch_bytes == ZZ_DEFAULT_BATCH_BYTES);
    CHECK(t, c.max_conns > 0 && c.max_conns_per_source > 0 && c.frame_timeout_ms > 0 &&
                 c.unauth_timeout_ms > 0);
    zz_conf_free(&c);
    CHECK(t, write_conf(path, "max_request 65536\nbatch_bytes 65559\n") == 0 &&
                 zz_conf_load(path, &c, err, sizeof err) < 0 && strstr(err, "max_request"));
    zz_conf_free(&c);
    CHECK(t, write_conf(path, "max_request 65536\nbatch_bytes 65560\n") == 0 &&
                 zz_conf_load(path, &c, err, sizeof err) < 0 && strstr(err, "secret"));
    zz_conf_free(&c);
    CHECK(t, write_conf(path, "batch_bytes 16777216\n") == 0 &&
                 zz_conf_load(path, &c, err, sizeof err) < 0 && strstr(err, "batch_bytes"));
    zz_conf_free(&c);
    unlink(path);
    t_end(t);
}

int main(void)
{
    tctx t = {0};
    test_batch_messages(&t);
    test_echo_state(&t);
    test_conf(&t);
    printf("%d passed, %d failed\n", t.passed, t.failed);
    return t.failed ? 1 : 0;
}
