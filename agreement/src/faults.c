/* faults.c - fault detection decisions: WAKEUP evidence checks, whom to wake, whom to convict.
 * A line-by-line port of zz/faults.py (docs/fault-detection.md §3-§5); tests/vectors/faults.txt
 * pins both to the same outcomes, so change them together. Pure, no allocation.
 * zz_fault_choose, zz-agreed's search for an evidence set among a candidate's rows, has no
 * Python counterpart (controld verifies the set a WAKEUP carries, it never searches).
 *
 * Sizes: rows describe at most ZZ_MAX_EXEC awake replicas, and every loop below is at most
 * quadratic in that or in nrows, which the signer checks bound to 3g+1 distinct rows before
 * any rule runs (a longer list fails with bad-signer or duplicate-signer first);
 * zz_fault_choose evaluates at most 2^ZZ_FAULT_SUBSET_MAX sets, or nrows + 1 with more rows. */
#include "faults.h"

#include <string.h>

static const char *const reason_names[] = {
    [ZZ_FAULT_OK] = "ok",
    [ZZ_FAULT_BAD_PARAMS] = "bad-params",
    [ZZ_FAULT_BAD_SIGNER] = "bad-signer",
    [ZZ_FAULT_DUPLICATE_SIGNER] = "duplicate-signer",
    [ZZ_FAULT_WRONG_SEQ] = "wrong-seq",
    [ZZ_FAULT_SHAPE] = "shape",
    [ZZ_FAULT_NOT_A_FAULT] = "not-a-fault",
    [ZZ_FAULT_TOO_FEW_SIGNERS] = "too-few-signers",
    [ZZ_FAULT_NOT_CONVICTABLE] = "not-convictable",
    [ZZ_FAULT_EMPTY_ROUND] = "empty-round",
};

const char *zz_fault_reason_name(int reason) {
    if (reason < 0 || (size_t)reason >= sizeof reason_names / sizeof reason_names[0])
        return "unknown";
    return reason_names[reason];
}

/* Digest bytes of an entry that has one; NONE entries never match anything. */
static int has_digest(const zz_fentry *e) {
    return e->state == ZZ_FENTRY_ONTIME || e->state == ZZ_FENTRY_LATE;
}

static int is_ontime(const zz_fentry *e, const uint8_t d[ZZ_DIGEST_LEN]) {
    return e->state == ZZ_FENTRY_ONTIME && memcmp(e->dig, d, ZZ_DIGEST_LEN) == 0;
}

/* f+1 matching on-time entries = an execution certificate; a correct replica never signs one. */
static int holds_certificate(const zz_frow *r, uint32_t f) {
    for (uint32_t a = 0; a < r->n; a++) {
        if (r->e[a].state != ZZ_FENTRY_ONTIME)
            continue;
        uint64_t same = 0;
        for (uint32_t b = 0; b < r->n; b++)
            same += is_ontime(&r->e[b], r->e[a].dig);
        if (same >= (uint64_t)f + 1)
            return 1;
    }
    return 0;
}

/* Rows showing awake replica index k without an on-time d. */
static uint32_t against(const zz_frow *rows, uint32_t nrows, uint32_t k,
                        const uint8_t d[ZZ_DIGEST_LEN]) {
    uint32_t n = 0;
    for (uint32_t r = 0; r < nrows; r++)
        n += !is_ontime(&rows[r].e[k], d);
    return n;
}

/* Rows showing awake replica index k with a digest other than d, on time or late. */
static uint32_t wrong(const zz_frow *rows, uint32_t nrows, uint32_t k,
                      const uint8_t d[ZZ_DIGEST_LEN]) {
    uint32_t n = 0;
    for (uint32_t r = 0; r < nrows; r++)
        n += has_digest(&rows[r].e[k]) && memcmp(rows[r].e[k].dig, d, ZZ_DIGEST_LEN) != 0;
    return n;
}

static int ascending_distinct(const uint32_t *ids, uint32_t n) {
    for (uint32_t i = 1; i < n; i++)
        if (ids[i] <= ids[i - 1])
            return 0;
    return 1;
}

/* _check of zz/faults.py: statements are checked one at a time, in the order given, so the
 * first bad statement decides the reason exactly as on the Python side. */
