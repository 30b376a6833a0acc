/* test_net.c - tests of net.c over real loopback TCP: this process is replica 0, a re-exec'd
 * child (`test_net --child ...`) is replica 1, because one process can run only one loop. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include "net.h"
#include "testutil.h"

/* t_end plus a line for passing cases too, so the log shows what ran. */
static void end_case(tctx *t)
{
    if (!t->case_failures)
        printf("ok   %s\n", t->name);
    t_end(t);
}

/* Test frame: u32 type, u64 seq, u32 total length, then a payload derived from seq. */
enum { T_DATA = 1, T_PING, T_REPORT, T_HELLO, T_QUIT, T_RAW = 99 };
#define BULK 3000
#define INJ 200

static void put32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static void put64(uint8_t *p, uint64_t v)
{
    put32(p, (uint32_t)(v >> 32));
    put32(p + 4, (uint32_t)v);
}

static uint64_t get64(const uint8_t *p)
{
    return (uint64_t)get32(p) << 32 | get32(p + 4);
}

/* Mostly small frames, with a large one now and then so reads and writes split frames. */
static size_t data_len(uint64_t seq)
{
    return seq % 500 == 499 ? 300000 : 16 + (size_t)((seq * 37) % 1500);
}

static size_t make_frame(uint8_t *buf, uint32_t type, uint64_t seq, size_t len)
{
    put32(buf, type);
    put64(buf + 4, seq);
    put32(buf + 12, (uint32_t)len);
    for (size_t i = 16; i < len; i++)
        buf[i] = (uint8_t)(seq * 31 + i);
    return len;
}

typedef struct {
    uint64_t ok, bad, sum, inversions, last;
} rx_stats;

static void rx_data(rx_stats *s, const uint8_t *m, size_t len)
{
    uint64_t seq = get64(m + 4);
    int good = len == data_len(seq) && get32(m + 12) == len;
    for (size_t i = 16; good && i < len; i++)
        good = m[i] == (uint8_t)(seq * 31 + i);
    if (!good) {
        s->bad++;
        return;
    }
    if (s->ok > 0 && seq < s->last)
        s->inversions++;
    s->last = seq;
    s->ok++;
    s->sum += seq;
}

static void send_data(zz_net *n, uint32_t peer, uint64_t seq, uint8_t *buf)
{
    zz_net_send_peer(n, peer, buf, make_frame(buf, T_DATA, seq, data_len(seq)));
}

static void send_small(zz_net *n, uint32_t peer, uint32_t type)
{
    uint8_t b[16];
    zz_net_send_peer(n, peer, b, make_frame(b, type, 0, 16));
}

static void conf_init(zz_conf *c, uint32_t id, const uint16_t ports[4])
{
    memset(c, 0, sizeof *c);
    c->service = 1;
    c->id = id;
    c->g = 1;
    c->n = 4;
    for (int r = 0; r < 4; r++) {
        snprintf(c->peers[r].host, sizeof c->peers[r].host, "127.0.0.1");
        c->peers[r].port = ports[r];
    }
    c->listen = c->peers[id];
}

/* ---- the child: replica 1 ---- */

typedef struct {
    zz_net *net;
    rx_stats rx;
    uint64_t initial; /* DATA frames to send replica 0 at start */
    int timed_out;
} child_state;

static void child_on_frame(void *ctx, zz_conn *conn, const uint8_t *m, size_t len)
{
    child_state *cs = ctx;
    (void)conn;
    uint32_t type = get32(m);
    if (type == T_DATA) {
        rx_data(&cs->rx, m, len);
    } else if (type == T_PING) {
        uint8_t r[16 + 32];
        make_frame(r, T_REPORT, 0, 16);
        put32(r + 12, sizeof r);
        put64(r + 16, cs->rx.ok);
        put64(r + 24, cs->rx.bad);
        put64(r + 32, cs->rx.sum);
        put64(r + 40, cs->rx.inversions);
        zz_net_send_peer(cs->net, 0, r, sizeof r);
    } else if (type == T_QUIT) {
        zz_net_stop(cs->net);
    }
}

