/* fuzz_replica.c - libFuzzer target for a whole agreement replica (make fuzz-run).
 *
 * Each input builds a fresh replica (4 replicas, g = 1, CP 4, L 16; byte 0 picks which
 * replica it is and whether execution is external with 3 execution replicas and a
 * controld per host) and reads the rest as a sequence of events: a message of any type
 * from any principal, built with valid MACs and signatures of the test keys so it gets
 * past authentication into the handlers, with fields chosen near the replica's own state
 * (its view, watermarks, slot and checkpoint digests, stored VIEW-CHANGEs); connections
 * opened, closed, fed partial frames or garbage; the clock advanced and timers fired.
 * Messages arrive through the daemon's own framing code (net.c is compiled in below), on
 * in-memory connections without sockets, and everything the replica sends must decode.
 * The replica, its connections and its keys are freed after each input, so LeakSanitizer
 * sees any leak, and nothing carries over from one input to the next. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "choose.h"
#include "replica.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

/* ---- net.c with a fake clock and no sockets ----
 * The monotonic clock of net.c (timers, frame and unauthenticated-connection timeouts) is
 * the fuzzer's; zz_net_new is replaced below by one that opens nothing. Outgoing links
 * never connect: every frame stays queued until fz_drain checks it. */
static uint64_t fz_now = 1000000;

static int fz_clock_gettime(clockid_t id, struct timespec *ts)
{
    if (id != CLOCK_MONOTONIC)
        return clock_gettime(id, ts);
    ts->tv_sec = (time_t)(fz_now / 1000);
    ts->tv_nsec = (long)(fz_now % 1000) * 1000000L;
    return 0;
}

#define clock_gettime fz_clock_gettime
#define zz_net_new zz_net_new_sockets
#include "net.c"
#undef zz_net_new
#undef clock_gettime

static zz_on_close fz_replica_on_close;
#define FZ_CONNS 6
static zz_conn *fz_conn[FZ_CONNS];

static void fz_on_close(void *ctx, zz_conn *c)
{
    fz_replica_on_close(ctx, c);
    for (int i = 0; i < FZ_CONNS; i++)
        if (fz_conn[i] == c)
            fz_conn[i] = NULL;
}

/* The daemon's own constructor (so whatever it sets up, the fuzzer has too), listening on
 * an ephemeral port that is closed at once; outgoing links are left connecting forever. */
zz_net *zz_net_new(const zz_conf *c, void *ctx, zz_on_frame on_frame, zz_on_close on_close,
                   char *err, size_t errcap)
{
    fz_replica_on_close = on_close;
    zz_net *n = zz_net_new_sockets(c, ctx, on_frame, fz_on_close, err, errcap);
    if (!n)
        return NULL;
    close(n->listener.fd);
    close(n->wake.fd);
    close(n->ep);
    n->listener.fd = n->wake.fd = n->ep = -1;
    n->listener.events = n->wake.events = 0;
    for (uint32_t p = 0; p < MAX_LINKS; p++)
        n->links[p].state = L_CONNECTING; /* never L_DOWN: link_connect opens nothing */
    return n;
}

/* An accepted connection as accept_all makes it, without a descriptor. */
static zz_conn *fz_open(zz_net *n, int slot)
{
    zz_conn *c = calloc(1, sizeof *c);
    if (!c)
        abort();
    c->kind = C_ACCEPTED;
    c->net = n;
    c->fd = -1;
    c->since_ms = zz_net_now_ms(n);
    c->src[0] = 127;
    c->src[15] = (uint8_t)slot;
    c->next = n->accepted;
    if (n->accepted)
        n->accepted->prev = c;
    n->accepted = c;
    n->n_accepted++;
    n->st.conns_open = n->n_accepted;
    n->st.conns_accepted++;
    fz_conn[slot] = c;
    return c;
}

/* Bytes arriving on a connection, as conn_readable handles one recv. */
static void fz_input(zz_net *n, int slot, const uint8_t *p, size_t len)
{
    zz_conn *c = fz_conn[slot] ? fz_conn[slot] : fz_open(n, slot);
    if (c->dead || len == 0)
        return;
    /* A copy that dies right after: a handler keeping a pointer into the frame is caught. */
    uint8_t *copy = malloc(len);
    if (!copy)
        abort();
    memcpy(copy, p, len);
    int delivered = 0;
    n->st.bytes_in += len;
    if (conn_input(n, c, copy, len, &delivered) < 0)
        mark_dead(n, c);
    free(copy);
    if (!c->dead) {
        if (c->in_len == 0)
            c->frame_since_ms = 0;
        else if (delivered > 0 || c->frame_since_ms == 0)
            c->frame_since_ms = zz_net_now_ms(n);
    }
    settle(n);
}

/* Everything queued for sending must be a well-formed message; then the wire takes it. */
static void fz_drain_conn(zz_conn *c)
{
    size_t p = c->out_off;
    while (p + 4 <= c->out_len) {
        uint32_t len = get_be32(c->out + p);
        if (p + 4 + len > c->out_len)
            break;
        zz_msg m;
        enum zz_err e = zz_decode(c->out + p + 4, len, &m);
        if (e != ZZ_OK) {
            fprintf(stderr, "the replica sent a message that does not decode: %s (%u bytes)\n",
                    zz_err_name(e), len);
            abort();
        }
        p += 4 + (size_t)len;
    }
    if (p != c->out_len) {
        fprintf(stderr, "an output queue ends in a partial frame\n");
        abort();
    }
    c->out_off = c->out_len = c->out_head = 0;
}