static int check(const zz_frow *rows, uint32_t nrows, uint32_t f, uint32_t g, uint64_t seq,
                 const uint32_t *awake, uint32_t n_awake) {
    if (n_awake > ZZ_MAX_EXEC || (nrows > 0 && !rows) || (n_awake > 0 && !awake) ||
        !ascending_distinct(awake, n_awake) || n_awake == 0)
        return ZZ_FAULT_BAD_PARAMS;
    for (uint32_t i = 0; i < nrows; i++) {
        const zz_frow *s = &rows[i];
        if ((uint64_t)s->signer > 3 * (uint64_t)g)
            return ZZ_FAULT_BAD_SIGNER;
        /* One signer twice would let g faulty replicas look like g+1. */
        for (uint32_t j = 0; j < i; j++)
            if (rows[j].signer == s->signer)
                return ZZ_FAULT_DUPLICATE_SIGNER;
        if (s->seq != seq)
            return ZZ_FAULT_WRONG_SEQ;
        if (s->n != n_awake ||
            (n_awake > 0 && memcmp(s->ids, awake, (size_t)n_awake * sizeof *awake) != 0))
            return ZZ_FAULT_SHAPE;
        if (holds_certificate(s, f))
            return ZZ_FAULT_NOT_A_FAULT;
    }
    return ZZ_FAULT_OK;
}

/* Definition 1 (docs/fault-detection.md §3): for every digest anyone reported (on time or
 * late), some awake replica is shown without it on time by g+1 rows. */
static int convictable(const zz_frow *rows, uint32_t nrows, uint32_t g) {
    if ((uint64_t)nrows < (uint64_t)g + 1)
        return 0;
    uint32_t n = rows[0].n;
    for (uint32_t r = 0; r < nrows; r++) {
        for (uint32_t c = 0; c < n; c++) {
            const zz_fentry *cand = &rows[r].e[c];
            if (!has_digest(cand))
                continue;
            int covered = 0;
            for (uint32_t k = 0; k < n && !covered; k++)
                covered = (uint64_t)against(rows, nrows, k, cand->dig) >= (uint64_t)g + 1;
            if (!covered)
                return 0;
        }
    }
    return 1;
}

/* f+1 minus the largest group on time with the same digest in every row. A faulty row can
 * only shrink the group, i.e. wake more (never more than f+1 in total), never fewer. */
static uint64_t wake_count(const zz_frow *rows, uint32_t nrows, uint32_t f) {
    uint32_t n = rows[0].n, best = 0;
    /* A digest on time in every row is on time in the first one, so its cells are the
     * only candidates. */
    for (uint32_t c = 0; c < n; c++) {
        const zz_fentry *cand = &rows[0].e[c];
        if (cand->state != ZZ_FENTRY_ONTIME)
            continue;
        uint32_t group = 0;
        for (uint32_t k = 0; k < n; k++)
            group += against(rows, nrows, k, cand->dig) == 0;
        if (group > best)
            best = group;
    }
    return (uint64_t)f + 1 > best ? (uint64_t)f + 1 - best : 0;
}

/* The count smallest of ids[0..n) in ascending order, duplicates kept, like sorted()[:count];
 * count <= ZZ_MAX_EXEC. */
static uint32_t smallest(const uint32_t *ids, uint32_t n, uint32_t count, uint32_t *out) {
    uint32_t m = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t v = ids[i], pos = m;
        while (pos > 0 && out[pos - 1] > v)
            pos--;
        if (pos >= count)
            continue;
        uint32_t last = m < count ? m : count - 1;
        for (uint32_t p = last; p > pos; p--)
            out[p] = out[p - 1];
        out[pos] = v;
        if (m < count)
            m++;
    }
    return m;
}

int zz_fault_evaluate(const zz_frow *rows, uint32_t nrows, uint32_t f, uint32_t g, uint64_t seq,
                      const uint32_t *awake, uint32_t n_awake, const uint32_t *sleeping,
                      uint32_t n_sleeping, uint32_t *wake, uint32_t *n_wake) {
    *n_wake = 0;
    int reason = check(rows, nrows, f, g, seq, awake, n_awake);
    if (reason != ZZ_FAULT_OK)
        return reason;
    if (n_sleeping > 0 && !sleeping)
        return ZZ_FAULT_BAD_PARAMS;
    if ((uint64_t)nrows < (uint64_t)g + 1)
        return ZZ_FAULT_TOO_FEW_SIGNERS;
    /* Fewer than f+1 awake (a shortfall an earlier round left) never certify anything:
     * g+1 rows over such a set wake the missing replicas with nobody to convict. */
    if ((uint64_t)n_awake >= (uint64_t)f + 1 && !convictable(rows, nrows, g))
        return ZZ_FAULT_NOT_CONVICTABLE;
    /* Nobody asleep: a round that wakes nobody decides from the awake replicas' reports,
     * which only 2f+1 awake (f+1 of them correct) are sure to do (§4a). */
    if (n_sleeping == 0 && (uint64_t)n_awake < 2 * (uint64_t)f + 1)
        return ZZ_FAULT_EMPTY_ROUND;
    /* wake_count <= f+1 <= n_awake <= ZZ_MAX_EXEC, so wake has room. */
    uint64_t count = wake_count(rows, nrows, f);
    if (count > n_sleeping)
        count = n_sleeping;
    *n_wake = smallest(sleeping, n_sleeping, (uint32_t)count, wake);
    return ZZ_FAULT_OK;
}

