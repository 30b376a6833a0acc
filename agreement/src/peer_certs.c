/* peer_certs.c - WAKEUP and SHUTDOWN certificates from agreement peers
 * (docs/fault-detection.md "In zz-agreed"): check and adopt a peer's WAKEUP (which opens
 * the round, rounds.c), collect SHUTDOWN bodies per sender, and adopt g+1 identical bodies
 * as a certificate, also one that differs from this replica's own resolution or names a
 * lower sibling seq (check_done).
 *
 * Invariants: everything is verified before it changes any state, anything that fails is
 * dropped and counted; a certificate needs g+1 identical bodies from distinct agreement
 * replicas; between two certified outcomes of one awake set the lower seq, then the smaller
 * body wins, so every correct replica applies the same one. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "faults.h"
#include "log.h"
#include "replica.h"
#include "wake.h"

/* ---- WAKEUP and SHUTDOWN from peers ---- */

static const char *check_wakeup(zz_replica *r, const zz_msg *m, uint32_t *nrows_out,
                                 uint32_t *wake, uint32_t *n_wake)
{
    struct zz_wake *w = r->zz.wake;
    const zz_wakeup *q = &m->u.wakeup;
    if (q->evidence.count == 0 || q->evidence.count > r->n)
        return "evidence count";
    zz_blist_iter it;
    zz_bytes item;
    uint32_t nrows = 0;
    zz_blist_begin(&q->evidence, &it);
    while (zz_blist_next(&it, &item)) {
        zz_msg s;
        if (zz_decode(item.p, item.len, &s) != ZZ_OK || s.type != ZZ_FAULT_STATEMENT)
            return "evidence is not a FAULT-STATEMENT";
        if (s.service != r->conf->service || s.sender >= r->n)
            return "evidence signer";
        const zz_pubkey *pk = zz_pub_for(r, s.sender);
        if (!pk || !zz_verify_sig(&s, pk))
            return "evidence signature";
        if (s.u.fault_statement.seq != q->seq)
            return "evidence seq";
        if (zw_row_from(&s, &w->rows[nrows]) != 0)
            return "evidence row";
        nrows++;
    }
    uint32_t sleeping[ZZ_MAX_EXEC], n_sleeping, claimed[ZZ_MAX_EXEC], n_claimed;
    if (zw_ids_from(&q->sleeping, sleeping, &n_sleeping) != 0 ||
        zw_ids_from(&q->wake, claimed, &n_claimed) != 0)
        return "replica lists";
    int reason = zz_fault_evaluate(w->rows, nrows, r->conf->f, r->g, q->seq, w->rows[0].ids,
                                   w->rows[0].n, sleeping, n_sleeping, wake, n_wake);
    if (reason != ZZ_FAULT_OK)
        return zz_fault_reason_name(reason);
    /* An empty wake list passed the evaluator only with nobody asleep in the sender's view
     * and 2f+1 awake: a round that wakes nobody (docs/fault-detection.md §4a). */
    if (!zw_same_ids(wake, *n_wake, claimed, n_claimed))
        return "wake differs from the evidence's choice";
    for (uint32_t j = 0; j < n_claimed; j++)
        if (claimed[j] >= r->conf->n_exec)
            return "wake names an unknown replica";
    *nrows_out = nrows;
    return NULL;
}

