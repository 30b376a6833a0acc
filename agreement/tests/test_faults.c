/* test_faults.c - faults.c against the scenarios shared with zz/faults.py
 * (tests/vectors/faults.txt, format in docs/fault-detection.md §7) plus the edges only C has. */
#include <stdlib.h>

#include "faults.h"
#include "testutil.h"

#ifndef ZZ_REPO_ROOT
#define ZZ_REPO_ROOT "."
#endif

#define MAX_ROWS 16
#define MAX_TOK 80
#define MAX_COLS 7 /* agreement replicas of a TR matrix: 3g+1 with g <= 2 */

typedef struct {
    char name[64];
    int has_source, has_params, has_wake, has_report;
    uint32_t f, g;
    uint64_t seq;
    uint32_t awake[ZZ_MAX_EXEC], n_awake, sleeping[ZZ_MAX_EXEC], n_sleeping;
    zz_frow rows[MAX_ROWS];
    uint32_t nrows;
    int want_yes;
    char want_reason[32];
    uint32_t want_wake[ZZ_MAX_EXEC], n_want_wake;
    zz_freport reports[ZZ_MAX_EXEC];
    uint32_t n_reports;
    int want_decided;
    uint8_t want_digest[ZZ_DIGEST_LEN];
    uint32_t want_convict[ZZ_MAX_EXEC], n_convict, want_stay[ZZ_MAX_EXEC], n_stay,
        want_sleep[ZZ_MAX_EXEC], n_sleep;
    /* A TR example: matrix[k][i] is what agreement replica i saw from awake[k]. */
    zz_fentry matrix[ZZ_MAX_EXEC][MAX_COLS];
    uint32_t n_matrix, cols, has_shutdown, has_woken_report;
    zz_fentry woken_report;
    uint32_t want_shutdown[ZZ_MAX_EXEC], n_shutdown;
} vcase;

typedef struct {
    int cases, timers, tr_l2a, tr_l2, parse_errors;
} vstats;

/* A digest label is opaque bytes: its ASCII, zero-padded (the Python side uses the ASCII). */
static int label_digest(const char *s, size_t n, uint8_t d[ZZ_DIGEST_LEN]) {
    if (n == 0 || n > ZZ_DIGEST_LEN)
        return 0;
    memset(d, 0, ZZ_DIGEST_LEN);
    memcpy(d, s, n);
    return 1;
}

static int parse_entry(const char *tok, zz_fentry *e) {
    size_t n = strlen(tok);
    memset(e, 0, sizeof *e);
    if (strcmp(tok, "-") == 0) {
        e->state = ZZ_FENTRY_NONE;
        return 1;
    }
    e->state = ZZ_FENTRY_ONTIME;
    if (n > 1 && tok[n - 1] == '\'') {
        e->state = ZZ_FENTRY_LATE;
        n--;
    }
    return label_digest(tok, n, e->dig);
}

static int parse_u64(const char *s, uint64_t *v) {
    char *end;
    if (!*s || *s == '-')
        return 0;
    unsigned long long x = strtoull(s, &end, 10);
    if (*end)
        return 0;
    *v = x;
    return 1;
}

static int parse_u32(const char *s, uint32_t *v) {
    uint64_t x;
    if (!parse_u64(s, &x) || x > UINT32_MAX)
        return 0;
    *v = (uint32_t)x;
    return 1;
}

static int parse_ids(char **tok, int n, uint32_t *out, uint32_t *count) {
    if (n > ZZ_MAX_EXEC)
        return 0;
    for (int i = 0; i < n; i++)
        if (!parse_u32(tok[i], &out[i]))
            return 0;
    *count = (uint32_t)n;
    return 1;
}

/* Splits line in place at single spaces after cutting the comment; returns the token count. */
static int tokenize(char *line, char **tok, int cap) {
    char *hash = strchr(line, '#');
    if (hash)
        *hash = '\0';
    int n = 0;
    for (char *p = strtok(line, " \t\r\n"); p; p = strtok(NULL, " \t\r\n")) {
        if (n == cap)
            return -1;
        tok[n++] = p;
    }
    return n;
}

