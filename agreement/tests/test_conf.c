/* test_conf.c - unit tests of conf.c: a valid replica file with its key files, defaults,
 * and every rejection naming the right FILE:LINE: KEY, all on files in a fresh temp dir. */
#include <stdlib.h>
#include <unistd.h>

#include "conf.h"
#include "crypto.h"
#include "testutil.h"

/* t_end plus a line for passing cases too, so the log shows what ran. */
static void end_case(tctx *t)
{
    if (!t->case_failures)
        printf("ok   %s\n", t->name);
    t_end(t);
}

#define NREP 4 /* g = 1 */
#define CLIENT 65536u

typedef struct {
    char dir[64];
    char conf[128], secret[128], public_path[128], bad[128];
    uint8_t seed[NREP][32];
    uint8_t pub[NREP][32];
    uint8_t client_seed[32], client_pub[32];
    uint8_t mac[NREP][NREP][32]; /* mac[a][b] == mac[b][a] */
    uint8_t client_mac[NREP][32];
} fixture;

static void fill(uint8_t *p, size_t n, unsigned tag)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(tag * 131 + i * 7 + 1);
}

static void hex(const uint8_t k[32], char out[65])
{
    t_hex(k, 32, out);
}

static int write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    if (!f)
        return -1;
    fputs(text, f);
    return fclose(f);
}

/* The key files of replica 1 in the format `zz keys` writes (zz/keys.py). */
static void fixture_init(fixture *fx)
{
    snprintf(fx->dir, sizeof fx->dir, "/tmp/zz-test-conf.XXXXXX");
    if (!mkdtemp(fx->dir)) {
        perror("mkdtemp");
        exit(2);
    }
    snprintf(fx->conf, sizeof fx->conf, "%s/agreed-1.conf", fx->dir);
    snprintf(fx->secret, sizeof fx->secret, "%s/p1.secret", fx->dir);
    snprintf(fx->public_path, sizeof fx->public_path, "%s/public", fx->dir);
    snprintf(fx->bad, sizeof fx->bad, "%s/bad", fx->dir);
    for (int r = 0; r < NREP; r++) {
        fill(fx->seed[r], 32, 10 + (unsigned)r);
        zz_signkey *sk = zz_signkey_new(fx->seed[r]);
        if (!sk) {
            fprintf(stderr, "zz_signkey_new failed\n");
            exit(2);
        }
        zz_signkey_public(sk, fx->pub[r]);
        zz_signkey_free(sk);
        for (int s = 0; s < NREP; s++)
            fill(fx->mac[r][s], 32, 100 + (unsigned)(r < s ? r * 8 + s : s * 8 + r));
        fill(fx->client_mac[r], 32, 200 + (unsigned)r);
    }
    fill(fx->client_seed, 32, 77);
    zz_signkey *sk = zz_signkey_new(fx->client_seed);
    zz_signkey_public(sk, fx->client_pub);
    zz_signkey_free(sk);
}

static void secret_text(const fixture *fx, char *out, size_t cap)
{
    char h[65];
    size_t o = 0;
    hex(fx->seed[1], h);
    o += (size_t)snprintf(out + o, cap - o, "sign %s\n", h);
    for (int s = 0; s < NREP; s++) {
        if (s == 1)
            continue;
        hex(fx->mac[1][s], h);
        o += (size_t)snprintf(out + o, cap - o, "mac %d %s\n", s, h);
    }
    hex(fx->client_mac[1], h);
    snprintf(out + o, cap - o, "mac %u %s\n", CLIENT, h);
}

static void public_text(const fixture *fx, char *out, size_t cap)
{
    char h[65];
    size_t o = 0;
    for (int r = 0; r < NREP; r++) {
        hex(fx->pub[r], h);
        o += (size_t)snprintf(out + o, cap - o, "%d %s\n", r, h);
    }
    hex(fx->client_pub, h);
    snprintf(out + o, cap - o, "%u %s\n", CLIENT, h);
}

static void write_keys(const fixture *fx)
{
    char buf[4096];
    secret_text(fx, buf, sizeof buf);
    write_file(fx->secret, buf);
    public_text(fx, buf, sizeof buf);
    write_file(fx->public_path, buf);
}

/* The base replica file, one entry per line; line i+1 of the file is lines[i]. */
#define NBASE 14
static void base_lines(const fixture *fx, char lines[][256])
{
    snprintf(lines[0], 256, "# generated for the test");
    snprintf(lines[1], 256, "service 7");
    snprintf(lines[2], 256, "id 1");
    snprintf(lines[3], 256, "g 1");
    snprintf(lines[4], 256, "listen 127.0.0.1 7101");
    lines[5][0] = '\0';
    snprintf(lines[6], 256, "peer 0 127.0.0.1 7100");
    snprintf(lines[7], 256, "peer 1 127.0.0.1 7101");
    snprintf(lines[8], 256, "peer 2 127.0.0.1 7102   # trailing comment");
    snprintf(lines[9], 256, "peer 3 localhost 7103");
    snprintf(lines[10], 256, "secret %s", fx->secret);
    snprintf(lines[11], 256, "public %s", fx->public_path);
    snprintf(lines[12], 256, "checkpoint_interval 64");
    snprintf(lines[13], 256, "log_window 192");
}

