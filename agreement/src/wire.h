/* wire.h - the ZZ binary wire format (docs/wire.md), zero-copy decoder and encoder.
 * Decoded messages point into the caller's buffer; nothing here allocates. */
#ifndef ZZ_WIRE_H
#define ZZ_WIRE_H

#include <stddef.h>
#include <stdint.h>

#define ZZ_MAGIC0 0x5A
#define ZZ_MAGIC1 0x5A
#define ZZ_VERSION 1
#define ZZ_HDR_LEN 16
#define ZZ_DIGEST_LEN 32
#define ZZ_MAC_LEN 32
#define ZZ_SIG_LEN 64
#define ZZ_KEY_LEN 32 /* Ed25519 / X25519 public key */
#define ZZ_MAX_MSG 16777216u
#define ZZ_MAX_LIST 65536u
#define ZZ_MAX_MACS 1024u
/* Size limits (docs/wire.md "Size limits"). A batch travels whole in PRE-PREPARE,
 * EXEC-COMMIT, FETCH-REPLY kind 1 and FETCH-REPLY kind 3, which packs committed batches up
 * to ZZ_LOG_REPLY_SOFT bytes and then adds one more; VIEW-CHANGE and NEW-VIEW carry only
 * digests. ZZ_MSG_OVERHEAD_MAX bounds a header, every fixed field and the largest MAC
 * vector (2 + 36 * ZZ_MAX_MACS = 36866 bytes), so a batch encoding of at most
 * ZZ_MAX_BATCH_BYTES fits every message that carries it. */
#define ZZ_LOG_REPLY_SOFT 4194304u
#define ZZ_MSG_OVERHEAD_MAX 65536u
#define ZZ_MAX_BATCH_BYTES (ZZ_MAX_MSG - ZZ_LOG_REPLY_SOFT - ZZ_MSG_OVERHEAD_MAX)
#define ZZ_BATCH_HDR_LEN 20u /* batch encoding: nd_time, nd_seed, request count */

enum zz_type {
    ZZ_REQUEST = 1,
    ZZ_REPLY = 2,
    ZZ_PRE_PREPARE = 3,
    ZZ_PREPARE = 4,
    ZZ_COMMIT = 5,
    ZZ_CHECKPOINT = 6,
    ZZ_VIEW_CHANGE = 7,
    ZZ_NEW_VIEW = 8,
    ZZ_FETCH = 9,
    ZZ_FETCH_REPLY = 10,
    ZZ_STATUS = 11,
    ZZ_EXEC_COMMIT = 16,
    ZZ_EXEC_REPORT = 17,
    ZZ_EXEC_CHECKPOINT = 18,
    ZZ_FAULT_STATEMENT = 19,
    ZZ_WAKEUP = 20,
    ZZ_SHUTDOWN = 21,
    ZZ_REPLY_AFFIRM = 22,
    ZZ_CONTROL = 23,
    ZZ_CONTROL_REPLY = 24,
    ZZ_FILE_FETCH = 25,
    ZZ_FILE_DATA = 26,
    ZZ_SPARE_READY = 27,
    ZZ_TYPE_MAX = 27
};
/* 12..15 and 28..31 are unassigned; a decoder rejects them like any unknown type. */
#define ZZ_FILE_MAX_CHUNK 4194304u /* FILE-FETCH length and FILE-DATA data, at most */
/* A server's challenge on one connection: FILE-DATA status 6 carries it, and every
 * FILE-FETCH on that connection after it (docs/wire.md "State fetching"). */
#define ZZ_FILE_CHALLENGE_LEN 16u
#define ZZ_FILE_STATUS_CHALLENGE 6u
int zz_type_known(uint8_t type);

/* ZZ_AUTH_MAC_SIG: a MAC vector followed by the sender's Ed25519 signature, both over the
 * authenticated bytes; only a REQUEST may carry it (a client's signed request, which every
 * replica can check: docs/wire.md "Signed requests"). */
enum zz_auth_kind { ZZ_AUTH_NONE = 0, ZZ_AUTH_MAC = 1, ZZ_AUTH_SIG = 2, ZZ_AUTH_MAC_SIG = 3 };

