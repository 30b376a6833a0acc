/* test_window.c - unit tests of the bounded evidence helpers (docs/fault-detection.md,
 * "Bounded evidence"): the window predicate every seq-indexed intake uses, and the
 * per-sender EXEC-CHECKPOINT vote table, where one sender can never push out another's. */
#include "replica.h"
#include "zzlayer.h"
#include "testutil.h"

static void dig(uint8_t d[ZZ_DIGEST_LEN], int v)
{
    memset(d, 0, ZZ_DIGEST_LEN);
    d[0] = (uint8_t)v;
}

int main(void)
{
    tctx t = {0};

    t_begin(&t, "window (low, low + width]");
    CHECK(&t, zz_seq_window(0, 16, 0) < 0);
    CHECK(&t, zz_seq_window(0, 16, 1) == 0);
    CHECK(&t, zz_seq_window(0, 16, 16) == 0);
    CHECK(&t, zz_seq_window(0, 16, 17) > 0);
    CHECK(&t, zz_seq_window(100, 16, 100) < 0);
    CHECK(&t, zz_seq_window(100, 16, 116) == 0);
    CHECK(&t, zz_seq_window(100, 16, UINT64_MAX) > 0); /* no wrap-around */
    CHECK(&t, zz_seq_window(UINT64_MAX - 4, 16, UINT64_MAX) == 0);
    t_end(&t);

    static zz_xvote tab[3][ZZ_XCKPT_VOTES];
    uint8_t d8[ZZ_DIGEST_LEN], dx[ZZ_DIGEST_LEN];
    dig(d8, 8);
    dig(dx, 99);

    t_begin(&t, "a far-future flood from one sender keeps another sender's vote");
    CHECK(&t, zz_xvote_put(tab[0], 0, 8, d8) == 1);
    for (uint64_t k = 0; k < 1000; k++)
        CHECK(&t, zz_xvote_put(tab[2], 0, 8000 + 8 * k, dx) == 1);
    CHECK(&t, zz_xvote_put(tab[1], 0, 8, d8) == 1);
    CHECK(&t, zz_xvote_count((const zz_xvote(*)[ZZ_XCKPT_VOTES])tab, 3, 8, d8) == 2);
    /* the flooder keeps only its newest ZZ_XCKPT_VOTES */
    CHECK(&t, zz_xvote_count((const zz_xvote(*)[ZZ_XCKPT_VOTES])tab, 3, 8000 + 8 * 999, dx) == 1);
    CHECK(&t, zz_xvote_count((const zz_xvote(*)[ZZ_XCKPT_VOTES])tab, 3, 8000, dx) == 0);
    t_end(&t);

    t_begin(&t, "a sender's changed answer replaces its vote, an old one is refused");
    CHECK(&t, zz_xvote_put(tab[0], 0, 8, dx) == 1);
    CHECK(&t, zz_xvote_count((const zz_xvote(*)[ZZ_XCKPT_VOTES])tab, 3, 8, d8) == 1);
    CHECK(&t, zz_xvote_count((const zz_xvote(*)[ZZ_XCKPT_VOTES])tab, 3, 8, dx) == 1);
    CHECK(&t, zz_xvote_put(tab[2], 0, 16, d8) == 0); /* older than all 8 of its kept votes */
    t_end(&t);

    t_begin(&t, "votes at or below the stable point make room first");
    memset(tab, 0, sizeof tab);
    for (uint64_t k = 1; k <= ZZ_XCKPT_VOTES; k++)
        CHECK(&t, zz_xvote_put(tab[0], 0, 8 * k, d8) == 1);
    CHECK(&t, zz_xvote_put(tab[0], 24, 16, dx) == 1); /* 8 and 16 are stale: 16 fits again */
    CHECK(&t, zz_xvote_count((const zz_xvote(*)[ZZ_XCKPT_VOTES])tab, 1, 16, dx) == 1);
    CHECK(&t, zz_xvote_count((const zz_xvote(*)[ZZ_XCKPT_VOTES])tab, 1, 64, d8) == 1);
    t_end(&t);

    return t_summary(&t);
}
