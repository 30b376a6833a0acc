/* zzexec.h - ZZ's layer in zz-agreed, as the PBFT core sees it: external execution
 * (execute.c, xlog.c), fault detection (detect.c) and fault handling (statements.c,
 * rounds.c, peer_certs.c, spares.c, exec_view.c). The PBFT core (request.c, normal.c,
 * checkpoint.c, viewchange.c, status.c, replica.c) reaches the layer only through what this
 * header declares; the layer's own files call each other through zzlayer.h.
 *
 * State: everything the layer keeps lives in zz_exec, the replica's `zz` member, which the
 * layer owns (zz_exec_init, zz_exec_free).
 *
 * Invariants: `exec_state` is the one awake set that EXEC-COMMIT pushes, certificates and
 * fault rows use; the execution log holds the batches of (xlog_low, last_exec]; the layer
 * touches PBFT state only through the replica's public functions (replica.h). */
#ifndef ZZ_ZZEXEC_H
#define ZZ_ZZEXEC_H

#include <stddef.h>
#include <stdint.h>

#include "conf.h"
#include "net.h"
#include "wire.h"

typedef struct zz_replica zz_replica;

#define ZZ_MAX_EXEC 64 /* execution replicas per service */

/* The execution log (external execution): committed batches kept from the last stable
 * execution checkpoint on, so that a woken or restarted execution replica can replay them
 * (ZZ §4.4). Ring of conf->exec_log entries; entry seq lives at seq % cap. */
typedef struct {
    uint64_t seq; /* 0 = empty */
    uint8_t digest[ZZ_DIGEST_LEN];
    uint8_t *batch; /* owned; NULL for a null request */
    uint32_t batch_len;
} zz_xlog_entry;

/* One execution replica's EXEC-CHECKPOINT vote. Votes are kept per sender, its newest
 * ZZ_XCKPT_VOTES above the stable execution checkpoint: a sender's new vote can only
 * replace one of its own (docs/fault-detection.md, "Bounded evidence"). */
#define ZZ_XCKPT_VOTES 8
typedef struct {
    uint64_t seq; /* 0 = empty */
    uint8_t dig[ZZ_DIGEST_LEN];
} zz_xvote;

/* EXEC-REPORTs for one sequence number (detect.c). The ring has L + ZZ_DETECT_RECORDS
 * records and holds the seqs of (stable + L - size, stable + L]: every seq of the window
 * has a record of its own, and a record is reused only once its seq fell below. */
#define ZZ_DETECT_RECORDS 1024
typedef struct zz_report_rec {
    uint64_t seq; /* 0 = unused */
    struct zz_replica *owner;
    uint64_t dispatch_ms, first_ms;
    uint64_t flag_ms;     /* when the mismatch or timeout was flagged (detection latency) */
    uint64_t timer;       /* net timer id of the K·t1 deadline, 0 = none */
    int dispatched;                  /* ordered and handed to execution here: the timer
                                      * starts only then, and nothing is judged before */
    int expired, certified, flagged; /* flagged: counted as a mismatch or a timeout */
    int stated;                      /* a fault statement was signed (or suppressed) */
    int deferred;                    /* reported, but its timer waits for seq - 1 to
                                      * settle (detect.c arm); t1_ms as at that report */
    uint64_t t1_ms;
    uint8_t reported[ZZ_MAX_EXEC], late[ZZ_MAX_EXEC];
    uint8_t dig[ZZ_MAX_EXEC][ZZ_DIGEST_LEN];
    /* Each reporter's reply_refs (owned, 44 bytes each) until the seq is certified: the
     * certified list feeds REPLY-AFFIRM. Freed at certification or when the slot is reused. */
    uint8_t *refs[ZZ_MAX_EXEC];
    uint32_t nrefs[ZZ_MAX_EXEC];
} zz_report_rec;

/* What this agreement replica believes about execution replica i (conf exec lines). */
enum { ZZ_EXEC_UNKNOWN = 0, ZZ_EXEC_AWAKE, ZZ_EXEC_SLEEPING, ZZ_EXEC_CONVICTED };
struct zz_wake; /* wake.h: fault statements collected, the open round */

