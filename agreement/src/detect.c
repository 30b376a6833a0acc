/* detect.c - fault detection over EXEC-REPORTs (ZZ §4.3): per sequence number a timer of
 * K·t1 (t1 = delay from dispatch to the first report, clamped to a floor and a ceiling)
 * starts at the first report after this replica dispatched the seq (at dispatch if a report
 * came earlier: t1 = 0), but not before seq - 1 has settled here (arm); f+1 matching on-time
 * reports make an execution certificate.
 * Reports are taken only for seqs in the window (docs/fault-detection.md, "Bounded
 * evidence"): above it they are dropped and counted for the sender; a report for a seq of
 * the window not yet dispatched here is kept, and judged from dispatch on.
 * A mismatch or a timeout is flagged and handed to statements.c, which signs the row as a fault
 * statement (docs/fault-detection.md). Late reports are kept as distinct values (the TR's
 * hatted P). Certified batches' reply lists feed REPLY-AFFIRM (request.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "faults.h"
#include "log.h"
#include "replica.h"
#include "zzlayer.h"

static void rec_free_refs(zz_report_rec *k)
{
    for (uint32_t i = 0; i < ZZ_MAX_EXEC; i++) {
        free(k->refs[i]);
        k->refs[i] = NULL;
        k->nrefs[i] = 0;
    }
}

/* Reports are kept for (stable + L - n_reports, stable + L]: the agreement window and the
 * history below it. Above it nothing was ordered by any correct replica we keep up with. */
int zz_detect_window(const zz_replica *r, uint64_t seq)
{
    uint64_t high = r->stable + r->L;
    uint64_t low = high > r->zz.n_reports ? high - r->zz.n_reports : 0;
    return zz_seq_window(low, high - low, seq);
}

static zz_report_rec *rec_for(zz_replica *r, uint64_t seq, int create)
{
    if (!r->zz.reports || seq == 0)
        return NULL;
    zz_report_rec *k = &r->zz.reports[seq % r->zz.n_reports];
    if (k->seq == seq)
        return k;
    /* The window's seqs have distinct residues: a record held for another seq is below it. */
    if (!create || zz_detect_window(r, seq) != 0)
        return NULL;
    if (k->timer)
        zz_net_cancel(r->net, k->timer);
    rec_free_refs(k);
    memset(k, 0, sizeof *k);
    k->seq = seq;
    k->owner = r;
    return k;
}

zz_report_rec *zz_detect_record(zz_replica *r, uint64_t seq) { return rec_for(r, seq, 0); }

static void on_deadline(void *ctx);
static void check_reports(zz_replica *r, zz_report_rec *k);

/* The K·t1 deadline, t1 measured from dispatch to the first report (0 for a report that
 * came before it). */
static void start_timer(zz_replica *r, zz_report_rec *k, uint64_t t1)
{
    k->first_ms = zz_now_ms(r);
    k->deferred = 0;
    uint64_t t = zz_fault_timer_ms(t1, r->conf->detect_k, r->conf->detect_floor_ms,
                                   r->conf->detect_ceiling_ms);
    k->timer = zz_net_timer(r->net, (uint32_t)t, on_deadline, k);
}

/* Settled: nothing more is waited for at this seq (certified, or its deadline passed, or a
 * fault flagged), or nobody awake reported it yet, so no timer runs that could. */
static int settled(const zz_replica *r, uint64_t seq)
{
    zz_report_rec *p = seq ? zz_detect_record((zz_replica *)r, seq) : NULL;
    return !p || !p->dispatched || p->certified || p->expired || p->flagged ||
           (!p->first_ms && !p->deferred);
}

/* A first report of k's seq came: start its timer, unless seq - 1 has not settled. An
 * execution replica runs batches one after another, so its report of seq cannot come before
 * it ran seq - 1: timed from the first report of seq alone, a correct replica that queued
 * several batches (ordering ran ahead of it) was late by what it is behind on all of them,
 * and was convicted though each batch took it well under the floor (docs/fault-detection.md
 * §6). Timed from when seq - 1 settled, the deadline bounds each replica's time per batch;
 * one that stops reporting is still caught at the first seq it leaves out, whose timer runs. */
static void arm(zz_replica *r, zz_report_rec *k)
{
    if (k->first_ms || k->deferred || k->certified)
        return;
    uint64_t now = zz_now_ms(r);
    uint64_t t1 = now > k->dispatch_ms ? now - k->dispatch_ms : 0;
    if (settled(r, k->seq - 1)) {
        start_timer(r, k, t1);
        return;
    }
    k->deferred = 1;
    k->t1_ms = t1;
    r->st.exec_timers_deferred++;
}

/* k's seq has settled: the timer of the next seq, if it waits for it, starts now. */
static void settle(zz_replica *r, zz_report_rec *k)
{
    zz_report_rec *n = zz_detect_record(r, k->seq + 1);
    if (n && n->deferred && !n->first_ms && !n->certified)
        start_timer(r, n, n->t1_ms);
}

