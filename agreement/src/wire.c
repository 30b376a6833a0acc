/* wire.c - decoder and encoders of the ZZ wire format (docs/wire.md).
 * Every byte read from the network goes through the bounds-checked reader below. */
#include "wire.h"

#include <stdlib.h>
#include <string.h>

const char *zz_err_name(enum zz_err e)
{
    switch (e) {
    case ZZ_OK: return "ok";
    case ZZ_ERR_SHORT: return "short";
    case ZZ_ERR_MAGIC: return "magic";
    case ZZ_ERR_VERSION: return "version";
    case ZZ_ERR_TYPE: return "type";
    case ZZ_ERR_LENGTH: return "length";
    case ZZ_ERR_AUTH: return "auth";
    case ZZ_ERR_FIELD: return "field";
    }
    return "?";
}

/* ---- big-endian helpers ---- */

static uint16_t ld16(const uint8_t *p) { return (uint16_t)((p[0] << 8) | p[1]); }
static uint32_t ld32(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}
static uint64_t ld64(const uint8_t *p) { return ((uint64_t)ld32(p) << 32) | ld32(p + 4); }
static void st32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

/* ---- bounds-checked reader ---- */

typedef struct {
    const uint8_t *p;
    uint32_t left;
} rd;

static enum zz_err rd_take(rd *r, uint32_t n, const uint8_t **out)
{
    if (n > r->left)
        return ZZ_ERR_SHORT;
    *out = r->p;
    r->p += n;
    r->left -= n;
    return ZZ_OK;
}

static enum zz_err rd_u8(rd *r, uint8_t *v)
{
    const uint8_t *q;
    enum zz_err e = rd_take(r, 1, &q);
    if (e == ZZ_OK)
        *v = q[0];
    return e;
}

static enum zz_err rd_u32(rd *r, uint32_t *v)
{
    const uint8_t *q;
    enum zz_err e = rd_take(r, 4, &q);
    if (e == ZZ_OK)
        *v = ld32(q);
    return e;
}

static enum zz_err rd_u64(rd *r, uint64_t *v)
{
    const uint8_t *q;
    enum zz_err e = rd_take(r, 8, &q);
    if (e == ZZ_OK)
        *v = ld64(q);
    return e;
}

static enum zz_err rd_digest(rd *r, const uint8_t **d) { return rd_take(r, ZZ_DIGEST_LEN, d); }

static enum zz_err rd_bytes(rd *r, zz_bytes *b)
{
    uint32_t n;
    enum zz_err e = rd_u32(r, &n);
    if (e != ZZ_OK)
        return e;
    b->len = n;
    return rd_take(r, n, &b->p);
}

/* list<bytes>: validates every item length now so that iteration later cannot fail. */
static enum zz_err rd_blist(rd *r, zz_blist *l)
{
    uint32_t count;
    enum zz_err e = rd_u32(r, &count);
    if (e != ZZ_OK)
        return e;
    if (count > ZZ_MAX_LIST)
        return ZZ_ERR_LENGTH;
    const uint8_t *start = r->p;
    uint32_t before = r->left;
    for (uint32_t i = 0; i < count; i++) {
        zz_bytes item;
        if ((e = rd_bytes(r, &item)) != ZZ_OK)
            return e;
    }
    l->count = count;
    l->p = start;
    l->len = before - r->left;
    return ZZ_OK;
}

static enum zz_err rd_flist(rd *r, uint32_t item_len, zz_flist *l)
{
    uint32_t count;
    enum zz_err e = rd_u32(r, &count);
    if (e != ZZ_OK)
        return e;
    if (count > ZZ_MAX_LIST)
        return ZZ_ERR_LENGTH;
    /* count <= 2^16 and item_len <= 44, so the product fits in 32 bits. */
    l->count = count;
    return rd_take(r, count * item_len, &l->p);
}

/* ---- list accessors ---- */

void zz_blist_begin(const zz_blist *l, zz_blist_iter *it)
{
    it->p = l->p;
    it->left = l->len;
    it->items_left = l->count;
}

int zz_blist_next(zz_blist_iter *it, zz_bytes *out)
{
    /* Re-checked although the decoder validated the list: a hand-built zz_blist
     * must not turn into an out-of-bounds read either. */
    if (it->items_left == 0 || it->left < 4)
        return 0;
    uint32_t n = ld32(it->p);
    if (n > it->left - 4)
        return 0;
    out->p = it->p + 4;
    out->len = n;
    it->p += 4 + n;
    it->left -= 4 + n;
    it->items_left--;
    return 1;
}