static int apply(vcase *c, char **tok, int n) {
    const char *k = tok[0];
    if (strcmp(k, "source") == 0) {
        c->has_source = n > 1;
    } else if (strcmp(k, "params") == 0) {
        int seen = 0;
        for (int i = 1; i < n; i++) {
            if (strncmp(tok[i], "f=", 2) == 0)
                seen += parse_u32(tok[i] + 2, &c->f);
            else if (strncmp(tok[i], "g=", 2) == 0)
                seen += parse_u32(tok[i] + 2, &c->g);
            else if (strncmp(tok[i], "seq=", 4) == 0)
                seen += parse_u64(tok[i] + 4, &c->seq);
            else if (strncmp(tok[i], "service=", 8) == 0)
                seen++; /* rows carry no service in C: the wire layer checks it */
        }
        c->has_params = seen == 4;
        return seen == 4;
    } else if (strcmp(k, "awake") == 0) {
        return parse_ids(tok + 1, n - 1, c->awake, &c->n_awake);
    } else if (strcmp(k, "sleeping") == 0) {
        return parse_ids(tok + 1, n - 1, c->sleeping, &c->n_sleeping);
    } else if (strcmp(k, "row") == 0) {
        if (n < 2 || c->nrows == MAX_ROWS)
            return 0;
        zz_frow *r = &c->rows[c->nrows++];
        memset(r, 0, sizeof *r);
        int i = 2;
        r->seq = c->seq;
        if (!parse_u32(tok[1], &r->signer))
            return 0;
        if (i < n && strncmp(tok[i], "seq=", 4) == 0 && !parse_u64(tok[i++] + 4, &r->seq))
            return 0;
        if (n - i > ZZ_MAX_EXEC)
            return 0;
        /* The row describes the case's awake set; a length mismatch is left to the shape check. */
        r->n = (uint32_t)(n - i);
        for (uint32_t j = 0; j < r->n; j++) {
            r->ids[j] = j < c->n_awake ? c->awake[j] : UINT32_MAX;
            if (!parse_entry(tok[i + (int)j], &r->e[j]))
                return 0;
        }
    } else if (strcmp(k, "expect-wake") == 0) {
        if (n < 3 || strlen(tok[2]) >= sizeof c->want_reason)
            return 0;
        c->has_wake = 1;
        c->want_yes = strcmp(tok[1], "yes") == 0;
        strcpy(c->want_reason, tok[2]);
        return parse_ids(tok + 3, n - 3, c->want_wake, &c->n_want_wake);
    } else if (strcmp(k, "report") == 0) {
        if (n - 1 > ZZ_MAX_EXEC)
            return 0;
        c->has_report = 1;
        for (int i = 1; i < n; i++) {
            char *eq = strchr(tok[i], '=');
            if (!eq)
                return 0;
            *eq = '\0';
            zz_freport *rep = &c->reports[c->n_reports++];
            if (!parse_u32(tok[i], &rep->id) || !parse_entry(eq + 1, &rep->e))
                return 0;
        }
    } else if (strcmp(k, "expect-decided") == 0) {
        if (n != 2)
            return 0;
        c->want_decided = strcmp(tok[1], "-") != 0;
        return !c->want_decided || label_digest(tok[1], strlen(tok[1]), c->want_digest);
    } else if (strcmp(k, "expect-convict") == 0) {
        return parse_ids(tok + 1, n - 1, c->want_convict, &c->n_convict);
    } else if (strcmp(k, "expect-stay") == 0) {
        return parse_ids(tok + 1, n - 1, c->want_stay, &c->n_stay);
    } else if (strcmp(k, "expect-sleep") == 0) {
        return parse_ids(tok + 1, n - 1, c->want_sleep, &c->n_sleep);
    } else if (strcmp(k, "matrix") == 0) {
        /* Lines come in awake order, one cell per agreement replica. */
        uint32_t j;
        if (n < 3 || n - 2 > MAX_COLS || c->n_matrix >= c->n_awake || !parse_u32(tok[1], &j) ||
            j != c->awake[c->n_matrix] || (c->cols && c->cols != (uint32_t)(n - 2)))
            return 0;
        c->cols = (uint32_t)(n - 2);
        for (int i = 2; i < n; i++)
            if (!parse_entry(tok[i], &c->matrix[c->n_matrix][i - 2]))
                return 0;
        c->n_matrix++;
    } else if (strcmp(k, "woken-report") == 0) {
        c->has_woken_report = 1;
        return n == 2 && parse_entry(tok[1], &c->woken_report);
    } else if (strcmp(k, "expect-shutdown") == 0) {
        c->has_shutdown = 1;
        return parse_ids(tok + 1, n - 1, c->want_shutdown, &c->n_shutdown);
    } else {
        return 0;
    }
    return 1;
}

static int same_ids(const uint32_t *a, uint32_t na, const uint32_t *b, uint32_t nb) {
    return na == nb && (na == 0 || memcmp(a, b, na * sizeof *a) == 0);
}

