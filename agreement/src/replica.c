/* replica.c - zz-agreed's replica: set-up, message intake (decode, authenticate, dispatch)
 * and the send helpers every protocol step uses. Nothing reaches a step unauthenticated. */
#include "replica.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <time.h>

#include "byz.h"

uint8_t *zz_memdup(const void *p, size_t n)
{
    uint8_t *q = malloc(n ? n : 1);
    if (q && n)
        memcpy(q, p, n);
    return q;
}

uint64_t zz_wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* The kernel's struct sched_attr (its first version, 48 bytes): glibc has no wrapper. */
struct zz_sched_attr {
    uint32_t size, policy;
    uint64_t flags;
    int32_t nice;
    uint32_t priority;
    uint64_t runtime, deadline, period;
};

void zz_sched_slice(uint32_t us)
{
    struct zz_sched_attr a;
    memset(&a, 0, sizeof a);
    if (us == 0 || syscall(SYS_sched_getattr, 0, &a, (unsigned)sizeof a, 0) != 0)
        return;
    if (a.policy != 0) /* SCHED_OTHER only: other policies' runtime means something else */
        return;
    a.size = sizeof a;
    a.flags = 0;
    a.runtime = (uint64_t)us * 1000u;
    (void)syscall(SYS_sched_setattr, 0, &a, 0);
}

uint64_t zz_mono_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

uint64_t zz_now_ms(const zz_replica *r) { return zz_net_now_ms(r->net); }

uint64_t zz_rand(zz_replica *r)
{
    /* xorshift64*: only for nd_seed proposals and backoff jitter, not for keys */
    uint64_t x = r->rng;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    r->rng = x;
    return x * 0x2545F4914F6CDD1DULL;
}

uint32_t zz_primary(const zz_replica *r, uint32_t view) { return view % r->n; }
int zz_is_primary(const zz_replica *r) { return zz_primary(r, r->view) == r->id; }

int zz_in_window(const zz_replica *r, uint64_t seq)
{
    return seq > r->stable && seq <= r->stable + r->L;
}

int zz_seq_window(uint64_t low, uint64_t width, uint64_t seq)
{
    if (seq <= low)
        return -1;
    return seq - low > width ? 1 : 0;
}

void zz_count_window(zz_replica *r, int peer, uint32_t sender)
{
    r->st.dropped[ZZ_DROP_WINDOW]++;
    if (peer && sender < ZZ_MAX_REPLICAS)
        r->st.peer_window[sender]++;
    else if (!peer && sender < ZZ_MAX_EXEC)
        r->st.exec_window[sender]++;
}

zz_slot *zz_slot_get(zz_replica *r, uint64_t seq)
{
    if (!zz_in_window(r, seq))
        return NULL;
    zz_slot *s = &r->slots[seq % r->L];
    if (s->seq != seq)
        zz_slot_reset(r, s, seq);
    return s;
}

const zz_mackey *zz_mac_for(const zz_replica *r, uint32_t principal)
{
    const zz_peer_key *k = zz_conf_key(r->conf, principal);
    return k ? k->mac : NULL;
}

const zz_pubkey *zz_pub_for(const zz_replica *r, uint32_t principal)
{
    const zz_peer_key *k = zz_conf_key(r->conf, principal);
    return k ? k->pub : NULL;
}

int zz_client_index(const zz_replica *r, uint32_t principal)
{
    if (principal < ZZ_PRINCIPAL_CLIENT || principal >= ZZ_PRINCIPAL_HOST)
        return -1;
    const zz_peer_key *k = zz_conf_key(r->conf, principal);
    if (!k || !k->mac)
        return -1;
    return (int)(k - r->conf->keys);
}

static void *xcalloc(size_t n, size_t sz, int *fail)
{
    void *p = calloc(n ? n : 1, sz);
    if (!p)
        *fail = 1;
    return p;
}