static void write_conf(const fixture *fx, char lines[][256], int nlines)
{
    char buf[8192];
    size_t o = 0;
    for (int i = 0; i < nlines; i++)
        o += (size_t)snprintf(buf + o, sizeof buf - o, "%s\n", lines[i]);
    write_file(fx->conf, buf);
}

static int contains(const char *hay, const char *needle)
{
    if (strstr(hay, needle))
        return 1;
    printf("  error was: %s\n  expected it to contain: %s\n", hay, needle);
    return 0;
}

static void test_valid(tctx *t, const fixture *fx)
{
    static zz_conf c;
    char lines[NBASE + 16][256];
    char err[1024] = "";
    base_lines(fx, lines);
    int n = NBASE;
    snprintf(lines[n++], 256, "batch_max 50");
    snprintf(lines[n++], 256, "exec_inflight 0");
    snprintf(lines[n++], 256, "exec_hold_ms 50");
    snprintf(lines[n++], 256, "inject_drop 0.25");
    snprintf(lines[n++], 256, "inject_dup 1");
    snprintf(lines[n++], 256, "inject_delay_ms 40");
    snprintf(lines[n++], 256, "inject_seed 18446744073709551615");
    snprintf(lines[n++], 256, "byzantine drop-requests");
    snprintf(lines[n++], 256, "execution external");
    snprintf(lines[n++], 256, "stats_file /tmp/x.json");
    snprintf(lines[n++], 256, "data_dir /tmp/x.data");
    snprintf(lines[n++], 256, "durability write");
    snprintf(lines[n++], 256, "sync_threads 0");
    snprintf(lines[n++], 256, "sync_slice_us 250");
    snprintf(lines[n++], 256, "loop_slice_us 300");
    snprintf(lines[n++], 256, "byzantine_commits 2:3-5:2,3");
    write_keys(fx);
    write_conf(fx, lines, n);

    t_begin(t, "valid file: fields");
    int rc = zz_conf_load(fx->conf, &c, err, sizeof err);
    if (!CHECK(t, rc == 0))
        printf("  error: %s\n", err);
    CHECK(t, c.service == 7 && c.id == 1 && c.g == 1 && c.n == 4);
    CHECK(t, strcmp(c.listen.host, "127.0.0.1") == 0 && c.listen.port == 7101);
    CHECK(t, c.peers[0].port == 7100 && c.peers[2].port == 7102 && c.peers[3].port == 7103);
    CHECK(t, strcmp(c.peers[3].host, "localhost") == 0);
    CHECK(t, c.checkpoint_interval == 64 && c.log_window == 192 && c.batch_max == 50);
    CHECK(t, c.max_inflight == 4 && c.view_timeout_ms == 1000); /* defaults */
    CHECK(t, c.exec_inflight == 0 && c.exec_hold_ms == 50);
    CHECK(t, c.require_signed == 0);
    CHECK(t, c.status_interval_ms == 100 && c.time_tolerance_ms == 2000);
    CHECK(t, c.inject_drop == 0.25 && c.inject_dup == 1.0 && c.inject_delay_ms == 40);
    CHECK(t, c.inject_seed == UINT64_MAX);
    CHECK(t, c.byzantine == ZZ_BYZ_DROP_REQUESTS);
    CHECK(t, c.external_exec == 1);
    CHECK(t, strcmp(c.stats_file, "/tmp/x.json") == 0);
    CHECK(t, strcmp(c.data_dir, "/tmp/x.data") == 0 && c.durability == ZZ_DUR_WRITE);
    CHECK(t, c.sync_threads == 0 && c.sync_slice_us == 250 && c.loop_slice_us == 300);
    CHECK(t, c.byz_commit_view == 2 && c.byz_commit_lo == 3 && c.byz_commit_hi == 5 &&
                 c.byz_commit_peers == 0xc);
    end_case(t);

    t_begin(t, "valid file: keys sorted and looked up");
    CHECK(t, c.sign != NULL);
    CHECK(t, c.nkeys == NREP + 1);
    for (uint32_t i = 1; i < c.nkeys; i++)
        CHECK(t, c.keys[i - 1].id < c.keys[i].id);
    for (uint32_t r = 0; r < NREP; r++) {
        const zz_peer_key *k = zz_conf_key(&c, r);
        CHECK(t, k != NULL && k->id == r && k->pub != NULL);
        CHECK(t, k != NULL && (r == 1 ? k->mac == NULL : k->mac != NULL));
    }
    const zz_peer_key *ck = zz_conf_key(&c, CLIENT);
    CHECK(t, ck != NULL && ck->mac != NULL && ck->pub != NULL);
    CHECK(t, zz_conf_key(&c, 4) == NULL);
    CHECK(t, zz_conf_key(&c, CLIENT + 1) == NULL);
    CHECK(t, zz_conf_key(&c, UINT32_MAX) == NULL);
    end_case(t);

    t_begin(t, "valid file: loaded keys are the ones in the files");
    /* A MAC from the loaded key equals one from the raw key bytes. */
    const zz_peer_key *k2 = zz_conf_key(&c, 2);
    zz_mackey *raw = zz_mackey_new(fx->mac[1][2]);
    uint8_t m1[32], m2[32];
    zz_hmac(k2->mac, "hello", 5, m1);
    zz_hmac(raw, "hello", 5, m2);
    CHECK(t, memcmp(m1, m2, 32) == 0);
    zz_mackey_free(raw);
    /* Replica 2 signs a CHECKPOINT; the loaded public key of 2 verifies it, of 3 does not. */
    zz_signkey *sk2 = zz_signkey_new(fx->seed[2]);
    zz_buf b;
    zz_buf_init(&b);
    uint8_t state[32] = {1, 2, 3};
    size_t st = zz_enc_checkpoint(&b, 7, 2, 128, state);
    CHECK(t, zz_auth_sign(&b, st, sk2) == 0);
    zz_msg m;
    CHECK(t, zz_decode(b.p + st, b.len - st, &m) == ZZ_OK);
    CHECK(t, zz_verify_sig(&m, k2->pub) == 1);
    CHECK(t, zz_verify_sig(&m, zz_conf_key(&c, 3)->pub) == 0);
    /* Our own sign key matches our public key. */
    zz_buf_reset(&b);
    st = zz_enc_checkpoint(&b, 7, 1, 128, state);
    CHECK(t, zz_auth_sign(&b, st, c.sign) == 0);
    CHECK(t, zz_decode(b.p + st, b.len - st, &m) == ZZ_OK);
    CHECK(t, zz_verify_sig(&m, zz_conf_key(&c, 1)->pub) == 1);
    zz_buf_free(&b);
    zz_signkey_free(sk2);
    zz_conf_free(&c);
    CHECK(t, c.nkeys == 0 && c.sign == NULL);
    zz_conf_free(&c); /* idempotent */
    end_case(t);

    t_begin(t, "defaults when optional keys are absent");
    base_lines(fx, lines);
    write_conf(fx, lines, 12); /* drops checkpoint_interval and log_window */
    rc = zz_conf_load(fx->conf, &c, err, sizeof err);
    if (!CHECK(t, rc == 0))
        printf("  error: %s\n", err);
    CHECK(t, c.checkpoint_interval == 128 && c.log_window == 256 && c.batch_max == 400);
    CHECK(t, c.max_inflight == 4 && c.view_timeout_ms == 1000 && c.status_interval_ms == 100);
    CHECK(t, c.exec_inflight == 1 && c.exec_hold_ms == 40);
    CHECK(t, c.time_tolerance_ms == 2000 && c.inject_drop == 0 && c.inject_dup == 0);
    CHECK(t, c.inject_delay_ms == 0 && c.inject_seed == 0 && c.byzantine == ZZ_BYZ_NONE);
    CHECK(t, c.byz_commit_peers == 0);
    CHECK(t, c.external_exec == 0);
    CHECK(t, c.stats_file[0] == '\0' && c.exec_view[0] == '\0');
    CHECK(t, c.data_dir[0] == '\0' && c.durability == ZZ_DUR_FSYNC); /* no log, fsync if one */
    CHECK(t, c.sync_threads == 2 && c.sync_slice_us == ZZ_DEFAULT_SYNC_SLICE_US &&
                 c.loop_slice_us == 0);
    CHECK(t, c.detect_k == 4 && c.detect_floor_ms == 500 && c.detect_ceiling_ms == 5000);
    CHECK(t, c.controld_pub[0] == NULL && c.controld_pub[1] == NULL);
    zz_conf_free(&c);
    end_case(t);

    /* max_inflight's default with a synced log is one batch (conf.c check_conf); a given
     * value, or a log that is only written, keeps its own. */
    static const struct {
        const char *durability, *inflight;
        uint32_t want;
    } dur[] = {
        {NULL, NULL, ZZ_DURABLE_MAX_INFLIGHT}, /* fsync is the default with a data_dir */
        {"durability fsync", NULL, ZZ_DURABLE_MAX_INFLIGHT},
        {"durability fsync", "max_inflight 4", 4},
        {"durability write", NULL, 4},
        {"durability off", NULL, 4},
    };
    for (size_t i = 0; i < sizeof dur / sizeof dur[0]; i++) {
        char name[96];
        snprintf(name, sizeof name, "max_inflight with data_dir, %s, %s",
                 dur[i].durability ? dur[i].durability : "no durability key",
                 dur[i].inflight ? dur[i].inflight : "no max_inflight key");
        t_begin(t, name);
        base_lines(fx, lines);
        n = NBASE;
        snprintf(lines[n++], 256, "data_dir /tmp/x.data");
        if (dur[i].durability)
            snprintf(lines[n++], 256, "%s", dur[i].durability);
        if (dur[i].inflight)
            snprintf(lines[n++], 256, "%s", dur[i].inflight);
        write_conf(fx, lines, n);
        rc = zz_conf_load(fx->conf, &c, err, sizeof err);
        if (!CHECK(t, rc == 0))
            printf("  error: %s\n", err);
        if (!CHECK(t, c.max_inflight == dur[i].want))
            printf("  max_inflight %u, want %u\n", c.max_inflight, dur[i].want);
        zz_conf_free(&c);
        end_case(t);
    }
}