static void fz_drain(zz_net *n)
{
    for (zz_conn *c = n->accepted; c; c = c->next)
        fz_drain_conn(c);
    for (uint32_t p = 0; p < n->n_links; p++)
        fz_drain_conn(&n->links[p]);
}

/* ---- principals and keys ----
 * Index: replicas 0..3, execution replicas 4..6 (principal 256 + i), clients 7..10
 * (65536 + i), controlds of hosts 11..14 (HOST + h). Every key derives from its index. */
#define FZ_N 4
#define FZ_EXEC 3
#define FZ_CLIENTS 4
#define FZ_HOSTS 4
#define FZ_NPRIN (FZ_N + FZ_EXEC + FZ_CLIENTS + FZ_HOSTS)
#define FZ_SVC 7
#define FZ_CP 4
#define FZ_L 16

static uint32_t fz_principal(int idx)
{
    if (idx < FZ_N)
        return (uint32_t)idx;
    if (idx < FZ_N + FZ_EXEC)
        return ZZ_PRINCIPAL_EXEC + (uint32_t)(idx - FZ_N);
    if (idx < FZ_N + FZ_EXEC + FZ_CLIENTS)
        return ZZ_PRINCIPAL_CLIENT + (uint32_t)(idx - FZ_N - FZ_EXEC);
    return ZZ_PRINCIPAL_HOST + (uint32_t)(idx - FZ_N - FZ_EXEC - FZ_CLIENTS);
}

static zz_signkey *fz_sk[FZ_NPRIN];
static uint8_t fz_pub[FZ_NPRIN][32];
static zz_mackey *fz_mk[FZ_NPRIN][FZ_N]; /* pairwise key of principal idx and replica j */

static void fz_seed(const char *what, uint32_t a, uint32_t b, uint8_t out[32])
{
    char s[64];
    int n = snprintf(s, sizeof s, "zz-fuzz %s %u %u", what, a, b);
    zz_sha256(s, (size_t)n, out);
}

static void fz_mac_seed(int idx, uint32_t replica, uint8_t out[32])
{
    uint32_t a = fz_principal(idx), b = replica;
    fz_seed("mac", a < b ? a : b, a < b ? b : a, out);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    for (int i = 0; i < FZ_NPRIN; i++) {
        uint8_t seed[32];
        fz_seed("sign", fz_principal(i), 0, seed);
        fz_sk[i] = zz_signkey_new(seed);
        if (!fz_sk[i])
            abort();
        zz_signkey_public(fz_sk[i], fz_pub[i]);
        for (uint32_t j = 0; j < FZ_N; j++) {
            fz_mac_seed(i, j, seed);
            fz_mk[i][j] = zz_mackey_new(seed);
            if (!fz_mk[i][j])
                abort();
        }
    }
    return 0;
}

/* The replica's configuration, with keys of its own (freed by zz_conf_free: the replica
 * replaces an execution replica's keys when a SPARE-READY announces new ones). */
static zz_conf fz_conf;

static void fz_conf_build(zz_conf *c, uint32_t id, int external)
{
    memset(c, 0, sizeof *c);
    c->service = FZ_SVC;
    c->id = id;
    c->g = 1;
    c->n = FZ_N;
    for (uint32_t p = 0; p < FZ_N; p++) {
        snprintf(c->peers[p].host, sizeof c->peers[p].host, "127.0.0.1");
        c->peers[p].port = (uint16_t)(9 + p);
    }
    snprintf(c->listen.host, sizeof c->listen.host, "127.0.0.1");
    c->listen.port = 0; /* an ephemeral port, closed right away (zz_net_new above) */
    c->checkpoint_interval = FZ_CP;
    c->log_window = FZ_L;
    c->batch_max = 3;
    c->max_inflight = 2;
    c->view_timeout_ms = 1000;
    c->status_interval_ms = 100;
    c->time_tolerance_ms = 2000;
    c->max_request = 4096;
    c->batch_bytes = 65536;
    c->max_conns = 16;
    c->max_conns_per_source = 8;
    c->frame_timeout_ms = 20000;
    c->unauth_timeout_ms = 10000;
    c->unauth_buffer_bytes = 1u << 20;
    c->f = 1;
    c->exec_log = 32;
    c->detect_k = 4;
    c->detect_floor_ms = 500;
    c->detect_ceiling_ms = 5000;
    if (external) {
        c->external_exec = 1;
        c->n_exec = FZ_EXEC;
        for (uint32_t i = 0; i < FZ_EXEC; i++) {
            c->exec[i].present = 1;
            c->exec[i].host = i + 1;
            c->exec[i].active = i < 2;
        }
        for (uint32_t h = 0; h < FZ_HOSTS; h++) {
            c->has_controld[h] = 1;
            snprintf(c->controld[h].host, sizeof c->controld[h].host, "127.0.0.1");
            c->controld[h].port = (uint16_t)(20 + h);
            c->controld_pub[h] = zz_pubkey_new(fz_pub[FZ_N + FZ_EXEC + FZ_CLIENTS + h]);
        }
    }
    uint8_t seed[32];
    fz_seed("sign", id, 0, seed);
    c->sign = zz_signkey_new(seed);
    for (int i = 0; i < FZ_N + FZ_EXEC + FZ_CLIENTS; i++) { /* sorted by principal id */
        zz_peer_key *k = &c->keys[c->nkeys++];
        k->id = fz_principal(i);
        fz_mac_seed(i, id, seed);
        k->mac = zz_mackey_new(seed);
        if (i < FZ_N + FZ_EXEC)
            k->pub = zz_pubkey_new(fz_pub[i]);
    }
}