void zz_detect_dispatched(zz_replica *r, uint64_t seq)
{
    zz_report_rec *k = rec_for(r, seq, 1);
    if (!k || k->dispatched)
        return;
    k->dispatched = 1;
    k->dispatch_ms = zz_now_ms(r);
    /* Reports kept from before dispatch: the timer starts now, and they are judged now. */
    int early = 0;
    for (uint32_t i = 0; i < ZZ_MAX_EXEC; i++)
        early |= k->reported[i] && zz_exec_counts(r, i);
    if (early && !k->certified)
        arm(r, k);
    if (early)
        check_reports(r, k);
}

/* One line per suspected fault, with the row of what each execution replica reported:
 * the first 4 hex digits of its digest, "late:" before a late one, "-" for none. */
static void log_fault(zz_replica *r, const zz_report_rec *k, const char *what)
{
    char row[ZZ_MAX_EXEC * 12 + 1];
    size_t off = 0;
    row[0] = '\0';
    uint32_t width = r->zz.wake && r->conf->n_exec > r->zz.n_exec ? r->conf->n_exec : r->zz.n_exec;
    for (uint32_t i = 0; i < width && off + 12 < sizeof row; i++) {
        if (!zz_exec_counts(r, i))
            continue;
        if (!k->reported[i])
            off += (size_t)snprintf(row + off, sizeof row - off, " %u=-", i);
        else
            off += (size_t)snprintf(row + off, sizeof row - off, " %u=%s%02x%02x", i,
                                    k->late[i] ? "late:" : "", k->dig[i][0], k->dig[i][1]);
    }
    zz_log("zz-agreed: replica %u: %s at seq %llu:%s\n", r->id, what,
           (unsigned long long)k->seq, row);
}

static void flag(zz_replica *r, zz_report_rec *k, const char *what)
{
    k->flagged = 1;
    k->flag_ms = zz_now_ms(r);
    log_fault(r, k, what);
    settle(r, k);
}

/* A fault statement is signed once per seq, and only when no certificate can form any more
 * (docs/fault-detection.md §1): a correct replica never signs a row that holds one. */
static void state_fault(zz_replica *r, zz_report_rec *k)
{
    if (k->certified || k->stated)
        return;
    k->stated = 1;
    if (!k->flag_ms)
        k->flag_ms = zz_now_ms(r);
    zz_wake_on_flag(r, k);
}

static void on_deadline(void *ctx)
{
    zz_report_rec *k = ctx;
    zz_replica *r = k->owner;
    k->timer = 0;
    k->expired = 1;
    settle(r, k);
    if (k->certified)
        return;
    if (!k->flagged) {
        r->st.exec_timeouts++;
        flag(r, k, "execution timeout");
    }
    state_fault(r, k);
}

/* The reply list of a certified batch: each client's newest (timestamp, result digest)
 * becomes what a retransmission of that request is affirmed with. */
static void record_affirmations(zz_replica *r, const uint8_t *refs, uint32_t nrefs)
{
    zz_flist l = {nrefs, refs};
    for (uint32_t i = 0; i < nrefs; i++) {
        zz_reply_ref e;
        zz_reply_ref_at(&l, i, &e);
        int ci = zz_client_index(r, e.client);
        if (ci < 0)
            continue;
        zz_client *c = &r->clients[ci];
        if (e.timestamp > c->aff_t) {
            c->aff_t = e.timestamp;
            memcpy(c->aff_dig, e.result_digest, ZZ_DIGEST_LEN);
        }
    }
}

static void check_reports(zz_replica *r, zz_report_rec *k)
{
    uint32_t best = 0, distinct = 0, best_i = 0, pending = 0;
    for (uint32_t i = 0; i < r->zz.n_exec || (r->zz.wake && i < r->conf->n_exec); i++) {
        if (!k->reported[i] && zz_exec_counts(r, i) && (r->zz.wake || i < r->zz.n_exec))
            pending++; /* awake, not reported yet: may still complete a certificate */
        if (!k->reported[i] || k->late[i] || !zz_exec_counts(r, i))
            continue;
        uint32_t same = 0;
        int first = 1;
        for (uint32_t j = 0; j < r->zz.n_exec; j++) {
            if (!k->reported[j] || k->late[j] || !zz_exec_counts(r, j))
                continue;
            if (memcmp(k->dig[i], k->dig[j], ZZ_DIGEST_LEN) == 0) {
                same++;
                if (j < i)
                    first = 0;
            }
        }
        distinct += first;
        if (same > best) {
            best = same;
            best_i = i;
        }
    }
    if (distinct > 1 && !k->flagged) {
        r->st.exec_mismatches++;
        flag(r, k, "execution mismatch");
    }
    /* A row signed while an awake replica has not reported shows it as "-", which counts
     * against it like silence (docs/fault-detection.md §3): so before the deadline, sign
     * only once every awake replica reported (f = 2 VM drill in CI: a correct replica a
     * little slower than the liar and its peer was convicted with the liar). */
    if (distinct > 1 && (k->expired || (pending == 0 && best < r->conf->f + 1)))
        state_fault(r, k);
    if (best >= r->conf->f + 1 && !k->certified) {
        k->certified = 1;
        r->st.exec_certificates++;
        if (k->timer) {
            zz_net_cancel(r->net, k->timer);
            k->timer = 0;
        }
        /* Equal digests hash equal lists (checked at intake), so any certified one will do. */
        record_affirmations(r, k->refs[best_i], k->nrefs[best_i]);
        zz_xlog_report_certified(r, k->seq, k->refs[best_i], k->nrefs[best_i]);
        rec_free_refs(k);
        zz_wake_on_certified(r, k);
        if (k->flagged)
            zz_xlog_release_held(r); /* a checkpoint at this seq may wait for it */
        settle(r, k);
    }
}