/* One malformed replica file: line `at` (1-based) replaced by `text` (NULL deletes it,
 * at == 0 appends `text`); the error must contain "conf:LINE: KEY:" (`line` 0 = the line
 * after the last, used for missing keys) and `why`. */
typedef struct {
    const char *name;
    int at;
    const char *text;
    int line;
    const char *key;
    const char *why;
} conf_case;

static void run_conf_case(tctx *t, const fixture *fx, const conf_case *cc)
{
    static zz_conf c;
    char lines[NBASE + 2][256];
    char err[1024] = "";
    base_lines(fx, lines);
    int n = NBASE;
    if (cc->at == 0) {
        snprintf(lines[n++], 256, "%s", cc->text);
    } else if (cc->text) {
        snprintf(lines[cc->at - 1], 256, "%s", cc->text);
    } else {
        for (int i = cc->at - 1; i < n - 1; i++)
            memcpy(lines[i], lines[i + 1], 256);
        n--;
    }
    write_conf(fx, lines, n);
    t_begin(t, cc->name);
    int rc = zz_conf_load(fx->conf, &c, err, sizeof err);
    CHECK(t, rc == -1);
    char want[512];
    snprintf(want, sizeof want, "%s:%d: %s: ", fx->conf, cc->line ? cc->line : n + 1, cc->key);
    CHECK(t, contains(err, want));
    if (cc->why)
        CHECK(t, contains(err, cc->why));
    CHECK(t, c.nkeys == 0 && c.sign == NULL); /* nothing leaked into c on failure */
    zz_conf_free(&c);
    end_case(t);
}

