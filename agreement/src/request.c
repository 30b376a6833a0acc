/* request.c - client requests: exactly-once filtering, the pending set that drives the
 * view-change timer, the primary's adaptive batching, and replies to clients. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "byz.h"
#include "replica.h"

void zz_send_reply(zz_replica *r, uint32_t ci, uint32_t view, uint64_t t, uint8_t flags,
                   const uint8_t *res, uint32_t len)
{
    zz_client *c = &r->clients[ci];
    if (!c->conn || zz_byz_silent(r))
        return;
    uint32_t principal = r->conf->keys[ci].id;
    zz_buf *b = &r->rbuf;
    zz_buf_reset(b);
    size_t st = zz_enc_reply(b, r->conf->service, r->id, view, t, principal, flags, res, len);
    zz_end_body(b, st);
    zz_mackey *k = r->conf->keys[ci].mac;
    zz_auth_mac(b, st, &principal, &k, 1);
    if (!b->oom)
        zz_net_send_conn(r->net, c->conn, b->p + st, b->len - st);
}

/* External execution: we hold no results, but an execution certificate for the client's
 * newest request; g+1 matching REPLY-AFFIRMs plus one REPLY with that result convince the
 * client (ZZ §4.2) when f+1 matching REPLYs cannot be had, e.g. while a spare wakes. */
static void send_affirm(zz_replica *r, uint32_t ci)
{
    zz_client *c = &r->clients[ci];
    if (!c->conn || zz_byz_silent(r))
        return;
    uint32_t principal = r->conf->keys[ci].id;
    zz_buf *b = &r->rbuf;
    zz_buf_reset(b);
    size_t st = zz_enc_reply_affirm(b, r->conf->service, r->id, c->aff_t, principal, c->aff_dig);
    zz_mackey *k = r->conf->keys[ci].mac;
    zz_auth_mac(b, st, &principal, &k, 1);
    if (!b->oom) {
        zz_net_send_conn(r->net, c->conn, b->p + st, b->len - st);
        r->st.reply_affirms_sent++;
    }
}

uint32_t zz_request_limit(const zz_replica *r)
{
    const zz_conf *c = r->conf;
    uint32_t lim = c->max_request;
    if (lim > c->batch_bytes - ZZ_BATCH_HDR_LEN - 4)
        lim = c->batch_bytes - ZZ_BATCH_HDR_LEN - 4;
    if (!c->external_exec) {
        /* The echo state encoding (docs/wire.md) holds every client's last result, which is
         * its op: nclients * (16 + result) + 44 must fit one FETCH-REPLY. Counted once per
         * key set (this runs for every request). */
        static const zz_conf *seen_conf;
        static uint32_t seen_nkeys, seen_clients;
        if (seen_conf != c || seen_nkeys != c->nkeys) {
            seen_clients = 0;
            for (uint32_t i = 0; i < c->nkeys; i++)
                seen_clients += c->keys[i].id >= ZZ_PRINCIPAL_CLIENT;
            seen_conf = c;
            seen_nkeys = c->nkeys;
        }
        uint32_t nclients = seen_clients;
        if (nclients > 0) {
            uint32_t per = (ZZ_MAX_MSG - ZZ_MSG_OVERHEAD_MAX - 44) / nclients;
            per = per > 16 ? per - 16 : 0;
            if (lim > per)
                lim = per;
        }
    }
    return lim;
}

/* The REPLY that refuses a request unordered (flag REJECTED, docs/wire.md): the client
 * learns why and the limit, and stops retransmitting. */
static void send_reject(zz_replica *r, uint32_t ci, uint64_t t, uint32_t limit)
{
    uint8_t res[ZZ_REJECT_LEN] = {ZZ_REJECT_TOO_LARGE, (uint8_t)(limit >> 24),
                                  (uint8_t)(limit >> 16), (uint8_t)(limit >> 8), (uint8_t)limit};
    zz_send_reply(r, ci, r->view, t, ZZ_REPLY_REJECTED, res, sizeof res);
}

static uint64_t largest_client_queue(const zz_replica *r)
{
    uint64_t most = 0;
    for (uint32_t i = 0; i < r->conf->nkeys; i++) {
        uint64_t q = zz_net_owner_queued(r->net, i + 1);
        most = q > most ? q : most;
    }
    return most;
}