void zz_detect_report(zz_replica *r, uint32_t i, uint64_t seq, const uint8_t *digest,
                      const uint8_t *refs, uint32_t nrefs)
{
    if (i >= ZZ_MAX_EXEC || !r->zz.reports)
        return;
    /* A convicted replica's reports (until its successor's SPARE-READY) are nobody's. */
    if (r->zz.wake && r->zz.exec_state[i] == ZZ_EXEC_CONVICTED) {
        r->st.exec_reports_convicted++;
        return;
    }
    int w = zz_detect_window(r, seq);
    if (w > 0) {
        zz_count_window(r, 0, i); /* never ordered by anyone we keep up with */
        return;
    }
    zz_report_rec *k = w == 0 ? rec_for(r, seq, 1) : zz_detect_record(r, seq);
    if (!k) {
        /* below the kept history, unless a fault round waits for it (exec_view.c keeps the
         * round's own record of its seq) */
        if (!zz_wake_on_lost_report(r, i, seq, digest))
            r->st.stale++;
        return;
    }
    if (i >= r->zz.n_exec)
        r->zz.n_exec = i + 1;
    if (k->reported[i])
        return; /* the first report counts; a replica that changes its answer is caught by
                 * the others' reports, not by believing its second one */
    k->reported[i] = 1;
    memcpy(k->dig[i], digest, ZZ_DIGEST_LEN);
    k->late[i] = (uint8_t)k->expired;
    if (!k->certified && nrefs > 0) {
        k->refs[i] = zz_memdup(refs, (size_t)nrefs * ZZ_REPLY_REF_WIRE);
        k->nrefs[i] = k->refs[i] ? nrefs : 0;
    }
    if (!k->dispatched) {
        r->st.exec_reports_early++; /* kept; no timer and no judgement before dispatch */
        return;
    }
    if (!k->first_ms && !k->certified && zz_exec_counts(r, i))
        arm(r, k);
    check_reports(r, k);
    zz_wake_on_report(r, k);
    /* Batching against execution (request.c): f+1 awake replicas have run this seq, so
     * its clients can hold their replies; matching or not, a fault round decides that. */
    uint32_t ran = 0;
    for (uint32_t j = 0; j < r->zz.n_exec; j++)
        ran += k->reported[j] && zz_exec_counts(r, j);
    if (ran >= r->conf->f + 1)
        zz_exec_reported(r, seq, zz_now_ms(r) - k->dispatch_ms);
}

/* An authenticated EXEC-REPORT from execution replica 256 + i. The reply digest must hash
 * the reply list it carries (docs/wire.md): otherwise a replica could report one digest and
 * a different list of results, and REPLY-AFFIRMs would vouch for results nobody compared. */
void zz_detect_on_report(zz_replica *r, const zz_msg *m)
{
    const zz_exec_report *q = &m->u.exec_report;
    uint8_t d[ZZ_DIGEST_LEN];
    zz_sha256(q->replies.p, (size_t)q->replies.count * ZZ_REPLY_REF_WIRE, d);
    if (!zz_ct_equal(d, q->reply_digest, ZZ_DIGEST_LEN)) {
        r->st.dropped[ZZ_DROP_FIELD]++;
        return;
    }
    r->st.exec_reports++;
    zz_detect_report(r, m->sender - ZZ_PRINCIPAL_EXEC, q->seq, q->reply_digest, q->replies.p,
                     q->replies.count);
}

/* Execution replica i was convicted at seq: what it reported for later seqs (kept before
 * those were dispatched here) must not count for the fresh replica that later takes its
 * index (a liar's future-seq reports convicted its successor; seen in the campaign). */
void zz_detect_forget(zz_replica *r, uint32_t i, uint64_t seq)
{
    for (uint32_t j = 0; r->zz.reports && i < ZZ_MAX_EXEC && j < r->zz.n_reports; j++) {
        zz_report_rec *k = &r->zz.reports[j];
        if (k->seq > seq && k->reported[i]) {
            k->reported[i] = 0;
            k->late[i] = 0;
            memset(k->dig[i], 0, ZZ_DIGEST_LEN);
            free(k->refs[i]);
            k->refs[i] = NULL;
            k->nrefs[i] = 0;
        }
    }
}

void zz_detect_free(zz_replica *r)
{
    for (uint32_t i = 0; r->zz.reports && i < r->zz.n_reports; i++)
        rec_free_refs(&r->zz.reports[i]);
    free(r->zz.reports);
    r->zz.reports = NULL;
}