int zz_replica_init(zz_replica *r, zz_conf *c, char *err, size_t errcap)
{
    memset(r, 0, sizeof *r);
    r->wal.fd[0] = r->wal.fd[1] = -1;
    r->conf = c;
    r->n = 3 * c->g + 1;
    r->g = c->g;
    r->id = c->id;
    r->L = c->log_window;
    int fail = 0;
    r->slots = xcalloc(r->L, sizeof(zz_slot), &fail);
    for (uint32_t i = 0; i < r->L && !fail; i++) {
        zz_slot *s = &r->slots[i];
        s->prep_view = xcalloc(r->n, sizeof(uint32_t), &fail);
        s->commit_view = xcalloc(r->n, sizeof(uint32_t), &fail);
        s->prep_dig = xcalloc(r->n, ZZ_DIGEST_LEN, &fail);
        s->commit_dig = xcalloc(r->n, ZZ_DIGEST_LEN, &fail);
    }
    r->n_ckpts = r->L / c->checkpoint_interval + 1; /* conf: L is a multiple of CP */
    r->ckpts = xcalloc(r->n_ckpts, sizeof(zz_ckpt), &fail);
    for (uint32_t i = 0; i < r->n_ckpts && !fail; i++) {
        r->ckpts[i].dig = xcalloc(r->n, ZZ_DIGEST_LEN, &fail);
        r->ckpts[i].raw = xcalloc(r->n, sizeof(uint8_t *), &fail);
        r->ckpts[i].raw_len = xcalloc(r->n, sizeof(uint32_t), &fail);
    }
    r->held_seq = xcalloc(r->n, sizeof(uint64_t), &fail);
    r->held_dig = xcalloc(r->n, ZZ_DIGEST_LEN, &fail);
    r->held_raw = xcalloc(r->n, sizeof(uint8_t *), &fail);
    r->held_len = xcalloc(r->n, sizeof(uint32_t), &fail);
    r->vc_raw = xcalloc(r->n, sizeof(uint8_t *), &fail);
    r->vc_len = xcalloc(r->n, sizeof(uint32_t), &fail);
    r->vc_view = xcalloc(r->n, sizeof(uint32_t), &fail);
    r->stable_proof = xcalloc(r->n, sizeof(uint8_t *), &fail);
    r->stable_proof_len = xcalloc(r->n, sizeof(uint32_t), &fail);
    r->clients = xcalloc(c->nkeys, sizeof(zz_client), &fail);
    r->queue = xcalloc(c->nkeys, sizeof(uint32_t), &fail);
    if (fail) {
        snprintf(err, errcap, "out of memory allocating the replica (L=%u n=%u)", r->L, r->n);
        return -1;
    }
    for (uint32_t i = 0; i < r->L; i++)
        r->slots[i].seq = 0;
    if (getrandom(&r->rng, sizeof r->rng, 0) != sizeof r->rng || r->rng == 0)
        r->rng = 0x9E3779B97F4A7C15ULL ^ (uint64_t)c->id;
    zz_buf_init(&r->out);
    zz_buf_init(&r->out2);
    zz_buf_init(&r->rbuf);
    r->net = zz_net_new(c, r, zz_replica_on_frame, zz_replica_on_close, err, errcap);
    if (!r->net)
        return -1;
    if (zz_exec_init(r, err, errcap) != 0)
        return -1;
    /* Durable state: replayed before the loop runs; from here on no byte is sent before
     * the records it depends on are written (and synced, durability fsync). */
    if (zz_wal_recover(r, err, errcap) != 0)
        return -1;
    if (r->wal.enabled)
        zz_net_set_barrier(r->net, zz_wal_sync, r);
    r->last_progress_ms = zz_now_ms(r);
    return 0;
}

void zz_replica_free(zz_replica *r)
{
    for (uint32_t i = 0; r->slots && i < r->L; i++) {
        zz_slot *s = &r->slots[i];
        free(s->batch);
        free(s->pp_raw);
        free(s->prep_view);
        free(s->commit_view);
        free(s->prep_dig);
        free(s->commit_dig);
    }
    free(r->slots);
    zz_free_ckpts(r);
    for (uint32_t i = 0; r->ckpts && i < r->n_ckpts; i++) {
        free(r->ckpts[i].dig);
        free(r->ckpts[i].raw);
        free(r->ckpts[i].raw_len);
    }
    free(r->ckpts);
    for (uint32_t i = 0; r->held_raw && i < r->n; i++)
        free(r->held_raw[i]);
    free(r->held_raw);
    free(r->held_seq);
    free(r->held_dig);
    free(r->held_len);
    for (uint32_t i = 0; r->vc_raw && i < r->n; i++)
        free(r->vc_raw[i]);
    for (uint32_t i = 0; r->stable_proof && i < r->n; i++)
        free(r->stable_proof[i]);
    free(r->vc_raw);
    free(r->vc_len);
    free(r->vc_view);
    free(r->nv_raw);
    free(r->stable_proof);
    free(r->stable_proof_len);
    for (uint32_t i = 0; r->clients && i < r->conf->nkeys; i++) {
        free(r->clients[i].result);
        free(r->clients[i].pend_raw);
    }
    free(r->clients);
    free(r->queue);
    zz_exec_free(r);
    zz_wal_free(r);
    zz_buf_free(&r->out);
    zz_buf_free(&r->out2);
    zz_buf_free(&r->rbuf);
    if (r->net)
        zz_net_free(r->net);
}

