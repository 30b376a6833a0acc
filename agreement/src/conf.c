/* conf.c - loads a replica file (docs/config.md, "Replica files") and the key files it names.
 * Every rejection says FILE:LINE: KEY: reason, because these files are generated and a bad
 * one means a bug upstream that the operator must be able to locate without guessing. */
#include "conf.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LINE_MAX_LEN 1024
#define MAX_TOKENS 8

/* ---- small helpers ---- */

static void set_err(char *err, size_t errcap, const char *fmt, ...)
{
    if (!err || errcap == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errcap, fmt, ap);
    va_end(ap);
}

/* set_err, then -1: the one-line failure of a line handler. */
__attribute__((format(printf, 3, 4))) static int line_err(char *err, size_t errcap,
                                                          const char *fmt, ...)
{
    if (err && errcap) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errcap, fmt, ap);
        va_end(ap);
    }
    return -1;
}

/* Splits in place on blanks; a '#' starting a token ends the line (comment). */
static int tokenize(char *line, char **tok, int max)
{
    int n = 0;
    char *p = line;
    while (*p) {
        while (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n')
            p++;
        if (!*p || *p == '#')
            break;
        if (n == max)
            return max + 1; /* too many: caller reports it */
        tok[n++] = p;
        while (*p && *p != ' ' && *p != '\t' && *p != '\r' && *p != '\n')
            p++;
        if (*p)
            *p++ = '\0';
    }
    return n;
}

/* Decimal only: strtoull alone would accept "-1", "+3", " 7" and hex, all of which would
 * hide a rendering bug. */
static int parse_u64(const char *s, uint64_t max, uint64_t *out)
{
    if (!*s)
        return -1;
    for (const char *p = s; *p; p++)
        if (*p < '0' || *p > '9')
            return -1;
    errno = 0;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || v > max)
        return -1;
    *out = v;
    return 0;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

static int parse_hex32(const char *s, uint8_t out[32])
{
    if (strlen(s) != 64)
        return -1;
    for (int i = 0; i < 32; i++) {
        int hi = hexval(s[2 * i]), lo = hexval(s[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return -1;
        out[i] = (uint8_t)(hi << 4 | lo);
    }
    return 0;
}

/* Reads one line; returns 1 on a line, 0 at EOF, -1 if the line does not fit. */
static int read_line(FILE *f, char *buf, size_t cap)
{
    if (!fgets(buf, (int)cap, f))
        return 0;
    size_t len = strlen(buf);
    if (len == cap - 1 && buf[len - 1] != '\n') {
        int ch = getc(f); /* a full buffer is fine only if the file ends right there */
        if (ch != EOF) {
            ungetc(ch, f);
            return -1;
        }
    }
    return 1;
}

/* ---- keys ---- */

static void free_keys(zz_conf *c)
{
    for (uint32_t i = 0; i < c->nkeys; i++) {
        zz_mackey_free(c->keys[i].mac);
        zz_pubkey_free(c->keys[i].pub);
        c->keys[i].mac = NULL;
        c->keys[i].pub = NULL;
    }
    c->nkeys = 0;
    zz_signkey_free(c->sign);
    c->sign = NULL;
}

/* One key line as read, before the secret and public files are merged by principal id. */
typedef struct {
    uint32_t id;
    uint8_t kind; /* 0 = mac (secret file), 1 = pub (public file) */
    uint32_t line;
    uint8_t key[32];
} raw_key;

static int raw_cmp(const void *a, const void *b)
{
    const raw_key *x = a, *y = b;
    if (x->id != y->id)
        return x->id < y->id ? -1 : 1;
    if (x->kind != y->kind)
        return x->kind < y->kind ? -1 : 1;
    return x->line < y->line ? -1 : x->line > y->line;
}

typedef struct {
    raw_key *v;
    size_t n, cap;
} raw_vec;

static int raw_push(raw_vec *rv, uint32_t id, uint8_t kind, uint32_t line, const uint8_t key[32])
{
    if (rv->n == rv->cap) {
        size_t nc = rv->cap ? rv->cap * 2 : 64;
        raw_key *nv = realloc(rv->v, nc * sizeof *nv);
        if (!nv)
            return -1;
        rv->v = nv;
        rv->cap = nc;
    }
    raw_key *k = &rv->v[rv->n++];
    k->id = id;
    k->kind = kind;
    k->line = line;
    memcpy(k->key, key, 32);
    return 0;
}

/* One line of a key file, split into tokens (blank lines are skipped by the reader). Returns
 * 0, or -1 after writing "path:line: reason" to err. */
typedef int (*line_fn)(void *ctx, char **tok, int nt, const char *path, uint32_t lineno,
                       char *err, size_t errcap);

/* Open `path` and hand each non-blank line to fn. The line buffer is wiped afterwards:
 * secret files pass through it. */
static int for_each_line(const char *path, line_fn fn, void *ctx, char *err, size_t errcap)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        set_err(err, errcap, "%s: cannot open: %s", path, strerror(errno));
        return -1;
    }
    char buf[LINE_MAX_LEN];
    char *tok[MAX_TOKENS];
    uint32_t lineno = 0;
    int rc = 0, r;
    while (rc == 0 && (r = read_line(f, buf, sizeof buf)) != 0) {
        lineno++;
        if (r < 0) {
            set_err(err, errcap, "%s:%u: line too long", path, lineno);
            rc = -1;
            break;
        }
        int nt = tokenize(buf, tok, MAX_TOKENS);
        if (nt > 0)
            rc = fn(ctx, tok, nt, path, lineno, err, errcap);
    }
    if (rc == 0 && ferror(f)) {
        set_err(err, errcap, "%s: read error", path);
        rc = -1;
    }
    fclose(f);
    memset(buf, 0, sizeof buf);
    return rc;
}

typedef struct {
    raw_vec *rv;
    uint8_t *seed;
    int *have_seed;
    uint32_t *seed_line;
} secret_ctx;

static int secret_line(void *vctx, char **tok, int nt, const char *path, uint32_t lineno,
                       char *err, size_t errcap)
{
    secret_ctx *sc = vctx;
    uint8_t key[32];
    if (strcmp(tok[0], "sign") == 0 && nt == 2) {
        if (parse_hex32(tok[1], key) < 0)
            return line_err(err, errcap, "%s:%u: sign: expected 64 hex digits", path, lineno);
        if (*sc->have_seed)
            return line_err(err, errcap, "%s:%u: sign: duplicate (first on line %u)", path,
                           lineno, *sc->seed_line);
        memcpy(sc->seed, key, 32);
        *sc->have_seed = 1;
        *sc->seed_line = lineno;
        return 0;
    }
    if (strcmp(tok[0], "mac") == 0 && nt == 3) {
        uint64_t peer;
        if (parse_u64(tok[1], UINT32_MAX, &peer) < 0)
            return line_err(err, errcap, "%s:%u: mac: bad peer id '%s'", path, lineno, tok[1]);
        if (parse_hex32(tok[2], key) < 0)
            return line_err(err, errcap, "%s:%u: mac: expected 64 hex digits", path, lineno);
        if (raw_push(sc->rv, (uint32_t)peer, 0, lineno, key) < 0)
            return line_err(err, errcap, "%s:%u: out of memory", path, lineno);
        return 0;
    }
    return line_err(err, errcap, "%s:%u: expected 'sign HEX' or 'mac PEER HEX'", path, lineno);
}

static int load_secret(const char *path, raw_vec *rv, uint8_t seed[32], int *have_seed,
                       uint32_t *seed_line, char *err, size_t errcap)
{
    secret_ctx sc = {rv, seed, have_seed, seed_line};
    return for_each_line(path, secret_line, &sc, err, errcap);
}

static int public_line(void *vctx, char **tok, int nt, const char *path, uint32_t lineno,
                       char *err, size_t errcap)
{
    uint64_t id;
    uint8_t key[32];
    if (nt != 2 || parse_u64(tok[0], UINT32_MAX, &id) < 0)
        return line_err(err, errcap, "%s:%u: expected '<id> <hex public key>'", path, lineno);
    if (parse_hex32(tok[1], key) < 0)
        return line_err(err, errcap, "%s:%u: %s: expected 64 hex digits", path, lineno, tok[0]);
    if (raw_push(vctx, (uint32_t)id, 1, lineno, key) < 0)
        return line_err(err, errcap, "%s:%u: out of memory", path, lineno);
    return 0;
}

static int load_public(const char *path, raw_vec *rv, char *err, size_t errcap)
{
    return for_each_line(path, public_line, rv, err, errcap);
}

/* c->id must be set first: the sign key is checked against the public key listed for it,
 * so a replica started with another principal's secret file fails here, not at runtime. */
int zz_keys_load(const char *secret_path, const char *public_path, zz_conf *c, char *err,
                 size_t errcap)
{
    free_keys(c);
    raw_vec rv = {0};
    uint8_t seed[32];
    int have_seed = 0, rc = -1;
    uint32_t seed_line = 0;
    if (load_secret(secret_path, &rv, seed, &have_seed, &seed_line, err, errcap) < 0)
        goto out;
    if (load_public(public_path, &rv, err, errcap) < 0)
        goto out;
    qsort(rv.v, rv.n, sizeof *rv.v, raw_cmp);
    /* Duplicates are adjacent after the sort; report the later line. */
    for (size_t i = 1; i < rv.n; i++) {
        const raw_key *a = &rv.v[i - 1], *b = &rv.v[i];
        if (a->id == b->id && a->kind == b->kind) {
            set_err(err, errcap, "%s:%u: %s %u: duplicate (first on line %u)",
                    b->kind ? public_path : secret_path, b->line, b->kind ? "key" : "mac", b->id,
                    a->line);
            goto out;
        }
    }
    if (have_seed) {
        c->sign = zz_signkey_new(seed);
        if (!c->sign) {
            set_err(err, errcap, "%s:%u: sign: not a usable Ed25519 seed", secret_path,
                    seed_line);
            goto out;
        }
    }
    for (size_t i = 0; i < rv.n; i++) {
        const raw_key *k = &rv.v[i];
        const char *path = k->kind ? public_path : secret_path;
        if (c->nkeys == 0 || c->keys[c->nkeys - 1].id != k->id) {
            if (c->nkeys == ZZ_MAX_PRINCIPALS) {
                set_err(err, errcap, "%s:%u: more than %d principals", path, k->line,
                        ZZ_MAX_PRINCIPALS);
                goto out;
            }
            zz_peer_key *pk = &c->keys[c->nkeys++];
            pk->id = k->id;
            pk->mac = NULL;
            pk->pub = NULL;
        }
        zz_peer_key *pk = &c->keys[c->nkeys - 1];
        if (k->kind == 0) {
            if (k->id == c->id) {
                set_err(err, errcap, "%s:%u: mac %u: a key shared with itself", path, k->line,
                        k->id);
                goto out;
            }
            pk->mac = zz_mackey_new(k->key);
            if (!pk->mac) {
                set_err(err, errcap, "%s:%u: out of memory", path, k->line);
                goto out;
            }
        } else {
            if (k->id == c->id && c->sign) {
                uint8_t mine[32];
                zz_signkey_public(c->sign, mine);
                if (memcmp(mine, k->key, 32) != 0) {
                    set_err(err, errcap,
                            "%s:%u: %u: public key does not match the sign key of %s:%u", path,
                            k->line, k->id, secret_path, seed_line);
                    goto out;
                }
            }
            pk->pub = zz_pubkey_new(k->key);
            if (!pk->pub) {
                set_err(err, errcap, "%s:%u: %u: not a valid Ed25519 public key", path, k->line,
                        k->id);
                goto out;
            }
        }
    }
    rc = 0;
out:
    if (rc < 0)
        free_keys(c);
    if (rv.v) {
        memset(rv.v, 0, rv.cap * sizeof *rv.v); /* MAC secrets */
        free(rv.v);
    }
    memset(seed, 0, sizeof seed);
    return rc;
}

const zz_peer_key *zz_conf_key(const zz_conf *c, uint32_t id)
{
    uint32_t lo = 0, hi = c->nkeys;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (c->keys[mid].id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < c->nkeys && c->keys[lo].id == id ? &c->keys[lo] : NULL;
}

static void free_rack_keys(zz_conf *c)
{
    for (uint32_t h = 0; h < ZZ_MAX_HOSTS; h++) {
        zz_pubkey_free(c->controld_pub[h]);
        c->controld_pub[h] = NULL;
    }
}

void zz_conf_free(zz_conf *c)
{
    if (c) {
        free_keys(c);
        free_rack_keys(c);
    }
}

/* One line of the rack-level public file: controld keys are kept by host, the operators'
 * (and anything else of service 0) are checked for shape and skipped. */
static int rack_public_line(void *vctx, char **tok, int nt, const char *path, uint32_t lineno,
                            char *err, size_t errcap)
{
    zz_conf *c = vctx;
    uint64_t id;
    uint8_t key[32];
    if (nt != 2 || parse_u64(tok[0], UINT32_MAX, &id) < 0)
        return line_err(err, errcap, "%s:%u: expected '<id> <hex public key>'", path, lineno);
    if (parse_hex32(tok[1], key) < 0)
        return line_err(err, errcap, "%s:%u: %s: expected 64 hex digits", path, lineno, tok[0]);
    if (id < ZZ_PRINCIPAL_HOST || id >= (uint64_t)ZZ_PRINCIPAL_HOST + ZZ_MAX_HOSTS)
        return 0;
    uint32_t h = (uint32_t)(id - ZZ_PRINCIPAL_HOST);
    if (c->controld_pub[h])
        return line_err(err, errcap, "%s:%u: %s: duplicate", path, lineno, tok[0]);
    c->controld_pub[h] = zz_pubkey_new(key);
    if (!c->controld_pub[h])
        return line_err(err, errcap, "%s:%u: %s: not a valid Ed25519 public key", path, lineno,
                        tok[0]);
    return 0;
}

/* ---- the replica file ---- */

enum {
    K_SERVICE, K_ID, K_G, K_LISTEN, K_PEER, K_SECRET, K_PUBLIC, K_CP, K_LOG_WINDOW,
    K_BATCH_MAX, K_MAX_INFLIGHT, K_VIEW_TIMEOUT, K_STATUS_INTERVAL, K_TIME_TOLERANCE,
    K_STATS_FILE, K_INJECT_DROP, K_INJECT_DUP, K_INJECT_DELAY, K_INJECT_SEED, K_BYZANTINE,
    K_EXECUTION, K_F, K_EXEC_LOG, K_DETECT_K, K_DETECT_FLOOR, K_DETECT_CEILING, K_EXEC,
    K_CONTROLD, K_EXEC_VIEW, K_RACK_PUBLIC, K_MAX_REQUEST, K_BATCH_BYTES, K_MAX_CONNS,
    K_MAX_CONNS_SOURCE, K_FRAME_TIMEOUT, K_UNAUTH_TIMEOUT, K_UNAUTH_BUFFER, K_CLIENT_OUT,
    K_CLIENT_OUT_TOTAL, K_OUT_STALL, K_REQUIRE_SIGNED, K_SPARE_KEYS, K_DATA_DIR, K_DURABILITY,
    K_EXEC_INFLIGHT, K_EXEC_HOLD, K_EXEC_HOLD_MAX, K_SYNC_THREADS, K_SYNC_SLICE, K_LOOP_SLICE, K_SYNC_GATE, K_BYZ_COMMITS, K_COUNT
};

static const char *const key_names[K_COUNT] = {
    "service", "id", "g", "listen", "peer", "secret", "public", "checkpoint_interval",
    "log_window", "batch_max", "max_inflight", "view_timeout_ms", "status_interval_ms",
    "time_tolerance_ms", "stats_file", "inject_drop", "inject_dup", "inject_delay_ms",
    "inject_seed", "byzantine", "execution", "f", "exec_log", "detect_k", "detect_floor_ms",
    "detect_ceiling_ms", "exec", "controld", "exec_view", "rack_public", "max_request",
    "batch_bytes", "max_conns", "max_conns_per_source", "frame_timeout_ms", "unauth_timeout_ms",
    "unauth_buffer_bytes", "client_out_bytes", "client_out_total", "out_stall_timeout_ms",
    "require_signed", "spare_keys", "data_dir", "durability", "exec_inflight", "exec_hold_ms",
    "exec_hold_max_ms", "sync_threads", "sync_slice_us", "loop_slice_us", "inject_sync_gate",
    "byzantine_commits",
};

/* What the parser remembers beyond zz_conf: where each key was, for cross-key checks that
 * can only run at the end (a peer line may precede the g line that bounds it). */
typedef struct {
    const char *path;
    uint32_t line[K_COUNT];           /* 0 = not given */
    uint32_t peer_line[ZZ_MAX_REPLICAS];
    uint32_t peer_over_line;          /* first peer line with R >= 64, 0 if none */
    uint64_t peer_over_id;
    uint32_t exec_line[ZZ_MAX_EXEC];  /* where `exec <i>` was, 0 = absent */
    uint32_t controld_line[ZZ_MAX_HOSTS];
    char secret[512], public_path[512], rack_public[512];
    char *err;
    size_t errcap;
} parse_state;

static int bad(parse_state *ps, uint32_t line, const char *key, const char *fmt, ...)
{
    char why[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    set_err(ps->err, ps->errcap, "%s:%u: %s: %s", ps->path, line, key, why);
    return -1;
}

static int parse_port(const char *s, uint16_t *out)
{
    uint64_t v;
    if (parse_u64(s, 65535, &v) < 0 || v == 0)
        return -1;
    *out = (uint16_t)v;
    return 0;
}

static int parse_host(const char *s, zz_addr *a)
{
    size_t len = strlen(s);
    if (len == 0 || len >= sizeof a->host)
        return -1;
    memcpy(a->host, s, len + 1);
    return 0;
}

static int parse_prob(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || *end || end == s || !isfinite(v) || v < 0.0 || v > 1.0)
        return -1;
    *out = v;
    return 0;
}

static int parse_path(const char *s, char *dst, size_t cap)
{
    size_t len = strlen(s);
    if (len == 0 || len >= cap)
        return -1;
    memcpy(dst, s, len + 1);
    return 0;
}

/* `byzantine_commits V:LO-HI:P[,P...]` (test only). */
static int parse_byz_commits(const char *s, zz_conf *c)
{
    char buf[128];
    size_t len = strlen(s);
    if (len == 0 || len >= sizeof buf)
        return -1;
    memcpy(buf, s, len + 1);
    char *colon1 = strchr(buf, ':');
    char *colon2 = colon1 ? strchr(colon1 + 1, ':') : NULL;
    char *dash = colon1 ? strchr(colon1 + 1, '-') : NULL;
    if (!colon1 || !colon2 || !dash || dash > colon2)
        return -1;
    *colon1 = *colon2 = *dash = '\0';
    uint64_t view, lo, hi, mask = 0;
    if (parse_u64(buf, UINT32_MAX, &view) < 0 || parse_u64(colon1 + 1, UINT64_MAX, &lo) < 0 ||
        parse_u64(dash + 1, UINT64_MAX, &hi) < 0 || lo > hi)
        return -1;
    char *p = colon2 + 1;
    for (;;) {
        char *comma = strchr(p, ',');
        if (comma)
            *comma = '\0';
        uint64_t peer;
        if (parse_u64(p, 63, &peer) < 0)
            return -1;
        mask |= 1ULL << peer;
        if (!comma)
            break;
        p = comma + 1;
    }
    c->byz_commit_view = (uint32_t)view;
    c->byz_commit_lo = lo;
    c->byz_commit_hi = hi;
    c->byz_commit_peers = mask;
    return 0;
}

/* u32 keys with a lower bound; the upper bound is where a larger value cannot work. */
static int set_u32(parse_state *ps, uint32_t line, int k, const char *s, uint64_t min,
                   uint64_t max, uint32_t *dst)
{
    uint64_t v;
    if (parse_u64(s, UINT64_MAX, &v) < 0)
        return bad(ps, line, key_names[k], "'%s' is not a non-negative integer", s);
    if (v < min || v > max)
        return bad(ps, line, key_names[k], "%llu out of range %llu..%llu",
                   (unsigned long long)v, (unsigned long long)min, (unsigned long long)max);
    *dst = (uint32_t)v;
    return 0;
}

static int apply_line(parse_state *ps, zz_conf *c, uint32_t line, char **tok, int nt)
{
    int k;
    for (k = 0; k < K_COUNT; k++)
        if (strcmp(tok[0], key_names[k]) == 0)
            break;
    if (k == K_COUNT)
        return bad(ps, line, tok[0], "unknown key");
    const char *name = key_names[k];
    int want = k == K_PEER || k == K_EXEC || k == K_CONTROLD ? 4 : k == K_LISTEN ? 3 : 2;
    if (nt != want)
        return bad(ps, line, name, "expected %d value%s, got %d", want - 1, want > 2 ? "s" : "",
                   nt - 1);
    if (k != K_PEER && k != K_EXEC && k != K_CONTROLD && ps->line[k])
        return bad(ps, line, name, "duplicate (first on line %u)", ps->line[k]);
    ps->line[k] = line;
    uint32_t u;
    switch (k) {
    case K_SERVICE:
        if (set_u32(ps, line, k, tok[1], 1, 65535, &u) < 0)
            return -1;
        c->service = (uint16_t)u;
        return 0;
    case K_ID:
        return set_u32(ps, line, k, tok[1], 0, ZZ_MAX_REPLICAS - 1, &c->id);
    case K_G:
        /* 3g+1 <= ZZ_MAX_REPLICAS */
        if (set_u32(ps, line, k, tok[1], 1, (ZZ_MAX_REPLICAS - 1) / 3, &c->g) < 0)
            return -1;
        c->n = 3 * c->g + 1;
        return 0;
    case K_LISTEN:
        if (parse_host(tok[1], &c->listen) < 0)
            return bad(ps, line, name, "host must be 1..%zu characters",
                       sizeof c->listen.host - 1);
        if (parse_port(tok[2], &c->listen.port) < 0)
            return bad(ps, line, name, "port '%s' is not in 1..65535", tok[2]);
        return 0;
    case K_PEER: {
        uint64_t r;
        if (parse_u64(tok[1], UINT32_MAX, &r) < 0)
            return bad(ps, line, name, "replica '%s' is not a non-negative integer", tok[1]);
        if (r >= ZZ_MAX_REPLICAS) {
            /* Judged against n at the end, so the message can name the real bound. */
            if (!ps->peer_over_line) {
                ps->peer_over_line = line;
                ps->peer_over_id = r;
            }
            return 0;
        }
        if (ps->peer_line[r])
            return bad(ps, line, name, "replica %llu duplicate (first on line %u)",
                       (unsigned long long)r, ps->peer_line[r]);
        ps->peer_line[r] = line;
        if (parse_host(tok[2], &c->peers[r]) < 0)
            return bad(ps, line, name, "host must be 1..%zu characters",
                       sizeof c->peers[r].host - 1);
        if (parse_port(tok[3], &c->peers[r].port) < 0)
            return bad(ps, line, name, "port '%s' is not in 1..65535", tok[3]);
        return 0;
    }
    case K_SECRET:
        if (parse_path(tok[1], ps->secret, sizeof ps->secret) < 0)
            return bad(ps, line, name, "path longer than %zu", sizeof ps->secret - 1);
        return 0;
    case K_PUBLIC:
        if (parse_path(tok[1], ps->public_path, sizeof ps->public_path) < 0)
            return bad(ps, line, name, "path longer than %zu", sizeof ps->public_path - 1);
        return 0;
    case K_CP:
        return set_u32(ps, line, k, tok[1], 1, UINT32_MAX, &c->checkpoint_interval);
    case K_LOG_WINDOW:
        return set_u32(ps, line, k, tok[1], 1, UINT32_MAX, &c->log_window);
    case K_BATCH_MAX:
        /* a PRE-PREPARE's request list is bounded by ZZ_MAX_LIST on the wire */
        return set_u32(ps, line, k, tok[1], 1, ZZ_MAX_LIST, &c->batch_max);
    case K_MAX_INFLIGHT:
        return set_u32(ps, line, k, tok[1], 1, UINT32_MAX, &c->max_inflight);
    case K_EXEC_INFLIGHT:
        return set_u32(ps, line, k, tok[1], 0, UINT32_MAX, &c->exec_inflight);
    case K_EXEC_HOLD:
        return set_u32(ps, line, k, tok[1], 1, 3600000, &c->exec_hold_ms);
    case K_EXEC_HOLD_MAX:
        return set_u32(ps, line, k, tok[1], 0, 3600000, &c->exec_hold_max_ms);
    case K_SYNC_THREADS:
        return set_u32(ps, line, k, tok[1], 0, ZZ_MAX_SYNC_THREADS, &c->sync_threads);
    case K_SYNC_SLICE:
        return set_u32(ps, line, k, tok[1], 0, 100000, &c->sync_slice_us);
    case K_LOOP_SLICE:
        return set_u32(ps, line, k, tok[1], 0, 100000, &c->loop_slice_us);
    case K_MAX_REQUEST:
        /* checked against batch_bytes at the end: a request must fit a batch alone */
        return set_u32(ps, line, k, tok[1], ZZ_MIN_MAX_REQUEST, ZZ_MAX_BATCH_BYTES,
                       &c->max_request);
    case K_BATCH_BYTES:
        return set_u32(ps, line, k, tok[1], ZZ_MIN_MAX_REQUEST + ZZ_BATCH_HDR_LEN + 4,
                       ZZ_MAX_BATCH_BYTES, &c->batch_bytes);
    case K_MAX_CONNS:
        return set_u32(ps, line, k, tok[1], 1, 1000000, &c->max_conns);
    case K_MAX_CONNS_SOURCE:
        return set_u32(ps, line, k, tok[1], 1, 1000000, &c->max_conns_per_source);
    case K_FRAME_TIMEOUT:
        return set_u32(ps, line, k, tok[1], 100, 3600000, &c->frame_timeout_ms);
    case K_UNAUTH_TIMEOUT:
        return set_u32(ps, line, k, tok[1], 100, 3600000, &c->unauth_timeout_ms);
    case K_UNAUTH_BUFFER:
        /* at least one largest frame, or a peer's first frame could never arrive */
        return set_u32(ps, line, k, tok[1], ZZ_MAX_MSG + 4, UINT32_MAX, &c->unauth_buffer_bytes);
    case K_CLIENT_OUT:
        /* one reply always goes out to a client with nothing queued, whatever its size */
        return set_u32(ps, line, k, tok[1], 64u << 10, UINT32_MAX, &c->client_out_bytes);
    case K_CLIENT_OUT_TOTAL:
        return set_u32(ps, line, k, tok[1], 64u << 10, UINT32_MAX, &c->client_out_total);
    case K_OUT_STALL:
        return set_u32(ps, line, k, tok[1], 100, 3600000, &c->out_stall_timeout_ms);
    case K_REQUIRE_SIGNED:
        return set_u32(ps, line, k, tok[1], 0, 1, &c->require_signed);
    case K_VIEW_TIMEOUT:
        return set_u32(ps, line, k, tok[1], 1, UINT32_MAX, &c->view_timeout_ms);
    case K_STATUS_INTERVAL:
        return set_u32(ps, line, k, tok[1], 1, UINT32_MAX, &c->status_interval_ms);
    case K_TIME_TOLERANCE:
        return set_u32(ps, line, k, tok[1], 0, UINT32_MAX, &c->time_tolerance_ms);
    case K_STATS_FILE:
        if (parse_path(tok[1], c->stats_file, sizeof c->stats_file) < 0)
            return bad(ps, line, name, "path longer than %zu", sizeof c->stats_file - 1);
        return 0;
    case K_EXEC_VIEW:
        if (parse_path(tok[1], c->exec_view, sizeof c->exec_view) < 0)
            return bad(ps, line, name, "path longer than %zu", sizeof c->exec_view - 1);
        return 0;
    case K_SYNC_GATE:
        if (parse_path(tok[1], c->inject_sync_gate, sizeof c->inject_sync_gate) < 0)
            return bad(ps, line, name, "path longer than %zu", sizeof c->inject_sync_gate - 1);
        return 0;
    case K_DATA_DIR:
        if (parse_path(tok[1], c->data_dir, sizeof c->data_dir) < 0)
            return bad(ps, line, name, "path longer than %zu", sizeof c->data_dir - 1);
        return 0;
    case K_DURABILITY:
        if (strcmp(tok[1], "fsync") == 0)
            c->durability = ZZ_DUR_FSYNC;
        else if (strcmp(tok[1], "write") == 0)
            c->durability = ZZ_DUR_WRITE;
        else if (strcmp(tok[1], "off") == 0)
            c->durability = ZZ_DUR_OFF;
        else
            return bad(ps, line, name, "'%s' is not one of fsync, write, off", tok[1]);
        return 0;
    case K_RACK_PUBLIC:
        if (parse_path(tok[1], ps->rack_public, sizeof ps->rack_public) < 0)
            return bad(ps, line, name, "path longer than %zu", sizeof ps->rack_public - 1);
        return 0;
    case K_SPARE_KEYS:
        if (parse_path(tok[1], c->spare_keys, sizeof c->spare_keys) < 0)
            return bad(ps, line, name, "path longer than %zu", sizeof c->spare_keys - 1);
        return 0;
    case K_INJECT_DROP:
        if (parse_prob(tok[1], &c->inject_drop) < 0)
            return bad(ps, line, name, "'%s' is not a probability in [0,1]", tok[1]);
        return 0;
    case K_INJECT_DUP:
        if (parse_prob(tok[1], &c->inject_dup) < 0)
            return bad(ps, line, name, "'%s' is not a probability in [0,1]", tok[1]);
        return 0;
    case K_INJECT_DELAY:
        /* bounded so a typo cannot park messages for days */
        return set_u32(ps, line, k, tok[1], 0, 3600000, &c->inject_delay_ms);
    case K_INJECT_SEED: {
        uint64_t v;
        if (parse_u64(tok[1], UINT64_MAX, &v) < 0)
            return bad(ps, line, name, "'%s' is not a non-negative integer", tok[1]);
        c->inject_seed = v;
        return 0;
    }
    case K_BYZANTINE:
        if (strcmp(tok[1], "none") == 0)
            c->byzantine = ZZ_BYZ_NONE;
        else if (strcmp(tok[1], "equivocate") == 0)
            c->byzantine = ZZ_BYZ_EQUIVOCATE;
        else if (strcmp(tok[1], "drop-requests") == 0)
            c->byzantine = ZZ_BYZ_DROP_REQUESTS;
        else if (strcmp(tok[1], "silent") == 0)
            c->byzantine = ZZ_BYZ_SILENT;
        else if (strcmp(tok[1], "false-fault") == 0)
            c->byzantine = ZZ_BYZ_FALSE_FAULT;
        else
            return bad(ps, line, name,
                       "'%s' is not one of none, equivocate, drop-requests, silent, false-fault",
                       tok[1]);
        return 0;
    case K_BYZ_COMMITS:
        if (parse_byz_commits(tok[1], c) < 0)
            return bad(ps, line, name, "'%s' is not VIEW:LO-HI:PEER[,PEER...] with LO <= HI "
                       "and peers below 64", tok[1]);
        return 0;
    case K_EXEC: {
        uint64_t i, h;
        if (parse_u64(tok[1], UINT32_MAX, &i) < 0 || i >= ZZ_MAX_EXEC)
            return bad(ps, line, name, "replica '%s' is not in 0..%u", tok[1], ZZ_MAX_EXEC - 1);
        if (ps->exec_line[i])
            return bad(ps, line, name, "replica %llu duplicate (first on line %u)",
                       (unsigned long long)i, ps->exec_line[i]);
        if (parse_u64(tok[2], UINT32_MAX, &h) < 0 || h >= ZZ_MAX_HOSTS)
            return bad(ps, line, name, "host '%s' is not in 0..%u", tok[2], ZZ_MAX_HOSTS - 1);
        int active;
        if (strcmp(tok[3], "active") == 0)
            active = 1;
        else if (strcmp(tok[3], "sleeping") == 0)
            active = 0;
        else
            return bad(ps, line, name, "'%s' is not one of active, sleeping", tok[3]);
        ps->exec_line[i] = line;
        c->exec[i].present = 1;
        c->exec[i].host = (uint32_t)h;
        c->exec[i].active = active;
        return 0;
    }
    case K_CONTROLD: {
        uint64_t h;
        if (parse_u64(tok[1], UINT32_MAX, &h) < 0 || h >= ZZ_MAX_HOSTS)
            return bad(ps, line, name, "host '%s' is not in 0..%u", tok[1], ZZ_MAX_HOSTS - 1);
        if (ps->controld_line[h])
            return bad(ps, line, name, "host %llu duplicate (first on line %u)",
                       (unsigned long long)h, ps->controld_line[h]);
        if (parse_host(tok[2], &c->controld[h]) < 0)
            return bad(ps, line, name, "address must be 1..%zu characters",
                       sizeof c->controld[h].host - 1);
        if (parse_port(tok[3], &c->controld[h].port) < 0)
            return bad(ps, line, name, "port '%s' is not in 1..65535", tok[3]);
        ps->controld_line[h] = line;
        c->has_controld[h] = 1;
        return 0;
    }
    case K_F:
        return set_u32(ps, line, k, tok[1], 0, 21, &c->f);
    case K_DETECT_K:
        return set_u32(ps, line, k, tok[1], 1, 1000, &c->detect_k);
    case K_DETECT_FLOOR:
        return set_u32(ps, line, k, tok[1], 1, 3600000, &c->detect_floor_ms);
    case K_DETECT_CEILING:
        return set_u32(ps, line, k, tok[1], 1, 3600000, &c->detect_ceiling_ms);
    case K_EXEC_LOG:
        return set_u32(ps, line, k, tok[1], 1, 1u << 20, &c->exec_log);
    case K_EXECUTION:
        if (strcmp(tok[1], "echo") == 0)
            c->external_exec = 0;
        else if (strcmp(tok[1], "external") == 0)
            c->external_exec = 1;
        else
            return bad(ps, line, name, "'%s' is not one of echo, external", tok[1]);
        return 0;
    }
    return bad(ps, line, name, "unhandled key"); /* unreachable: every key has a case */
}

/* Cross-key checks; `eof` is the line number used for keys that are missing. */
static int check_conf(parse_state *ps, zz_conf *c, uint32_t eof)
{
    static const int required[] = {K_SERVICE, K_ID, K_G, K_LISTEN, K_SECRET, K_PUBLIC};
    for (size_t i = 0; i < sizeof required / sizeof required[0]; i++)
        if (!ps->line[required[i]])
            return bad(ps, eof, key_names[required[i]], "missing (required)");
    if (c->id >= c->n)
        return bad(ps, ps->line[K_ID], "id", "%u is not below n = 3g+1 = %u", c->id, c->n);
    if (ps->peer_over_line)
        return bad(ps, ps->peer_over_line, "peer", "replica %llu is not below n = %u",
                   (unsigned long long)ps->peer_over_id, c->n);
    for (uint32_t r = c->n; r < ZZ_MAX_REPLICAS; r++)
        if (ps->peer_line[r])
            return bad(ps, ps->peer_line[r], "peer", "replica %u is not below n = %u", r, c->n);
    for (uint32_t r = 0; r < c->n; r++)
        if (!ps->peer_line[r])
            return bad(ps, eof, "peer", "missing replica %u (need 0..%u)", r, c->n - 1);
    /* A durable replica syncs its log before each COMMIT, about one sync per batch at every
     * replica (the batches in flight become prepared at different moments): the fewer and
     * larger the batches, the fewer syncs per request. Without the key, a durable primary
     * keeps one batch in flight (docs/agreement.md "One batch in flight"). */
    if (!ps->line[K_MAX_INFLIGHT] && c->data_dir[0] && c->durability == ZZ_DUR_FSYNC)
        c->max_inflight = ZZ_DURABLE_MAX_INFLIGHT;
    if (c->log_window % c->checkpoint_interval != 0) {
        uint32_t line = ps->line[K_LOG_WINDOW] ? ps->line[K_LOG_WINDOW]
                                               : ps->line[K_CP] ? ps->line[K_CP] : eof;
        return bad(ps, line, "log_window", "%u is not a multiple of checkpoint_interval %u",
                   c->log_window, c->checkpoint_interval);
    }
    /* exec lines: ids 0 .. n_exec-1 without gaps, at least f+1 active (fewer could never
     * form an execution certificate), and a controld for every host named. */
    uint32_t n_exec = 0, n_active = 0;
    for (uint32_t i = 0; i < ZZ_MAX_EXEC; i++)
        if (ps->exec_line[i])
            n_exec = i + 1;
    for (uint32_t i = 0; i < n_exec; i++) {
        if (!ps->exec_line[i])
            return bad(ps, ps->exec_line[n_exec - 1], "exec",
                       "replica %u listed but replica %u missing (ids must be 0..%u)",
                       n_exec - 1, i, n_exec - 1);
        n_active += (uint32_t)c->exec[i].active;
        uint32_t h = c->exec[i].host;
        if (!c->has_controld[h])
            return bad(ps, ps->exec_line[i], "exec", "host %u of replica %u has no controld line",
                       h, i);
    }
    if (n_exec > 0 && n_active < c->f + 1)
        return bad(ps, ps->exec_line[0], "exec", "%u active replicas, need at least f+1 = %u",
                   n_active, c->f + 1);
    c->n_exec = n_exec;
    if ((uint64_t)c->max_request + ZZ_BATCH_HDR_LEN + 4 > c->batch_bytes) {
        uint32_t line = ps->line[K_MAX_REQUEST] ? ps->line[K_MAX_REQUEST]
                        : ps->line[K_BATCH_BYTES] ? ps->line[K_BATCH_BYTES] : eof;
        return bad(ps, line, "max_request", "%u does not fit batch_bytes %u (need %u more)",
                   c->max_request, c->batch_bytes, ZZ_BATCH_HDR_LEN + 4);
    }
    if (c->detect_floor_ms > c->detect_ceiling_ms) {
        uint32_t line = ps->line[K_DETECT_FLOOR] ? ps->line[K_DETECT_FLOOR]
                        : ps->line[K_DETECT_CEILING] ? ps->line[K_DETECT_CEILING] : eof;
        return bad(ps, line, "detect_floor_ms", "%u is above detect_ceiling_ms %u",
                   c->detect_floor_ms, c->detect_ceiling_ms);
    }
    return 0;
}

int zz_conf_load(const char *path, zz_conf *c, char *err, size_t errcap)
{
    memset(c, 0, sizeof *c);
    c->checkpoint_interval = 128;
    c->log_window = 256;
    c->batch_max = 400;
    c->max_inflight = 4;
    c->sync_threads = 2;
    c->sync_slice_us = ZZ_DEFAULT_SYNC_SLICE_US;
    c->exec_inflight = 1;
    c->exec_hold_ms = 40;
    c->view_timeout_ms = 1000;
    c->status_interval_ms = 100;
    c->time_tolerance_ms = 2000;
    c->byzantine = ZZ_BYZ_NONE;
    c->f = 1;
    c->exec_log = 65536;
    c->detect_k = 4;
    /* 500, not 50: at 50 ms a correct replica merely slow under load was late often enough
     * to be convicted (docs/fault-detection.md §6, bench-results/detection.json). */
    c->detect_floor_ms = 500;
    c->detect_ceiling_ms = 5000;
    c->max_request = ZZ_DEFAULT_MAX_REQUEST;
    c->batch_bytes = ZZ_DEFAULT_BATCH_BYTES;
    c->max_conns = 1024;
    c->max_conns_per_source = 256;
    c->frame_timeout_ms = 20000;
    c->unauth_timeout_ms = 10000;
    c->unauth_buffer_bytes = 64u << 20;
    c->client_out_bytes = 4u << 20;
    c->client_out_total = 64u << 20;
    c->out_stall_timeout_ms = 10000;

    parse_state *ps = calloc(1, sizeof *ps);
    if (!ps) {
        set_err(err, errcap, "%s: out of memory", path);
        return -1;
    }
    ps->path = path;
    ps->err = err;
    ps->errcap = errcap;
    int rc = -1;
    FILE *f = fopen(path, "r");
    if (!f) {
        set_err(err, errcap, "%s: cannot open: %s", path, strerror(errno));
        free(ps);
        return -1;
    }
    char buf[LINE_MAX_LEN];
    char *tok[MAX_TOKENS];
    uint32_t lineno = 0;
    int r;
    while ((r = read_line(f, buf, sizeof buf)) != 0) {
        lineno++;
        if (r < 0) {
            set_err(err, errcap, "%s:%u: line too long (max %d)", path, lineno, LINE_MAX_LEN - 2);
            goto out;
        }
        int nt = tokenize(buf, tok, MAX_TOKENS);
        if (nt == 0)
            continue;
        if (nt > MAX_TOKENS) {
            bad(ps, lineno, tok[0], "too many values");
            goto out;
        }
        if (apply_line(ps, c, lineno, tok, nt) < 0)
            goto out;
    }
    if (ferror(f)) {
        set_err(err, errcap, "%s: read error", path);
        goto out;
    }
    if (check_conf(ps, c, lineno + 1) < 0)
        goto out;
    char kerr[768];
    if (zz_keys_load(ps->secret, ps->public_path, c, kerr, sizeof kerr) < 0) {
        bad(ps, ps->line[K_SECRET], "secret", "%s", kerr);
        goto out;
    }
    if (!c->sign) {
        bad(ps, ps->line[K_SECRET], "secret", "%s has no sign key", ps->secret);
        goto out;
    }
    /* Without these the replica would silently drop every message of a peer. */
    for (uint32_t p = 0; p < c->n; p++) {
        const zz_peer_key *k = zz_conf_key(c, p);
        if (p != c->id && (!k || !k->mac)) {
            bad(ps, ps->line[K_SECRET], "secret", "%s has no mac key for replica %u", ps->secret,
                p);
            goto out;
        }
        if (!k || !k->pub) {
            bad(ps, ps->line[K_PUBLIC], "public", "%s has no key for replica %u",
                ps->public_path, p);
            goto out;
        }
    }
    if (ps->rack_public[0] &&
        for_each_line(ps->rack_public, rack_public_line, c, kerr, sizeof kerr) < 0) {
        bad(ps, ps->line[K_RACK_PUBLIC], "rack_public", "%s", kerr);
        goto out;
    }
    rc = 0;
out:
    fclose(f);
    free(ps);
    if (rc < 0) {
        free_keys(c);
        free_rack_keys(c);
    }
    return rc;
}
