/* exec_view.c - the view of the execution replicas zz-agreed keeps for ZZ fault handling
 * (docs/fault-detection.md "In zz-agreed"): the awake set (r->zz.exec_state) and the id-list
 * helpers the other fault files use, the view on disk (conf->exec_view, one line per
 * execution replica), set-up and teardown of struct zz_wake and of the layer's state as a
 * whole (zz_exec_init, zz_exec_free), sending to controld and to the agreement peers, and
 * the fault counters in the stats file.
 *
 * Invariants: r->zz.exec_state is the awake set every certificate, row and EXEC-COMMIT push
 * uses; the file on disk holds only that view (no statement, round or resolution) and is
 * replaced atomically (write, fsync, rename), so after a crash it is the old view or the
 * new one. */
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

/* ---- awake set ---- */

int zz_exec_counts(const zz_replica *r, uint32_t i)
{
    return !r->zz.wake || (i < ZZ_MAX_EXEC && r->zz.exec_state[i] == ZZ_EXEC_AWAKE);
}

uint32_t zw_list_state(const zz_replica *r, uint8_t state, uint32_t *out)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < r->conf->n_exec && i < ZZ_MAX_EXEC; i++)
        if (r->zz.exec_state[i] == state)
            out[n++] = i;
    return n;
}

int zw_same_ids(const uint32_t *a, uint32_t na, const uint32_t *b, uint32_t nb)
{
    return na == nb && (na == 0 || memcmp(a, b, na * sizeof *a) == 0);
}

/* Whether one ascending id list holds every id of the other (equal lists too): the awake
 * sets of a round and of the follow-up at its seq, after it closed undecided (w6 -> w7). */
int zw_nested_ids(const uint32_t *a, uint32_t na, const uint32_t *b, uint32_t nb)
{
    const uint32_t *in = na <= nb ? a : b, *out = na <= nb ? b : a;
    uint32_t nin = na <= nb ? na : nb, nout = na <= nb ? nb : na, j = 0;
    for (uint32_t i = 0; i < nin; i++) {
        while (j < nout && out[j] < in[i])
            j++;
        if (j == nout || out[j] != in[i])
            return 0;
        j++;
    }
    return 1;
}

/* ids from a wire list<u32>: ascending, distinct, below ZZ_MAX_EXEC. */
int zw_ids_from(const zz_flist *l, uint32_t *out, uint32_t *n)
{
    if (l->count > ZZ_MAX_EXEC)
        return -1;
    for (uint32_t i = 0; i < l->count; i++) {
        out[i] = zz_u32_at(l, i);
        if (out[i] >= ZZ_MAX_EXEC || (i > 0 && out[i] <= out[i - 1]))
            return -1;
    }
    *n = l->count;
    return 0;
}

void zw_fmt_ids(char *s, size_t cap, const uint32_t *ids, uint32_t n)
{
    size_t o = 0;
    s[0] = '\0';
    for (uint32_t i = 0; i < n && o + 12 < cap; i++)
        o += (size_t)snprintf(s + o, cap - o, "%s%u", i ? "," : "", ids[i]);
}

/* ---- the view on disk (conf->exec_view) ----
 * One line per execution replica, `exec I awake|sleeping|convicted SEQ` (SEQ: the SHUTDOWN
 * seq that convicted it, 0 otherwise). Only the view is kept: no statement, round or
 * resolution, so a restarted replica never signs anything about a round it was in. */

static const char *const state_names[] = {"unknown", "awake", "sleeping", "convicted"};

