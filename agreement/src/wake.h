/* wake.h - what the files of ZZ fault handling inside zz-agreed share (internal; the PBFT
 * core and detect.c call them through replica.h): exec_view.c (awake set, the view on disk,
 * set-up, sending, stats), statements.c (FAULT-STATEMENTs and candidates), rounds.c (the
 * open round and its resolution into SHUTDOWN), peer_certs.c (WAKEUP and SHUTDOWN from
 * peers), spares.c (SPARE-READY and key epochs). docs/fault-detection.md "In zz-agreed".
 *
 * Invariants: at most one round is open; while it is, no new statement is signed (its
 * rows would be about an awake set that is changing). r->zz.exec_state is the awake set every
 * certificate, row and EXEC-COMMIT push uses. Everything received is verified in these
 * files or in replica.c before it changes any state; anything that fails is dropped and
 * counted. */
#ifndef ZZ_WAKE_H
#define ZZ_WAKE_H

#include <stdio.h>

#include "faults.h"
#include "replica.h"
#include "zzlayer.h"

/* seqs whose statements are being collected at once: one unconfirmed candidate per signer
 * at most, and room for 16 that several signers share (cand_for) */
#define WAKE_CANDIDATES (ZZ_MAX_REPLICAS + 16)
#define WAKE_RESEND_MS 1000  /* WAKEUP to controld again while the woken have not reported */
#define WAKE_RESOLVE_MS 5000 /* + ceiling: resolve without the woken replicas' reports */
#define FIELDS_MAX 6         /* fields per line of the view and keys files (zw_next_fields) */

typedef struct {
    uint64_t seq; /* 0 = free */
    uint32_t n_awake;
    uint32_t awake[ZZ_MAX_EXEC]; /* the statements' awake set (their row ids) */
    uint8_t **raw;               /* per signer: its signed FAULT-STATEMENT (owned) or NULL */
    uint32_t *len;
    uint32_t count;
    uint64_t first_ms;
} candidate;

struct zz_wake {
    candidate cand[WAKE_CANDIDATES];
    zz_frow *rows, *sub;     /* n scratch rows each: decoded statements, an evidence set */
    int links[ZZ_MAX_HOSTS]; /* net link to each host's controld, -1 = none */
    zz_buf buf;              /* encoder scratch (r->out is reused by xlog.c's log serving) */
    /* the open round: a WAKEUP adopted, its SHUTDOWN not yet decided */
    int open;
    uint64_t seq;
    uint32_t awake[ZZ_MAX_EXEC], n_awake; /* the evidence's awake set */
    uint32_t woken[ZZ_MAX_EXEC], n_woken;
    zz_frow *ev; /* the evidence rows (n entries) */
    uint32_t n_ev;
    /* The round's seq's reports as detect.c last held them, plus those that came once its
     * record left the ring (reused L + 1024 seqs on: under the campaign's load 7 s, before a
     * slow woken replica reported and before the round was overdue, and the round never
     * resolved; seed 3202 round 14). It outlives an undecided round for the follow-up at
     * the same seq. No refs, no timer. */
    zz_report_rec rec;
    uint8_t *wakeup_raw; /* the adopted WAKEUP, resent to controld (owned) */
    uint32_t wakeup_len;
    uint64_t opened_ms, resend_timer;
    int resolve_failed_logged;
    uint8_t **sd_body; /* per sender: body of its SHUTDOWN for the open round (owned) */
    uint32_t *sd_len;
    /* The last round this replica closed with a decision (own or adopted): its SHUTDOWN
     * bodies per sender (ours at r->id) and the body whose outcome we applied, so that a
     * certificate for another outcome can still be adopted (docs/fault-detection.md). */
    int done;
    uint64_t done_seq;
    /* The highest seq any round was decided at: at or below it everything is settled, even
     * once done_seq moved down to a lower certified sibling (check_done). */
    uint64_t settled_seq;
    uint64_t done_floor; /* settled_seq before the done round: its siblings lie above */
    /* The last seq dispatched when a round was last decided: the seqs up to it ran while
     * the woken replicas were still recovering, so their lateness there is no evidence
     * (their timers ran out while they replayed). Never signed or evaluated. */
    uint64_t quiet_through;
    uint32_t done_awake[ZZ_MAX_EXEC], n_done_awake;
    uint8_t **dn_body; /* per sender (owned) */
    uint32_t *dn_len;
    uint8_t *applied; /* the body whose outcome r->zz.exec_state holds (owned) */
    uint32_t applied_len;
    /* Per execution replica: the SHUTDOWN seq that convicted it (persisted), and a verified
     * SPARE-READY's seq that arrived before that conviction was known here (0 = none). */
    uint64_t convicted_seq[ZZ_MAX_EXEC];
    uint64_t spare_pending[ZZ_MAX_EXEC];
    /* Key epochs (docs/wire.md "Key epochs"): per execution slot, the epoch of the key its
     * current incarnation holds (0 = the key directory's), the announced public keys of the
     * current and the previous epoch (persisted in conf->exec_view + ".keys"), the previous
     * epoch's keys (to tell a stale-key message from noise), a held SPARE-READY's keys, and
     * how many messages signed or MACed with the previous key were dropped. */
    uint32_t key_epoch[ZZ_MAX_EXEC];
    uint8_t key_pub[ZZ_MAX_EXEC][2][ZZ_KEY_LEN]; /* [0] current, [1] previous: sign_pub */
    uint8_t key_dh[ZZ_MAX_EXEC][2][ZZ_KEY_LEN];  /* the same for dh_pub */
    uint32_t key_prev_epoch[ZZ_MAX_EXEC];
    zz_pubkey *old_pub[ZZ_MAX_EXEC];
    zz_mackey *old_mac[ZZ_MAX_EXEC];
    uint32_t pend_epoch[ZZ_MAX_EXEC];
    uint8_t pend_pub[ZZ_MAX_EXEC][ZZ_KEY_LEN], pend_dh[ZZ_MAX_EXEC][ZZ_KEY_LEN];
    uint64_t stale_key[ZZ_MAX_EXEC];
};