void zz_limits_write_stats(zz_replica *r, void *file)
{
    FILE *f = file;
    const zz_net_stats *ns = zz_net_get_stats(r->net);
    fprintf(f, "\"limits\": {\"request_limit\": %u, \"batch_bytes\": %u, "
               "\"requests_too_large\": %llu, \"batches_too_large\": %llu, "
               "\"conns_open\": %llu, \"conns_refused\": %llu, "
               "\"conns_refused_source\": %llu, \"frame_timeouts\": %llu, "
               "\"unauth_timeouts\": %llu, \"unauth_buffer_refusals\": %llu, "
               "\"in_buffer_bytes\": %llu, \"client_out_budget\": %u, "
               "\"client_out_total_budget\": %u, \"out_stall_timeout_ms\": %u, "
               "\"out_buffer_bytes\": %llu, \"client_out_queued\": %llu, "
               "\"client_out_largest\": %llu, \"client_out_overflows\": %llu, "
               "\"out_total_overflows\": %llu, \"out_stall_timeouts\": %llu, "
               "\"slow_readers\": {",
            zz_request_limit(r), r->conf->batch_bytes,
            (unsigned long long)r->st.requests_too_large,
            (unsigned long long)r->st.batches_too_large, (unsigned long long)ns->conns_open,
            (unsigned long long)ns->conns_refused, (unsigned long long)ns->conns_refused_source,
            (unsigned long long)ns->frame_timeouts, (unsigned long long)ns->unauth_timeouts,
            (unsigned long long)ns->unauth_buffer_refusals,
            (unsigned long long)ns->in_buffer_bytes, r->conf->client_out_bytes,
            r->conf->client_out_total, r->conf->out_stall_timeout_ms,
            (unsigned long long)ns->out_buffer_bytes, (unsigned long long)ns->client_out_bytes,
            (unsigned long long)largest_client_queue(r),
            (unsigned long long)ns->client_out_overflows,
            (unsigned long long)ns->out_total_overflows,
            (unsigned long long)ns->out_stall_timeouts);
    /* Per client principal: its connections closed as slow readers (only those with any). */
    const char *sep = "";
    for (uint32_t i = 0; i < r->conf->nkeys; i++) {
        uint64_t k = zz_net_owner_closes(r->net, i + 1);
        if (k) {
            fprintf(f, "%s\"%u\": %llu", sep, r->conf->keys[i].id, (unsigned long long)k);
            sep = ", ";
        }
    }
    fprintf(f, "}}, ");
}

void zz_signed_write_stats(zz_replica *r, void *file)
{
    FILE *f = file;
    fprintf(f, "\"signed_requests\": {\"in\": %llu, \"bad_signature\": %llu, "
               "\"bad_mac\": %llu, \"sig_banned\": %llu, \"upgraded\": %llu, "
               "\"timer_exempt\": %llu, \"pp_checked\": %llu, "
               "\"pp_unverifiable\": %llu, \"pp_held\": %llu, \"pp_vouched\": %llu, "
               "\"must_sign_marks\": %llu, \"unsigned_deferred\": %llu}, ",
            (unsigned long long)r->st.req_signed_in, (unsigned long long)r->st.req_bad_sig,
            (unsigned long long)r->st.req_bad_mac, (unsigned long long)r->st.req_sig_banned,
            (unsigned long long)r->st.req_upgraded,
            (unsigned long long)r->st.req_timer_exempt, (unsigned long long)r->st.pp_sig_checked,
            (unsigned long long)r->st.pp_unverifiable, (unsigned long long)r->st.pp_held,
            (unsigned long long)r->st.pp_vouched, (unsigned long long)r->st.must_sign_marks,
            (unsigned long long)r->st.unsigned_deferred);
}

static void enqueue(zz_replica *r, uint32_t ci)
{
    zz_client *c = &r->clients[ci];
    if (c->queued)
        return;
    uint32_t cap = r->conf->nkeys;
    r->queue[(r->q_head + r->q_len) % cap] = ci;
    r->q_len++;
    c->queued = 1;
}