void zz_entry_at(const zz_flist *l, uint32_t i, zz_entry *out)
{
    const uint8_t *p = l->p + (size_t)i * ZZ_ENTRY_WIRE;
    out->seq = ld64(p);
    out->view = ld32(p + 8);
    memcpy(out->digest, p + 12, ZZ_DIGEST_LEN);
}

void zz_choice_at(const zz_flist *l, uint32_t i, zz_choice *out)
{
    const uint8_t *p = l->p + (size_t)i * ZZ_CHOICE_WIRE;
    out->seq = ld64(p);
    memcpy(out->digest, p + 8, ZZ_DIGEST_LEN);
}

void zz_row_at(const zz_flist *l, uint32_t i, zz_row_entry *out)
{
    const uint8_t *p = l->p + (size_t)i * ZZ_ROW_WIRE;
    out->replica = ld32(p);
    out->state = p[4];
    memcpy(out->digest, p + 5, ZZ_DIGEST_LEN);
}

void zz_reply_ref_at(const zz_flist *l, uint32_t i, zz_reply_ref *out)
{
    const uint8_t *p = l->p + (size_t)i * ZZ_REPLY_REF_WIRE;
    out->client = ld32(p);
    out->timestamp = ld64(p + 4);
    memcpy(out->result_digest, p + 12, ZZ_DIGEST_LEN);
}

uint32_t zz_u32_at(const zz_flist *l, uint32_t i) { return ld32(l->p + (size_t)i * ZZ_U32_WIRE); }

/* ---- decoding ---- */

int zz_type_known(uint8_t type)
{
    return (type >= ZZ_REQUEST && type <= ZZ_STATUS) ||
           (type >= ZZ_EXEC_COMMIT && type <= ZZ_TYPE_MAX);
}

static uint8_t auth_kind_of(uint8_t type)
{
    switch (type) {
    case ZZ_EXEC_CHECKPOINT:
    case ZZ_CHECKPOINT:
    case ZZ_VIEW_CHANGE:
    case ZZ_NEW_VIEW:
    case ZZ_FAULT_STATEMENT:
    case ZZ_WAKEUP:
    case ZZ_SHUTDOWN:
    case ZZ_FILE_FETCH:
    case ZZ_SPARE_READY:
        return ZZ_AUTH_SIG;
    case ZZ_FILE_DATA: /* its content is checked against a certified manifest instead */
        return ZZ_AUTH_NONE;
    default:
        return ZZ_AUTH_MAC;
    }
}

static enum zz_err dec_batch(rd *r, uint64_t *nd_time, uint64_t *nd_seed, zz_blist *reqs)
{
    enum zz_err e;
    if ((e = rd_u64(r, nd_time)) != ZZ_OK || (e = rd_u64(r, nd_seed)) != ZZ_OK)
        return e;
    return rd_blist(r, reqs);
}

static int is_null_digest(const uint8_t *d)
{
    uint8_t acc = 0;
    for (int i = 0; i < ZZ_DIGEST_LEN; i++)
        acc |= d[i];
    return acc == 0;
}

/* Row entries: a state outside 0..2, or a digest that is null exactly when the state is not
 * "nothing", is no statement a correct replica makes. */
static enum zz_err check_row(const zz_flist *l)
{
    for (uint32_t i = 0; i < l->count; i++) {
        zz_row_entry e;
        zz_row_at(l, i, &e);
        if (e.state > ZZ_ROW_LATE || (e.state == ZZ_ROW_NONE) != is_null_digest(e.digest))
            return ZZ_ERR_FIELD;
    }
    return ZZ_OK;
}