static void child_start(void *ctx)
{
    child_state *cs = ctx;
    uint8_t *buf = malloc(300000);
    send_small(cs->net, 0, T_HELLO);
    for (uint64_t s = 0; s < cs->initial; s++)
        send_data(cs->net, 0, s, buf);
    free(buf);
}

static void child_deadline(void *ctx)
{
    child_state *cs = ctx;
    cs->timed_out = 1; /* the parent died or hung: do not linger */
    zz_net_stop(cs->net);
}

static int child_main(char **argv)
{
    static zz_conf c;
    uint16_t ports[4];
    for (int i = 0; i < 4; i++)
        ports[i] = (uint16_t)atoi(argv[i]);
    conf_init(&c, 1, ports);
    child_state cs = {0};
    cs.initial = strtoull(argv[4], NULL, 10);
    char err[256];
    cs.net = zz_net_new(&c, &cs, child_on_frame, NULL, err, sizeof err);
    if (!cs.net) {
        fprintf(stderr, "child: %s\n", err);
        return 2;
    }
    zz_net_timer(cs.net, 0, child_start, &cs);
    zz_net_timer(cs.net, 20000, child_deadline, &cs);
    zz_net_run(cs.net);
    zz_net_free(cs.net);
    return cs.timed_out ? 3 : 0;
}

/* ---- the parent: replica 0 ---- */

typedef struct parent parent;
typedef int (*pred_fn)(parent *p);

struct parent {
    zz_net *net;
    zz_conf conf;
    uint16_t ports[4];
    pred_fn pred;
    int timed_out;
    rx_stats rx;
    int have_report;
    uint64_t rep_ok, rep_bad, rep_sum, rep_inv;
    int hellos, closes, raw_frames;
    zz_conn *hello_conn;
    uint64_t next_seq;
    uint64_t tick_timer;
    uint8_t *buf;
};

static void check_pred(parent *p)
{
    if (p->pred && p->pred(p))
        zz_net_stop(p->net);
}

static void parent_on_frame(void *ctx, zz_conn *conn, const uint8_t *m, size_t len)
{
    parent *p = ctx;
    uint32_t type = get32(m);
    if (type == T_DATA) {
        rx_data(&p->rx, m, len);
    } else if (type == T_REPORT && len == 48) {
        p->have_report = 1;
        p->rep_ok = get64(m + 16);
        p->rep_bad = get64(m + 24);
        p->rep_sum = get64(m + 32);
        p->rep_inv = get64(m + 40);
    } else if (type == T_HELLO) {
        p->hellos++;
        p->hello_conn = conn;
    } else if (type == T_RAW) {
        p->raw_frames++;
    }
    check_pred(p);
}

static void parent_on_close(void *ctx, zz_conn *conn)
{
    parent *p = ctx;
    p->closes++;
    if (conn == p->hello_conn)
        p->hello_conn = NULL;
    check_pred(p);
}

static void on_deadline(void *ctx)
{
    parent *p = ctx;
    p->timed_out = 1;
    zz_net_stop(p->net);
}

/* Run the loop until pred holds (1) or timeout_ms passes (0). */
static int run_until(parent *p, pred_fn pred, uint32_t timeout_ms)
{
    p->pred = pred;
    p->timed_out = 0;
    if (pred && pred(p))
        return 1;
    uint64_t id = zz_net_timer(p->net, timeout_ms, on_deadline, p);
    zz_net_run(p->net);
    zz_net_cancel(p->net, id);
    p->pred = NULL;
    return !p->timed_out;
}

static int pred_bulk(parent *p)
{
    return p->rx.ok + p->rx.bad >= BULK && p->have_report && p->hellos >= 1;
}
static int pred_report(parent *p) { return p->have_report; }
static int pred_hello(parent *p) { return p->hellos >= 1 && p->hello_conn; }
static int pred_closed(parent *p) { return p->closes >= 1; }
static int pred_framing(parent *p)
{
    return zz_net_get_stats(p->net)->framing_errors >= 2 && p->closes >= 2;
}
static int pred_restarted(parent *p) { return p->have_report && p->rep_ok >= 1; }