static void print_ids(const char *what, const uint32_t *ids, uint32_t n) {
    printf("    %s:", what);
    for (uint32_t i = 0; i < n; i++)
        printf(" %u", ids[i]);
    printf("\n");
}

/* f+1 equal on-time cells: a correct agreement replica holding a certificate signs nothing. */
static int column_certified(const vcase *c, uint32_t col) {
    for (uint32_t a = 0; a < c->n_matrix; a++) {
        const zz_fentry *x = &c->matrix[a][col];
        uint32_t same = 0;
        for (uint32_t b = 0; b < c->n_matrix; b++)
            same += x->state == ZZ_FENTRY_ONTIME && c->matrix[b][col].state == ZZ_FENTRY_ONTIME &&
                    memcmp(x->dig, c->matrix[b][col].dig, ZZ_DIGEST_LEN) == 0;
        if (same >= c->f + 1)
            return 1;
    }
    return 0;
}

static void column_row(const vcase *c, uint32_t col, zz_frow *r) {
    memset(r, 0, sizeof *r);
    r->signer = col;
    r->seq = c->seq;
    r->n = c->n_awake;
    for (uint32_t k = 0; k < c->n_awake; k++) {
        r->ids[k] = c->awake[k];
        r->e[k] = c->matrix[k][col];
    }
}

static int same_resolution(const zz_fresolution *a, const zz_fresolution *b) {
    return a->decided == b->decided && memcmp(a->digest, b->digest, ZZ_DIGEST_LEN) == 0 &&
           a->n_convict == b->n_convict && a->n_stay == b->n_stay && a->n_sleep == b->n_sleep &&
           memcmp(a->convict, b->convict, a->n_convict * sizeof a->convict[0]) == 0 &&
           memcmp(a->stay, b->stay, a->n_stay * sizeof a->stay[0]) == 0 &&
           memcmp(a->sleep, b->sleep, a->n_sleep * sizeof a->sleep[0]) == 0;
}

/* A TR example: the verdict for every g+1 of the columns without a certificate, and the
 * SHUTDOWN that g+1 agreement replicas vote for, each resolving with its own column. */
static void run_matrix(tctx *t, const vcase *c) {
    zz_frow fault[MAX_COLS], ev[MAX_COLS];
    uint32_t nfault = 0;
    if (!CHECK(t, c->n_matrix == c->n_awake && c->cols == 3 * c->g + 1))
        return;
    for (uint32_t col = 0; col < c->cols; col++)
        if (!column_certified(c, col))
            column_row(c, col, &fault[nfault++]);
    int subsets = 0;
    for (uint32_t mask = 0; mask < (1u << nfault); mask++) {
        uint32_t nev = 0;
        for (uint32_t i = 0; i < nfault; i++)
            if (mask & (1u << i))
                ev[nev++] = fault[i];
        /* Every g+1 of them; all of them when there are fewer. */
        if (nev != c->g + 1 && !(nfault < c->g + 1 && nev == nfault))
            continue;
        subsets++;
        uint32_t wake[ZZ_MAX_EXEC], n_wake = 99;
        int reason = zz_fault_evaluate(ev, nev, c->f, c->g, c->seq, c->awake, c->n_awake,
                                       c->sleeping, c->n_sleeping, wake, &n_wake);
        if (!CHECK(t, strcmp(zz_fault_reason_name(reason), c->want_reason) == 0))
            printf("    rows %#x: reason %s, want %s\n", mask, zz_fault_reason_name(reason),
                   c->want_reason);
        CHECK(t, same_ids(wake, n_wake, c->want_wake, c->n_want_wake));
        if (reason != ZZ_FAULT_OK) {
            CHECK(t, !c->has_shutdown);
            continue;
        }
        zz_fresolution votes[MAX_COLS];
        uint32_t count[MAX_COLS] = {0}, best = 0;
        for (uint32_t col = 0; col < c->cols; col++) {
            zz_freport rep[ZZ_MAX_EXEC];
            uint32_t nrep = 0;
            for (uint32_t k = 0; k < c->n_awake; k++)
                rep[nrep++] = (zz_freport){.id = c->awake[k], .e = c->matrix[k][col]};
            for (uint32_t k = 0; k < n_wake && nrep < ZZ_MAX_EXEC; k++) {
                rep[nrep] = (zz_freport){.id = wake[k], .e = c->woken_report};
                if (!c->has_woken_report) /* default: p on time */
                    parse_entry("p", &rep[nrep].e);
                nrep++;
            }
            CHECK(t, zz_fault_resolve(ev, nev, c->f, c->g, c->awake, c->n_awake, wake, n_wake,
                                      rep, nrep, &votes[col]) == 0);
            for (uint32_t o = 0; o <= col; o++)
                if (same_resolution(&votes[o], &votes[col])) {
                    count[o]++;
                    break;
                }
        }
        uint32_t certified = 0;
        for (uint32_t o = 0; o < c->cols; o++)
            if (count[o] >= c->g + 1) {
                certified++;
                best = o;
            }
        if (CHECK(t, certified == 1 && c->has_shutdown) &&
            !CHECK(t, same_ids(votes[best].convict, votes[best].n_convict, c->want_shutdown,
                               c->n_shutdown)))
            print_ids("shutdown", votes[best].convict, votes[best].n_convict);
    }
    CHECK(t, subsets > 0);
}