static enum zz_err dec_body(rd *r, zz_msg *m)
{
    enum zz_err e = ZZ_OK;
#define TRY(x)                                                                                   \
    do {                                                                                         \
        if ((e = (x)) != ZZ_OK)                                                                  \
            return e;                                                                            \
    } while (0)
    switch (m->type) {
    case ZZ_REQUEST: {
        zz_request *q = &m->u.request;
        TRY(rd_u64(r, &q->timestamp));
        TRY(rd_u8(r, &q->flags));
        if (q->flags != 0 && q->flags != ZZ_REQ_READONLY && q->flags != ZZ_REQ_ORDERED_READ)
            return ZZ_ERR_FIELD;
        TRY(rd_bytes(r, &q->op));
        break;
    }
    case ZZ_REPLY: {
        zz_reply *q = &m->u.reply;
        TRY(rd_u32(r, &q->view));
        TRY(rd_u64(r, &q->timestamp));
        TRY(rd_u32(r, &q->client));
        TRY(rd_u8(r, &q->flags));
        if (q->flags != 0 && q->flags != ZZ_REPLY_READONLY && q->flags != ZZ_REPLY_REJECTED)
            return ZZ_ERR_FIELD;
        TRY(rd_bytes(r, &q->result));
        if (q->flags == ZZ_REPLY_REJECTED && q->result.len != ZZ_REJECT_LEN)
            return ZZ_ERR_FIELD;
        break;
    }
    case ZZ_PRE_PREPARE: {
        zz_pre_prepare *q = &m->u.pre_prepare;
        TRY(rd_u32(r, &q->view));
        TRY(rd_u64(r, &q->seq));
        q->batch.p = r->p;
        q->batch.len = r->left;
        TRY(dec_batch(r, &q->nd_time, &q->nd_seed, &q->requests));
        break;
    }
    case ZZ_PREPARE:
    case ZZ_COMMIT: {
        zz_phase *q = &m->u.phase;
        TRY(rd_u32(r, &q->view));
        TRY(rd_u64(r, &q->seq));
        TRY(rd_digest(r, &q->digest));
        break;
    }
    case ZZ_CHECKPOINT: {
        zz_checkpoint *q = &m->u.checkpoint;
        TRY(rd_u64(r, &q->seq));
        TRY(rd_digest(r, &q->state));
        break;
    }
    case ZZ_VIEW_CHANGE: {
        zz_view_change *q = &m->u.view_change;
        TRY(rd_u32(r, &q->new_view));
        TRY(rd_u64(r, &q->stable_seq));
        TRY(rd_blist(r, &q->proof));
        TRY(rd_flist(r, ZZ_ENTRY_WIRE, &q->prepared));
        TRY(rd_flist(r, ZZ_ENTRY_WIRE, &q->preprepared));
        break;
    }
    case ZZ_NEW_VIEW: {
        zz_new_view *q = &m->u.new_view;
        TRY(rd_u32(r, &q->view));
        TRY(rd_blist(r, &q->view_changes));
        TRY(rd_u64(r, &q->min_s));
        TRY(rd_flist(r, ZZ_CHOICE_WIRE, &q->chosen));
        break;
    }
    case ZZ_FETCH: {
        zz_fetch *q = &m->u.fetch;
        TRY(rd_u8(r, &q->kind));
        if (q->kind < ZZ_FETCH_BATCH || q->kind > ZZ_FETCH_LOG)
            return ZZ_ERR_FIELD;
        TRY(rd_u64(r, &q->seq));
        TRY(rd_digest(r, &q->digest));
        break;
    }
    case ZZ_FETCH_REPLY: {
        zz_fetch_reply *q = &m->u.fetch_reply;
        TRY(rd_u8(r, &q->kind));
        if (q->kind < ZZ_FETCH_BATCH || q->kind > ZZ_FETCH_LOG)
            return ZZ_ERR_FIELD;
        TRY(rd_u64(r, &q->seq));
        TRY(rd_digest(r, &q->digest));
        TRY(rd_bytes(r, &q->data));
        break;
    }
    case ZZ_STATUS: {
        zz_status *q = &m->u.status;
        TRY(rd_u32(r, &q->view));
        TRY(rd_u64(r, &q->last_exec));
        TRY(rd_u64(r, &q->stable_seq));
        break;
    }
    case ZZ_EXEC_COMMIT: {
        zz_exec_commit *q = &m->u.exec_commit;
        TRY(rd_u32(r, &q->view));
        TRY(rd_u64(r, &q->seq));
        TRY(rd_digest(r, &q->digest));
        TRY(rd_bytes(r, &q->batch));
        break;
    }
    case ZZ_EXEC_CHECKPOINT: {
        zz_exec_digest *q = &m->u.exec_digest;
        TRY(rd_u64(r, &q->seq));
        TRY(rd_digest(r, &q->digest));
        break;
    }
    case ZZ_EXEC_REPORT: {
        zz_exec_report *q = &m->u.exec_report;
        TRY(rd_u64(r, &q->seq));
        TRY(rd_digest(r, &q->digest));
        TRY(rd_flist(r, ZZ_REPLY_REF_WIRE, &q->replies));
        q->refs = q->replies.p;
        break;
    }
    case ZZ_FAULT_STATEMENT: {
        zz_fault_statement *q = &m->u.fault_statement;
        TRY(rd_u64(r, &q->seq));
        TRY(rd_flist(r, ZZ_ROW_WIRE, &q->row));
        TRY(check_row(&q->row));
        break;
    }
    case ZZ_WAKEUP: {
        zz_wakeup *q = &m->u.wakeup;
        TRY(rd_u64(r, &q->seq));
        TRY(rd_blist(r, &q->evidence));
        TRY(rd_flist(r, ZZ_U32_WIRE, &q->sleeping));
        TRY(rd_flist(r, ZZ_U32_WIRE, &q->wake));
        break;
    }
    case ZZ_SHUTDOWN: {
        zz_shutdown *q = &m->u.shutdown;
        TRY(rd_u64(r, &q->seq));
        TRY(rd_flist(r, ZZ_U32_WIRE, &q->awake));
        TRY(rd_flist(r, ZZ_U32_WIRE, &q->convict));
        TRY(rd_flist(r, ZZ_U32_WIRE, &q->sleep));
        TRY(rd_flist(r, ZZ_U32_WIRE, &q->active));
        break;
    }
    case ZZ_REPLY_AFFIRM: {
        zz_reply_affirm *q = &m->u.reply_affirm;
        TRY(rd_u64(r, &q->timestamp));
        TRY(rd_u32(r, &q->client));
        TRY(rd_digest(r, &q->result_digest));
        break;
    }
    case ZZ_CONTROL:
    case ZZ_CONTROL_REPLY: {
        zz_control *q = &m->u.control;
        TRY(rd_u64(r, &q->request_id));
        TRY(rd_bytes(r, &q->json));
        break;
    }
    case ZZ_FILE_FETCH: {
        zz_file_fetch *q = &m->u.file_fetch;
        TRY(rd_u64(r, &q->seq));
        TRY(rd_bytes(r, &q->path));
        TRY(rd_u64(r, &q->offset));
        TRY(rd_u32(r, &q->length));
        /* Same checks, same order as zz/wire.py FileFetch._parse. */
        if (q->length > ZZ_FILE_MAX_CHUNK)
            return ZZ_ERR_FIELD;
        TRY(rd_u32(r, &q->target));
        TRY(rd_bytes(r, &q->challenge));
        if (q->challenge.len != 0 && q->challenge.len != ZZ_FILE_CHALLENGE_LEN)
            return ZZ_ERR_FIELD;
        break;
    }
    case ZZ_FILE_DATA: {
        zz_file_data *q = &m->u.file_data;
        TRY(rd_u64(r, &q->seq));
        TRY(rd_bytes(r, &q->path));
        TRY(rd_u64(r, &q->offset));
        TRY(rd_u8(r, &q->status));
        TRY(rd_u64(r, &q->size));
        TRY(rd_bytes(r, &q->data));
        /* Same checks, same order as zz/wire.py FileData._parse. */
        if (q->status > ZZ_FILE_STATUS_CHALLENGE)
            return ZZ_ERR_FIELD;
        /* 0 ok and 5 later carry the file's bytes, 6 challenge the connection's challenge;
         * the others carry nothing. */
        if (q->status == ZZ_FILE_STATUS_CHALLENGE) {
            if (q->size != 0 || q->data.len != ZZ_FILE_CHALLENGE_LEN)
                return ZZ_ERR_FIELD;
        } else if (q->status != 0 && q->status != 5 && (q->size != 0 || q->data.len != 0)) {
            return ZZ_ERR_FIELD;
        }
        if (q->data.len > ZZ_FILE_MAX_CHUNK)
            return ZZ_ERR_FIELD;
        break;
    }
    case ZZ_SPARE_READY: {
        zz_spare_ready *q = &m->u.spare_ready;
        TRY(rd_u32(r, &q->replica));
        TRY(rd_u64(r, &q->seq));
        TRY(rd_u32(r, &q->epoch));
        TRY(rd_take(r, ZZ_KEY_LEN, &q->sign_pub));
        TRY(rd_take(r, ZZ_KEY_LEN, &q->dh_pub));
        break;
    }
    default:
        return ZZ_ERR_TYPE;
    }
#undef TRY
    /* Fields must fill the body exactly. */
    return r->left == 0 ? ZZ_OK : ZZ_ERR_LENGTH;
}

