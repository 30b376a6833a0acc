/* faults.h - fault detection decisions (docs/fault-detection.md §3-§5): is a WAKEUP justified,
 * whom to wake, whom to convict. Pure functions over already-verified fault statements, a port
 * of zz/faults.py with the same reason codes, wake choice and resolve ordering. */
#ifndef ZZ_FAULTS_H
#define ZZ_FAULTS_H

#include <stdint.h>

#include "wire.h"

/* Same value as replica.h; duplicated so that this header does not pull in the replica. */
#ifndef ZZ_MAX_EXEC
#define ZZ_MAX_EXEC 64 /* execution replicas per service */
#endif

enum { ZZ_FENTRY_NONE = 0, ZZ_FENTRY_ONTIME = 1, ZZ_FENTRY_LATE = 2 }; /* = wire row state */

/* One cell of a row; dig is ignored when state is NONE. A LATE digest never equals an
 * ONTIME one, even with the same bytes (docs/fault-detection.md §2). */
typedef struct {
    uint8_t state;
    uint8_t dig[ZZ_DIGEST_LEN];
} zz_fentry;

/* A verified fault statement: agreement replica signer's row for seq over the n awake
 * execution replicas ids[0..n) (ascending); e[k] is what signer saw from ids[k].
 * The service is checked by the caller (the wire message carries it). */
typedef struct {
    uint32_t signer;
    uint64_t seq;
    uint32_t n;
    uint32_t ids[ZZ_MAX_EXEC];
    zz_fentry e[ZZ_MAX_EXEC];
} zz_frow;

enum {
    ZZ_FAULT_OK = 0,
    ZZ_FAULT_BAD_PARAMS,
    ZZ_FAULT_BAD_SIGNER,
    ZZ_FAULT_DUPLICATE_SIGNER,
    ZZ_FAULT_WRONG_SEQ,
    ZZ_FAULT_SHAPE,
    ZZ_FAULT_NOT_A_FAULT,
    ZZ_FAULT_TOO_FEW_SIGNERS,
    ZZ_FAULT_NOT_CONVICTABLE,
    ZZ_FAULT_EMPTY_ROUND /* nobody asleep and fewer than 2f+1 awake (§4a) */
};

/* "ok", "bad-params", ... as in docs/fault-detection.md §4; "unknown" for other values. */
const char *zz_fault_reason_name(int reason);

/* Checks rows[0..nrows) as WAKEUP evidence for seq over the awake replicas (ascending) and,
 * when justified, writes the sleepers to wake (ascending, *n_wake of them) into wake, which
 * must have room for ZZ_MAX_EXEC ids. Returns ZZ_FAULT_OK or the first failing reason;
 * *n_wake is 0 unless OK. OK with *n_wake = 0 (nobody asleep) only when n_awake >= 2f+1:
 * a round that wakes nobody decides from the awake replicas' reports (§4a). */
int zz_fault_evaluate(const zz_frow *rows, uint32_t nrows, uint32_t f, uint32_t g, uint64_t seq,
                      const uint32_t *awake, uint32_t n_awake, const uint32_t *sleeping,
                      uint32_t n_sleeping, uint32_t *wake, uint32_t *n_wake);

/* Rows up to which zz_fault_choose tries every subset of at least g+1 of them. */
#define ZZ_FAULT_SUBSET_MAX 10

/* The evidence a WAKEUP carries, from rows[0..nrows) (the verified statements of one
 * candidate, nrows <= 64): the first set of at least g+1 rows that zz_fault_evaluate
 * accepts. A faulty signer's row can spoil a set that is justified without it, so with at
 * most ZZ_FAULT_SUBSET_MAX rows every subset is tried by falling size, else the full set and
 * the sets missing one row. On ZZ_FAULT_OK the chosen rows are copied to sub (room for nrows)
 * in order, *n_sub of them, *mask has bit i set for each chosen rows[i], and the wake set is
 * written as by zz_fault_evaluate (empty only over 2f+1 awake with nobody asleep: a round
 * that wakes nobody, §4a). Otherwise returns the reason of the full set, *mask = 0. */
int zz_fault_choose(const zz_frow *rows, uint32_t nrows, uint32_t f, uint32_t g, uint64_t seq,
                    const uint32_t *awake, uint32_t n_awake, const uint32_t *sleeping,
                    uint32_t n_sleeping, zz_frow *sub, uint32_t *n_sub, uint64_t *mask,
                    uint32_t *wake, uint32_t *n_wake);

/* This agreement replica's own view of replica id's report for the seq being resolved. */
typedef struct {
    uint32_t id;
    zz_fentry e;
} zz_freport;

/* decided = 0: no digest has f+1 reports yet, every list is empty. Otherwise digest is the
 * decided one; convict, stay and sleep are ascending; shortfall = f+1 - n_stay. */
typedef struct {
    int decided;
    uint8_t digest[ZZ_DIGEST_LEN];
    uint32_t convict[ZZ_MAX_EXEC], n_convict, stay[ZZ_MAX_EXEC], n_stay, sleep[ZZ_MAX_EXEC],
        n_sleep, shortfall;
} zz_fresolution;

/* Convictions and the new active set once awake and woken replicas have reported
 * (docs/fault-detection.md §5). Replicas absent from reports count as NONE.
 * Returns 0, or -1 when the evidence is rejected by the checks of zz_fault_evaluate, the
 * replica sets are invalid, or two digests each have f+1 reports (more than f faults). */
int zz_fault_resolve(const zz_frow *rows, uint32_t nrows, uint32_t f, uint32_t g,
                     const uint32_t *awake, uint32_t n_awake, const uint32_t *woken,
                     uint32_t n_woken, const zz_freport *reports, uint32_t n_reports,
                     zz_fresolution *out);

/* clamp(k * t1, floor, ceiling) in ms: how long after the first EXEC-REPORT the others are
 * on time (docs/fault-detection.md §1). Saturates instead of overflowing; if floor > ceiling
 * the ceiling wins. */
uint64_t zz_fault_timer_ms(uint64_t t1, uint32_t k, uint64_t floor, uint64_t ceiling);

#endif