static void run_case(tctx *t, const vcase *c) {
    t_begin(t, c->name);
    CHECK(t, c->has_source && c->has_params && c->has_wake);
    if (c->n_matrix) {
        run_matrix(t, c);
        t_end(t);
        return;
    }
    uint32_t wake[ZZ_MAX_EXEC], n_wake = 99;
    int reason = zz_fault_evaluate(c->rows, c->nrows, c->f, c->g, c->seq, c->awake, c->n_awake,
                                   c->sleeping, c->n_sleeping, wake, &n_wake);
    if (!CHECK(t, strcmp(zz_fault_reason_name(reason), c->want_reason) == 0))
        printf("    reason %s, want %s\n", zz_fault_reason_name(reason), c->want_reason);
    CHECK(t, (reason == ZZ_FAULT_OK) == c->want_yes);
    if (!CHECK(t, same_ids(wake, n_wake, c->want_wake, c->n_want_wake)))
        print_ids("wake", wake, n_wake);
    if (c->has_report) {
        zz_fresolution res;
        int rc = zz_fault_resolve(c->rows, c->nrows, c->f, c->g, c->awake, c->n_awake, wake,
                                  n_wake, c->reports, c->n_reports, &res);
        CHECK(t, rc == 0);
        CHECK(t, res.decided == c->want_decided);
        CHECK(t, !c->want_decided || memcmp(res.digest, c->want_digest, ZZ_DIGEST_LEN) == 0);
        if (!CHECK(t, same_ids(res.convict, res.n_convict, c->want_convict, c->n_convict)))
            print_ids("convict", res.convict, res.n_convict);
        if (!CHECK(t, same_ids(res.stay, res.n_stay, c->want_stay, c->n_stay)))
            print_ids("stay", res.stay, res.n_stay);
        if (!CHECK(t, same_ids(res.sleep, res.n_sleep, c->want_sleep, c->n_sleep)))
            print_ids("sleep", res.sleep, res.n_sleep);
        CHECK(t, !res.decided || res.shortfall == c->f + 1 - res.n_stay);
    }
    t_end(t);
}

static void run_timer(tctx *t, char **tok, int n, vstats *st) {
    uint64_t v[5];
    t_begin(t, "timer vector");
    int ok = n == 6;
    for (int i = 0; ok && i < 5; i++)
        ok = parse_u64(tok[i + 1], &v[i]);
    if (CHECK(t, ok && v[1] <= UINT32_MAX)) {
        uint64_t got = zz_fault_timer_ms(v[0], (uint32_t)v[1], v[2], v[3]);
        if (!CHECK(t, got == v[4]))
            printf("    timer(%s) = %llu\n", tok[1], (unsigned long long)got);
    }
    t_end(t);
    st->timers++;
}

/* Returns -1 when the file cannot be opened; malformed lines fail a case of their own. */
static int run_file(tctx *t, const char *path, vstats *st) {
    FILE *fp = fopen(path, "r");
    if (!fp)
        return -1;
    vcase *c = calloc(1, sizeof *c);
    if (!c) {
        fclose(fp);
        return -1;
    }
    char line[4096], *tok[MAX_TOK];
    int in_case = 0, lineno = 0;
    while (fgets(line, sizeof line, fp)) {
        lineno++;
        int n = tokenize(line, tok, MAX_TOK);
        if (n == 0)
            continue;
        int ok = n > 0;
        if (ok && strcmp(tok[0], "timer") == 0 && !in_case) {
            run_timer(t, tok, n, st);
        } else if (ok && strcmp(tok[0], "case") == 0 && !in_case && n == 2 &&
                   strlen(tok[1]) < sizeof c->name) {
            memset(c, 0, sizeof *c);
            strcpy(c->name, tok[1]);
            in_case = 1;
        } else if (ok && strcmp(tok[0], "end") == 0 && in_case) {
            run_case(t, c);
            st->cases++;
            st->tr_l2a += strncmp(c->name, "tr-l2a-", 7) == 0 && c->n_matrix > 0;
            st->tr_l2 += strncmp(c->name, "tr-l2-", 6) == 0 && c->n_matrix > 0;
            in_case = 0;
        } else if (!ok || !in_case || !apply(c, tok, n)) {
            t_begin(t, "vector file syntax");
            CHECK(t, 0);
            printf("    %s:%d: cannot parse\n", path, lineno);
            t_end(t);
            st->parse_errors++;
        }
    }
    if (in_case)
        st->parse_errors++;
    free(c);
    fclose(fp);
    return 0;
}