/* The authenticator must have exactly the size its kind implies. */
static enum zz_err check_auth_shape(const zz_msg *m)
{
    switch (m->auth_kind) {
    case ZZ_AUTH_NONE:
        return m->auth_len == 0 ? ZZ_OK : ZZ_ERR_AUTH;
    case ZZ_AUTH_MAC: {
        if (m->auth_len < 2)
            return ZZ_ERR_AUTH;
        uint16_t count = ld16(m->auth);
        if (count > ZZ_MAX_MACS)
            return ZZ_ERR_LENGTH;
        return m->auth_len == 2u + 36u * count ? ZZ_OK : ZZ_ERR_AUTH;
    }
    case ZZ_AUTH_SIG:
        return m->auth_len == ZZ_SIG_LEN ? ZZ_OK : ZZ_ERR_AUTH;
    case ZZ_AUTH_MAC_SIG: {
        if (m->auth_len < 2)
            return ZZ_ERR_AUTH;
        uint16_t count = ld16(m->auth);
        if (count > ZZ_MAX_MACS)
            return ZZ_ERR_LENGTH;
        return m->auth_len == 2u + 36u * count + ZZ_SIG_LEN ? ZZ_OK : ZZ_ERR_AUTH;
    }
    }
    return ZZ_ERR_AUTH;
}