void zw_save_view(zz_replica *r)
{
    const char *path = r->conf->exec_view;
    if (!path[0])
        return;
    char tmp[300];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) {
        zz_log("zz-agreed: replica %u: cannot write %s: %s\n", r->id, tmp,
               strerror(errno));
        return;
    }
    fprintf(f, "# zz-agreed replica %u: execution replicas' view; rewritten on every change\n",
            r->id);
    for (uint32_t i = 0; i < r->conf->n_exec; i++)
        fprintf(f, "exec %u %s %llu\n", i, state_names[r->zz.exec_state[i] & 3],
                (unsigned long long)r->zz.wake->convicted_seq[i]);
    /* fsync before rename: after a crash the file is the old view or the new one. */
    int ok = fflush(f) == 0 && fsync(fileno(f)) == 0;
    ok &= fclose(f) == 0;
    if (!ok || rename(tmp, path) != 0)
        zz_log("zz-agreed: replica %u: cannot write %s: %s\n", r->id, path,
               strerror(errno));
}

/* The next line of a view or keys file with any fields, split into tok (at most FIELDS_MAX,
 * more make the count FIELDS_MAX and fail the caller's field count): the field count, 0 at
 * the end, -1 with err set for a line no correct zz-agreed wrote (too long, a NUL byte).
 * Blank lines and '#' comments are skipped. (FIELDS_MAX: wake.h) */
int zw_next_fields(FILE *f, char **line, size_t *cap, uint32_t *lineno, char **tok,
                   const char *path, const char *what, char *err, size_t errcap)
{
    ssize_t got;
    while ((got = getline(line, cap, f)) >= 0) {
        ++*lineno;
        if (got > 255 || strlen(*line) != (size_t)got) {
            if (got > 255)
                snprintf(err, errcap, "%s:%u: line too long", path, *lineno);
            else
                snprintf(err, errcap, "%s:%u: NUL byte (not a %s file)", path, *lineno, what);
            return -1;
        }
        char *save = NULL;
        int nt = 0;
        for (char *p = strtok_r(*line, " \t\r\n", &save); p && nt < FIELDS_MAX;
             p = strtok_r(NULL, " \t\r\n", &save))
            tok[nt++] = p;
        if (nt > 0 && tok[0][0] != '#')
            return nt;
    }
    return 0;
}

int zw_parse_dec(const char *s, uint64_t max, uint64_t *out)
{
    if (!*s || strlen(s) > 20)
        return -1;
    uint64_t v = 0;
    for (const char *p = s; *p; p++) {
        if (*p < '0' || *p > '9' || v > (UINT64_MAX - (uint64_t)(*p - '0')) / 10)
            return -1;
        v = v * 10 + (uint64_t)(*p - '0');
    }
    if (v > max)
        return -1;
    *out = v;
    return 0;
}

/* A missing file means a first start; anything unreadable is an error naming the file, since
 * starting from the replica file instead could wake or count a convicted replica again. */