static void test_conf_errors(tctx *t, const fixture *fx)
{
    static const conf_case cases[] = {
        {"unknown key", 0, "frobnicate 3", 15, "frobnicate", "unknown key"},
        {"missing service", 2, NULL, 0, "service", "missing"},
        {"missing id", 3, NULL, 0, "id", "missing"},
        {"missing g", 4, NULL, 0, "g", "missing"},
        {"missing listen", 5, NULL, 0, "listen", "missing"},
        {"missing secret", 11, NULL, 0, "secret", "missing"},
        {"missing public", 12, NULL, 0, "public", "missing"},
        {"missing peer 2", 9, NULL, 0, "peer", "missing replica 2"},
        {"bad number", 0, "batch_max 12x", 15, "batch_max", "not a non-negative integer"},
        {"negative number", 0, "view_timeout_ms -5", 15, "view_timeout_ms", NULL},
        {"number too large", 0, "max_inflight 99999999999", 15, "max_inflight", "out of range"},
        {"exec_hold_ms 0", 0, "exec_hold_ms 0", 15, "exec_hold_ms", "out of range"},
        {"exec_hold_ms over an hour", 0, "exec_hold_ms 3600001", 15, "exec_hold_ms",
         "out of range"},
        {"require_signed 2", 0, "require_signed 2", 15, "require_signed", "out of range"},
        {"durability bogus", 0, "durability sometimes", 15, "durability",
         "not one of fsync, write, off"},
        {"sync_threads 5", 0, "sync_threads 5", 15, "sync_threads", "out of range"},
        {"sync_slice_us over 100 ms", 0, "sync_slice_us 100001", 15, "sync_slice_us",
         "out of range"},
        {"loop_slice_us over 100 ms", 0, "loop_slice_us 100001", 15, "loop_slice_us",
         "out of range"},
        {"id >= n", 3, "id 4", 3, "id", "not below n"},
        {"g = 0", 4, "g 0", 4, "g", "out of range"},
        {"3g+1 > max replicas", 4, "g 22", 4, "g", "out of range"},
        {"service 0", 2, "service 0", 2, "service", "out of range"},
        {"log_window not a multiple", 14, "log_window 100", 14, "log_window", "multiple"},
        {"log_window 0", 14, "log_window 0", 14, "log_window", "out of range"},
        {"checkpoint_interval 0", 13, "checkpoint_interval 0", 13, "checkpoint_interval",
         "out of range"},
        {"cp not dividing log_window", 13, "checkpoint_interval 100", 14, "log_window",
         "multiple"},
        {"inject_drop > 1", 0, "inject_drop 1.5", 15, "inject_drop", "probability"},
        {"inject_dup < 0", 0, "inject_dup -0.1", 15, "inject_dup", "probability"},
        {"inject_drop nan", 0, "inject_drop nan", 15, "inject_drop", "probability"},
        {"inject_dup junk", 0, "inject_dup 0.5x", 15, "inject_dup", "probability"},
        {"listen port 0", 5, "listen 127.0.0.1 0", 5, "listen", "port"},
        {"peer port out of range", 8, "peer 1 127.0.0.1 70000", 8, "peer", "port"},
        {"peer beyond n", 0, "peer 7 127.0.0.1 7107", 15, "peer", "replica 7 is not below n"},
        {"peer duplicate", 0, "peer 2 127.0.0.1 7199", 15, "peer", "duplicate"},
        {"duplicate key", 0, "g 1", 15, "g", "duplicate (first on line 4)"},
        {"wrong value count", 5, "listen 127.0.0.1", 5, "listen", "expected 2 values"},
        {"byzantine unknown", 0, "byzantine sometimes", 15, "byzantine", "not one of"},
        {"byzantine_commits without peers", 0, "byzantine_commits 0:3-5", 15,
         "byzantine_commits", "VIEW:LO-HI:PEER"},
        {"byzantine_commits lo above hi", 0, "byzantine_commits 0:5-3:2", 15,
         "byzantine_commits", "LO <= HI"},
        {"execution unknown", 0, "execution remote", 15, "execution", "not one of"},
        {"byzantine false-fault is known", 0, "byzantine falsefault", 15, "byzantine",
         "false-fault"},
        {"exec id out of range", 0, "exec 64 0 active", 15, "exec", "not in 0..63"},
        {"exec host out of range", 0, "exec 0 256 active", 15, "exec", "host '256'"},
        {"exec state unknown", 0, "exec 0 1 awake", 15, "exec", "not one of active, sleeping"},
        {"exec value count", 0, "exec 0 1", 15, "exec", "expected 3 values"},
        {"exec without controld", 0, "exec 0 1 active", 15, "exec", "host 1 of replica 0"},
        {"controld port", 0, "controld 1 127.0.0.1 0", 15, "controld", "port"},
        {"controld host out of range", 0, "controld 300 127.0.0.1 7000", 15, "controld",
         "not in 0..255"},
        {"detect floor above ceiling", 0, "detect_floor_ms 9000", 15, "detect_floor_ms",
         "above detect_ceiling_ms 5000"},
        {"secret file missing", 11, "secret /nonexistent/p1.secret", 11, "secret",
         "cannot open"},
        {"host too long", 5,
         "listen aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa 7101", 5,
         "listen", "host"},
    };
    write_keys(fx);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_conf_case(t, fx, &cases[i]);

    static zz_conf c;
    char err[1024] = "";
    t_begin(t, "nonexistent replica file");
    CHECK(t, zz_conf_load("/nonexistent/agreed.conf", &c, err, sizeof err) == -1);
    CHECK(t, contains(err, "/nonexistent/agreed.conf: cannot open"));
    end_case(t);

    t_begin(t, "line too long");
    char *big = malloc(3000);
    memset(big, 'x', 2999);
    big[2999] = '\0';
    memcpy(big, "stats_file ", 11);
    char bl[NBASE + 1][256];
    base_lines(fx, bl);
    write_conf(fx, bl, NBASE);
    FILE *f = fopen(fx->conf, "a");
    fprintf(f, "%s\n", big);
    fclose(f);
    free(big);
    CHECK(t, zz_conf_load(fx->conf, &c, err, sizeof err) == -1);
    char want[300];
    snprintf(want, sizeof want, "%s:15: line too long", fx->conf);
    CHECK(t, contains(err, want));
    end_case(t);
}