/* ---- reading the input ---- */

typedef struct {
    const uint8_t *p;
    size_t n;
} fz_in;

static uint8_t u8(fz_in *in)
{
    if (!in->n)
        return 0;
    in->n--;
    return *in->p++;
}

static uint16_t u16(fz_in *in) { return (uint16_t)(u8(in) | u8(in) << 8); }
static uint32_t u32(fz_in *in) { return (uint32_t)u16(in) | (uint32_t)u16(in) << 16; }
static uint64_t u64(fz_in *in) { return (uint64_t)u32(in) | (uint64_t)u32(in) << 32; }

static void take(fz_in *in, uint8_t *out, size_t len)
{
    for (size_t i = 0; i < len; i++)
        out[i] = u8(in);
}

/* ---- the state an input runs against ---- */

static zz_replica fz_r;
static zz_buf fz_b, fz_sub, fz_last;       /* message, nested message, last delivered */
static uint8_t fz_dig[8][ZZ_DIGEST_LEN];   /* digests of batches built by this input */
static uint8_t *fz_batch[8];               /* ... and the batches */
static uint32_t fz_batch_len[8];
static uint32_t fz_ndig, fz_nbuilt;
static zz_buf fz_vcs[FZ_N];                /* a NEW-VIEW's view changes */

static uint64_t pick_seq(fz_in *in)
{
    zz_replica *r = &fz_r;
    uint8_t b = u8(in);
    uint64_t k = b & 63;
    switch (b >> 6) {
    case 0:
        return r->stable + 1 + k % (r->L + 2);
    case 1:
        return r->last_exec + k % 8 > 4 ? r->last_exec + k % 8 - 4 : 0;
    case 2:
        return r->stable + r->L + k;
    default:
        return u8(in) == 0xff ? u64(in) : k;
    }
}

static uint64_t pick_ckpt_seq(fz_in *in)
{
    uint8_t b = u8(in);
    if (b == 0xff)
        return u64(in);
    return (fz_r.stable / FZ_CP + b % (FZ_L / FZ_CP + 3)) * FZ_CP;
}

static uint32_t pick_view(fz_in *in)
{
    uint32_t v = fz_r.view;
    uint8_t b = u8(in);
    uint32_t k = b & 63;
    switch (b >> 6) {
    case 0:
        return v + k % 3;
    case 1:
        return v >= k % 4 ? v - k % 4 : 0;
    case 2:
        return v + k;
    default:
        return u32(in);
    }
}

static void pick_digest(fz_in *in, uint64_t seq, uint8_t out[ZZ_DIGEST_LEN])
{
    zz_replica *r = &fz_r;
    uint8_t b = u8(in);
    memset(out, 0, ZZ_DIGEST_LEN);
    switch (b % 5) {
    case 0: /* a batch this input built */
        if (fz_ndig)
            memcpy(out, fz_dig[(b / 5) % fz_ndig], ZZ_DIGEST_LEN);
        break;
    case 1: { /* what the replica has in the slot */
        const zz_slot *s = &r->slots[seq % r->L];
        memcpy(out, s->digest, ZZ_DIGEST_LEN);
        break;
    }
    case 2: { /* its own checkpoint digest at seq, or the stable one */
        const zz_ckpt *k = &r->ckpts[(seq / FZ_CP) % r->n_ckpts];
        memcpy(out, k->seq == seq && k->have_own ? k->own_dig : r->stable_dig, ZZ_DIGEST_LEN);
        break;
    }
    case 3: /* the null request */
        break;
    default:
        take(in, out, 1);
        out[31] = u8(in);
        break;
    }
}

static uint32_t pick_replica(fz_in *in) { return u8(in) % FZ_N; }

/* MAC to the replica only, or to all four (as clients and replicas do). */
static void fz_mac(fz_in *in, zz_buf *b, size_t st, int idx)
{
    uint32_t recv[FZ_N];
    zz_mackey *keys[FZ_N];
    uint16_t k = 0;
    int all = u8(in) & 1;
    for (uint32_t j = 0; j < FZ_N; j++)
        if (all ? (uint32_t)idx != j : j == fz_r.id) {
            recv[k] = j;
            keys[k++] = fz_mk[idx][j];
        }
    zz_auth_mac(b, st, recv, keys, k);
}

static void fz_sign(zz_buf *b, size_t st, int idx)
{
    if (zz_auth_sign(b, st, fz_sk[idx]) != 0)
        abort();
}

/* A client's signed request (auth kind 3): MACs as fz_mac, then its signature, flipped in
 * its last byte when `bad` (a wrong signature). */
static void fz_mac_sig(fz_in *in, zz_buf *b, size_t st, int idx, int bad)
{
    uint32_t recv[FZ_N];
    zz_mackey *keys[FZ_N];
    uint16_t k = 0;
    int all = u8(in) & 1;
    for (uint32_t j = 0; j < FZ_N; j++)
        if (all || j == fz_r.id) {
            recv[k] = j;
            keys[k++] = fz_mk[idx][j];
        }
    if (zz_auth_mac_sig(b, st, recv, keys, k, fz_sk[idx]) != 0)
        abort();
    if (bad && b->len > st)
        b->p[b->len - 1] ^= 1;
}