static int load_view(zz_replica *r, char *err, size_t errcap)
{
    const char *path = r->conf->exec_view;
    if (!path[0])
        return 0;
    FILE *f = fopen(path, "r");
    if (!f) {
        if (errno == ENOENT)
            return 0;
        snprintf(err, errcap, "%s: cannot open: %s", path, strerror(errno));
        return -1;
    }
    uint8_t state[ZZ_MAX_EXEC] = {0};
    uint64_t cseq[ZZ_MAX_EXEC] = {0};
    char *line = NULL;
    size_t cap = 0;
    uint32_t lineno = 0;
    int rc = 0, nt;
    char *tok[FIELDS_MAX];
    while (rc == 0 && (nt = zw_next_fields(f, &line, &cap, &lineno, tok, path, "view", err,
                                           errcap)) != 0) {
        if (nt < 0) {
            rc = -1;
            break;
        }
        uint64_t id, seq;
        int st = 0;
        for (int k = 1; k < 4 && nt == 4; k++)
            if (strcmp(tok[2], state_names[k]) == 0)
                st = k;
        if (nt != 4 || strcmp(tok[0], "exec") != 0 || !st ||
            zw_parse_dec(tok[1], ZZ_MAX_EXEC - 1, &id) != 0 ||
            zw_parse_dec(tok[3], UINT64_MAX, &seq)) {
            snprintf(err, errcap, "%s:%u: expected 'exec I awake|sleeping|convicted SEQ'", path,
                     lineno);
            rc = -1;
        } else if (id >= r->conf->n_exec) {
            snprintf(err, errcap, "%s:%u: replica %llu is not in the replica file's 0..%u",
                     path, lineno, (unsigned long long)id, r->conf->n_exec - 1);
            rc = -1;
        } else if (state[id]) {
            snprintf(err, errcap, "%s:%u: replica %llu listed twice", path, lineno,
                     (unsigned long long)id);
            rc = -1;
        } else {
            state[id] = (uint8_t)st;
            cseq[id] = seq;
        }
    }
    if (rc == 0 && ferror(f)) {
        snprintf(err, errcap, "%s: read error", path);
        rc = -1;
    }
    free(line);
    fclose(f);
    for (uint32_t i = 0; rc == 0 && i < r->conf->n_exec; i++)
        if (!state[i]) {
            snprintf(err, errcap, "%s: replica %u missing (the file must list 0..%u)", path, i,
                     r->conf->n_exec - 1);
            rc = -1;
        }
    if (rc != 0)
        return -1;
    memcpy(r->zz.exec_state, state, r->conf->n_exec);
    memcpy(r->zz.wake->convicted_seq, cseq, r->conf->n_exec * sizeof *cseq);
    char as[256], ss[256], cs[256];
    uint32_t ids[ZZ_MAX_EXEC];
    zw_fmt_ids(as, sizeof as, ids, zw_list_state(r, ZZ_EXEC_AWAKE, ids));
    zw_fmt_ids(ss, sizeof ss, ids, zw_list_state(r, ZZ_EXEC_SLEEPING, ids));
    zw_fmt_ids(cs, sizeof cs, ids, zw_list_state(r, ZZ_EXEC_CONVICTED, ids));
    zz_log("zz-agreed: replica %u: view from %s: awake [%s] sleeping [%s] convicted "
           "[%s]\n",
           r->id, path, as, ss, cs);
    return 0;
}

/* ---- set-up ---- */

int zz_wake_init(zz_replica *r, char *err, size_t errcap)
{
    if (!r->conf->external_exec || r->conf->n_exec == 0)
        return 0;
    struct zz_wake *w = calloc(1, sizeof *w);
    if (!w)
        goto oom;
    r->zz.wake = w;
    zz_buf_init(&w->buf);
    w->rows = calloc(r->n, sizeof *w->rows);
    w->sub = calloc(r->n, sizeof *w->sub);
    w->ev = calloc(r->n, sizeof *w->ev);
    w->sd_body = calloc(r->n, sizeof *w->sd_body);
    w->sd_len = calloc(r->n, sizeof *w->sd_len);
    w->dn_body = calloc(r->n, sizeof *w->dn_body);
    w->dn_len = calloc(r->n, sizeof *w->dn_len);
    if (!w->rows || !w->sub || !w->ev || !w->sd_body || !w->sd_len || !w->dn_body || !w->dn_len)
        goto oom;
    for (int c = 0; c < WAKE_CANDIDATES; c++) {
        w->cand[c].raw = calloc(r->n, sizeof *w->cand[c].raw);
        w->cand[c].len = calloc(r->n, sizeof *w->cand[c].len);
        if (!w->cand[c].raw || !w->cand[c].len)
            goto oom;
    }
    for (uint32_t i = 0; i < r->conf->n_exec; i++)
        r->zz.exec_state[i] = r->conf->exec[i].active ? ZZ_EXEC_AWAKE : ZZ_EXEC_SLEEPING;
    if (load_view(r, err, errcap) != 0 || zw_load_keys(r, err, errcap) != 0 ||
        zw_load_announced(r, err, errcap) != 0)
        return -1;
    zw_save_view(r); /* from the first start on, the file shows the view */
    for (uint32_t h = 0; h < ZZ_MAX_HOSTS; h++) {
        w->links[h] = -1;
        if (!r->conf->has_controld[h])
            continue;
        w->links[h] = zz_net_add_link(r->net, r->conf->controld[h].host,
                                      r->conf->controld[h].port);
        if (w->links[h] < 0) {
            snprintf(err, errcap, "controld of host %u: cannot resolve '%s'", h,
                     r->conf->controld[h].host);
            return -1;
        }
    }
    return 0;
oom:
    snprintf(err, errcap, "out of memory allocating fault detection state");
    return -1;
}

