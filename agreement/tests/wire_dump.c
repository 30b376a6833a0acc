/* wire_dump.c - the canonical dump (docs/wire.md "Canonical dump") and the re-encoder of a
 * decoded message. Test support: the unit tests and fuzz_wire link it, zz-agreed does not. */
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

static void w_field_u(wr *w, const char *name, uint64_t v)
{
    w_str(w, " ");
    w_str(w, name);
    w_str(w, "=");
    w_u64(w, v);
}

static void w_field_hex(wr *w, const char *name, const uint8_t *p, size_t n)
{
    w_str(w, " ");
    w_str(w, name);
    w_str(w, "=");
    w_hex(w, p, n);
}

static void w_field_blist(wr *w, const char *name, const zz_blist *l)
{
    zz_blist_iter it;
    zz_bytes b;
    int first = 1;
    w_str(w, " ");
    w_str(w, name);
    w_str(w, "=[");
    zz_blist_begin(l, &it);
    while (zz_blist_next(&it, &b)) {
        if (!first)
            w_str(w, ",");
        first = 0;
        w_hex(w, b.p, b.len);
    }
    w_str(w, "]");
}

static void w_field_entries(wr *w, const char *name, const zz_flist *l)
{
    w_str(w, " ");
    w_str(w, name);
    w_str(w, "=[");
    for (uint32_t i = 0; i < l->count; i++) {
        zz_entry e;
        zz_entry_at(l, i, &e);
        if (i)
            w_str(w, ",");
        w_u64(w, e.seq);
        w_str(w, "/");
        w_u64(w, e.view);
        w_str(w, "/");
        w_hex(w, e.digest, ZZ_DIGEST_LEN);
    }
    w_str(w, "]");
}

static void w_field_choices(wr *w, const char *name, const zz_flist *l)
{
    w_str(w, " ");
    w_str(w, name);
    w_str(w, "=[");
    for (uint32_t i = 0; i < l->count; i++) {
        zz_choice c;
        zz_choice_at(l, i, &c);
        if (i)
            w_str(w, ",");
        w_u64(w, c.seq);
        w_str(w, "/");
        w_hex(w, c.digest, ZZ_DIGEST_LEN);
    }
    w_str(w, "]");
}

static void w_field_rows(wr *w, const char *name, const zz_flist *l)
{
    w_str(w, " ");
    w_str(w, name);
    w_str(w, "=[");
    for (uint32_t i = 0; i < l->count; i++) {
        zz_row_entry e;
        zz_row_at(l, i, &e);
        if (i)
            w_str(w, ",");
        w_u64(w, e.replica);
        w_str(w, "/");
        w_u64(w, e.state);
        w_str(w, "/");
        w_hex(w, e.digest, ZZ_DIGEST_LEN);
    }
    w_str(w, "]");
}

static void w_field_reply_refs(wr *w, const char *name, const zz_flist *l)
{
    w_str(w, " ");
    w_str(w, name);
    w_str(w, "=[");
    for (uint32_t i = 0; i < l->count; i++) {
        zz_reply_ref e;
        zz_reply_ref_at(l, i, &e);
        if (i)
            w_str(w, ",");
        w_u64(w, e.client);
        w_str(w, "/");
        w_u64(w, e.timestamp);
        w_str(w, "/");
        w_hex(w, e.result_digest, ZZ_DIGEST_LEN);
    }
    w_str(w, "]");
}

static void w_field_u32s(wr *w, const char *name, const zz_flist *l)
{
    w_str(w, " ");
    w_str(w, name);
    w_str(w, "=[");
    for (uint32_t i = 0; i < l->count; i++) {
        if (i)
            w_str(w, ",");
        w_u64(w, zz_u32_at(l, i));
    }
    w_str(w, "]");
}

