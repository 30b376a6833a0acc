/* byz.h - test-only misbehaviour of zz-agreed, the conf's `byzantine` setting (none,
 * equivocate, drop-requests, silent, false-fault; docs/agreement.md). One hook per point
 * where a faulty replica acts differently; the product files ask these hooks and never test
 * the setting themselves, so a correct replica's code reads as the protocol.
 *
 * Invariant: with `byzantine none` (the default, and every product deployment) every hook
 * answers "behave correctly": zz_byz_silent, zz_byz_drops_requests and zz_byz_false_fault
 * are 0, zz_byz_pre_prepare sends nothing and, without `byzantine_commits`,
 * zz_byz_withholds_commit is 0. Compiled in always, so the tests run the
 * binary they ship. */
#ifndef ZZ_BYZ_H
#define ZZ_BYZ_H

#include <stdint.h>

#include "replica.h"

/* Every send point: 1 = send nothing at all (silent). */
int zz_byz_silent(const zz_replica *r);
/* The primary's proposal loop: 1 = never propose client requests (drop-requests). */
int zz_byz_drops_requests(const zz_replica *r);
/* A FAULT-STATEMENT for a certified seq: 1 = sign one blaming the lowest awake (correct)
 * execution replica (false-fault); alone it must never wake anyone. */
int zz_byz_false_fault(const zz_replica *r);

/* A COMMIT for (view, seq) to agreement replica `to`: 1 = withhold it (`byzantine_commits`;
 * a correct replica that only lost those messages, for the view-change tests). */
int zz_byz_withholds_commit(const zz_replica *r, uint32_t to, uint32_t view, uint64_t seq);

/* Send one PRE-PREPARE for `seq` with `batch` to agreement replica `to` (request.c). */
typedef void zz_byz_send_pp(zz_replica *r, uint32_t to, uint64_t seq, const uint8_t *batch,
                            uint32_t len);
/* The primary's PRE-PREPARE for seq: with equivocate, every backup gets a different batch
 * (the seed at batch bytes 8..15 differs), so no PREPARE quorum can form and the backups
 * must change view; 1 = sent that way (the batch is left as the last backup's), 0 = send the
 * one batch to all as usual. */
int zz_byz_pre_prepare(zz_replica *r, uint64_t seq, zz_buf *batch, uint64_t seed,
                       zz_byz_send_pp *send_one);

#endif
