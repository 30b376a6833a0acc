/* xlog.c - external execution's checkpoints and log: the stable execution checkpoint (f+1
 * matching signed EXEC-CHECKPOINTs, or f+1 matching EXEC-REPORTs carrying its digest; held
 * while its seq may be a fault's), and the committed batches kept from the stable execution
 * checkpoint before it on, served to execution replicas that replay after a restart or a
 * wake-up (ZZ §4.2 step 5, §4.4; docs/design.md §4.3): an execution replica's FETCH for
 * the log registers its connection (where EXEC-COMMITs are pushed from then on) and is
 * answered from here (zz_xlog_on_fetch), as is a woken replica at once (zz_xlog_serve).
 *
 * Invariants: entries are kept for seq in (xlog_low, last_exec]; a served batch is vouched
 * (certified_through) only up to the first seq without an execution certificate here, or
 * one that was flagged or is at or above an open fault round's seq. */
#include <stdlib.h>
#include <string.h>

#include "byz.h"
#include "replica.h"
#include "zzlayer.h"

static void entry_clear(zz_xlog_entry *e)
{
    free(e->batch);
    memset(e, 0, sizeof *e);
}

void zz_xlog_free(zz_replica *r)
{
    for (uint32_t i = 0; r->zz.xlog && i < r->conf->exec_log; i++)
        entry_clear(&r->zz.xlog[i]);
    free(r->zz.xlog);
    r->zz.xlog = NULL;
}

const zz_xlog_entry *zz_xlog_get(const zz_replica *r, uint64_t seq)
{
    if (!r->zz.xlog || seq <= r->zz.xlog_low)
        return NULL;
    const zz_xlog_entry *e = &r->zz.xlog[seq % r->conf->exec_log];
    return e->seq == seq ? e : NULL;
}

void zz_xlog_append(zz_replica *r, const zz_slot *s)
{
    static const uint8_t null_digest[ZZ_DIGEST_LEN];
    if (!r->zz.xlog)
        return;
    uint32_t cap = r->conf->exec_log;
    /* Full: the oldest entry goes. Execution replicas that needed it must get state from
     * a peer's checkpoint instead of replaying; the counter tells the operator. */
    while (s->seq - r->zz.xlog_low > cap) {
        r->zz.xlog_low++;
        zz_xlog_entry *old = &r->zz.xlog[r->zz.xlog_low % cap];
        if (old->seq == r->zz.xlog_low) {
            entry_clear(old);
            r->st.exec_log_overflow++;
        }
    }
    zz_xlog_entry *e = &r->zz.xlog[s->seq % cap];
    entry_clear(e);
    e->seq = s->seq;
    memcpy(e->digest, s->is_null ? null_digest : s->digest, ZZ_DIGEST_LEN);
    if (!s->is_null && s->batch) {
        e->batch = zz_memdup(s->batch, s->batch_len);
        e->batch_len = e->batch ? s->batch_len : 0;
    }
}

static void xlog_collect(zz_replica *r, uint64_t upto)
{
    if (!r->zz.xlog)
        return;
    for (uint64_t seq = r->zz.xlog_low + 1; seq <= upto; seq++) {
        zz_xlog_entry *e = &r->zz.xlog[seq % r->conf->exec_log];
        if (e->seq == seq)
            entry_clear(e);
    }
    if (upto > r->zz.xlog_low)
        r->zz.xlog_low = upto;
}

int zz_xvote_put(zz_xvote *own, uint64_t low, uint64_t seq, const uint8_t dig[ZZ_DIGEST_LEN])
{
    zz_xvote *slot = NULL;
    for (int j = 0; j < ZZ_XCKPT_VOTES && !slot; j++)
        if (own[j].seq == seq)
            slot = &own[j]; /* a changed answer replaces the sender's earlier one */
    for (int j = 0; j < ZZ_XCKPT_VOTES && !slot; j++)
        if (own[j].seq == 0 || own[j].seq <= low)
            slot = &own[j];
    if (!slot) {
        zz_xvote *lowest = &own[0];
        for (int j = 1; j < ZZ_XCKPT_VOTES; j++)
            if (own[j].seq < lowest->seq)
                lowest = &own[j];
        if (lowest->seq > seq)
            return 0; /* older than all of this sender's kept votes */
        slot = lowest;
    }
    slot->seq = seq;
    memcpy(slot->dig, dig, ZZ_DIGEST_LEN);
    return 1;
}