void zz_on_request(zz_replica *r, zz_conn *conn, const zz_msg *m)
{
    int ci = zz_client_index(r, m->sender);
    zz_client *c = &r->clients[ci];
    uint64_t t = m->u.request.timestamp;
    r->st.requests_in++;
    int relayed = zz_net_conn_tag(conn) == ZZ_TAG_PEER;
    if (conn && !relayed) {
        c->conn = conn;
        /* Replies queued for this client, on every connection it used, share one budget
         * (client_out_bytes); a connection it stopped reading is closed (net.c). */
        zz_net_conn_set_owner(r->net, conn, (uint32_t)ci + 1);
    }
    /* Too large to ever be ordered (docs/wire.md "Size limits"): refused here, before it
     * is pending anywhere, so it can never start a view-change timer. */
    uint32_t limit = zz_request_limit(r);
    if (m->raw_len > limit) {
        r->st.requests_too_large++;
        if (!relayed)
            send_reject(r, (uint32_t)ci, t, limit);
        return;
    }
    if (m->u.request.flags & ZZ_REQ_READONLY) {
        zz_exec_readonly(r, (uint32_t)ci, m);
        return;
    }
    if (t <= c->last_t) {
        /* A retransmission of the executed request gets the cached reply again;
         * older ones are stale and the client has moved on. */
        r->st.requests_dup++;
        if (t == c->last_t && c->result)
            zz_send_reply(r, (uint32_t)ci, r->view, t, 0, c->result, c->result_len);
        else if (r->conf->external_exec && c->aff_t && t <= c->aff_t)
            send_affirm(r, (uint32_t)ci);
        return;
    }
    int is_signed = m->auth_kind == ZZ_AUTH_MAC_SIG;
    /* A newer request, or the signed copy of the pending one (a client signs when it
     * retransmits): the signed copy replaces the unsigned one, so that it is the one this
     * replica proposes or relays and the one whose wait runs the view-change timer. */
    int upgrade = t == c->pend_t && c->pend_raw && is_signed && !c->pend_signed;
    if (t > c->pend_t || upgrade) {
        uint8_t *copy = zz_memdup(m->raw, m->raw_len);
        if (!copy)
            return;
        free(c->pend_raw);
        c->pend_raw = copy;
        c->pend_len = m->raw_len;
        c->pend_t = t;
        c->pend_signed = is_signed;
        c->pend_since_ms = zz_now_ms(r);
        if (upgrade)
            r->st.req_upgraded++;
        else if (!is_signed && !zz_is_primary(r))
            r->st.req_timer_exempt++;
        /* A backup relays a request it hears of first to the primary (PBFT), and the
         * signed copy too. Only a signed request can make a backup suspect the primary
         * (zz_has_pending): every replica, the primary included, can check a signature,
         * so a client that breaks the primary's MAC entry cannot force a view change. */
        if (!zz_is_primary(r) && !relayed && !zz_byz_silent(r))
            zz_net_send_peer(r->net, zz_primary(r, r->view), m->raw, m->raw_len);
    } else if (t < c->pend_t) {
        r->st.requests_dup++;
        return;
    } else if (is_signed && !zz_is_primary(r) && !relayed &&
               !zz_byz_silent(r)) {
        /* The client retransmits its signed request: it is still waiting, so relay it
         * again (the primary may have missed the first relay, e.g. one that came before
         * anything marked our link to it as a peer's, when only the signature counts). */
        zz_net_send_peer(r->net, zz_primary(r, r->view), m->raw, m->raw_len);
    }
    if (zz_is_primary(r) && !r->in_vc && c->proposed_t < c->pend_t) {
        enqueue(r, (uint32_t)ci);
        zz_try_propose(r);
    }
}

int zz_has_pending(const zz_replica *r, uint64_t older_than_ms, int signed_only)
{
    for (uint32_t i = 0; i < r->conf->nkeys; i++) {
        const zz_client *c = &r->clients[i];
        /* The view-change timer counts signed requests only: whether an unsigned one is
         * authentic depends on whose MAC entry is checked, so a backup could be waiting
         * for one the primary rightly dropped. A correct client signs its retransmission,
         * which then counts. (Asking peers to retransmit, status.c, counts any.) */
        if (c->pend_raw && (c->pend_signed || !signed_only) && c->pend_t > c->last_t &&
            c->pend_since_ms <= older_than_ms)
            return 1;
    }
    return 0;
}

void zz_requeue_pending(zz_replica *r)
{
    r->q_head = 0;
    r->q_len = 0;
    for (uint32_t i = 0; i < r->conf->nkeys; i++) {
        zz_client *c = &r->clients[i];
        c->queued = 0;
        c->proposed_t = 0;
        /* A view change restarts every request's timer: the new primary gets a full
         * period before it is suspected in turn. */
        c->pend_since_ms = zz_now_ms(r);
    }
    if (!zz_is_primary(r))
        return;
    for (uint32_t i = 0; i < r->conf->nkeys; i++) {
        zz_client *c = &r->clients[i];
        if (c->pend_raw && c->pend_t > c->last_t)
            enqueue(r, i);
    }
    zz_try_propose(r);
}