/* Decode errors; names match the `error =` values of tests/vectors/wire.txt. */
enum zz_err {
    ZZ_OK = 0,
    ZZ_ERR_SHORT,   /* "short": fewer bytes than the header or lengths need */
    ZZ_ERR_MAGIC,   /* "magic" */
    ZZ_ERR_VERSION, /* "version" */
    ZZ_ERR_TYPE,    /* "type": unknown type, or wrong auth kind for the type */
    ZZ_ERR_LENGTH,  /* "length": over a limit, or trailing bytes */
    ZZ_ERR_AUTH,    /* "auth": malformed authenticator or failed verification */
    ZZ_ERR_FIELD    /* "field": a field value out of its domain (reserved != 0, ...) */
};
const char *zz_err_name(enum zz_err e);

enum { ZZ_FETCH_BATCH = 1, ZZ_FETCH_STATE = 2, ZZ_FETCH_LOG = 3 };
/* REQUEST flags: READONLY runs unordered at the agreement replicas (PBFT); ORDERED_READ is
 * ordered like any request, and execution replicas run it without write access (ZZ §4.7.2). */
enum { ZZ_REQ_READONLY = 1, ZZ_REQ_ORDERED_READ = 2 };
/* REPLY flags: READONLY (1) answers a read-only request; REJECTED (2) says the request was
 * refused unordered, its result is u8 reason + u32 limit (docs/wire.md). */
enum { ZZ_REPLY_READONLY = 1, ZZ_REPLY_REJECTED = 2 };
enum { ZZ_REJECT_TOO_LARGE = 1 };
#define ZZ_REJECT_LEN 5u

#define ZZ_PRINCIPAL_EXEC 256u
#define ZZ_PRINCIPAL_CLIENT 65536u
#define ZZ_PRINCIPAL_HOST 16777216u
#define ZZ_PRINCIPAL_OPERATOR 33554432u

/* FAULT-STATEMENT row entry states (docs/wire.md). */
enum { ZZ_ROW_NONE = 0, ZZ_ROW_ONTIME = 1, ZZ_ROW_LATE = 2 };

typedef struct {
    const uint8_t *p;
    uint32_t len;
} zz_bytes;

/* A list<bytes>: `count` items encoded back to back starting at p (len bytes total). */
typedef struct {
    uint32_t count;
    const uint8_t *p;
    uint32_t len;
} zz_blist;

/* Iterator over a zz_blist. */
typedef struct {
    const uint8_t *p;
    uint32_t left; /* bytes left */
    uint32_t items_left;
} zz_blist_iter;
void zz_blist_begin(const zz_blist *l, zz_blist_iter *it);
/* Returns 1 and sets *out for the next item, 0 at the end. The list was
 * validated by the decoder, so iteration cannot fail. */
int zz_blist_next(zz_blist_iter *it, zz_bytes *out);

/* VIEW-CHANGE P/Q entry (44 bytes on the wire) and NEW-VIEW choice (40 bytes). */
typedef struct {
    uint64_t seq;
    uint32_t view;
    uint8_t digest[ZZ_DIGEST_LEN];
} zz_entry;
typedef struct {
    uint64_t seq;
    uint8_t digest[ZZ_DIGEST_LEN];
} zz_choice;
#define ZZ_ENTRY_WIRE 44
#define ZZ_CHOICE_WIRE 40
/* FAULT-STATEMENT row entry (37 bytes), EXEC-REPORT reply_ref (44 bytes), list<u32> item. */
typedef struct {
    uint32_t replica;
    uint8_t state;
    uint8_t digest[ZZ_DIGEST_LEN];
} zz_row_entry;
typedef struct {
    uint32_t client;
    uint64_t timestamp;
    uint8_t result_digest[ZZ_DIGEST_LEN];
} zz_reply_ref;
#define ZZ_ROW_WIRE 37
#define ZZ_REPLY_REF_WIRE 44
/* The client of an EXEC-REPORT's checkpoint ref (docs/wire.md): no client has it. */
#define ZZ_CHECKPOINT_REF_CLIENT 0xFFFFFFFFu
#define ZZ_U32_WIRE 4
typedef struct {
    uint32_t count;
    const uint8_t *p; /* count * the item's wire size */
} zz_flist;
void zz_entry_at(const zz_flist *l, uint32_t i, zz_entry *out);
void zz_choice_at(const zz_flist *l, uint32_t i, zz_choice *out);
void zz_row_at(const zz_flist *l, uint32_t i, zz_row_entry *out);
void zz_reply_ref_at(const zz_flist *l, uint32_t i, zz_reply_ref *out);
uint32_t zz_u32_at(const zz_flist *l, uint32_t i);