void zz_replica_on_close(void *ctx, zz_conn *conn)
{
    zz_replica *r = ctx;
    for (uint32_t i = 0; i < r->conf->nkeys; i++)
        if (r->clients[i].conn == conn)
            r->clients[i].conn = NULL;
    zz_exec_on_close(r, conn);
}

/* ---- sending ---- */

void zz_bcast_mac(zz_replica *r, zz_buf *b, size_t start)
{
    uint32_t recv[ZZ_MAX_REPLICAS];
    zz_mackey *keys[ZZ_MAX_REPLICAS];
    uint16_t k = 0;
    for (uint32_t i = 0; i < r->n; i++) {
        if (i == r->id)
            continue;
        const zz_mackey *mk = zz_mac_for(r, i);
        if (!mk)
            continue;
        recv[k] = i;
        keys[k++] = (zz_mackey *)mk;
    }
    zz_auth_mac(b, start, recv, keys, k);
    if (b->oom || zz_byz_silent(r))
        return;
    zz_net_bcast(r->net, b->p + start, b->len - start);
}

void zz_send_mac(zz_replica *r, uint32_t to, zz_buf *b, size_t start)
{
    const zz_mackey *mk = zz_mac_for(r, to);
    if (!mk)
        return;
    zz_mackey *k = (zz_mackey *)mk;
    zz_auth_mac(b, start, &to, &k, 1);
    if (b->oom || zz_byz_silent(r))
        return;
    zz_net_send_peer(r->net, to, b->p + start, b->len - start);
}

void zz_bcast_signed(zz_replica *r, zz_buf *b, size_t start)
{
    if (zz_auth_sign(b, start, r->conf->sign) != 0 || b->oom)
        return;
    if (zz_byz_silent(r))
        return;
    zz_net_bcast(r->net, b->p + start, b->len - start);
}

/* ---- intake ---- */

static void drop(zz_replica *r, int why) { r->st.dropped[why]++; }

/* A client's REQUEST. Unsigned (auth kind 1): our MAC entry. Signed (kind 3): the
 * signature decides, as it does for every replica (docs/agreement.md "Signed requests");
 * from the client itself our MAC entry is checked first, so that only a client holding its
 * keys makes us verify a signature. A copy relayed by a peer replica (whose MAC entry for
 * us may be what the client broke) is judged by the signature alone. */
static int authenticate_request(zz_replica *r, const zz_msg *m, int relayed)
{
    int ci = zz_client_index(r, m->sender);
    if (ci < 0)
        return ZZ_DROP_SENDER;
    if (m->auth_kind == ZZ_AUTH_MAC_SIG) {
        zz_client *c = &r->clients[ci];
        if (!relayed) {
            if (!zz_verify_mac(m, r->id, zz_mac_for(r, m->sender))) {
                r->st.req_bad_mac++;
                return ZZ_DROP_AUTH;
            }
            /* A client that MACed a wrong signature is faulty (only it and we hold the
             * MAC key): its signed requests cost us a MAC check only, for a while
             * (Aardvark blacklists such clients). Its unsigned ones are still taken. */
            if (zz_now_ms(r) < c->sig_banned_until_ms) {
                r->st.req_sig_banned++;
                return ZZ_DROP_AUTH;
            }
        }
        if (!zz_verify_sig(m, zz_pub_for(r, m->sender))) {
            r->st.req_bad_sig++;
            if (!relayed)
                c->sig_banned_until_ms = zz_now_ms(r) + ZZ_SIG_BAN_MS;
            return ZZ_DROP_AUTH;
        }
        r->st.req_signed_in++;
        return 0;
    }
    if (!zz_verify_mac(m, r->id, zz_mac_for(r, m->sender))) {
        r->st.req_bad_mac++;
        return ZZ_DROP_AUTH;
    }
    return 0;
}