/* Evaluate the rows of mask (copied to sub); ZZ_FAULT_OK with the wake set, or the reason. */
static int try_mask(const zz_frow *rows, uint32_t nrows, uint64_t mask, uint32_t f, uint32_t g,
                    uint64_t seq, const uint32_t *awake, uint32_t n_awake,
                    const uint32_t *sleeping, uint32_t n_sleeping, zz_frow *sub,
                    uint32_t *n_sub, uint32_t *wake, uint32_t *n_wake) {
    uint32_t k = 0;
    for (uint32_t i = 0; i < nrows; i++)
        if (mask & (1ULL << i))
            sub[k++] = rows[i];
    *n_sub = k;
    return zz_fault_evaluate(sub, k, f, g, seq, awake, n_awake, sleeping, n_sleeping, wake,
                             n_wake);
}

int zz_fault_choose(const zz_frow *rows, uint32_t nrows, uint32_t f, uint32_t g, uint64_t seq,
                    const uint32_t *awake, uint32_t n_awake, const uint32_t *sleeping,
                    uint32_t n_sleeping, zz_frow *sub, uint32_t *n_sub, uint64_t *mask,
                    uint32_t *wake, uint32_t *n_wake) {
    *mask = 0;
    *n_sub = 0;
    *n_wake = 0;
    if (nrows == 0 || nrows > 64 || !rows || !sub)
        return ZZ_FAULT_BAD_PARAMS;
    uint64_t full = nrows == 64 ? UINT64_MAX : (1ULL << nrows) - 1;
    int first = try_mask(rows, nrows, full, f, g, seq, awake, n_awake, sleeping, n_sleeping,
                         sub, n_sub, wake, n_wake);
    if (first == ZZ_FAULT_OK) {
        *mask = full;
        return ZZ_FAULT_OK;
    }
    uint64_t min = (uint64_t)g + 1;
    if (nrows <= ZZ_FAULT_SUBSET_MAX) {
        for (uint32_t pc = nrows - 1; pc >= min && pc > 0; pc--)
            for (uint64_t m = full - 1; m > 0; m--)
                if ((uint32_t)__builtin_popcountll(m) == pc &&
                    try_mask(rows, nrows, m, f, g, seq, awake, n_awake, sleeping, n_sleeping,
                             sub, n_sub, wake, n_wake) == ZZ_FAULT_OK) {
                    *mask = m;
                    return ZZ_FAULT_OK;
                }
    } else if (nrows - 1 >= min) {
        for (uint32_t i = 0; i < nrows; i++) {
            uint64_t m = full & ~(1ULL << i);
            if (try_mask(rows, nrows, m, f, g, seq, awake, n_awake, sleeping, n_sleeping, sub,
                         n_sub, wake, n_wake) == ZZ_FAULT_OK) {
                *mask = m;
                return ZZ_FAULT_OK;
            }
        }
    }
    *n_sub = 0;
    *n_wake = 0;
    return first;
}

static void sort_ids(uint32_t *ids, uint32_t n) {
    for (uint32_t i = 1; i < n; i++) {
        uint32_t v = ids[i], p = i;
        for (; p > 0 && ids[p - 1] > v; p--)
            ids[p] = ids[p - 1];
        ids[p] = v;
    }
}

static const zz_fentry none_entry = {.state = ZZ_FENTRY_NONE};