static const char *type_name(uint8_t t)
{
    static const char *const names[] = {
        "?",           "REQUEST",        "REPLY",           "PRE-PREPARE",     "PREPARE",
        "COMMIT",      "CHECKPOINT",     "VIEW-CHANGE",     "NEW-VIEW",        "FETCH",
        "FETCH-REPLY", "STATUS",         "?",               "?",               "?",
        "?",           "EXEC-COMMIT",    "EXEC-REPORT",     "EXEC-CHECKPOINT", "FAULT-STATEMENT",
        "WAKEUP",      "SHUTDOWN",       "REPLY-AFFIRM",    "CONTROL",         "CONTROL-REPLY",
        "FILE-FETCH",  "FILE-DATA",      "SPARE-READY"};
    return zz_type_known(t) ? names[t] : "?";
}

int zz_dump(const zz_msg *m, char *out, size_t cap)
{
    if (cap == 0)
        return -1;
    wr w = {out, cap, 0, 0};
    w_str(&w, "type=");
    w_str(&w, type_name(m->type));
    w_field_u(&w, "service", m->service);
    w_field_u(&w, "sender", m->sender);
    switch (m->type) {
    case ZZ_REQUEST:
        w_field_u(&w, "timestamp", m->u.request.timestamp);
        w_field_u(&w, "flags", m->u.request.flags);
        w_field_hex(&w, "op", m->u.request.op.p, m->u.request.op.len);
        break;
    case ZZ_REPLY:
        w_field_u(&w, "view", m->u.reply.view);
        w_field_u(&w, "timestamp", m->u.reply.timestamp);
        w_field_u(&w, "client", m->u.reply.client);
        w_field_u(&w, "flags", m->u.reply.flags);
        w_field_hex(&w, "result", m->u.reply.result.p, m->u.reply.result.len);
        break;
    case ZZ_PRE_PREPARE:
        w_field_u(&w, "view", m->u.pre_prepare.view);
        w_field_u(&w, "seq", m->u.pre_prepare.seq);
        w_field_u(&w, "nd_time", m->u.pre_prepare.nd_time);
        w_field_u(&w, "nd_seed", m->u.pre_prepare.nd_seed);
        w_field_blist(&w, "requests", &m->u.pre_prepare.requests);
        break;
    case ZZ_PREPARE:
    case ZZ_COMMIT:
        w_field_u(&w, "view", m->u.phase.view);
        w_field_u(&w, "seq", m->u.phase.seq);
        w_field_hex(&w, "digest", m->u.phase.digest, ZZ_DIGEST_LEN);
        break;
    case ZZ_CHECKPOINT:
        w_field_u(&w, "seq", m->u.checkpoint.seq);
        w_field_hex(&w, "state", m->u.checkpoint.state, ZZ_DIGEST_LEN);
        break;
    case ZZ_VIEW_CHANGE:
        w_field_u(&w, "new_view", m->u.view_change.new_view);
        w_field_u(&w, "stable_seq", m->u.view_change.stable_seq);
        w_field_blist(&w, "proof", &m->u.view_change.proof);
        w_field_entries(&w, "prepared", &m->u.view_change.prepared);
        w_field_entries(&w, "preprepared", &m->u.view_change.preprepared);
        break;
    case ZZ_NEW_VIEW:
        w_field_u(&w, "view", m->u.new_view.view);
        w_field_blist(&w, "view_changes", &m->u.new_view.view_changes);
        w_field_u(&w, "min_s", m->u.new_view.min_s);
        w_field_choices(&w, "chosen", &m->u.new_view.chosen);
        break;
    case ZZ_FETCH:
        w_field_u(&w, "kind", m->u.fetch.kind);
        w_field_u(&w, "seq", m->u.fetch.seq);
        w_field_hex(&w, "digest", m->u.fetch.digest, ZZ_DIGEST_LEN);
        break;
    case ZZ_FETCH_REPLY:
        w_field_u(&w, "kind", m->u.fetch_reply.kind);
        w_field_u(&w, "seq", m->u.fetch_reply.seq);
        w_field_hex(&w, "digest", m->u.fetch_reply.digest, ZZ_DIGEST_LEN);
        w_field_hex(&w, "data", m->u.fetch_reply.data.p, m->u.fetch_reply.data.len);
        break;
    case ZZ_STATUS:
        w_field_u(&w, "view", m->u.status.view);
        w_field_u(&w, "last_exec", m->u.status.last_exec);
        w_field_u(&w, "stable_seq", m->u.status.stable_seq);
        break;
    case ZZ_EXEC_COMMIT:
        w_field_u(&w, "view", m->u.exec_commit.view);
        w_field_u(&w, "seq", m->u.exec_commit.seq);
        w_field_hex(&w, "digest", m->u.exec_commit.digest, ZZ_DIGEST_LEN);
        w_field_hex(&w, "batch", m->u.exec_commit.batch.p, m->u.exec_commit.batch.len);
        break;
    case ZZ_EXEC_REPORT:
        w_field_u(&w, "seq", m->u.exec_report.seq);
        w_field_hex(&w, "reply_digest", m->u.exec_report.digest, ZZ_DIGEST_LEN);
        w_field_reply_refs(&w, "replies", &m->u.exec_report.replies);
        break;
    case ZZ_EXEC_CHECKPOINT:
        w_field_u(&w, "seq", m->u.exec_digest.seq);
        w_field_hex(&w, "checkpoint", m->u.exec_digest.digest, ZZ_DIGEST_LEN);
        break;
    case ZZ_FAULT_STATEMENT:
        w_field_u(&w, "seq", m->u.fault_statement.seq);
        w_field_rows(&w, "row", &m->u.fault_statement.row);
        break;
    case ZZ_WAKEUP:
        w_field_u(&w, "seq", m->u.wakeup.seq);
        w_field_blist(&w, "evidence", &m->u.wakeup.evidence);
        w_field_u32s(&w, "sleeping", &m->u.wakeup.sleeping);
        w_field_u32s(&w, "wake", &m->u.wakeup.wake);
        break;
    case ZZ_SHUTDOWN:
        w_field_u(&w, "seq", m->u.shutdown.seq);
        w_field_u32s(&w, "awake", &m->u.shutdown.awake);
        w_field_u32s(&w, "convict", &m->u.shutdown.convict);
        w_field_u32s(&w, "sleep", &m->u.shutdown.sleep);
        w_field_u32s(&w, "active", &m->u.shutdown.active);
        break;
    case ZZ_REPLY_AFFIRM:
        w_field_u(&w, "timestamp", m->u.reply_affirm.timestamp);
        w_field_u(&w, "client", m->u.reply_affirm.client);
        w_field_hex(&w, "result_digest", m->u.reply_affirm.result_digest, ZZ_DIGEST_LEN);
        break;
    case ZZ_CONTROL:
    case ZZ_CONTROL_REPLY:
        w_field_u(&w, "request_id", m->u.control.request_id);
        w_field_hex(&w, "json", m->u.control.json.p, m->u.control.json.len);
        break;
    case ZZ_FILE_FETCH:
        w_field_u(&w, "seq", m->u.file_fetch.seq);
        w_field_hex(&w, "path", m->u.file_fetch.path.p, m->u.file_fetch.path.len);
        w_field_u(&w, "offset", m->u.file_fetch.offset);
        w_field_u(&w, "length", m->u.file_fetch.length);
        w_field_u(&w, "target", m->u.file_fetch.target);
        w_field_hex(&w, "challenge", m->u.file_fetch.challenge.p, m->u.file_fetch.challenge.len);
        break;
    case ZZ_FILE_DATA:
        w_field_u(&w, "seq", m->u.file_data.seq);
        w_field_hex(&w, "path", m->u.file_data.path.p, m->u.file_data.path.len);
        w_field_u(&w, "offset", m->u.file_data.offset);
        w_field_u(&w, "status", m->u.file_data.status);
        w_field_u(&w, "size", m->u.file_data.size);
        w_field_hex(&w, "data", m->u.file_data.data.p, m->u.file_data.data.len);
        break;
    case ZZ_SPARE_READY:
        w_field_u(&w, "replica", m->u.spare_ready.replica);
        w_field_u(&w, "seq", m->u.spare_ready.seq);
        w_field_u(&w, "epoch", m->u.spare_ready.epoch);
        w_field_hex(&w, "sign_pub", m->u.spare_ready.sign_pub, ZZ_KEY_LEN);
        w_field_hex(&w, "dh_pub", m->u.spare_ready.dh_pub, ZZ_KEY_LEN);
        break;
    default:
        return -1;
    }
    if (w.overflow)
        return -1;
    out[w.len] = '\0';
    return (int)w.len;
}

