/* test_wire.c - unit tests of the wire codec: round trips of every type, malformed inputs,
 * authenticator tampering, and the shared vectors of tests/vectors/wire.txt (docs/wire.md). */
#include <stdlib.h>

#include "crypto.h"
#include "testutil.h"
#include "wire.h"
#include "wire_dump.h"

#ifndef ZZ_REPO_ROOT
#define ZZ_REPO_ROOT "."
#endif

#define NREPL 4
#define DUMP_CAP (1u << 20)

typedef struct {
    zz_mackey *mac[NREPL]; /* key shared by the test sender and receiver r */
    zz_mackey *wrong;
    zz_signkey *sk;
    zz_pubkey *pk;
    zz_pubkey *other_pk;
    uint32_t rcv[NREPL];
    char *dump; /* DUMP_CAP bytes of scratch */
} fixture;

static int fixture_init(fixture *f)
{
    uint8_t k[32];
    for (int r = 0; r < NREPL; r++) {
        memset(k, 0x10 + r, sizeof k);
        f->mac[r] = zz_mackey_new(k);
        f->rcv[r] = (uint32_t)r;
    }
    memset(k, 0xee, sizeof k);
    f->wrong = zz_mackey_new(k);
    memset(k, 0x42, sizeof k);
    f->sk = zz_signkey_new(k);
    uint8_t pub[32];
    zz_signkey_public(f->sk, pub);
    f->pk = zz_pubkey_new(pub);
    memset(k, 0x43, sizeof k);
    zz_signkey *o = zz_signkey_new(k);
    zz_signkey_public(o, pub);
    zz_signkey_free(o);
    f->other_pk = zz_pubkey_new(pub);
    f->dump = malloc(DUMP_CAP);
    return f->wrong && f->sk && f->pk && f->other_pk && f->dump && f->mac[NREPL - 1];
}

static void fixture_free(fixture *f)
{
    for (int r = 0; r < NREPL; r++)
        zz_mackey_free(f->mac[r]);
    zz_mackey_free(f->wrong);
    zz_signkey_free(f->sk);
    zz_pubkey_free(f->pk);
    zz_pubkey_free(f->other_pk);
    free(f->dump);
}

/* Add the authenticator the type needs. */
static void authenticate(fixture *f, zz_buf *b, size_t start)
{
    uint8_t kind = b->p[start + 4];
    if (kind == ZZ_AUTH_MAC)
        zz_auth_mac(b, start, f->rcv, f->mac, NREPL);
    else if (kind == ZZ_AUTH_SIG)
        zz_auth_sign(b, start, f->sk);
}

/* Everything a well-formed message must satisfy: decode, dump (against `want` if given),
 * re-encode byte for byte, authenticate for the right keys only; and every truncation and
 * every 1-byte extension must be rejected. */
static void check_valid(tctx *t, fixture *f, const uint8_t *msg, size_t len, const char *want)
{
    zz_msg m;
    CHECK(t, zz_decode(msg, len, &m) == ZZ_OK);
    if (t->case_failures)
        return;
    int n = zz_dump(&m, f->dump, DUMP_CAP);
    CHECK(t, n > 0);
    if (want && n > 0 && !CHECK(t, strcmp(f->dump, want) == 0))
        printf("  got  %s\n  want %s\n", f->dump, want);
    /* a too-small dump buffer fails cleanly instead of truncating */
    if (n > 0)
        CHECK(t, zz_dump(&m, f->dump, (size_t)n) == -1);

    zz_buf b;
    zz_buf_init(&b);
    zz_put_raw(&b, "prefix", 6); /* messages may be encoded mid-buffer */
    size_t s = zz_reencode(&b, &m);
    CHECK(t, s == 6 && !b.oom);
    CHECK(t, b.len - s == len && memcmp(b.p + s, msg, len) == 0);
    zz_buf_free(&b);

    if (m.auth_kind == ZZ_AUTH_MAC) {
        for (int r = 0; r < NREPL; r++) {
            CHECK(t, zz_verify_mac(&m, f->rcv[r], f->mac[r]) == 1);
            CHECK(t, zz_verify_mac(&m, f->rcv[r], f->wrong) == 0);
        }
        CHECK(t, zz_verify_mac(&m, 99, f->mac[0]) == 0); /* no entry for 99 */
        CHECK(t, zz_verify_sig(&m, f->pk) == 0);
    } else {
        CHECK(t, zz_verify_sig(&m, f->pk) == 1);
        CHECK(t, zz_verify_sig(&m, f->other_pk) == 0);
        CHECK(t, zz_verify_mac(&m, 0, f->mac[0]) == 0);
    }

    /* Tamper with every byte of the authenticated part: structure may or may not survive,
     * but authentication must never. (Bounded: the long messages only sample.) */
    uint8_t *c = malloc(len + 1);
    size_t step = len > 400 ? len / 97 : 1;
    for (size_t i = 0; i < m.authed_len; i += step) {
        memcpy(c, msg, len);
        c[i] ^= 0x01;
        zz_msg mt;
        if (zz_decode(c, len, &mt) != ZZ_OK)
            continue;
        if (mt.auth_kind == ZZ_AUTH_MAC)
            CHECK(t, zz_verify_mac(&mt, f->rcv[1], f->mac[1]) == 0);
        else
            CHECK(t, zz_verify_sig(&mt, f->pk) == 0);
    }
    /* ... and of the authenticator: a MAC entry or signature byte flipped fails. */
    memcpy(c, msg, len);
    c[len - 1] ^= 0x80;
    zz_msg mt;
    CHECK(t, zz_decode(c, len, &mt) == ZZ_OK);
    if (mt.auth_kind == ZZ_AUTH_MAC)
        CHECK(t, zz_verify_mac(&mt, f->rcv[NREPL - 1], f->mac[NREPL - 1]) == 0);
    else
        CHECK(t, zz_verify_sig(&mt, f->pk) == 0);

    /* Every strict prefix is rejected: short inside header/body, auth inside the
     * authenticator (its size no longer matches its kind). */
    for (size_t cut = 0; cut < len; cut++) {
        enum zz_err e = zz_decode(msg, cut, &mt);
        if (cut < m.authed_len)
            CHECK(t, e == ZZ_ERR_SHORT);
        else
            CHECK(t, e == ZZ_ERR_AUTH);
    }
    /* A trailing byte after the authenticator is rejected too. */
    memcpy(c, msg, len);
    c[len] = 0;
    CHECK(t, zz_decode(c, len + 1, &mt) == ZZ_ERR_AUTH);
    free(c);
}