uint32_t zz_xvote_count(const zz_xvote (*tab)[ZZ_XCKPT_VOTES], uint32_t nsenders, uint64_t seq,
                        const uint8_t dig[ZZ_DIGEST_LEN])
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < nsenders; i++)
        for (int j = 0; j < ZZ_XCKPT_VOTES; j++)
            if (tab[i][j].seq == seq && memcmp(tab[i][j].dig, dig, ZZ_DIGEST_LEN) == 0) {
                n++;
                break;
            }
    return n;
}

void zz_xlog_restore_stable(zz_replica *r, uint64_t seq, const uint8_t dig[ZZ_DIGEST_LEN],
                            uint64_t low)
{
    if (!r->zz.xlog)
        return;
    r->zz.exec_stable = seq;
    memcpy(r->zz.exec_stable_dig, dig, ZZ_DIGEST_LEN);
    xlog_collect(r, low);
}

void zz_xlog_restore(zz_replica *r, uint64_t seq, const uint8_t dig[ZZ_DIGEST_LEN],
                     const uint8_t *batch, uint32_t len)
{
    static const uint8_t null_digest[ZZ_DIGEST_LEN];
    if (!r->zz.xlog || seq <= r->zz.xlog_low)
        return;
    zz_slot s;
    memset(&s, 0, sizeof s);
    s.seq = seq;
    memcpy(s.digest, dig, ZZ_DIGEST_LEN);
    s.is_null = memcmp(dig, null_digest, ZZ_DIGEST_LEN) == 0;
    s.batch = (uint8_t *)batch; /* copied by zz_xlog_append */
    s.batch_len = len;
    zz_xlog_append(r, &s);
}

/* XSTABLE, then an XENTRY for each entry up to the agreement stable checkpoint (those above
 * it are rebuilt from the log's slots, executed again at recovery). */
void zz_xlog_write(zz_replica *r, zz_buf *b, uint32_t epoch)
{
    if (!r->zz.xlog)
        return;
    size_t st = zz_wal_begin(b, ZZ_WAL_XSTABLE, epoch);
    zz_put_u64(b, r->zz.exec_stable);
    zz_put_raw(b, r->zz.exec_stable_dig, ZZ_DIGEST_LEN);
    zz_put_u64(b, r->zz.xlog_low);
    zz_wal_end(b, st);
    uint64_t top = r->stable < r->last_exec ? r->stable : r->last_exec;
    for (uint64_t seq = r->zz.xlog_low + 1; seq <= top; seq++) {
        const zz_xlog_entry *e = zz_xlog_get(r, seq);
        if (!e)
            continue;
        st = zz_wal_begin(b, ZZ_WAL_XENTRY, epoch);
        zz_put_u64(b, seq);
        zz_put_raw(b, e->digest, ZZ_DIGEST_LEN);
        zz_put_bytes(b, e->batch, e->batch ? e->batch_len : 0);
        zz_wal_end(b, st);
    }
}

static void advance_stable(zz_replica *r, uint64_t seq, const uint8_t digest[ZZ_DIGEST_LEN])
{
    /* The log is kept from the stable checkpoint before this one, as the execution
     * replicas keep that one's snapshot: a spare woken for a round at S recovers from the
     * checkpoint below S that the replicas which saw the fault hold, and needs 2g+1 copies
     * of the log from there, also from replicas that made S stable before the round
     * opened (an equivocating replica's right reports certify S at them). */
    uint64_t keep = r->zz.exec_stable;
    r->zz.exec_stable = seq;
    memcpy(r->zz.exec_stable_dig, digest, ZZ_DIGEST_LEN);
    r->st.exec_stable_advances++;
    xlog_collect(r, keep < r->last_exec ? keep : r->last_exec);
    for (uint32_t i = 0; i < ZZ_MAX_EXEC; i++)
        for (int j = 0; j < ZZ_XCKPT_VOTES; j++)
            if (r->zz.xvotes[i][j].seq <= seq)
                memset(&r->zz.xvotes[i][j], 0, sizeof r->zz.xvotes[i][j]);
    if (r->zz.xcert.seq <= seq)
        memset(&r->zz.xcert, 0, sizeof r->zz.xcert);
    zz_wal_xstable(r); /* durable state: where the served log starts now */
}

static uint32_t votes_for(const zz_replica *r, uint64_t seq, const uint8_t digest[ZZ_DIGEST_LEN])
{
    return zz_xvote_count((const zz_xvote(*)[ZZ_XCKPT_VOTES])r->zz.xvotes, ZZ_MAX_EXEC, seq,
                          digest);
}

