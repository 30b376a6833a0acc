/* replica.h - the one replica struct of zz-agreed and the functions of each protocol step.
 * Each step lives in its own file: request.c (clients, batching, replies), normal.c
 * (pre-prepare/prepare/commit), execute.c (in-order execution, echo state machine,
 * EXEC-COMMIT push), checkpoint.c (checkpoints, GC, state transfer, FETCH), viewchange.c,
 * status.c (retransmission); with external execution xlog.c (execution log and checkpoints),
 * detect.c (EXEC-REPORTs), statements.c, rounds.c, peer_certs.c, spares.c and exec_view.c
 * (fault statements, WAKEUP, SHUTDOWN, SPARE-READY, the view; they share wake.h).
 * The PBFT core (request.c, normal.c, checkpoint.c, viewchange.c, status.c, replica.c)
 * reaches ZZ's layer only through zzexec.h; the layer's files share zzlayer.h.
 * docs/design.md §3-§5 follows a request and a fault through them. */
#ifndef ZZ_REPLICA_H
#define ZZ_REPLICA_H

#include <stdint.h>

#include "conf.h"
#include "crypto.h"
#include "net.h"
#include "wal.h"
#include "wire.h"
#include "zzexec.h"

/* One log slot: what this replica knows about sequence number `seq`.
 * Invariant: a slot is in use only for stable < seq <= stable + L, and slot i of the
 * ring holds seq with seq % L == i. */
typedef struct {
    uint64_t seq;      /* 0 = unused */
    uint32_t view;     /* view of the accepted pre-prepare (meaningful if has_pp) */
    int has_pp;        /* a pre-prepare (or NEW-VIEW choice) was accepted in `view` */
    int held;          /* has_pp, but an unsigned request in it failed our MAC entry: no
                        * PREPARE (nor Q entry) until g other backups prepare it (normal.c) */
    int is_null;       /* the NEW-VIEW chose the null request for this seq */
    uint8_t digest[ZZ_DIGEST_LEN];
    uint8_t *batch;    /* batch encoding (owned); NULL until known */
    uint32_t batch_len;
    uint8_t *pp_raw;   /* the primary's PRE-PREPARE as received, relayed on retransmission */
    uint32_t pp_raw_len;
    /* Votes: per replica, the view and digest of its latest PREPARE / COMMIT for seq.
     * Kept before the pre-prepare arrives, since messages are reordered. */
    uint32_t *prep_view, *commit_view;           /* n entries, UINT32_MAX = none */
    uint8_t (*prep_dig)[ZZ_DIGEST_LEN];          /* n entries */
    uint8_t (*commit_dig)[ZZ_DIGEST_LEN];
    int sent_prepare, sent_commit; /* in `view` */
    int prepared, committed;       /* in `view` */
    uint64_t pp_time_ms;           /* when the pre-prepare was accepted (latency stats) */
    uint64_t p_mark;   /* the log's mark of the record that made it prepared: this replica's
                        * own COMMIT counts toward committing only once it is synced */
    uint64_t t_pp_us, t_prep_us, t_commit_us; /* monotonic us when it was pre-prepared,
                                   * prepared, committed here (stats "phases"); 0: not seen */
    /* View-change sets: highest view in which this replica prepared / pre-prepared. */
    int has_p, has_q;
    uint32_t p_view, q_view;
    uint8_t p_dig[ZZ_DIGEST_LEN], q_dig[ZZ_DIGEST_LEN];
    uint64_t fetch_sent_ms;        /* last FETCH for the missing batch */
} zz_slot;

#define ZZ_TAG_PEER 1  /* connection tag: an agreement replica sends on it */

/* Checkpoint votes for one sequence number. The ring has L/CP + 1 records, one per
 * checkpoint seq of [stable, stable + L]; a record is reused only below the stable point. */
typedef struct {
    uint64_t seq;                         /* 0 = unused */
    uint8_t (*dig)[ZZ_DIGEST_LEN];        /* n entries */
    uint8_t **raw;                        /* n signed CHECKPOINT messages (owned) or NULL */
    uint32_t *raw_len;
    uint8_t *state;                       /* our own state encoding at seq (owned) or NULL */
    uint32_t state_len;
    uint8_t own_dig[ZZ_DIGEST_LEN];
    int have_own;
} zz_ckpt;

/* How long a replica skips the signed requests of a client that sent it a wrong signature
 * under a good MAC (replica.c). */