static void finish(tctx *t, fixture *f, const char *name, zz_buf *b, size_t s, const char *want)
{
    t_begin(t, name);
    authenticate(f, b, s);
    CHECK(t, !b->oom);
    if (!b->oom)
        check_valid(t, f, b->p + s, b->len - s, want);
    zz_buf_reset(b);
    t_end(t);
}

static const uint8_t D1[32] = {0xab, 0x12, [31] = 0xff};

static void test_roundtrips(tctx *t, fixture *f)
{
    zz_buf b, batch, inner;
    zz_buf_init(&b);
    zz_buf_init(&batch);
    zz_buf_init(&inner);
    const char *d1 = "ab12000000000000000000000000000000000000000000000000000000000" "0ff";
    char want[1024];
    size_t s;

    s = zz_enc_request(&b, 1, ZZ_PRINCIPAL_CLIENT + 5, 1700000000000000001ull, ZZ_REQ_READONLY,
                       "hello", 5);
    finish(t, f, "roundtrip REQUEST", &b, s,
           "type=REQUEST service=1 sender=65541 timestamp=1700000000000000001 flags=1 "
           "op=68656c6c6f");
    s = zz_enc_request(&b, 1, ZZ_PRINCIPAL_CLIENT, 7, 0, NULL, 0);
    finish(t, f, "roundtrip REQUEST empty op", &b, s,
           "type=REQUEST service=1 sender=65536 timestamp=7 flags=0 op=-");
    s = zz_enc_reply(&b, 2, 3, 9, 44, ZZ_PRINCIPAL_CLIENT + 1, 0, "\x00\x01", 2);
    finish(t, f, "roundtrip REPLY", &b, s,
           "type=REPLY service=2 sender=3 view=9 timestamp=44 client=65537 flags=0 result=0001");

    /* PRE-PREPARE carrying two real MAC'd REQUESTs, and an empty batch. */
    size_t r1 = zz_enc_request(&inner, 1, ZZ_PRINCIPAL_CLIENT, 1, 0, "a", 1);
    zz_auth_mac(&inner, r1, f->rcv, f->mac, NREPL);
    size_t r1_len = inner.len;
    size_t r2 = zz_enc_request(&inner, 1, ZZ_PRINCIPAL_CLIENT + 1, 2, 0, "bc", 2);
    zz_auth_mac(&inner, r2, f->rcv, f->mac, 1);
    zz_put_u64(&batch, 1700000000123ull);
    zz_put_u64(&batch, 0x0123456789abcdefull);
    zz_put_u32(&batch, 2);
    zz_put_bytes(&batch, inner.p + r1, (uint32_t)r1_len);
    zz_put_bytes(&batch, inner.p + r2, (uint32_t)(inner.len - r2));
    s = zz_enc_pre_prepare(&b, 1, 0, 3, 17, batch.p, (uint32_t)batch.len);
    {
        char *h1 = malloc(2 * inner.len + 1), *h2 = malloc(2 * inner.len + 1);
        t_hex(inner.p + r1, r1_len, h1);
        t_hex(inner.p + r2, inner.len - r2, h2);
        snprintf(want, sizeof want,
                 "type=PRE-PREPARE service=1 sender=0 view=3 seq=17 nd_time=1700000000123 "
                 "nd_seed=81985529216486895 requests=[%s,%s]",
                 h1, h2);
        free(h1);
        free(h2);
    }
    /* The batch digest input must be exactly the batch encoding we built. */
    {
        zz_msg m;
        authenticate(f, &b, s);
        t_begin(t, "pre-prepare batch view and decode_batch");
        CHECK(t, zz_decode(b.p + s, b.len - s, &m) == ZZ_OK);
        CHECK(t, m.u.pre_prepare.batch.len == batch.len &&
                     memcmp(m.u.pre_prepare.batch.p, batch.p, batch.len) == 0);
        uint64_t nt, ns;
        zz_blist reqs;
        CHECK(t, zz_decode_batch(batch.p, batch.len, &nt, &ns, &reqs) == ZZ_OK);
        CHECK(t, nt == 1700000000123ull && ns == 0x0123456789abcdefull && reqs.count == 2);
        zz_blist_iter it;
        zz_bytes item;
        int k = 0;
        zz_blist_begin(&reqs, &it);
        while (zz_blist_next(&it, &item)) {
            zz_msg rq;
            CHECK(t, zz_decode(item.p, item.len, &rq) == ZZ_OK && rq.type == ZZ_REQUEST);
            CHECK(t, zz_verify_mac(&rq, 0, f->mac[0]) == 1);
            k++;
        }
        CHECK(t, k == 2);
        CHECK(t, zz_decode_batch(batch.p, batch.len - 1, &nt, &ns, &reqs) == ZZ_ERR_SHORT);
        zz_put_u8(&batch, 0);
        CHECK(t, zz_decode_batch(batch.p, batch.len, &nt, &ns, &reqs) == ZZ_ERR_LENGTH);
        t_end(t);
        zz_buf_reset(&b);
        s = zz_enc_pre_prepare(&b, 1, 0, 3, 17, batch.p, (uint32_t)batch.len - 1);
    }
    finish(t, f, "roundtrip PRE-PREPARE", &b, s, want);
    {
        uint8_t empty[20] = {0};
        s = zz_enc_pre_prepare(&b, 1, 0, 0, 1, empty, sizeof empty);
        finish(t, f, "roundtrip PRE-PREPARE empty batch", &b, s,
               "type=PRE-PREPARE service=1 sender=0 view=0 seq=1 nd_time=0 nd_seed=0 "
               "requests=[]");
    }

    s = zz_enc_phase(&b, ZZ_PREPARE, 1, 2, 4294967295u, 18446744073709551615ull, D1);
    snprintf(want, sizeof want,
             "type=PREPARE service=1 sender=2 view=4294967295 seq=18446744073709551615 "
             "digest=%s",
             d1);
    finish(t, f, "roundtrip PREPARE (max ints)", &b, s, want);
    s = zz_enc_phase(&b, ZZ_COMMIT, 65535, 3, 1, 2, D1);
    snprintf(want, sizeof want, "type=COMMIT service=65535 sender=3 view=1 seq=2 digest=%s", d1);
    finish(t, f, "roundtrip COMMIT", &b, s, want);
    s = zz_enc_checkpoint(&b, 1, 1, 128, D1);
    snprintf(want, sizeof want, "type=CHECKPOINT service=1 sender=1 seq=128 state=%s", d1);
    finish(t, f, "roundtrip CHECKPOINT", &b, s, want);

    /* VIEW-CHANGE with a proof of two signed CHECKPOINTs, P and Q entries. */
    zz_buf_reset(&inner);
    size_t c1 = zz_enc_checkpoint(&inner, 1, 1, 128, D1);
    zz_auth_sign(&inner, c1, f->sk);
    size_t c1_len = inner.len;
    char *ch = malloc(2 * c1_len + 1);
    t_hex(inner.p, c1_len, ch);
    s = zz_begin(&b, ZZ_VIEW_CHANGE, ZZ_AUTH_SIG, 1, 2);
    zz_put_u32(&b, 5);
    zz_put_u64(&b, 128);
    zz_put_u32(&b, 2);
    zz_put_bytes(&b, inner.p, (uint32_t)c1_len);
    zz_put_bytes(&b, NULL, 0);
    zz_entry e1 = {129, 4, {0}}, e2 = {130, 3, {0}};
    memcpy(e1.digest, D1, 32);
    zz_put_u32(&b, 2);
    zz_put_entry(&b, &e1);
    zz_put_entry(&b, &e2);
    zz_put_u32(&b, 0);
    zz_end_body(&b, s);
    snprintf(want, sizeof want,
             "type=VIEW-CHANGE service=1 sender=2 new_view=5 stable_seq=128 proof=[%s,-] "
             "prepared=[129/4/%s,130/3/%s] preprepared=[]",
             ch, d1, "0000000000000000000000000000000000000000000000000000000000000000");
    finish(t, f, "roundtrip VIEW-CHANGE", &b, s, want);

    s = zz_begin(&b, ZZ_NEW_VIEW, ZZ_AUTH_SIG, 1, 1);
    zz_put_u32(&b, 5);
    zz_put_u32(&b, 1);
    zz_put_bytes(&b, inner.p, (uint32_t)c1_len);
    zz_put_u64(&b, 128);
    zz_choice k1 = {129, {0}};
    memcpy(k1.digest, D1, 32);
    zz_put_u32(&b, 1);
    zz_put_choice(&b, &k1);
    zz_end_body(&b, s);
    snprintf(want, sizeof want,
             "type=NEW-VIEW service=1 sender=1 view=5 view_changes=[%s] min_s=128 "
             "chosen=[129/%s]",
             ch, d1);
    finish(t, f, "roundtrip NEW-VIEW", &b, s, want);
    free(ch);

    s = zz_enc_fetch(&b, 1, ZZ_PRINCIPAL_EXEC + 1, ZZ_FETCH_STATE, 256, D1);
    snprintf(want, sizeof want, "type=FETCH service=1 sender=257 kind=2 seq=256 digest=%s", d1);
    finish(t, f, "roundtrip FETCH", &b, s, want);
    s = zz_enc_fetch_reply(&b, 1, 0, ZZ_FETCH_BATCH, 3, D1, "\xde\xad", 2);
    snprintf(want, sizeof want,
             "type=FETCH-REPLY service=1 sender=0 kind=1 seq=3 digest=%s data=dead", d1);
    finish(t, f, "roundtrip FETCH-REPLY", &b, s, want);
    s = zz_enc_status(&b, 1, 3, 2, 1000, 896);
    finish(t, f, "roundtrip STATUS", &b, s,
           "type=STATUS service=1 sender=3 view=2 last_exec=1000 stable_seq=896");

    /* fault detection and control messages */
    zz_reply_ref ref = {65536, 5, {0}};
    memcpy(ref.result_digest, D1, 32);
    zz_buf refs;
    zz_buf_init(&refs);
    zz_put_reply_ref(&refs, &ref);
    ref.client = 65537;
    zz_put_reply_ref(&refs, &ref);
    s = zz_enc_exec_report(&b, 1, ZZ_PRINCIPAL_EXEC + 1, 9, D1, refs.p, 2);
    snprintf(want, sizeof want,
             "type=EXEC-REPORT service=1 sender=257 seq=9 reply_digest=%s "
             "replies=[65536/5/%s,65537/5/%s]",
             d1, d1, d1);
    finish(t, f, "roundtrip EXEC-REPORT", &b, s, want);
    zz_buf_free(&refs);

    s = zz_begin(&b, ZZ_FAULT_STATEMENT, ZZ_AUTH_SIG, 1, 2);
    zz_put_u64(&b, 7);
    zz_put_u32(&b, 2);
    zz_row_entry re = {0, ZZ_ROW_LATE, {0}};
    memcpy(re.digest, D1, 32);
    zz_put_row_entry(&b, &re);
    memset(&re, 0, sizeof re);
    re.replica = 1;
    zz_put_row_entry(&b, &re);
    zz_end_body(&b, s);
    snprintf(want, sizeof want,
             "type=FAULT-STATEMENT service=1 sender=2 seq=7 row=[0/2/%s,1/0/%064d]", d1, 0);
    finish(t, f, "roundtrip FAULT-STATEMENT", &b, s, want);

    static const uint32_t sleeping[] = {2, 3}, wake[] = {2};
    s = zz_begin(&b, ZZ_WAKEUP, ZZ_AUTH_SIG, 1, 0);
    zz_put_u64(&b, 7);
    zz_put_u32(&b, 1);
    zz_put_bytes(&b, "\x01\x02", 2);
    zz_put_u32_list(&b, sleeping, 2);
    zz_put_u32_list(&b, wake, 1);
    zz_end_body(&b, s);
    finish(t, f, "roundtrip WAKEUP", &b, s,
           "type=WAKEUP service=1 sender=0 seq=7 evidence=[0102] sleeping=[2,3] wake=[2]");

    static const uint32_t awake[] = {0, 1}, convict[] = {1}, active[] = {0, 2};
    s = zz_begin(&b, ZZ_SHUTDOWN, ZZ_AUTH_SIG, 1, 3);
    zz_put_u64(&b, 7);
    zz_put_u32_list(&b, awake, 2);
    zz_put_u32_list(&b, convict, 1);
    zz_put_u32_list(&b, NULL, 0);
    zz_put_u32_list(&b, active, 2);
    zz_end_body(&b, s);
    finish(t, f, "roundtrip SHUTDOWN", &b, s,
           "type=SHUTDOWN service=1 sender=3 seq=7 awake=[0,1] convict=[1] sleep=[] "
           "active=[0,2]");

    s = zz_enc_reply_affirm(&b, 1, 2, 44, 65537, D1);
    snprintf(want, sizeof want,
             "type=REPLY-AFFIRM service=1 sender=2 timestamp=44 client=65537 result_digest=%s", d1);
    finish(t, f, "roundtrip REPLY-AFFIRM", &b, s, want);
    s = zz_enc_control(&b, ZZ_CONTROL, 0, ZZ_PRINCIPAL_OPERATOR, 3, "{}", 2);
    finish(t, f, "roundtrip CONTROL", &b, s,
           "type=CONTROL service=0 sender=33554432 request_id=3 json=7b7d");
    s = zz_enc_control(&b, ZZ_CONTROL_REPLY, 0, ZZ_PRINCIPAL_HOST, 3, "", 0);
    finish(t, f, "roundtrip CONTROL-REPLY", &b, s,
           "type=CONTROL-REPLY service=0 sender=16777216 request_id=3 json=-");
    uint8_t kpub[ZZ_KEY_LEN], kdh[ZZ_KEY_LEN];
    memset(kpub, 0xab, sizeof kpub);
    memset(kdh, 0x01, sizeof kdh);
    zz_spare_ready sr = {.replica = 1, .seq = 57, .epoch = 3, .sign_pub = kpub, .dh_pub = kdh};
    s = zz_enc_spare_ready(&b, 1, ZZ_PRINCIPAL_HOST + 2, &sr);
    finish(t, f, "roundtrip SPARE-READY", &b, s,
           "type=SPARE-READY service=1 sender=16777218 replica=1 seq=57 epoch=3 "
           "sign_pub=abababababababababababababababababababababababababababababababab "
           "dh_pub=0101010101010101010101010101010101010101010101010101010101010101");

    zz_buf_free(&b);
    zz_buf_free(&batch);
    zz_buf_free(&inner);
}

