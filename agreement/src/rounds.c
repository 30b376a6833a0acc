/* rounds.c - the open fault round and its resolution (docs/fault-detection.md "In
 * zz-agreed"): open a round on a WAKEUP (own or adopted), resend it to the woken replicas'
 * controld, have the woken replicas replay the log, and once they reported the round's seq
 * (or after WAKE_RESOLVE_MS) resolve it into a signed SHUTDOWN and apply its outcome to the
 * awake set. A round that wakes nobody (nobody asleep, 2f+1 awake) resolves as soon as the
 * awake replicas' reports decide a digest, and waits for that.
 *
 * Invariants: at most one round is open (w->open); a decided round is remembered (w->done,
 * w->settled_seq) so that a certificate for another outcome can still be adopted
 * (peer_certs.c); the view is saved on every change of the awake set. */
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

/* ---- the open round ---- */

static void try_resolve(zz_replica *r);

static void on_round_tick(void *ctx)
{
    zz_replica *r = ctx;
    struct zz_wake *w = r->zz.wake;
    w->resend_timer = 0;
    if (!w->open)
        return;
    zz_report_rec *k = zw_round_record(r);
    uint8_t hosts[ZZ_MAX_HOSTS] = {0};
    for (uint32_t j = 0; j < w->n_woken; j++)
        if (!k || !k->reported[w->woken[j]])
            zw_send_controld(r, w->woken[j], w->wakeup_raw, w->wakeup_len, hosts);
    try_resolve(r);
    if (w->open)
        w->resend_timer = zz_net_timer(r->net, WAKE_RESEND_MS, on_round_tick, r);
}

void zw_open_round(zz_replica *r, uint64_t seq, const uint32_t *awake, uint32_t n_awake,
                   const uint32_t *wake, uint32_t n_wake, const zz_frow *rows,
                   uint32_t nrows, const uint8_t *raw, uint32_t len)
{
    struct zz_wake *w = r->zz.wake;
    /* SHUTDOWN bodies for this round that came before it (zz_on_shutdown) stay. */
    uint8_t *early[ZZ_MAX_REPLICAS] = {0};
    uint32_t early_len[ZZ_MAX_REPLICAS] = {0};
    for (uint32_t s = 0; s < r->n && s < ZZ_MAX_REPLICAS; s++) {
        uint32_t l[4][ZZ_MAX_EXEC], n[4];
        const uint8_t *b = w->sd_body[s];
        if (b && zw_body_seq(b, w->sd_len[s]) == seq &&
            zw_body_lists(r, b, w->sd_len[s], l, n) == 0 &&
            zw_nested_ids(l[0], n[0], awake, n_awake)) {
            early[s] = w->sd_body[s];
            early_len[s] = w->sd_len[s];
            w->sd_body[s] = NULL;
            w->sd_len[s] = 0;
        }
    }
    zw_round_clear(r);
    for (uint32_t s = 0; s < r->n && s < ZZ_MAX_REPLICAS; s++) {
        w->sd_body[s] = early[s];
        w->sd_len[s] = early_len[s];
    }
    w->wakeup_raw = zz_memdup(raw, len);
    w->wakeup_len = w->wakeup_raw ? len : 0;
    w->open = 1;
    w->seq = seq;
    if (!zw_round_record(r) && w->rec.seq != seq) {
        /* adopted for a seq whose record is gone here: only later reports count */
        memset(&w->rec, 0, sizeof w->rec);
        w->rec.seq = seq;
    }
    w->n_awake = n_awake;
    memcpy(w->awake, awake, n_awake * sizeof *awake);
    w->n_woken = n_wake;
    memcpy(w->woken, wake, n_wake * sizeof *wake);
    w->n_ev = nrows < r->n ? nrows : r->n;
    memcpy(w->ev, rows, w->n_ev * sizeof *rows);
    w->opened_ms = zz_now_ms(r);
    for (uint32_t j = 0; j < n_wake; j++) {
        r->zz.exec_state[wake[j]] = ZZ_EXEC_AWAKE;
        zz_xlog_serve(r, wake[j]); /* not connected: gets the log once it registers */
    }
    zw_save_view(r);
    w->resend_timer = zz_net_timer(r->net, WAKE_RESEND_MS, on_round_tick, r);
    for (uint32_t s = 0; s < r->n && s < ZZ_MAX_REPLICAS; s++) {
        uint32_t l[4][ZZ_MAX_EXEC], n[4];
        const uint8_t *b = w->sd_body[s];
        uint32_t bl = w->sd_len[s];
        if (b && zw_count_body(r, w->sd_body, w->sd_len, b, bl) >= r->g + 1 &&
            zw_body_lists(r, b, bl, l, n) == 0) {
            uint8_t *copy = zz_memdup(b, bl); /* zw_adopt() frees the table it comes from */
            if (!copy)
                return;
            zw_adopt(r, copy, bl, seq, l[1], n[1], l[2], n[2], l[3], n[3]);
            free(copy);
            return;
        }
    }
    try_resolve(r);
}