#define ZZ_SIG_BAN_MS 10000u
/* How long a replica, as primary, orders only signed requests of a client one of whose
 * unsigned requests it could not check in a PRE-PREPARE (normal.c, request.c). */
#define ZZ_MUST_SIGN_MS 60000u

/* Per client principal (indexed like conf->keys): exactly-once and reply cache. */
typedef struct {
    uint64_t last_t;    /* timestamp of the last executed request (state) */
    uint8_t *result;    /* cached reply (state, owned) */
    uint32_t result_len;
    zz_conn *conn;      /* where to send replies; NULL if unknown */
    /* pending: the newest authenticated request not yet executed */
    uint8_t *pend_raw;  /* owned copy of the REQUEST message */
    uint32_t pend_len;
    uint64_t pend_t;
    uint64_t pend_since_ms;
    int pend_signed;     /* the pending copy carries a valid client signature (auth kind 3):
                          * only such a request runs the view-change timer (request.c) */
    uint64_t sig_banned_until_ms; /* its MAC for us was good and its signature wrong: a
                                   * faulty client, whose signed requests we skip till then */
    uint64_t must_sign_until_ms;  /* an unsigned request of it failed our MAC entry in a
                                   * PRE-PREPARE: as primary we order only its signed ones */
    uint64_t proposed_t; /* primary: highest t put in a batch in the current view */
    int queued;          /* primary: in the proposal queue */
    /* external execution: the newest request of this client in a batch with an execution
     * certificate here, and SHA-256 of its result (REPLY-AFFIRM to retransmissions) */
    uint64_t aff_t;
    uint8_t aff_dig[ZZ_DIGEST_LEN];
} zz_client;

enum zz_drop {
    ZZ_DROP_SHORT = 1, ZZ_DROP_MAGIC, ZZ_DROP_VERSION, ZZ_DROP_TYPE, ZZ_DROP_LENGTH,
    ZZ_DROP_AUTH, ZZ_DROP_FIELD, /* the seven match enum zz_err */
    ZZ_DROP_SENDER,  /* wrong service or a sender not allowed for the type */
    ZZ_DROP_WINDOW,  /* outside the watermarks */
    ZZ_DROP_VIEW,    /* for another view */
    ZZ_DROP_BADPP,   /* pre-prepare rejected: bad batch, conflicting digest, bad nd_time */
    ZZ_DROP_BADVC,   /* invalid VIEW-CHANGE / NEW-VIEW content */
    ZZ_DROP_N
};