enum zz_err zz_decode(const uint8_t *buf, size_t len, zz_msg *out)
{
    memset(out, 0, sizeof(*out));
    if (len < ZZ_HDR_LEN)
        return ZZ_ERR_SHORT;
    if (len > ZZ_MAX_MSG)
        return ZZ_ERR_LENGTH;
    if (buf[0] != ZZ_MAGIC0 || buf[1] != ZZ_MAGIC1)
        return ZZ_ERR_MAGIC;
    if (buf[2] != ZZ_VERSION)
        return ZZ_ERR_VERSION;
    uint8_t type = buf[3];
    if (!zz_type_known(type))
        return ZZ_ERR_TYPE;
    /* wire.h and the shared vectors call a wrong auth kind a `type` error (docs/wire.md
     * words it as "counted as auth"; the vectors are what both codecs are held to). */
    if (buf[4] != auth_kind_of(type) && !(type == ZZ_REQUEST && buf[4] == ZZ_AUTH_MAC_SIG))
        return ZZ_ERR_TYPE;
    if (buf[5] != 0)
        return ZZ_ERR_FIELD;
    uint32_t body_len = ld32(buf + 12);
    if (body_len > len - ZZ_HDR_LEN)
        return ZZ_ERR_SHORT;

    out->type = type;
    out->auth_kind = buf[4];
    out->service = ld16(buf + 6);
    out->sender = ld32(buf + 8);
    out->raw = buf;
    out->raw_len = (uint32_t)len;
    out->authed_len = ZZ_HDR_LEN + body_len;
    out->body = buf + ZZ_HDR_LEN;
    out->body_len = body_len;
    out->auth = buf + out->authed_len;
    out->auth_len = (uint32_t)len - out->authed_len;

    rd r = {out->body, body_len};
    enum zz_err e = dec_body(&r, out);
    if (e == ZZ_OK)
        e = check_auth_shape(out);
    return e;
}

enum zz_err zz_decode_batch(const uint8_t *buf, size_t len, uint64_t *nd_time, uint64_t *nd_seed,
                            zz_blist *requests)
{
    if (len > ZZ_MAX_MSG)
        return ZZ_ERR_LENGTH;
    rd r = {buf, (uint32_t)len};
    enum zz_err e = dec_batch(&r, nd_time, nd_seed, requests);
    if (e != ZZ_OK)
        return e;
    return r.left == 0 ? ZZ_OK : ZZ_ERR_LENGTH;
}

const uint8_t *zz_find_mac(const zz_msg *m, uint32_t receiver)
{
    if ((m->auth_kind != ZZ_AUTH_MAC && m->auth_kind != ZZ_AUTH_MAC_SIG) || m->auth_len < 2)
        return NULL;
    uint32_t count = ld16(m->auth);
    if (m->auth_len < 2u + 36u * count)
        return NULL;
    for (uint32_t i = 0; i < count; i++) {
        const uint8_t *e = m->auth + 2 + 36u * i;
        if (ld32(e) == receiver)
            return e + 4;
    }
    return NULL;
}