/* A list<u32> of ids below `below`, ascending, from a bit mask. */
static void put_ids(zz_buf *b, uint8_t mask, uint32_t below)
{
    uint32_t ids[8], n = 0;
    for (uint32_t i = 0; i < 8 && i < below; i++)
        if (mask >> i & 1)
            ids[n++] = i;
    zz_put_u32_list(b, ids, n);
}

/* ---- message builders: each appends one complete message to b ---- */

static void build_request(fz_in *in, zz_buf *b, int ci)
{
    uint8_t op[64];
    uint8_t fl = u8(in);
    uint32_t len = u8(in) % sizeof op;
    take(in, op, len);
    uint64_t ts;
    uint8_t tb = u8(in);
    const zz_peer_key *k = zz_conf_key(fz_r.conf, ZZ_PRINCIPAL_CLIENT + (uint32_t)ci);
    int cix = k ? (int)(k - fz_r.conf->keys) : -1;
    if (tb < 200 && cix >= 0)
        ts = fz_r.clients[cix].last_t + tb % 4; /* a retransmission, the next one, ... */
    else
        ts = tb == 255 ? u64(in) : tb;
    int sign = fl & 4; /* signed (a retransmission), wrongly so with fl & 8 */
    size_t st = zz_enc_request_kind(b, sign ? ZZ_AUTH_MAC_SIG : ZZ_AUTH_MAC, FZ_SVC,
                                    ZZ_PRINCIPAL_CLIENT + (uint32_t)ci, ts,
                                    fl % 4 == 3 ? 0 : fl % 4 == 1 ? ZZ_REQ_READONLY
                                    : fl % 4 == 2               ? ZZ_REQ_ORDERED_READ
                                                                : 0,
                                    op, len);
    if (sign)
        fz_mac_sig(in, b, st, FZ_N + FZ_EXEC + ci, fl & 8);
    else
        fz_mac(in, b, st, FZ_N + FZ_EXEC + ci);
}

/* A batch: nd_time near the wall clock, requests from clients (or pending ones). */
static void build_batch(fz_in *in, zz_buf *b)
{
    int8_t skew = (int8_t)u8(in);
    zz_put_u64(b, zz_wall_ms() + (uint64_t)((int64_t)skew * 50));
    zz_put_u64(b, u8(in));
    uint32_t nreq = u8(in) % 4;
    zz_put_u32(b, nreq);
    for (uint32_t i = 0; i < nreq; i++) {
        int ci = u8(in) % FZ_CLIENTS;
        const zz_peer_key *k = zz_conf_key(fz_r.conf, ZZ_PRINCIPAL_CLIENT + (uint32_t)ci);
        const zz_client *cl = k ? &fz_r.clients[k - fz_r.conf->keys] : NULL;
        if (cl && cl->pend_raw && (u8(in) & 1)) {
            zz_put_bytes(b, cl->pend_raw, cl->pend_len);
            continue;
        }
        zz_buf_reset(&fz_sub);
        build_request(in, &fz_sub, ci);
        zz_put_bytes(b, fz_sub.p, (uint32_t)fz_sub.len);
    }
}

static void remember_batch(const uint8_t *p, uint32_t len)
{
    uint32_t i = fz_nbuilt++ % 8;
    if (fz_ndig < 8)
        fz_ndig++;
    free(fz_batch[i]);
    fz_batch[i] = zz_memdup(p, len);
    fz_batch_len[i] = fz_batch[i] ? len : 0;
    zz_sha256(p, len, fz_dig[i]);
}

static void build_pre_prepare(fz_in *in, zz_buf *b)
{
    uint32_t s = pick_replica(in);
    uint32_t view = pick_view(in);
    uint64_t seq = pick_seq(in);
    size_t st = zz_begin(b, ZZ_PRE_PREPARE, ZZ_AUTH_MAC, FZ_SVC, s);
    zz_put_u32(b, view);
    zz_put_u64(b, seq);
    size_t batch_at = b->len;
    if (fz_ndig && u8(in) < 64) { /* a batch already proposed: equivocation, resend */
        uint32_t i = u8(in) % fz_ndig;
        zz_put_raw(b, fz_batch[i], fz_batch_len[i]);
    } else {
        build_batch(in, b);
    }
    if (!b->oom)
        remember_batch(b->p + batch_at, (uint32_t)(b->len - batch_at));
    zz_end_body(b, st);
    fz_mac(in, b, st, (int)s);
}

static void build_phase(fz_in *in, zz_buf *b, uint8_t type, uint32_t s, uint32_t view,
                        uint64_t seq, const uint8_t *dig)
{
    size_t st = zz_enc_phase(b, type, FZ_SVC, s, view, seq, dig);
    fz_mac(in, b, st, (int)s);
}

static void build_checkpoint(zz_buf *b, uint32_t s, uint64_t seq, const uint8_t *dig)
{
    size_t st = zz_enc_checkpoint(b, FZ_SVC, s, seq, dig);
    fz_sign(b, st, (int)s);
}

/* VIEW-CHANGE of sender s for view v: a stable point with a proof (the replica's own proof,
 * three CHECKPOINTs made here, or none) and P/Q entries near the replica's log. */