/* The layer's state in the replica (r->zz). */
typedef struct {
    zz_conn *exec_conn[ZZ_MAX_EXEC]; /* external execution: where execution replica i listens */
    zz_xlog_entry *xlog;            /* conf->exec_log entries (external execution only) */
    uint64_t xlog_low;              /* entries are kept for seq in (xlog_low, last_exec] */
    uint64_t exec_stable;           /* last stable execution checkpoint (f+1 matching) */
    uint8_t exec_stable_dig[ZZ_DIGEST_LEN];
    zz_xvote xvotes[ZZ_MAX_EXEC][ZZ_XCKPT_VOTES]; /* per execution replica */
    /* The newest checkpoint certified by f+1 matching EXEC-REPORTs at its seq (their
     * checkpoint ref, docs/wire.md), above exec_stable; 0 = none. */
    zz_xvote xcert;
    zz_report_rec *reports;         /* n_reports (external execution only) */
    uint32_t n_reports;
    uint32_t n_exec;                /* execution replicas seen reporting (row width) */
    /* Awake set (conf exec lines; all ZZ_EXEC_UNKNOWN without them): starts as the conf's
     * active replicas, grows on an adopted WAKEUP, becomes a SHUTDOWN's `active`. Only
     * awake replicas get EXEC-COMMITs and count in certificates and fault rows. */
    uint8_t exec_state[ZZ_MAX_EXEC];
    struct zz_wake *wake;           /* NULL without exec lines */
} zz_exec;

/* execute.c: in-order execution (in process, or EXEC-COMMIT pushes to the execution
 * replicas), called whenever a slot may have committed */
void zz_try_execute(zz_replica *r);
void zz_exec_readonly(zz_replica *r, uint32_t ci, const zz_msg *m);

/* set-up and teardown (replica.c; exec_view.c): the execution log, the report records and
 * the fault state with external execution; -1 with err set. zz_exec_free frees it all
 * (also after a failed init); zz_exec_on_close forgets a closed execution connection. */
int zz_exec_init(zz_replica *r, char *err, size_t errcap);
void zz_exec_free(zz_replica *r);
void zz_exec_on_close(zz_replica *r, const zz_conn *conn);

/* messages of the layer, after replica.c authenticated them */
void zz_on_exec_message(zz_replica *r, const zz_msg *m); /* EXEC-REPORT, EXEC-CHECKPOINT */
void zz_on_fault_statement(zz_replica *r, const zz_msg *m);
void zz_on_wakeup(zz_replica *r, const zz_msg *m);
void zz_on_shutdown(zz_replica *r, const zz_msg *m);
void zz_on_spare_ready(zz_replica *r, const zz_msg *m); /* verifies the controld's signature */
/* An execution replica's message failed authentication: counted per slot if it verifies under
 * the slot's previous key (key epochs, spares.c). */
void zz_exec_auth_failed(zz_replica *r, const zz_msg *m);
void zz_wake_write_stats(zz_replica *r, void *file); /* FILE *, JSON fields */

/* A FETCH for the log (kind 3): with external execution xlog.c answers it from the
 * execution log and registers an execution replica's connection (1); 0 = not external,
 * checkpoint.c serves its own committed log. */
int zz_xlog_on_fetch(zz_replica *r, zz_conn *conn, const zz_msg *m);

/* Durable state (wal.c, xlog.c): the execution log below the agreement stable checkpoint and
 * the stable execution checkpoint are kept in the replica's log. zz_xlog_restore_stable and
 * zz_xlog_restore put them back at recovery (no-ops without external execution);
 * zz_xlog_write puts them into a rewrite of the log. */
void zz_xlog_restore_stable(zz_replica *r, uint64_t seq, const uint8_t dig[ZZ_DIGEST_LEN],
                            uint64_t low);
void zz_xlog_restore(zz_replica *r, uint64_t seq, const uint8_t dig[ZZ_DIGEST_LEN],
                     const uint8_t *batch, uint32_t len);
void zz_xlog_write(zz_replica *r, zz_buf *b, uint32_t epoch);

#endif