/* ---- growable buffer ---- */

void zz_buf_init(zz_buf *b)
{
    b->p = NULL;
    b->len = 0;
    b->cap = 0;
    b->oom = 0;
}

void zz_buf_free(zz_buf *b)
{
    free(b->p);
    zz_buf_init(b);
}

void zz_buf_reset(zz_buf *b)
{
    b->len = 0;
    b->oom = 0;
}

/* Make room for n more bytes; on failure mark the buffer oom for good so that a
 * half-written message is never mistaken for a complete one. */
static int reserve(zz_buf *b, size_t n)
{
    if (b->oom)
        return 0;
    if (n <= b->cap - b->len)
        return 1;
    if (n > SIZE_MAX / 2 - b->len) {
        b->oom = 1;
        return 0;
    }
    size_t need = b->len + n;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < need)
        cap *= 2;
    uint8_t *p = realloc(b->p, cap);
    if (!p) {
        b->oom = 1;
        return 0;
    }
    b->p = p;
    b->cap = cap;
    return 1;
}

void zz_put_raw(zz_buf *b, const void *p, size_t n)
{
    if (n == 0 || !reserve(b, n))
        return;
    memcpy(b->p + b->len, p, n);
    b->len += n;
}

void zz_put_u8(zz_buf *b, uint8_t v) { zz_put_raw(b, &v, 1); }

void zz_put_u16(zz_buf *b, uint16_t v)
{
    uint8_t t[2] = {(uint8_t)(v >> 8), (uint8_t)v};
    zz_put_raw(b, t, 2);
}

void zz_put_u32(zz_buf *b, uint32_t v)
{
    uint8_t t[4];
    st32(t, v);
    zz_put_raw(b, t, 4);
}

void zz_put_u64(zz_buf *b, uint64_t v)
{
    uint8_t t[8];
    st32(t, (uint32_t)(v >> 32));
    st32(t + 4, (uint32_t)v);
    zz_put_raw(b, t, 8);
}

void zz_put_bytes(zz_buf *b, const void *p, uint32_t n)
{
    zz_put_u32(b, n);
    zz_put_raw(b, p, n);
}

size_t zz_begin(zz_buf *b, uint8_t type, uint8_t auth_kind, uint16_t service, uint32_t sender)
{
    size_t start = b->len;
    uint8_t h[ZZ_HDR_LEN] = {ZZ_MAGIC0, ZZ_MAGIC1, ZZ_VERSION, type, auth_kind, 0};
    h[6] = (uint8_t)(service >> 8);
    h[7] = (uint8_t)service;
    st32(h + 8, sender);
    zz_put_raw(b, h, sizeof h);
    return start;
}

void zz_end_body(zz_buf *b, size_t start)
{
    if (b->oom || b->len < start + ZZ_HDR_LEN)
        return;
    size_t body = b->len - start - ZZ_HDR_LEN;
    if (body > ZZ_MAX_MSG) {
        /* Unsendable anyway; poisoning the buffer beats a silently truncated length. */
        b->oom = 1;
        return;
    }
    st32(b->p + start + 12, (uint32_t)body);
}

void zz_put_entry(zz_buf *b, const zz_entry *e)
{
    zz_put_u64(b, e->seq);
    zz_put_u32(b, e->view);
    zz_put_raw(b, e->digest, ZZ_DIGEST_LEN);
}

void zz_put_choice(zz_buf *b, const zz_choice *c)
{
    zz_put_u64(b, c->seq);
    zz_put_raw(b, c->digest, ZZ_DIGEST_LEN);
}

size_t zz_enc_request(zz_buf *b, uint16_t svc, uint32_t sender, uint64_t ts, uint8_t flags,
                      const void *op, uint32_t op_len)
{
    return zz_enc_request_kind(b, ZZ_AUTH_MAC, svc, sender, ts, flags, op, op_len);
}

size_t zz_enc_request_kind(zz_buf *b, uint8_t auth_kind, uint16_t svc, uint32_t sender,
                           uint64_t ts, uint8_t flags, const void *op, uint32_t op_len)
{
    size_t s = zz_begin(b, ZZ_REQUEST, auth_kind, svc, sender);
    zz_put_u64(b, ts);
    zz_put_u8(b, flags);
    zz_put_bytes(b, op, op_len);
    zz_end_body(b, s);
    return s;
}