/* exec_view.c */
void zw_bcast_raw(zz_replica *r, const uint8_t *msg, size_t len);
void zw_cand_clear(zz_replica *r, candidate *c);
void zw_done_clear(zz_replica *r);
void zw_fmt_ids(char *s, size_t cap, const uint32_t *ids, uint32_t n);
int zw_ids_from(const zz_flist *l, uint32_t *out, uint32_t *n);
uint32_t zw_list_state(const zz_replica *r, uint8_t state, uint32_t *out);
int zw_nested_ids(const uint32_t *a, uint32_t na, const uint32_t *b, uint32_t nb);
int zw_next_fields(FILE *f, char **line, size_t *cap, uint32_t *lineno, char **tok,
                   const char *path, const char *what, char *err, size_t errcap);
int zw_parse_dec(const char *s, uint64_t max, uint64_t *out);
void zw_round_clear(zz_replica *r);
void zw_round_close_undecided(zz_replica *r);
zz_report_rec *zw_round_record(zz_replica *r);
int zw_same_ids(const uint32_t *a, uint32_t na, const uint32_t *b, uint32_t nb);
void zw_save_view(zz_replica *r);
void zw_send_controld(zz_replica *r, uint32_t exec_id, const uint8_t *msg, size_t len,
                      uint8_t *sent_hosts);
void zw_send_wakeup_controld(zz_replica *r, const uint32_t *wake, uint32_t n_wake,
                             const uint8_t *msg, size_t len);

/* statements.c */
void zw_retry_candidates(zz_replica *r);
int zw_row_from(const zz_msg *m, zz_frow *row);
void zw_send_statement(zz_replica *r, const zz_report_rec *k, int blame_first);

/* rounds.c */
void zw_apply_resolution(zz_replica *r, uint64_t seq, const uint32_t *convict, uint32_t nc,
                         const uint32_t *sleep, uint32_t ns, const uint32_t *active,
                         uint32_t na);
void zw_open_round(zz_replica *r, uint64_t seq, const uint32_t *awake, uint32_t n_awake,
                   const uint32_t *wake, uint32_t n_wake, const zz_frow *rows,
                   uint32_t nrows, const uint8_t *raw, uint32_t len);
void zw_set_done(zz_replica *r, const uint8_t *applied, uint32_t applied_len,
                 const uint8_t *own, uint32_t own_len);

/* peer_certs.c */
void zw_adopt(zz_replica *r, const uint8_t *body, uint32_t len, uint64_t seq,
              const uint32_t *convict, uint32_t nc, const uint32_t *sleep, uint32_t ns,
              const uint32_t *active, uint32_t nact);
int zw_body_lists(zz_replica *r, const uint8_t *p, uint32_t len,
                  uint32_t out[4][ZZ_MAX_EXEC], uint32_t n[4]);
uint64_t zw_body_seq(const uint8_t *p, uint32_t len);
void zw_check_done(zz_replica *r);
uint32_t zw_count_body(zz_replica *r, uint8_t **bodies, const uint32_t *lens,
                       const uint8_t *body, uint32_t len);

/* spares.c */
int zw_load_keys(zz_replica *r, char *err, size_t errcap);
/* At start, after zw_load_keys: the key directory's announcements (conf spare_keys). */
int zw_load_announced(zz_replica *r, char *err, size_t errcap);
void zw_take_key(zz_replica *r, uint32_t x, uint32_t epoch, const uint8_t *pub,
                 const uint8_t *dh);

#endif