/* Build a valid MAC'd STATUS into b and return its start. */
static size_t status_msg(fixture *f, zz_buf *b)
{
    size_t s = zz_enc_status(b, 1, 3, 2, 10, 0);
    zz_auth_mac(b, s, f->rcv, f->mac, NREPL);
    return s;
}

static enum zz_err dec(const zz_buf *b) { zz_msg m; return zz_decode(b->p, b->len, &m); }

static void test_malformed(tctx *t, fixture *f)
{
    zz_buf b;
    zz_buf_init(&b);
    zz_msg m;

    t_begin(t, "header errors");
    status_msg(f, &b);
    CHECK(t, dec(&b) == ZZ_OK);
    b.p[0] = 'Y';
    CHECK(t, dec(&b) == ZZ_ERR_MAGIC);
    b.p[0] = 0x5A;
    b.p[1] = 0;
    CHECK(t, dec(&b) == ZZ_ERR_MAGIC);
    b.p[1] = 0x5A;
    b.p[2] = 2;
    CHECK(t, dec(&b) == ZZ_ERR_VERSION);
    b.p[2] = 0;
    CHECK(t, dec(&b) == ZZ_ERR_VERSION);
    b.p[2] = 1;
    for (int ty = 0; ty < 256; ty++) {
        if (zz_type_known((uint8_t)ty))
            continue;
        b.p[3] = (uint8_t)ty;
        CHECK(t, dec(&b) == ZZ_ERR_TYPE);
    }
    b.p[3] = ZZ_STATUS;
    for (int k = 0; k < 256; k++) {
        if (k == ZZ_AUTH_MAC)
            continue;
        b.p[4] = (uint8_t)k;
        CHECK(t, dec(&b) == ZZ_ERR_TYPE); /* wrong auth kind for the type */
    }
    b.p[4] = ZZ_AUTH_MAC;
    b.p[5] = 1;
    CHECK(t, dec(&b) == ZZ_ERR_FIELD);
    b.p[5] = 0;
    CHECK(t, dec(&b) == ZZ_OK);
    /* body_len beyond the message */
    b.p[15] += 200;
    CHECK(t, dec(&b) == ZZ_ERR_SHORT);
    b.p[12] = 0xff;
    CHECK(t, dec(&b) == ZZ_ERR_SHORT);
    CHECK(t, zz_decode(b.p, 0, &m) == ZZ_ERR_SHORT);
    CHECK(t, zz_decode(b.p, 15, &m) == ZZ_ERR_SHORT);
    t_end(t);

    t_begin(t, "signed type with a MAC vector is a type error");
    zz_buf_reset(&b);
    size_t s = zz_begin(&b, ZZ_CHECKPOINT, ZZ_AUTH_MAC, 1, 0);
    zz_put_u64(&b, 1);
    zz_put_raw(&b, D1, 32);
    zz_end_body(&b, s);
    zz_auth_mac(&b, s, f->rcv, f->mac, 1);
    CHECK(t, dec(&b) == ZZ_ERR_TYPE);
    t_end(t);

    t_begin(t, "trailing body bytes are a length error");
    zz_buf_reset(&b);
    s = zz_enc_status(&b, 1, 3, 2, 10, 0);
    zz_put_u8(&b, 0); /* one byte too many inside the body */
    zz_end_body(&b, s);
    zz_auth_mac(&b, s, f->rcv, f->mac, 1);
    CHECK(t, dec(&b) == ZZ_ERR_LENGTH);
    t_end(t);

    t_begin(t, "field domains: flags and fetch kind");
    for (int k = 0; k < 256; k++) { /* a request is one of: ordered, unordered read, ordered read */
        zz_buf_reset(&b);
        s = zz_enc_request(&b, 1, ZZ_PRINCIPAL_CLIENT, 1, (uint8_t)k, "x", 1);
        zz_auth_mac(&b, s, f->rcv, f->mac, 1);
        CHECK(t, dec(&b) == (k <= 2 ? ZZ_OK : ZZ_ERR_FIELD));
    }
    zz_buf_reset(&b);
    s = zz_enc_reply(&b, 1, 0, 0, 1, ZZ_PRINCIPAL_CLIENT, 0x80, "x", 1);
    zz_auth_mac(&b, s, f->rcv, f->mac, 1);
    CHECK(t, dec(&b) == ZZ_ERR_FIELD);
    for (int k = 0; k < 256; k += 1) {
        zz_buf_reset(&b);
        s = zz_enc_fetch(&b, 1, 0, (uint8_t)k, 1, D1);
        zz_auth_mac(&b, s, f->rcv, f->mac, 1);
        CHECK(t, dec(&b) == (k >= 1 && k <= 3 ? ZZ_OK : ZZ_ERR_FIELD));
        zz_buf_reset(&b);
        s = zz_enc_fetch_reply(&b, 1, 0, (uint8_t)k, 1, D1, NULL, 0);
        zz_auth_mac(&b, s, f->rcv, f->mac, 1);
        CHECK(t, dec(&b) == (k >= 1 && k <= 3 ? ZZ_OK : ZZ_ERR_FIELD));
    }
    t_end(t);

    t_begin(t, "nested lengths out of bounds are short");
    zz_buf_reset(&b);
    s = zz_begin(&b, ZZ_REQUEST, ZZ_AUTH_MAC, 1, ZZ_PRINCIPAL_CLIENT);
    zz_put_u64(&b, 1);
    zz_put_u8(&b, 0);
    zz_put_u32(&b, 6); /* claims 6 bytes of op, has 5 */
    zz_put_raw(&b, "hello", 5);
    zz_end_body(&b, s);
    zz_auth_mac(&b, s, f->rcv, f->mac, 1);
    CHECK(t, dec(&b) == ZZ_ERR_SHORT);
    zz_buf_reset(&b);
    s = zz_begin(&b, ZZ_VIEW_CHANGE, ZZ_AUTH_SIG, 1, 0);
    zz_put_u32(&b, 1);
    zz_put_u64(&b, 0);
    zz_put_u32(&b, 0);
    zz_put_u32(&b, 2); /* two P entries announced, one present */
    zz_entry e = {1, 0, {0}};
    zz_put_entry(&b, &e);
    zz_put_u32(&b, 0);
    zz_end_body(&b, s);
    zz_auth_sign(&b, s, f->sk);
    CHECK(t, dec(&b) == ZZ_ERR_SHORT);
    t_end(t);

    t_begin(t, "oversized list counts are length errors");
    zz_buf_reset(&b);
    s = zz_begin(&b, ZZ_VIEW_CHANGE, ZZ_AUTH_SIG, 1, 0);
    zz_put_u32(&b, 1);
    zz_put_u64(&b, 0);
    zz_put_u32(&b, ZZ_MAX_LIST + 1); /* proof count */
    zz_end_body(&b, s);
    zz_auth_sign(&b, s, f->sk);
    CHECK(t, dec(&b) == ZZ_ERR_LENGTH);
    zz_buf_reset(&b);
    s = zz_begin(&b, ZZ_NEW_VIEW, ZZ_AUTH_SIG, 1, 0);
    zz_put_u32(&b, 1);
    zz_put_u32(&b, 0);
    zz_put_u64(&b, 0);
    zz_put_u32(&b, 0xffffffffu); /* chosen count */
    zz_end_body(&b, s);
    zz_auth_sign(&b, s, f->sk);
    CHECK(t, dec(&b) == ZZ_ERR_LENGTH);
    /* MAC vector with 1025 entries: over the limit even when all the bytes are there. */
    zz_buf_reset(&b);
    s = zz_enc_status(&b, 1, 0, 0, 0, 0);
    zz_put_u16(&b, ZZ_MAX_MACS + 1);
    for (uint32_t i = 0; i < ZZ_MAX_MACS + 1; i++) {
        zz_put_u32(&b, i);
        zz_put_raw(&b, D1, 32);
    }
    CHECK(t, !b.oom && dec(&b) == ZZ_ERR_LENGTH);
    /* exactly 1024 is fine */
    zz_buf_reset(&b);
    s = zz_enc_status(&b, 1, 0, 0, 0, 0);
    zz_put_u16(&b, ZZ_MAX_MACS);
    for (uint32_t i = 0; i < ZZ_MAX_MACS; i++) {
        zz_put_u32(&b, i);
        zz_put_raw(&b, D1, 32);
    }
    CHECK(t, dec(&b) == ZZ_OK);
    t_end(t);

    t_begin(t, "authenticator shape");
    zz_buf_reset(&b);
    s = zz_enc_status(&b, 1, 0, 0, 0, 0);
    CHECK(t, dec(&b) == ZZ_ERR_AUTH); /* MAC type with no authenticator at all */
    zz_put_u16(&b, 0);
    CHECK(t, dec(&b) == ZZ_OK); /* an empty vector is well-formed ... */
    CHECK(t, zz_decode(b.p, b.len, &m) == ZZ_OK && zz_verify_mac(&m, 0, f->mac[0]) == 0);
    zz_buf_reset(&b);
    s = zz_enc_checkpoint(&b, 1, 0, 1, D1);
    zz_put_raw(&b, D1, 32);
    CHECK(t, dec(&b) == ZZ_ERR_AUTH); /* 32-byte "signature" */
    t_end(t);

    t_begin(t, "MAC vector: missing entry, first entry wins, tampering");
    zz_buf_reset(&b);
    s = zz_enc_status(&b, 1, 0, 0, 0, 0);
    {
        uint32_t rcv[3] = {2, 1, 2};
        zz_mackey *keys[3] = {f->mac[2], f->mac[1], f->wrong};
        zz_auth_mac(&b, s, rcv, keys, 3);
    }
    CHECK(t, zz_decode(b.p, b.len, &m) == ZZ_OK);
    CHECK(t, zz_verify_mac(&m, 2, f->mac[2]) == 1);  /* first entry for 2 */
    CHECK(t, zz_verify_mac(&m, 1, f->mac[1]) == 1);
    CHECK(t, zz_verify_mac(&m, 0, f->mac[0]) == 0);  /* no entry for 0 */
    CHECK(t, zz_verify_mac(&m, 1, f->mac[2]) == 0);  /* key of someone else */
    CHECK(t, zz_find_mac(&m, 3) == NULL);
    CHECK(t, zz_find_mac(&m, 1) == m.auth + 2 + 36 + 4);
    b.p[m.authed_len + 2 + 36 + 4 + 7] ^= 4; /* flip a bit of receiver 1's MAC */
    CHECK(t, zz_decode(b.p, b.len, &m) == ZZ_OK);
    CHECK(t, zz_verify_mac(&m, 1, f->mac[1]) == 0);
    CHECK(t, zz_verify_mac(&m, 2, f->mac[2]) == 1);
    b.p[m.authed_len + 2 + 3] ^= 1; /* rename entry 0 from receiver 2 to 3 */
    CHECK(t, zz_decode(b.p, b.len, &m) == ZZ_OK);
    CHECK(t, zz_verify_mac(&m, 2, f->mac[2]) == 0); /* now only the wrong-key entry */
    t_end(t);

    t_begin(t, "signature tampering");
    zz_buf_reset(&b);
    s = zz_enc_checkpoint(&b, 1, 0, 1, D1);
    zz_auth_sign(&b, s, f->sk);
    CHECK(t, zz_decode(b.p, b.len, &m) == ZZ_OK && zz_verify_sig(&m, f->pk) == 1);
    for (size_t i = m.authed_len; i < b.len; i++) {
        b.p[i] ^= 0x10;
        CHECK(t, zz_decode(b.p, b.len, &m) == ZZ_OK && zz_verify_sig(&m, f->pk) == 0);
        b.p[i] ^= 0x10;
    }
    b.p[7] ^= 1; /* service */
    CHECK(t, zz_decode(b.p, b.len, &m) == ZZ_OK && zz_verify_sig(&m, f->pk) == 0);
    t_end(t);

    t_begin(t, "buffer growth and oom stickiness");
    zz_buf_reset(&b);
    for (int i = 0; i < 100000; i++)
        zz_put_u32(&b, (uint32_t)i);
    CHECK(t, b.len == 400000 && !b.oom && b.p[399999] == (uint8_t)99999);
    b.oom = 1;
    size_t before = b.len;
    zz_put_u64(&b, 1);
    CHECK(t, b.len == before);
    zz_buf_reset(&b);
    CHECK(t, b.len == 0 && !b.oom);
    t_end(t);

    zz_buf_free(&b);
}