static pid_t spawn_child(const uint16_t ports[4], uint64_t initial)
{
    char a[4][8], k[24];
    for (int i = 0; i < 4; i++)
        snprintf(a[i], sizeof a[i], "%u", ports[i]);
    snprintf(k, sizeof k, "%llu", (unsigned long long)initial);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        execl("/proc/self/exe", "test_net", "--child", a[0], a[1], a[2], a[3], k, (char *)NULL);
        _exit(127);
    }
    return pid;
}

static int child_exit_status(pid_t pid)
{
    int st = 0;
    if (waitpid(pid, &st, 0) != pid)
        return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* Ports nobody listens on right now; the kernel hands out distinct ephemeral ones. */
static void pick_ports(uint16_t ports[4])
{
    int fds[4];
    for (int i = 0; i < 4; i++) {
        fds[i] = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        socklen_t sl = sizeof sa;
        if (bind(fds[i], (struct sockaddr *)&sa, sl) < 0 ||
            getsockname(fds[i], (struct sockaddr *)&sa, &sl) < 0) {
            perror("pick_ports");
            exit(2);
        }
        ports[i] = ntohs(sa.sin_port);
    }
    for (int i = 0; i < 4; i++)
        close(fds[i]);
}

/* ---- timers ---- */

typedef struct {
    zz_net *net;
    char tag;
    uint32_t ms;
    uint64_t start;
    char *log;
    uint64_t *elapsed;
    uint64_t cancel_id; /* cancelled by this timer when it fires */
} tmr;

static void on_tmr(void *ctx)
{
    tmr *t = ctx;
    size_t i = strlen(t->log);
    t->log[i] = t->tag;
    t->log[i + 1] = '\0';
    t->elapsed[i] = zz_net_now_ms(t->net) - t->start;
    if (t->cancel_id)
        zz_net_cancel(t->net, t->cancel_id);
}

static void on_stop(void *ctx)
{
    zz_net_stop(ctx);
}

static void test_timers(tctx *t, const uint16_t ports[4])
{
    static zz_conf c;
    conf_init(&c, 0, ports);
    char err[256];
    zz_net *n = zz_net_new(&c, NULL, NULL, NULL, err, sizeof err);
    t_begin(t, "timers fire in expiry order; cancel works");
    if (!CHECK(t, n != NULL)) {
        printf("  %s\n", err);
        end_case(t);
        return;
    }
    char log[16] = "";
    uint64_t elapsed[16] = {0};
    uint64_t start = zz_net_now_ms(n);
    /* a(0) cancels x(25) from inside a callback; y(20) is cancelled before the loop runs;
     * b and c share an expiry and must fire in the order they were set. */
    tmr ts[] = {
        {n, 'd', 30, start, log, elapsed, 0}, {n, 'b', 10, start, log, elapsed, 0},
        {n, 'a', 0, start, log, elapsed, 0},  {n, 'c', 10, start, log, elapsed, 0},
        {n, 'y', 20, start, log, elapsed, 0}, {n, 'x', 25, start, log, elapsed, 0},
    };
    uint64_t ids[6];
    for (int i = 0; i < 6; i++)
        ids[i] = zz_net_timer(n, ts[i].ms, on_tmr, &ts[i]);
    ts[2].cancel_id = ids[5];
    zz_net_cancel(n, ids[4]);
    CHECK(t, ids[0] > 0 && ids[1] != ids[0]);
    zz_net_timer(n, 45, on_stop, n);
    zz_net_run(n);
    uint64_t total = zz_net_now_ms(n) - start;
    CHECK(t, strcmp(log, "abcd") == 0);
    if (strcmp(log, "abcd") != 0)
        printf("  fired: %s\n", log);
    static const uint32_t want[] = {0, 10, 10, 30};
    for (int i = 0; i < 4; i++)
        CHECK(t, elapsed[i] >= want[i] && elapsed[i] < want[i] + 500);
    CHECK(t, total >= 45 && total < 1000);
    end_case(t);

    t_begin(t, "stop before run returns at once; run resumes after stop");
    zz_net_stop(n);
    uint64_t t0 = zz_net_now_ms(n);
    zz_net_timer(n, 300, on_stop, n);
    CHECK(t, zz_net_run(n) == 0);
    CHECK(t, zz_net_now_ms(n) - t0 < 200);
    CHECK(t, zz_net_run(n) == 0); /* now waits for the 300 ms timer */
    CHECK(t, zz_net_now_ms(n) - t0 >= 300);
    end_case(t);

    /* What SIGUSR1 relies on: a kick (here from a signal handler's context: only a flag
     * and an eventfd write) has the loop call on_kick at once, not at the next timer. */
    t_begin(t, "a kick runs on_kick in the loop at once");
    zz_net_on_kick(n, on_stop, n);
    t0 = zz_net_now_ms(n);
    zz_net_timer(n, 5000, on_stop, n);
    zz_net_kick(n);
    CHECK(t, zz_net_run(n) == 0);
    CHECK(t, zz_net_now_ms(n) - t0 < 2500);
    end_case(t);
    zz_net_free(n);
}

/* The injector's PRNG depends only on (seed, id): two runs drop the same frames. */
static void test_inject_deterministic(tctx *t, const uint16_t ports[4])
{
    static zz_conf c;
    uint64_t drops[3];
    uint8_t buf[16];
    t_begin(t, "injection is deterministic per seed");
    for (int run = 0; run < 3; run++) {
        conf_init(&c, 0, ports);
        c.inject_drop = 0.5;
        c.inject_seed = run < 2 ? 42 : 43;
        char err[256];
        zz_net *n = zz_net_new(&c, NULL, NULL, NULL, err, sizeof err);
        if (!CHECK(t, n != NULL))
            break;
        for (int i = 0; i < 1000; i++)
            zz_net_send_peer(n, 2, buf, make_frame(buf, T_DATA, (uint64_t)i, 16));
        drops[run] = zz_net_get_stats(n)->injected_drops;
        zz_net_free(n);
    }
    CHECK(t, drops[0] == drops[1]);
    CHECK(t, drops[0] > 400 && drops[0] < 600);
    CHECK(t, drops[2] > 400 && drops[2] < 600);
    end_case(t);
}

static void new_parent(tctx *t, parent *p)
{
    char err[256];
    memset(&p->rx, 0, sizeof p->rx);
    p->have_report = p->hellos = p->closes = p->raw_frames = 0;
    p->hello_conn = NULL;
    p->net = zz_net_new(&p->conf, p, parent_on_frame, parent_on_close, err, sizeof err);
    if (!p->net) {
        printf("zz_net_new: %s\n", err);
        t->failed++;
        t_summary(t);
        exit(1);
    }
}

static void start_bulk(void *ctx)
{
    parent *p = ctx;
    for (uint64_t s = 0; s < BULK; s++)
        send_data(p->net, 1, s, p->buf);
    send_small(p->net, 1, T_PING);
}

static void test_exchange(tctx *t, parent *p, pid_t *child)
{
    t_begin(t, "bulk exchange both ways, content and order intact");
    *child = spawn_child(p->ports, BULK);
    zz_net_timer(p->net, 0, start_bulk, p);
    int ok = run_until(p, pred_bulk, 8000);
    CHECK(t, ok);
    CHECK(t, p->rx.ok == BULK && p->rx.bad == 0 && p->rx.inversions == 0);
    CHECK(t, p->rx.sum == (uint64_t)BULK * (BULK - 1) / 2);
    CHECK(t, p->have_report && p->rep_ok == BULK && p->rep_bad == 0 && p->rep_inv == 0);
    CHECK(t, p->rep_sum == (uint64_t)BULK * (BULK - 1) / 2);
    const zz_net_stats *st = zz_net_get_stats(p->net);
    CHECK(t, st->frames_in >= BULK + 2 && st->frames_out >= BULK + 1);
    CHECK(t, st->framing_errors == 0 && st->conns_accepted >= 1 && st->send_overflow == 0);
    CHECK(t, st->bytes_in > 1000000 && st->bytes_out > 1000000);
    if (!ok)
        printf("  parent rx ok=%llu bad=%llu report=%d\n", (unsigned long long)p->rx.ok,
               (unsigned long long)p->rx.bad, p->have_report);
    end_case(t);
}

static int raw_connect(uint16_t port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        close(fd);
        return -1;
    }
    struct timeval tv = {.tv_sec = 3};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
}