void zz_on_wakeup(zz_replica *r, const zz_msg *m)
{
    struct zz_wake *w = r->zz.wake;
    uint32_t wake[ZZ_MAX_EXEC], n_wake = 0, nrows = 0;
    const char *why = w ? check_wakeup(r, m, &nrows, wake, &n_wake) : "no exec lines";
    if (why) {
        r->st.wakeups_rejected++;
        zz_log("zz-agreed: replica %u: WAKEUP from %u for seq %llu rejected: %s\n",
               r->id, m->sender, (unsigned long long)m->u.wakeup.seq, why);
        return;
    }
    r->st.wakeups_received++;
    const zz_frow *rows = w->rows;
    if (w->open && w->seq == m->u.wakeup.seq &&
        zw_same_ids(w->awake, w->n_awake, rows[0].ids, rows[0].n))
        return; /* the round we are in */
    if (m->u.wakeup.seq <= w->settled_seq)
        return; /* settled: controld refuses it as stale too */
    uint32_t awake[ZZ_MAX_EXEC];
    uint32_t n_awake = zw_list_state(r, ZZ_EXEC_AWAKE, awake);
    int fits = !w->open && zw_same_ids(awake, n_awake, rows[0].ids, rows[0].n);
    for (uint32_t j = 0; fits && j < n_wake; j++)
        fits = r->zz.exec_state[wake[j]] == ZZ_EXEC_SLEEPING;
    uint32_t asleep[ZZ_MAX_EXEC];
    if (fits && n_wake == 0 && zw_list_state(r, ZZ_EXEC_SLEEPING, asleep) > 0) {
        /* A round that wakes nobody while a spare sleeps in our view: its sender's sleeping
         * list is not ours (a faulty sender's, or an old view). Our own statements wake. */
        zz_log("zz-agreed: replica %u: WAKEUP from %u for seq %llu wakes nobody, but a spare "
               "sleeps here: not adopted\n",
               r->id, m->sender, (unsigned long long)m->u.wakeup.seq);
        return;
    }
    if (!fits)
        return; /* valid but about another awake set: an old round, or one we are past */
    char ws[256];
    zw_fmt_ids(ws, sizeof ws, wake, n_wake);
    zz_log("zz-agreed: replica %u: WAKEUP seq %llu wake [%s] adopted from replica %u\n",
           r->id, (unsigned long long)m->u.wakeup.seq, ws, m->sender);
    /* Relay it: its sender may be faulty and have told no controld. */
    zw_send_wakeup_controld(r, wake, n_wake, m->raw, m->raw_len);
    r->st.wakeups_relayed++;
    /* rows live in w->rows, which open_round's evaluation paths do not touch */
    zz_frow *copy = calloc(nrows, sizeof *copy);
    if (!copy)
        return;
    memcpy(copy, rows, nrows * sizeof *copy);
    zw_open_round(r, m->u.wakeup.seq, copy[0].ids, copy[0].n, wake, n_wake, copy, nrows, m->raw,
                  m->raw_len);
    free(copy);
}

/* Big-endian u32 at p (the wire's byte order). */
static uint32_t be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* The four lists of a stored SHUTDOWN body (`u64 seq` then awake, convict, sleep, active);
 * bodies were checked on intake, this re-checks every length anyway. */
int zw_body_lists(zz_replica *r, const uint8_t *p, uint32_t len,
                  uint32_t out[4][ZZ_MAX_EXEC], uint32_t n[4])
{
    uint32_t o = 8;
    if (len < o)
        return -1;
    for (int l = 0; l < 4; l++) {
        if (len - o < 4)
            return -1;
        uint32_t c = be32(p + o);
        o += 4;
        if (c > ZZ_MAX_EXEC || (len - o) / 4 < c)
            return -1;
        for (uint32_t i = 0; i < c; i++) {
            out[l][i] = be32(p + o + 4 * i);
            if (out[l][i] >= r->conf->n_exec || (i > 0 && out[l][i] <= out[l][i - 1]))
                return -1;
        }
        n[l] = c;
        o += 4 * c;
    }
    return o == len ? 0 : -1;
}

static int body_cmp(const uint8_t *a, uint32_t la, const uint8_t *b, uint32_t lb)
{
    if (la != lb)
        return la < lb ? -1 : 1;
    return memcmp(a, b, la);
}

/* The seq a stored SHUTDOWN body starts with (bodies were checked on intake). */
uint64_t zw_body_seq(const uint8_t *p, uint32_t len)
{
    uint64_t v = 0;
    for (uint32_t i = 0; i < 8 && i < len; i++)
        v = v << 8 | p[i];
    return v;
}

uint32_t zw_count_body(zz_replica *r, uint8_t **bodies, const uint32_t *lens,
                       const uint8_t *body, uint32_t len)
{
    uint32_t same = 0;
    for (uint32_t j = 0; j < r->n; j++)
        same += bodies[j] && body_cmp(bodies[j], lens[j], body, len) == 0;
    return same;
}

/* A certified outcome names every replica of its round. One of a round over a smaller
 * awake set than ours (the round before a follow-up at the same seq) does not name the
 * replicas only ours woke: they go back to sleep, as in that outcome they never woke. */