void zw_cand_clear(zz_replica *r, candidate *c)
{
    for (uint32_t s = 0; s < r->n; s++) {
        free(c->raw[s]);
        c->raw[s] = NULL;
        c->len[s] = 0;
    }
    c->seq = 0;
    c->count = 0;
    c->n_awake = 0;
}

uint64_t zz_fault_round_seq(const zz_replica *r)
{
    return r->zz.wake && r->zz.wake->open ? r->zz.wake->seq : 0;
}

/* The reports for the round's seq: detect.c's record while the ring holds it (copied into
 * w->rec on every use), then w->rec. */
zz_report_rec *zw_round_record(zz_replica *r)
{
    struct zz_wake *w = r->zz.wake;
    zz_report_rec *k = zz_detect_record(r, w->seq);
    if (k) {
        w->rec = *k;
        memset(w->rec.refs, 0, sizeof w->rec.refs);
        memset(w->rec.nrefs, 0, sizeof w->rec.nrefs);
        w->rec.timer = 0;
        return k;
    }
    return w->rec.seq == w->seq ? &w->rec : NULL;
}

static void round_clear(zz_replica *r, int keep_bodies)
{
    struct zz_wake *w = r->zz.wake;
    int was_open = w->open;
    if (w->resend_timer)
        zz_net_cancel(r->net, w->resend_timer);
    w->resend_timer = 0;
    free(w->wakeup_raw);
    w->wakeup_raw = NULL;
    w->wakeup_len = 0;
    for (uint32_t s = 0; s < r->n && !keep_bodies; s++) {
        free(w->sd_body[s]);
        w->sd_body[s] = NULL;
        w->sd_len[s] = 0;
    }
    w->open = 0;
    w->n_ev = 0;
    w->resolve_failed_logged = 0;
    if (was_open)
        zz_xlog_release_held(r);
}

void zw_round_clear(zz_replica *r)
{
    round_clear(r, 0);
}

/* Closing a round undecided keeps the SHUTDOWN bodies peers sent for it: they decided it
 * while we did not, and g+1 of them still certify its outcome at this seq for the follow-up
 * over the larger awake set (nested awake sets, zz_on_shutdown). Dropped, a body that
 * reached us just before we closed never counted, and the certificate of the peers that
 * decided was never complete here (tests/test_round_outcomes.py, seen in CI). */
void zw_round_close_undecided(zz_replica *r)
{
    round_clear(r, 1);
}

void zw_done_clear(zz_replica *r)
{
    struct zz_wake *w = r->zz.wake;
    for (uint32_t s = 0; s < r->n; s++) {
        free(w->dn_body[s]);
        w->dn_body[s] = NULL;
        w->dn_len[s] = 0;
    }
    free(w->applied);
    w->applied = NULL;
    w->applied_len = 0;
    w->done = 0;
}

void zz_wake_free(zz_replica *r)
{
    struct zz_wake *w = r->zz.wake;
    if (!w)
        return;
    if (w->dn_body && w->dn_len)
        zw_done_clear(r);
    free(w->dn_body);
    free(w->dn_len);
    if (w->rows && w->ev && w->sd_body && w->sd_len) {
        zw_round_clear(r);
        for (int c = 0; c < WAKE_CANDIDATES; c++)
            if (w->cand[c].raw && w->cand[c].len)
                zw_cand_clear(r, &w->cand[c]);
    }
    for (int c = 0; c < WAKE_CANDIDATES; c++) {
        free(w->cand[c].raw);
        free(w->cand[c].len);
    }
    free(w->rows);
    free(w->sub);
    free(w->ev);
    free(w->sd_body);
    free(w->sd_len);
    for (uint32_t i = 0; i < ZZ_MAX_EXEC; i++) {
        zz_pubkey_free(w->old_pub[i]);
        zz_mackey_free(w->old_mac[i]);
    }
    zz_buf_free(&w->buf);
    free(w);
    r->zz.wake = NULL;
}