typedef struct {
    uint64_t dropped[ZZ_DROP_N];
    uint64_t requests_in, requests_dup, requests_readonly;
    uint64_t batches_proposed, batches_executed, executed, null_executed;
    uint64_t checkpoints, stable_advances, state_transfers;
    uint64_t view_changes, new_views;
    uint64_t fetches_sent, fetches_served, retransmits;
    uint64_t stale; /* votes and proposals below the low watermark: late, not malformed */
    uint64_t exec_commits_sent, exec_reports, exec_checkpoints, exec_stable_advances;
    uint64_t exec_log_overflow; /* batches dropped from a full execution log */
    uint64_t exec_stable_held;  /* f+1-matched execution checkpoints held back by a fault round */
    uint64_t exec_stable_by_reports; /* checkpoints certified by f+1 matching EXEC-REPORTs */
    uint64_t exec_reports_convicted; /* EXEC-REPORTs of a convicted replica, dropped */
    uint64_t exec_certificates, exec_mismatches, exec_timeouts;
    uint64_t exec_timers_deferred; /* a seq's timer started when seq - 1 settled (detect.c) */
    uint64_t exec_reports_early; /* kept for a seq not yet dispatched here */
    uint64_t exec_paced;      /* proposals held for execution (conf exec_inflight) */
    uint64_t exec_pace_expired; /* ... and released by the hold's timer */
    /* seq-indexed messages above the window, per sender (also in dropped[ZZ_DROP_WINDOW]) */
    uint64_t exec_window[ZZ_MAX_EXEC];  /* EXEC-REPORT, EXEC-CHECKPOINT */
    uint64_t peer_window[ZZ_MAX_REPLICAS]; /* CHECKPOINT, FAULT-STATEMENT */
    /* messages dropped at intake (undecodable, wrong service or sender, failed
     * authenticator) on a connection charged to a sender slot (net.h ZZ_NET_SENDER_SLOTS;
     * replica.c attribute_conn); also in dropped[] by reason */
    uint64_t malformed_from[ZZ_NET_SENDER_SLOTS];
    /* fault detection in zz-agreed (wake.h) */
    uint64_t fault_statements_sent, fault_statements_received, fault_statements_rejected;
    uint64_t wakeups_sent, wakeups_received, wakeups_rejected, wakeups_relayed;
    uint64_t shutdowns_sent, shutdowns_received, shutdowns_rejected;
    uint64_t controld_sends, reply_affirms_sent;
    uint64_t detect_latency_last_ms, detect_latency_max_ms; /* flag -> own WAKEUP sent */
    uint64_t spares_ready_received, spares_ready_rejected, spares_ready_held;
    uint64_t shutdowns_adopted_over_own; /* a certified outcome replaced our own resolution */
    uint64_t shutdowns_merged; /* two or more certified outcomes of a round, merged */
    /* Request size limits (request.c, normal.c; docs/security.md "Resource limits"). */
    /* client signatures (docs/agreement.md "Signed requests") */
    uint64_t req_signed_in;      /* signed REQUESTs authenticated at intake */
    uint64_t req_bad_sig;        /* signed REQUESTs whose signature failed (also dropped.auth) */
    uint64_t req_bad_mac;        /* REQUESTs whose MAC entry for us failed (also dropped.auth) */
    uint64_t req_sig_banned;     /* signed REQUESTs skipped: their client sent a wrong one */
    uint64_t req_upgraded;       /* a pending unsigned copy replaced by the signed one */
    uint64_t req_timer_exempt;   /* unsigned requests that went pending without a timer */
    uint64_t pp_sig_checked;     /* signed requests whose signature a pre-prepare made us check */
    uint64_t pp_unverifiable;    /* unsigned requests in pre-prepares that failed our MAC */
    uint64_t pp_held;            /* pre-prepares held for such a request */
    uint64_t pp_vouched;         /* held pre-prepares prepared once g other backups had */
    uint64_t must_sign_marks;    /* clients marked must-sign (ZZ_MUST_SIGN_MS) */
    uint64_t unsigned_deferred;  /* primary: unsigned requests left for their signed copy */
    uint64_t requests_too_large;   /* REQUESTs over the limit: dropped, REPLY rejected sent */
    uint64_t batches_too_large;    /* PRE-PREPAREs whose batch is over a limit: refused */
    /* Where a slot's time goes here (stats "phases"): slots that went from pre-prepared to
     * prepared, prepared to committed, committed to executed in one view, and the summed
     * microseconds of each step. */
    uint64_t ph_prep_n, ph_prep_us, ph_commit_n, ph_commit_us, ph_exec_n, ph_exec_us;
} zz_rstats;

/* The replica. Watermarks: stable < seq <= stable + conf->log_window.
 * Views: `view` is the current view; in_vc means this replica sent VIEW-CHANGE for
 * `view` and has not yet accepted its NEW-VIEW, so it takes no normal-case messages. */