/* Base file plus `extra` lines; loading must fail naming line `line` and `key`, or succeed
 * when key is NULL. */
static void exec_case(tctx *t, const fixture *fx, const char *name, const char *const *extra,
                      int nextra, int line, const char *key, const char *why, zz_conf *out)
{
    static zz_conf c;
    char lines[NBASE + 16][256];
    char err[1024] = "";
    base_lines(fx, lines);
    int n = NBASE;
    for (int i = 0; i < nextra; i++)
        snprintf(lines[n++], 256, "%s", extra[i]);
    write_conf(fx, lines, n);
    t_begin(t, name);
    int rc = zz_conf_load(fx->conf, &c, err, sizeof err);
    if (!key) {
        if (!CHECK(t, rc == 0))
            printf("  error: %s\n", err);
        if (out && rc == 0)
            *out = c; /* shallow: the caller only reads plain fields, then c is freed here */
    } else {
        CHECK(t, rc == -1);
        char want[512];
        snprintf(want, sizeof want, "%s:%d: %s: ", fx->conf, line, key);
        CHECK(t, contains(err, want));
        if (why)
            CHECK(t, contains(err, why));
    }
    zz_conf_free(&c);
    end_case(t);
}

static void test_exec_lines(tctx *t, const fixture *fx)
{
    static zz_conf got;
    write_keys(fx);
    static const char *const ok[] = {
        "exec 0 1 active", "exec 1 2 active", "exec 2 3 sleeping", "byzantine false-fault",
        "controld 0 127.0.0.1 7000", "controld 1 127.0.0.2 7001", "controld 2 ::1 7002",
        "controld 3 localhost 7003",
    };
    memset(&got, 0, sizeof got);
    exec_case(t, fx, "exec and controld lines", ok, 8, 0, NULL, NULL, &got);
    t_begin(t, "exec and controld lines: fields");
    CHECK(t, got.n_exec == 3 && got.byzantine == ZZ_BYZ_FALSE_FAULT);
    CHECK(t, got.exec[0].present && got.exec[0].host == 1 && got.exec[0].active);
    CHECK(t, got.exec[1].host == 2 && got.exec[1].active);
    CHECK(t, got.exec[2].host == 3 && !got.exec[2].active && !got.exec[3].present);
    CHECK(t, got.has_controld[2] && strcmp(got.controld[2].host, "::1") == 0 &&
                 got.controld[2].port == 7002);
    CHECK(t, !got.has_controld[4]);
    end_case(t);

    static const char *const none[] = {"controld 0 127.0.0.1 7000"};
    memset(&got, 0, sizeof got);
    exec_case(t, fx, "no exec lines: detection without wake-ups", none, 1, 0, NULL, NULL, &got);
    t_begin(t, "no exec lines: n_exec 0");
    CHECK(t, got.n_exec == 0);
    end_case(t);

    static const char *const gap[] = {"controld 1 127.0.0.1 7001", "exec 0 1 active",
                                      "exec 2 1 active"};
    exec_case(t, fx, "exec ids with a gap", gap, 3, 17, "exec", "replica 1 missing", NULL);
    static const char *const dup[] = {"controld 1 127.0.0.1 7001", "exec 0 1 active",
                                      "exec 0 1 sleeping"};
    exec_case(t, fx, "exec duplicate", dup, 3, 17, "exec", "duplicate (first on line 16)", NULL);
    static const char *const few[] = {"controld 1 127.0.0.1 7001", "exec 0 1 active",
                                      "exec 1 1 sleeping", "f 1"};
    exec_case(t, fx, "exec fewer than f+1 active", few, 4, 16, "exec", "need at least f+1 = 2",
              NULL);
    static const char *const cdup[] = {"controld 1 127.0.0.1 7001", "controld 1 127.0.0.1 7002"};
    exec_case(t, fx, "controld duplicate", cdup, 2, 16, "controld", "duplicate", NULL);
}

