/* net.c - the single-threaded epoll loop of zz-agreed: framed TCP in and out, reconnecting
 * peer links, a timer heap and the test-only fault injector. Writes are coalesced per loop
 * iteration because at ~20k requests/s one syscall per frame would dominate the CPU. */
#include "net.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "wire.h"

#define READ_CHUNK (64 * 1024)
#define WAIT_MARKS 4 /* tickets a link's waiting frames can be split by (more merge) */
#define READS_PER_EVENT 16             /* fairness: at most 1 MiB per connection per wakeup */
#define OUT_LIMIT (64u * 1024 * 1024)  /* per-connection queue bound; beyond it frames drop */
#define OUT_KEEP (64 * 1024)           /* an empty output buffer above this is given back */
#define FLUSH_EARLY (256 * 1024)       /* write before the loop's flush once this is queued */
#define IN_KEEP READ_CHUNK             /* an empty read buffer above this is given back */
#define IN_FIRST 4096                  /* a connection's first read buffer; doubles as bytes arrive */
#define BACKOFF_MIN_MS 50
#define BACKOFF_MAX_MS 1000
/* Out of descriptors (EMFILE, ENFILE, ...) on accept: the listener leaves epoll for this
 * long, doubling up to the max while it persists; the backlog waits meanwhile. */
#define ACCEPT_BACKOFF_MIN_MS 100
#define ACCEPT_BACKOFF_MAX_MS 1000
#define MAX_EVENTS 256
/* Outgoing links: agreement peers 0 .. ZZ_MAX_REPLICAS-1, then links added with
 * zz_net_add_link (e.g. to the controld of every host), which get no fault injection. */
#define MAX_LINKS (ZZ_MAX_REPLICAS + ZZ_MAX_HOSTS)

enum conn_kind { C_ACCEPTED, C_PEER, C_LISTEN, C_WAKE, C_WATCH };
enum link_state { L_DOWN, L_CONNECTING, L_UP };

struct zz_conn {
    enum conn_kind kind;
    int fd;
    uint32_t events;  /* what epoll currently watches for fd */
    int dead;         /* close pending at the end of the iteration */
    int dirty;        /* on the flush list */
    zz_conn *next_dirty, *next_dead;
    zz_conn *prev, *next; /* accepted connections list */
    /* input: frames accumulate here until complete */
    uint8_t *in;
    size_t in_len, in_cap;
    /* output: [out_off, out_len) not yet written; out_head bytes at out_off finish a frame
     * that is partly on the wire, so a broken link can drop exactly that partial frame */
    uint8_t *out;
    size_t out_off, out_len, out_cap, out_head;
    /* outgoing peer links only */
    zz_net *net; /* back pointer for the retry timer */
    uint32_t peer;
    enum link_state state;
    uint32_t backoff_ms;
    uint64_t retry_timer;
    int ever_up;
    uint32_t tag; /* the owner's label for this connection (zz_net_conn_tag) */
    uint32_t sender; /* sender slot + 1 its framing errors are charged to; 0 none */
    /* accepted connections only: resource limits (docs/security.md "Resource limits") */
    uint64_t since_ms;       /* accepted at (monotonic) */
    uint64_t frame_since_ms; /* an incomplete frame waits since; 0 = none */
    int trusted;             /* the owner authenticated a message received here */
    uint8_t src[16];         /* source address (IPv4 as v4-mapped IPv6) */
    uint32_t owner;          /* key index + 1 of the client whose requests arrive here; 0 */
    size_t acct;             /* queued bytes counted in the totals (out_sync) */
    int abort;               /* closed as a slow reader: reset, unsent bytes discarded */
    uint64_t out_since_ms;   /* queued output made its last progress (or began) at */
    /* links, with a barrier: frames that wait for the turn's durable barrier (release_held) */
    uint8_t *held;
    size_t held_len, held_cap;
    /* ... and frames of earlier turns that wait for the owner's ticket (zz_net_release), in
     * the order they were sent: wait[0, mark[i].end) may leave once ticket mark[i].ticket is
     * released; marks ascend in both. */
    uint8_t *wait;
    size_t wait_len, wait_cap;
    struct {
        uint64_t ticket;
        size_t end;
    } mark[WAIT_MARKS];
    uint32_t n_marks;
};

typedef struct {
    uint64_t expiry, id;
    zz_on_timer fn;
    void *ctx;
    int cancelled;
} timer_ent;

/* A message held back by the delay injector. */
typedef struct {
    zz_net *net;
    uint32_t peer;
    size_t len;
    uint8_t msg[];
} delayed_msg;

struct zz_net {
    const zz_conf *conf;
    void *ctx;
    zz_on_frame on_frame;
    zz_on_close on_close;
    int ep;
    zz_conn listener, wake;
    zz_conn links[MAX_LINKS];
    struct sockaddr_storage peer_addr[MAX_LINKS];
    socklen_t peer_addrlen[MAX_LINKS];
    uint32_t n_links; /* links in use: ZZ_MAX_REPLICAS + those added */
    zz_conn *accepted;   /* list head */
    zz_conn *dirty_head; /* connections with output to flush */
    zz_conn *dead_head;  /* connections to close */
    timer_ent *heap;
    size_t nheap, heapcap;
    uint64_t next_timer_id;
    uint64_t rng;
    int inject;
    /* Set by zz_net_stop, which may run in a signal handler: only this flag and a write to
     * the eventfd happen there, both async-signal-safe. */
    volatile sig_atomic_t stop;
    /* Set by zz_net_kick (also from a signal handler); the loop calls on_kick once. */
    volatile sig_atomic_t kicked;
    zz_on_timer on_kick;
    void *kick_ctx;
    zz_on_barrier barrier; /* before any write to a socket (zz_net_set_barrier) */
    void *barrier_ctx;
    int early;    /* link sends now go out before the durable barrier (zz_net_early) */
    int barrier_first; /* the turn's durable call before its socket writes */
    int any_held; /* some link holds frames for the durable barrier */
    int any_wait; /* some link has frames waiting for a ticket (zz_net_release) */
    uint64_t released; /* the highest ticket released */
    zz_conn watch;     /* a descriptor the owner watches (zz_net_watch); fd -1: none */
    zz_on_timer watch_fn;
    void *watch_ctx;
    zz_net_stats st;
    uint32_t n_accepted;
    uint32_t accept_backoff_ms; /* the current accept back-off; 0: accepting normally */
    int accept_paused;          /* the listener is out of epoll until the back-off timer */
    /* conf's limits; a zero there (a hand-made conf) means the default */
    uint32_t max_conns, max_per_source, frame_timeout_ms, unauth_timeout_ms;
    uint64_t unauth_buffer_max; /* read buffers of unauthenticated connections, in total */
    uint64_t unauth_buffered;   /* ... held now */
    /* output budgets of accepted connections (docs/security.md "Slow readers") */
    uint64_t client_out_max;    /* bytes queued for one owner, all its connections */
    uint64_t client_out_total;  /* bytes queued for all owners together */
    uint32_t out_stall_ms;      /* queued output must make progress within this */
    uint32_t n_owners;          /* conf->nkeys */
    uint64_t *owner_out;        /* bytes queued per owner (index owner - 1) */
    uint64_t *owner_closes;     /* connections closed as slow readers, per owner */
    uint8_t scratch[READ_CHUNK]; /* every recv lands here; only a frame's tail is kept */
};