static void build_view_change(fz_in *in, zz_buf *b, uint32_t s, uint32_t v)
{
    zz_replica *r = &fz_r;
    size_t st = zz_begin(b, ZZ_VIEW_CHANGE, ZZ_AUTH_SIG, FZ_SVC, s);
    zz_put_u32(b, v);
    uint8_t mode = u8(in) % 3;
    if (mode == 0 && r->stable) {
        zz_put_u64(b, r->stable);
        zz_put_u32(b, r->stable_proof_n);
        for (uint32_t i = 0; i < r->stable_proof_n; i++)
            zz_put_bytes(b, r->stable_proof[i], r->stable_proof_len[i]);
    } else if (mode == 1) {
        uint64_t seq = pick_ckpt_seq(in);
        uint8_t dig[ZZ_DIGEST_LEN];
        pick_digest(in, seq, dig);
        uint8_t who = u8(in);
        zz_put_u64(b, seq);
        zz_put_u32(b, 3);
        for (uint32_t i = 0; i < 3; i++) {
            zz_buf_reset(&fz_sub);
            build_checkpoint(&fz_sub, (who + i) % FZ_N, seq, dig);
            zz_put_bytes(b, fz_sub.p, (uint32_t)fz_sub.len);
        }
    } else {
        zz_put_u64(b, 0);
        zz_put_u32(b, 0);
    }
    for (int list = 0; list < 2; list++) {
        uint32_t k = u8(in) % 4;
        zz_put_u32(b, k);
        for (uint32_t i = 0; i < k; i++) {
            zz_entry e;
            e.seq = pick_seq(in);
            e.view = pick_view(in);
            pick_digest(in, e.seq, e.digest);
            zz_put_entry(b, &e);
        }
    }
    zz_end_body(b, st);
    fz_sign(b, st, (int)s);
}

/* NEW-VIEW for view v: view changes from a subset of the replicas (stored ones when the
 * replica has them for v), and `chosen` as zz_choose decides it, unless the input says
 * otherwise. */
static void build_new_view(fz_in *in, zz_buf *b)
{
    zz_replica *r = &fz_r;
    uint32_t v = pick_view(in);
    uint8_t mask = u8(in);
    uint32_t s = (mask & 0x80) ? pick_replica(in) : v % FZ_N;
    zz_buf *vcs = fz_vcs;
    zz_vc_info info[FZ_N];
    uint32_t nvc = 0;
    for (uint32_t i = 0; i < FZ_N; i++) {
        zz_buf_reset(&vcs[i]);
        if (!(mask >> i & 1))
            continue;
        if ((mask >> 4 & 1) && r->vc_raw[i] && r->vc_view[i] == v) {
            zz_put_raw(&vcs[i], r->vc_raw[i], r->vc_len[i]);
        } else {
            build_view_change(in, &vcs[i], i, v);
        }
        zz_msg m;
        if (vcs[i].oom || zz_decode(vcs[i].p, vcs[i].len, &m) != ZZ_OK)
            continue;
        info[nvc].sender = m.sender;
        info[nvc].stable_seq = m.u.view_change.stable_seq;
        info[nvc].P = m.u.view_change.prepared;
        info[nvc].Q = m.u.view_change.preprepared;
        nvc++;
    }
    zz_choice chosen[2 * FZ_L + 2];
    uint32_t nch = 0;
    uint64_t min_s = 0;
    if (nvc < 3 || zz_choose(info, nvc, 1, FZ_L, &min_s, chosen, 2 * FZ_L + 2, &nch) != 1) {
        min_s = pick_seq(in);
        nch = 0;
    }
    uint8_t twist = u8(in);
    if (twist == 1 && nch)
        chosen[0].digest[0] ^= 1;
    else if (twist == 2)
        min_s += FZ_CP;
    size_t st = zz_begin(b, ZZ_NEW_VIEW, ZZ_AUTH_SIG, FZ_SVC, s);
    zz_put_u32(b, v);
    uint32_t count = 0;
    for (uint32_t i = 0; i < FZ_N; i++)
        count += vcs[i].len > 0 && !vcs[i].oom;
    zz_put_u32(b, count);
    for (uint32_t i = 0; i < FZ_N; i++)
        if (vcs[i].len > 0 && !vcs[i].oom)
            zz_put_bytes(b, vcs[i].p, (uint32_t)vcs[i].len);
    zz_put_u64(b, min_s);
    zz_put_u32(b, nch);
    for (uint32_t i = 0; i < nch; i++)
        zz_put_choice(b, &chosen[i]);
    zz_end_body(b, st);
    fz_sign(b, st, (int)s);
}

static void build_fetch(fz_in *in, zz_buf *b)
{
    uint8_t w = u8(in);
    int idx = w & 1 ? FZ_N + (w >> 1) % FZ_EXEC : (int)((w >> 1) % FZ_N);
    uint8_t kind = (uint8_t)(1 + u8(in) % 3);
    uint64_t seq = kind == ZZ_FETCH_STATE ? pick_ckpt_seq(in) : pick_seq(in);
    uint8_t dig[ZZ_DIGEST_LEN];
    pick_digest(in, seq, dig);
    size_t st = zz_enc_fetch(b, FZ_SVC, fz_principal(idx), kind, seq, dig);
    fz_mac(in, b, st, idx);
}