typedef struct {
    uint64_t timestamp;
    uint8_t flags;
    zz_bytes op;
} zz_request;

typedef struct {
    uint32_t view;
    uint64_t timestamp;
    uint32_t client;
    uint8_t flags;
    zz_bytes result;
} zz_reply;

typedef struct {
    uint32_t view;
    uint64_t seq;
    uint64_t nd_time;
    uint64_t nd_seed;
    zz_blist requests;
    zz_bytes batch; /* the batch encoding: body from nd_time to the end */
} zz_pre_prepare;

typedef struct {
    uint32_t view;
    uint64_t seq;
    const uint8_t *digest;
} zz_phase; /* PREPARE and COMMIT */

typedef struct {
    uint64_t seq;
    const uint8_t *state;
} zz_checkpoint;

typedef struct {
    uint32_t new_view;
    uint64_t stable_seq;
    zz_blist proof;
    zz_flist prepared;
    zz_flist preprepared;
} zz_view_change;

typedef struct {
    uint32_t view;
    zz_blist view_changes;
    uint64_t min_s;
    zz_flist chosen;
} zz_new_view;

typedef struct {
    uint8_t kind;
    uint64_t seq;
    const uint8_t *digest;
} zz_fetch;

typedef struct {
    uint8_t kind;
    uint64_t seq;
    const uint8_t *digest;
    zz_bytes data;
} zz_fetch_reply;

typedef struct {
    uint32_t view;
    uint64_t last_exec;
    uint64_t stable_seq;
} zz_status;

typedef struct {
    uint32_t view;
    uint64_t seq;
    const uint8_t *digest;
    zz_bytes batch;
} zz_exec_commit;

typedef struct {
    uint64_t seq;
    const uint8_t *digest; /* checkpoint digest (EXEC-CHECKPOINT) */
} zz_exec_digest;

/* EXEC-REPORT: the decoder does not check that reply_digest hashes `replies` (wire.c has
 * no crypto); zz_reply_refs_digest does, and the agreement intake drops a mismatch. */
typedef struct {
    uint64_t seq;
    const uint8_t *digest; /* reply_digest */
    zz_flist replies;      /* ZZ_REPLY_REF_WIRE items */
    const uint8_t *refs;   /* the encoded reply_refs (replies.count * 44 bytes): what the
                            * reply digest hashes */
} zz_exec_report;

typedef struct {
    uint64_t seq;
    zz_flist row; /* ZZ_ROW_WIRE items; states in 0..2, a null digest exactly for state 0 */
} zz_fault_statement;

typedef struct {
    uint64_t seq;
    zz_blist evidence; /* complete signed FAULT-STATEMENT messages */
    zz_flist sleeping; /* u32 items */
    zz_flist wake;
} zz_wakeup;

typedef struct {
    uint64_t seq;
    zz_flist awake, convict, sleep, active; /* u32 items */
} zz_shutdown;

typedef struct {
    uint64_t timestamp;
    uint32_t client;
    const uint8_t *result_digest;
} zz_reply_affirm;

typedef struct {
    uint64_t request_id;
    zz_bytes json;
} zz_control; /* CONTROL and CONTROL-REPLY */

typedef struct {
    uint64_t seq;
    zz_bytes path;
    uint64_t offset;
    uint32_t length;
    uint32_t target;    /* the principal of the server it is meant for */
    zz_bytes challenge; /* empty, or that server's ZZ_FILE_CHALLENGE_LEN-byte challenge */
} zz_file_fetch;

typedef struct {
    uint64_t seq;
    zz_bytes path;
    uint64_t offset;
    uint8_t status; /* 0 ok, 1 no such checkpoint, 2 no such file, 3 refused, 4 error,
                       5 later, 6 challenge (data = the connection's challenge) */
    uint64_t size;
    zz_bytes data;
} zz_file_data;

/* SPARE-READY (signed by the controld of the replica's host): a fresh sleeping replica
 * stands under index `replica`; seq = the SHUTDOWN seq that convicted its previous
 * incarnation, 0 for a first provisioning. `epoch` numbers the slot's key generations (0 =
 * the key directory's); sign_pub / dh_pub are the new incarnation's Ed25519 and X25519
 * public keys (pointers into the message). */
