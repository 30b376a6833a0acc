/* statements.c - FAULT-STATEMENTs (docs/fault-detection.md "In zz-agreed"): sign one for
 * each seq detect.c flags, collect the peers' per (seq, awake set) as candidates, and turn a
 * candidate into a self-certifying WAKEUP once zz_fault_evaluate accepts an evidence set
 * (the round itself is opened in rounds.c).
 *
 * Invariants: no statement is signed while a round is open (its rows would be about an
 * awake set that is changing); candidates are bounded per signer (a peer holds at most one
 * candidate of its own, so there is always room for every peer's); a statement is verified
 * (replica.c, row_from) before it is stored, and dropped and counted otherwise. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "byz.h"
#include "faults.h"
#include "log.h"
#include "replica.h"
#include "wake.h"

/* ---- candidates: statements collected per (seq, awake set) ---- */

/* The candidate for (seq, awake), made for `signer`'s statement if needed; NULL if there is
 * no room. Bounded per signer (docs/fault-detection.md, "Bounded evidence"): a candidate
 * only `signer` signed is its own, and a peer's new one replaces it, so each peer holds at
 * most one and there is always room for all of them; another signer's own candidate is
 * never evicted, shared ones go by fewest signers, then oldest. */
static candidate *cand_for(zz_replica *r, uint64_t seq, const uint32_t *awake, uint32_t n,
                           uint32_t signer)
{
    struct zz_wake *w = r->zz.wake;
    candidate *free_c = NULL, *own = NULL, *victim = NULL;
    for (int i = 0; i < WAKE_CANDIDATES; i++) {
        candidate *c = &w->cand[i];
        if (c->seq == seq && zw_same_ids(c->awake, c->n_awake, awake, n))
            return c;
        if (!c->seq) {
            if (!free_c)
                free_c = c;
            continue;
        }
        int sole = c->count == 1 && c->raw[signer];
        if (sole && signer != r->id && !own)
            own = c;
        if (c->count == 1 && !sole)
            continue; /* another signer's own */
        if (!victim || c->count < victim->count ||
            (c->count == victim->count && c->seq < victim->seq))
            victim = c;
    }
    candidate *c = own ? own : free_c ? free_c : victim;
    if (!c)
        return NULL;
    zw_cand_clear(r, c);
    c->seq = seq;
    c->n_awake = n;
    memcpy(c->awake, awake, n * sizeof *awake);
    c->first_ms = zz_now_ms(r);
    return c;
}

/* A verified FAULT-STATEMENT into its row form; -1 if it is not one a correct replica
 * could sign (row longer than ZZ_MAX_EXEC, ids not ascending). */
int zw_row_from(const zz_msg *m, zz_frow *row)
{
    const zz_fault_statement *q = &m->u.fault_statement;
    if (q->row.count == 0 || q->row.count > ZZ_MAX_EXEC)
        return -1;
    row->signer = m->sender;
    row->seq = q->seq;
    row->n = q->row.count;
    for (uint32_t i = 0; i < q->row.count; i++) {
        zz_row_entry e;
        zz_row_at(&q->row, i, &e);
        if (e.replica >= ZZ_MAX_EXEC || (i > 0 && e.replica <= row->ids[i - 1]))
            return -1;
        row->ids[i] = e.replica;
        row->e[i].state = e.state;
        memcpy(row->e[i].dig, e.digest, ZZ_DIGEST_LEN);
    }
    return 0;
}

