/* execute.c - in-order execution of committed batches: the built-in echo state machine (a
 * null service, result = op, state a hash chain: `echo` services, tests and the agreement
 * benchmark), or, with `execution external`, the hand-off of each batch to the execution
 * log and to the awake execution replicas as EXEC-COMMIT (docs/design.md §3.3). */
#include <stdlib.h>
#include <string.h>

#include "byz.h"
#include "replica.h"
#include "zzlayer.h"

/* Echo state machine: app = SHA-256(app || u32 client || u64 t || op); result = op. */
static void echo_apply(zz_replica *r, uint32_t client, uint64_t t, const zz_bytes *op)
{
    zz_buf *b = &r->out2;
    zz_buf_reset(b);
    zz_put_raw(b, r->app, ZZ_DIGEST_LEN);
    zz_put_u32(b, client);
    zz_put_u64(b, t);
    zz_put_raw(b, op->p, op->len);
    if (!b->oom)
        zz_sha256(b->p, b->len, r->app);
}

static void execute_request(zz_replica *r, const zz_bytes *raw)
{
    zz_msg m;
    /* Every correct replica runs the same deterministic decode, so a malformed entry
     * slipped in by a faulty primary is skipped identically everywhere. */
    if (zz_decode(raw->p, raw->len, &m) != ZZ_OK || m.type != ZZ_REQUEST ||
        m.service != r->conf->service)
        return;
    int ci = zz_client_index(r, m.sender);
    if (ci < 0)
        return;
    zz_client *c = &r->clients[ci];
    uint64_t t = m.u.request.timestamp;
    if (t <= c->last_t)
        return; /* exactly-once: already executed */
    const zz_bytes *op = &m.u.request.op;
    echo_apply(r, m.sender, t, op);
    c->last_t = t;
    if (c->pend_t <= t) {
        free(c->pend_raw);
        c->pend_raw = NULL;
        c->pend_len = 0;
        c->pend_signed = 0;
    }
    r->st.executed++;
    if (r->conf->external_exec)
        return; /* execution replicas run the app and reply; we only record the order */
    free(c->result);
    c->result = zz_memdup(op->p, op->len);
    c->result_len = c->result ? op->len : 0;
    if (c->result)
        zz_send_reply(r, (uint32_t)ci, r->view, t, 0, c->result, c->result_len);
}

static void execute_batch(zz_replica *r, zz_slot *s)
{
    uint64_t nd_time, nd_seed;
    zz_blist reqs;
    if (zz_decode_batch(s->batch, s->batch_len, &nd_time, &nd_seed, &reqs) != ZZ_OK)
        return; /* digest-certified but malformed: a faulty primary's batch, executes as null */
    if (nd_time > r->last_nd_time)
        r->last_nd_time = nd_time;
    zz_blist_iter it;
    zz_bytes item;
    zz_blist_begin(&reqs, &it);
    while (zz_blist_next(&it, &item))
        execute_request(r, &item);
}

static void fetch_batch(zz_replica *r, zz_slot *s)
{
    uint64_t now = zz_now_ms(r);
    if (s->fetch_sent_ms && now - s->fetch_sent_ms < 200)
        return;
    s->fetch_sent_ms = now;
    zz_buf *b = &r->out;
    zz_buf_reset(b);
    size_t st = zz_enc_fetch(b, r->conf->service, r->id, ZZ_FETCH_BATCH, s->seq, s->digest);
    zz_end_body(b, st);
    zz_bcast_mac(r, b, st);
    r->st.fetches_sent++;
}

/* docs/design.md §3.3: every committed batch goes, in order, to the execution replicas that
 * registered (FETCH kind 3); they execute on 2g+1 matching EXEC-COMMITs. */
static void push_exec_commit(zz_replica *r, zz_slot *s)
{
    static const uint8_t null_digest[ZZ_DIGEST_LEN];
    zz_buf *b = &r->out;
    zz_detect_dispatched(r, s->seq);
    for (uint32_t i = 0; i < ZZ_MAX_EXEC; i++) {
        /* Sleeping replicas get nothing; woken ones replay the log first (rounds.c). */
        if (!r->zz.exec_conn[i] || zz_byz_silent(r) || !zz_exec_counts(r, i))
            continue;
        uint32_t to = ZZ_PRINCIPAL_EXEC + i;
        zz_mackey *k = (zz_mackey *)zz_mac_for(r, to);
        if (!k)
            continue;
        zz_buf_reset(b);
        size_t st = zz_enc_exec_commit(b, r->conf->service, r->id, s->view, s->seq,
                                       s->is_null ? null_digest : s->digest, s->batch,
                                       s->is_null ? 0 : s->batch_len);
        zz_auth_mac(b, st, &to, &k, 1);
        if (!b->oom) {
            zz_net_send_conn(r->net, r->zz.exec_conn[i], b->p + st, b->len - st);
            r->st.exec_commits_sent++;
        }
    }
}

void zz_try_execute(zz_replica *r)
{
    int progress = 0;
    while (!r->transfer_seq) {
        uint64_t seq = r->last_exec + 1;
        if (!zz_in_window(r, seq))
            break;
        zz_slot *s = &r->slots[seq % r->L];
        if (s->seq != seq || !s->committed)
            break;
        if (!s->is_null && !s->batch) {
            fetch_batch(r, s);
            break;
        }
        if (s->is_null)
            r->st.null_executed++;
        else
            execute_batch(r, s);
        if (r->conf->external_exec) {
            zz_xlog_append(r, s);
            push_exec_commit(r, s);
        }
        r->last_exec = seq;
        r->st.batches_executed++;
        if (s->t_commit_us) {
            r->st.ph_exec_n++;
            r->st.ph_exec_us += zz_mono_us() - s->t_commit_us;
        }
        progress = 1;
        if (seq % r->conf->checkpoint_interval == 0)
            zz_take_checkpoint(r);
    }
    if (progress) {
        r->last_progress_ms = zz_now_ms(r);
        r->vc_attempts = 0;
        if (r->next_seq < r->last_exec)
            r->next_seq = r->last_exec;
        zz_try_propose(r);
    }
}

void zz_exec_readonly(zz_replica *r, uint32_t ci, const zz_msg *m)
{
    /* Read-only optimisation: answered at once from the current state, no ordering; the
     * client needs 2g+1 matching replies and falls back to an ordered request. */
    r->st.requests_readonly++;
    const zz_bytes *op = &m->u.request.op;
    zz_send_reply(r, ci, r->view, m->u.request.timestamp, ZZ_REQ_READONLY, op->p, op->len);
}