/* ---- shared vector file ---- */

typedef struct {
    char name[128];
    uint8_t *msg;
    long msg_len;
    char *dump;
    char error[32];
    uint32_t mac_rcv[64];
    uint8_t mac_key[64][32];
    int nmac;
    uint8_t pub[8][32];
    int npub;
    int bad; /* a line of the block did not parse */
} vector;

static void vector_clear(vector *v)
{
    free(v->msg);
    free(v->dump);
    memset(v, 0, sizeof *v);
}

static enum zz_err err_by_name(const char *s)
{
    for (int e = ZZ_ERR_SHORT; e <= ZZ_ERR_FIELD; e++)
        if (strcmp(zz_err_name((enum zz_err)e), s) == 0)
            return (enum zz_err)e;
    return ZZ_OK;
}

static void run_vector(tctx *t, fixture *f, const char *file, vector *v)
{
    char label[256];
    snprintf(label, sizeof label, "vector %s [%s]", file, v->name);
    t_begin(t, label);
    CHECK(t, !v->bad);
    CHECK(t, v->msg != NULL);
    if (!v->msg) {
        t_end(t);
        return;
    }
    zz_msg m;
    enum zz_err e = zz_decode(v->msg, (size_t)v->msg_len, &m);
    if (v->error[0]) {
        enum zz_err want = err_by_name(v->error);
        CHECK(t, want != ZZ_OK);
        CHECK(t, v->dump == NULL);
        if (want == ZZ_ERR_AUTH && e == ZZ_OK) {
            /* Well-formed, but the listed keys must not authenticate it. */
            CHECK(t, v->nmac + v->npub > 0);
            for (int i = 0; i < v->nmac; i++) {
                zz_mackey *k = zz_mackey_new(v->mac_key[i]);
                CHECK(t, zz_verify_mac(&m, v->mac_rcv[i], k) == 0);
                zz_mackey_free(k);
            }
            for (int i = 0; i < v->npub; i++) {
                zz_pubkey *k = zz_pubkey_new(v->pub[i]);
                CHECK(t, zz_verify_sig(&m, k) == 0);
                zz_pubkey_free(k);
            }
        } else if (!CHECK(t, e == want)) {
            printf("  decode gave %s, vector says %s\n", zz_err_name(e), v->error);
        }
        t_end(t);
        return;
    }
    if (!CHECK(t, e == ZZ_OK)) {
        printf("  decode gave %s\n", zz_err_name(e));
        t_end(t);
        return;
    }
    CHECK(t, v->dump != NULL);
    int n = zz_dump(&m, f->dump, DUMP_CAP);
    CHECK(t, n > 0);
    if (v->dump && n > 0 && !CHECK(t, strcmp(f->dump, v->dump) == 0))
        printf("  got  %s\n  want %s\n", f->dump, v->dump);
    zz_buf b;
    zz_buf_init(&b);
    size_t s = zz_reencode(&b, &m);
    CHECK(t, !b.oom && b.len - s == (size_t)v->msg_len && memcmp(b.p + s, v->msg, b.len - s) == 0);
    zz_buf_free(&b);
    for (int i = 0; i < v->nmac; i++) {
        zz_mackey *k = zz_mackey_new(v->mac_key[i]);
        CHECK(t, zz_verify_mac(&m, v->mac_rcv[i], k) == 1);
        zz_mackey_free(k);
        v->mac_key[i][0] ^= 1; /* a flipped key must fail */
        k = zz_mackey_new(v->mac_key[i]);
        CHECK(t, zz_verify_mac(&m, v->mac_rcv[i], k) == 0);
        zz_mackey_free(k);
    }
    for (int i = 0; i < v->npub; i++) {
        zz_pubkey *k = zz_pubkey_new(v->pub[i]);
        CHECK(t, k && zz_verify_sig(&m, k) == 1);
        zz_pubkey_free(k);
        /* and the signature is bound to the bytes */
        uint8_t *c = malloc((size_t)v->msg_len);
        memcpy(c, v->msg, (size_t)v->msg_len);
        c[8] ^= 1; /* sender */
        zz_msg mc;
        k = zz_pubkey_new(v->pub[i]);
        CHECK(t, zz_decode(c, (size_t)v->msg_len, &mc) == ZZ_OK && zz_verify_sig(&mc, k) == 0);
        zz_pubkey_free(k);
        free(c);
    }
    t_end(t);
}