static void test_vectors(tctx *t) {
    const char *env = getenv("ZZ_REPO_ROOT");
    const char *root = env && *env ? env : ZZ_REPO_ROOT;
    char path[4096];
    vstats st = {0};
    snprintf(path, sizeof path, "%s/tests/vectors/faults.txt", root);
    int rc = run_file(t, path, &st);
    t_begin(t, "faults.txt: the TR's four Lemma 2A and seven Lemma 2 examples, timers");
    if (!CHECK(t, rc == 0))
        printf("    %s: missing\n", path);
    CHECK(t, st.tr_l2a == 4 && st.tr_l2 == 7 && st.timers >= 4 && st.parse_errors == 0);
    printf("fault vectors: %d cases, %d timers from %s\n", st.cases, st.timers, path);
    t_end(t);
}

/* ---- edges the shared vectors cannot express ---- */

static void set_row(zz_frow *r, uint32_t signer, uint64_t seq, const uint32_t *ids, uint32_t n,
                    const char *cells) {
    memset(r, 0, sizeof *r);
    r->signer = signer;
    r->seq = seq;
    r->n = n;
    memcpy(r->ids, ids, n * sizeof *ids);
    for (uint32_t j = 0; j < n; j++) {
        char tok[2] = {cells[j], 0};
        parse_entry(tok, &r->e[j]);
    }
}