static void set_err(char *err, size_t errcap, const char *fmt, ...)
{
    if (!err || !errcap)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errcap, fmt, ap);
    va_end(ap);
}

uint64_t zz_net_now_ms(const zz_net *n)
{
    (void)n;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static uint32_t get_be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* ---- PRNG for fault injection: splitmix64, deterministic per (seed, replica) ---- */

static uint64_t rng_next(zz_net *n)
{
    uint64_t z = (n->rng += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static double rng_unit(zz_net *n) /* uniform in [0, 1) */
{
    return (double)(rng_next(n) >> 11) * 0x1.0p-53;
}

/* ---- timers: binary min-heap on (expiry, id); cancel marks, the pop skips ---- */

static int heap_less(const timer_ent *a, const timer_ent *b)
{
    return a->expiry != b->expiry ? a->expiry < b->expiry : a->id < b->id;
}

static void heap_up(zz_net *n, size_t i)
{
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!heap_less(&n->heap[i], &n->heap[p]))
            break;
        timer_ent t = n->heap[i];
        n->heap[i] = n->heap[p];
        n->heap[p] = t;
        i = p;
    }
}

static void heap_down(zz_net *n, size_t i)
{
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n->nheap && heap_less(&n->heap[l], &n->heap[m]))
            m = l;
        if (r < n->nheap && heap_less(&n->heap[r], &n->heap[m]))
            m = r;
        if (m == i)
            break;
        timer_ent t = n->heap[i];
        n->heap[i] = n->heap[m];
        n->heap[m] = t;
        i = m;
    }
}

static void heap_pop(zz_net *n, timer_ent *out)
{
    *out = n->heap[0];
    n->heap[0] = n->heap[--n->nheap];
    heap_down(n, 0);
}

uint64_t zz_net_timer(zz_net *n, uint32_t ms, zz_on_timer fn, void *ctx)
{
    if (n->nheap == n->heapcap) {
        size_t nc = n->heapcap ? n->heapcap * 2 : 64;
        timer_ent *nh = realloc(n->heap, nc * sizeof *nh);
        if (!nh) {
            /* Out of memory: losing a timer would stall the protocol silently; there is
             * nothing sensible left to do in a replica that cannot allocate 64 bytes. */
            zz_log("zz_net_timer: out of memory\n");
            abort();
        }
        n->heap = nh;
        n->heapcap = nc;
    }
    timer_ent *t = &n->heap[n->nheap];
    t->expiry = zz_net_now_ms(n) + ms;
    t->id = ++n->next_timer_id;
    t->fn = fn;
    t->ctx = ctx;
    t->cancelled = 0;
    uint64_t id = t->id; /* t moves during heap_up */
    heap_up(n, n->nheap++);
    return id;
}

/* Linear: cancels are rare (a handful of protocol timers), firing is the hot path. */
void zz_net_cancel(zz_net *n, uint64_t id)
{
    if (id == 0)
        return;
    for (size_t i = 0; i < n->nheap; i++)
        if (n->heap[i].id == id) {
            n->heap[i].cancelled = 1;
            return;
        }
}

/* ---- epoll bookkeeping ---- */

static int ep_set(zz_net *n, zz_conn *c, uint32_t events)
{
    if (c->events == events)
        return 0;
    struct epoll_event ev = {.events = events, .data.ptr = c};
    int op = events == 0 ? EPOLL_CTL_DEL : c->events ? EPOLL_CTL_MOD : EPOLL_CTL_ADD;
    if (epoll_ctl(n->ep, op, c->fd, &ev) < 0)
        return -1;
    c->events = events;
    return 0;
}

static void out_sync(zz_net *n, zz_conn *c);

static void mark_dead(zz_net *n, zz_conn *c)
{
    if (c->dead)
        return;
    c->dead = 1;
    c->next_dead = n->dead_head;
    n->dead_head = c;
    out_sync(n, c); /* its queue is never written: out of the budgets at once */
}

static void mark_dirty(zz_net *n, zz_conn *c)
{
    if (c->dirty || c->dead)
        return;
    c->dirty = 1;
    c->next_dirty = n->dirty_head;
    n->dirty_head = c;
}