static void test_framing(tctx *t, parent *p)
{
    t_begin(t, "bad frame length closes only that connection");
    int a = raw_connect(p->ports[0]), b = raw_connect(p->ports[0]);
    CHECK(t, a >= 0 && b >= 0);
    uint8_t out[20 + 4];
    put32(out, 16);
    make_frame(out + 4, T_RAW, 0, 16);
    put32(out + 20, 5); /* below the 16-byte header */
    CHECK(t, send(a, out, sizeof out, MSG_NOSIGNAL) == (ssize_t)sizeof out);
    put32(out, ZZ_MAX_MSG + 1);
    CHECK(t, send(b, out, 4, MSG_NOSIGNAL) == 4);
    p->closes = 0;
    CHECK(t, run_until(p, pred_framing, 3000));
    CHECK(t, zz_net_get_stats(p->net)->framing_errors == 2);
    CHECK(t, p->raw_frames == 1); /* the good frame before the bad length was delivered */
    CHECK(t, p->closes == 2);
    char c;
    CHECK(t, recv(a, &c, 1, 0) == 0); /* EOF: the replica closed it */
    CHECK(t, recv(b, &c, 1, 0) == 0);
    close(a);
    close(b);
    /* The link to the child is unaffected. */
    p->have_report = 0;
    send_small(p->net, 1, T_PING);
    CHECK(t, run_until(p, pred_report, 3000));
    CHECK(t, p->rep_ok == BULK);
    end_case(t);
}