/* Build the batch encoding of up to batch_max queued requests, at most batch_bytes bytes,
 * into b. A request that does not fit stays queued for the next batch. Returns the count. */
static uint32_t build_batch(zz_replica *r, zz_buf *b, uint64_t nd_time, uint64_t nd_seed)
{
    zz_buf_reset(b);
    zz_put_u64(b, nd_time);
    zz_put_u64(b, nd_seed);
    size_t count_at = b->len;
    zz_put_u32(b, 0);
    uint32_t count = 0;
    uint32_t cap = r->conf->nkeys;
    while (r->q_len > 0 && count < r->conf->batch_max) {
        uint32_t ci = r->queue[r->q_head];
        zz_client *c = &r->clients[ci];
        /* With require_signed, or for a client marked must-sign (normal.c), an unsigned
         * request waits for its signed copy (on_request queues it again when it comes). */
        int live = c->pend_raw && c->pend_t > c->last_t && c->pend_t > c->proposed_t;
        if (live && !c->pend_signed &&
            (r->conf->require_signed || zz_now_ms(r) < c->must_sign_until_ms)) {
            r->st.unsigned_deferred++;
            live = 0;
        }
        if (live && (uint64_t)b->len + 4 + c->pend_len > r->conf->batch_bytes && count > 0)
            break; /* next batch */
        r->q_head = (r->q_head + 1) % cap;
        r->q_len--;
        c->queued = 0;
        if (!live)
            continue;
        if ((uint64_t)b->len + 4 + c->pend_len > r->conf->batch_bytes) {
            /* Cannot happen with intake's limit; never build a batch that cannot be sent. */
            r->st.requests_too_large++;
            c->proposed_t = c->pend_t;
            continue;
        }
        zz_put_bytes(b, c->pend_raw, c->pend_len);
        c->proposed_t = c->pend_t;
        count++;
    }
    if (!b->oom && b->len >= count_at + 4) {
        b->p[count_at] = (uint8_t)(count >> 24);
        b->p[count_at + 1] = (uint8_t)(count >> 16);
        b->p[count_at + 2] = (uint8_t)(count >> 8);
        b->p[count_at + 3] = (uint8_t)count;
    }
    return count;
}

static void send_pp(zz_replica *r, int only, uint32_t to, uint64_t seq, const uint8_t *batch,
                    uint32_t len)
{
    zz_buf *b = &r->out;
    zz_buf_reset(b);
    size_t st = zz_enc_pre_prepare(b, r->conf->service, r->id, r->view, seq, batch, len);
    zz_end_body(b, st);
    if (only)
        zz_send_mac(r, to, b, st);
    else
        zz_bcast_mac(r, b, st);
}

void zz_send_pre_prepare_to(zz_replica *r, uint32_t to, uint64_t seq, const uint8_t *batch,
                            uint32_t len)
{
    send_pp(r, 1, to, seq, batch, len);
}

static void propose_loop(zz_replica *r);

/* Batching against execution. With external execution the agreement replicas commit a
 * request long before the execution replicas have run it, so with a few clients each
 * request went out alone (one batch per request: every per-batch message, EXEC-COMMIT and
 * EXEC-REPORT, was paid per request). The primary holds a proposal while `exec_inflight`
 * batches or more wait above the highest seq that f+1 awake execution replicas have
 * reported (what a client needs for its reply certificate): requests arriving meanwhile go
 * out together once the reports come. Reports only release holds: replicas reporting early
 * or falsely merely bring back proposing at once.
 *
 * A hold lasts twice the recent latency from dispatch to those f+1 reports (exec_lat_ms),
 * at least exec_hold_ms and at most exec_hold_max_ms (half the view-change timer unless
 * set), so execution replicas that are asleep, stopped or silent (a fault round) delay
 * ordering by that much per batch at worst. A fixed 40 ms hold let ordering run ahead of
 * execution replicas that take longer per batch (TCG guests: 0.3-1.5 s): every hold
 * expired, each request went out alone, each execution replica queued several batches, and
 * its report of the last came that many batches late. The detection timer runs from the
 * first report of a seq, so a correct replica merely a little slower per batch was late by
 * the sum over its queue, and convicted (docs/fault-detection.md §6: a report timer bounds
 * a correct replica's lateness only while what it has queued is bounded). */
static void on_pace_timer(void *ctx)
{
    zz_replica *r = ctx;
    r->pace_timer = 0;
    r->pace_expired = 1;
    r->st.exec_pace_expired++;
    zz_try_propose(r);
}

