/* wakeup.c - ZZ fault handling inside zz-agreed (§4.3, §4.7.3; docs/fault-detection.md "In
 * zz-agreed"): sign FAULT-STATEMENTs for seqs detect.c flags, collect the peers', send a
 * self-certifying WAKEUP once zz_fault_evaluate accepts them, adopt peers' WAKEUPs, and once
 * the woken replicas have reported, resolve the round into a signed SHUTDOWN; adopt a
 * certified SHUTDOWN that differs from our own resolution; take SPARE-READY from controld
 * (a convicted replica's fresh spare sleeps again); keep the view in conf->exec_view.
 *
 * Invariants: at most one round is open; while it is, no new statement is signed (its
 * rows would be about an awake set that is changing). r->exec_state is the awake set every
 * certificate, row and EXEC-COMMIT push uses. Everything received is verified here or in
 * replica.c before it changes any state; anything that fails is dropped and counted. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "faults.h"
#include "log.h"
#include "replica.h"

/* seqs whose statements are being collected at once: one unconfirmed candidate per signer
 * at most, and room for 16 that several signers share (cand_for) */
#define WAKE_CANDIDATES (ZZ_MAX_REPLICAS + 16)
#define WAKE_RESEND_MS 1000  /* WAKEUP to controld again while the woken have not reported */
#define WAKE_RESOLVE_MS 5000 /* + ceiling: resolve without the woken replicas' reports */
#define SUBSET_MAX 10        /* rows up to which every subset is tried as evidence */

typedef struct {
    uint64_t seq; /* 0 = free */
    uint32_t n_awake;
    uint32_t awake[ZZ_MAX_EXEC]; /* the statements' awake set (their row ids) */
    uint8_t **raw;               /* per signer: its signed FAULT-STATEMENT (owned) or NULL */
    uint32_t *len;
    uint32_t count;
    uint64_t first_ms;
} candidate;

struct zz_wake {
    candidate cand[WAKE_CANDIDATES];
    zz_frow *rows, *sub;     /* n scratch rows each: decoded statements, an evidence set */
    int links[ZZ_MAX_HOSTS]; /* net link to each host's controld, -1 = none */
    zz_buf buf;              /* encoder scratch (r->out is reused by zz_on_fetch) */
    /* the open round: a WAKEUP adopted, its SHUTDOWN not yet decided */
    int open;
    uint64_t seq;
    uint32_t awake[ZZ_MAX_EXEC], n_awake; /* the evidence's awake set */
    uint32_t woken[ZZ_MAX_EXEC], n_woken;
    zz_frow *ev; /* the evidence rows (n entries) */
    uint32_t n_ev;
    /* The round's seq's reports as detect.c last held them, plus those that came once its
     * record left the ring (reused L + 1024 seqs on: under the campaign's load 7 s, before a
     * slow woken replica reported and before the round was overdue, and the round never
     * resolved; seed 3202 round 14). It outlives an undecided round for the follow-up at
     * the same seq. No refs, no timer. */
    zz_report_rec rec;
    uint8_t *wakeup_raw; /* the adopted WAKEUP, resent to controld (owned) */
    uint32_t wakeup_len;
    uint64_t opened_ms, resend_timer;
    int resolve_failed_logged;
    uint8_t **sd_body; /* per sender: body of its SHUTDOWN for the open round (owned) */
    uint32_t *sd_len;
    /* The last round this replica closed with a decision (own or adopted): its SHUTDOWN
     * bodies per sender (ours at r->id) and the body whose outcome we applied, so that a
     * certificate for another outcome can still be adopted (docs/fault-detection.md). */
    int done;
    uint64_t done_seq;
    /* The highest seq any round was decided at: at or below it everything is settled, even
     * once done_seq moved down to a lower certified sibling (check_done). */
    uint64_t settled_seq;
    uint64_t done_floor; /* settled_seq before the done round: its siblings lie above */
    /* The last seq dispatched when a round was last decided: the seqs up to it ran while
     * the woken replicas were still recovering, so their lateness there is no evidence
     * (their timers ran out while they replayed). Never signed or evaluated. */
    uint64_t quiet_through;
    uint32_t done_awake[ZZ_MAX_EXEC], n_done_awake;
    uint8_t **dn_body; /* per sender (owned) */
    uint32_t *dn_len;
    uint8_t *applied; /* the body whose outcome r->exec_state holds (owned) */
    uint32_t applied_len;
    /* Per execution replica: the SHUTDOWN seq that convicted it (persisted), and a verified
     * SPARE-READY's seq that arrived before that conviction was known here (0 = none). */
    uint64_t convicted_seq[ZZ_MAX_EXEC];
    uint64_t spare_pending[ZZ_MAX_EXEC];
    /* Key epochs (docs/wire.md "Key epochs"): per execution slot, the epoch of the key its
     * current incarnation holds (0 = the key directory's), the announced public keys of the
     * current and the previous epoch (persisted in conf->exec_view + ".keys"), the previous
     * epoch's keys (to tell a stale-key message from noise), a held SPARE-READY's keys, and
     * how many messages signed or MACed with the previous key were dropped. */
    uint32_t key_epoch[ZZ_MAX_EXEC];
    uint8_t key_pub[ZZ_MAX_EXEC][2][ZZ_KEY_LEN]; /* [0] current, [1] previous: sign_pub */
    uint8_t key_dh[ZZ_MAX_EXEC][2][ZZ_KEY_LEN];  /* the same for dh_pub */
    uint32_t key_prev_epoch[ZZ_MAX_EXEC];
    zz_pubkey *old_pub[ZZ_MAX_EXEC];
    zz_mackey *old_mac[ZZ_MAX_EXEC];
    uint32_t pend_epoch[ZZ_MAX_EXEC];
    uint8_t pend_pub[ZZ_MAX_EXEC][ZZ_KEY_LEN], pend_dh[ZZ_MAX_EXEC][ZZ_KEY_LEN];
    uint64_t stale_key[ZZ_MAX_EXEC];
};

/* key epochs, with SPARE-READY at the end of this file */
static int load_keys(zz_replica *r, char *err, size_t errcap);
static void take_key(zz_replica *r, uint32_t x, uint32_t epoch, const uint8_t *pub,
                     const uint8_t *dh);

/* ---- awake set ---- */

int zz_exec_counts(const zz_replica *r, uint32_t i)
{
    return !r->wake || (i < ZZ_MAX_EXEC && r->exec_state[i] == ZZ_EXEC_AWAKE);
}

static uint32_t list_state(const zz_replica *r, uint8_t state, uint32_t *out)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < r->conf->n_exec && i < ZZ_MAX_EXEC; i++)
        if (r->exec_state[i] == state)
            out[n++] = i;
    return n;
}

static int same_ids(const uint32_t *a, uint32_t na, const uint32_t *b, uint32_t nb)
{
    return na == nb && (na == 0 || memcmp(a, b, na * sizeof *a) == 0);
}

