/* wire_dump.c - the canonical dump (docs/wire.md "Canonical dump") and the re-encoder of a
 * decoded message, by the same field tables as the codec (wire_table.c). Test support: the
 * unit tests and fuzz_wire link it, zz-agreed does not. */
#include "wire_dump.h"

#include <stdio.h>
#include <string.h>

typedef struct {
    char *p;
    size_t cap;
    size_t len;
    int overflow;
} wr;

static void w_raw(wr *w, const char *s, size_t n)
{
    if (w->overflow || n >= w->cap - w->len) {
        w->overflow = 1;
        return;
    }
    memcpy(w->p + w->len, s, n);
    w->len += n;
}

static void w_str(wr *w, const char *s) { w_raw(w, s, strlen(s)); }

static void w_u64(wr *w, uint64_t v)
{
    char tmp[24];
    int n = snprintf(tmp, sizeof tmp, "%llu", (unsigned long long)v);
    w_raw(w, tmp, (size_t)n);
}

/* Lower-case hex; "-" for no bytes. */
static void w_hex(wr *w, const uint8_t *p, size_t n)
{
    static const char hx[] = "0123456789abcdef";
    if (n == 0) {
        w_raw(w, "-", 1);
        return;
    }
    if (w->overflow || n >= (w->cap - w->len) / 2) {
        w->overflow = 1;
        return;
    }
    for (size_t i = 0; i < n; i++) {
        w->p[w->len++] = hx[p[i] >> 4];
        w->p[w->len++] = hx[p[i] & 15];
    }
}

/* A list item: its fields joined by '/'. */
static void w_item(wr *w, uint8_t rec, const void *item)
{
    const zz_layout *l = &zz_records[rec].layout;
    for (uint8_t k = 0; k < l->nfields; k++) {
        const zz_field *f = &zz_fields[l->field + k];
        if (k)
            w_str(w, "/");
        if (f->kind == ZZ_K_ARRAY)
            w_hex(w, (const uint8_t *)item + f->off, f->size);
        else
            w_u64(w, zz_field_uint(f, item));
    }
}

static void w_field(wr *w, const zz_field *f, const void *base)
{
    const void *at = (const uint8_t *)base + f->off;
    const zz_bytes *x = at;
    w_str(w, " ");
    w_str(w, f->name);
    w_str(w, "=");
    switch (f->kind) {
    case ZZ_K_FIXED: w_hex(w, *(const uint8_t *const *)at, f->size); break;
    case ZZ_K_ARRAY: w_hex(w, at, f->size); break;
    case ZZ_K_BYTES: w_hex(w, x->p, x->len); break;
    case ZZ_K_BLIST: {
        zz_blist_iter it;
        zz_bytes item;
        w_str(w, "[");
        zz_blist_begin(at, &it);
        for (int first = 1; zz_blist_next(&it, &item); first = 0) {
            if (!first)
                w_str(w, ",");
            w_hex(w, item.p, item.len);
        }
        w_str(w, "]");
        break;
    }
    case ZZ_K_LIST: {
        const zz_flist *l = at;
        w_str(w, "[");
        for (uint32_t i = 0; i < l->count; i++) {
            zz_item item;
            zz_item_at(f->rec, l, i, &item);
            if (i)
                w_str(w, ",");
            w_item(w, f->rec, &item);
        }
        w_str(w, "]");
        break;
    }
    default: w_u64(w, zz_field_uint(f, base)); break;
    }
}

int zz_dump(const zz_msg *m, char *out, size_t cap)
{
    if (cap == 0 || !zz_type_known(m->type))
        return -1;
    const zz_layout *l = &zz_msgdefs[m->type].layout;
    wr w = {out, cap, 0, 0};
    w_str(&w, "type=");
    w_str(&w, zz_msgdefs[m->type].name);
    w_str(&w, " service=");
    w_u64(&w, m->service);
    w_str(&w, " sender=");
    w_u64(&w, m->sender);
    for (const zz_field *f = &zz_fields[l->field]; f < &zz_fields[l->field + l->nfields]; f++)
        if (f->kind != ZZ_K_REST) /* its parts follow it */
            w_field(&w, f, &m->u);
    if (w.overflow)
        return -1;
    out[w.len] = '\0';
    return (int)w.len;
}

size_t zz_reencode(zz_buf *b, const zz_msg *m)
{
    if (!zz_type_known(m->type))
        return b->len;
    /* A decoded ZZ_K_REST field holds the bytes of the fields after it: clear it, so that
     * those fields are encoded one by one. */
    zz_msg fields = *m;
    const zz_layout *l = &zz_msgdefs[m->type].layout;
    for (const zz_field *f = &zz_fields[l->field]; f < &zz_fields[l->field + l->nfields]; f++)
        if (f->kind == ZZ_K_REST)
            memset((uint8_t *)&fields.u + f->off, 0, sizeof(zz_bytes));
    size_t s = zz_encode(b, &fields);
    zz_put_raw(b, m->auth, m->auth_len); /* the encoder adds none */
    return s;
}