/* No checkpoint at or above a suspected fault's seq S becomes stable until S is settled:
 * the woken replicas must recover below S and replay S to report it (the round resolves
 * on those reports), and a stable checkpoint at S would both name S as their recovery
 * point and collect the log they replay. A liar whose first wrong reply was a read at a
 * checkpoint seq signs the same checkpoint as the correct replicas (a read's result is
 * not in the reply cache), so without this it was never convicted (seen in CI). Held:
 * while a fault round at S <= seq is open, and while seq's own reports disagree or are
 * late (flagged) without a certificate: that comes before the round is open. */
static int must_hold(zz_replica *r, uint64_t seq)
{
    uint64_t round = zz_fault_round_seq(r);
    if (round != 0 && seq >= round)
        return 1;
    /* Nor before seq's own reports are certified here: EXEC-CHECKPOINTs can come before
     * the reports that show a mismatch at seq, and an equivocating replica's checkpoint
     * is right while its report is not (campaign seed 3101 round 93: the checkpoint at
     * the fault seq became stable everywhere, the woken spare recovered at it and never
     * reported it). The certifying reports make it stable (zz_xlog_report_certified). */
    const zz_report_rec *k = zz_detect_record(r, seq);
    if (!k || k->certified)
        return 0;
    for (uint32_t i = 0; i < ZZ_MAX_EXEC; i++)
        if (k->reported[i])
            return 1;
    return 0; /* nobody reported it here: checkpoints are all there is to go on */
}

/* A signed EXEC-CHECKPOINT from execution replica i (signature already checked). Taken
 * for seqs in (exec_stable, stable + L]: no execution replica can have executed a seq above
 * the agreement window of a replica that keeps up; above it is dropped and counted. */
static void on_exec_checkpoint(zz_replica *r, uint32_t i, uint64_t seq,
                               const uint8_t digest[ZZ_DIGEST_LEN])
{
    if (i >= ZZ_MAX_EXEC || seq % r->conf->checkpoint_interval != 0)
        return;
    if (seq <= r->zz.exec_stable) {
        r->st.stale++;
        return;
    }
    if (seq > r->stable + r->L) {
        zz_count_window(r, 0, i);
        return;
    }
    if (!zz_xvote_put(r->zz.xvotes[i], r->zz.exec_stable, seq, digest))
        return;
    if (votes_for(r, seq, digest) < r->conf->f + 1)
        return;
    if (must_hold(r, seq)) {
        r->st.exec_stable_held++;
        return;
    }
    advance_stable(r, seq, digest);
}

/* f+1 matching EXEC-REPORTs at checkpoint seq certify the checkpoint digest in their
 * checkpoint ref (docs/wire.md): a replica that reports correctly but signs a wrong (or no)
 * EXEC-CHECKPOINT cannot keep checkpoints from becoming stable, and one that puts a wrong
 * digest in its report is a mismatch, detected and convicted like a wrong reply. */
void zz_xlog_report_certified(zz_replica *r, uint64_t seq, const uint8_t *refs, uint32_t nrefs)
{
    if (!r->zz.xlog || seq % r->conf->checkpoint_interval != 0 || seq <= r->zz.exec_stable)
        return;
    zz_flist l = {nrefs, refs};
    for (uint32_t i = nrefs; i-- > 0;) {
        zz_reply_ref e;
        zz_reply_ref_at(&l, i, &e);
        if (e.client != ZZ_CHECKPOINT_REF_CLIENT || e.timestamp != seq)
            continue;
        r->st.exec_stable_by_reports++;
        if (must_hold(r, seq)) {
            r->st.exec_stable_held++;
            if (seq > r->zz.xcert.seq) {
                r->zz.xcert.seq = seq;
                memcpy(r->zz.xcert.dig, e.result_digest, ZZ_DIGEST_LEN);
            }
            return;
        }
        advance_stable(r, seq, e.result_digest);
        return;
    }
}

void zz_xlog_release_held(zz_replica *r)
{
    /* The highest seq with f+1 matching votes, or certified by reports. */
    const zz_xvote *best = r->zz.xcert.seq > r->zz.exec_stable ? &r->zz.xcert : NULL;
    for (uint32_t i = 0; i < ZZ_MAX_EXEC; i++)
        for (int j = 0; j < ZZ_XCKPT_VOTES; j++) {
            const zz_xvote *v = &r->zz.xvotes[i][j];
            if (v->seq <= r->zz.exec_stable || (best && v->seq <= best->seq))
                continue;
            if (votes_for(r, v->seq, v->dig) >= r->conf->f + 1)
                best = v;
        }
    if (best && !must_hold(r, best->seq)) {
        uint8_t copy[ZZ_DIGEST_LEN];
        memcpy(copy, best->dig, ZZ_DIGEST_LEN); /* advance_stable clears the votes */
        advance_stable(r, best->seq, copy);
    }
}