static void test_edges(tctx *t) {
    static const uint32_t awake[] = {0, 1}, unsorted[] = {1, 0}, sleeping[] = {5, 2, 2, 9};
    zz_frow rows[3];
    uint32_t wake[ZZ_MAX_EXEC], n_wake;

    t_begin(t, "reason names match docs/fault-detection.md §4");
    CHECK(t, strcmp(zz_fault_reason_name(ZZ_FAULT_OK), "ok") == 0);
    CHECK(t, strcmp(zz_fault_reason_name(ZZ_FAULT_NOT_CONVICTABLE), "not-convictable") == 0);
    CHECK(t, strcmp(zz_fault_reason_name(-1), "unknown") == 0);
    CHECK(t, strcmp(zz_fault_reason_name(99), "unknown") == 0);
    t_end(t);

    t_begin(t, "bad params: unsorted awake, nobody awake, too many awake");
    set_row(&rows[0], 0, 7, awake, 2, "ab");
    set_row(&rows[1], 1, 7, awake, 2, "ab");
    CHECK(t, zz_fault_evaluate(rows, 2, 1, 1, 7, unsorted, 2, sleeping, 1, wake, &n_wake) ==
                 ZZ_FAULT_BAD_PARAMS);
    CHECK(t, zz_fault_evaluate(rows, 2, 1, 1, 7, awake, 0, sleeping, 1, wake, &n_wake) ==
                 ZZ_FAULT_BAD_PARAMS);
    /* Fewer than f+1 awake is a shortfall, not bad parameters: the missing ones are woken
     * (f = 2, two awake agreeing: one more). */
    set_row(&rows[0], 0, 7, awake, 2, "aa");
    set_row(&rows[1], 1, 7, awake, 2, "aa");
    CHECK(t, zz_fault_evaluate(rows, 2, 2, 1, 7, awake, 2, sleeping, 4, wake, &n_wake) ==
                 ZZ_FAULT_OK);
    CHECK(t, n_wake == 1 && wake[0] == 2);
    set_row(&rows[0], 0, 7, awake, 2, "ab");
    set_row(&rows[1], 1, 7, awake, 2, "ab");
    CHECK(t, zz_fault_evaluate(rows, 2, 1, 1, 7, awake, ZZ_MAX_EXEC + 1, sleeping, 1, wake,
                               &n_wake) == ZZ_FAULT_BAD_PARAMS);
    CHECK(t, n_wake == 0);
    t_end(t);

    t_begin(t, "shape: row over other replicas; first bad statement decides");
    static const uint32_t other[] = {0, 2};
    set_row(&rows[1], 1, 7, other, 2, "ab");
    CHECK(t, zz_fault_evaluate(rows, 2, 1, 1, 7, awake, 2, sleeping, 1, wake, &n_wake) ==
                 ZZ_FAULT_SHAPE);
    set_row(&rows[1], 1, 7, awake, 1, "a");
    CHECK(t, zz_fault_evaluate(rows, 2, 1, 1, 7, awake, 2, sleeping, 1, wake, &n_wake) ==
                 ZZ_FAULT_SHAPE);
    /* Statement 0 has the wrong shape and statement 1 a bad signer: the order given wins. */
    set_row(&rows[0], 0, 7, other, 2, "ab");
    set_row(&rows[1], 9, 7, awake, 2, "ab");
    CHECK(t, zz_fault_evaluate(rows, 2, 1, 1, 7, awake, 2, sleeping, 1, wake, &n_wake) ==
                 ZZ_FAULT_SHAPE);
    t_end(t);

    t_begin(t, "same bytes late and on time are different values");
    /* Row 0 "a a'" holds no certificate with f=1 because the late a is not an on-time a. */
    set_row(&rows[0], 0, 7, awake, 2, "aa");
    rows[0].e[1].state = ZZ_FENTRY_LATE;
    set_row(&rows[1], 1, 7, awake, 2, "aa");
    rows[1].e[1].state = ZZ_FENTRY_LATE;
    CHECK(t, zz_fault_evaluate(rows, 2, 1, 1, 7, awake, 2, sleeping, 1, wake, &n_wake) ==
                 ZZ_FAULT_OK);
    CHECK(t, n_wake == 1 && wake[0] == 5); /* sleepers in given order: 5 is the only one */
    t_end(t);

    t_begin(t, "sleepers are taken smallest first, duplicates as given (sorted()[:k])");
    set_row(&rows[0], 0, 7, awake, 2, "--");
    set_row(&rows[1], 1, 7, awake, 2, "--");
    CHECK(t, zz_fault_evaluate(rows, 2, 1, 1, 7, awake, 2, sleeping, 4, wake, &n_wake) ==
                 ZZ_FAULT_OK);
    CHECK(t, n_wake == 2 && wake[0] == 2 && wake[1] == 2);
    /* nobody asleep over two awake (f = 1): a round would wake nobody and could not be sure
     * to decide (§4a) */
    CHECK(t, zz_fault_evaluate(rows, 2, 1, 1, 7, awake, 2, sleeping, 0, wake, &n_wake) ==
                 ZZ_FAULT_EMPTY_ROUND);
    CHECK(t, n_wake == 0);
    t_end(t);

    t_begin(t, "resolve rejects two decided digests, duplicate reports, woken also awake");
    zz_fresolution res;
    set_row(&rows[0], 0, 7, awake, 2, "ab");
    set_row(&rows[1], 1, 7, awake, 2, "ab");
    static const uint32_t woken[] = {2, 3}, woken_bad[] = {1};
    zz_freport rep[4];
    const char *labels = "aabb";
    for (uint32_t i = 0; i < 4; i++) {
        char tok[2] = {labels[i], 0};
        rep[i].id = i;
        parse_entry(tok, &rep[i].e);
    }
    CHECK(t, zz_fault_resolve(rows, 2, 1, 1, awake, 2, woken, 2, rep, 4, &res) == -1);
    rep[3].id = 2;
    CHECK(t, zz_fault_resolve(rows, 2, 1, 1, awake, 2, woken, 2, rep, 4, &res) == -1);
    CHECK(t, zz_fault_resolve(rows, 2, 1, 1, awake, 2, woken_bad, 1, rep, 2, &res) == -1);
    set_row(&rows[1], 1, 8, awake, 2, "ab");
    CHECK(t, zz_fault_resolve(rows, 2, 1, 1, awake, 2, woken, 1, rep, 3, &res) == -1);
    t_end(t);

    t_begin(t, "resolve: undecided leaves everything empty; shortfall when too few remain");
    set_row(&rows[1], 1, 7, awake, 2, "ab");
    CHECK(t, zz_fault_resolve(rows, 2, 1, 1, awake, 2, woken, 1, rep, 1, &res) == 0);
    CHECK(t, !res.decided && res.n_convict == 0 && res.n_stay == 0 && res.shortfall == 0);
    /* Both rows show replica 1 silent; with no sleeper left, 1's late a still decides a,
     * 1 is convicted on the evidence and only 0 remains: one short of f+1. */
    set_row(&rows[0], 0, 7, awake, 2, "a-");
    set_row(&rows[1], 1, 7, awake, 2, "a-");
    rep[1].id = 1;
    rep[1].e.state = ZZ_FENTRY_LATE;
    memcpy(rep[1].e.dig, rep[0].e.dig, ZZ_DIGEST_LEN);
    CHECK(t, zz_fault_resolve(rows, 2, 1, 1, awake, 2, NULL, 0, rep, 2, &res) == 0);
    CHECK(t, res.decided && res.n_convict == 1 && res.convict[0] == 1);
    CHECK(t, res.n_stay == 1 && res.stay[0] == 0 && res.n_sleep == 0 && res.shortfall == 1);
    t_end(t);

    t_begin(t, "timer clamp saturates instead of overflowing");
    CHECK(t, zz_fault_timer_ms(UINT64_MAX / 2, 3, 0, UINT64_MAX) == UINT64_MAX);
    CHECK(t, zz_fault_timer_ms(7, 0, 5, 100) == 5);
    CHECK(t, zz_fault_timer_ms(10, 3, 200, 100) == 100);
    t_end(t);
}