size_t zz_enc_reply(zz_buf *b, uint16_t svc, uint32_t sender, uint32_t view, uint64_t ts,
                    uint32_t client, uint8_t flags, const void *res, uint32_t res_len)
{
    size_t s = zz_begin(b, ZZ_REPLY, ZZ_AUTH_MAC, svc, sender);
    zz_put_u32(b, view);
    zz_put_u64(b, ts);
    zz_put_u32(b, client);
    zz_put_u8(b, flags);
    zz_put_bytes(b, res, res_len);
    zz_end_body(b, s);
    return s;
}

size_t zz_enc_pre_prepare(zz_buf *b, uint16_t svc, uint32_t sender, uint32_t view, uint64_t seq,
                          const void *batch, uint32_t batch_len)
{
    size_t s = zz_begin(b, ZZ_PRE_PREPARE, ZZ_AUTH_MAC, svc, sender);
    zz_put_u32(b, view);
    zz_put_u64(b, seq);
    zz_put_raw(b, batch, batch_len);
    zz_end_body(b, s);
    return s;
}

size_t zz_enc_phase(zz_buf *b, uint8_t type, uint16_t svc, uint32_t sender, uint32_t view,
                    uint64_t seq, const uint8_t digest[ZZ_DIGEST_LEN])
{
    size_t s = zz_begin(b, type, ZZ_AUTH_MAC, svc, sender);
    zz_put_u32(b, view);
    zz_put_u64(b, seq);
    zz_put_raw(b, digest, ZZ_DIGEST_LEN);
    zz_end_body(b, s);
    return s;
}

size_t zz_enc_checkpoint(zz_buf *b, uint16_t svc, uint32_t sender, uint64_t seq,
                         const uint8_t state[ZZ_DIGEST_LEN])
{
    size_t s = zz_begin(b, ZZ_CHECKPOINT, ZZ_AUTH_SIG, svc, sender);
    zz_put_u64(b, seq);
    zz_put_raw(b, state, ZZ_DIGEST_LEN);
    zz_end_body(b, s);
    return s;
}

size_t zz_enc_fetch(zz_buf *b, uint16_t svc, uint32_t sender, uint8_t kind, uint64_t seq,
                    const uint8_t digest[ZZ_DIGEST_LEN])
{
    size_t s = zz_begin(b, ZZ_FETCH, ZZ_AUTH_MAC, svc, sender);
    zz_put_u8(b, kind);
    zz_put_u64(b, seq);
    zz_put_raw(b, digest, ZZ_DIGEST_LEN);
    zz_end_body(b, s);
    return s;
}

size_t zz_enc_fetch_reply(zz_buf *b, uint16_t svc, uint32_t sender, uint8_t kind, uint64_t seq,
                          const uint8_t digest[ZZ_DIGEST_LEN], const void *data, uint32_t len)
{
    size_t s = zz_begin(b, ZZ_FETCH_REPLY, ZZ_AUTH_MAC, svc, sender);
    zz_put_u8(b, kind);
    zz_put_u64(b, seq);
    zz_put_raw(b, digest, ZZ_DIGEST_LEN);
    zz_put_bytes(b, data, len);
    zz_end_body(b, s);
    return s;
}

size_t zz_enc_status(zz_buf *b, uint16_t svc, uint32_t sender, uint32_t view, uint64_t last_exec,
                     uint64_t stable_seq)
{
    size_t s = zz_begin(b, ZZ_STATUS, ZZ_AUTH_MAC, svc, sender);
    zz_put_u32(b, view);
    zz_put_u64(b, last_exec);
    zz_put_u64(b, stable_seq);
    zz_end_body(b, s);
    return s;
}

size_t zz_enc_exec_commit(zz_buf *b, uint16_t svc, uint32_t sender, uint32_t view, uint64_t seq,
                          const uint8_t digest[ZZ_DIGEST_LEN], const void *batch, uint32_t len)
{
    size_t s = zz_begin(b, ZZ_EXEC_COMMIT, ZZ_AUTH_MAC, svc, sender);
    zz_put_u32(b, view);
    zz_put_u64(b, seq);
    zz_put_raw(b, digest, ZZ_DIGEST_LEN);
    zz_put_bytes(b, batch, len);
    zz_end_body(b, s);
    return s;
}