typedef struct {
    uint32_t replica;
    uint64_t seq;
    uint32_t epoch;
    const uint8_t *sign_pub; /* ZZ_KEY_LEN bytes */
    const uint8_t *dh_pub;   /* ZZ_KEY_LEN bytes */
} zz_spare_ready;

typedef struct {
    uint8_t type;
    uint8_t auth_kind;
    uint16_t service;
    uint32_t sender;
    const uint8_t *raw;  /* the whole message */
    uint32_t raw_len;
    uint32_t authed_len; /* 16 + body_len: the authenticated bytes are raw[0, authed_len) */
    const uint8_t *body;
    uint32_t body_len;
    const uint8_t *auth;
    uint32_t auth_len;
    union {
        zz_request request;
        zz_reply reply;
        zz_pre_prepare pre_prepare;
        zz_phase phase;
        zz_checkpoint checkpoint;
        zz_view_change view_change;
        zz_new_view new_view;
        zz_fetch fetch;
        zz_fetch_reply fetch_reply;
        zz_status status;
        zz_exec_commit exec_commit;
        zz_exec_digest exec_digest; /* EXEC-CHECKPOINT */
        zz_exec_report exec_report;
        zz_fault_statement fault_statement;
        zz_wakeup wakeup;
        zz_shutdown shutdown;
        zz_reply_affirm reply_affirm;
        zz_control control; /* CONTROL and CONTROL-REPLY */
        zz_file_fetch file_fetch;
        zz_file_data file_data;
        zz_spare_ready spare_ready;
    } u;
} zz_msg;

/* Decode and structurally validate buf[0,len). Does not verify MACs/signatures
 * (see crypto.h), but does check the authenticator's shape for auth_kind. */
enum zz_err zz_decode(const uint8_t *buf, size_t len, zz_msg *out);

/* Decode only a batch encoding (PRE-PREPARE body from nd_time on, or FETCH-REPLY data). */
enum zz_err zz_decode_batch(const uint8_t *buf, size_t len, uint64_t *nd_time, uint64_t *nd_seed,
                            zz_blist *requests);

/* Find the MAC entry for `receiver` in a MAC-vector message; NULL if absent. */
const uint8_t *zz_find_mac(const zz_msg *m, uint32_t receiver);

/* ---- encoding ----
 * A growable buffer. Encoders append a header with body_len patched at the end;
 * an authenticator is added afterwards by crypto.h (zz_auth_mac / zz_auth_sign). */
typedef struct {
    uint8_t *p;
    size_t len;
    size_t cap;
    int oom; /* sticky: set when an allocation failed; the content is then unusable */
} zz_buf;
void zz_buf_init(zz_buf *b);
void zz_buf_free(zz_buf *b);
void zz_buf_reset(zz_buf *b);
void zz_put_u8(zz_buf *b, uint8_t v);
void zz_put_u16(zz_buf *b, uint16_t v);
void zz_put_u32(zz_buf *b, uint32_t v);
void zz_put_u64(zz_buf *b, uint64_t v);
void zz_put_raw(zz_buf *b, const void *p, size_t n);
void zz_put_bytes(zz_buf *b, const void *p, uint32_t n); /* u32 length + data */

/* Start a message: writes the 16-byte header with body_len = 0. Returns the
 * offset of the header in b (messages may be encoded into the middle of a buffer). */
size_t zz_begin(zz_buf *b, uint8_t type, uint8_t auth_kind, uint16_t service, uint32_t sender);
/* Patch body_len of the message started at `start` (call after writing the body,
 * before adding the authenticator). */
void zz_end_body(zz_buf *b, size_t start);

/* Convenience encoders: header + body (no authenticator yet). Return the start offset. */
/* A REQUEST header and body with the given auth kind (ZZ_AUTH_MAC or ZZ_AUTH_MAC_SIG). */
size_t zz_enc_request_kind(zz_buf *b, uint8_t auth_kind, uint16_t svc, uint32_t sender,
                           uint64_t ts, uint8_t flags, const void *op, uint32_t op_len);
size_t zz_enc_request(zz_buf *b, uint16_t svc, uint32_t sender, uint64_t ts, uint8_t flags,
                      const void *op, uint32_t op_len);