/* FETCH-REPLY: a batch this input built, the replica's own checkpoint state, or bytes. */
static void build_fetch_reply(fz_in *in, zz_buf *b)
{
    zz_replica *r = &fz_r;
    uint32_t s = pick_replica(in);
    uint8_t kind = (uint8_t)(1 + u8(in) % 3);
    uint64_t seq;
    uint8_t dig[ZZ_DIGEST_LEN];
    const uint8_t *data = NULL;
    uint32_t len = 0;
    uint8_t raw[64];
    uint8_t mode = u8(in);
    if (kind == ZZ_FETCH_BATCH && fz_ndig && mode < 200) {
        uint32_t i = mode % fz_ndig;
        seq = pick_seq(in);
        memcpy(dig, fz_dig[i], ZZ_DIGEST_LEN);
        data = fz_batch[i];
        len = fz_batch_len[i];
    } else if (kind == ZZ_FETCH_STATE && mode < 200) {
        const zz_ckpt *k = &r->ckpts[mode % r->n_ckpts];
        seq = k->seq;
        memcpy(dig, k->own_dig, ZZ_DIGEST_LEN);
        data = k->state;
        len = k->state ? k->state_len : 0;
    } else {
        seq = pick_seq(in);
        pick_digest(in, seq, dig);
        len = u8(in) % sizeof raw;
        take(in, raw, len);
        data = raw;
    }
    size_t st = zz_enc_fetch_reply(b, FZ_SVC, s, kind, seq, dig, data ? data : raw, len);
    fz_mac(in, b, st, (int)s);
}

static void build_status(fz_in *in, zz_buf *b)
{
    uint32_t s = pick_replica(in);
    uint32_t view = pick_view(in);
    uint64_t le = pick_seq(in);
    uint64_t stable = pick_ckpt_seq(in);
    size_t st = zz_enc_status(b, FZ_SVC, s, view, le, stable);
    fz_mac(in, b, st, (int)s);
}

static int pick_exec(fz_in *in) { return FZ_N + u8(in) % FZ_EXEC; }

static void build_exec_report(fz_in *in, zz_buf *b)
{
    int x = pick_exec(in);
    uint64_t seq = pick_seq(in);
    uint32_t nrefs = u8(in) % 3;
    uint8_t refs[3 * ZZ_REPLY_REF_WIRE];
    zz_buf rb;
    zz_buf_init(&rb);
    for (uint32_t i = 0; i < nrefs; i++) {
        zz_reply_ref ref;
        uint8_t w = u8(in);
        ref.client = w == 255 ? ZZ_CHECKPOINT_REF_CLIENT : ZZ_PRINCIPAL_CLIENT + w % FZ_CLIENTS;
        ref.timestamp = u8(in);
        pick_digest(in, seq, ref.result_digest);
        zz_put_reply_ref(&rb, &ref);
    }
    if (rb.oom)
        abort();
    if (nrefs)
        memcpy(refs, rb.p, rb.len);
    zz_buf_free(&rb);
    uint8_t dig[ZZ_DIGEST_LEN];
    zz_sha256(refs, (size_t)nrefs * ZZ_REPLY_REF_WIRE, dig);
    if (u8(in) == 0xff)
        dig[0] ^= 1;
    size_t st = zz_enc_exec_report(b, FZ_SVC, fz_principal(x), seq, dig, refs, nrefs);
    fz_mac(in, b, st, x);
}

static void build_exec_checkpoint(fz_in *in, zz_buf *b)
{
    int x = pick_exec(in);
    uint64_t seq = pick_ckpt_seq(in);
    uint8_t dig[ZZ_DIGEST_LEN];
    pick_digest(in, seq, dig);
    size_t st = zz_enc_exec_digest(b, ZZ_EXEC_CHECKPOINT, FZ_SVC, fz_principal(x), seq, dig);
    fz_sign(b, st, x);
}

static void build_fault_statement(fz_in *in, zz_buf *b, uint32_t s, uint64_t seq)
{
    size_t st = zz_begin(b, ZZ_FAULT_STATEMENT, ZZ_AUTH_SIG, FZ_SVC, s);
    zz_put_u64(b, seq);
    uint8_t states = u8(in);
    zz_put_u32(b, FZ_EXEC);
    uint8_t dig[ZZ_DIGEST_LEN];
    pick_digest(in, seq, dig);
    for (uint32_t i = 0; i < FZ_EXEC; i++) {
        zz_row_entry e;
        e.replica = i;
        e.state = (uint8_t)((states >> (2 * i)) % 3);
        memset(e.digest, 0, ZZ_DIGEST_LEN);
        if (e.state != ZZ_ROW_NONE) {
            memcpy(e.digest, dig, ZZ_DIGEST_LEN);
            e.digest[0] ^= (uint8_t)((states >> 6 == i) ? 0x80 : 0); /* one disagrees */
            e.digest[31] |= 1; /* never the null digest */
        }
        zz_put_row_entry(b, &e);
    }
    zz_end_body(b, st);
    fz_sign(b, st, (int)s);
}

static void build_wakeup(fz_in *in, zz_buf *b)
{
    uint32_t s = pick_replica(in);
    uint64_t seq = pick_seq(in);
    uint8_t who = u8(in);
    uint32_t nev = u8(in) % 4;
    size_t st = zz_begin(b, ZZ_WAKEUP, ZZ_AUTH_SIG, FZ_SVC, s);
    zz_put_u64(b, seq);
    zz_put_u32(b, nev);
    for (uint32_t i = 0; i < nev; i++) {
        zz_buf_reset(&fz_sub);
        build_fault_statement(in, &fz_sub, (who + i) % FZ_N, seq);
        zz_put_bytes(b, fz_sub.p, (uint32_t)fz_sub.len);
    }
    put_ids(b, u8(in), FZ_EXEC + 1);
    put_ids(b, u8(in), FZ_EXEC + 1);
    zz_end_body(b, st);
    fz_sign(b, st, (int)s);
}