/* ---- the layer's state as a whole (zzexec.h) ---- */

int zz_exec_init(zz_replica *r, char *err, size_t errcap)
{
    if (r->conf->external_exec) {
        r->zz.xlog = calloc(r->conf->exec_log ? r->conf->exec_log : 1, sizeof *r->zz.xlog);
        r->zz.n_reports = r->L + ZZ_DETECT_RECORDS;
        r->zz.reports = calloc(r->zz.n_reports, sizeof *r->zz.reports);
        if (!r->zz.xlog || !r->zz.reports) {
            snprintf(err, errcap, "out of memory allocating the execution log (exec_log=%u)",
                     r->conf->exec_log);
            return -1;
        }
    }
    return zz_wake_init(r, err, errcap);
}

void zz_exec_free(zz_replica *r)
{
    zz_wake_free(r);
    zz_xlog_free(r);
    zz_detect_free(r);
}

void zz_exec_on_close(zz_replica *r, const zz_conn *conn)
{
    for (uint32_t i = 0; i < ZZ_MAX_EXEC; i++)
        if (r->zz.exec_conn[i] == conn)
            r->zz.exec_conn[i] = NULL;
}

/* ---- sending ---- */

void zw_send_controld(zz_replica *r, uint32_t exec_id, const uint8_t *msg, size_t len,
                      uint8_t *sent_hosts)
{
    uint32_t h = r->conf->exec[exec_id].host;
    if (h >= ZZ_MAX_HOSTS || sent_hosts[h] || r->zz.wake->links[h] < 0)
        return;
    sent_hosts[h] = 1;
    if (zz_byz_silent(r))
        return;
    zz_net_send_link(r->net, r->zz.wake->links[h], msg, len);
    r->st.controld_sends++;
}

/* A WAKEUP to the controld of each woken replica's host; one that wakes nobody (§4a) to the
 * controld of every host with a replica of the service, like a SHUTDOWN: none has anything
 * to wake, but each one's audit log and replay guard then hold the certificate of the round
 * whose SHUTDOWN follows. */
void zw_send_wakeup_controld(zz_replica *r, const uint32_t *wake, uint32_t n_wake,
                             const uint8_t *msg, size_t len)
{
    uint8_t hosts[ZZ_MAX_HOSTS] = {0};
    if (n_wake == 0)
        for (uint32_t i = 0; i < r->conf->n_exec && i < ZZ_MAX_EXEC; i++)
            zw_send_controld(r, i, msg, len, hosts);
    for (uint32_t j = 0; j < n_wake; j++)
        zw_send_controld(r, wake[j], msg, len, hosts);
}

void zw_bcast_raw(zz_replica *r, const uint8_t *msg, size_t len)
{
    if (!zz_byz_silent(r))
        zz_net_bcast(r->net, msg, len);
}

/* ---- stats ---- */

static void write_ids(FILE *f, const char *name, const uint32_t *ids, uint32_t n)
{
    fprintf(f, "\"%s\": [", name);
    for (uint32_t i = 0; i < n; i++)
        fprintf(f, "%s%u", i ? ", " : "", ids[i]);
    fprintf(f, "], ");
}

/* Faults flagged here (a mismatch or a timeout) whose statement is still to be signed: the
 * row waits for every awake replica's report or the K·t1 deadline. A round is coming then,
 * although none is open; a drill or campaign that took the rack for settled in that gap
 * missed the wake-up that followed (campaign seed 3602, f = 2, round 130). Seqs at or
 * below the last decided round or dispatched while it was open are never signed. */