static void set_sockopts(int fd)
{
    int one = 1;
    /* Frames are small and latency-bound; coalescing is done by our own output buffer. */
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* ---- output ---- */

/* Bring the totals in line with c's queue: an accepted connection that is alive counts
 * its queued bytes, towards its owner's budget too; a dead one counts nothing (its queue
 * is never written). Every change of out_off, out_len, dead or owner ends here. */
static void out_sync(zz_net *n, zz_conn *c)
{
    if (c->kind != C_ACCEPTED)
        return;
    size_t now = c->dead ? 0 : c->out_len - c->out_off;
    n->st.out_buffer_bytes = n->st.out_buffer_bytes - c->acct + now;
    if (c->owner) {
        n->owner_out[c->owner - 1] = n->owner_out[c->owner - 1] - c->acct + now;
        n->st.client_out_bytes = n->st.client_out_bytes - c->acct + now;
    }
    c->acct = now;
}

/* A reader too slow for its budget or its timeout: closed, its queue dropped at once. */
static void close_slow(zz_net *n, zz_conn *c, uint64_t *counter)
{
    (*counter)++;
    if (c->owner)
        n->owner_closes[c->owner - 1]++;
    c->abort = 1;
    mark_dead(n, c);
}

/* May `need` more bytes be queued on c? Client connections share their client's budget
 * (client_out_max) and all clients one total (client_out_total). Over the client's
 * budget, its other connections that hold queued replies are closed first (it reads none
 * of them), then c; over the total, the connection with the most queued (c included).
 * A reply to a client with nothing queued is always admitted, so one reply larger than
 * the budget still goes out. Other connections: OUT_LIMIT each, as peer links. */
static int out_admit(zz_net *n, zz_conn *c, size_t need)
{
    if (c->kind != C_ACCEPTED || !c->owner)
        return 1;
    uint64_t *mine = &n->owner_out[c->owner - 1];
    if (*mine > 0 && *mine + need > n->client_out_max) {
        for (zz_conn *o = n->accepted; o && *mine > 0 && *mine + need > n->client_out_max;
             o = o->next)
            if (o != c && o->owner == c->owner && !o->dead && o->acct > 0)
                close_slow(n, o, &n->st.client_out_overflows);
        if (*mine > 0 && *mine + need > n->client_out_max) {
            close_slow(n, c, &n->st.client_out_overflows);
            return 0;
        }
    }
    while (n->st.client_out_bytes > 0 && n->st.client_out_bytes + need > n->client_out_total) {
        zz_conn *big = NULL;
        for (zz_conn *o = n->accepted; o; o = o->next)
            if (o->owner && !o->dead && o->acct > 0 && (!big || o->acct > big->acct))
                big = o;
        if (!big)
            break;
        close_slow(n, big, &n->st.out_total_overflows);
        if (big == c)
            return 0;
    }
    return 1;
}

/* Account `w` written bytes, walking frame boundaries so out_head stays exact. */
static void out_consumed(zz_conn *c, size_t w)
{
    while (w > 0) {
        if (c->out_head == 0)
            c->out_head = 4 + (size_t)get_be32(c->out + c->out_off);
        size_t step = w < c->out_head ? w : c->out_head;
        c->out_head -= step;
        c->out_off += step;
        w -= step;
    }
    if (c->out_off == c->out_len) {
        c->out_off = c->out_len = 0;
        if (c->out_cap > OUT_KEEP) { /* a burst's buffer is not kept for good */
            free(c->out);
            c->out = NULL;
            c->out_cap = 0;
        }
    }
}

/* Write as much as the socket takes. Returns -1 if the connection broke. */
static int conn_flush(zz_net *n, zz_conn *c)
{
    if (c->fd < 0 || c->dead || (c->kind == C_PEER && c->state != L_UP))
        return 0;
    /* What these bytes depend on is written first; bytes that need it synced are held
     * until the durable barrier (release_held). */
    if (n->barrier && c->out_off < c->out_len)
        n->barrier(n->barrier_ctx, 0);
    size_t wrote = 0;
    while (c->out_off < c->out_len) {
        ssize_t w = send(c->fd, c->out + c->out_off, c->out_len - c->out_off,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                break;
            mark_dead(n, c);
            return -1;
        }
        n->st.bytes_out += (uint64_t)w;
        wrote += (size_t)w;
        out_consumed(c, (size_t)w);
    }
    if (wrote > 0 && c->out_off < c->out_len)
        c->out_since_ms = zz_net_now_ms(n); /* progress: the stall clock restarts */
    out_sync(n, c);
    uint32_t want = EPOLLIN | (c->out_off < c->out_len ? EPOLLOUT : 0);
    if (ep_set(n, c, want) < 0) {
        mark_dead(n, c);
        return -1;
    }
    return 0;
}

/* Room for `need` more bytes at the end of c's output queue (reclaiming the written prefix
 * before growing); the caller fills them. NULL without memory. */
static uint8_t *out_reserve(zz_conn *c, size_t need)
{
    if (c->out_cap - c->out_len < need) {
        if (c->out_off > 0) {
            memmove(c->out, c->out + c->out_off, c->out_len - c->out_off);
            c->out_len -= c->out_off;
            c->out_off = 0;
        }
        if (c->out_cap - c->out_len < need) {
            size_t nc = c->out_cap ? c->out_cap : 64 * 1024;
            while (nc - c->out_len < need)
                nc *= 2;
            uint8_t *p = realloc(c->out, nc);
            if (!p)
                return NULL;
            c->out = p;
            c->out_cap = nc;
        }
    }
    uint8_t *d = c->out + c->out_len;
    c->out_len += need;
    return d;
}

/* Append one frame; 0 on success, -1 if it was dropped (queue bound or memory). */
static int conn_enqueue(zz_net *n, zz_conn *c, const uint8_t *msg, size_t len)
{
    /* A dying accepted connection is gone for good (the owner learns via on_close); a
     * dying peer link keeps its queue for the next connection. */
    if (c->dead && c->kind != C_PEER)
        return -1;
    if (len > ZZ_MAX_MSG || (c->out_len - c->out_off) + 4 + len > OUT_LIMIT) {
        n->st.send_overflow++;
        return -1;
    }
    size_t need = 4 + len;
    if (!out_admit(n, c, need))
        return -1;
    if (c->out_off == c->out_len)
        c->out_since_ms = zz_net_now_ms(n);
    uint8_t *d = out_reserve(c, need);
    if (!d) {
        n->st.send_overflow++;
        return -1;
    }
    d[0] = (uint8_t)(len >> 24);
    d[1] = (uint8_t)(len >> 16);
    d[2] = (uint8_t)(len >> 8);
    d[3] = (uint8_t)len;
    memcpy(d + 4, msg, len);
    out_sync(n, c);
    n->st.frames_out++;
    if (c->out_len - c->out_off >= FLUSH_EARLY)
        conn_flush(n, c);
    else
        mark_dirty(n, c);
    return 0;
}

/* ---- outgoing peer links ---- */

static void link_connect(zz_net *n, zz_conn *c);

static void on_retry(void *ctx)
{
    zz_conn *c = ctx;
    c->retry_timer = 0;
    link_connect(c->net, c);
}

static void link_schedule_retry(zz_net *n, zz_conn *c)
{
    c->state = L_DOWN;
    if (c->retry_timer)
        return;
    c->retry_timer = zz_net_timer(n, c->backoff_ms, on_retry, c);
    c->backoff_ms = c->backoff_ms * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : c->backoff_ms * 2;
}

static void link_established(zz_net *n, zz_conn *c)
{
    c->state = L_UP;
    c->backoff_ms = BACKOFF_MIN_MS;
    if (c->ever_up)
        n->st.reconnects++;
    c->ever_up = 1;
    if (conn_flush(n, c) < 0)
        return;
}

static void link_connect(zz_net *n, zz_conn *c)
{
    if (c->state != L_DOWN || c->retry_timer)
        return;
    int fd = socket(n->peer_addr[c->peer].ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC,
                    0);
    if (fd < 0) {
        link_schedule_retry(n, c);
        return;
    }
    set_sockopts(fd);
    c->fd = fd;
    c->events = 0;
    c->dead = 0;
    if (connect(fd, (struct sockaddr *)&n->peer_addr[c->peer], n->peer_addrlen[c->peer]) == 0) {
        if (ep_set(n, c, EPOLLIN) < 0) {
            mark_dead(n, c);
            return;
        }
        link_established(n, c);
        return;
    }
    if (errno != EINPROGRESS || ep_set(n, c, EPOLLOUT) < 0) {
        n->st.connect_failures++;
        /* Through the dead list so the fd is closed in one place. */
        c->state = L_CONNECTING;
        mark_dead(n, c);
        return;
    }
    c->state = L_CONNECTING;
}

static void link_connect_done(zz_net *n, zz_conn *c)
{
    int soerr = 0;
    socklen_t sl = sizeof soerr;
    if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) < 0 || soerr != 0) {
        n->st.connect_failures++;
        mark_dead(n, c);
        return;
    }
    if (ep_set(n, c, EPOLLIN) < 0) {
        mark_dead(n, c);
        return;
    }
    link_established(n, c);
}