static void sleep_unnamed(zz_replica *r, const uint32_t *ours, uint32_t n_ours,
                          uint32_t theirs[4][ZZ_MAX_EXEC], const uint32_t tn[4])
{
    for (uint32_t i = 0; i < n_ours; i++) {
        uint32_t x = ours[i];
        int named = 0;
        for (int b = 1; b < 4 && !named; b++)
            for (uint32_t j = 0; j < tn[b] && !named; j++)
                named = theirs[b][j] == x;
        if (!named && x < ZZ_MAX_EXEC && r->zz.exec_state[x] == ZZ_EXEC_AWAKE)
            r->zz.exec_state[x] = ZZ_EXEC_SLEEPING;
    }
}

/* The merged outcome of the certified bodies at `seq` (each with g+1 identical copies in
 * dn_body): convict the union of their convictions, keep active only who every one keeps
 * active, put every other replica they name to sleep; awake is the union of their (nested)
 * awake sets. It depends on the set of certificates only, not on the order they came in,
 * so every correct agreement replica and every controld (zz/certs.py merge_outcomes) ends on
 * the same one. Each conviction is vouched for by a correct agreement replica's own view;
 * convictions only grow and the active set only shrinks as certificates arrive, so nobody
 * ever has to wake a replica some certificate put to sleep or revive a destroyed one; an
 * active set short of f+1 is a shortfall the next round mends (campaign seed 3502 round
 * 63: two certified outcomes, controld acted on one, the agreement replicas on the other).
 * Returns the number of distinct certified bodies merged, 0 on none. */
static uint32_t merge_certified(zz_replica *r, uint64_t seq, zz_buf *out)
{
    struct zz_wake *w = r->zz.wake;
    uint8_t named[ZZ_MAX_EXEC] = {0}, awake[ZZ_MAX_EXEC] = {0}, conv[ZZ_MAX_EXEC] = {0};
    uint8_t act[ZZ_MAX_EXEC];
    memset(act, 1, sizeof act);
    uint32_t merged = 0;
    for (uint32_t s = 0; s < r->n; s++) {
        const uint8_t *b = w->dn_body[s];
        uint32_t bl = w->dn_len[s], l[4][ZZ_MAX_EXEC], n[4];
        if (!b || zw_body_seq(b, bl) != seq ||
            zw_count_body(r, w->dn_body, w->dn_len, b, bl) < r->g + 1 ||
            zw_body_lists(r, b, bl, l, n) != 0)
            continue;
        int first = 1; /* count each distinct body once */
        for (uint32_t t = 0; t < s && first; t++)
            first = !(w->dn_body[t] && body_cmp(w->dn_body[t], w->dn_len[t], b, bl) == 0);
        merged += first;
        uint8_t mine[ZZ_MAX_EXEC] = {0};
        for (int a = 0; a < 4; a++)
            for (uint32_t i = 0; i < n[a]; i++) {
                named[l[a][i]] = 1;
                awake[l[a][i]] |= a == 0;
                conv[l[a][i]] |= a == 1;
                mine[l[a][i]] |= a == 3;
            }
        for (uint32_t x = 0; x < ZZ_MAX_EXEC; x++)
            act[x] &= mine[x];
    }
    if (!merged)
        return 0;
    uint32_t ids[4][ZZ_MAX_EXEC], cnt[4] = {0};
    for (uint32_t x = 0; x < r->conf->n_exec && x < ZZ_MAX_EXEC; x++) {
        if (awake[x])
            ids[0][cnt[0]++] = x;
        if (conv[x])
            ids[1][cnt[1]++] = x;
        else if (act[x])
            ids[3][cnt[3]++] = x;
        else if (named[x])
            ids[2][cnt[2]++] = x;
    }
    zz_buf_reset(out);
    zz_put_u64(out, seq);
    for (int a = 0; a < 4; a++)
        zz_put_u32_list(out, ids[a], cnt[a]);
    return out->oom ? 0 : merged;
}

/* After this replica decided a round, the certified SHUTDOWN bodies (g+1 identical ones from
 * distinct agreement replicas) settle it: those at the lowest certified seq, merged
 * (merge_certified) when correct replicas split so that more than one is certified. A
 * certified outcome wins over our own uncertified one. Another outcome may be at a lower seq
 * of the same awake set: one fault flagged at two adjacent seqs, where some replicas
 * gathered g+1 statements for one first and some for the other (campaign seed 3001 rounds
 * 17, 22, 44); or at the same seq over a larger or smaller awake set: the follow-up of a
 * round that closed undecided elsewhere (seed 3202 round 18). */