static uint32_t flags_waiting(const zz_replica *r)
{
    const struct zz_wake *w = r->zz.wake;
    uint32_t n = 0;
    if (!w)
        return 0;
    for (uint32_t i = 0; i < r->zz.n_reports; i++) {
        const zz_report_rec *k = &r->zz.reports[i];
        n += k->seq && k->flagged && !k->certified && !k->stated && k->seq > w->settled_seq &&
             k->seq > w->quiet_through;
    }
    return n;
}

void zz_wake_write_stats(zz_replica *r, void *file)
{
    FILE *f = file;
    const zz_rstats *s = &r->st;
    fprintf(f, "\"fault_statements_sent\": %llu, \"fault_statements_received\": %llu, "
               "\"fault_statements_rejected\": %llu, \"wakeups_sent\": %llu, "
               "\"wakeups_received\": %llu, \"wakeups_rejected\": %llu, "
               "\"wakeups_relayed\": %llu, \"shutdowns_sent\": %llu, "
               "\"shutdowns_received\": %llu, \"shutdowns_rejected\": %llu, "
               "\"controld_sends\": %llu, \"reply_affirms_sent\": %llu, "
               "\"detect_latency_last_ms\": %llu, \"detect_latency_max_ms\": %llu, "
               "\"spares_ready_received\": %llu, \"spares_ready_rejected\": %llu, "
               "\"spares_ready_held\": %llu, \"shutdowns_adopted_over_own\": %llu, "
               "\"shutdowns_merged\": %llu, ",
            (unsigned long long)s->fault_statements_sent,
            (unsigned long long)s->fault_statements_received,
            (unsigned long long)s->fault_statements_rejected,
            (unsigned long long)s->wakeups_sent, (unsigned long long)s->wakeups_received,
            (unsigned long long)s->wakeups_rejected, (unsigned long long)s->wakeups_relayed,
            (unsigned long long)s->shutdowns_sent, (unsigned long long)s->shutdowns_received,
            (unsigned long long)s->shutdowns_rejected, (unsigned long long)s->controld_sends,
            (unsigned long long)s->reply_affirms_sent,
            (unsigned long long)s->detect_latency_last_ms,
            (unsigned long long)s->detect_latency_max_ms,
            (unsigned long long)s->spares_ready_received,
            (unsigned long long)s->spares_ready_rejected, (unsigned long long)s->spares_ready_held,
            (unsigned long long)s->shutdowns_adopted_over_own,
            (unsigned long long)s->shutdowns_merged);
    uint32_t ids[ZZ_MAX_EXEC], n;
    n = zw_list_state(r, ZZ_EXEC_AWAKE, ids);
    write_ids(f, "exec_awake", ids, n);
    n = zw_list_state(r, ZZ_EXEC_SLEEPING, ids);
    write_ids(f, "exec_sleeping", ids, n);
    n = zw_list_state(r, ZZ_EXEC_CONVICTED, ids);
    write_ids(f, "exec_convicted", ids, n);
    if (r->zz.wake) {
        uint32_t nx = r->conf->n_exec < ZZ_MAX_EXEC ? r->conf->n_exec : ZZ_MAX_EXEC;
        fprintf(f, "\"exec_key_epoch\": [");
        for (uint32_t i = 0; i < nx; i++)
            fprintf(f, "%s%u", i ? ", " : "", r->zz.wake->key_epoch[i]);
        fprintf(f, "], \"exec_stale_key_drops\": [");
        for (uint32_t i = 0; i < nx; i++)
            fprintf(f, "%s%llu", i ? ", " : "", (unsigned long long)r->zz.wake->stale_key[i]);
        fprintf(f, "], ");
    }
    fprintf(f, "\"fault_round_open\": %d, \"fault_round_seq\": %llu, ",
            r->zz.wake ? r->zz.wake->open : 0,
            (unsigned long long)(r->zz.wake && r->zz.wake->open ? r->zz.wake->seq : 0));
    fprintf(f, "\"fault_flags_waiting\": %u, ", flags_waiting(r));
}