/* The partial frame at the head cannot be resumed on a new connection: the receiver would
 * read its tail as a length prefix. Whole queued frames are kept for the next connection. */
static void link_down(zz_net *n, zz_conn *c)
{
    if (c->fd >= 0) {
        ep_set(n, c, 0);
        close(c->fd);
        c->fd = -1;
    }
    c->events = 0;
    c->dead = 0;
    c->out_off += c->out_head;
    c->out_head = 0;
    if (c->out_off == c->out_len)
        c->out_off = c->out_len = 0;
    c->in_len = 0;
    link_schedule_retry(n, c);
}

static int resolve(const char *host, uint16_t port, int passive, struct sockaddr_storage *ss,
                   socklen_t *sl);

/* ---- injection and the public send API ---- */

/* Keep one frame for link c until the turn's durable barrier; -1 if it was dropped. */
static int held_enqueue(zz_net *n, zz_conn *c, const uint8_t *msg, size_t len)
{
    if (len > ZZ_MAX_MSG ||
        (c->out_len - c->out_off) + c->held_len + c->wait_len + 4 + len > OUT_LIMIT) {
        n->st.send_overflow++;
        return -1;
    }
    size_t need = 4 + len;
    if (c->held_cap - c->held_len < need) {
        size_t nc = c->held_cap ? c->held_cap : 64 * 1024;
        while (nc - c->held_len < need)
            nc *= 2;
        uint8_t *p = realloc(c->held, nc);
        if (!p) {
            n->st.send_overflow++;
            return -1;
        }
        c->held = p;
        c->held_cap = nc;
    }
    uint8_t *d = c->held + c->held_len;
    d[0] = (uint8_t)(len >> 24);
    d[1] = (uint8_t)(len >> 16);
    d[2] = (uint8_t)(len >> 8);
    d[3] = (uint8_t)len;
    memcpy(d + 4, msg, len);
    c->held_len += need;
    n->st.frames_out++;
    n->any_held = 1;
    return 0;
}

/* With a barrier, a link send waits for the turn's durable barrier unless the owner marked
 * it early (zz_net_early): it needs only what is written. */
static void link_send(zz_net *n, uint32_t peer, const uint8_t *msg, size_t len)
{
    zz_conn *c = &n->links[peer];
    int rc = n->barrier && !n->early ? held_enqueue(n, c, msg, len)
                                     : conn_enqueue(n, c, msg, len);
    if (rc < 0)
        return;
    if (c->state == L_DOWN)
        link_connect(n, c);
}

/* Frames join link c's output queue (a failed allocation drops them, counted). */
static void link_queue(zz_net *n, zz_conn *c, const uint8_t *p, size_t len)
{
    uint8_t *d = out_reserve(c, len);
    if (d)
        memcpy(d, p, len);
    else
        n->st.send_overflow++;
}

/* Move c's held frames behind its waiting ones, to leave once `ticket` is released; 0 if
 * they could not be kept (dropped, counted). */
static int wait_append(zz_net *n, zz_conn *c, uint64_t ticket)
{
    if (c->wait_cap - c->wait_len < c->held_len) {
        size_t nc = c->wait_cap ? c->wait_cap : 64 * 1024;
        while (nc - c->wait_len < c->held_len)
            nc *= 2;
        uint8_t *p = realloc(c->wait, nc);
        if (!p) {
            n->st.send_overflow++;
            return 0;
        }
        c->wait = p;
        c->wait_cap = nc;
    }
    memcpy(c->wait + c->wait_len, c->held, c->held_len);
    c->wait_len += c->held_len;
    /* Frames never overtake earlier ones of the same link: a ticket below the last mark's
     * waits for that one. With every mark in use, the last one grows (the frames of both
     * wait for the later ticket, which is never too early). */
    if (c->n_marks > 0 && ticket < c->mark[c->n_marks - 1].ticket)
        ticket = c->mark[c->n_marks - 1].ticket;
    if (c->n_marks > 0 && (c->n_marks == WAIT_MARKS || c->mark[c->n_marks - 1].ticket == ticket)) {
        c->mark[c->n_marks - 1].ticket = ticket;
        c->mark[c->n_marks - 1].end = c->wait_len;
    } else {
        c->mark[c->n_marks].ticket = ticket;
        c->mark[c->n_marks].end = c->wait_len;
        c->n_marks++;
    }
    n->any_wait = 1;
    return 1;
}

/* The turn's durable barrier (one call), then the held frames join their links' queues, or
 * wait behind the ticket the barrier returned (zz_net_release). */
static void release_held(zz_net *n)
{
    if (!n->any_held)
        return;
    n->any_held = 0;
    n->st.barriers++;
    uint64_t ticket = n->barrier(n->barrier_ctx, 1);
    if (ticket <= n->released)
        ticket = 0;
    for (uint32_t p = 0; p < n->n_links; p++) {
        zz_conn *c = &n->links[p];
        if (c->held_len == 0)
            continue;
        if (ticket == 0 && c->wait_len == 0)
            link_queue(n, c, c->held, c->held_len);
        else if (wait_append(n, c, ticket))
            n->st.waited++;
        c->held_len = 0;
        if (c->held_cap > OUT_KEEP) {
            free(c->held);
            c->held = NULL;
            c->held_cap = 0;
        }
        if (c->wait_len == 0)
            conn_flush(n, c);
    }
}

void zz_net_release(zz_net *n, uint64_t ticket)
{
    if (ticket > n->released)
        n->released = ticket;
    if (!n->any_wait)
        return;
    n->any_wait = 0;
    for (uint32_t p = 0; p < n->n_links; p++) {
        zz_conn *c = &n->links[p];
        uint32_t k = 0;
        while (k < c->n_marks && c->mark[k].ticket <= n->released)
            k++;
        if (k > 0) {
            size_t end = c->mark[k - 1].end;
            link_queue(n, c, c->wait, end);
            memmove(c->wait, c->wait + end, c->wait_len - end);
            c->wait_len -= end;
            for (uint32_t i = k; i < c->n_marks; i++) {
                c->mark[i - k].ticket = c->mark[i].ticket;
                c->mark[i - k].end = c->mark[i].end - end;
            }
            c->n_marks -= k;
            if (c->wait_len == 0 && c->wait_cap > OUT_KEEP) {
                free(c->wait);
                c->wait = NULL;
                c->wait_cap = 0;
            }
            /* Out now, not at the end of the turn: they waited for this sync alone. */
            conn_flush(n, c);
        }
        if (c->wait_len > 0)
            n->any_wait = 1;
    }
}