static void build_shutdown(fz_in *in, zz_buf *b)
{
    uint32_t s = pick_replica(in);
    uint64_t seq = pick_seq(in);
    size_t st = zz_begin(b, ZZ_SHUTDOWN, ZZ_AUTH_SIG, FZ_SVC, s);
    zz_put_u64(b, seq);
    for (int i = 0; i < 4; i++)
        put_ids(b, u8(in), FZ_EXEC + 1);
    zz_end_body(b, st);
    fz_sign(b, st, (int)s);
}

static void build_spare_ready(fz_in *in, zz_buf *b)
{
    zz_spare_ready q;
    uint8_t w = u8(in);
    q.replica = w % (FZ_EXEC + 1);
    uint32_t h = w & 0x80 ? (uint32_t)(w >> 4) % FZ_HOSTS : q.replica + 1;
    if (h >= FZ_HOSTS)
        h = 0;
    uint8_t sb = u8(in);
    q.seq = sb == 255 ? u64(in) : sb;
    q.epoch = u8(in) % 4;
    uint8_t keys[2][ZZ_KEY_LEN];
    int from = u8(in) % FZ_NPRIN;
    memcpy(keys[0], fz_pub[from], ZZ_KEY_LEN); /* a valid Ed25519 key, someone's */
    take(in, keys[1], 1);
    fz_seed("dh", keys[1][0], 0, keys[1]); /* almost always a usable X25519 key */
    q.sign_pub = keys[0];
    q.dh_pub = keys[1];
    int idx = FZ_N + FZ_EXEC + FZ_CLIENTS + (int)h;
    size_t st = zz_enc_spare_ready(b, FZ_SVC, ZZ_PRINCIPAL_HOST + h, &q);
    fz_sign(b, st, idx);
}

/* ---- delivery ---- */

/* One message on connection `slot`: whole, in two pieces with the clock moving between
 * them, byte by byte for its length prefix, or only a prefix (a frame left half-sent). */
static void deliver(fz_in *in, const zz_buf *b)
{
    if (b->oom || b->len == 0 || b->len > ZZ_MAX_MSG)
        return;
    uint8_t how = u8(in);
    int slot = how % FZ_CONNS;
    size_t total = 4 + b->len;
    uint8_t *f = malloc(total);
    if (!f)
        abort();
    f[0] = (uint8_t)(b->len >> 24);
    f[1] = (uint8_t)(b->len >> 16);
    f[2] = (uint8_t)(b->len >> 8);
    f[3] = (uint8_t)b->len;
    memcpy(f + 4, b->p, b->len);
    zz_net *n = fz_r.net;
    if (getenv("FZ_DEBUG"))
        fprintf(stderr, "fuzz_replica: type %u from %u, %zu bytes, conn %d mode %d\n", b->p[3],
                get_be32(b->p + 8), b->len, slot,
                (how / FZ_CONNS) % 8);
    switch ((how / FZ_CONNS) % 8) {
    case 5: { /* split, time passing between the halves */
        size_t cut = 1 + u16(in) % (total - 1);
        fz_input(n, slot, f, cut);
        fz_now += u8(in) * 10u;
        run_timers(n);
        settle(n);
        fz_input(n, slot, f + cut, total - cut);
        break;
    }
    case 6: /* the length prefix a byte at a time */
        for (size_t i = 0; i < 4; i++)
            fz_input(n, slot, f + i, 1);
        fz_input(n, slot, f + 4, total - 4);
        break;
    case 7: /* half-sent, never finished */
        fz_input(n, slot, f, 1 + u16(in) % (total - 1));
        break;
    default:
        fz_input(n, slot, f, total);
        break;
    }
    free(f);
    zz_buf_reset(&fz_last);
    zz_put_raw(&fz_last, b->p, b->len);
}

/* Prepares or commits from every other replica for one seq and digest: enough, with the
 * primary's pre-prepare, to move a slot along. */
static void quorum_phase(fz_in *in, uint8_t type)
{
    uint32_t view = pick_view(in);
    uint64_t seq = pick_seq(in);
    uint8_t dig[ZZ_DIGEST_LEN];
    pick_digest(in, seq, dig);
    for (uint32_t s = 0; s < FZ_N; s++) {
        if (s == fz_r.id || (type == ZZ_PREPARE && s == view % FZ_N))
            continue;
        zz_buf_reset(&fz_b);
        build_phase(in, &fz_b, type, s, view, seq, dig);
        deliver(in, &fz_b);
    }
}

static void quorum_checkpoint(fz_in *in)
{
    uint64_t seq = pick_ckpt_seq(in);
    uint8_t dig[ZZ_DIGEST_LEN];
    pick_digest(in, seq, dig);
    for (uint32_t s = 0; s < FZ_N; s++) {
        if (s == fz_r.id)
            continue;
        zz_buf_reset(&fz_b);
        build_checkpoint(&fz_b, s, seq, dig);
        deliver(in, &fz_b);
    }
}

static void tick(fz_in *in)
{
    static const uint32_t steps[8] = {1, 10, 50, 100, 500, 1000, 5000, 20000};
    fz_now += steps[u8(in) % 8];
    run_timers(fz_r.net);
    settle(fz_r.net);
}