static char *trim(char *s)
{
    while (*s == ' ' || *s == '\t')
        s++;
    size_t n = strlen(s);
    while (n && (s[n - 1] == '\n' || s[n - 1] == '\r' || s[n - 1] == ' ' || s[n - 1] == '\t'))
        s[--n] = '\0';
    return s;
}

/* Parse one `key = value` line into v; marks v->bad when malformed. */
static void parse_line(vector *v, char *line)
{
    char *eq = strchr(line, '=');
    if (!eq) {
        v->bad = 1;
        return;
    }
    *eq = '\0';
    char *key = trim(line), *val = trim(eq + 1);
    size_t vl = strlen(val);
    if (strcmp(key, "msg") == 0) {
        free(v->msg);
        v->msg = malloc(vl / 2 + 1);
        v->msg_len = v->msg ? t_unhex(val, vl, v->msg, vl / 2 + 1) : -1;
        if (v->msg_len < 0) {
            free(v->msg);
            v->msg = NULL;
            v->bad = 1;
        }
    } else if (strcmp(key, "dump") == 0) {
        free(v->dump);
        v->dump = strdup(val);
    } else if (strcmp(key, "error") == 0) {
        snprintf(v->error, sizeof v->error, "%s", val);
    } else if (strcmp(key, "mac_key") == 0) {
        char *colon = strchr(val, ':');
        if (!colon || v->nmac == 64) {
            v->bad = 1;
            return;
        }
        *colon = '\0';
        v->mac_rcv[v->nmac] = (uint32_t)strtoul(val, NULL, 10);
        if (t_unhex(colon + 1, strlen(colon + 1), v->mac_key[v->nmac], 32) != 32)
            v->bad = 1;
        else
            v->nmac++;
    } else if (strcmp(key, "sign_pub") == 0) {
        if (v->npub == 8 || t_unhex(val, vl, v->pub[v->npub], 32) != 32)
            v->bad = 1;
        else
            v->npub++;
    } else {
        v->bad = 1; /* unknown keys would mean the two sides read different formats */
    }
}

