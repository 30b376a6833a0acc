/* wire.h - the ZZ binary wire format (docs/wire.md), zero-copy decoder and encoder.
 * Decoded messages point into the caller's buffer; nothing here allocates. The messages are
 * declared in wire/messages.toml: wire_table.h holds their types and structs, and wire.c
 * decodes and encodes every type by walking its field table (zz_msgdefs). */
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

#define ZZ_FILE_MAX_CHUNK 4194304u /* FILE-FETCH length and FILE-DATA data, at most */
/* A server's challenge on one connection: FILE-DATA status 6 carries it, and every
 * FILE-FETCH on that connection after it (docs/wire.md "State fetching"). */
#define ZZ_FILE_CHALLENGE_LEN 16u
#define ZZ_FILE_STATUS_CHALLENGE 6u

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
/* The client of an EXEC-REPORT's checkpoint ref (docs/wire.md): no client has it. */
#define ZZ_CHECKPOINT_REF_CLIENT 0xFFFFFFFFu

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

/* A list of fixed-size records (list<entry>, list<u32>, ...): count items of the record's
 * wire size back to back from p. */
typedef struct {
    uint32_t count;
    const uint8_t *p; /* count * the item's wire size */
} zz_flist;

/* ---- the message table ----
 * wire_table.c, generated from wire/messages.toml, lists every record's, group's and message
 * body's fields in wire order in one array, zz_fields, and their domains in another,
 * zz_checks; a layout is a slice of each. zz_decode, zz_encode and the tests' dump walk a
 * type's layout instead of switching per type. A field lands at `off` in its struct
 * (zz_msg.u.<layout> for a message, zz_<record> for a list item). */
enum zz_kind {
    ZZ_K_U8,
    ZZ_K_U16,
    ZZ_K_U32,
    ZZ_K_U64,
    ZZ_K_FIXED, /* `size` raw bytes: a const uint8_t * into the message */
    ZZ_K_ARRAY, /* `size` raw bytes copied into an array (record fields) */
    ZZ_K_BYTES, /* u32 length + the bytes: zz_bytes */
    ZZ_K_BLIST, /* list<bytes>: zz_blist */
    ZZ_K_LIST,  /* u32 count + that many zz_records[rec] items: zz_flist */
    ZZ_K_REST   /* reads nothing: the body from here to its end as zz_bytes; the fields after it
                 * are its parts (PRE-PREPARE's batch) */
};
typedef struct {
    const char *name;
    uint8_t kind; /* enum zz_kind */
    uint8_t size; /* ZZ_K_FIXED, ZZ_K_ARRAY: the length */
    uint16_t off; /* offsetof the field in its struct */
    uint8_t rec;  /* ZZ_K_LIST: the item, an index of zz_records (enum zz_rec) */
} zz_field;

/* A field domain, checked once field `at` is read (a record's, once its whole list is): the
 * field's value (a bytes field's length) is in the set `arg` (ZZ_T_IN: bit v for value v, so
 * values below 32) or at most `arg` (ZZ_T_MAX), or a digest is all zero or not. `when` names
 * a field whose value must be in the set `when_in` for the check to apply, or is
 * ZZ_ALWAYS. Field numbers count from the layout's first field. A failed check is
 * ZZ_ERR_FIELD. */
enum zz_test { ZZ_T_IN, ZZ_T_MAX, ZZ_T_ZERO, ZZ_T_NONZERO };
#define ZZ_ALWAYS 0xFF
typedef struct {
    uint8_t at, field, test, when;
    uint32_t when_in;
    uint64_t arg;
} zz_check;

/* A record, group or message body: a slice of zz_fields and one of zz_checks (the checks in
 * the order of their `at`). */
typedef struct {
    uint16_t field; /* zz_fields[field, field + nfields) */
    uint8_t nfields;
    uint16_t check; /* zz_checks[check, check + nchecks) */
    uint8_t nchecks;
} zz_layout;

/* A list item: only integers and arrays, so every item has the same wire size. */
typedef struct {
    zz_layout layout;
    uint32_t wire;
} zz_record;

typedef struct {
    const char *name; /* "PRE-PREPARE"; NULL for an unassigned type */
    uint8_t auth;     /* the auth kind the encoders give it */
    uint8_t auths;    /* the kinds a decoder admits: bit k for kind k */
    zz_layout layout; /* its body, over zz_msg.u */
} zz_msgdef;

extern const zz_field zz_fields[];
extern const zz_check zz_checks[];

#include "wire_table.h"

/* Whether zz_msgdefs declares the type (12..15 and 28..31 are unassigned; a decoder rejects
 * them like any unknown type). */
int zz_type_known(uint8_t type);

/* Item i of a list of zz_records[rec], decoded into the record's struct (a zz_item has room
 * for any). */
void zz_item_at(uint8_t rec, const zz_flist *l, uint32_t i, void *out);
void zz_entry_at(const zz_flist *l, uint32_t i, zz_entry *out);
void zz_choice_at(const zz_flist *l, uint32_t i, zz_choice *out);
void zz_row_at(const zz_flist *l, uint32_t i, zz_row_entry *out);
void zz_reply_ref_at(const zz_flist *l, uint32_t i, zz_reply_ref *out);
uint32_t zz_u32_at(const zz_flist *l, uint32_t i);
/* An integer field of the struct at base (ZZ_K_U8 .. ZZ_K_U64). */
uint64_t zz_field_uint(const zz_field *f, const void *base);

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
    zz_body u; /* the fields, in the struct of the type's layout (wire_table.h) */
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

/* Encode m's header and body (from m->u by its type's field table; no authenticator yet),
 * body_len patched. A ZZ_K_REST field that is set is written as it is, instead of the fields
 * after it. Returns the offset of the message in b. */
size_t zz_encode(zz_buf *b, const zz_msg *m);
/* A zz_msg with the header of a new message of `type`: its default auth kind, body zeroed. */
zz_msg zz_msg_new(uint8_t type, uint16_t service, uint32_t sender);
/* Append one list item of zz_records[rec] from the record's struct. */
void zz_put_item(zz_buf *b, uint8_t rec, const void *item);

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
/* EXEC-CHECKPOINT (signed): seq, checkpoint digest */
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
/* SPARE-READY (signed by the caller, a controld). */
size_t zz_enc_spare_ready(zz_buf *b, uint16_t svc, uint32_t sender, const zz_spare_ready *q);
/* FAULT-STATEMENT, WAKEUP and SHUTDOWN have lists: zz_begin (auth ZZ_AUTH_SIG), the zz_put_*
 * helpers, zz_end_body. */
/* VIEW-CHANGE and NEW-VIEW have variable lists: build them with zz_begin, the zz_put_*
 * helpers, zz_put_entry/zz_put_choice, then zz_end_body. */
void zz_put_entry(zz_buf *b, const zz_entry *e);
void zz_put_choice(zz_buf *b, const zz_choice *c);

#endif