/* zz_fault_choose, the evidence search of statements.c try_evaluate, and its round that
 * wakes nobody (docs/fault-detection.md §4a). */
static void test_choose(tctx *t) {
    static const uint32_t three[] = {0, 1, 2}, two[] = {1, 2}, spare[] = {3};
    zz_frow rows[ZZ_MAX_EXEC], sub[ZZ_MAX_EXEC];
    uint32_t wake[ZZ_MAX_EXEC], n_wake = 99, n_sub = 99;
    uint64_t mask = 99;

    t_begin(t, "nobody asleep, 2f+1 awake: g+1 rows open a round that wakes nobody");
    set_row(&rows[0], 0, 7, three, 3, "ab-");
    set_row(&rows[1], 1, 7, three, 3, "ab-");
    CHECK(t, zz_fault_choose(rows, 2, 1, 1, 7, three, 3, NULL, 0, sub, &n_sub, &mask, wake,
                             &n_wake) == ZZ_FAULT_OK);
    CHECK(t, n_wake == 0 && mask == 3 && n_sub == 2);
    CHECK(t, sub[0].signer == 0 && sub[1].signer == 1);
    t_end(t);

    t_begin(t, "the same rows with a spare asleep wake it");
    CHECK(t, zz_fault_choose(rows, 2, 1, 1, 7, three, 3, spare, 1, sub, &n_sub, &mask, wake,
                             &n_wake) == ZZ_FAULT_OK);
    CHECK(t, n_wake == 1 && wake[0] == 3 && mask == 3);
    t_end(t);

    t_begin(t, "nobody asleep, fewer than 2f+1 awake: no round (empty-round)");
    set_row(&rows[0], 0, 7, two, 2, "ab");
    set_row(&rows[1], 1, 7, two, 2, "ab");
    n_wake = 99;
    CHECK(t, zz_fault_choose(rows, 2, 1, 1, 7, two, 2, NULL, 0, sub, &n_sub, &mask, wake,
                             &n_wake) == ZZ_FAULT_EMPTY_ROUND);
    CHECK(t, mask == 0 && n_wake == 0 && n_sub == 0);
    CHECK(t, strcmp(zz_fault_reason_name(ZZ_FAULT_EMPTY_ROUND), "empty-round") == 0);
    /* f = 2 needs five awake: four are not enough */
    static const uint32_t four[] = {0, 1, 2, 3}, five[] = {0, 1, 2, 3, 4};
    set_row(&rows[0], 0, 7, four, 4, "ab--");
    set_row(&rows[1], 1, 7, four, 4, "ab--");
    CHECK(t, zz_fault_choose(rows, 2, 2, 1, 7, four, 4, NULL, 0, sub, &n_sub, &mask, wake,
                             &n_wake) == ZZ_FAULT_EMPTY_ROUND);
    set_row(&rows[0], 0, 7, five, 5, "aba--");
    set_row(&rows[1], 1, 7, five, 5, "aba--");
    CHECK(t, zz_fault_choose(rows, 2, 2, 1, 7, five, 5, NULL, 0, sub, &n_sub, &mask, wake,
                             &n_wake) == ZZ_FAULT_OK);
    CHECK(t, n_wake == 0 && mask == 3);
    t_end(t);

    t_begin(t, "g rows never open a round that wakes nobody, whatever they say");
    set_row(&rows[0], 3, 7, three, 3, "-ba");
    CHECK(t, zz_fault_choose(rows, 1, 1, 1, 7, three, 3, NULL, 0, sub, &n_sub, &mask, wake,
                             &n_wake) == ZZ_FAULT_TOO_FEW_SIGNERS);
    CHECK(t, mask == 0);
    /* two rows from one faulty signer are still g rows */
    set_row(&rows[1], 3, 7, three, 3, "-ba");
    CHECK(t, zz_fault_choose(rows, 2, 1, 1, 7, three, 3, NULL, 0, sub, &n_sub, &mask, wake,
                             &n_wake) == ZZ_FAULT_DUPLICATE_SIGNER);
    CHECK(t, mask == 0);
    t_end(t);

    t_begin(t, "a faulty signer's row holding a certificate does not spoil the rest");
    set_row(&rows[0], 0, 7, three, 3, "ab-");
    set_row(&rows[1], 3, 7, three, 3, "aba"); /* 0 and 2 agree on time: not a fault row */
    set_row(&rows[2], 2, 7, three, 3, "ab-");
    CHECK(t, zz_fault_choose(rows, 3, 1, 1, 7, three, 3, NULL, 0, sub, &n_sub, &mask, wake,
                             &n_wake) == ZZ_FAULT_OK);
    CHECK(t, mask == 5 && n_sub == 2 && n_wake == 0);
    CHECK(t, sub[0].signer == 0 && sub[1].signer == 2);
    t_end(t);

    t_begin(t, "more than ZZ_FAULT_SUBSET_MAX rows: the sets missing one row");
    uint32_t n = ZZ_FAULT_SUBSET_MAX + 3; /* g = 4: signers 0..12 */
    for (uint32_t i = 0; i < n; i++)
        set_row(&rows[i], i, 7, three, 3, i == 5 ? "aba" : "ab-");
    CHECK(t, zz_fault_choose(rows, n, 1, 4, 7, three, 3, NULL, 0, sub, &n_sub, &mask, wake,
                             &n_wake) == ZZ_FAULT_OK);
    CHECK(t, mask == (((1ULL << n) - 1) & ~(1ULL << 5)) && n_sub == n - 1);
    set_row(&rows[6], 6, 7, three, 3, "aba"); /* two spoilers: no set missing one row passes */
    CHECK(t, zz_fault_choose(rows, n, 1, 4, 7, three, 3, NULL, 0, sub, &n_sub, &mask, wake,
                             &n_wake) == ZZ_FAULT_NOT_A_FAULT);
    CHECK(t, mask == 0);
    t_end(t);

    t_begin(t, "choose: no rows, too many rows");
    CHECK(t, zz_fault_choose(rows, 0, 1, 1, 7, three, 3, NULL, 0, sub, &n_sub, &mask, wake,
                             &n_wake) == ZZ_FAULT_BAD_PARAMS);
    CHECK(t, zz_fault_choose(rows, 65, 1, 1, 7, three, 3, NULL, 0, sub, &n_sub, &mask, wake,
                             &n_wake) == ZZ_FAULT_BAD_PARAMS);
    t_end(t);

    t_begin(t, "a round that wakes nobody resolves from the awake replicas' reports");
    set_row(&rows[0], 0, 7, three, 3, "ab-");
    set_row(&rows[1], 1, 7, three, 3, "ab-");
    zz_freport rep[3];
    memset(rep, 0, sizeof rep);
    for (uint32_t i = 0; i < 3; i++)
        rep[i].id = i;
    parse_entry("a", &rep[0].e);
    parse_entry("b", &rep[1].e);
    zz_fresolution res;
    CHECK(t, zz_fault_resolve(rows, 2, 1, 1, three, 3, NULL, 0, rep, 3, &res) == 0);
    CHECK(t, !res.decided); /* the overdue spare 2 has not answered yet */
    parse_entry("a'", &rep[2].e);
    CHECK(t, zz_fault_resolve(rows, 2, 1, 1, three, 3, NULL, 0, rep, 3, &res) == 0);
    CHECK(t, res.decided && res.n_convict == 1 && res.convict[0] == 1);
    CHECK(t, res.n_stay == 2 && res.stay[0] == 0 && res.stay[1] == 2 && res.n_sleep == 0);
    t_end(t);
}

int main(void) {
    tctx t = {0};
    test_vectors(&t);
    test_edges(&t);
    test_choose(&t);
    return t_summary(&t);
}