size_t zz_enc_reply(zz_buf *b, uint16_t svc, uint32_t sender, uint32_t view, uint64_t ts,
                    uint32_t client, uint8_t flags, const void *res, uint32_t res_len);
/* batch = batch encoding (nd_time, nd_seed, list<bytes> requests) */
size_t zz_enc_pre_prepare(zz_buf *b, uint16_t svc, uint32_t sender, uint32_t view, uint64_t seq,
                          const void *batch, uint32_t batch_len);
size_t zz_enc_phase(zz_buf *b, uint8_t type, uint16_t svc, uint32_t sender, uint32_t view,
                    uint64_t seq, const uint8_t digest[ZZ_DIGEST_LEN]);
size_t zz_enc_checkpoint(zz_buf *b, uint16_t svc, uint32_t sender, uint64_t seq,
                         const uint8_t state[ZZ_DIGEST_LEN]);
size_t zz_enc_fetch(zz_buf *b, uint16_t svc, uint32_t sender, uint8_t kind, uint64_t seq,
                    const uint8_t digest[ZZ_DIGEST_LEN]);
size_t zz_enc_fetch_reply(zz_buf *b, uint16_t svc, uint32_t sender, uint8_t kind, uint64_t seq,
                          const uint8_t digest[ZZ_DIGEST_LEN], const void *data, uint32_t len);
size_t zz_enc_status(zz_buf *b, uint16_t svc, uint32_t sender, uint32_t view, uint64_t last_exec,
                     uint64_t stable_seq);
size_t zz_enc_exec_commit(zz_buf *b, uint16_t svc, uint32_t sender, uint32_t view, uint64_t seq,
                          const uint8_t digest[ZZ_DIGEST_LEN], const void *batch, uint32_t len);
/* EXEC-CHECKPOINT (signed): u64 seq, digest */
size_t zz_enc_exec_digest(zz_buf *b, uint8_t type, uint16_t svc, uint32_t sender, uint64_t seq,
                          const uint8_t digest[ZZ_DIGEST_LEN]);
/* EXEC-REPORT: refs = `nrefs` encoded reply_refs (44 bytes each) back to back. */
size_t zz_enc_exec_report(zz_buf *b, uint16_t svc, uint32_t sender, uint64_t seq,
                          const uint8_t digest[ZZ_DIGEST_LEN], const uint8_t *refs,
                          uint32_t nrefs);
void zz_put_reply_ref(zz_buf *b, const zz_reply_ref *r);
void zz_put_row_entry(zz_buf *b, const zz_row_entry *e);
/* list<u32> from an array */
void zz_put_u32_list(zz_buf *b, const uint32_t *v, uint32_t n);
size_t zz_enc_reply_affirm(zz_buf *b, uint16_t svc, uint32_t sender, uint64_t ts, uint32_t client,
                           const uint8_t digest[ZZ_DIGEST_LEN]);
size_t zz_enc_control(zz_buf *b, uint8_t type, uint16_t svc, uint32_t sender, uint64_t request_id,
                      const void *json, uint32_t len);
/* FILE-FETCH (signed by the caller) and FILE-DATA (no authenticator): state fetching. */
size_t zz_enc_file_fetch(zz_buf *b, uint16_t svc, uint32_t sender, const zz_file_fetch *q);
size_t zz_enc_file_data(zz_buf *b, uint16_t svc, uint32_t sender, const zz_file_data *d);
/* SPARE-READY (signed by the caller, a controld): u32 replica, u64 seq, u32 epoch, 32-byte
 * sign_pub, 32-byte dh_pub. */
size_t zz_enc_spare_ready(zz_buf *b, uint16_t svc, uint32_t sender, const zz_spare_ready *q);
/* FAULT-STATEMENT, WAKEUP and SHUTDOWN have lists: zz_begin (auth ZZ_AUTH_SIG), the zz_put_*
 * helpers, zz_end_body. */
/* VIEW-CHANGE and NEW-VIEW have variable lists: build them with zz_begin, the zz_put_*
 * helpers, zz_put_entry/zz_put_choice, then zz_end_body. */
void zz_put_entry(zz_buf *b, const zz_entry *e);
void zz_put_choice(zz_buf *b, const zz_choice *c);

#endif