int zz_net_watch(zz_net *n, int fd, zz_on_timer fn, void *ctx)
{
    if (n->watch.fd >= 0 || fd < 0)
        return -1;
    n->watch.fd = fd;
    n->watch_fn = fn;
    n->watch_ctx = ctx;
    if (ep_set(n, &n->watch, EPOLLIN) < 0) {
        n->watch.fd = -1;
        return -1;
    }
    return 0;
}

static void on_delayed(void *ctx)
{
    delayed_msg *d = ctx;
    link_send(d->net, d->peer, d->msg, d->len);
    free(d);
}

static void inject_send(zz_net *n, uint32_t peer, const uint8_t *msg, size_t len)
{
    if (rng_unit(n) < n->conf->inject_drop) {
        n->st.injected_drops++;
        return;
    }
    int copies = 1;
    if (rng_unit(n) < n->conf->inject_dup) {
        n->st.injected_dups++;
        copies = 2;
    }
    for (int i = 0; i < copies; i++) {
        uint32_t delay = 0;
        if (n->conf->inject_delay_ms > 0)
            delay = (uint32_t)(rng_next(n) % ((uint64_t)n->conf->inject_delay_ms + 1));
        if (delay == 0) {
            link_send(n, peer, msg, len);
            continue;
        }
        delayed_msg *d = malloc(sizeof *d + len);
        if (!d) {
            n->st.send_overflow++;
            continue;
        }
        d->net = n;
        d->peer = peer;
        d->len = len;
        memcpy(d->msg, msg, len);
        n->st.injected_delays++;
        zz_net_timer(n, delay, on_delayed, d);
    }
}

void zz_net_send_peer(zz_net *n, uint32_t peer, const uint8_t *msg, size_t len)
{
    if (peer >= n->conf->n || peer == n->conf->id)
        return;
    if (n->inject)
        inject_send(n, peer, msg, len);
    else
        link_send(n, peer, msg, len);
}

int zz_net_add_link(zz_net *n, const char *host, uint16_t port)
{
    if (n->n_links >= MAX_LINKS)
        return -1;
    uint32_t id = n->n_links;
    if (resolve(host, port, 0, &n->peer_addr[id], &n->peer_addrlen[id]) < 0)
        return -1;
    n->n_links++;
    return (int)id;
}

void zz_net_send_link(zz_net *n, int link, const uint8_t *msg, size_t len)
{
    if (link < ZZ_MAX_REPLICAS || (uint32_t)link >= n->n_links)
        return;
    link_send(n, (uint32_t)link, msg, len);
}

void zz_net_bcast(zz_net *n, const uint8_t *msg, size_t len)
{
    for (uint32_t p = 0; p < n->conf->n; p++)
        if (p != n->conf->id)
            zz_net_send_peer(n, p, msg, len);
}

void zz_net_send_conn(zz_net *n, zz_conn *conn, const uint8_t *msg, size_t len)
{
    if (!conn)
        return;
    if (conn->kind == C_PEER) {
        link_send(n, conn->peer, msg, len);
        return;
    }
    conn_enqueue(n, conn, msg, len);
}

/* ---- input ---- */

/* Deliver every complete frame at the start of buf[0, len). Returns the bytes consumed, or
 * -1 if the connection must close; *delivered counts the frames. */
static long parse_frames(zz_net *n, zz_conn *c, const uint8_t *buf, size_t len, int *delivered)
{
    size_t p = 0;
    while (len - p >= 4) {
        uint32_t L = get_be32(buf + p);
        if (L < ZZ_HDR_LEN || L > ZZ_MAX_MSG) {
            n->st.framing_errors++;
            if (c->sender && c->sender <= ZZ_NET_SENDER_SLOTS)
                n->st.framing_from[c->sender - 1]++;
            return -1;
        }
        if (len - p - 4 < L)
            break;
        n->st.frames_in++;
        (*delivered)++;
        n->on_frame(n->ctx, c, buf + p + 4, L);
        p += 4 + (size_t)L;
        if (c->dead) /* a send from the handler broke it */
            return -1;
    }
    return (long)p;
}

static int counts_unauth(const zz_conn *c)
{
    return c->kind == C_ACCEPTED && !c->trusted;
}

static void in_set_cap(zz_net *n, zz_conn *c, uint8_t *p, size_t cap)
{
    n->st.in_buffer_bytes -= c->in_cap;
    n->st.in_buffer_bytes += cap;
    if (counts_unauth(c))
        n->unauth_buffered = n->unauth_buffered - c->in_cap + cap;
    c->in = p;
    c->in_cap = cap;
}

/* Keep the bytes of an incomplete frame. The buffer grows with what has arrived (doubling
 * from IN_FIRST), never by what a length prefix announces: a peer that announces 16 MiB and
 * sends 10 bytes costs 4 KiB, not 16 MiB. */
static int in_append(zz_net *n, zz_conn *c, const uint8_t *p, size_t len)
{
    if (len == 0)
        return 0;
    size_t need = c->in_len + len;
    if (need > c->in_cap) {
        size_t nc = c->in_cap ? c->in_cap : IN_FIRST;
        while (nc < need)
            nc *= 2;
        /* Connections that authenticated nothing yet share one budget: many of them that
         * really send most of a 16 MiB frame cannot hold more than that in total. */
        if (counts_unauth(c) && n->unauth_buffered - c->in_cap + nc > n->unauth_buffer_max) {
            n->st.unauth_buffer_refusals++;
            return -1;
        }
        uint8_t *q = realloc(c->in, nc);
        if (!q)
            return -1;
        in_set_cap(n, c, q, nc);
    }
    memcpy(c->in + c->in_len, p, len);
    c->in_len += len;
    return 0;
}

/* One recv's bytes: frames complete in the kept tail plus the new bytes are delivered; a
 * read that begins at a frame boundary is parsed where it landed, without a copy. */
static int conn_input(zz_net *n, zz_conn *c, const uint8_t *buf, size_t len, int *delivered)
{
    if (c->in_len == 0) {
        long used = parse_frames(n, c, buf, len, delivered);
        if (used < 0)
            return -1;
        return in_append(n, c, buf + used, len - (size_t)used);
    }
    /* Complete the frame at the head first, then continue from buf directly. */
    size_t take = len;
    if (c->in_len >= 4) {
        size_t frame = 4 + (size_t)get_be32(c->in);
        if (frame > c->in_len && frame - c->in_len < take)
            take = frame - c->in_len;
    } else if (4 - c->in_len < take) {
        take = 4 - c->in_len; /* just the length prefix; then look again */
    }
    if (in_append(n, c, buf, take) < 0)
        return -1;
    long used = parse_frames(n, c, c->in, c->in_len, delivered);
    if (used < 0)
        return -1;
    if (used > 0) {
        memmove(c->in, c->in + used, c->in_len - (size_t)used);
        c->in_len -= (size_t)used;
    }
    if (take < len)
        return conn_input(n, c, buf + take, len - take, delivered);
    return 0;
}