static void event(fz_in *in)
{
    zz_buf *b = &fz_b;
    zz_buf_reset(b);
    uint8_t op = u8(in);
    switch (op % 24) {
    case 0:
    case 1:
        build_request(in, b, u8(in) % FZ_CLIENTS);
        break;
    case 2:
        build_pre_prepare(in, b);
        break;
    case 3:
    case 4: {
        uint32_t s = pick_replica(in), view = pick_view(in);
        uint64_t seq = pick_seq(in);
        uint8_t dig[ZZ_DIGEST_LEN];
        pick_digest(in, seq, dig);
        build_phase(in, b, op % 24 == 3 ? ZZ_PREPARE : ZZ_COMMIT, s, view, seq, dig);
        break;
    }
    case 5: {
        uint32_t s = pick_replica(in);
        uint64_t seq = pick_ckpt_seq(in);
        uint8_t dig[ZZ_DIGEST_LEN];
        pick_digest(in, seq, dig);
        build_checkpoint(b, s, seq, dig);
        break;
    }
    case 6: {
        uint32_t s = pick_replica(in);
        build_view_change(in, b, s, pick_view(in));
        break;
    }
    case 7:
        build_new_view(in, b);
        break;
    case 8:
        build_fetch(in, b);
        break;
    case 9:
        build_fetch_reply(in, b);
        break;
    case 10:
        build_status(in, b);
        break;
    case 11:
        build_exec_report(in, b);
        break;
    case 12:
        build_exec_checkpoint(in, b);
        break;
    case 13: {
        uint32_t s = pick_replica(in);
        build_fault_statement(in, b, s, pick_seq(in));
        break;
    }
    case 14:
        build_wakeup(in, b);
        break;
    case 15:
        build_shutdown(in, b);
        break;
    case 16:
        build_spare_ready(in, b);
        break;
    case 17: { /* bytes: garbage, or the last message again with one byte changed */
        uint8_t len = u8(in);
        if (len < 128 || fz_last.len == 0) {
            uint8_t raw[128];
            take(in, raw, len % sizeof raw);
            zz_put_raw(b, raw, len % sizeof raw);
        } else {
            zz_put_raw(b, fz_last.p, fz_last.len);
            b->p[u16(in) % b->len] ^= (uint8_t)(1u << (u8(in) % 8));
        }
        break;
    }
    case 18: /* the last message again (a replay or a retransmission) */
        zz_put_raw(b, fz_last.p, fz_last.len);
        break;
    case 19: { /* a connection closes */
        int slot = u8(in) % FZ_CONNS;
        if (fz_conn[slot]) {
            mark_dead(fz_r.net, fz_conn[slot]);
            settle(fz_r.net);
        }
        return;
    }
    case 20:
        tick(in);
        return;
    case 21:
        quorum_phase(in, u8(in) & 1 ? ZZ_COMMIT : ZZ_PREPARE);
        return;
    case 22:
        quorum_checkpoint(in);
        return;
    default: { /* raw bytes straight into a connection: framing errors, split frames */
        uint8_t raw[16];
        uint32_t len = u8(in) % sizeof raw;
        take(in, raw, len);
        fz_input(fz_r.net, u8(in) % FZ_CONNS, raw, len);
        return;
    }
    }
    deliver(in, b);
}

#define FZ_MAX_EVENTS 300

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_in in = {data, size};
    uint8_t cfg = u8(&in);
    fz_now = 1000000;
    fz_conf_build(&fz_conf, cfg % FZ_N, (cfg >> 2) & 1);
    char err[256];
    if (zz_replica_init(&fz_r, &fz_conf, err, sizeof err) != 0) {
        fprintf(stderr, "fuzz_replica: %s\n", err);
        abort();
    }
    fz_r.rng = 0x9E3779B97F4A7C15ULL; /* proposals' nd_seed: the same run for the same input */
    zz_replica_start_timers(&fz_r);
    for (int i = 0; i < FZ_MAX_EVENTS && in.n > 0; i++) {
        event(&in);
        fz_drain(fz_r.net);
    }
    if (getenv("FZ_DEBUG")) /* what an input reached: FZ_DEBUG=1 fuzz_replica FILE */
        fprintf(stderr, "fuzz_replica: id %u view %u in_vc %d last_exec %llu stable %llu "
                        "executed %llu proposed %llu dropped auth %llu\n",
                fz_r.id, fz_r.view, fz_r.in_vc, (unsigned long long)fz_r.last_exec,
                (unsigned long long)fz_r.stable, (unsigned long long)fz_r.st.executed,
                (unsigned long long)fz_r.st.batches_proposed,
                (unsigned long long)fz_r.st.dropped[ZZ_DROP_AUTH]);
    for (int i = 1; getenv("FZ_DEBUG") && i < ZZ_DROP_N; i++)
        fprintf(stderr, "  dropped[%d] %llu\n", i, (unsigned long long)fz_r.st.dropped[i]);
    zz_replica_free(&fz_r);
    zz_conf_free(&fz_conf);
    for (int i = 0; i < FZ_CONNS; i++)
        fz_conn[i] = NULL;
    for (uint32_t i = 0; i < 8; i++) {
        free(fz_batch[i]);
        fz_batch[i] = NULL;
    }
    fz_ndig = fz_nbuilt = 0;
    for (uint32_t i = 0; i < FZ_N; i++)
        zz_buf_free(&fz_vcs[i]);
    zz_buf_free(&fz_b);
    zz_buf_free(&fz_sub);
    zz_buf_free(&fz_last);
    return 0;
}