size_t zz_enc_exec_digest(zz_buf *b, uint8_t type, uint16_t svc, uint32_t sender, uint64_t seq,
                          const uint8_t digest[ZZ_DIGEST_LEN])
{
    size_t s = zz_begin(b, type, auth_kind_of(type), svc, sender);
    zz_put_u64(b, seq);
    zz_put_raw(b, digest, ZZ_DIGEST_LEN);
    zz_end_body(b, s);
    return s;
}

void zz_put_reply_ref(zz_buf *b, const zz_reply_ref *r)
{
    zz_put_u32(b, r->client);
    zz_put_u64(b, r->timestamp);
    zz_put_raw(b, r->result_digest, ZZ_DIGEST_LEN);
}

void zz_put_row_entry(zz_buf *b, const zz_row_entry *e)
{
    zz_put_u32(b, e->replica);
    zz_put_u8(b, e->state);
    zz_put_raw(b, e->digest, ZZ_DIGEST_LEN);
}

void zz_put_u32_list(zz_buf *b, const uint32_t *v, uint32_t n)
{
    zz_put_u32(b, n);
    for (uint32_t i = 0; i < n; i++)
        zz_put_u32(b, v[i]);
}

size_t zz_enc_exec_report(zz_buf *b, uint16_t svc, uint32_t sender, uint64_t seq,
                          const uint8_t digest[ZZ_DIGEST_LEN], const uint8_t *refs,
                          uint32_t nrefs)
{
    size_t s = zz_begin(b, ZZ_EXEC_REPORT, ZZ_AUTH_MAC, svc, sender);
    zz_put_u64(b, seq);
    zz_put_raw(b, digest, ZZ_DIGEST_LEN);
    zz_put_u32(b, nrefs);
    zz_put_raw(b, refs, (size_t)nrefs * ZZ_REPLY_REF_WIRE);
    zz_end_body(b, s);
    return s;
}

size_t zz_enc_reply_affirm(zz_buf *b, uint16_t svc, uint32_t sender, uint64_t ts, uint32_t client,
                           const uint8_t digest[ZZ_DIGEST_LEN])
{
    size_t s = zz_begin(b, ZZ_REPLY_AFFIRM, ZZ_AUTH_MAC, svc, sender);
    zz_put_u64(b, ts);
    zz_put_u32(b, client);
    zz_put_raw(b, digest, ZZ_DIGEST_LEN);
    zz_end_body(b, s);
    return s;
}

size_t zz_enc_control(zz_buf *b, uint8_t type, uint16_t svc, uint32_t sender, uint64_t request_id,
                      const void *json, uint32_t len)
{
    size_t s = zz_begin(b, type, ZZ_AUTH_MAC, svc, sender);
    zz_put_u64(b, request_id);
    zz_put_bytes(b, json, len);
    zz_end_body(b, s);
    return s;
}

size_t zz_enc_file_fetch(zz_buf *b, uint16_t svc, uint32_t sender, const zz_file_fetch *q)
{
    size_t s = zz_begin(b, ZZ_FILE_FETCH, ZZ_AUTH_SIG, svc, sender);
    zz_put_u64(b, q->seq);
    zz_put_bytes(b, q->path.p, q->path.len);
    zz_put_u64(b, q->offset);
    zz_put_u32(b, q->length);
    zz_put_u32(b, q->target);
    zz_put_bytes(b, q->challenge.p, q->challenge.len);
    zz_end_body(b, s);
    return s;
}

size_t zz_enc_file_data(zz_buf *b, uint16_t svc, uint32_t sender, const zz_file_data *d)
{
    size_t s = zz_begin(b, ZZ_FILE_DATA, ZZ_AUTH_NONE, svc, sender);
    zz_put_u64(b, d->seq);
    zz_put_bytes(b, d->path.p, d->path.len);
    zz_put_u64(b, d->offset);
    zz_put_u8(b, d->status);
    zz_put_u64(b, d->size);
    zz_put_bytes(b, d->data.p, d->data.len);
    zz_end_body(b, s);
    return s;
}

size_t zz_enc_spare_ready(zz_buf *b, uint16_t svc, uint32_t sender, const zz_spare_ready *q)
{
    size_t s = zz_begin(b, ZZ_SPARE_READY, ZZ_AUTH_SIG, svc, sender);
    zz_put_u32(b, q->replica);
    zz_put_u64(b, q->seq);
    zz_put_u32(b, q->epoch);
    zz_put_raw(b, q->sign_pub, ZZ_KEY_LEN);
    zz_put_raw(b, q->dh_pub, ZZ_KEY_LEN);
    zz_end_body(b, s);
    return s;
}