/* ---- the intake table ----
 * Which principals may send each type to an agreement replica, and the protocol step that
 * takes it. The authenticator is checked by the kind the wire table gives the type
 * (zz_msgdefs: our MAC entry, or the sender's signature), except for the two rows marked. A
 * type without a row (REPLY, CONTROL, FILE-FETCH, ...) is not for a replica. */
enum intake_from {
    FROM_NOBODY = 0,
    FROM_CLIENT,       /* REQUEST: authenticate_request decides, signed or not */
    FROM_PEER,         /* another agreement replica */
    FROM_REPLICA,      /* any agreement replica, our own signed messages relayed back too */
    FROM_PEER_OR_EXEC, /* agreement peers fetch batches and state, execution replicas the log */
    FROM_EXEC,         /* an execution replica */
    FROM_HOST,         /* a controld: SPARE-READY, whose step checks host and signature itself,
                        * to count and log why it rejects one */
};

typedef void intake_step(zz_replica *r, zz_conn *conn, const zz_msg *m);

/* The steps that do not need the connection, under the table's one signature. */
#define STEP(fn)                                                                                 \
    static void fn##_step(zz_replica *r, zz_conn *conn, const zz_msg *m)                         \
    {                                                                                            \
        (void)conn;                                                                              \
        fn(r, m);                                                                                \
    }
STEP(zz_on_pre_prepare)
STEP(zz_on_phase)
STEP(zz_on_checkpoint)
STEP(zz_on_view_change)
STEP(zz_on_new_view)
STEP(zz_on_fetch_reply)
STEP(zz_on_status)
STEP(zz_on_exec_message)
STEP(zz_on_fault_statement)
STEP(zz_on_wakeup)
STEP(zz_on_shutdown)
STEP(zz_on_spare_ready)
#undef STEP

static const struct {
    uint8_t from; /* enum intake_from */
    intake_step *step;
} intake[ZZ_TYPE_MAX + 1] = {
    [ZZ_REQUEST] = {FROM_CLIENT, zz_on_request},
    [ZZ_PRE_PREPARE] = {FROM_PEER, zz_on_pre_prepare_step},
    [ZZ_PREPARE] = {FROM_PEER, zz_on_phase_step},
    [ZZ_COMMIT] = {FROM_PEER, zz_on_phase_step},
    [ZZ_CHECKPOINT] = {FROM_REPLICA, zz_on_checkpoint_step},
    [ZZ_VIEW_CHANGE] = {FROM_REPLICA, zz_on_view_change_step},
    [ZZ_NEW_VIEW] = {FROM_REPLICA, zz_on_new_view_step},
    [ZZ_FETCH] = {FROM_PEER_OR_EXEC, zz_on_fetch},
    [ZZ_FETCH_REPLY] = {FROM_PEER, zz_on_fetch_reply_step},
    [ZZ_STATUS] = {FROM_PEER, zz_on_status_step},
    [ZZ_EXEC_REPORT] = {FROM_EXEC, zz_on_exec_message_step},
    [ZZ_EXEC_CHECKPOINT] = {FROM_EXEC, zz_on_exec_message_step},
    [ZZ_FAULT_STATEMENT] = {FROM_REPLICA, zz_on_fault_statement_step},
    [ZZ_WAKEUP] = {FROM_REPLICA, zz_on_wakeup_step},
    [ZZ_SHUTDOWN] = {FROM_REPLICA, zz_on_shutdown_step},
    [ZZ_SPARE_READY] = {FROM_HOST, zz_on_spare_ready_step},
};

static int sender_fits(const zz_replica *r, uint8_t from, uint32_t sender)
{
    int replica = sender < r->n;
    int exec = sender >= ZZ_PRINCIPAL_EXEC && sender < ZZ_PRINCIPAL_CLIENT; /* any index */
    switch (from) {
    case FROM_PEER: return replica && sender != r->id;
    case FROM_REPLICA: return replica;
    case FROM_PEER_OR_EXEC: return (replica || exec) && sender != r->id;
    case FROM_EXEC: return exec && sender < ZZ_PRINCIPAL_EXEC + ZZ_MAX_EXEC;
    case FROM_HOST: return sender >= ZZ_PRINCIPAL_HOST && sender < ZZ_PRINCIPAL_HOST + ZZ_MAX_HOSTS;
    default: return 0;
    }
}