/* A key file damaged on one line: the error names that file and line. */
static void key_case(tctx *t, const fixture *fx, const char *name, int secret_file,
                     const char *append, const char *replace_first, int line, const char *why)
{
    static zz_conf c;
    char err[1024] = "";
    char text[4096];
    write_keys(fx);
    const char *path = secret_file ? fx->secret : fx->public_path;
    if (secret_file)
        secret_text(fx, text, sizeof text);
    else
        public_text(fx, text, sizeof text);
    if (replace_first) {
        char *nl = strchr(text, '\n');
        char rest[2048];
        snprintf(rest, sizeof rest, "%s", nl + 1);
        snprintf(text, sizeof text, "%.1000s\n%s", replace_first, rest);
    }
    if (append)
        strncat(text, append, sizeof text - strlen(text) - 1);
    write_file(path, text);
    char lines[NBASE][256];
    base_lines(fx, lines);
    write_conf(fx, lines, NBASE);
    t_begin(t, name);
    CHECK(t, zz_conf_load(fx->conf, &c, err, sizeof err) == -1);
    char want[300];
    if (line)
        snprintf(want, sizeof want, "%s:%d: ", path, line);
    else
        snprintf(want, sizeof want, "%s", path);
    CHECK(t, contains(err, want));
    CHECK(t, contains(err, why));
    CHECK(t, c.nkeys == 0 && c.sign == NULL);
    end_case(t);
    write_keys(fx);
}