static void conn_readable(zz_net *n, zz_conn *c)
{
    int delivered = 0;
    for (int i = 0; i < READS_PER_EVENT && !c->dead; i++) {
        ssize_t r = recv(c->fd, n->scratch, READ_CHUNK, MSG_DONTWAIT);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                mark_dead(n, c);
            break;
        }
        if (r == 0) {
            mark_dead(n, c);
            break;
        }
        n->st.bytes_in += (uint64_t)r;
        if (conn_input(n, c, n->scratch, (size_t)r, &delivered) < 0) {
            mark_dead(n, c);
            return;
        }
        if ((size_t)r < READ_CHUNK)
            break; /* drained: skip the EAGAIN round trip */
    }
    /* The half-sent-frame clock restarts whenever a frame completes. */
    if (c->in_len == 0)
        c->frame_since_ms = 0;
    else if (delivered > 0 || c->frame_since_ms == 0)
        c->frame_since_ms = zz_net_now_ms(n);
    if (c->in_len == 0 && c->in_cap > IN_KEEP) {
        free(c->in);
        in_set_cap(n, c, NULL, 0);
    }
}

/* ---- accepted connections ---- */

/* The source address as 16 bytes (IPv4 as v4-mapped IPv6), for the per-source cap. */
static void source_key(const struct sockaddr_storage *ss, uint8_t out[16])
{
    memset(out, 0, 16);
    if (ss->ss_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
        out[10] = out[11] = 0xff;
        memcpy(out + 12, &a->sin_addr, 4);
    } else if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
        memcpy(out, &a->sin6_addr, 16);
    }
}

/* Over a cap the connection is accepted and closed at once (counted): left in the backlog
 * it would be retried forever, and the peer learns nothing. */
static int over_cap(zz_net *n, const uint8_t src[16])
{
    if (n->n_accepted >= n->max_conns) {
        n->st.conns_refused++;
        return 1;
    }
    uint32_t same = 0;
    for (zz_conn *c = n->accepted; c; c = c->next)
        same += !c->dead && memcmp(c->src, src, 16) == 0;
    if (same >= n->max_per_source) {
        n->st.conns_refused++;
        n->st.conns_refused_source++;
        return 1;
    }
    return 0;
}

/* The listener stays readable while accept fails for want of a descriptor: level-
 * triggered epoll would spin on it. Take it out of epoll for a back-off (100 ms, doubling
 * to 1 s while the shortage lasts), count it (stats accept_backoffs) and try again when
 * the timer fires; established connections are served meanwhile. */
static void accept_back_off(zz_net *n);

static void accept_resume(void *ctx)
{
    zz_net *n = ctx;
    n->accept_paused = 0;
    if (ep_set(n, &n->listener, EPOLLIN) < 0)
        accept_back_off(n); /* epoll_ctl itself may lack memory: try again later */
}

static void accept_back_off(zz_net *n)
{
    if (n->accept_paused)
        return;
    uint32_t ms = n->accept_backoff_ms ? n->accept_backoff_ms * 2 : ACCEPT_BACKOFF_MIN_MS;
    n->accept_backoff_ms = ms > ACCEPT_BACKOFF_MAX_MS ? ACCEPT_BACKOFF_MAX_MS : ms;
    n->st.accept_backoffs++;
    n->accept_paused = 1;
    (void)ep_set(n, &n->listener, 0); /* EPOLL_CTL_DEL: needs no memory */
    zz_net_timer(n, n->accept_backoff_ms, accept_resume, n);
}

static void accept_all(zz_net *n)
{
    for (;;) {
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        memset(&ss, 0, sizeof ss);
        int fd = accept4(n->listener.fd, (struct sockaddr *)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
                accept_back_off(n);
            /* EAGAIN: done. Out of descriptors: the rest waits in the backlog. */
            return;
        }
        n->accept_backoff_ms = 0; /* accepting again: the next shortage starts small */
        uint8_t src[16];
        source_key(&ss, src);
        if (over_cap(n, src)) {
            close(fd);
            continue;
        }
        zz_conn *c = calloc(1, sizeof *c);
        if (!c) {
            close(fd);
            continue;
        }
        set_sockopts(fd);
        c->kind = C_ACCEPTED;
        c->net = n;
        c->fd = fd;
        c->since_ms = zz_net_now_ms(n);
        memcpy(c->src, src, 16);
        if (ep_set(n, c, EPOLLIN) < 0) {
            close(fd);
            free(c);
            continue;
        }
        c->next = n->accepted;
        if (n->accepted)
            n->accepted->prev = c;
        n->accepted = c;
        n->n_accepted++;
        n->st.conns_open = n->n_accepted;
        n->st.conns_accepted++;
    }
}

/* Every sweep: close accepted connections whose incomplete frame is older than
 * frame_timeout_ms, or that authenticated nothing within unauth_timeout_ms. */
static uint32_t sweep_ms(const zz_net *n)
{
    uint32_t t = n->frame_timeout_ms < n->unauth_timeout_ms ? n->frame_timeout_ms
                                                            : n->unauth_timeout_ms;
    if (n->out_stall_ms < t)
        t = n->out_stall_ms;
    t /= 4;
    return t < 50 ? 50 : t > 1000 ? 1000 : t;
}

static void on_sweep(void *ctx)
{
    zz_net *n = ctx;
    uint64_t now = zz_net_now_ms(n);
    for (zz_conn *c = n->accepted; c; c = c->next) {
        if (c->dead)
            continue;
        if (c->frame_since_ms && now - c->frame_since_ms >= n->frame_timeout_ms) {
            n->st.frame_timeouts++;
            mark_dead(n, c);
        } else if (!c->trusted && now - c->since_ms >= n->unauth_timeout_ms) {
            n->st.unauth_timeouts++;
            mark_dead(n, c);
        } else if (c->acct > 0 && now - c->out_since_ms >= n->out_stall_ms) {
            close_slow(n, c, &n->st.out_stall_timeouts); /* a reader that stopped reading */
        }
    }
    zz_net_timer(n, sweep_ms(n), on_sweep, n);
}

/* Deregistered explicitly: close() alone leaves the registration alive while any other
 * descriptor (a forked child's copy) still refers to the socket, and a later event would
 * then carry a pointer to freed memory. */