void zw_check_done(zz_replica *r)
{
    struct zz_wake *w = r->zz.wake;
    if (!w->done || w->open || !w->applied)
        return;
    uint64_t low = UINT64_MAX;
    for (uint32_t s = 0; s < r->n; s++) {
        const uint8_t *b = w->dn_body[s];
        if (b && zw_body_seq(b, w->dn_len[s]) < low &&
            zw_count_body(r, w->dn_body, w->dn_len, b, w->dn_len[s]) >= r->g + 1)
            low = zw_body_seq(b, w->dn_len[s]);
    }
    if (low == UINT64_MAX)
        return;
    zz_buf mb;
    zz_buf_init(&mb);
    uint32_t k = merge_certified(r, low, &mb);
    uint32_t l[4][ZZ_MAX_EXEC], n[4];
    if (!k || body_cmp(mb.p, (uint32_t)mb.len, w->applied, w->applied_len) == 0 ||
        zw_body_lists(r, mb.p, (uint32_t)mb.len, l, n) != 0) {
        zz_buf_free(&mb);
        return;
    }
    uint8_t *copy = zz_memdup(mb.p, (uint32_t)mb.len);
    uint32_t copy_len = (uint32_t)mb.len;
    zz_buf_free(&mb);
    if (!copy)
        return;
    uint32_t own = zw_count_body(r, w->dn_body, w->dn_len, w->applied, w->applied_len);
    uint32_t ol[4][ZZ_MAX_EXEC], on[4];
    if (zw_body_lists(r, w->applied, w->applied_len, ol, on) == 0)
        for (int a = 1; a < 4; a++)
            sleep_unnamed(r, ol[a], on[a], l, n);
    w->done_seq = low;
    char cs[256], ss[256], as[256];
    zw_fmt_ids(cs, sizeof cs, l[1], n[1]);
    zw_fmt_ids(ss, sizeof ss, l[2], n[2]);
    zw_fmt_ids(as, sizeof as, l[3], n[3]);
    if (k > 1) {
        zz_log("zz-agreed: replica %u: SHUTDOWN seq %llu convict [%s] sleep [%s] active [%s] "
               "merged from %u certified outcomes\n",
               r->id, (unsigned long long)low, cs, ss, as, k);
        r->st.shutdowns_merged++;
    } else {
        zz_log("zz-agreed: replica %u: SHUTDOWN seq %llu convict [%s] sleep [%s] active [%s] "
               "adopted from a certificate of %u over our own outcome (certified by %u)\n",
               r->id, (unsigned long long)low, cs, ss, as,
               zw_count_body(r, w->dn_body, w->dn_len, copy, copy_len), own);
        r->st.shutdowns_adopted_over_own++;
    }
    /* Undo nothing: the lists name every replica of the round, so applying them sets each
     * one's state afresh. */
    zw_apply_resolution(r, low, l[1], n[1], l[2], n[2], l[3], n[3]);
    free(w->applied);
    w->applied = copy;
    w->applied_len = copy_len;
}

/* Apply a SHUTDOWN certificate (g+1 identical bodies in sd_body) for the round w->seq /
 * w->awake, or for a lower sibling of it (its seq becomes the decided one). */
void zw_adopt(zz_replica *r, const uint8_t *body, uint32_t len, uint64_t seq,
              const uint32_t *convict, uint32_t nc, const uint32_t *sleep, uint32_t ns,
              const uint32_t *active, uint32_t nact)
{
    struct zz_wake *w = r->zz.wake;
    uint32_t same = zw_count_body(r, w->sd_body, w->sd_len, body, len);
    char cs[256], as[256];
    zw_fmt_ids(cs, sizeof cs, convict, nc);
    zw_fmt_ids(as, sizeof as, active, nact);
    zz_log("zz-agreed: replica %u: SHUTDOWN seq %llu convict [%s] active [%s] adopted from a "
           "certificate of %u\n",
           r->id, (unsigned long long)seq, cs, as, same);
    if (w->open) { /* the certificate may be of the round before our follow-up at seq */
        uint32_t tl[4][ZZ_MAX_EXEC], tn[4] = {0, nc, ns, nact};
        memcpy(tl[1], convict, nc * sizeof *convict);
        memcpy(tl[2], sleep, ns * sizeof *sleep);
        memcpy(tl[3], active, nact * sizeof *active);
        sleep_unnamed(r, w->woken, w->n_woken, tl, tn);
    }
    zw_apply_resolution(r, seq, convict, nc, sleep, ns, active, nact);
    zw_set_done(r, body, len, NULL, 0);
    w->done_seq = seq; /* a lower sibling's certificate: the open round's seq is settled */
    zw_round_clear(r);
    zw_check_done(r);
}