static void on_tick(void *ctx)
{
    parent *p = ctx;
    send_data(p->net, 1, p->next_seq++, p->buf);
    send_small(p->net, 1, T_PING);
    p->tick_timer = zz_net_timer(p->net, 20, on_tick, p);
}

static void test_reconnect(tctx *t, parent *p, pid_t *child)
{
    t_begin(t, "peer link reconnects after the peer is killed and restarted");
    kill(*child, SIGKILL);
    child_exit_status(*child);
    /* Large sends write at once (no loop iteration in between) into the dead peer's socket:
     * EPIPE must be an error return, not a SIGPIPE that kills the replica. */
    usleep(50000);
    for (uint64_t s = 499; s < 5000; s += 500)
        send_data(p->net, 1, s, p->buf);
    uint64_t rc0 = zz_net_get_stats(p->net)->reconnects;
    p->have_report = 0;
    p->hellos = 0;
    p->closes = 0;
    p->next_seq = 100000;
    p->tick_timer = zz_net_timer(p->net, 0, on_tick, p);
    /* Let the parent notice the dead peer and fail a few connects before the restart. */
    run_until(p, NULL, 150);
    CHECK(t, p->closes >= 1); /* the child's link into us closed */
    *child = spawn_child(p->ports, 0);
    CHECK(t, run_until(p, pred_restarted, 5000));
    zz_net_cancel(p->net, p->tick_timer);
    CHECK(t, p->rep_bad == 0 && p->rep_ok >= 1);
    CHECK(t, zz_net_get_stats(p->net)->reconnects > rc0);
    end_case(t);

    t_begin(t, "child exits cleanly on QUIT");
    p->closes = 0;
    send_small(p->net, 1, T_QUIT);
    CHECK(t, run_until(p, pred_closed, 3000));
    CHECK(t, child_exit_status(*child) == 0);
    *child = 0;
    end_case(t);
}

