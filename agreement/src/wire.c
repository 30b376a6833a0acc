/* wire.c - decoder and encoder of the ZZ wire format (docs/wire.md). Every type is decoded
 * and encoded by walking its field table (wire_table.c, generated from wire/messages.toml);
 * every byte read from the network goes through the bounds-checked reader below. */
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

static enum zz_err rd_u32(rd *r, uint32_t *v)
{
    const uint8_t *q;
    enum zz_err e = rd_take(r, 4, &q);
    if (e == ZZ_OK)
        *v = ld32(q);
    return e;
}

static enum zz_err rd_bytes(rd *r, zz_bytes *b)
{
    enum zz_err e = rd_u32(r, &b->len);
    return e != ZZ_OK ? e : rd_take(r, b->len, &b->p);
}

/* A list's count. The limit is checked before any item is read, so an absurd count is a
 * `length` error even when the bytes for it are missing too. */
static enum zz_err rd_count(rd *r, uint32_t *count)
{
    enum zz_err e = rd_u32(r, count);
    if (e == ZZ_OK && *count > ZZ_MAX_LIST)
        return ZZ_ERR_LENGTH;
    return e;
}

/* list<bytes>: validates every item length now so that iteration later cannot fail. */
static enum zz_err rd_blist(rd *r, zz_blist *l)
{
    uint32_t count;
    enum zz_err e = rd_count(r, &count);
    if (e != ZZ_OK)
        return e;
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
    enum zz_err e = rd_count(r, &count);
    if (e != ZZ_OK)
        return e;
    if ((uint64_t)count * item_len > r->left)
        return ZZ_ERR_SHORT;
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

/* ---- fields ----
 * A field lands at f->off in its struct: integers as themselves, ZZ_K_FIXED as a pointer into
 * the message, ZZ_K_ARRAY copied, the rest as zz_bytes / zz_blist / zz_flist. */

static const uint8_t int_len[] = {[ZZ_K_U8] = 1, [ZZ_K_U16] = 2, [ZZ_K_U32] = 4, [ZZ_K_U64] = 8};

static uint64_t ld_int(const uint8_t *p, uint8_t kind)
{
    switch (kind) {
    case ZZ_K_U8: return p[0];
    case ZZ_K_U16: return ld16(p);
    case ZZ_K_U32: return ld32(p);
    default: return ld64(p);
    }
}

uint64_t zz_field_uint(const zz_field *f, const void *base)
{
    const uint8_t *p = (const uint8_t *)base + f->off;
    switch (f->kind) {
    case ZZ_K_U8: return *p;
    case ZZ_K_U16: return *(const uint16_t *)p;
    case ZZ_K_U32: return *(const uint32_t *)p;
    default: return *(const uint64_t *)p;
    }
}

static void store_uint(const zz_field *f, void *base, uint64_t v)
{
    uint8_t *p = (uint8_t *)base + f->off;
    switch (f->kind) {
    case ZZ_K_U8: *p = (uint8_t)v; break;
    case ZZ_K_U16: *(uint16_t *)p = (uint16_t)v; break;
    case ZZ_K_U32: *(uint32_t *)p = (uint32_t)v; break;
    default: *(uint64_t *)p = v; break;
    }
}

void zz_item_at(uint8_t rec, const zz_flist *l, uint32_t i, void *out)
{
    const zz_layout *lay = &zz_records[rec].layout;
    const uint8_t *p = l->p + (size_t)i * zz_records[rec].wire;
    for (uint8_t k = 0; k < lay->nfields; k++) {
        const zz_field *f = &zz_fields[lay->field + k];
        if (f->kind == ZZ_K_ARRAY) {
            memcpy((uint8_t *)out + f->off, p, f->size);
            p += f->size;
        } else {
            store_uint(f, out, ld_int(p, f->kind));
            p += int_len[f->kind];
        }
    }
}

void zz_entry_at(const zz_flist *l, uint32_t i, zz_entry *out)
{
    zz_item_at(ZZ_REC_ENTRY, l, i, out);
}
void zz_choice_at(const zz_flist *l, uint32_t i, zz_choice *out)
{
    zz_item_at(ZZ_REC_CHOICE, l, i, out);
}
void zz_row_at(const zz_flist *l, uint32_t i, zz_row_entry *out)
{
    zz_item_at(ZZ_REC_ROW_ENTRY, l, i, out);
}
void zz_reply_ref_at(const zz_flist *l, uint32_t i, zz_reply_ref *out)
{
    zz_item_at(ZZ_REC_REPLY_REF, l, i, out);
}
uint32_t zz_u32_at(const zz_flist *l, uint32_t i) { return ld32(l->p + (size_t)i * ZZ_U32_WIRE); }

/* ---- field domains ---- */

static int is_zero(const uint8_t *d, size_t n)
{
    uint8_t acc = 0;
    for (size_t i = 0; i < n; i++)
        acc |= d[i];
    return acc == 0;
}

/* What a check tests of a field: an integer's value, a bytes field's length. */
static uint64_t value_of(const zz_field *f, const void *base)
{
    if (f->kind == ZZ_K_BYTES)
        return ((const zz_bytes *)((const uint8_t *)base + f->off))->len;
    return zz_field_uint(f, base);
}

static const uint8_t *digest_of(const zz_field *f, const void *base)
{
    const uint8_t *p = (const uint8_t *)base + f->off;
    return f->kind == ZZ_K_ARRAY ? p : *(const uint8_t *const *)p;
}

static int in_set(uint64_t v, uint64_t set) { return v < 32 && (set >> v & 1u); }

static int holds(const zz_layout *l, const zz_check *c, const void *base)
{
    if (c->when != ZZ_ALWAYS && !in_set(value_of(&zz_fields[l->field + c->when], base),
                                        c->when_in))
        return 1; /* the check does not apply */
    const zz_field *f = &zz_fields[l->field + c->field];
    switch (c->test) {
    case ZZ_T_IN: return in_set(value_of(f, base), c->arg);
    case ZZ_T_MAX: return value_of(f, base) <= c->arg;
    case ZZ_T_ZERO: return is_zero(digest_of(f, base), f->size);
    default: return !is_zero(digest_of(f, base), f->size);
    }
}

/* A record's domains, item by item, once the whole list is read. */
static enum zz_err check_items(uint8_t rec, const zz_flist *l)
{
    const zz_layout *lay = &zz_records[rec].layout;
    for (uint32_t i = 0; lay->nchecks && i < l->count; i++) {
        zz_item item;
        zz_item_at(rec, l, i, &item);
        for (uint8_t c = 0; c < lay->nchecks; c++)
            if (!holds(lay, &zz_checks[lay->check + c], &item))
                return ZZ_ERR_FIELD;
    }
    return ZZ_OK;
}

/* ---- decoding ---- */

int zz_type_known(uint8_t type) { return type <= ZZ_TYPE_MAX && zz_msgdefs[type].name; }

static enum zz_err read_field(rd *r, const zz_field *f, void *base)
{
    void *at = (uint8_t *)base + f->off;
    const uint8_t *q;
    enum zz_err e;
    switch (f->kind) {
    case ZZ_K_FIXED:
        return rd_take(r, f->size, (const uint8_t **)at);
    case ZZ_K_ARRAY:
        if ((e = rd_take(r, f->size, &q)) == ZZ_OK)
            memcpy(at, q, f->size);
        return e;
    case ZZ_K_BYTES:
        return rd_bytes(r, at);
    case ZZ_K_BLIST:
        return rd_blist(r, at);
    case ZZ_K_LIST:
        if ((e = rd_flist(r, zz_records[f->rec].wire, at)) != ZZ_OK)
            return e;
        return check_items(f->rec, at);
    case ZZ_K_REST:
        ((zz_bytes *)at)->p = r->p;
        ((zz_bytes *)at)->len = r->left;
        return ZZ_OK;
    default:
        if ((e = rd_take(r, int_len[f->kind], &q)) == ZZ_OK)
            store_uint(f, base, ld_int(q, f->kind));
        return e;
    }
}

/* The fields in order, each one's checks as soon as it is read (the order of `short` and
 * `field` errors is part of the format: zz/wire.py keeps the same). */
static enum zz_err read_layout(rd *r, const zz_layout *l, void *base)
{
    const zz_check *c = &zz_checks[l->check], *end = c + l->nchecks;
    for (uint8_t k = 0; k < l->nfields; k++) {
        enum zz_err e = read_field(r, &zz_fields[l->field + k], base);
        if (e != ZZ_OK)
            return e;
        for (; c < end && c->at == k; c++)
            if (!holds(l, c, base))
                return ZZ_ERR_FIELD;
    }
    return ZZ_OK;
}

/* The authenticator must have exactly the size its kind implies (ZZ_AUTH_MAC_SIG: a MAC
 * vector, then a signature). */
static enum zz_err check_auth_shape(const zz_msg *m)
{
    switch (m->auth_kind) {
    case ZZ_AUTH_NONE:
        return m->auth_len == 0 ? ZZ_OK : ZZ_ERR_AUTH;
    case ZZ_AUTH_MAC:
    case ZZ_AUTH_MAC_SIG: {
        if (m->auth_len < 2)
            return ZZ_ERR_AUTH;
        uint16_t count = ld16(m->auth);
        if (count > ZZ_MAX_MACS)
            return ZZ_ERR_LENGTH;
        uint32_t sig = m->auth_kind == ZZ_AUTH_MAC_SIG ? ZZ_SIG_LEN : 0;
        return m->auth_len == 2u + 36u * count + sig ? ZZ_OK : ZZ_ERR_AUTH;
    }
    case ZZ_AUTH_SIG:
        return m->auth_len == ZZ_SIG_LEN ? ZZ_OK : ZZ_ERR_AUTH;
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
    /* a wrong auth kind for the type is a `type` error (docs/wire.md, the shared vectors) */
    const zz_msgdef *d = &zz_msgdefs[type];
    if (buf[4] >= 8 || !(d->auths >> buf[4] & 1u))
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
    enum zz_err e = read_layout(&r, &d->layout, &out->u);
    if (e == ZZ_OK && r.left != 0)
        e = ZZ_ERR_LENGTH; /* fields must fill the body exactly */
    if (e == ZZ_OK)
        e = check_auth_shape(out);
    return e;
}

enum zz_err zz_decode_batch(const uint8_t *buf, size_t len, uint64_t *nd_time, uint64_t *nd_seed,
                            zz_blist *requests)
{
    if (len > ZZ_MAX_MSG)
        return ZZ_ERR_LENGTH;
    zz_batch batch;
    rd r = {buf, (uint32_t)len};
    enum zz_err e = read_layout(&r, &zz_layout_batch, &batch);
    if (e != ZZ_OK)
        return e;
    *nd_time = batch.nd_time;
    *nd_seed = batch.nd_seed;
    *requests = batch.requests;
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

/* ---- encoding by the table ---- */

/* Lists are rebuilt item by item from their decoded view (not copied as one blob), so that
 * re-encoding a decoded message exercises the encoders. */
static void put_layout(zz_buf *b, const zz_layout *l, const void *base);

static void put_blist(zz_buf *b, const zz_blist *l)
{
    zz_blist_iter it;
    zz_bytes item;
    zz_put_u32(b, l->count);
    zz_blist_begin(l, &it);
    while (zz_blist_next(&it, &item))
        zz_put_bytes(b, item.p, item.len);
}

static void put_items(zz_buf *b, uint8_t rec, const zz_flist *l)
{
    zz_put_u32(b, l->count);
    for (uint32_t i = 0; i < l->count; i++) {
        zz_item item;
        zz_item_at(rec, l, i, &item);
        put_layout(b, &zz_records[rec].layout, &item);
    }
}

static void put_layout(zz_buf *b, const zz_layout *l, const void *base)
{
    for (uint8_t k = 0; k < l->nfields; k++) {
        const zz_field *f = &zz_fields[l->field + k];
        const void *at = (const uint8_t *)base + f->off;
        const zz_bytes *x = at;
        switch (f->kind) {
        case ZZ_K_U8: zz_put_u8(b, (uint8_t)zz_field_uint(f, base)); break;
        case ZZ_K_U16: zz_put_u16(b, (uint16_t)zz_field_uint(f, base)); break;
        case ZZ_K_U32: zz_put_u32(b, (uint32_t)zz_field_uint(f, base)); break;
        case ZZ_K_U64: zz_put_u64(b, zz_field_uint(f, base)); break;
        case ZZ_K_FIXED: zz_put_raw(b, *(const uint8_t *const *)at, f->size); break;
        case ZZ_K_ARRAY: zz_put_raw(b, at, f->size); break;
        case ZZ_K_BYTES: zz_put_bytes(b, x->p, x->len); break;
        case ZZ_K_BLIST: put_blist(b, at); break;
        case ZZ_K_LIST: put_items(b, f->rec, at); break;
        case ZZ_K_REST:
            if (x->p) {
                zz_put_raw(b, x->p, x->len); /* the encoding of the fields after it */
                return;
            }
            break;
        }
    }
}

void zz_put_item(zz_buf *b, uint8_t rec, const void *item)
{
    put_layout(b, &zz_records[rec].layout, item);
}

size_t zz_encode(zz_buf *b, const zz_msg *m)
{
    size_t s = zz_begin(b, m->type, m->auth_kind, m->service, m->sender);
    if (zz_type_known(m->type))
        put_layout(b, &zz_msgdefs[m->type].layout, &m->u);
    zz_end_body(b, s);
    return s;
}

zz_msg zz_msg_new(uint8_t type, uint16_t service, uint32_t sender)
{
    zz_msg m;
    memset(&m, 0, sizeof m);
    m.type = type;
    m.auth_kind = zz_type_known(type) ? zz_msgdefs[type].auth : ZZ_AUTH_NONE;
    m.service = service;
    m.sender = sender;
    return m;
}

void zz_put_entry(zz_buf *b, const zz_entry *e) { zz_put_item(b, ZZ_REC_ENTRY, e); }
void zz_put_choice(zz_buf *b, const zz_choice *c) { zz_put_item(b, ZZ_REC_CHOICE, c); }
void zz_put_reply_ref(zz_buf *b, const zz_reply_ref *r) { zz_put_item(b, ZZ_REC_REPLY_REF, r); }
void zz_put_row_entry(zz_buf *b, const zz_row_entry *e) { zz_put_item(b, ZZ_REC_ROW_ENTRY, e); }

void zz_put_u32_list(zz_buf *b, const uint32_t *v, uint32_t n)
{
    zz_put_u32(b, n);
    for (uint32_t i = 0; i < n; i++)
        zz_put_u32(b, v[i]);
}

/* ---- convenience encoders: a message's fields as arguments, in wire order like its struct ---- */

static size_t enc(zz_buf *b, uint8_t type, uint16_t svc, uint32_t sender, const zz_body *u)
{
    zz_msg m = zz_msg_new(type, svc, sender);
    m.u = *u;
    return zz_encode(b, &m);
}
/* The body `member` of zz_msg.u with the given fields. */
#define BODY(member, ...) (&(zz_body){.member = {__VA_ARGS__}})

size_t zz_enc_request(zz_buf *b, uint16_t svc, uint32_t sender, uint64_t ts, uint8_t flags,
                      const void *op, uint32_t op_len)
{
    return zz_enc_request_kind(b, ZZ_AUTH_MAC, svc, sender, ts, flags, op, op_len);
}

size_t zz_enc_request_kind(zz_buf *b, uint8_t auth_kind, uint16_t svc, uint32_t sender,
                           uint64_t ts, uint8_t flags, const void *op, uint32_t op_len)
{
    zz_msg m = zz_msg_new(ZZ_REQUEST, svc, sender);
    m.auth_kind = auth_kind;
    m.u.request = (zz_request){ts, flags, {op, op_len}};
    return zz_encode(b, &m);
}

size_t zz_enc_reply(zz_buf *b, uint16_t svc, uint32_t sender, uint32_t view, uint64_t ts,
                    uint32_t client, uint8_t flags, const void *res, uint32_t res_len)
{
    return enc(b, ZZ_REPLY, svc, sender, BODY(reply, view, ts, client, flags, {res, res_len}));
}

/* batch: the batch encoding, written as it is (ZZ_K_REST) */
size_t zz_enc_pre_prepare(zz_buf *b, uint16_t svc, uint32_t sender, uint32_t view, uint64_t seq,
                          const void *batch, uint32_t batch_len)
{
    zz_body u = {.pre_prepare = {.view = view, .seq = seq, .batch = {batch, batch_len}}};
    return enc(b, ZZ_PRE_PREPARE, svc, sender, &u);
}

size_t zz_enc_phase(zz_buf *b, uint8_t type, uint16_t svc, uint32_t sender, uint32_t view,
                    uint64_t seq, const uint8_t digest[ZZ_DIGEST_LEN])
{
    return enc(b, type, svc, sender, BODY(phase, view, seq, digest));
}

size_t zz_enc_checkpoint(zz_buf *b, uint16_t svc, uint32_t sender, uint64_t seq,
                         const uint8_t state[ZZ_DIGEST_LEN])
{
    return enc(b, ZZ_CHECKPOINT, svc, sender, BODY(checkpoint, seq, state));
}

size_t zz_enc_fetch(zz_buf *b, uint16_t svc, uint32_t sender, uint8_t kind, uint64_t seq,
                    const uint8_t digest[ZZ_DIGEST_LEN])
{
    return enc(b, ZZ_FETCH, svc, sender, BODY(fetch, kind, seq, digest));
}

size_t zz_enc_fetch_reply(zz_buf *b, uint16_t svc, uint32_t sender, uint8_t kind, uint64_t seq,
                          const uint8_t digest[ZZ_DIGEST_LEN], const void *data, uint32_t len)
{
    return enc(b, ZZ_FETCH_REPLY, svc, sender, BODY(fetch_reply, kind, seq, digest, {data, len}));
}

size_t zz_enc_status(zz_buf *b, uint16_t svc, uint32_t sender, uint32_t view, uint64_t last_exec,
                     uint64_t stable_seq)
{
    return enc(b, ZZ_STATUS, svc, sender, BODY(status, view, last_exec, stable_seq));
}

size_t zz_enc_exec_commit(zz_buf *b, uint16_t svc, uint32_t sender, uint32_t view, uint64_t seq,
                          const uint8_t digest[ZZ_DIGEST_LEN], const void *batch, uint32_t len)
{
    return enc(b, ZZ_EXEC_COMMIT, svc, sender, BODY(exec_commit, view, seq, digest, {batch, len}));
}

size_t zz_enc_exec_digest(zz_buf *b, uint8_t type, uint16_t svc, uint32_t sender, uint64_t seq,
                          const uint8_t digest[ZZ_DIGEST_LEN])
{
    return enc(b, type, svc, sender, BODY(exec_checkpoint, seq, digest));
}

/* refs: nrefs encoded reply_refs back to back */
size_t zz_enc_exec_report(zz_buf *b, uint16_t svc, uint32_t sender, uint64_t seq,
                          const uint8_t digest[ZZ_DIGEST_LEN], const uint8_t *refs,
                          uint32_t nrefs)
{
    return enc(b, ZZ_EXEC_REPORT, svc, sender, BODY(exec_report, seq, digest, {nrefs, refs}));
}

size_t zz_enc_reply_affirm(zz_buf *b, uint16_t svc, uint32_t sender, uint64_t ts, uint32_t client,
                           const uint8_t digest[ZZ_DIGEST_LEN])
{
    return enc(b, ZZ_REPLY_AFFIRM, svc, sender, BODY(reply_affirm, ts, client, digest));
}

size_t zz_enc_control(zz_buf *b, uint8_t type, uint16_t svc, uint32_t sender, uint64_t request_id,
                      const void *json, uint32_t len)
{
    return enc(b, type, svc, sender, BODY(control, request_id, {json, len}));
}

size_t zz_enc_file_fetch(zz_buf *b, uint16_t svc, uint32_t sender, const zz_file_fetch *q)
{
    return enc(b, ZZ_FILE_FETCH, svc, sender, &(zz_body){.file_fetch = *q});
}

size_t zz_enc_file_data(zz_buf *b, uint16_t svc, uint32_t sender, const zz_file_data *d)
{
    return enc(b, ZZ_FILE_DATA, svc, sender, &(zz_body){.file_data = *d});
}

size_t zz_enc_spare_ready(zz_buf *b, uint16_t svc, uint32_t sender, const zz_spare_ready *q)
{
    return enc(b, ZZ_SPARE_READY, svc, sender, &(zz_body){.spare_ready = *q});
}