void zz_on_shutdown(zz_replica *r, const zz_msg *m)
{
    struct zz_wake *w = r->zz.wake;
    const zz_shutdown *q = &m->u.shutdown;
    uint32_t awake[ZZ_MAX_EXEC], na, convict[ZZ_MAX_EXEC], nc, sleep[ZZ_MAX_EXEC], ns,
        active[ZZ_MAX_EXEC], nact;
    if (!w || zw_ids_from(&q->awake, awake, &na) != 0 ||
        zw_ids_from(&q->convict, convict, &nc) != 0 || zw_ids_from(&q->sleep, sleep, &ns) != 0 ||
        zw_ids_from(&q->active, active, &nact) != 0) {
        r->st.shutdowns_rejected++;
        return;
    }
    for (uint32_t j = 0; j < nc + ns + nact; j++) {
        uint32_t id = j < nc ? convict[j] : j < nc + ns ? sleep[j - nc] : active[j - nc - ns];
        if (id >= r->conf->n_exec) {
            r->st.shutdowns_rejected++;
            return;
        }
    }
    r->st.shutdowns_received++;
    uint32_t s = m->sender;
    uint32_t cur[ZZ_MAX_EXEC];
    uint32_t ncur = zw_list_state(r, ZZ_EXEC_AWAKE, cur);
    if (!w->open && q->seq > w->settled_seq && zw_nested_ids(awake, na, cur, ncur)) {
        /* A round not open here yet: peers that adopted the WAKEUP first may decide and
         * send their SHUTDOWN before the WAKEUP or the statements reach us (campaign seed
         * 3101 round 26: the bodies were dropped, the round opened after them and closed
         * undecided). Kept for that round (open_round keeps them); g+1 identical bodies
         * are a certificate whether or not it ever opens. Nested awake sets: peers that
         * decided a round we just closed undecided (our awake set is larger now). */
        free(w->sd_body[s]);
        w->sd_body[s] = zz_memdup(m->body, m->body_len);
        w->sd_len[s] = w->sd_body[s] ? m->body_len : 0;
        if (zw_count_body(r, w->sd_body, w->sd_len, m->body, m->body_len) < r->g + 1)
            return;
        w->seq = q->seq;
        w->n_awake = na;
        memcpy(w->awake, awake, na * sizeof *awake);
        zw_adopt(r, m->body, m->body_len, q->seq, convict, nc, sleep, ns, active, nact);
        return;
    }
    /* Our open round, or a lower seq of its awake set: one fault flagged at two adjacent
     * seqs can open a round at either, and a certificate for the lower one settles it. The
     * awake sets may be nested: a round that closed undecided at some replicas is followed
     * at its seq by a round over the larger set (w6 -> w7), while others decided it (campaign
     * seed 3202 round 18: one replica decided the first round alone, two the follow-up; the
     * one kept its own outcome for good). */
    if (!w->open || q->seq > w->seq || q->seq <= w->settled_seq ||
        !zw_nested_ids(awake, na, w->awake, w->n_awake)) {
        /* not our open round: the round we decided last (or a lower sibling), or nothing */
        if (!w->done || q->seq > w->done_seq || q->seq <= w->done_floor ||
            !zw_nested_ids(awake, na, w->done_awake, w->n_done_awake))
            return;
        free(w->dn_body[s]);
        w->dn_body[s] = zz_memdup(m->body, m->body_len);
        w->dn_len[s] = w->dn_body[s] ? m->body_len : 0;
        zw_check_done(r);
        return;
    }
    /* A certificate is g+1 identical bodies from distinct replicas (docs/wire.md). */
    free(w->sd_body[s]);
    w->sd_body[s] = zz_memdup(m->body, m->body_len);
    w->sd_len[s] = w->sd_body[s] ? m->body_len : 0;
    if (zw_count_body(r, w->sd_body, w->sd_len, m->body, m->body_len) < r->g + 1)
        return;
    zw_adopt(r, m->body, m->body_len, q->seq, convict, nc, sleep, ns, active, nact);
}