/* One fault-injection mode against a fresh child; PING travels on the child's own link
 * (zz_net_send_conn), which is not subject to injection. */
static void inject_case(tctx *t, parent *p, const char *name, double drop, double dup,
                        uint32_t delay)
{
    t_begin(t, name);
    p->conf.inject_drop = drop;
    p->conf.inject_dup = dup;
    p->conf.inject_delay_ms = delay;
    p->conf.inject_seed = 7;
    new_parent(t, p);
    pid_t child = spawn_child(p->ports, 0);
    CHECK(t, run_until(p, pred_hello, 3000));
    for (uint64_t s = 0; s < INJ; s++)
        send_data(p->net, 1, s, p->buf);
    run_until(p, NULL, delay + 300); /* let everything that will arrive arrive */
    uint8_t b[16];
    if (CHECK(t, p->hello_conn != NULL))
        zz_net_send_conn(p->net, p->hello_conn, b, make_frame(b, T_PING, 0, 16));
    CHECK(t, run_until(p, pred_report, 3000));
    const zz_net_stats *st = zz_net_get_stats(p->net);
    uint64_t sum = (uint64_t)INJ * (INJ - 1) / 2;
    CHECK(t, p->rep_bad == 0);
    if (drop >= 1.0) {
        CHECK(t, p->rep_ok == 0 && st->injected_drops == INJ);
    } else if (dup >= 1.0) {
        CHECK(t, p->rep_ok == 2 * INJ && p->rep_sum == 2 * sum && st->injected_dups == INJ);
    } else {
        CHECK(t, p->rep_ok == INJ && p->rep_sum == sum);
        CHECK(t, st->injected_delays > INJ / 2 && p->rep_inv > 0); /* reordered */
    }
    if (p->hello_conn)
        zz_net_send_conn(p->net, p->hello_conn, b, make_frame(b, T_QUIT, 0, 16));
    p->closes = 0;
    CHECK(t, run_until(p, pred_closed, 3000));
    CHECK(t, child_exit_status(child) == 0);
    zz_net_free(p->net);
    p->net = NULL;
    end_case(t);
}

/* ---- the durability barrier (zz_net_set_barrier, zz_net_early) ---- */

typedef struct {
    zz_net *net;
    int durable_calls;
    int watching;            /* record the next durable call */
    uint64_t out_at_durable; /* bytes written to sockets when it came */
    uint64_t ticket;         /* what the durable call returns */
} bar_state;

static uint64_t on_barrier(void *ctx, int durable)
{
    bar_state *b = ctx;
    if (!durable)
        return 0;
    b->durable_calls++;
    if (b->watching) {
        b->watching = 0;
        b->out_at_durable = zz_net_get_stats(b->net)->bytes_out;
    }
    return b->ticket;
}

static void send_held_then_early(void *ctx)
{
    zz_net *n = ctx;
    uint8_t b[16];
    zz_net_send_peer(n, 1, b, make_frame(b, T_DATA, 1, 16)); /* held for the barrier */
    zz_net_early(n, 1);
    zz_net_send_peer(n, 1, b, make_frame(b, T_DATA, 2, 16)); /* needs only the write */
    zz_net_early(n, 0);
}

/* Run the loop in 50 ms steps until `bytes` were written to sockets (5 s at most). */
static int run_until_out(zz_net *n, uint64_t bytes)
{
    for (int i = 0; i < 100 && zz_net_get_stats(n)->bytes_out < bytes; i++) {
        zz_net_timer(n, 50, on_stop, n);
        zz_net_run(n);
    }
    return zz_net_get_stats(n)->bytes_out >= bytes;
}

/* Read one 20-byte frame (u32 length 16 + a test frame) and return its seq; -1 on error. */
static long read_frame(int fd)
{
    uint8_t f[20];
    size_t got = 0;
    while (got < sizeof f) {
        ssize_t r = recv(fd, f + got, sizeof f - got, 0);
        if (r <= 0)
            return -1;
        got += (size_t)r;
    }
    return get32(f) == 16 && get32(f + 4) == T_DATA ? (long)get64(f + 8) : -1;
}