void zw_apply_resolution(zz_replica *r, uint64_t seq, const uint32_t *convict, uint32_t nc,
                         const uint32_t *sleep, uint32_t ns, const uint32_t *active,
                         uint32_t na)
{
    struct zz_wake *w = r->zz.wake;
    for (uint32_t i = 0; i < nc; i++) {
        uint32_t x = convict[i];
        /* Re-applied (an adopted certificate, or a lower sibling's: check_done), its fresh
         * spare already announced: it stays asleep. A new conviction finds x awake. */
        if (r->zz.exec_state[x] == ZZ_EXEC_SLEEPING && w->convicted_seq[x] >= seq &&
            w->convicted_seq[x] <= w->settled_seq)
            continue;
        r->zz.exec_state[x] = ZZ_EXEC_CONVICTED;
        w->convicted_seq[x] = seq;
        zz_detect_forget(r, x, seq);
        if (w->spare_pending[x] == seq) {
            /* controld's SPARE-READY for this conviction came first (held, verified) */
            r->zz.exec_state[x] = ZZ_EXEC_SLEEPING;
            zz_log("zz-agreed: replica %u: SPARE-READY for %u (SHUTDOWN seq %llu) "
                   "held until now: sleeping again\n",
                   r->id, x, (unsigned long long)seq);
            zw_take_key(r, x, w->pend_epoch[x], w->pend_pub[x], w->pend_dh[x]);
        }
        w->spare_pending[x] = 0;
    }
    for (uint32_t i = 0; i < ns; i++)
        r->zz.exec_state[sleep[i]] = ZZ_EXEC_SLEEPING;
    for (uint32_t i = 0; i < na; i++)
        r->zz.exec_state[active[i]] = ZZ_EXEC_AWAKE;
    zw_save_view(r);
}

/* Remember the round just decided (seq, awake, the SHUTDOWN bodies seen so far and the one
 * applied); the open round's per-sender bodies move over, so none is lost. */
void zw_set_done(zz_replica *r, const uint8_t *applied, uint32_t applied_len,
                 const uint8_t *own, uint32_t own_len)
{
    struct zz_wake *w = r->zz.wake;
    zw_done_clear(r);
    if (r->last_exec > w->quiet_through)
        w->quiet_through = r->last_exec;
    uint8_t **tb = w->dn_body;
    uint32_t *tl = w->dn_len;
    w->dn_body = w->sd_body;
    w->dn_len = w->sd_len;
    w->sd_body = tb; /* all NULL after done_clear */
    w->sd_len = tl;
    if (own) {
        free(w->dn_body[r->id]);
        w->dn_body[r->id] = zz_memdup(own, own_len);
        w->dn_len[r->id] = w->dn_body[r->id] ? own_len : 0;
    }
    w->applied = zz_memdup(applied, applied_len);
    w->applied_len = w->applied ? applied_len : 0;
    w->done = 1;
    w->done_seq = w->seq;
    w->done_floor = w->settled_seq;
    if (w->seq > w->settled_seq)
        w->settled_seq = w->seq;
    w->n_done_awake = w->n_awake;
    memcpy(w->done_awake, w->awake, w->n_awake * sizeof *w->awake);
}


static void send_shutdown(zz_replica *r, const zz_fresolution *res)
{
    struct zz_wake *w = r->zz.wake;
    zz_buf *b = &w->buf;
    zz_buf_reset(b);
    size_t st = zz_begin(b, ZZ_SHUTDOWN, ZZ_AUTH_SIG, r->conf->service, r->id);
    zz_put_u64(b, w->seq);
    zz_put_u32_list(b, w->awake, w->n_awake);
    zz_put_u32_list(b, res->convict, res->n_convict);
    zz_put_u32_list(b, res->sleep, res->n_sleep);
    zz_put_u32_list(b, res->stay, res->n_stay);
    zz_end_body(b, st);
    if (zz_auth_sign(b, st, r->conf->sign) != 0 || b->oom)
        return;
    const uint8_t *msg = b->p + st;
    size_t len = b->len - st;
    /* The controld of every host with a replica of the service, not only of the round's:
     * convicted ones are destroyed, surplus ones put back to sleep, and every controld's
     * replay guard (zz/certs.py Freshness) follows every round. One that missed the rounds
     * since the last it saw took a later round over that round's awake set for a sibling of
     * it and refused its WAKEUP: the spare it hosts never woke (campaign seed 3202 round 14). */
    uint8_t hosts[ZZ_MAX_HOSTS] = {0};
    for (uint32_t i = 0; i < r->conf->n_exec && i < ZZ_MAX_EXEC; i++)
        zw_send_controld(r, i, msg, len, hosts);
    zw_bcast_raw(r, msg, len);
    r->st.shutdowns_sent++;
    char cs[256], ss[256], as[256];
    zw_fmt_ids(cs, sizeof cs, res->convict, res->n_convict);
    zw_fmt_ids(ss, sizeof ss, res->sleep, res->n_sleep);
    zw_fmt_ids(as, sizeof as, res->stay, res->n_stay);
    zz_log("zz-agreed: replica %u: SHUTDOWN seq %llu convict [%s] sleep [%s] active [%s]%s\n",
           r->id, (unsigned long long)w->seq, cs, ss, as,
           res->shortfall ? " (fewer than f+1 active)" : "");
    zw_apply_resolution(r, w->seq, res->convict, res->n_convict, res->sleep, res->n_sleep,
                        res->stay, res->n_stay);
    zz_msg own;
    if (zz_decode(msg, len, &own) == ZZ_OK)
        zw_set_done(r, own.body, own.body_len, own.body, own.body_len);
    zw_round_clear(r);
    zw_check_done(r);
}