/* 0 if m may go to its step, else the drop counter: a type not for a replica, a sender the
 * table does not admit, or an authenticator that does not verify. */
static int authenticate(zz_replica *r, const zz_msg *m, int relayed)
{
    uint8_t from = m->type <= ZZ_TYPE_MAX ? intake[m->type].from : FROM_NOBODY;
    if (from == FROM_NOBODY)
        return ZZ_DROP_TYPE;
    if (from == FROM_CLIENT)
        return authenticate_request(r, m, relayed);
    if (!sender_fits(r, from, m->sender))
        return ZZ_DROP_SENDER;
    if (from == FROM_HOST)
        return 0;
    if (m->auth_kind == ZZ_AUTH_MAC) {
        const zz_mackey *k = zz_mac_for(r, m->sender);
        return k && zz_verify_mac(m, r->id, k) ? 0 : ZZ_DROP_AUTH;
    }
    const zz_pubkey *pk = zz_pub_for(r, m->sender);
    return pk && zz_verify_sig(m, pk) ? 0 : ZZ_DROP_AUTH;
}

/* Per peer, malformed: a connection is charged to the principal whose own messages it
 * carries, named by the first authenticated message of a type only its sender sends and
 * nobody relays: STATUS from an agreement peer (sent by zz_status_tick, never stored or
 * forwarded), EXEC-REPORT or FETCH from an execution replica. Pre-prepares, view changes,
 * checkpoints and requests are relayed by others and name nobody. */
static void attribute_conn(zz_replica *r, zz_conn *conn, const zz_msg *m)
{
    if (!conn || zz_net_conn_sender(conn))
        return;
    if (m->type == ZZ_STATUS && m->sender < r->n && m->sender < ZZ_MAX_REPLICAS &&
        m->sender != r->id)
        zz_net_conn_set_sender(conn, m->sender + 1);
    else if ((m->type == ZZ_EXEC_REPORT || m->type == ZZ_FETCH) &&
             m->sender >= ZZ_PRINCIPAL_EXEC && m->sender - ZZ_PRINCIPAL_EXEC < ZZ_MAX_EXEC)
        zz_net_conn_set_sender(conn, ZZ_MAX_REPLICAS + (m->sender - ZZ_PRINCIPAL_EXEC) + 1);
}

/* A message dropped at intake: counted by reason, and for the connection's peer if known. */
static void drop_from(zz_replica *r, zz_conn *conn, int why)
{
    drop(r, why);
    uint32_t slot = zz_net_conn_sender(conn);
    if (slot && slot <= ZZ_NET_SENDER_SLOTS)
        r->st.malformed_from[slot - 1]++;
}

void zz_replica_on_frame(void *ctx, zz_conn *conn, const uint8_t *buf, size_t len)
{
    zz_replica *r = ctx;
    zz_msg m;
    enum zz_err e = zz_decode(buf, len, &m);
    if (e != ZZ_OK) {
        drop_from(r, conn, (int)e);
        return;
    }
    if (m.service != r->conf->service) {
        drop_from(r, conn, ZZ_DROP_SENDER);
        return;
    }
    int why = authenticate(r, &m, conn && zz_net_conn_tag(conn) == ZZ_TAG_PEER);
    if (why) {
        if (why == ZZ_DROP_AUTH)
            zz_exec_auth_failed(r, &m); /* a replaced key: counted per slot (spares.c) */
        drop_from(r, conn, why);
        return;
    }
    attribute_conn(r, conn, &m);
    zz_net_conn_set_trusted(conn); /* authenticated: no unauth_timeout_ms (net.c) */
    if (m.type != ZZ_REQUEST && m.sender < r->n)
        zz_net_conn_set_tag(conn, ZZ_TAG_PEER);
    intake[m.type].step(r, conn, &m);
}

/* ---- periodic work ---- */

static void on_tick(void *ctx)
{
    zz_replica *r = ctx;
    zz_status_tick(r);
    zz_vc_tick(r);
    zz_net_timer(r->net, r->conf->status_interval_ms, on_tick, r);
}

static void on_stats(void *ctx)
{
    zz_replica *r = ctx;
    zz_wal_flush(r); /* records no send has pushed out yet: written at least once a second */
    zz_write_stats(r);
    zz_net_timer(r->net, 1000, on_stats, r);
}