uint64_t zz_exec_hold_ms(const zz_replica *r)
{
    uint64_t lo = r->conf->exec_hold_ms;
    uint64_t hi = r->conf->exec_hold_max_ms ? r->conf->exec_hold_max_ms
                                             : r->conf->view_timeout_ms / 2;
    uint64_t h = 2 * r->exec_lat_ms;
    if (h > hi)
        h = hi;
    return h < lo ? lo : h;
}

static int paced(zz_replica *r)
{
    if (!r->conf->exec_inflight || !r->zz.reports || r->pace_expired ||
        r->next_seq < r->exec_done + r->conf->exec_inflight)
        return 0;
    r->st.exec_paced++;
    if (!r->pace_timer)
        r->pace_timer = zz_net_timer(r->net, zz_exec_hold_ms(r), on_pace_timer, r);
    return 1;
}

void zz_exec_reported(zz_replica *r, uint64_t seq, uint64_t lat_ms)
{
    if (seq <= r->exec_done)
        return;
    r->exec_done = seq;
    /* Up at once, down by an eighth per report: one slow batch lengthens the next holds, a
     * run of fast ones shortens them again. */
    if (lat_ms >= r->exec_lat_ms)
        r->exec_lat_ms = lat_ms;
    else
        r->exec_lat_ms -= (r->exec_lat_ms - lat_ms + 7) / 8;
    if (r->q_len > 0)
        zz_try_propose(r);
}

void zz_try_propose(zz_replica *r)
{
    /* Accepting a proposal can execute, and execution calls back here: one loop at a time. */
    if (r->proposing || !zz_is_primary(r) || r->in_vc ||
        zz_byz_drops_requests(r))
        return;
    r->proposing = 1;
    propose_loop(r);
    r->proposing = 0;
}

static void propose_loop(zz_replica *r)
{
    /* Adaptive batching: propose at once while few instances are in flight; requests
     * arriving meanwhile accumulate and go out together when one completes. */
    while (r->q_len > 0 && r->next_seq - r->last_exec < r->conf->max_inflight &&
           r->next_seq + 1 <= r->stable + r->L && !zz_wal_abstains(r, r->next_seq + 1) &&
           !zz_wal_forgets(r, r->view, r->next_seq + 1) && !paced(r)) {
        uint64_t now = zz_wall_ms();
        uint64_t nd_time = now > r->last_nd_time ? now : r->last_nd_time;
        uint64_t seed = zz_rand(r);
        uint32_t count = build_batch(r, &r->out2, nd_time, seed);
        if (count == 0 || r->out2.oom)
            return;
        uint64_t seq = ++r->next_seq;
        zz_slot *s = zz_slot_get(r, seq);
        if (!s)
            return;
        uint8_t d[ZZ_DIGEST_LEN];
        zz_sha256(r->out2.p, r->out2.len, d);
        r->st.batches_proposed++;
        r->pace_expired = 0; /* an expired hold releases one proposal */
        if (r->pace_timer) {
            zz_net_cancel(r->net, r->pace_timer);
            r->pace_timer = 0;
        }
        /* Accepted (and logged, wal.c) before the PRE-PREPARE is sent: a restarted primary
         * must not propose another batch for this seq in this view (after a host restart
         * it proposes none in it, zz_wal_forgets). Accepting reuses the encoder buffers, so
         * the batch is sent from a copy. */
        zz_buf batch;
        zz_buf_init(&batch);
        zz_put_raw(&batch, r->out2.p, r->out2.len);
        if (batch.oom) {
            zz_buf_free(&batch);
            return;
        }
        zz_accept_proposal(r, s, r->view, d, batch.p, (uint32_t)batch.len);
        if (!zz_byz_pre_prepare(r, seq, &batch, seed, zz_send_pre_prepare_to)) {
            zz_net_early(r->net, zz_wal_early(r)); /* before the turn's sync, if it may */
            send_pp(r, 0, 0, seq, batch.p, (uint32_t)batch.len);
            zz_net_early(r->net, 0);
        }
        zz_buf_free(&batch);
        /* Our own PRE-PREPARE is relayed on retransmission. */
        if (s->seq == seq && !s->pp_raw && !r->out.oom) {
            s->pp_raw = zz_memdup(r->out.p, r->out.len);
            s->pp_raw_len = s->pp_raw ? (uint32_t)r->out.len : 0;
        }
    }
}