typedef struct zz_replica {
    zz_conf *conf;
    zz_net *net;
    uint32_t n, g, id;
    uint32_t L;
    /* views */
    uint32_t view;
    int in_vc;
    uint32_t vc_attempts;           /* failed views in a row: timer = T << attempts */
    uint64_t vc_deadline_ms;        /* in_vc: when to give up on this view */
    uint64_t vc_sent_ms;            /* in_vc: last (re)broadcast of our VIEW-CHANGE */
    uint8_t **vc_raw;               /* per replica, its newest VIEW-CHANGE (owned) */
    uint32_t *vc_len;
    uint32_t *vc_view;              /* its view (0 and NULL raw = none) */
    uint8_t *nv_raw;                /* NEW-VIEW accepted for `view` (owned), relayed */
    uint32_t nv_len;
    /* log */
    zz_slot *slots;                 /* L slots */
    uint64_t next_seq;              /* primary: last seq assigned */
    uint64_t last_exec;             /* last executed seq */
    uint64_t stable;                /* last stable checkpoint */
    uint8_t stable_dig[ZZ_DIGEST_LEN];
    uint8_t **stable_proof;         /* 2g+1 signed CHECKPOINTs for `stable` (owned) */
    uint32_t *stable_proof_len;
    uint32_t stable_proof_n;
    zz_ckpt *ckpts;                 /* n_ckpts = L/CP + 1 records, seq at (seq/CP) % n_ckpts */
    uint32_t n_ckpts;
    /* Per agreement replica: its newest CHECKPOINT above the window (signed, owned), held so
     * that a replica more than L behind can still learn a certified checkpoint to fetch. */
    uint64_t *held_seq;
    uint8_t (*held_dig)[ZZ_DIGEST_LEN];
    uint8_t **held_raw;
    uint32_t *held_len;
    uint64_t transfer_seq;          /* state transfer in progress to this seq (0 = none) */
    uint8_t transfer_dig[ZZ_DIGEST_LEN];
    uint64_t transfer_sent_ms;
    uint64_t ahead_seq;             /* a stable checkpoint seen ahead of last_exec */
    uint64_t ahead_since_ms;
    /* execution state (echo state machine + reply cache) */
    uint8_t app[ZZ_DIGEST_LEN];     /* hash chain of executed operations */
    uint64_t last_nd_time;
    zz_client *clients;             /* conf->nkeys entries, only client principals used */
    zz_exec zz;                     /* external execution, ZZ's layer (zzexec.h) */
    /* primary's proposal queue of client indexes */
    uint32_t *queue;
    uint32_t q_head, q_len;
    int proposing;                  /* re-entrancy guard of zz_try_propose */
    /* batching against execution (request.c): the highest dispatched seq an awake
     * execution replica has reported, the timer that bounds a hold, and its expiry */
    uint64_t exec_done;
    uint64_t exec_lat_ms;           /* recent dispatch -> f+1 reports (request.c) */
    uint64_t pace_timer;
    int pace_expired;
    /* misc */
    uint64_t rng;
    zz_buf out;                     /* scratch encoder buffer */
    zz_buf out2;
    zz_buf rbuf;                    /* replies */
    zz_rstats st;
    uint64_t last_progress_ms;      /* last time execution advanced or a view was installed */
    uint64_t last_status_ms;        /* last STATUS sent */
    uint64_t tick_exec;             /* last_exec at the previous status tick */
    zz_wal wal;                     /* durable state (wal.c); enabled with conf->data_dir */
} zz_replica;

/* replica.c */
int zz_replica_init(zz_replica *r, zz_conf *c, char *err, size_t errcap);
void zz_replica_free(zz_replica *r);
void zz_replica_on_frame(void *ctx, zz_conn *conn, const uint8_t *msg, size_t len);
void zz_replica_on_close(void *ctx, zz_conn *conn);
void zz_replica_start_timers(zz_replica *r);
uint32_t zz_primary(const zz_replica *r, uint32_t view);
int zz_is_primary(const zz_replica *r);
uint64_t zz_now_ms(const zz_replica *r);
uint64_t zz_wall_ms(void);
uint64_t zz_mono_us(void); /* CLOCK_MONOTONIC in microseconds */
/* Ask the scheduler (EEVDF, Linux 6.12 and later) for a slice of `us` microseconds for the
 * calling thread, keeping its policy and nice value (0: leave it). A thread that runs briefly
 * per wakeup gets an earlier virtual deadline with a short slice and so runs when its wakeup
 * comes rather than after the running task's slice. Best effort: an older kernel ignores or
 * refuses it (docs/agreement.md "The sync threads"). */
void zz_sched_slice(uint32_t us);
uint64_t zz_rand(zz_replica *r);
/* Add a MAC vector for all other agreement replicas to the message at `start` and send it. */
void zz_bcast_mac(zz_replica *r, zz_buf *b, size_t start);
void zz_send_mac(zz_replica *r, uint32_t to, zz_buf *b, size_t start);
void zz_bcast_signed(zz_replica *r, zz_buf *b, size_t start);
void zz_write_stats(zz_replica *r);
zz_slot *zz_slot_get(zz_replica *r, uint64_t seq);  /* NULL outside the window */
int zz_in_window(const zz_replica *r, uint64_t seq);
/* Where seq lies against the window (low, low + width]: <0 at or below, 0 in, >0 above. */
int zz_seq_window(uint64_t low, uint64_t width, uint64_t seq);
/* Count a seq-indexed message above the window from agreement replica (peer) or execution
 * replica (!peer) `sender`. */
void zz_count_window(zz_replica *r, int peer, uint32_t sender);
uint8_t *zz_memdup(const void *p, size_t n);
const zz_mackey *zz_mac_for(const zz_replica *r, uint32_t principal);
const zz_pubkey *zz_pub_for(const zz_replica *r, uint32_t principal);
int zz_client_index(const zz_replica *r, uint32_t principal); /* -1 if not a client */