/* first: zz_net_barrier_first, the durable call before the turn's socket writes. */
static void test_barrier(tctx *t, int first)
{
    static zz_conf c;
    uint16_t ports[4];
    pick_ports(ports);
    /* Peer 1 is a plain socket here, to see the bytes in the order they leave. */
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof sa;
    t_begin(t, first ? "barrier first: the durable call before any byte of the turn, frames in "
                       "the same order"
                     : "barrier: held link frames leave after the durable call, early ones before");
    if (!CHECK(t, lfd >= 0 && bind(lfd, (struct sockaddr *)&sa, sl) == 0 &&
                      getsockname(lfd, (struct sockaddr *)&sa, &sl) == 0 &&
                      listen(lfd, 4) == 0)) {
        end_case(t);
        return;
    }
    ports[1] = ntohs(sa.sin_port);
    conf_init(&c, 0, ports);
    char err[256];
    zz_net *n = zz_net_new(&c, NULL, NULL, NULL, err, sizeof err);
    if (!CHECK(t, n != NULL)) {
        printf("  %s\n", err);
        close(lfd);
        end_case(t);
        return;
    }
    bar_state b = {n, 0, 0, 0, 0};
    zz_net_set_barrier(n, on_barrier, &b);
    zz_net_barrier_first(n, first);
    uint8_t f[16];
    zz_net_send_peer(n, 1, f, make_frame(f, T_DATA, 0, 16)); /* connects the link */
    CHECK(t, run_until_out(n, 20));
    CHECK(t, b.durable_calls == 1);
    uint64_t base = zz_net_get_stats(n)->bytes_out;
    b.watching = 1;
    zz_net_timer(n, 0, send_held_then_early, n);
    CHECK(t, run_until_out(n, base + 40));
    CHECK(t, b.durable_calls == 2);
    /* Only the early frame had left when the durable call came (none, with first). */
    CHECK(t, b.out_at_durable == base + (first ? 0 : 20));
    struct timeval tv = {5, 0};
    int cfd = accept(lfd, NULL, NULL);
    CHECK(t, cfd >= 0);
    if (cfd >= 0) {
        setsockopt(cfd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        long s0 = read_frame(cfd), s1 = read_frame(cfd), s2 = read_frame(cfd);
        CHECK(t, s0 == 0 && s1 == 2 && s2 == 1);
        if (!(s0 == 0 && s1 == 2 && s2 == 1))
            printf("  frames arrived as seq %ld, %ld, %ld\n", s0, s1, s2);
        close(cfd);
    }
    zz_net_free(n);
    close(lfd);
    end_case(t);
}

/* A sync off the loop: the durable call returns a ticket and the frames of that turn wait
 * for zz_net_release while the loop runs; later frames of the link never overtake them. */
typedef struct {
    zz_net *net;
    uint64_t seq;
} send_arg;

static void send_held(void *ctx)
{
    send_arg *a = ctx;
    uint8_t b[16];
    zz_net_send_peer(a->net, 1, b, make_frame(b, T_DATA, a->seq, 16));
}

typedef struct {
    zz_net *net;
    uint64_t ticket;
} release_arg;

static void release_ticket(void *ctx)
{
    release_arg *a = ctx;
    zz_net_release(a->net, a->ticket);
}

/* Run the loop for `ms`. */
static void run_for(zz_net *n, uint32_t ms)
{
    zz_net_timer(n, ms, on_stop, n);
    zz_net_run(n);
}

static void test_barrier_ticket(tctx *t)
{
    static zz_conf c;
    uint16_t ports[4];
    pick_ports(ports);
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof sa;
    t_begin(t, "barrier ticket: held frames wait for zz_net_release, in order, the loop runs");
    if (!CHECK(t, lfd >= 0 && bind(lfd, (struct sockaddr *)&sa, sl) == 0 &&
                      getsockname(lfd, (struct sockaddr *)&sa, &sl) == 0 &&
                      listen(lfd, 4) == 0)) {
        end_case(t);
        return;
    }
    ports[1] = ntohs(sa.sin_port);
    conf_init(&c, 0, ports);
    char err[256];
    zz_net *n = zz_net_new(&c, NULL, NULL, NULL, err, sizeof err);
    if (!CHECK(t, n != NULL)) {
        printf("  %s\n", err);
        close(lfd);
        end_case(t);
        return;
    }
    bar_state b = {n, 0, 0, 0, 0};
    zz_net_set_barrier(n, on_barrier, &b);
    uint8_t f[16];
    zz_net_send_peer(n, 1, f, make_frame(f, T_DATA, 0, 16)); /* ticket 0: leaves at once */
    CHECK(t, run_until_out(n, 20));
    uint64_t base = zz_net_get_stats(n)->bytes_out;
    send_arg a1 = {n, 1}, a2 = {n, 2}, a3 = {n, 3};
    b.ticket = 7; /* the turn's frames wait for ticket 7 */
    zz_net_timer(n, 0, send_held, &a1);
    run_for(n, 150);
    CHECK(t, zz_net_get_stats(n)->bytes_out == base);
    CHECK(t, zz_net_get_stats(n)->waited == 1);
    b.ticket = 0; /* nothing to sync for this turn: still behind frame 1 */
    zz_net_timer(n, 0, send_held, &a2);
    run_for(n, 100);
    CHECK(t, zz_net_get_stats(n)->bytes_out == base);
    release_arg r6 = {n, 6}, r7 = {n, 7};
    zz_net_timer(n, 0, release_ticket, &r6); /* an earlier ticket releases nothing */
    run_for(n, 100);
    CHECK(t, zz_net_get_stats(n)->bytes_out == base);
    zz_net_timer(n, 0, release_ticket, &r7);
    CHECK(t, run_until_out(n, base + 40));
    /* Ticket 7 is released: a turn asking for it (or less) sends at once. */
    b.ticket = 7;
    zz_net_timer(n, 0, send_held, &a3);
    CHECK(t, run_until_out(n, base + 60));
    struct timeval tv = {5, 0};
    int cfd = accept(lfd, NULL, NULL);
    CHECK(t, cfd >= 0);
    if (cfd >= 0) {
        setsockopt(cfd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        long s0 = read_frame(cfd), s1 = read_frame(cfd), s2 = read_frame(cfd);
        long s3 = read_frame(cfd);
        CHECK(t, s0 == 0 && s1 == 1 && s2 == 2 && s3 == 3);
        if (!(s0 == 0 && s1 == 1 && s2 == 2 && s3 == 3))
            printf("  frames arrived as seq %ld, %ld, %ld, %ld\n", s0, s1, s2, s3);
        close(cfd);
    }
    zz_net_free(n);
    close(lfd);
    end_case(t);
}

int main(int argc, char **argv)
{
    if (argc == 7 && strcmp(argv[1], "--child") == 0)
        return child_main(argv + 2);
    tctx t = {0};
    static parent p;
    pick_ports(p.ports);
    p.buf = malloc(300000);
    test_timers(&t, p.ports);
    test_inject_deterministic(&t, p.ports);
    test_barrier(&t, 0);
    test_barrier(&t, 1);
    test_barrier_ticket(&t);

    conf_init(&p.conf, 0, p.ports);
    new_parent(&t, &p);
    pid_t child = 0;
    test_exchange(&t, &p, &child);
    test_framing(&t, &p);
    test_reconnect(&t, &p, &child);
    if (child > 0) {
        kill(child, SIGKILL);
        child_exit_status(child);
    }
    zz_net_free(p.net);
    p.net = NULL;

    inject_case(&t, &p, "inject drop=1.0 delivers nothing", 1.0, 0, 0);
    inject_case(&t, &p, "inject dup=1.0 delivers everything twice", 0, 1.0, 0);
    inject_case(&t, &p, "inject delay reorders but delivers all", 0, 0, 50);
    free(p.buf);
    return t_summary(&t);
}