/* ---- re-encoding ---- */

/* Lists are rebuilt item by item from the decoded view (not copied as one blob) so
 * that a round trip actually exercises the encoders. */
static void put_blist(zz_buf *b, const zz_blist *l)
{
    zz_blist_iter it;
    zz_bytes item;
    zz_put_u32(b, l->count);
    zz_blist_begin(l, &it);
    while (zz_blist_next(&it, &item))
        zz_put_bytes(b, item.p, item.len);
}

static void put_entries(zz_buf *b, const zz_flist *l)
{
    zz_put_u32(b, l->count);
    for (uint32_t i = 0; i < l->count; i++) {
        zz_entry e;
        zz_entry_at(l, i, &e);
        zz_put_entry(b, &e);
    }
}

static void put_u32s(zz_buf *b, const zz_flist *l)
{
    zz_put_u32(b, l->count);
    for (uint32_t i = 0; i < l->count; i++)
        zz_put_u32(b, zz_u32_at(l, i));
}

/* Returns the start offset of the re-encoded message in b, like the zz_enc_* helpers. */
size_t zz_reencode(zz_buf *b, const zz_msg *m)
{
    size_t s;
    switch (m->type) {
    case ZZ_REQUEST:
        s = zz_enc_request_kind(b, m->auth_kind, m->service, m->sender, m->u.request.timestamp,
                                m->u.request.flags, m->u.request.op.p, m->u.request.op.len);
        break;
    case ZZ_REPLY:
        s = zz_enc_reply(b, m->service, m->sender, m->u.reply.view, m->u.reply.timestamp,
                         m->u.reply.client, m->u.reply.flags, m->u.reply.result.p,
                         m->u.reply.result.len);
        break;
    case ZZ_PRE_PREPARE: {
        const zz_pre_prepare *q = &m->u.pre_prepare;
        s = zz_begin(b, ZZ_PRE_PREPARE, m->auth_kind, m->service, m->sender);
        zz_put_u32(b, q->view);
        zz_put_u64(b, q->seq);
        zz_put_u64(b, q->nd_time);
        zz_put_u64(b, q->nd_seed);
        put_blist(b, &q->requests);
        zz_end_body(b, s);
        break;
    }
    case ZZ_PREPARE:
    case ZZ_COMMIT:
        s = zz_enc_phase(b, m->type, m->service, m->sender, m->u.phase.view, m->u.phase.seq,
                         m->u.phase.digest);
        break;
    case ZZ_CHECKPOINT:
        s = zz_enc_checkpoint(b, m->service, m->sender, m->u.checkpoint.seq, m->u.checkpoint.state);
        break;
    case ZZ_VIEW_CHANGE: {
        const zz_view_change *q = &m->u.view_change;
        s = zz_begin(b, ZZ_VIEW_CHANGE, m->auth_kind, m->service, m->sender);
        zz_put_u32(b, q->new_view);
        zz_put_u64(b, q->stable_seq);
        put_blist(b, &q->proof);
        put_entries(b, &q->prepared);
        put_entries(b, &q->preprepared);
        zz_end_body(b, s);
        break;
    }
    case ZZ_NEW_VIEW: {
        const zz_new_view *q = &m->u.new_view;
        s = zz_begin(b, ZZ_NEW_VIEW, m->auth_kind, m->service, m->sender);
        zz_put_u32(b, q->view);
        put_blist(b, &q->view_changes);
        zz_put_u64(b, q->min_s);
        zz_put_u32(b, q->chosen.count);
        for (uint32_t i = 0; i < q->chosen.count; i++) {
            zz_choice c;
            zz_choice_at(&q->chosen, i, &c);
            zz_put_choice(b, &c);
        }
        zz_end_body(b, s);
        break;
    }
    case ZZ_FETCH:
        s = zz_enc_fetch(b, m->service, m->sender, m->u.fetch.kind, m->u.fetch.seq,
                         m->u.fetch.digest);
        break;
    case ZZ_FETCH_REPLY:
        s = zz_enc_fetch_reply(b, m->service, m->sender, m->u.fetch_reply.kind,
                               m->u.fetch_reply.seq, m->u.fetch_reply.digest,
                               m->u.fetch_reply.data.p, m->u.fetch_reply.data.len);
        break;
    case ZZ_STATUS:
        s = zz_enc_status(b, m->service, m->sender, m->u.status.view, m->u.status.last_exec,
                          m->u.status.stable_seq);
        break;
    case ZZ_EXEC_COMMIT:
        s = zz_enc_exec_commit(b, m->service, m->sender, m->u.exec_commit.view,
                               m->u.exec_commit.seq, m->u.exec_commit.digest,
                               m->u.exec_commit.batch.p, m->u.exec_commit.batch.len);
        break;
    case ZZ_EXEC_CHECKPOINT:
        s = zz_enc_exec_digest(b, m->type, m->service, m->sender, m->u.exec_digest.seq,
                               m->u.exec_digest.digest);
        break;
    case ZZ_EXEC_REPORT: {
        const zz_exec_report *q = &m->u.exec_report;
        s = zz_begin(b, ZZ_EXEC_REPORT, m->auth_kind, m->service, m->sender);
        zz_put_u64(b, q->seq);
        zz_put_raw(b, q->digest, ZZ_DIGEST_LEN);
        zz_put_u32(b, q->replies.count);
        for (uint32_t i = 0; i < q->replies.count; i++) {
            zz_reply_ref e;
            zz_reply_ref_at(&q->replies, i, &e);
            zz_put_reply_ref(b, &e);
        }
        zz_end_body(b, s);
        break;
    }
    case ZZ_FAULT_STATEMENT: {
        const zz_fault_statement *q = &m->u.fault_statement;
        s = zz_begin(b, ZZ_FAULT_STATEMENT, m->auth_kind, m->service, m->sender);
        zz_put_u64(b, q->seq);
        zz_put_u32(b, q->row.count);
        for (uint32_t i = 0; i < q->row.count; i++) {
            zz_row_entry e;
            zz_row_at(&q->row, i, &e);
            zz_put_row_entry(b, &e);
        }
        zz_end_body(b, s);
        break;
    }
    case ZZ_WAKEUP: {
        const zz_wakeup *q = &m->u.wakeup;
        s = zz_begin(b, ZZ_WAKEUP, m->auth_kind, m->service, m->sender);
        zz_put_u64(b, q->seq);
        put_blist(b, &q->evidence);
        put_u32s(b, &q->sleeping);
        put_u32s(b, &q->wake);
        zz_end_body(b, s);
        break;
    }
    case ZZ_SHUTDOWN: {
        const zz_shutdown *q = &m->u.shutdown;
        s = zz_begin(b, ZZ_SHUTDOWN, m->auth_kind, m->service, m->sender);
        zz_put_u64(b, q->seq);
        put_u32s(b, &q->awake);
        put_u32s(b, &q->convict);
        put_u32s(b, &q->sleep);
        put_u32s(b, &q->active);
        zz_end_body(b, s);
        break;
    }
    case ZZ_REPLY_AFFIRM:
        s = zz_enc_reply_affirm(b, m->service, m->sender, m->u.reply_affirm.timestamp,
                                m->u.reply_affirm.client, m->u.reply_affirm.result_digest);
        break;
    case ZZ_CONTROL:
    case ZZ_CONTROL_REPLY:
        s = zz_enc_control(b, m->type, m->service, m->sender, m->u.control.request_id,
                           m->u.control.json.p, m->u.control.json.len);
        break;
    case ZZ_FILE_FETCH:
        s = zz_enc_file_fetch(b, m->service, m->sender, &m->u.file_fetch);
        break;
    case ZZ_FILE_DATA:
        s = zz_enc_file_data(b, m->service, m->sender, &m->u.file_data);
        break;
    case ZZ_SPARE_READY:
        s = zz_enc_spare_ready(b, m->service, m->sender, &m->u.spare_ready);
        break;
    default:
        return b->len;
    }
    /* The encoders pick the auth kind of the type; a decoded message already had it. */
    zz_put_raw(b, m->auth, m->auth_len);
    return s;
}