/* request.c */
void zz_on_request(zz_replica *r, zz_conn *conn, const zz_msg *m);
void zz_try_propose(zz_replica *r);
/* f+1 awake execution replicas reported dispatched seq `seq`, `lat_ms` after its dispatch
 * here: may release a held proposal. */
void zz_exec_reported(zz_replica *r, uint64_t seq, uint64_t lat_ms);
/* How long the primary holds a proposal for execution now (request.c). */
uint64_t zz_exec_hold_ms(const zz_replica *r);
void zz_send_reply(zz_replica *r, uint32_t ci, uint32_t view, uint64_t t, uint8_t flags,
                   const uint8_t *res, uint32_t len);
void zz_requeue_pending(zz_replica *r); /* after a view change */
/* A PRE-PREPARE of this view for seq and batch, to replica `to` alone. */
void zz_send_pre_prepare_to(zz_replica *r, uint32_t to, uint64_t seq, const uint8_t *batch,
                            uint32_t len);
/* A pending request older than the given time; only signed ones with signed_only (the
 * view-change timer). */
int zz_has_pending(const zz_replica *r, uint64_t older_than_ms, int signed_only);
/* The largest REQUEST message accepted (request.c): max_request, capped so that a batch of
 * one fits batch_bytes and, with the echo service, every client's cached result fits one
 * state encoding (docs/wire.md "Size limits"). */
uint32_t zz_request_limit(const zz_replica *r);
/* The stats of the resource limits, a JSON fragment ending in ", " (request.c). */
void zz_limits_write_stats(zz_replica *r, void *file); /* FILE * */
void zz_signed_write_stats(zz_replica *r, void *file); /* FILE *: "signed_requests" */

/* normal.c */
void zz_on_pre_prepare(zz_replica *r, const zz_msg *m);
void zz_on_phase(zz_replica *r, const zz_msg *m);
/* Record an accepted proposal (pp or NEW-VIEW choice) for seq in `view` and send PREPARE. */
void zz_accept_proposal(zz_replica *r, zz_slot *s, uint32_t view, const uint8_t *digest,
                        const uint8_t *batch, uint32_t batch_len);
void zz_check_slot(zz_replica *r, zz_slot *s);
void zz_slot_reset(zz_replica *r, zz_slot *s, uint64_t seq);
int zz_slot_set_batch(zz_replica *r, zz_slot *s, const uint8_t *batch, uint32_t len);

/* wal.c: log the slot's durable fields (and its batch, with_batch); dep (enum zz_wal_dep):
 * what a message about to be queued needs of them before any byte goes out to a peer. */
void zz_wal_slot(zz_replica *r, const zz_slot *s, int with_batch, int dep);

/* checkpoint.c */
/* Recovery (wal.c): make the checkpoint at seq our state and the stable one, from its
 * digest, its 2g+1 signed CHECKPOINTs (verified) and our state encoding (its SHA-256 must be
 * the digest). 0 on success; -1 leaves the replica unchanged. */
int zz_restore_stable(zz_replica *r, uint64_t seq, const uint8_t dig[ZZ_DIGEST_LEN],
                      const zz_blist *proof, const uint8_t *state, uint32_t state_len);
void zz_take_checkpoint(zz_replica *r);
void zz_on_checkpoint(zz_replica *r, const zz_msg *m);
void zz_on_fetch(zz_replica *r, zz_conn *conn, const zz_msg *m);
void zz_on_fetch_reply(zz_replica *r, const zz_msg *m);
/* Verify a 2g+1 checkpoint proof (list of signed CHECKPOINT messages) for seq; writes
 * the certified digest. 1 = valid. */
int zz_verify_ckpt_proof(zz_replica *r, const zz_blist *proof, uint64_t seq,
                         uint8_t digest_out[ZZ_DIGEST_LEN]);
void zz_start_transfer(zz_replica *r, uint64_t seq, const uint8_t dig[ZZ_DIGEST_LEN]);
void zz_encode_state(zz_replica *r, zz_buf *b);
void zz_free_ckpts(zz_replica *r);
void zz_ckpt_tick(zz_replica *r);

/* viewchange.c */
void zz_start_view_change(zz_replica *r, uint32_t new_view);
void zz_on_view_change(zz_replica *r, const zz_msg *m);
void zz_on_new_view(zz_replica *r, const zz_msg *m);
void zz_vc_tick(zz_replica *r);

/* status.c */
void zz_status_tick(zz_replica *r);
void zz_on_status(zz_replica *r, const zz_msg *m);

#endif
