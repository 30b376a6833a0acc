/* zzlayer.h - what the files of ZZ's layer in zz-agreed call in each other (internal):
 * execute.c and xlog.c (external execution, the execution log and checkpoints), detect.c
 * (EXEC-REPORTs), and the fault handling files that share wake.h. The PBFT core never
 * includes it: it calls the layer through zzexec.h.
 *
 * Invariants: see zzexec.h (the awake set, the execution log) and wake.h (the fault round). */
#ifndef ZZ_ZZLAYER_H
#define ZZ_ZZLAYER_H

#include "replica.h"

/* set-up and teardown of the parts (zz_exec_init, zz_exec_free) */
int zz_wake_init(zz_replica *r, char *err, size_t errcap);
void zz_wake_free(zz_replica *r);
void zz_detect_free(zz_replica *r);
void zz_xlog_free(zz_replica *r);

/* xlog.c */
const zz_xlog_entry *zz_xlog_get(const zz_replica *r, uint64_t seq);
/* Send the execution log from the stable execution checkpoint on to execution replica i on
 * its registered connection (a woken replica replays it); nothing if it is not connected. */
void zz_xlog_serve(zz_replica *r, uint32_t i);
void zz_xlog_append(zz_replica *r, const zz_slot *s);
/* Per-sender EXEC-CHECKPOINT votes (pure): store seq/dig in one sender's ZZ_XCKPT_VOTES
 * votes, replacing its vote for seq, an empty one or one at or below `low`, else its lowest
 * if seq is higher; 1 = stored. Count the senders with a vote for seq/dig. */
int zz_xvote_put(zz_xvote *own, uint64_t low, uint64_t seq, const uint8_t dig[ZZ_DIGEST_LEN]);
uint32_t zz_xvote_count(const zz_xvote (*tab)[ZZ_XCKPT_VOTES], uint32_t nsenders, uint64_t seq,
                        const uint8_t dig[ZZ_DIGEST_LEN]);
void zz_xlog_release_held(zz_replica *r); /* a suspected fault settled */
void zz_xlog_report_certified(zz_replica *r, uint64_t seq, const uint8_t *refs, uint32_t nrefs);

/* exec_view.c, statements.c, rounds.c (wake.h) */
uint64_t zz_fault_round_seq(const zz_replica *r); /* the open fault round's seq, 0 = none */
int zz_exec_counts(const zz_replica *r, uint32_t i); /* awake, or no exec lines at all */
void zz_wake_on_flag(zz_replica *r, zz_report_rec *k);        /* detect.c flagged k->seq */
void zz_wake_on_certified(zz_replica *r, zz_report_rec *k);   /* false-fault test mode */
void zz_wake_on_report(zz_replica *r, zz_report_rec *k); /* a report for k->seq arrived */
/* A report for a seq whose record left the ring: 1 if it is the fault round's (taken). */
int zz_wake_on_lost_report(zz_replica *r, uint32_t i, uint64_t seq, const uint8_t *digest);

/* detect.c */
zz_report_rec *zz_detect_record(zz_replica *r, uint64_t seq); /* NULL if not held */
void zz_detect_dispatched(zz_replica *r, uint64_t seq);
void zz_detect_report(zz_replica *r, uint32_t i, uint64_t seq, const uint8_t *digest,
                      const uint8_t *refs, uint32_t nrefs);
void zz_detect_forget(zz_replica *r, uint32_t i, uint64_t seq); /* i convicted at seq */
int zz_detect_window(const zz_replica *r, uint64_t seq);      /* zz_seq_window of reports */
void zz_detect_on_report(zz_replica *r, const zz_msg *m); /* checks the reply digest first */

#endif