/* Once the woken replicas reported the round's seq (or after WAKE_RESOLVE_MS), decide from
 * this replica's own view of every report (docs/fault-detection.md §5). */
static void try_resolve(zz_replica *r)
{
    struct zz_wake *w = r->zz.wake;
    if (!w->open)
        return;
    zz_report_rec *k = zw_round_record(r);
    if (!k)
        return;
    int all = 1;
    for (uint32_t j = 0; j < w->n_woken; j++)
        all &= k->reported[w->woken[j]];
    uint64_t waited = zz_now_ms(r) - w->opened_ms;
    int overdue = waited >= WAKE_RESOLVE_MS + (uint64_t)r->conf->detect_ceiling_ms;
    if (!all && !overdue)
        return;
    zz_freport rep[ZZ_MAX_EXEC];
    uint32_t nrep = 0;
    for (uint32_t pass = 0; pass < 2; pass++) {
        const uint32_t *ids = pass ? w->woken : w->awake;
        uint32_t n = pass ? w->n_woken : w->n_awake;
        for (uint32_t j = 0; j < n; j++) {
            uint32_t i = ids[j];
            rep[nrep].id = i;
            memset(&rep[nrep].e, 0, sizeof rep[nrep].e);
            if (k->reported[i]) {
                rep[nrep].e.state = k->late[i] ? ZZ_FENTRY_LATE : ZZ_FENTRY_ONTIME;
                memcpy(rep[nrep].e.dig, k->dig[i], ZZ_DIGEST_LEN);
            }
            nrep++;
        }
    }
    zz_fresolution res;
    if (zz_fault_resolve(w->ev, w->n_ev, r->conf->f, r->g, w->awake, w->n_awake, w->woken,
                         w->n_woken, rep, nrep, &res) != 0) {
        if (!w->resolve_failed_logged)
            zz_log("zz-agreed: replica %u: round at seq %llu cannot be resolved "
                   "(more than f faults?)\n",
                   r->id, (unsigned long long)w->seq);
        w->resolve_failed_logged = 1;
        return;
    }
    if (res.decided) {
        send_shutdown(r, &res);
        return;
    }
    /* A round that woke nobody (§4a) has 2f+1 awake, f+1 of them correct: they all report
     * the seq in the end (a slow woken replica of the round before replays it), and their
     * reports decide. Closing it undecided would only sign the same rows again. */
    if (w->n_woken == 0)
        return;
    /* Still no f+1 agree, and either everyone woken reported (the agreeing replicas were
     * faulty, scenario w6) or a woken replica is overdue (it crashed, or its host did: with
     * f = 2 a liar plus a dead spare, the round waited for it for good). Close this round:
     * the seq is judged again over the larger awake set, where a silent woken replica shows
     * as "-" and more spares can be woken. */
    zz_log("zz-agreed: replica %u: round at seq %llu undecided%s, next round\n", r->id,
           (unsigned long long)w->seq, all ? "" : " (a woken replica is overdue)");
    zw_round_close_undecided(r);
    if (!k->certified)
        zw_send_statement(r, k, 0);
}

void zz_wake_on_report(zz_replica *r, zz_report_rec *k)
{
    if (r->zz.wake && r->zz.wake->open && k->seq == r->zz.wake->seq)
        try_resolve(r);
}

int zz_wake_on_lost_report(zz_replica *r, uint32_t i, uint64_t seq, const uint8_t *digest)
{
    struct zz_wake *w = r->zz.wake;
    if (!w || i >= ZZ_MAX_EXEC || seq == 0 || w->rec.seq != seq)
        return 0;
    if (!w->rec.reported[i]) { /* the first report counts, as in detect.c */
        w->rec.reported[i] = 1;
        w->rec.late[i] = 1; /* its deadline passed long ago */
        memcpy(w->rec.dig[i], digest, ZZ_DIGEST_LEN);
    }
    if (w->open && w->seq == seq)
        try_resolve(r);
    return 1;
}