/* Whether one ascending id list holds every id of the other (equal lists too): the awake
 * sets of a round and of the follow-up at its seq, after it closed undecided (w6 -> w7). */
static int nested_ids(const uint32_t *a, uint32_t na, const uint32_t *b, uint32_t nb)
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
static int ids_from(const zz_flist *l, uint32_t *out, uint32_t *n)
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

static void fmt_ids(char *s, size_t cap, const uint32_t *ids, uint32_t n)
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

static void save_view(zz_replica *r)
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
        fprintf(f, "exec %u %s %llu\n", i, state_names[r->exec_state[i] & 3],
                (unsigned long long)r->wake->convicted_seq[i]);
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
 * Blank lines and '#' comments are skipped. */
#define FIELDS_MAX 6
static int next_fields(FILE *f, char **line, size_t *cap, uint32_t *lineno, char **tok,
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

static int parse_dec(const char *s, uint64_t max, uint64_t *out)
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
    while (rc == 0 && (nt = next_fields(f, &line, &cap, &lineno, tok, path, "view", err,
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
            parse_dec(tok[1], ZZ_MAX_EXEC - 1, &id) != 0 || parse_dec(tok[3], UINT64_MAX, &seq)) {
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
    memcpy(r->exec_state, state, r->conf->n_exec);
    memcpy(r->wake->convicted_seq, cseq, r->conf->n_exec * sizeof *cseq);
    char as[256], ss[256], cs[256];
    uint32_t ids[ZZ_MAX_EXEC];
    fmt_ids(as, sizeof as, ids, list_state(r, ZZ_EXEC_AWAKE, ids));
    fmt_ids(ss, sizeof ss, ids, list_state(r, ZZ_EXEC_SLEEPING, ids));
    fmt_ids(cs, sizeof cs, ids, list_state(r, ZZ_EXEC_CONVICTED, ids));
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
    r->wake = w;
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
        r->exec_state[i] = r->conf->exec[i].active ? ZZ_EXEC_AWAKE : ZZ_EXEC_SLEEPING;
    if (load_view(r, err, errcap) != 0 || load_keys(r, err, errcap) != 0)
        return -1;
    save_view(r); /* from the first start on, the file shows the view */
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

static void cand_clear(zz_replica *r, candidate *c)
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
    return r->wake && r->wake->open ? r->wake->seq : 0;
}

/* The reports for the round's seq: detect.c's record while the ring holds it (copied into
 * w->rec on every use), then w->rec. */
static zz_report_rec *round_record(zz_replica *r)
{
    struct zz_wake *w = r->wake;
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

static void round_clear(zz_replica *r)
{
    struct zz_wake *w = r->wake;
    int was_open = w->open;
    if (w->resend_timer)
        zz_net_cancel(r->net, w->resend_timer);
    w->resend_timer = 0;
    free(w->wakeup_raw);
    w->wakeup_raw = NULL;
    w->wakeup_len = 0;
    for (uint32_t s = 0; s < r->n; s++) {
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

static void done_clear(zz_replica *r)
{
    struct zz_wake *w = r->wake;
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
    struct zz_wake *w = r->wake;
    if (!w)
        return;
    if (w->dn_body && w->dn_len)
        done_clear(r);
    free(w->dn_body);
    free(w->dn_len);
    if (w->rows && w->ev && w->sd_body && w->sd_len) {
        round_clear(r);
        for (int c = 0; c < WAKE_CANDIDATES; c++)
            if (w->cand[c].raw && w->cand[c].len)
                cand_clear(r, &w->cand[c]);
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
    r->wake = NULL;
}

/* ---- sending ---- */

static void send_controld(zz_replica *r, uint32_t exec_id, const uint8_t *msg, size_t len,
                          uint8_t *sent_hosts)
{
    uint32_t h = r->conf->exec[exec_id].host;
    if (h >= ZZ_MAX_HOSTS || sent_hosts[h] || r->wake->links[h] < 0)
        return;
    sent_hosts[h] = 1;
    if (r->conf->byzantine == ZZ_BYZ_SILENT)
        return;
    zz_net_send_link(r->net, r->wake->links[h], msg, len);
    r->st.controld_sends++;
}

static void bcast_raw(zz_replica *r, const uint8_t *msg, size_t len)
{
    if (r->conf->byzantine != ZZ_BYZ_SILENT)
        zz_net_bcast(r->net, msg, len);
}

/* ---- candidates: statements collected per (seq, awake set) ---- */

/* The candidate for (seq, awake), made for `signer`'s statement if needed; NULL if there is
 * no room. Bounded per signer (docs/fault-detection.md, "Bounded evidence"): a candidate
 * only `signer` signed is its own, and a peer's new one replaces it, so each peer holds at
 * most one and there is always room for all of them; another signer's own candidate is
 * never evicted, shared ones go by fewest signers, then oldest. */
static candidate *cand_for(zz_replica *r, uint64_t seq, const uint32_t *awake, uint32_t n,
                           uint32_t signer)
{
    struct zz_wake *w = r->wake;
    candidate *free_c = NULL, *own = NULL, *victim = NULL;
    for (int i = 0; i < WAKE_CANDIDATES; i++) {
        candidate *c = &w->cand[i];
        if (c->seq == seq && same_ids(c->awake, c->n_awake, awake, n))
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
    cand_clear(r, c);
    c->seq = seq;
    c->n_awake = n;
    memcpy(c->awake, awake, n * sizeof *awake);
    c->first_ms = zz_now_ms(r);
    return c;
}

/* A verified FAULT-STATEMENT into its row form; -1 if it is not one a correct replica
 * could sign (row longer than ZZ_MAX_EXEC, ids not ascending). */
static int row_from(const zz_msg *m, zz_frow *row)
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

static void open_round(zz_replica *r, uint64_t seq, const uint32_t *awake, uint32_t n_awake,
                       const uint32_t *wake, uint32_t n_wake, const zz_frow *rows,
                       uint32_t nrows, const uint8_t *raw, uint32_t len);

/* Evidence sets to try, best first: every subset of at least g+1 rows by falling size when
 * there are few rows (a faulty signer's row can spoil a set that is convictable without it),
 * else the full set and the sets missing one row. */
static uint32_t evidence_masks(uint32_t nrows, uint32_t min, uint64_t *out, uint32_t cap)
{
    uint64_t full = nrows >= 64 ? UINT64_MAX : (1ULL << nrows) - 1;
    uint32_t n = 0;
    if (nrows <= SUBSET_MAX) {
        for (uint32_t pc = nrows; pc >= min && pc > 0; pc--)
            for (uint64_t mask = full; mask > 0 && n < cap; mask--)
                if ((uint32_t)__builtin_popcountll(mask) == pc)
                    out[n++] = mask;
        return n;
    }
    out[n++] = full;
    for (uint32_t i = 0; i < nrows && n < cap && nrows - 1 >= min; i++)
        out[n++] = full & ~(1ULL << i);
    return n;
}

/* Try to turn the candidate's statements into a WAKEUP (docs/fault-detection.md §4). */
static void try_evaluate(zz_replica *r, candidate *c)
{
    struct zz_wake *w = r->wake;
    /* A seq at or below the last decided round is settled: controld refuses its WAKEUP as
     * stale, so it would wake nobody while this replica counted the spare awake. Statements
     * kept from before that round can come back here once the awake set is the one they
     * name again (retry_candidates after a SPARE-READY; seen in the campaign). */
    if (c->seq <= w->settled_seq || c->seq <= w->quiet_through) {
        cand_clear(r, c);
        return;
    }
    if (w->open || c->count < r->g + 1)
        return;
    uint32_t awake[ZZ_MAX_EXEC], sleeping[ZZ_MAX_EXEC];
    uint32_t n_awake = list_state(r, ZZ_EXEC_AWAKE, awake);
    uint32_t n_sleeping = list_state(r, ZZ_EXEC_SLEEPING, sleeping);
    if (n_sleeping == 0 || !same_ids(awake, n_awake, c->awake, c->n_awake))
        return;
    uint32_t signer[ZZ_MAX_REPLICAS], nrows = 0;
    for (uint32_t s = 0; s < r->n; s++) {
        zz_msg m;
        if (!c->raw[s] || zz_decode(c->raw[s], c->len[s], &m) != ZZ_OK ||
            row_from(&m, &w->rows[nrows]) != 0)
            continue;
        signer[nrows++] = s;
    }
    static const uint32_t mask_cap = (1u << SUBSET_MAX) + ZZ_MAX_REPLICAS + 1;
    uint64_t masks[(1u << SUBSET_MAX) + ZZ_MAX_REPLICAS + 1];
    uint32_t nmasks = evidence_masks(nrows, r->g + 1, masks, mask_cap);
    uint32_t wake[ZZ_MAX_EXEC], n_wake = 0, k = 0;
    uint64_t best_mask = 0;
    zz_frow *sub = w->sub;
    for (uint32_t t = 0; t < nmasks && !best_mask; t++) {
        k = 0;
        for (uint32_t i = 0; i < nrows; i++)
            if (masks[t] & (1ULL << i))
                sub[k++] = w->rows[i];
        int reason = zz_fault_evaluate(sub, k, r->conf->f, r->g, c->seq, awake, n_awake,
                                       sleeping, n_sleeping, wake, &n_wake);
        if (reason == ZZ_FAULT_OK) {
            if (n_wake == 0)
                return; /* justified, but nobody is left asleep to wake */
            best_mask = masks[t];
        }
    }
    if (!best_mask)
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
    uint8_t hosts[ZZ_MAX_HOSTS] = {0};
    for (uint32_t i = 0; i < n_wake; i++)
        send_controld(r, wake[i], raw, len, hosts);
    bcast_raw(r, raw, len);
    r->st.wakeups_sent++;
    zz_report_rec *rec = zz_detect_record(r, c->seq);
    uint64_t now = zz_now_ms(r);
    uint64_t since = rec && rec->flagged && rec->flag_ms ? rec->flag_ms : c->first_ms;
    uint64_t lat = now > since ? now - since : 0;
    r->st.detect_latency_last_ms = lat;
    if (lat > r->st.detect_latency_max_ms)
        r->st.detect_latency_max_ms = lat;
    char ws[256], ss[256];
    fmt_ids(ws, sizeof ws, wake, n_wake);
    fmt_ids(ss, sizeof ss, who, k);
    zz_log("zz-agreed: replica %u: WAKEUP seq %llu wake [%s], evidence from agreement replicas "
           "[%s], %llu ms after the fault was flagged\n",
           r->id, (unsigned long long)c->seq, ws, ss, (unsigned long long)lat);
    uint64_t seq = c->seq;
    uint32_t cawake[ZZ_MAX_EXEC], cn = c->n_awake;
    memcpy(cawake, c->awake, cn * sizeof *cawake);
    cand_clear(r, c);
    open_round(r, seq, cawake, cn, wake, n_wake, sub, k, raw, len);
    free(raw);
}

/* Statements collected while nobody was asleep wake no one; once a spare sleeps again
 * (SPARE-READY), they may (a crash of the partner of a convicted replica before its fresh
 * spare was ready would otherwise stall the service until some later seq fails too). */
static void retry_candidates(zz_replica *r)
{
    struct zz_wake *w = r->wake;
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
static void send_statement(zz_replica *r, const zz_report_rec *k, int blame_first)
{
    struct zz_wake *w = r->wake;
    uint32_t awake[ZZ_MAX_EXEC];
    uint32_t n_awake = list_state(r, ZZ_EXEC_AWAKE, awake);
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
    bcast_raw(r, raw, len);
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
    if (!r->wake || r->wake->open || k->certified || k->seq <= r->wake->quiet_through)
        return;
    send_statement(r, k, 0);
}

void zz_wake_on_certified(zz_replica *r, zz_report_rec *k)
{
    /* Test-only Byzantine agreement replica: a signed statement blaming the lowest awake
     * (correct) replica for every certified seq; alone it must never wake anyone. */
    if (r->wake && r->conf->byzantine == ZZ_BYZ_FALSE_FAULT)
        send_statement(r, k, 1);
}

void zz_on_fault_statement(zz_replica *r, const zz_msg *m)
{
    struct zz_wake *w = r->wake;
    zz_frow row;
    if (!w || m->sender == r->id || row_from(m, &row) != 0) {
        r->st.fault_statements_rejected++;
        return;
    }
    /* Only for a seq of the report window (detect.c): above it nothing was dispatched by a
     * replica we keep up with; dropped and counted for the signer. Below it: stale. */
    int win = r->reports ? zz_detect_window(r, row.seq) : 0;
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

/* ---- the open round ---- */

/* The woken replica replays the committed log like any execution replica that registers:
 * answer it as if it had just sent FETCH{kind 3, seq 0} on its registered connection. */
static void serve_log(zz_replica *r, uint32_t i)
{
    static const uint8_t null_digest[ZZ_DIGEST_LEN];
    if (!r->exec_conn[i])
        return; /* not connected: it registers (and gets the log) once it runs */
    zz_buf b;
    zz_buf_init(&b);
    size_t st = zz_enc_fetch(&b, r->conf->service, ZZ_PRINCIPAL_EXEC + i, ZZ_FETCH_LOG, 0,
                             null_digest);
    zz_put_u16(&b, 0); /* an empty MAC vector: this message never leaves the replica */
    zz_msg m;
    if (!b.oom && zz_decode(b.p + st, b.len - st, &m) == ZZ_OK)
        zz_on_fetch(r, r->exec_conn[i], &m);
    zz_buf_free(&b);
}

static void try_resolve(zz_replica *r);
static uint64_t body_seq(const uint8_t *p, uint32_t len);
static int body_lists(zz_replica *r, const uint8_t *p, uint32_t len,
                      uint32_t out[4][ZZ_MAX_EXEC], uint32_t n[4]);
static uint32_t count_body(zz_replica *r, uint8_t **bodies, const uint32_t *lens,
                           const uint8_t *body, uint32_t len);
static void adopt(zz_replica *r, const uint8_t *body, uint32_t len, uint64_t seq,
                  const uint32_t *convict, uint32_t nc, const uint32_t *sleep, uint32_t ns,
                  const uint32_t *active, uint32_t nact);

static void on_round_tick(void *ctx)
{
    zz_replica *r = ctx;
    struct zz_wake *w = r->wake;
    w->resend_timer = 0;
    if (!w->open)
        return;
    zz_report_rec *k = round_record(r);
    uint8_t hosts[ZZ_MAX_HOSTS] = {0};
    for (uint32_t j = 0; j < w->n_woken; j++)
        if (!k || !k->reported[w->woken[j]])
            send_controld(r, w->woken[j], w->wakeup_raw, w->wakeup_len, hosts);
    try_resolve(r);
    if (w->open)
        w->resend_timer = zz_net_timer(r->net, WAKE_RESEND_MS, on_round_tick, r);
}

static void open_round(zz_replica *r, uint64_t seq, const uint32_t *awake, uint32_t n_awake,
                       const uint32_t *wake, uint32_t n_wake, const zz_frow *rows,
                       uint32_t nrows, const uint8_t *raw, uint32_t len)
{
    struct zz_wake *w = r->wake;
    /* SHUTDOWN bodies for this round that came before it (zz_on_shutdown) stay. */
    uint8_t *early[ZZ_MAX_REPLICAS] = {0};
    uint32_t early_len[ZZ_MAX_REPLICAS] = {0};
    for (uint32_t s = 0; s < r->n && s < ZZ_MAX_REPLICAS; s++) {
        uint32_t l[4][ZZ_MAX_EXEC], n[4];
        const uint8_t *b = w->sd_body[s];
        if (b && body_seq(b, w->sd_len[s]) == seq &&
            body_lists(r, b, w->sd_len[s], l, n) == 0 && nested_ids(l[0], n[0], awake, n_awake)) {
            early[s] = w->sd_body[s];
            early_len[s] = w->sd_len[s];
            w->sd_body[s] = NULL;
            w->sd_len[s] = 0;
        }
    }
    round_clear(r);
    for (uint32_t s = 0; s < r->n && s < ZZ_MAX_REPLICAS; s++) {
        w->sd_body[s] = early[s];
        w->sd_len[s] = early_len[s];
    }
    w->wakeup_raw = zz_memdup(raw, len);
    w->wakeup_len = w->wakeup_raw ? len : 0;
    w->open = 1;
    w->seq = seq;
    if (!round_record(r) && w->rec.seq != seq) {
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
        r->exec_state[wake[j]] = ZZ_EXEC_AWAKE;
        serve_log(r, wake[j]);
    }
    save_view(r);
    w->resend_timer = zz_net_timer(r->net, WAKE_RESEND_MS, on_round_tick, r);
    for (uint32_t s = 0; s < r->n && s < ZZ_MAX_REPLICAS; s++) {
        uint32_t l[4][ZZ_MAX_EXEC], n[4];
        const uint8_t *b = w->sd_body[s];
        uint32_t bl = w->sd_len[s];
        if (b && count_body(r, w->sd_body, w->sd_len, b, bl) >= r->g + 1 &&
            body_lists(r, b, bl, l, n) == 0) {
            uint8_t *copy = zz_memdup(b, bl); /* adopt() frees the table it comes from */
            if (!copy)
                return;
            adopt(r, copy, bl, seq, l[1], n[1], l[2], n[2], l[3], n[3]);
            free(copy);
            return;
        }
    }
    try_resolve(r);
}

static void apply_resolution(zz_replica *r, uint64_t seq, const uint32_t *convict, uint32_t nc,
                             const uint32_t *sleep, uint32_t ns, const uint32_t *active,
                             uint32_t na)
{
    struct zz_wake *w = r->wake;
    for (uint32_t i = 0; i < nc; i++) {
        uint32_t x = convict[i];
        /* Re-applied (an adopted certificate, or a lower sibling's: check_done), its fresh
         * spare already announced: it stays asleep. A new conviction finds x awake. */
        if (r->exec_state[x] == ZZ_EXEC_SLEEPING && w->convicted_seq[x] >= seq &&
            w->convicted_seq[x] <= w->settled_seq)
            continue;
        r->exec_state[x] = ZZ_EXEC_CONVICTED;
        w->convicted_seq[x] = seq;
        zz_detect_forget(r, x, seq);
        if (w->spare_pending[x] == seq) {
            /* controld's SPARE-READY for this conviction came first (held, verified) */
            r->exec_state[x] = ZZ_EXEC_SLEEPING;
            zz_log("zz-agreed: replica %u: SPARE-READY for %u (SHUTDOWN seq %llu) "
                   "held until now: sleeping again\n",
                   r->id, x, (unsigned long long)seq);
            take_key(r, x, w->pend_epoch[x], w->pend_pub[x], w->pend_dh[x]);
        }
        w->spare_pending[x] = 0;
    }
    for (uint32_t i = 0; i < ns; i++)
        r->exec_state[sleep[i]] = ZZ_EXEC_SLEEPING;
    for (uint32_t i = 0; i < na; i++)
        r->exec_state[active[i]] = ZZ_EXEC_AWAKE;
    save_view(r);
}

/* Remember the round just decided (seq, awake, the SHUTDOWN bodies seen so far and the one
 * applied); the open round's per-sender bodies move over, so none is lost. */
static void set_done(zz_replica *r, const uint8_t *applied, uint32_t applied_len,
                     const uint8_t *own, uint32_t own_len)
{
    struct zz_wake *w = r->wake;
    done_clear(r);
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

static void check_done(zz_replica *r);

static void send_shutdown(zz_replica *r, const zz_fresolution *res)
{
    struct zz_wake *w = r->wake;
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
        send_controld(r, i, msg, len, hosts);
    bcast_raw(r, msg, len);
    r->st.shutdowns_sent++;
    char cs[256], ss[256], as[256];
    fmt_ids(cs, sizeof cs, res->convict, res->n_convict);
    fmt_ids(ss, sizeof ss, res->sleep, res->n_sleep);
    fmt_ids(as, sizeof as, res->stay, res->n_stay);
    zz_log("zz-agreed: replica %u: SHUTDOWN seq %llu convict [%s] sleep [%s] active [%s]%s\n",
           r->id, (unsigned long long)w->seq, cs, ss, as,
           res->shortfall ? " (fewer than f+1 active)" : "");
    apply_resolution(r, w->seq, res->convict, res->n_convict, res->sleep, res->n_sleep,
                     res->stay, res->n_stay);
    zz_msg own;
    if (zz_decode(msg, len, &own) == ZZ_OK)
        set_done(r, own.body, own.body_len, own.body, own.body_len);
    round_clear(r);
    check_done(r);
}

/* Once the woken replicas reported the round's seq (or after WAKE_RESOLVE_MS), decide from
 * this replica's own view of every report (docs/fault-detection.md §5). */
static void try_resolve(zz_replica *r)
{
    struct zz_wake *w = r->wake;
    if (!w->open)
        return;
    zz_report_rec *k = round_record(r);
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
    /* Still no f+1 agree, and either everyone woken reported (the agreeing replicas were
     * faulty, scenario w6) or a woken replica is overdue (it crashed, or its host did: with
     * f = 2 a liar plus a dead spare, the round waited for it for good). Close this round:
     * the seq is judged again over the larger awake set, where a silent woken replica shows
     * as "-" and more spares can be woken. */
    zz_log("zz-agreed: replica %u: round at seq %llu undecided%s, next round\n", r->id,
           (unsigned long long)w->seq, all ? "" : " (a woken replica is overdue)");
    round_clear(r);
    if (!k->certified)
        send_statement(r, k, 0);
}

void zz_wake_on_report(zz_replica *r, zz_report_rec *k)
{
    if (r->wake && r->wake->open && k->seq == r->wake->seq)
        try_resolve(r);
}

int zz_wake_on_lost_report(zz_replica *r, uint32_t i, uint64_t seq, const uint8_t *digest)
{
    struct zz_wake *w = r->wake;
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

/* ---- WAKEUP and SHUTDOWN from peers ---- */

static const char *check_wakeup(zz_replica *r, const zz_msg *m, uint32_t *nrows_out,
                                 uint32_t *wake, uint32_t *n_wake)
{
    struct zz_wake *w = r->wake;
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
        if (row_from(&s, &w->rows[nrows]) != 0)
            return "evidence row";
        nrows++;
    }
    uint32_t sleeping[ZZ_MAX_EXEC], n_sleeping, claimed[ZZ_MAX_EXEC], n_claimed;
    if (ids_from(&q->sleeping, sleeping, &n_sleeping) != 0 ||
        ids_from(&q->wake, claimed, &n_claimed) != 0)
        return "replica lists";
    int reason = zz_fault_evaluate(w->rows, nrows, r->conf->f, r->g, q->seq, w->rows[0].ids,
                                   w->rows[0].n, sleeping, n_sleeping, wake, n_wake);
    if (reason != ZZ_FAULT_OK)
        return zz_fault_reason_name(reason);
    if (!same_ids(wake, *n_wake, claimed, n_claimed) || n_claimed == 0)
        return "wake differs from the evidence's choice";
    for (uint32_t j = 0; j < n_claimed; j++)
        if (claimed[j] >= r->conf->n_exec)
            return "wake names an unknown replica";
    *nrows_out = nrows;
    return NULL;
}

void zz_on_wakeup(zz_replica *r, const zz_msg *m)
{
    struct zz_wake *w = r->wake;
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
        same_ids(w->awake, w->n_awake, rows[0].ids, rows[0].n))
        return; /* the round we are in */
    if (m->u.wakeup.seq <= w->settled_seq)
        return; /* settled: controld refuses it as stale too */
    uint32_t awake[ZZ_MAX_EXEC];
    uint32_t n_awake = list_state(r, ZZ_EXEC_AWAKE, awake);
    int fits = !w->open && same_ids(awake, n_awake, rows[0].ids, rows[0].n);
    for (uint32_t j = 0; fits && j < n_wake; j++)
        fits = r->exec_state[wake[j]] == ZZ_EXEC_SLEEPING;
    if (!fits)
        return; /* valid but about another awake set: an old round, or one we are past */
    char ws[256];
    fmt_ids(ws, sizeof ws, wake, n_wake);
    zz_log("zz-agreed: replica %u: WAKEUP seq %llu wake [%s] adopted from replica %u\n",
           r->id, (unsigned long long)m->u.wakeup.seq, ws, m->sender);
    /* Relay it: its sender may be faulty and have told no controld. */
    uint8_t hosts[ZZ_MAX_HOSTS] = {0};
    for (uint32_t j = 0; j < n_wake; j++)
        send_controld(r, wake[j], m->raw, m->raw_len, hosts);
    r->st.wakeups_relayed++;
    /* rows live in w->rows, which open_round's evaluation paths do not touch */
    zz_frow *copy = calloc(nrows, sizeof *copy);
    if (!copy)
        return;
    memcpy(copy, rows, nrows * sizeof *copy);
    open_round(r, m->u.wakeup.seq, copy[0].ids, copy[0].n, wake, n_wake, copy, nrows, m->raw,
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
static int body_lists(zz_replica *r, const uint8_t *p, uint32_t len,
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
static uint64_t body_seq(const uint8_t *p, uint32_t len)
{
    uint64_t v = 0;
    for (uint32_t i = 0; i < 8 && i < len; i++)
        v = v << 8 | p[i];
    return v;
}

/* Between two certified outcomes of one awake set: the lower seq, then the smaller body. */
static int outcome_cmp(const uint8_t *a, uint32_t la, const uint8_t *b, uint32_t lb)
{
    uint64_t sa = body_seq(a, la), sb = body_seq(b, lb);
    if (sa != sb)
        return sa < sb ? -1 : 1;
    return body_cmp(a, la, b, lb);
}

static uint32_t count_body(zz_replica *r, uint8_t **bodies, const uint32_t *lens,
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
        if (!named && x < ZZ_MAX_EXEC && r->exec_state[x] == ZZ_EXEC_AWAKE)
            r->exec_state[x] = ZZ_EXEC_SLEEPING;
    }
}

/* After this replica decided a round, g+1 identical SHUTDOWN bodies from distinct agreement
 * replicas for another outcome win over ours, unless ours is certified too; between two
 * certified outcomes (correct replicas split) the lower seq, then the smaller body wins, so
 * every correct replica ends on the same one whatever order the bodies arrive in. Another
 * outcome may be at a lower seq of the same awake set: one fault flagged at two adjacent
 * seqs, where some replicas gathered g+1 statements for one first and some for the other
 * (campaign seed 3001 rounds 17, 22, 44); or at the same seq over a larger or smaller awake
 * set: the follow-up of a round that closed undecided elsewhere (seed 3202 round 18). */
static void check_done(zz_replica *r)
{
    struct zz_wake *w = r->wake;
    if (!w->done || w->open || !w->applied)
        return;
    const uint8_t *best = NULL;
    uint32_t best_len = 0, best_n = 0;
    for (uint32_t s = 0; s < r->n; s++) {
        const uint8_t *b = w->dn_body[s];
        uint32_t bl = w->dn_len[s];
        if (!b || body_cmp(b, bl, w->applied, w->applied_len) == 0)
            continue;
        uint32_t c = count_body(r, w->dn_body, w->dn_len, b, bl);
        if (c >= r->g + 1 && (!best || outcome_cmp(b, bl, best, best_len) < 0)) {
            best = b;
            best_len = bl;
            best_n = c;
        }
    }
    if (!best)
        return;
    uint32_t own = count_body(r, w->dn_body, w->dn_len, w->applied, w->applied_len);
    if (own >= r->g + 1 && outcome_cmp(w->applied, w->applied_len, best, best_len) < 0)
        return;
    uint32_t l[4][ZZ_MAX_EXEC], n[4];
    if (body_lists(r, best, best_len, l, n) != 0)
        return;
    uint8_t *copy = zz_memdup(best, best_len);
    if (!copy)
        return;
    uint32_t ol[4][ZZ_MAX_EXEC], on[4];
    if (body_lists(r, w->applied, w->applied_len, ol, on) == 0)
        for (int a = 1; a < 4; a++)
            sleep_unnamed(r, ol[a], on[a], l, n);
    w->done_seq = body_seq(best, best_len);
    char cs[256], ss[256], as[256];
    fmt_ids(cs, sizeof cs, l[1], n[1]);
    fmt_ids(ss, sizeof ss, l[2], n[2]);
    fmt_ids(as, sizeof as, l[3], n[3]);
    zz_log("zz-agreed: replica %u: SHUTDOWN seq %llu convict [%s] sleep [%s] active [%s] "
           "adopted from a certificate of %u over our own outcome (certified by %u)\n",
           r->id, (unsigned long long)w->done_seq, cs, ss, as, best_n, own);
    r->st.shutdowns_adopted_over_own++;
    /* Undo nothing: the certified lists name every replica of the round, so applying them
     * sets each one's state afresh. */
    apply_resolution(r, w->done_seq, l[1], n[1], l[2], n[2], l[3], n[3]);
    free(w->applied);
    w->applied = copy;
    w->applied_len = best_len;
}

/* Apply a SHUTDOWN certificate (g+1 identical bodies in sd_body) for the round w->seq /
 * w->awake, or for a lower sibling of it (its seq becomes the decided one). */
static void adopt(zz_replica *r, const uint8_t *body, uint32_t len, uint64_t seq,
                  const uint32_t *convict, uint32_t nc, const uint32_t *sleep, uint32_t ns,
                  const uint32_t *active, uint32_t nact)
{
    struct zz_wake *w = r->wake;
    uint32_t same = count_body(r, w->sd_body, w->sd_len, body, len);
    char cs[256], as[256];
    fmt_ids(cs, sizeof cs, convict, nc);
    fmt_ids(as, sizeof as, active, nact);
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
    apply_resolution(r, seq, convict, nc, sleep, ns, active, nact);
    set_done(r, body, len, NULL, 0);
    w->done_seq = seq; /* a lower sibling's certificate: the open round's seq is settled */
    round_clear(r);
    check_done(r);
}

void zz_on_shutdown(zz_replica *r, const zz_msg *m)
{
    struct zz_wake *w = r->wake;
    const zz_shutdown *q = &m->u.shutdown;
    uint32_t awake[ZZ_MAX_EXEC], na, convict[ZZ_MAX_EXEC], nc, sleep[ZZ_MAX_EXEC], ns,
        active[ZZ_MAX_EXEC], nact;
    if (!w || ids_from(&q->awake, awake, &na) != 0 || ids_from(&q->convict, convict, &nc) != 0 ||
        ids_from(&q->sleep, sleep, &ns) != 0 || ids_from(&q->active, active, &nact) != 0) {
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
    uint32_t ncur = list_state(r, ZZ_EXEC_AWAKE, cur);
    if (!w->open && q->seq > w->settled_seq && nested_ids(awake, na, cur, ncur)) {
        /* A round not open here yet: peers that adopted the WAKEUP first may decide and
         * send their SHUTDOWN before the WAKEUP or the statements reach us (campaign seed
         * 3101 round 26: the bodies were dropped, the round opened after them and closed
         * undecided). Kept for that round (open_round keeps them); g+1 identical bodies
         * are a certificate whether or not it ever opens. Nested awake sets: peers that
         * decided a round we just closed undecided (our awake set is larger now). */
        free(w->sd_body[s]);
        w->sd_body[s] = zz_memdup(m->body, m->body_len);
        w->sd_len[s] = w->sd_body[s] ? m->body_len : 0;
        if (count_body(r, w->sd_body, w->sd_len, m->body, m->body_len) < r->g + 1)
            return;
        w->seq = q->seq;
        w->n_awake = na;
        memcpy(w->awake, awake, na * sizeof *awake);
        adopt(r, m->body, m->body_len, q->seq, convict, nc, sleep, ns, active, nact);
        return;
    }
    /* Our open round, or a lower seq of its awake set: one fault flagged at two adjacent
     * seqs can open a round at either, and a certificate for the lower one settles it. The
     * awake sets may be nested: a round that closed undecided at some replicas is followed
     * at its seq by a round over the larger set (w6 -> w7), while others decided it (campaign
     * seed 3202 round 18: one replica decided the first round alone, two the follow-up; the
     * one kept its own outcome for good). */
    if (!w->open || q->seq > w->seq || q->seq <= w->settled_seq ||
        !nested_ids(awake, na, w->awake, w->n_awake)) {
        /* not our open round: the round we decided last (or a lower sibling), or nothing */
        if (!w->done || q->seq > w->done_seq || q->seq <= w->done_floor ||
            !nested_ids(awake, na, w->done_awake, w->n_done_awake))
            return;
        free(w->dn_body[s]);
        w->dn_body[s] = zz_memdup(m->body, m->body_len);
        w->dn_len[s] = w->dn_body[s] ? m->body_len : 0;
        check_done(r);
        return;
    }
    /* A certificate is g+1 identical bodies from distinct replicas (docs/wire.md). */
    free(w->sd_body[s]);
    w->sd_body[s] = zz_memdup(m->body, m->body_len);
    w->sd_len[s] = w->sd_body[s] ? m->body_len : 0;
    if (count_body(r, w->sd_body, w->sd_len, m->body, m->body_len) < r->g + 1)
        return;
    adopt(r, m->body, m->body_len, q->seq, convict, nc, sleep, ns, active, nact);
}

/* ---- key epochs (docs/wire.md "Key epochs") ----
 * A verified SPARE-READY with a higher epoch than the slot's current one replaces the slot's
 * public key and the MAC key this replica shares with it (derived by zz_epoch_mac_key) in the
 * conf's key table, which every authenticate() and send uses: from then on the previous
 * incarnation's keys verify nothing. They are kept only to count, per slot, the messages
 * still signed or MACed with them. The announced keys of the last two epochs per slot are
 * written to conf->exec_view + ".keys" (`key I EPOCH SIGN_PUB DH_PUB`, oldest first), and
 * re-installed in that order at start. */

static void hexs(char *out, const uint8_t *p, size_t n)
{
    static const char dig[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = dig[p[i] >> 4];
        out[2 * i + 1] = dig[p[i] & 15];
    }
    out[2 * n] = '\0';
}

static int unhex32(const char *s, uint8_t out[ZZ_KEY_LEN])
{
    if (strlen(s) != 2 * ZZ_KEY_LEN)
        return -1;
    for (size_t i = 0; i < ZZ_KEY_LEN; i++) {
        int v = 0;
        for (int k = 0; k < 2; k++) {
            char c = s[2 * i + (size_t)k];
            int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
            if (d < 0)
                return -1;
            v = v * 16 + d;
        }
        out[i] = (uint8_t)v;
    }
    return 0;
}

/* Install `epoch`'s keys for slot x (epoch above the current one). NULL or why not. */
static const char *install_key(zz_replica *r, uint32_t x, uint32_t epoch, const uint8_t *pub,
                               const uint8_t *dh)
{
    struct zz_wake *w = r->wake;
    zz_peer_key *k = (zz_peer_key *)zz_conf_key(r->conf, ZZ_PRINCIPAL_EXEC + x);
    if (!k || !r->conf->sign)
        return "no key of that replica in the key file";
    uint8_t mk[32];
    if (zz_epoch_mac_key(r->conf->sign, dh, r->conf->service, r->id, ZZ_PRINCIPAL_EXEC + x, epoch,
                         mk) != 0)
        return "dh_pub is not a usable X25519 key";
    zz_pubkey *np = zz_pubkey_new(pub);
    zz_mackey *nm = zz_mackey_new(mk);
    explicit_bzero(mk, sizeof mk);
    if (!np || !nm) {
        zz_pubkey_free(np);
        zz_mackey_free(nm);
        return "sign_pub is not an Ed25519 key (or out of memory)";
    }
    zz_pubkey_free(w->old_pub[x]);
    zz_mackey_free(w->old_mac[x]);
    w->old_pub[x] = k->pub;
    w->old_mac[x] = k->mac;
    k->pub = np;
    k->mac = nm;
    w->key_prev_epoch[x] = w->key_epoch[x];
    memcpy(w->key_pub[x][1], w->key_pub[x][0], ZZ_KEY_LEN);
    memcpy(w->key_dh[x][1], w->key_dh[x][0], ZZ_KEY_LEN);
    w->key_epoch[x] = epoch;
    memcpy(w->key_pub[x][0], pub, ZZ_KEY_LEN);
    memcpy(w->key_dh[x][0], dh, ZZ_KEY_LEN);
    return NULL;
}

static void save_keys(zz_replica *r)
{
    const struct zz_wake *w = r->wake;
    char path[300], tmp[310], hp[2 * ZZ_KEY_LEN + 1], hd[2 * ZZ_KEY_LEN + 1];
    if (!r->conf->exec_view[0] ||
        snprintf(path, sizeof path, "%s.keys", r->conf->exec_view) >= (int)sizeof path)
        return;
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) {
        zz_log("zz-agreed: replica %u: cannot write %s: %s\n", r->id, tmp,
               strerror(errno));
        return;
    }
    fprintf(f, "# zz-agreed replica %u: execution slots' announced keys, oldest first\n", r->id);
    for (uint32_t i = 0; i < r->conf->n_exec; i++)
        for (int g = 1; g >= 0; g--) {
            uint32_t e = g ? w->key_prev_epoch[i] : w->key_epoch[i];
            if (!e)
                continue;
            hexs(hp, w->key_pub[i][g], ZZ_KEY_LEN);
            hexs(hd, w->key_dh[i][g], ZZ_KEY_LEN);
            fprintf(f, "key %u %u %s %s\n", i, e, hp, hd);
        }
    int ok = fflush(f) == 0 && fsync(fileno(f)) == 0;
    ok &= fclose(f) == 0;
    if (!ok || rename(tmp, path) != 0)
        zz_log("zz-agreed: replica %u: cannot write %s: %s\n", r->id, path,
               strerror(errno));
}

/* A missing file: no slot was re-keyed. Anything unreadable stops the replica (starting
 * with the key file's keys would accept a convicted incarnation's messages again). */
static int load_keys(zz_replica *r, char *err, size_t errcap)
{
    char path[300];
    if (!r->conf->exec_view[0])
        return 0;
    if (snprintf(path, sizeof path, "%s.keys", r->conf->exec_view) >= (int)sizeof path) {
        snprintf(err, errcap, "%s.keys: path too long", r->conf->exec_view);
        return -1;
    }
    FILE *f = fopen(path, "r");
    if (!f) {
        if (errno == ENOENT)
            return 0;
        snprintf(err, errcap, "%s: cannot open: %s", path, strerror(errno));
        return -1;
    }
    char *line = NULL;
    size_t cap = 0;
    uint32_t lineno = 0;
    int rc = 0, nt;
    char *tok[FIELDS_MAX];
    while (rc == 0 && (nt = next_fields(f, &line, &cap, &lineno, tok, path, "keys", err,
                                        errcap)) != 0) {
        if (nt < 0) {
            rc = -1;
            break;
        }
        uint64_t id, epoch;
        uint8_t pub[ZZ_KEY_LEN], dh[ZZ_KEY_LEN];
        if (nt != 5 || strcmp(tok[0], "key") != 0 || parse_dec(tok[1], ZZ_MAX_EXEC - 1, &id) ||
            parse_dec(tok[2], UINT32_MAX, &epoch) || epoch == 0 || unhex32(tok[3], pub) ||
            unhex32(tok[4], dh)) {
            snprintf(err, errcap, "%s:%u: expected 'key I EPOCH SIGN_PUB DH_PUB'", path, lineno);
            rc = -1;
        } else if (id >= r->conf->n_exec || epoch <= r->wake->key_epoch[id]) {
            snprintf(err, errcap, "%s:%u: replica %llu epoch %llu out of place", path, lineno,
                     (unsigned long long)id, (unsigned long long)epoch);
            rc = -1;
        } else {
            const char *why = install_key(r, (uint32_t)id, (uint32_t)epoch, pub, dh);
            if (why) {
                snprintf(err, errcap, "%s:%u: %s", path, lineno, why);
                rc = -1;
            }
        }
    }
    free(line);
    fclose(f);
    for (uint32_t i = 0; rc == 0 && i < r->conf->n_exec; i++)
        if (r->wake->key_epoch[i])
            zz_log("zz-agreed: replica %u: exec %u key epoch %u from %s\n", r->id, i,
                   r->wake->key_epoch[i], path);
    return rc;
}

/* A verified SPARE-READY's keys for slot x, applied now: a higher epoch replaces the key. */
static void take_key(zz_replica *r, uint32_t x, uint32_t epoch, const uint8_t *pub,
                     const uint8_t *dh)
{
    if (epoch <= r->wake->key_epoch[x])
        return; /* epoch 0 (keys of the key directory), or an old announcement replayed */
    const char *why = install_key(r, x, epoch, pub, dh);
    if (why) {
        zz_log("zz-agreed: replica %u: exec %u key epoch %u not installed: %s\n", r->id,
               x, epoch, why);
        return;
    }
    save_keys(r);
    zz_log("zz-agreed: replica %u: exec %u key epoch %u installed: its previous key "
           "is refused from now on\n",
           r->id, x, epoch);
}

void zz_exec_auth_failed(zz_replica *r, const zz_msg *m)
{
    struct zz_wake *w = r->wake;
    if (!w || m->sender < ZZ_PRINCIPAL_EXEC || m->sender >= ZZ_PRINCIPAL_EXEC + ZZ_MAX_EXEC)
        return;
    uint32_t x = m->sender - ZZ_PRINCIPAL_EXEC;
    if (x >= r->conf->n_exec || !w->key_epoch[x])
        return;
    int stale = m->auth_kind == ZZ_AUTH_SIG
                    ? w->old_pub[x] && zz_verify_sig(m, w->old_pub[x])
                    : m->auth_kind == ZZ_AUTH_MAC && w->old_mac[x] &&
                          zz_verify_mac(m, r->id, w->old_mac[x]);
    if (!stale)
        return;
    uint64_t n = ++w->stale_key[x];
    if ((n & (n - 1)) == 0) /* 1, 2, 4, 8, ...: the log shows it without flooding */
        zz_log("zz-agreed: replica %u: exec %u: message type %u under its previous "
               "key (epoch %u) dropped (%llu so far)\n",
               r->id, x, m->type, w->key_prev_epoch[x], (unsigned long long)n);
}

/* ---- SPARE-READY from controld ---- */

static const char *check_spare(zz_replica *r, const zz_msg *m)
{
    const zz_spare_ready *q = &m->u.spare_ready;
    if (!r->wake)
        return "no exec lines";
    if (q->replica >= r->conf->n_exec)
        return "unknown replica";
    uint32_t h = r->conf->exec[q->replica].host;
    if (m->sender != ZZ_PRINCIPAL_HOST + h)
        return "sender is not the controld of the replica's host";
    if (!r->conf->controld_pub[h])
        return "no key for that controld (rack_public)";
    if (!zz_verify_sig(m, r->conf->controld_pub[h]))
        return "signature";
    return NULL;
}

void zz_on_spare_ready(zz_replica *r, const zz_msg *m)
{
    const zz_spare_ready *q = &m->u.spare_ready;
    const char *why = check_spare(r, m);
    uint32_t x = q->replica;
    if (!why) {
        struct zz_wake *w = r->wake;
        uint8_t st = r->exec_state[x];
        if (st == ZZ_EXEC_SLEEPING) {
            r->st.spares_ready_received++;
            zz_log("zz-agreed: replica %u: SPARE-READY %u seq %llu from %u: already "
                   "sleeping\n",
                   r->id, x, (unsigned long long)q->seq, m->sender);
            take_key(r, x, q->epoch, q->sign_pub, q->dh_pub);
            return;
        }
        /* Convicted by the SHUTDOWN at seq, or a key epoch above the slot's: controld made
         * that key only for a successor, after a SHUTDOWN certificate convicting x (one
         * fault flagged at two seqs may leave this replica on a sibling's seq, check_done,
         * while controld acted on the other's: CI, a slow replica at 1563 and 1564). */
        if (st == ZZ_EXEC_CONVICTED &&
            (q->seq == w->convicted_seq[x] || q->epoch > w->key_epoch[x])) {
            r->st.spares_ready_received++;
            r->exec_state[x] = ZZ_EXEC_SLEEPING;
            w->spare_pending[x] = 0;
            save_view(r);
            zz_log("zz-agreed: replica %u: SPARE-READY %u seq %llu from %u: convicted "
                   "-> sleeping\n",
                   r->id, x, (unsigned long long)q->seq, m->sender);
            take_key(r, x, q->epoch, q->sign_pub, q->dh_pub);
            retry_candidates(r);
            return;
        }
        /* controld acts on a SHUTDOWN certificate this replica may not have applied yet (a
         * round still open here): hold the newest such announcement for that conviction. */
        if (q->seq > w->convicted_seq[x] && q->seq > w->spare_pending[x]) {
            r->st.spares_ready_held++;
            w->spare_pending[x] = q->seq;
            w->pend_epoch[x] = q->epoch;
            memcpy(w->pend_pub[x], q->sign_pub, ZZ_KEY_LEN);
            memcpy(w->pend_dh[x], q->dh_pub, ZZ_KEY_LEN);
            zz_log("zz-agreed: replica %u: SPARE-READY %u seq %llu from %u held: not "
                   "convicted at that seq here (yet)\n",
                   r->id, x, (unsigned long long)q->seq, m->sender);
            return;
        }
        why = st == ZZ_EXEC_CONVICTED ? "seq is not the conviction's" : "replica is awake";
    }
    r->st.spares_ready_rejected++;
    zz_log("zz-agreed: replica %u: SPARE-READY %u seq %llu from %u rejected: %s\n",
           r->id, x, (unsigned long long)q->seq, m->sender, why);
}

/* ---- stats ---- */

static void write_ids(FILE *f, const char *name, const uint32_t *ids, uint32_t n)
{
    fprintf(f, "\"%s\": [", name);
    for (uint32_t i = 0; i < n; i++)
        fprintf(f, "%s%u", i ? ", " : "", ids[i]);
    fprintf(f, "], ");
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
               "\"spares_ready_held\": %llu, \"shutdowns_adopted_over_own\": %llu, ",
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
            (unsigned long long)s->shutdowns_adopted_over_own);
    uint32_t ids[ZZ_MAX_EXEC], n;
    n = list_state(r, ZZ_EXEC_AWAKE, ids);
    write_ids(f, "exec_awake", ids, n);
    n = list_state(r, ZZ_EXEC_SLEEPING, ids);
    write_ids(f, "exec_sleeping", ids, n);
    n = list_state(r, ZZ_EXEC_CONVICTED, ids);
    write_ids(f, "exec_convicted", ids, n);
    if (r->wake) {
        uint32_t nx = r->conf->n_exec < ZZ_MAX_EXEC ? r->conf->n_exec : ZZ_MAX_EXEC;
        fprintf(f, "\"exec_key_epoch\": [");
        for (uint32_t i = 0; i < nx; i++)
            fprintf(f, "%s%u", i ? ", " : "", r->wake->key_epoch[i]);
        fprintf(f, "], \"exec_stale_key_drops\": [");
        for (uint32_t i = 0; i < nx; i++)
            fprintf(f, "%s%llu", i ? ", " : "", (unsigned long long)r->wake->stale_key[i]);
        fprintf(f, "], ");
    }
    fprintf(f, "\"fault_round_open\": %d, \"fault_round_seq\": %llu, ",
            r->wake ? r->wake->open : 0,
            (unsigned long long)(r->wake && r->wake->open ? r->wake->seq : 0));
}