static void conn_destroy(zz_net *n, zz_conn *c)
{
    if (c->fd >= 0) {
        ep_set(n, c, 0);
        if (c->abort) {
            /* A reset: a plain close would leave the replies in the kernel's send buffer,
             * and the FIN behind them, for as long as the peer keeps its window shut. */
            struct linger lg = {.l_onoff = 1, .l_linger = 0};
            setsockopt(c->fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
        }
        close(c->fd);
    }
    n->st.in_buffer_bytes -= c->in_cap;
    if (counts_unauth(c))
        n->unauth_buffered -= c->in_cap;
    c->dead = 1;
    out_sync(n, c);
    free(c->in);
    free(c->out);
    free(c);
}

/* ---- the loop ---- */

/* Flush everything queued, then what the links held for the durable barrier, then close
 * what broke, repeating because an on_close handler may queue more output. Replies and
 * early link frames leave before the barrier's sync, the held frames after it. At the end
 * the owner writes what the turn decided even if nothing was sent. */
static void settle(zz_net *n)
{
    while (n->dirty_head || n->dead_head || n->any_held) {
        if (n->barrier_first)
            release_held(n); /* the durable call first: it only asks for the sync */
        while (n->dirty_head) {
            zz_conn *c = n->dirty_head;
            n->dirty_head = c->next_dirty;
            c->dirty = 0;
            c->next_dirty = NULL;
            conn_flush(n, c);
        }
        release_held(n);
        while (n->dead_head) {
            zz_conn *c = n->dead_head;
            n->dead_head = c->next_dead;
            c->next_dead = NULL;
            if (c->kind == C_PEER) {
                link_down(n, c);
                continue;
            }
            if (c->prev)
                c->prev->next = c->next;
            else
                n->accepted = c->next;
            if (c->next)
                c->next->prev = c->prev;
            n->n_accepted--;
            n->st.conns_open = n->n_accepted;
            if (n->on_close)
                n->on_close(n->ctx, c);
            conn_destroy(n, c);
        }
    }
    if (n->barrier)
        n->barrier(n->barrier_ctx, 0);
}

static void run_timers(zz_net *n)
{
    uint64_t now = zz_net_now_ms(n);
    /* Timers added by these callbacks wait for the next iteration, so a callback that
     * re-arms itself with 0 ms cannot starve the sockets. */
    uint64_t last_id = n->next_timer_id;
    while (n->nheap > 0 && n->heap[0].expiry <= now && n->heap[0].id <= last_id) {
        timer_ent t;
        heap_pop(n, &t);
        if (!t.cancelled)
            t.fn(t.ctx);
    }
    /* Drop cancelled entries at the top so they do not shorten the next wait. */
    while (n->nheap > 0 && n->heap[0].cancelled) {
        timer_ent t;
        heap_pop(n, &t);
    }
}

static int next_timeout(zz_net *n)
{
    if (n->nheap == 0)
        return -1;
    uint64_t now = zz_net_now_ms(n);
    if (n->heap[0].expiry <= now)
        return 0;
    uint64_t d = n->heap[0].expiry - now;
    return d > 60000 ? 60000 : (int)d;
}

int zz_net_run(zz_net *n)
{
    struct epoll_event evs[MAX_EVENTS];
    int rc = 0;
    while (!n->stop) {
        settle(n);
        if (n->stop)
            break;
        int ne = epoll_wait(n->ep, evs, MAX_EVENTS, next_timeout(n));
        if (n->kicked) {
            n->kicked = 0;
            if (n->on_kick)
                n->on_kick(n->kick_ctx);
        }
        if (ne < 0) {
            if (errno == EINTR)
                continue;
            rc = -1;
            break;
        }
        /* The owner's descriptor first (a finished sync: the frames waiting for it leave
         * before this turn's messages are handled). */
        for (int i = 0; i < ne; i++)
            if (((zz_conn *)evs[i].data.ptr)->kind == C_WATCH)
                n->watch_fn(n->watch_ctx); /* it reads the descriptor */
        for (int i = 0; i < ne; i++) {
            zz_conn *c = evs[i].data.ptr;
            uint32_t e = evs[i].events;
            if (c->kind == C_LISTEN) {
                accept_all(n);
                continue;
            }
            if (c->kind == C_WATCH)
                continue; /* handled above */
            if (c->kind == C_WAKE) {
                uint64_t v;
                ssize_t r = read(c->fd, &v, sizeof v);
                (void)r; /* only the wakeup matters; the flag says why */
                continue;
            }
            if (c->dead)
                continue;
            if (c->kind == C_PEER && c->state == L_CONNECTING) {
                link_connect_done(n, c);
                continue;
            }
            if (e & (EPOLLIN | EPOLLERR | EPOLLHUP))
                conn_readable(n, c);
            if ((e & EPOLLOUT) && !c->dead)
                conn_flush(n, c);
        }
        if (ne > 0)
            n->st.turns++;
        run_timers(n);
    }
    settle(n); /* best effort: get queued replies out before returning */
    n->stop = 0;
    return rc;
}

/* Async-signal-safe: call it from a SIGTERM handler; the loop returns after the current
 * iteration. */
void zz_net_on_kick(zz_net *n, zz_on_timer fn, void *ctx)
{
    n->on_kick = fn;
    n->kick_ctx = ctx;
}

void zz_net_early(zz_net *n, int on) { n->early = on; }

void zz_net_barrier_first(zz_net *n, int on) { n->barrier_first = on; }

void zz_net_set_barrier(zz_net *n, zz_on_barrier fn, void *ctx)
{
    n->barrier = fn;
    n->barrier_ctx = ctx;
}

void zz_net_kick(zz_net *n)
{
    n->kicked = 1;
    uint64_t one = 1;
    ssize_t r = write(n->wake.fd, &one, sizeof one);
    (void)r; /* a full eventfd counter still wakes the loop */
}

void zz_net_stop(zz_net *n)
{
    n->stop = 1;
    uint64_t one = 1;
    ssize_t r = write(n->wake.fd, &one, sizeof one);
    (void)r; /* a full eventfd counter still wakes the loop */
}

const zz_net_stats *zz_net_get_stats(const zz_net *n)
{
    return &n->st;
}

/* ---- setup and teardown ---- */

static int resolve(const char *host, uint16_t port, int passive, struct sockaddr_storage *ss,
                   socklen_t *sl)
{
    char ps[8];
    snprintf(ps, sizeof ps, "%u", port);
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
    if (getaddrinfo(host, ps, &hints, &res) != 0 || !res)
        return -1;
    memcpy(ss, res->ai_addr, res->ai_addrlen);
    *sl = res->ai_addrlen;
    freeaddrinfo(res);
    return 0;
}

zz_net *zz_net_new(const zz_conf *c, void *ctx, zz_on_frame on_frame, zz_on_close on_close,
                   char *err, size_t errcap)
{
    if (c->n == 0 || c->n > ZZ_MAX_REPLICAS || c->id >= c->n) {
        set_err(err, errcap, "net: bad replica set (id %u, n %u)", c->id, c->n);
        return NULL;
    }
    zz_net *n = calloc(1, sizeof *n);
    if (!n) {
        set_err(err, errcap, "net: out of memory");
        return NULL;
    }
    n->conf = c;
    n->ctx = ctx;
    n->on_frame = on_frame;
    n->on_close = on_close;
    n->ep = -1;
    n->listener.fd = -1;
    n->wake.fd = -1;
    n->listener.kind = C_LISTEN;
    n->wake.kind = C_WAKE;
    n->watch.fd = -1;
    n->watch.kind = C_WATCH;
    n->rng = c->inject_seed ^ (uint64_t)c->id;
    n->inject = c->inject_drop > 0 || c->inject_dup > 0 || c->inject_delay_ms > 0;
    n->n_links = ZZ_MAX_REPLICAS;
    for (uint32_t p = 0; p < MAX_LINKS; p++) {
        zz_conn *l = &n->links[p];
        l->kind = C_PEER;
        l->net = n;
        l->fd = -1;
        l->peer = p;
        l->state = L_DOWN;
        l->backoff_ms = BACKOFF_MIN_MS;
    }
    for (uint32_t p = 0; p < c->n; p++) {
        if (p == c->id)
            continue;
        if (resolve(c->peers[p].host, c->peers[p].port, 0, &n->peer_addr[p],
                    &n->peer_addrlen[p]) < 0) {
            set_err(err, errcap, "net: cannot resolve peer %u host '%s'", p, c->peers[p].host);
            goto fail;
        }
    }
    n->ep = epoll_create1(EPOLL_CLOEXEC);
    n->wake.fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (n->ep < 0 || n->wake.fd < 0 || ep_set(n, &n->wake, EPOLLIN) < 0) {
        set_err(err, errcap, "net: epoll/eventfd: %s", strerror(errno));
        goto fail;
    }
    struct sockaddr_storage ls;
    socklen_t lsl;
    if (resolve(c->listen.host, c->listen.port, 1, &ls, &lsl) < 0) {
        set_err(err, errcap, "net: cannot resolve listen host '%s' port %u", c->listen.host,
                c->listen.port);
        goto fail;
    }
    n->listener.fd = socket(ls.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int one = 1;
    if (n->listener.fd < 0 ||
        setsockopt(n->listener.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0 ||
        bind(n->listener.fd, (struct sockaddr *)&ls, lsl) < 0 ||
        listen(n->listener.fd, 1024) < 0) {
        set_err(err, errcap, "net: listen on %s port %u: %s", c->listen.host, c->listen.port,
                strerror(errno));
        goto fail;
    }
    if (ep_set(n, &n->listener, EPOLLIN) < 0) {
        set_err(err, errcap, "net: epoll: %s", strerror(errno));
        goto fail;
    }
    n->max_conns = c->max_conns ? c->max_conns : 1024;
    n->max_per_source = c->max_conns_per_source ? c->max_conns_per_source : 256;
    n->frame_timeout_ms = c->frame_timeout_ms ? c->frame_timeout_ms : 20000;
    n->unauth_timeout_ms = c->unauth_timeout_ms ? c->unauth_timeout_ms : 10000;
    n->unauth_buffer_max = c->unauth_buffer_bytes ? c->unauth_buffer_bytes : 64u << 20;
    n->client_out_max = c->client_out_bytes ? c->client_out_bytes : 4u << 20;
    n->client_out_total = c->client_out_total ? c->client_out_total : 64u << 20;
    n->out_stall_ms = c->out_stall_timeout_ms ? c->out_stall_timeout_ms : 10000;
    n->n_owners = c->nkeys;
    n->owner_out = calloc(c->nkeys ? c->nkeys : 1, sizeof *n->owner_out);
    n->owner_closes = calloc(c->nkeys ? c->nkeys : 1, sizeof *n->owner_closes);
    if (!n->owner_out || !n->owner_closes) {
        set_err(err, errcap, "net: out of memory");
        goto fail;
    }
    zz_net_timer(n, sweep_ms(n), on_sweep, n);
    return n;
fail:
    zz_net_free(n);
    return NULL;
}

void zz_net_free(zz_net *n)
{
    if (!n)
        return;
    while (n->accepted) {
        zz_conn *c = n->accepted;
        n->accepted = c->next;
        conn_destroy(n, c);
    }
    for (uint32_t p = 0; p < MAX_LINKS; p++) {
        zz_conn *l = &n->links[p];
        if (l->fd >= 0)
            close(l->fd);
        free(l->in);
        free(l->out);
        free(l->held);
        free(l->wait);
    }
    /* Messages parked by the delay injector are owned by their timers. */
    for (size_t i = 0; i < n->nheap; i++)
        if (n->heap[i].fn == on_delayed)
            free(n->heap[i].ctx);
    free(n->heap);
    free(n->owner_out);
    free(n->owner_closes);
    if (n->listener.fd >= 0)
        close(n->listener.fd);
    if (n->wake.fd >= 0)
        close(n->wake.fd);
    if (n->ep >= 0)
        close(n->ep);
    free(n);
}

uint32_t zz_net_conn_tag(const zz_conn *c) { return c ? c->tag : 0; }
void zz_net_conn_set_tag(zz_conn *c, uint32_t tag)
{
    if (c) {
        c->tag = tag;
        zz_net_conn_set_trusted(c); /* labels go to connections whose sender authenticated */
    }
}

uint32_t zz_net_conn_sender(const zz_conn *c) { return c ? c->sender : 0; }
void zz_net_conn_set_sender(zz_conn *c, uint32_t slot_plus_1)
{
    if (c && !c->sender && slot_plus_1 <= ZZ_NET_SENDER_SLOTS)
        c->sender = slot_plus_1;
}

void zz_net_conn_set_trusted(zz_conn *c)
{
    if (!c || c->trusted)
        return;
    if (counts_unauth(c) && c->net)
        c->net->unauth_buffered -= c->in_cap;
    c->trusted = 1;
}

void zz_net_conn_set_owner(zz_net *n, zz_conn *c, uint32_t owner)
{
    if (!c || c->kind != C_ACCEPTED || owner > n->n_owners || c->owner == owner)
        return;
    size_t keep = c->acct; /* the queue moves to the new owner's budget */
    c->acct = 0;
    n->st.out_buffer_bytes -= keep;
    if (c->owner) {
        n->owner_out[c->owner - 1] -= keep;
        n->st.client_out_bytes -= keep;
    }
    c->owner = owner;
    out_sync(n, c);
}

uint64_t zz_net_owner_queued(const zz_net *n, uint32_t owner)
{
    return owner && owner <= n->n_owners ? n->owner_out[owner - 1] : 0;
}

uint64_t zz_net_owner_closes(const zz_net *n, uint32_t owner)
{
    return owner && owner <= n->n_owners ? n->owner_closes[owner - 1] : 0;
}