static void test_key_errors(tctx *t, const fixture *fx)
{
    char h[65], line[200];
    /* secret: sign, mac 0, mac 2, mac 3, mac 65536 -> lines 1..5 */
    key_case(t, fx, "secret: bad hex", 1, NULL,
             "sign zz00000000000000000000000000000000000000000000000000000000000000", 1,
             "64 hex digits");
    key_case(t, fx, "secret: short key", 1, "mac 9 0011\n", NULL, 6, "64 hex digits");
    hex(fx->mac[1][2], h);
    snprintf(line, sizeof line, "mac 2 %s\n", h);
    key_case(t, fx, "secret: duplicate mac", 1, line, NULL, 6, "duplicate (first on line 3)");
    hex(fx->seed[1], h);
    snprintf(line, sizeof line, "sign %s\n", h);
    key_case(t, fx, "secret: duplicate sign", 1, line, NULL, 6, "duplicate");
    key_case(t, fx, "secret: unknown line", 1, "\n# ok\nsalt 12\n", NULL, 8, "expected");
    key_case(t, fx, "secret: bad peer id", 1,
             "mac x1 0000000000000000000000000000000000000000000000000000000000000000\n", NULL,
             6, "bad peer id");
    hex(fx->mac[1][2], h);
    snprintf(line, sizeof line, "mac 1 %s\n", h);
    key_case(t, fx, "secret: mac with itself", 1, line, NULL, 6, "itself");
    /* public: 0, 1, 2, 3, 65536 -> lines 1..5 */
    key_case(t, fx, "public: bad hex", 0, "9 0g00000000000000000000000000000000000000000000000000000000000000\n",
             NULL, 6, "64 hex digits");
    hex(fx->pub[3], h);
    snprintf(line, sizeof line, "3 %s\n", h);
    key_case(t, fx, "public: duplicate id", 0, line, NULL, 6, "duplicate (first on line 4)");
    key_case(t, fx, "public: malformed line", 0, "12\n", NULL, 6, "expected");
    {
        /* Replica 1's line carries replica 0's key: a secret file from the wrong principal. */
        static zz_conf c;
        char err[1024] = "", text[4096], hx[65];
        size_t o = 0;
        for (int r = 0; r < NREP; r++) {
            hex(fx->pub[r == 1 ? 0 : r], hx);
            o += (size_t)snprintf(text + o, sizeof text - o, "%d %s\n", r, hx);
        }
        write_file(fx->public_path, text);
        t_begin(t, "public: own key differs from the sign key");
        CHECK(t, zz_conf_load(fx->conf, &c, err, sizeof err) == -1);
        char want[300];
        snprintf(want, sizeof want, "%s:2: 1: public key does not match", fx->public_path);
        CHECK(t, contains(err, want));
        end_case(t);
        write_keys(fx);
    }
    {
        /* A secret file without the MAC key of replica 3. */
        static zz_conf c;
        char err[1024] = "", text[4096], want[300];
        secret_text(fx, text, sizeof text);
        char *p = strstr(text, "mac 3 ");
        char *e = strchr(p, '\n');
        memmove(p, e + 1, strlen(e + 1) + 1);
        write_file(fx->secret, text);
        t_begin(t, "secret: no mac key for a replica");
        CHECK(t, zz_conf_load(fx->conf, &c, err, sizeof err) == -1);
        snprintf(want, sizeof want, "%s:11: secret: ", fx->conf);
        CHECK(t, contains(err, want));
        CHECK(t, contains(err, "no mac key for replica 3"));
        end_case(t);
        write_keys(fx);
    }
    {
        /* A secret file without a sign key. */
        static zz_conf c;
        char err[1024] = "", text[4096];
        secret_text(fx, text, sizeof text);
        write_file(fx->secret, strchr(text, '\n') + 1);
        t_begin(t, "secret: no sign key");
        CHECK(t, zz_conf_load(fx->conf, &c, err, sizeof err) == -1);
        CHECK(t, contains(err, "has no sign key"));
        end_case(t);
        write_keys(fx);
    }
}

/* zz_keys_load on its own, the way zz-loadgen loads a client's keys. */
static void test_keys_direct(tctx *t, const fixture *fx)
{
    static zz_conf c;
    char err[1024] = "", text[4096], h[65], path[160];
    snprintf(path, sizeof path, "%s/p%u.secret", fx->dir, CLIENT);
    size_t o = 0;
    hex(fx->client_seed, h);
    o += (size_t)snprintf(text + o, sizeof text - o, "sign %s\n", h);
    for (int r = NREP - 1; r >= 0; r--) { /* unsorted on purpose */
        hex(fx->client_mac[r], h);
        o += (size_t)snprintf(text + o, sizeof text - o, "mac %d %s\n", r, h);
    }
    write_file(path, text);
    write_keys(fx);
    t_begin(t, "zz_keys_load for a client principal");
    memset(&c, 0, sizeof c);
    c.id = CLIENT;
    int rc = zz_keys_load(path, fx->public_path, &c, err, sizeof err);
    if (!CHECK(t, rc == 0))
        printf("  error: %s\n", err);
    CHECK(t, c.sign != NULL && c.nkeys == NREP + 1);
    for (uint32_t r = 0; r < NREP; r++) {
        const zz_peer_key *k = zz_conf_key(&c, r);
        CHECK(t, k && k->mac && k->pub);
        if (k && k->mac) {
            uint8_t a[32], b[32];
            zz_mackey *raw = zz_mackey_new(fx->client_mac[r]);
            zz_hmac(k->mac, "x", 1, a);
            zz_hmac(raw, "x", 1, b);
            CHECK(t, memcmp(a, b, 32) == 0);
            zz_mackey_free(raw);
        }
    }
    CHECK(t, zz_conf_key(&c, CLIENT) && zz_conf_key(&c, CLIENT)->mac == NULL);
    /* Loading again replaces, not appends. */
    rc = zz_keys_load(path, fx->public_path, &c, err, sizeof err);
    CHECK(t, rc == 0 && c.nkeys == NREP + 1);
    CHECK(t, zz_keys_load(path, "/nonexistent/public", &c, err, sizeof err) == -1);
    CHECK(t, contains(err, "/nonexistent/public: cannot open"));
    CHECK(t, c.nkeys == 0 && c.sign == NULL);
    zz_conf_free(&c);
    end_case(t);
    unlink(path);
}