/* Try to turn the candidate's statements into a WAKEUP (docs/fault-detection.md §4). */
static void try_evaluate(zz_replica *r, candidate *c)
{
    struct zz_wake *w = r->zz.wake;
    /* A seq at or below the last decided round is settled: controld refuses its WAKEUP as
     * stale, so it would wake nobody while this replica counted the spare awake. Statements
     * kept from before that round can come back here once the awake set is the one they
     * name again (retry_candidates after a SPARE-READY; seen in the campaign). */
    if (c->seq <= w->settled_seq || c->seq <= w->quiet_through) {
        zw_cand_clear(r, c);
        return;
    }
    if (w->open || c->count < r->g + 1)
        return;
    uint32_t awake[ZZ_MAX_EXEC], sleeping[ZZ_MAX_EXEC];
    uint32_t n_awake = zw_list_state(r, ZZ_EXEC_AWAKE, awake);
    uint32_t n_sleeping = zw_list_state(r, ZZ_EXEC_SLEEPING, sleeping);
    if (!zw_same_ids(awake, n_awake, c->awake, c->n_awake))
        return;
    uint32_t signer[ZZ_MAX_REPLICAS], nrows = 0;
    for (uint32_t s = 0; s < r->n; s++) {
        zz_msg m;
        if (!c->raw[s] || zz_decode(c->raw[s], c->len[s], &m) != ZZ_OK ||
            zw_row_from(&m, &w->rows[nrows]) != 0)
            continue;
        signer[nrows++] = s;
    }
    /* With nobody asleep the evaluator accepts a round that wakes nobody only over 2f+1
     * awake, whose own reports decide it (docs/fault-detection.md §4a); with fewer it says
     * empty-round and the candidate waits for a spare (zw_retry_candidates). */
    uint32_t wake[ZZ_MAX_EXEC], n_wake = 0, k = 0;
    uint64_t best_mask = 0;
    zz_frow *sub = w->sub;
    if (nrows == 0 ||
        zz_fault_choose(w->rows, nrows, r->conf->f, r->g, c->seq, awake, n_awake, sleeping,
                        n_sleeping, sub, &k, &best_mask, wake, &n_wake) != ZZ_FAULT_OK)
        return;
    /* WAKEUP: the chosen statements, our sleeping view, the evaluator's choice. */
    zz_buf *b = &w->buf;
    zz_buf_reset(b);
    size_t st = zz_begin(b, ZZ_WAKEUP, ZZ_AUTH_SIG, r->conf->service, r->id);
    zz_put_u64(b, c->seq);
    uint32_t who[ZZ_MAX_REPLICAS];
    k = 0;
    for (uint32_t i = 0; i < nrows; i++)
        if (best_mask & (1ULL << i))
            who[k++] = signer[i];
    zz_put_u32(b, k);
    for (uint32_t i = 0; i < k; i++)
        zz_put_bytes(b, c->raw[who[i]], c->len[who[i]]);
    zz_put_u32_list(b, sleeping, n_sleeping);
    zz_put_u32_list(b, wake, n_wake);
    zz_end_body(b, st);
    if (zz_auth_sign(b, st, r->conf->sign) != 0 || b->oom)
        return;
    uint8_t *raw = zz_memdup(b->p + st, b->len - st);
    uint32_t len = (uint32_t)(b->len - st);
    if (!raw)
        return;
    zw_send_wakeup_controld(r, wake, n_wake, raw, len);
    zw_bcast_raw(r, raw, len);
    r->st.wakeups_sent++;
    zz_report_rec *rec = zz_detect_record(r, c->seq);
    uint64_t now = zz_now_ms(r);
    uint64_t since = rec && rec->flagged && rec->flag_ms ? rec->flag_ms : c->first_ms;
    uint64_t lat = now > since ? now - since : 0;
    r->st.detect_latency_last_ms = lat;
    if (lat > r->st.detect_latency_max_ms)
        r->st.detect_latency_max_ms = lat;
    char ws[256], ss[256];
    zw_fmt_ids(ws, sizeof ws, wake, n_wake);
    zw_fmt_ids(ss, sizeof ss, who, k);
    zz_log("zz-agreed: replica %u: WAKEUP seq %llu wake [%s], evidence from agreement replicas "
           "[%s], %llu ms after the fault was flagged\n",
           r->id, (unsigned long long)c->seq, ws, ss, (unsigned long long)lat);
    uint64_t seq = c->seq;
    uint32_t cawake[ZZ_MAX_EXEC], cn = c->n_awake;
    memcpy(cawake, c->awake, cn * sizeof *cawake);
    zw_cand_clear(r, c);
    zw_open_round(r, seq, cawake, cn, wake, n_wake, sub, k, raw, len);
    free(raw);
}

/* Statements collected while nobody was asleep wake no one; once a spare sleeps again
 * (SPARE-READY), they may (a crash of the partner of a convicted replica before its fresh
 * spare was ready would otherwise stall the service until some later seq fails too). */
void zw_retry_candidates(zz_replica *r)
{
    struct zz_wake *w = r->zz.wake;
    for (int i = 0; i < WAKE_CANDIDATES && !w->open; i++)
        if (w->cand[i].seq)
            try_evaluate(r, &w->cand[i]);
}

