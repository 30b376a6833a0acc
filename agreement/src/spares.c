/* spares.c - SPARE-READY from controld and key epochs (docs/fault-detection.md "In
 * zz-agreed", docs/wire.md "Key epochs"): a convicted replica's fresh spare sleeps again,
 * and its announced keys replace the slot's keys in the conf's key table; the keys of the
 * last two epochs per slot are kept in conf->exec_view + ".keys" and re-installed at start.
 *
 * Invariants: a slot's key only moves to a higher epoch; from then on the previous
 * incarnation's keys verify nothing (they are kept only to count stale-key drops); a
 * SPARE-READY that arrives before the conviction it answers is held (spare_pending) until
 * that conviction is known here. */
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
    struct zz_wake *w = r->zz.wake;
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
    const struct zz_wake *w = r->zz.wake;
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
int zw_load_keys(zz_replica *r, char *err, size_t errcap)
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
    while (rc == 0 && (nt = zw_next_fields(f, &line, &cap, &lineno, tok, path, "keys", err,
                                           errcap)) != 0) {
        if (nt < 0) {
            rc = -1;
            break;
        }
        uint64_t id, epoch;
        uint8_t pub[ZZ_KEY_LEN], dh[ZZ_KEY_LEN];
        if (nt != 5 || strcmp(tok[0], "key") != 0 || zw_parse_dec(tok[1], ZZ_MAX_EXEC - 1, &id) ||
            zw_parse_dec(tok[2], UINT32_MAX, &epoch) || epoch == 0 || unhex32(tok[3], pub) ||
            unhex32(tok[4], dh)) {
            snprintf(err, errcap, "%s:%u: expected 'key I EPOCH SIGN_PUB DH_PUB'", path, lineno);
            rc = -1;
        } else if (id >= r->conf->n_exec || epoch <= r->zz.wake->key_epoch[id]) {
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
        if (r->zz.wake->key_epoch[i])
            zz_log("zz-agreed: replica %u: exec %u key epoch %u from %s\n", r->id, i,
                   r->zz.wake->key_epoch[i], path);
    return rc;
}

/* A verified SPARE-READY's keys for slot x, applied now: a higher epoch replaces the key. */
void zw_take_key(zz_replica *r, uint32_t x, uint32_t epoch, const uint8_t *pub,
                 const uint8_t *dh)
{
    if (epoch <= r->zz.wake->key_epoch[x])
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
    struct zz_wake *w = r->zz.wake;
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
    if (!r->zz.wake)
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
        struct zz_wake *w = r->zz.wake;
        uint8_t st = r->zz.exec_state[x];
        if (st == ZZ_EXEC_SLEEPING) {
            r->st.spares_ready_received++;
            zz_log("zz-agreed: replica %u: SPARE-READY %u seq %llu from %u: already "
                   "sleeping\n",
                   r->id, x, (unsigned long long)q->seq, m->sender);
            zw_take_key(r, x, q->epoch, q->sign_pub, q->dh_pub);
            return;
        }
        /* Convicted by the SHUTDOWN at seq, or a key epoch above the slot's: controld made
         * that key only for a successor, after a SHUTDOWN certificate convicting x (one
         * fault flagged at two seqs may leave this replica on a sibling's seq, check_done,
         * while controld acted on the other's: CI, a slow replica at 1563 and 1564). */
        if (st == ZZ_EXEC_CONVICTED &&
            (q->seq == w->convicted_seq[x] || q->epoch > w->key_epoch[x])) {
            r->st.spares_ready_received++;
            r->zz.exec_state[x] = ZZ_EXEC_SLEEPING;
            w->spare_pending[x] = 0;
            zw_save_view(r);
            zz_log("zz-agreed: replica %u: SPARE-READY %u seq %llu from %u: convicted "
                   "-> sleeping\n",
                   r->id, x, (unsigned long long)q->seq, m->sender);
            zw_take_key(r, x, q->epoch, q->sign_pub, q->dh_pub);
            zw_retry_candidates(r);
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

/* ---- the key directory's announcements, at start ----
 * controld keeps each re-keyed slot's signed SPARE-READY in the service's key directory
 * (conf spare_keys: spare-p<256+i>.msg, the message in hex), and the slot's runtime, its
 * peers and the clients use the keys it names (zz/keys.py slot_keys). An announcement this
 * replica did not take before it stopped (held for a conviction not applied here yet, or
 * not delivered before the rack went down) would leave it on the slot's previous key: a
 * correct runtime started in that slot authenticates nothing here, and is convicted at the
 * first seq for a silence that is this replica's (campaign seeds 3101 round 27 and 3102
 * round 4: the first round after a rack restart). So a slot that is not convicted here
 * takes the announced epoch if it is above its own. A convicted slot's key moves only with
 * the announcement that answers its conviction (zz_on_spare_ready: a replayed one must not
 * turn a convicted incarnation into a spare). A file that does not verify stops the
 * replica, as an unreadable .keys file does. */
#define ANNOUNCE_MAX 1024 /* bytes of one SPARE-READY; it has 80 + 16 + 64 */

static int hexval(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* Slot x's announcement file into raw (at most ANNOUNCE_MAX bytes): 1 read, 0 no file,
 * -1 with err set. */
static int read_announcement(const char *path, uint8_t *raw, uint32_t *len, char *err,
                             size_t errcap)
{
    char text[2 * ANNOUNCE_MAX + 2];
    FILE *f = fopen(path, "r");
    if (!f) {
        if (errno == ENOENT)
            return 0;
        snprintf(err, errcap, "%s: cannot open: %s", path, strerror(errno));
        return -1;
    }
    size_t n = fread(text, 1, sizeof text, f);
    int rerr = ferror(f);
    fclose(f);
    if (rerr) {
        snprintf(err, errcap, "%s: read error", path);
        return -1;
    }
    while (n > 0 && (text[n - 1] == '\n' || text[n - 1] == '\r' || text[n - 1] == ' '))
        n--;
    if (n == 0 || n % 2 != 0 || n / 2 > ANNOUNCE_MAX) {
        snprintf(err, errcap, "%s: not one message in hex of at most %u bytes", path,
                 ANNOUNCE_MAX);
        return -1;
    }
    for (size_t i = 0; i < n / 2; i++) {
        int hi = hexval(text[2 * i]), lo = hexval(text[2 * i + 1]);
        if (hi < 0 || lo < 0) {
            snprintf(err, errcap, "%s: not lower-case hex", path);
            return -1;
        }
        raw[i] = (uint8_t)(hi * 16 + lo);
    }
    *len = (uint32_t)(n / 2);
    return 1;
}

int zw_load_announced(zz_replica *r, char *err, size_t errcap)
{
    const char *dir = r->conf->spare_keys;
    if (!dir[0] || !r->zz.wake)
        return 0;
    for (uint32_t x = 0; x < r->conf->n_exec; x++) {
        char path[320];
        uint8_t raw[ANNOUNCE_MAX];
        uint32_t len = 0;
        if (snprintf(path, sizeof path, "%s/spare-p%u.msg", dir, ZZ_PRINCIPAL_EXEC + x) >=
            (int)sizeof path) {
            snprintf(err, errcap, "%s: path too long", dir);
            return -1;
        }
        int got = read_announcement(path, raw, &len, err, errcap);
        if (got <= 0) {
            if (got < 0)
                return -1;
            continue;
        }
        zz_msg m;
        const char *why = NULL;
        if (zz_decode(raw, len, &m) != ZZ_OK || m.type != ZZ_SPARE_READY)
            why = "not a SPARE-READY";
        else if (m.service != r->conf->service)
            why = "another service's";
        else if (m.u.spare_ready.replica != x)
            why = "announces another replica";
        else
            why = check_spare(r, &m);
        if (why) {
            snprintf(err, errcap, "%s: %s", path, why);
            return -1;
        }
        const zz_spare_ready *q = &m.u.spare_ready;
        if (r->zz.exec_state[x] == ZZ_EXEC_CONVICTED || q->epoch <= r->zz.wake->key_epoch[x])
            continue;
        zz_log("zz-agreed: replica %u: exec %u key epoch %u announced in %s\n", r->id, x,
               q->epoch, path);
        zw_take_key(r, x, q->epoch, q->sign_pub, q->dh_pub);
    }
    return 0;
}
