/* test_choose.c - unit tests of the NEW-VIEW decision rule (choose.c): the cases that make
 * view changes safe (a possibly committed batch survives) and live (null fill, undecided). */
#include <stdlib.h>

#include "choose.h"
#include "testutil.h"

typedef struct {
    zz_buf p, q;
} lists;

static void dig(uint8_t d[ZZ_DIGEST_LEN], int v)
{
    memset(d, 0, ZZ_DIGEST_LEN);
    d[0] = (uint8_t)v;
    d[31] = 0xEE;
}

static void add(zz_buf *b, uint64_t seq, uint32_t view, int d)
{
    zz_entry e = {seq, view, {0}};
    dig(e.digest, d);
    zz_put_entry(b, &e);
}

static void mk(zz_vc_info *vi, uint32_t sender, uint64_t stable, lists *l)
{
    vi->sender = sender;
    vi->stable_seq = stable;
    vi->P.count = (uint32_t)(l->p.len / ZZ_ENTRY_WIRE);
    vi->P.p = l->p.p;
    vi->Q.count = (uint32_t)(l->q.len / ZZ_ENTRY_WIRE);
    vi->Q.p = l->q.p;
}

static int is_dig(const zz_choice *c, int d)
{
    uint8_t x[ZZ_DIGEST_LEN];
    dig(x, d);
    return memcmp(c->digest, x, ZZ_DIGEST_LEN) == 0;
}

static int is_null(const zz_choice *c)
{
    static const uint8_t z[ZZ_DIGEST_LEN];
    return memcmp(c->digest, z, ZZ_DIGEST_LEN) == 0;
}

int main(void)
{
    tctx t = {0};
    enum { G = 1, L = 32, N = 4 };
    lists l[N];
    zz_vc_info vi[N];
    zz_choice out[L];
    uint64_t min_s;
    uint32_t nout;

#define RESET()                                                                              \
    for (int i = 0; i < N; i++) {                                                            \
        zz_buf_reset(&l[i].p);                                                               \
        zz_buf_reset(&l[i].q);                                                               \
    }
    for (int i = 0; i < N; i++) {
        zz_buf_init(&l[i].p);
        zz_buf_init(&l[i].q);
    }

    t_begin(&t, "empty logs: nothing to re-propose");
    RESET();
    for (int i = 0; i < 3; i++)
        mk(&vi[i], (uint32_t)i, 0, &l[i]);
    CHECK(&t, zz_choose(vi, 3, G, L, &min_s, out, L, &nout) == 1);
    CHECK(&t, min_s == 0 && nout == 0);
    t_end(&t);

    t_begin(&t, "too few view changes cannot decide");
    CHECK(&t, zz_choose(vi, 2, G, L, &min_s, out, L, &nout) == 0);
    t_end(&t);

    t_begin(&t, "a prepared batch with g+1 pre-prepares survives, gap filled with null");
    RESET();
    add(&l[0].p, 3, 0, 7);
    add(&l[0].q, 3, 0, 7);
    add(&l[1].q, 3, 0, 7);
    for (int i = 0; i < 3; i++)
        mk(&vi[i], (uint32_t)i, 0, &l[i]);
    CHECK(&t, zz_choose(vi, 3, G, L, &min_s, out, L, &nout) == 1);
    CHECK(&t, nout == 3);
    CHECK(&t, out[0].seq == 1 && is_null(&out[0]));
    CHECK(&t, out[1].seq == 2 && is_null(&out[1]));
    CHECK(&t, out[2].seq == 3 && is_dig(&out[2], 7));
    t_end(&t);

    t_begin(&t, "the later view's prepared batch wins over an older one");
    RESET();
    add(&l[0].p, 1, 0, 1);
    add(&l[0].q, 1, 0, 1);
    add(&l[1].p, 1, 2, 2);
    add(&l[1].q, 1, 2, 2);
    add(&l[2].q, 1, 2, 2);
    for (int i = 0; i < 3; i++)
        mk(&vi[i], (uint32_t)i, 0, &l[i]);
    CHECK(&t, zz_choose(vi, 3, G, L, &min_s, out, L, &nout) == 1);
    CHECK(&t, nout == 1 && is_dig(&out[0], 2));
    t_end(&t);

    t_begin(&t, "a prepared claim without g+1 pre-prepares and no null quorum is undecided");
    RESET();
    add(&l[0].p, 1, 0, 5);
    add(&l[0].q, 1, 0, 5);
    for (int i = 0; i < 3; i++)
        mk(&vi[i], (uint32_t)i, 0, &l[i]);
    CHECK(&t, zz_choose(vi, 3, G, L, &min_s, out, L, &nout) == 0);
    t_end(&t);

    t_begin(&t, "the fourth view change settles it as null");
    mk(&vi[3], 3, 0, &l[3]);
    CHECK(&t, zz_choose(vi, 4, G, L, &min_s, out, L, &nout) == 1);
    CHECK(&t, nout == 0);
    t_end(&t);

    t_begin(&t, "a faulty replica's lone claim cannot override a committed batch");
    RESET();
    /* seq 1 prepared with digest 3 in view 0 at replicas 0 and 1; replica 2 (faulty)
     * claims digest 9 prepared in view 0 too. */
    add(&l[0].p, 1, 0, 3);
    add(&l[0].q, 1, 0, 3);
    add(&l[1].p, 1, 0, 3);
    add(&l[1].q, 1, 0, 3);
    add(&l[2].p, 1, 0, 9);
    add(&l[2].q, 1, 0, 9);
    for (int i = 0; i < 4; i++)
        mk(&vi[i], (uint32_t)i, 0, &l[i]);
    CHECK(&t, zz_choose(vi, 4, G, L, &min_s, out, L, &nout) == 1);
    CHECK(&t, nout == 1 && is_dig(&out[0], 3));
    t_end(&t);

    t_begin(&t, "the highest stable checkpoint is the starting point");
    RESET();
    add(&l[0].p, 3, 0, 4); /* below the chosen checkpoint: ignored */
    add(&l[1].p, 18, 1, 6);
    add(&l[1].q, 18, 1, 6);
    add(&l[2].q, 18, 1, 6);
    mk(&vi[0], 0, 0, &l[0]);
    mk(&vi[1], 1, 16, &l[1]);
    mk(&vi[2], 2, 16, &l[2]);
    mk(&vi[3], 3, 16, &l[3]);
    CHECK(&t, zz_choose(vi, 4, G, L, &min_s, out, L, &nout) == 1);
    CHECK(&t, min_s == 16 && nout == 2);
    CHECK(&t, out[0].seq == 17 && is_null(&out[0]));
    CHECK(&t, out[1].seq == 18 && is_dig(&out[1], 6));
    t_end(&t);

    t_begin(&t, "output capacity is checked");
    CHECK(&t, zz_choose(vi, 4, G, L, &min_s, out, 1, &nout) == -1);
    t_end(&t);

    for (int i = 0; i < N; i++) {
        zz_buf_free(&l[i].p);
        zz_buf_free(&l[i].q);
    }
    return t_summary(&t);
}