/* ---- signing statements ---- */

/* blame_first: the false-fault test mode's lie, "nothing" for the lowest awake replica. */
static void put_row(zz_buf *b, const zz_report_rec *k, const uint32_t *awake, uint32_t n_awake,
                    int blame_first)
{
    zz_put_u32(b, n_awake);
    for (uint32_t j = 0; j < n_awake; j++) {
        uint32_t i = awake[j];
        zz_row_entry e;
        memset(&e, 0, sizeof e);
        e.replica = i;
        if (k->reported[i] && !(blame_first && j == 0)) {
            e.state = k->late[i] ? ZZ_ROW_LATE : ZZ_ROW_ONTIME;
            memcpy(e.digest, k->dig[i], ZZ_DIGEST_LEN);
        }
        zz_put_row_entry(b, &e);
    }
}

/* Sign and broadcast a row for k->seq over the current awake set; also collect it. */
void zw_send_statement(zz_replica *r, const zz_report_rec *k, int blame_first)
{
    struct zz_wake *w = r->zz.wake;
    uint32_t awake[ZZ_MAX_EXEC];
    uint32_t n_awake = zw_list_state(r, ZZ_EXEC_AWAKE, awake);
    if (n_awake == 0)
        return;
    zz_buf *b = &w->buf;
    zz_buf_reset(b);
    size_t st = zz_begin(b, ZZ_FAULT_STATEMENT, ZZ_AUTH_SIG, r->conf->service, r->id);
    zz_put_u64(b, k->seq);
    put_row(b, k, awake, n_awake, blame_first);
    zz_end_body(b, st);
    if (zz_auth_sign(b, st, r->conf->sign) != 0 || b->oom)
        return;
    uint32_t len = (uint32_t)(b->len - st);
    uint8_t *raw = zz_memdup(b->p + st, len);
    if (!raw)
        return;
    zw_bcast_raw(r, raw, len);
    r->st.fault_statements_sent++;
    if (blame_first) {
        free(raw); /* the false statement is only for the others to reject */
        return;
    }
    candidate *c = cand_for(r, k->seq, awake, n_awake, r->id);
    if (!c || c->raw[r->id]) {
        free(raw);
        return;
    }
    c->raw[r->id] = raw;
    c->len[r->id] = len;
    c->count++;
    try_evaluate(r, c);
}

void zz_wake_on_flag(zz_replica *r, zz_report_rec *k)
{
    if (!r->zz.wake || r->zz.wake->open || k->certified || k->seq <= r->zz.wake->quiet_through)
        return;
    zw_send_statement(r, k, 0);
}

void zz_wake_on_certified(zz_replica *r, zz_report_rec *k)
{
    /* Test-only Byzantine agreement replica: a signed statement blaming the lowest awake
     * (correct) replica for every certified seq; alone it must never wake anyone. */
    if (r->zz.wake && zz_byz_false_fault(r))
        zw_send_statement(r, k, 1);
}

void zz_on_fault_statement(zz_replica *r, const zz_msg *m)
{
    struct zz_wake *w = r->zz.wake;
    zz_frow row;
    if (!w || m->sender == r->id || zw_row_from(m, &row) != 0) {
        r->st.fault_statements_rejected++;
        return;
    }
    /* Only for a seq of the report window (detect.c): above it nothing was dispatched by a
     * replica we keep up with; dropped and counted for the signer. Below it: stale. */
    int win = r->zz.reports ? zz_detect_window(r, row.seq) : 0;
    if (win > 0) {
        zz_count_window(r, 1, m->sender);
        return;
    }
    if (win < 0 && (!w->rec.seq || row.seq != w->rec.seq)) { /* but a round's follow-up */
        r->st.stale++;
        return;
    }
    r->st.fault_statements_received++;
    candidate *c = cand_for(r, row.seq, row.ids, row.n, m->sender);
    if (!c) {
        r->st.fault_statements_rejected++;
        return;
    }
    if (c->raw[m->sender])
        return; /* one statement per signer and round: a duplicate or a second opinion */
    c->raw[m->sender] = zz_memdup(m->raw, m->raw_len);
    if (!c->raw[m->sender])
        return;
    c->len[m->sender] = m->raw_len;
    c->count++;
    try_evaluate(r, c);
}