/* Returns the number of vectors run, or -1 when the file cannot be opened. */
static int run_vector_file(tctx *t, fixture *f, const char *path)
{
    FILE *fp = fopen(path, "r");
    if (!fp)
        return -1;
    char *line = NULL;
    size_t cap = 0;
    vector *v = calloc(1, sizeof *v);
    int in_block = 0, count = 0;
    while (getline(&line, &cap, fp) != -1) {
        char *s = trim(line);
        if (*s == '\0' || *s == '#')
            continue;
        if (*s == '[') {
            if (in_block) {
                run_vector(t, f, path, v);
                count++;
            }
            vector_clear(v);
            char *end = strchr(s, ']');
            if (end)
                *end = '\0';
            snprintf(v->name, sizeof v->name, "%s", s + 1);
            in_block = 1;
            continue;
        }
        if (!in_block)
            continue;
        parse_line(v, s);
    }
    if (in_block) {
        run_vector(t, f, path, v);
        count++;
    }
    vector_clear(v);
    free(v);
    free(line);
    fclose(fp);
    return count;
}

static void test_vector_files(tctx *t, fixture *f)
{
    const char *env = getenv("ZZ_REPO_ROOT");
    const char *root = env && *env ? env : ZZ_REPO_ROOT;
    char path[4096];

    snprintf(path, sizeof path, "%s/tests/vectors/wire.txt", root);
    int n = run_vector_file(t, f, path);
    t_begin(t, "shared vector file present and non-empty");
    if (!CHECK(t, n > 0))
        printf("  %s: %s\n", path, n < 0 ? "missing" : "no vectors");
    else
        printf("shared vectors: %d from %s\n", n, path);
    t_end(t);

    snprintf(path, sizeof path, "%s/agreement/tests/wire_local.txt", root);
    n = run_vector_file(t, f, path);
    t_begin(t, "local vector file present and non-empty");
    CHECK(t, n > 0);
    t_end(t);
}

int main(void)
{
    tctx t = {0};
    fixture f;
    memset(&f, 0, sizeof f);
    if (!fixture_init(&f)) {
        printf("fixture setup failed\n0 passed, 1 failed\n");
        return 1;
    }
    test_roundtrips(&t, &f);
    test_malformed(&t, &f);
    test_vector_files(&t, &f);
    fixture_free(&f);
    return t_summary(&t);
}