/* rack_public: the controlds' keys are kept by host, operator keys skipped, a damaged line
 * or a missing file names the file (and line). */
static void test_rack_public(tctx *t, const fixture *fx)
{
    static zz_conf c;
    char err[1024] = "", h2[65], h3[65], rack[160], text[512];
    char lines[NBASE + 3][256];
    snprintf(rack, sizeof rack, "%s/rack-public", fx->dir);
    hex(fx->pub[2], h2);
    hex(fx->pub[3], h3);
    /* controld of host 1, an operator, controld of host 5 */
    snprintf(text, sizeof text, "16777217 %s\n33554432 %s\n16777221 %s\n", h2, h3, h3);
    write_file(rack, text);
    write_keys(fx);
    base_lines(fx, lines);
    snprintf(lines[NBASE], 256, "rack_public %s", rack);
    snprintf(lines[NBASE + 1], 256, "exec_view %s/view", fx->dir);
    snprintf(lines[NBASE + 2], 256, "spare_keys %s/keys", fx->dir);
    write_conf(fx, lines, NBASE + 3);
    t_begin(t, "rack_public, exec_view and spare_keys");
    int rc = zz_conf_load(fx->conf, &c, err, sizeof err);
    if (!CHECK(t, rc == 0))
        printf("  error: %s\n", err);
    CHECK(t, c.controld_pub[1] != NULL && c.controld_pub[5] != NULL);
    CHECK(t, c.controld_pub[0] == NULL && c.controld_pub[2] == NULL);
    char want[512];
    snprintf(want, sizeof want, "%s/view", fx->dir);
    CHECK(t, strcmp(c.exec_view, want) == 0);
    snprintf(want, sizeof want, "%s/keys", fx->dir);
    CHECK(t, strcmp(c.spare_keys, want) == 0);
    /* the kept key is the one in the file: host 1's verifies a message signed with seed 2 */
    zz_signkey *sk = zz_signkey_new(fx->seed[2]);
    zz_buf b;
    zz_buf_init(&b);
    uint8_t kz[ZZ_KEY_LEN] = {0};
    zz_spare_ready sr = {.replica = 2, .seq = 0, .epoch = 0, .sign_pub = kz, .dh_pub = kz};
    size_t st = zz_enc_spare_ready(&b, 7, ZZ_PRINCIPAL_HOST + 1, &sr);
    CHECK(t, zz_auth_sign(&b, st, sk) == 0);
    zz_msg m;
    CHECK(t, zz_decode(b.p + st, b.len - st, &m) == ZZ_OK);
    CHECK(t, rc == 0 && zz_verify_sig(&m, c.controld_pub[1]) == 1);
    CHECK(t, rc == 0 && zz_verify_sig(&m, c.controld_pub[5]) == 0);
    zz_buf_free(&b);
    zz_signkey_free(sk);
    zz_conf_free(&c);
    CHECK(t, c.controld_pub[1] == NULL);
    end_case(t);

    snprintf(text, sizeof text, "16777217 %s\n16777217 %s\n", h2, h3);
    write_file(rack, text);
    t_begin(t, "rack_public: duplicate controld key");
    CHECK(t, zz_conf_load(fx->conf, &c, err, sizeof err) == -1);
    snprintf(want, sizeof want, "%s:%d: rack_public: %s:2: 16777217: duplicate", fx->conf,
             NBASE + 1, rack);
    CHECK(t, contains(err, want));
    CHECK(t, c.controld_pub[1] == NULL && c.nkeys == 0);
    end_case(t);

    write_file(rack, "16777217 00zz\n");
    t_begin(t, "rack_public: bad hex");
    CHECK(t, zz_conf_load(fx->conf, &c, err, sizeof err) == -1);
    snprintf(want, sizeof want, "%s:1: 16777217: expected 64 hex digits", rack);
    CHECK(t, contains(err, want));
    end_case(t);

    unlink(rack);
    t_begin(t, "rack_public: missing file");
    CHECK(t, zz_conf_load(fx->conf, &c, err, sizeof err) == -1);
    snprintf(want, sizeof want, "%s: cannot open", rack);
    CHECK(t, contains(err, want) && contains(err, "rack_public"));
    end_case(t);
}

int main(void)
{
    tctx t = {0};
    static fixture fx;
    fixture_init(&fx);
    test_valid(&t, &fx);
    test_conf_errors(&t, &fx);
    test_exec_lines(&t, &fx);
    test_key_errors(&t, &fx);
    test_keys_direct(&t, &fx);
    test_rack_public(&t, &fx);
    unlink(fx.conf);
    unlink(fx.secret);
    unlink(fx.public_path);
    rmdir(fx.dir);
    return t_summary(&t);
}