int zz_fault_resolve(const zz_frow *rows, uint32_t nrows, uint32_t f, uint32_t g,
                     const uint32_t *awake, uint32_t n_awake, const uint32_t *woken,
                     uint32_t n_woken, const zz_freport *reports, uint32_t n_reports,
                     zz_fresolution *out) {
    memset(out, 0, sizeof *out);
    uint64_t seq = nrows > 0 && rows ? rows[0].seq : 0;
    if (check(rows, nrows, f, g, seq, awake, n_awake) != ZZ_FAULT_OK)
        return -1;
    if ((uint64_t)n_awake + n_woken > ZZ_MAX_EXEC || (n_woken > 0 && !woken) ||
        (n_reports > 0 && !reports))
        return -1;

    /* everyone = awake (ascending) then woken (ascending); got[i] = its report or NONE. */
    uint32_t all[ZZ_MAX_EXEC], n_all = n_awake + n_woken;
    if (n_awake > 0)
        memcpy(all, awake, (size_t)n_awake * sizeof *awake);
    if (n_woken > 0)
        memcpy(all + n_awake, woken, (size_t)n_woken * sizeof *woken);
    sort_ids(all + n_awake, n_woken);
    const zz_fentry *got[ZZ_MAX_EXEC];
    for (uint32_t i = 0; i < n_all; i++) {
        for (uint32_t j = 0; j < i; j++)
            if (all[j] == all[i])
                return -1; /* a woken replica is also awake, or woken twice */
        got[i] = &none_entry;
    }
    for (uint32_t r = 0; r < n_reports; r++) {
        for (uint32_t q = 0; q < r; q++)
            if (reports[q].id == reports[r].id)
                return -1; /* two reports for one replica: the caller's view is inconsistent */
        for (uint32_t i = 0; i < n_all; i++)
            if (all[i] == reports[r].id)
                got[i] = &reports[r].e;
    }

    /* Decided digest: f+1 reports, late or not (any f+1 include a correct replica). */
    const uint8_t *d = NULL;
    for (uint32_t i = 0; i < n_all; i++) {
        if (!has_digest(got[i]))
            continue;
        uint64_t same = 0;
        for (uint32_t j = 0; j < n_all; j++)
            same += has_digest(got[j]) && memcmp(got[j]->dig, got[i]->dig, ZZ_DIGEST_LEN) == 0;
        if (same < (uint64_t)f + 1)
            continue;
        if (d && memcmp(d, got[i]->dig, ZZ_DIGEST_LEN) != 0)
            return -1; /* two digests with f+1 reports: more than f faulty replicas */
        d = got[i]->dig;
    }
    if (!d)
        return 0;
    out->decided = 1;
    memcpy(out->digest, d, ZZ_DIGEST_LEN);

    /* The evidence blames an awake replica for a mismatch (a wrong digest, late or not, in
     * g+1 rows) or for a timeout (d missing or late in g+1 rows). When it blames one for a
     * mismatch, a timeout is excused if the replica answered here, late or not: a wrong
     * early reply may have started the timer a correct replica then missed (TR §9.1.1,
     * Lemma 2 example 2); one that never answered gave no late but correct response
     * (a crash next to a liar, campaign seed 3102 round 12). Own wrong answers are
     * convicted either way. */
    uint8_t blamed[ZZ_MAX_EXEC] = {0};
    int mismatch = 0;
    for (uint32_t i = 0; i < n_awake; i++)
        mismatch |= blamed[i] = (uint64_t)wrong(rows, nrows, i, d) >= (uint64_t)g + 1;
    for (uint32_t i = 0; i < n_awake; i++)
        if (!blamed[i] && (!mismatch || !has_digest(got[i])))
            blamed[i] = (uint64_t)against(rows, nrows, i, d) >= (uint64_t)g + 1;
    uint8_t convicted[ZZ_MAX_EXEC] = {0}, right[ZZ_MAX_EXEC];
    for (uint32_t i = 0; i < n_all; i++) {
        right[i] = has_digest(got[i]) && memcmp(got[i]->dig, d, ZZ_DIGEST_LEN) == 0;
        convicted[i] = (has_digest(got[i]) && !right[i]) || blamed[i];
        if (convicted[i])
            out->convict[out->n_convict++] = all[i];
    }
    /* Those that produced d hold the right state: they stay first, in everyone order. */
    for (int pass = 1; pass >= 0; pass--) {
        for (uint32_t i = 0; i < n_all; i++) {
            if (convicted[i] || right[i] != pass)
                continue;
            if ((uint64_t)out->n_stay < (uint64_t)f + 1)
                out->stay[out->n_stay++] = all[i];
            else
                out->sleep[out->n_sleep++] = all[i];
        }
    }
    sort_ids(out->convict, out->n_convict);
    sort_ids(out->stay, out->n_stay);
    sort_ids(out->sleep, out->n_sleep);
    out->shortfall = (uint32_t)((uint64_t)f + 1 - out->n_stay);
    return 0;
}

uint64_t zz_fault_timer_ms(uint64_t t1, uint32_t k, uint64_t floor, uint64_t ceiling) {
    uint64_t v = (k != 0 && t1 > UINT64_MAX / k) ? UINT64_MAX : t1 * k;
    if (v < floor)
        v = floor;
    return v < ceiling ? v : ceiling;
}