void zz_on_exec_message(zz_replica *r, const zz_msg *m)
{
    if (m->type == ZZ_EXEC_REPORT) {
        zz_detect_on_report(r, m);
        return;
    }
    r->st.exec_checkpoints++;
    on_exec_checkpoint(r, m->sender - ZZ_PRINCIPAL_EXEC, m->u.exec_checkpoint.seq,
                       m->u.exec_checkpoint.checkpoint);
}

/* ---- serving the log (FETCH kind 3) ---- */

/* The execution log above max(from, xlog_low) as u64 certified_through, list<log_entry>
 * (docs/wire.md), capped so one reply stays far below ZZ_MAX_MSG; the requester asks again
 * from where it ends. certified_through vouches that the listed batches up to it hold
 * execution certificates here, so a replaying replica may skip their read-only requests
 * (ZZ §4.7.2) and does not report them; 0 vouches for none. */
static void encode_log(zz_replica *r, uint64_t from, zz_buf *b)
{
    static const size_t cap = 4u << 20;
    zz_buf_reset(b);
    zz_put_u64(b, 0);
    zz_put_u32(b, 0);
    uint32_t count = 0;
    uint64_t certified = 0;
    int gap = 0;
    const uint64_t round = zz_fault_round_seq(r);
    const uint64_t low = from > r->zz.xlog_low ? from : r->zz.xlog_low;
    for (uint64_t seq = low + 1; seq <= r->last_exec; seq++) {
        const zz_xlog_entry *e = zz_xlog_get(r, seq);
        if (!e || b->len > cap)
            break;
        /* Not vouched: a seq that was suspected (flagged) or an open fault round's.
         * The woken replicas must run it in full and report it, or the round waits for
         * their reports until its timeout (a read skipped changes the reply digest). */
        const zz_report_rec *k = zz_detect_record(r, seq);
        gap |= !k || !k->certified || k->flagged || (round && seq >= round);
        if (!gap)
            certified = seq;
        zz_put_u64(b, seq);
        zz_put_raw(b, e->digest, ZZ_DIGEST_LEN);
        zz_put_bytes(b, e->batch, e->batch_len);
        count++;
    }
    if (!b->oom) {
        for (int i = 0; i < 8; i++)
            b->p[i] = (uint8_t)(certified >> (56 - 8 * i));
        for (int i = 0; i < 4; i++)
            b->p[8 + i] = (uint8_t)(count >> (24 - 8 * i));
    }
}

/* FETCH-REPLY{kind 3} with the log above `from` to principal `to` on conn. The log starts
 * after the stable execution checkpoint, which the reply names. */
static void send_log(zz_replica *r, zz_conn *conn, uint32_t to, uint64_t from)
{
    zz_buf *b = &r->out;
    zz_buf_reset(b);
    encode_log(r, from, &r->out2);
    if (r->out2.oom)
        return;
    size_t st = zz_enc_fetch_reply(b, r->conf->service, r->id, ZZ_FETCH_LOG, r->zz.exec_stable,
                                   r->zz.exec_stable_dig, r->out2.p, (uint32_t)r->out2.len);
    zz_end_body(b, st);
    zz_mackey *k = (zz_mackey *)zz_mac_for(r, to);
    zz_auth_mac(b, st, &to, &k, 1);
    if (!b->oom && conn && !zz_byz_silent(r))
        zz_net_send_conn(r->net, conn, b->p + st, b->len - st);
    r->st.fetches_served++;
}

int zz_xlog_on_fetch(zz_replica *r, zz_conn *conn, const zz_msg *m)
{
    if (!r->zz.xlog)
        return 0;
    /* Execution replicas (not agreement peers) ask on their own connection, which is also
     * where committed batches are pushed to them from now on. */
    if (m->sender >= ZZ_PRINCIPAL_EXEC && m->sender < ZZ_PRINCIPAL_EXEC + ZZ_MAX_EXEC)
        r->zz.exec_conn[m->sender - ZZ_PRINCIPAL_EXEC] = conn;
    send_log(r, conn, m->sender, m->u.fetch.seq);
    return 1;
}

void zz_xlog_serve(zz_replica *r, uint32_t i)
{
    if (r->zz.xlog && i < ZZ_MAX_EXEC && r->zz.exec_conn[i])
        send_log(r, r->zz.exec_conn[i], ZZ_PRINCIPAL_EXEC + i, 0);
}