void zz_replica_start_timers(zz_replica *r)
{
    zz_net_timer(r->net, r->conf->status_interval_ms, on_tick, r);
    /* A first stats file at once: readers take its existence as "SIGUSR1 is handled". */
    zz_write_stats(r);
    zz_net_timer(r->net, 1000, on_stats, r);
}

static const char *drop_names[ZZ_DROP_N] = {
    "", "short", "magic", "version", "type", "length", "auth", "field",
    "sender", "window", "view", "bad_preprepare", "bad_viewchange",
};

void zz_write_stats(zz_replica *r)
{
    if (!r->conf->stats_file[0])
        return;
    char tmp[300];
    snprintf(tmp, sizeof tmp, "%s.tmp", r->conf->stats_file);
    FILE *f = fopen(tmp, "w");
    if (!f)
        return;
    const zz_net_stats *ns = zz_net_get_stats(r->net);
    uint64_t total = 0;
    fprintf(f, "{\"id\": %u, \"view\": %u, \"in_view_change\": %d, \"last_exec\": %llu, "
               "\"stable_seq\": %llu, \"executed\": %llu, \"null_executed\": %llu, "
               "\"batches_executed\": %llu, \"batches_proposed\": %llu, "
               "\"requests_in\": %llu, \"requests_dup\": %llu, \"requests_readonly\": %llu, "
               "\"checkpoints\": %llu, \"stable_advances\": %llu, \"state_transfers\": %llu, "
               "\"view_changes\": %llu, \"new_views\": %llu, \"fetches_sent\": %llu, "
               "\"fetches_served\": %llu, \"retransmits\": %llu, \"stale\": %llu, "
               "\"exec_commits_sent\": %llu, \"exec_reports\": %llu, \"exec_checkpoints\": %llu, "
               "\"exec_stable\": %llu, \"exec_stable_advances\": %llu, \"exec_log_overflow\": %llu, "
               "\"exec_stable_held\": %llu, \"exec_stable_by_reports\": %llu, "
               "\"exec_reports_convicted\": %llu, "
               "\"exec_certificates\": %llu, \"exec_mismatches\": %llu, \"exec_timeouts\": %llu, "
               "\"app_digest\": \"",
            r->id, r->view, r->in_vc, (unsigned long long)r->last_exec,
            (unsigned long long)r->stable, (unsigned long long)r->st.executed,
            (unsigned long long)r->st.null_executed, (unsigned long long)r->st.batches_executed,
            (unsigned long long)r->st.batches_proposed, (unsigned long long)r->st.requests_in,
            (unsigned long long)r->st.requests_dup, (unsigned long long)r->st.requests_readonly,
            (unsigned long long)r->st.checkpoints, (unsigned long long)r->st.stable_advances,
            (unsigned long long)r->st.state_transfers, (unsigned long long)r->st.view_changes,
            (unsigned long long)r->st.new_views, (unsigned long long)r->st.fetches_sent,
            (unsigned long long)r->st.fetches_served, (unsigned long long)r->st.retransmits,
            (unsigned long long)r->st.stale, (unsigned long long)r->st.exec_commits_sent,
            (unsigned long long)r->st.exec_reports, (unsigned long long)r->st.exec_checkpoints,
            (unsigned long long)r->zz.exec_stable, (unsigned long long)r->st.exec_stable_advances,
            (unsigned long long)r->st.exec_log_overflow, (unsigned long long)r->st.exec_stable_held,
            (unsigned long long)r->st.exec_stable_by_reports,
            (unsigned long long)r->st.exec_reports_convicted,
            (unsigned long long)r->st.exec_certificates,
            (unsigned long long)r->st.exec_mismatches, (unsigned long long)r->st.exec_timeouts);
    for (int i = 0; i < ZZ_DIGEST_LEN; i++)
        fprintf(f, "%02x", r->app[i]);
    fprintf(f, "\", \"dropped\": {");
    for (int i = 1; i < ZZ_DROP_N; i++) {
        fprintf(f, "%s\"%s\": %llu", i > 1 ? ", " : "", drop_names[i],
                (unsigned long long)r->st.dropped[i]);
        total += r->st.dropped[i];
    }
    fprintf(f, ", \"framing\": %llu}, \"dropped_total\": %llu, ",
            (unsigned long long)ns->framing_errors,
            (unsigned long long)(total + ns->framing_errors));
    fprintf(f, "\"exec_reports_early\": %llu, \"ckpt_ahead_seq\": %llu, \"transfer_seq\": %llu, "
               "\"exec_done\": %llu, \"exec_paced\": %llu, \"exec_pace_expired\": %llu, "
               "\"exec_lat_ms\": %llu, \"exec_hold_ms\": %llu, \"exec_timers_deferred\": %llu, "
               "\"peer_window_drops\": [",
            (unsigned long long)r->st.exec_reports_early, (unsigned long long)r->ahead_seq,
            (unsigned long long)r->transfer_seq, (unsigned long long)r->exec_done,
            (unsigned long long)r->st.exec_paced, (unsigned long long)r->st.exec_pace_expired,
            (unsigned long long)r->exec_lat_ms, (unsigned long long)zz_exec_hold_ms(r),
            (unsigned long long)r->st.exec_timers_deferred);
    for (uint32_t i = 0; i < r->n && i < ZZ_MAX_REPLICAS; i++)
        fprintf(f, "%s%llu", i ? ", " : "", (unsigned long long)r->st.peer_window[i]);
    /* one entry per execution replica of the conf, or per slot seen without exec lines */
    uint32_t nx = r->conf->n_exec > r->zz.n_exec ? r->conf->n_exec : r->zz.n_exec;
    for (uint32_t i = nx; i < ZZ_MAX_EXEC; i++)
        if (r->st.exec_window[i])
            nx = i + 1;
    fprintf(f, "], \"exec_window_drops\": [");
    for (uint32_t i = 0; i < nx && i < ZZ_MAX_EXEC; i++)
        fprintf(f, "%s%llu", i ? ", " : "", (unsigned long long)r->st.exec_window[i]);
    /* malformed per peer (attribute_conn): intake drops + framing errors, same shapes */
    fprintf(f, "], \"peer_malformed_drops\": [");
    for (uint32_t i = 0; i < r->n && i < ZZ_MAX_REPLICAS; i++)
        fprintf(f, "%s%llu", i ? ", " : "",
                (unsigned long long)(r->st.malformed_from[i] + ns->framing_from[i]));
    fprintf(f, "], \"exec_malformed_drops\": [");
    for (uint32_t i = 0; i < nx && i < ZZ_MAX_EXEC; i++)
        fprintf(f, "%s%llu", i ? ", " : "",
                (unsigned long long)(r->st.malformed_from[ZZ_MAX_REPLICAS + i] +
                                     ns->framing_from[ZZ_MAX_REPLICAS + i]));
    fprintf(f, "], ");
    zz_signed_write_stats(r, f);
    zz_limits_write_stats(r, f);
    zz_wake_write_stats(r, f);
    zz_wal_stats(r, f);
    const zz_rstats *st = &r->st;
    fprintf(f, "\"phases\": {\"prepared\": %llu, \"pp_to_prepared_us\": %llu, "
               "\"committed\": %llu, \"prepared_to_committed_us\": %llu, \"executed\": %llu, "
               "\"committed_to_executed_us\": %llu}, ",
            (unsigned long long)st->ph_prep_n,
            (unsigned long long)(st->ph_prep_n ? st->ph_prep_us / st->ph_prep_n : 0),
            (unsigned long long)st->ph_commit_n,
            (unsigned long long)(st->ph_commit_n ? st->ph_commit_us / st->ph_commit_n : 0),
            (unsigned long long)st->ph_exec_n,
            (unsigned long long)(st->ph_exec_n ? st->ph_exec_us / st->ph_exec_n : 0));
    fprintf(f, "\"net\": {\"frames_in\": %llu, \"frames_out\": %llu, \"reconnects\": %llu, "
               "\"injected_drops\": %llu, \"injected_dups\": %llu, \"injected_delays\": %llu, "
               "\"send_overflow\": %llu, \"connect_failures\": %llu, "
               "\"accept_backoffs\": %llu, \"turns\": %llu, \"barriers\": %llu}}\n",
            (unsigned long long)ns->frames_in, (unsigned long long)ns->frames_out,
            (unsigned long long)ns->reconnects, (unsigned long long)ns->injected_drops,
            (unsigned long long)ns->injected_dups, (unsigned long long)ns->injected_delays,
            (unsigned long long)ns->send_overflow, (unsigned long long)ns->connect_failures,
            (unsigned long long)ns->accept_backoffs, (unsigned long long)ns->turns,
            (unsigned long long)ns->barriers);
    if (fclose(f) == 0)
        rename(tmp, r->conf->stats_file);
}
