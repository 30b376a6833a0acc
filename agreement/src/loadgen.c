/* loadgen.c - zz-loadgen, a closed-loop load generator for one agreement cluster.
 * N logical clients share one epoll loop and one TCP connection per replica, so a
 * single process can offer enough load to measure the ordering path (scripts/bench). */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "conf.h"
#include "crypto.h"
#include "wire.h"

#define LG_MAX_WBUF (64u << 20) /* per connection; beyond it we drop and rely on retransmission */
#define LG_MAX_CLIENTS 4096u

typedef struct {
    struct sockaddr_storage sa;
    socklen_t salen;
    char host[64];
    uint16_t port;
    int fd;          /* -1 = down */
    int connecting;  /* non-blocking connect in progress */
    uint64_t epoch;  /* bumped per established connection: replicas forget us on close */
    uint64_t next_try_ns;
    uint8_t *rbuf;
    size_t rlen, rcap;
    uint8_t *wbuf;
    size_t woff, wlen, wcap;
} lg_conn;

typedef struct {
    uint32_t principal;
    zz_conf *keys; /* holds this client's MAC keys (heap: zz_conf is large) */
    zz_mackey *mac[ZZ_MAX_REPLICAS];
    uint32_t rcv[ZZ_MAX_REPLICAS];
    uint64_t reg_epoch[ZZ_MAX_REPLICAS]; /* conn epoch our request last reached replica r in */
    uint64_t t;                          /* timestamp of the outstanding request */
    uint64_t seq;                        /* requests issued, for distinct op contents */
    int busy;
    uint64_t start_ns, retry_ns;
    uint32_t retries;
    zz_buf req; /* the framed REQUEST: u32 prefix + message + MAC vector */
    size_t msg_off;
    uint8_t *op;
    /* REPLY votes for the outstanding request, one per replica */
    uint8_t have[ZZ_MAX_REPLICAS];
    uint32_t vview[ZZ_MAX_REPLICAS];
    uint8_t vdig[ZZ_MAX_REPLICAS][ZZ_DIGEST_LEN];
} lg_client;

typedef struct {
    /* client file */
    uint16_t service;
    uint32_t g, n;
    char key_dir[512];
    char public_path[600];
    uint32_t client_base, clients_avail;
    uint32_t timeout_ms;
    uint32_t sign_always; /* 1: every request signed (client_signatures = "always") */
    int have_peer[ZZ_MAX_REPLICAS];
    /* run */
    lg_conn conns[ZZ_MAX_REPLICAS];
    lg_client *cl;
    uint32_t ncl;
    uint32_t payload;
    uint32_t view;
    int ep;
    double *lat;
    size_t nlat, latcap;
    uint64_t completed, retransmits, wrong, bad_replies, reconnects, wdrops;
    uint64_t end_ns;
    int measuring;
} lg;

static volatile sig_atomic_t lg_stop_flag; /* async-signal-safe stop request: the only global */

static void on_sigint(int s) {
    (void)s;
    lg_stop_flag = 1;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t wall_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000ull + (uint64_t)ts.tv_nsec / 1000u;
}

static int parse_u32(const char *s, uint32_t max, uint32_t *out) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || v > max) return -1;
    *out = (uint32_t)v;
    return 0;
}

/* The client file (docs/config.md, "Load generator"). */
static int load_client_conf(lg *L, const char *path, char *err, size_t errcap) {
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(err, errcap, "%s: %s", path, strerror(errno));
        return -1;
    }
    char line[1024];
    unsigned lineno = 0;
    int have_service = 0, have_g = 0;
    L->client_base = ZZ_PRINCIPAL_CLIENT;
    L->timeout_ms = 1000;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        size_t ll = strlen(line);
        if (ll == sizeof line - 1 && line[ll - 1] != '\n') {
            snprintf(err, errcap, "%s:%u: line too long", path, lineno);
            goto fail;
        }
        char *hash = strchr(line, '#');
        if (hash) *hash = 0;
        char *save = NULL;
        char *key = strtok_r(line, " \t\r\n", &save);
        if (!key) continue;
        char *a1 = strtok_r(NULL, " \t\r\n", &save);
        char *a2 = strtok_r(NULL, " \t\r\n", &save);
        char *a3 = strtok_r(NULL, " \t\r\n", &save);
        char *extra = strtok_r(NULL, " \t\r\n", &save);
        uint32_t v;
        if (!a1) {
            snprintf(err, errcap, "%s:%u: %s: missing value", path, lineno, key);
            goto fail;
        }
        if (!strcmp(key, "peer")) {
            uint32_t r, port;
            if (!a2 || !a3 || extra || parse_u32(a1, ZZ_MAX_REPLICAS - 1, &r) ||
                parse_u32(a3, 65535, &port) || strlen(a2) >= sizeof L->conns[0].host) {
                snprintf(err, errcap, "%s:%u: peer: expected R HOST PORT", path, lineno);
                goto fail;
            }
            snprintf(L->conns[r].host, sizeof L->conns[r].host, "%s", a2);
            L->conns[r].port = (uint16_t)port;
            L->have_peer[r] = 1;
            continue;
        }
        if (a2) {
            snprintf(err, errcap, "%s:%u: %s: one value expected", path, lineno, key);
            goto fail;
        }
        if (!strcmp(key, "service")) {
            if (parse_u32(a1, 65535, &v) || v == 0) {
                snprintf(err, errcap, "%s:%u: service: must be 1..65535", path, lineno);
                goto fail;
            }
            L->service = (uint16_t)v;
            have_service = 1;
        } else if (!strcmp(key, "g")) {
            if (parse_u32(a1, (ZZ_MAX_REPLICAS - 1) / 3, &v) || v == 0) {
                snprintf(err, errcap, "%s:%u: g: must be 1..%u", path, lineno,
                         (ZZ_MAX_REPLICAS - 1) / 3);
                goto fail;
            }
            L->g = v;
            have_g = 1;
        } else if (!strcmp(key, "key_dir")) {
            if (strlen(a1) >= sizeof L->key_dir) {
                snprintf(err, errcap, "%s:%u: key_dir: too long", path, lineno);
                goto fail;
            }
            snprintf(L->key_dir, sizeof L->key_dir, "%s", a1);
        } else if (!strcmp(key, "public")) {
            if (strlen(a1) >= sizeof L->public_path) {
                snprintf(err, errcap, "%s:%u: public: too long", path, lineno);
                goto fail;
            }
            snprintf(L->public_path, sizeof L->public_path, "%s", a1);
        } else if (!strcmp(key, "client_base")) {
            if (parse_u32(a1, UINT32_MAX - LG_MAX_CLIENTS, &v) || v < ZZ_PRINCIPAL_CLIENT) {
                snprintf(err, errcap, "%s:%u: client_base: must be >= %u", path, lineno,
                         ZZ_PRINCIPAL_CLIENT);
                goto fail;
            }
            L->client_base = v;
        } else if (!strcmp(key, "clients")) {
            if (parse_u32(a1, LG_MAX_CLIENTS, &v)) {
                snprintf(err, errcap, "%s:%u: clients: must be 0..%u", path, lineno,
                         LG_MAX_CLIENTS);
                goto fail;
            }
            L->clients_avail = v;
        } else if (!strcmp(key, "timeout_ms")) {
            if (parse_u32(a1, 600000, &v) || v == 0) {
                snprintf(err, errcap, "%s:%u: timeout_ms: must be 1..600000", path, lineno);
                goto fail;
            }
            L->timeout_ms = v;
        } else if (!strcmp(key, "sign_always")) {
            if (parse_u32(a1, 1, &v)) {
                snprintf(err, errcap, "%s:%u: sign_always: must be 0 or 1", path, lineno);
                goto fail;
            }
            L->sign_always = v;
        } else {
            snprintf(err, errcap, "%s:%u: unknown key %s", path, lineno, key);
            goto fail;
        }
    }
    fclose(f);
    if (!have_service || !have_g || !L->key_dir[0]) {
        snprintf(err, errcap, "%s: service, g and key_dir are required", path);
        return -1;
    }
    L->n = 3 * L->g + 1;
    for (uint32_t r = 0; r < ZZ_MAX_REPLICAS; r++) {
        if (r < L->n && !L->have_peer[r]) {
            snprintf(err, errcap, "%s: peer %u missing (n = %u)", path, r, L->n);
            return -1;
        }
        if (r >= L->n && L->have_peer[r]) {
            snprintf(err, errcap, "%s: peer %u out of range (n = %u)", path, r, L->n);
            return -1;
        }
    }
    if (!L->public_path[0]) {
        int w = snprintf(L->public_path, sizeof L->public_path, "%s/public", L->key_dir);
        if (w < 0 || (size_t)w >= sizeof L->public_path) {
            snprintf(err, errcap, "%s: key_dir too long", path);
            return -1;
        }
    }
    return 0;
fail:
    fclose(f);
    return -1;
}

static int resolve(lg_conn *c, char *err, size_t errcap) {
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    char port[8];
    snprintf(port, sizeof port, "%u", (unsigned)c->port);
    int rc = getaddrinfo(c->host, port, &hints, &res);
    if (rc || !res) {
        snprintf(err, errcap, "resolve %s: %s", c->host, gai_strerror(rc));
        return -1;
    }
    if (res->ai_addrlen > sizeof c->sa) {
        freeaddrinfo(res);
        snprintf(err, errcap, "resolve %s: address too long", c->host);
        return -1;
    }
    memcpy(&c->sa, res->ai_addr, res->ai_addrlen);
    c->salen = res->ai_addrlen;
    freeaddrinfo(res);
    return 0;
}

static void conn_close(lg *L, lg_conn *c, uint64_t now) {
    if (c->fd >= 0) {
        epoll_ctl(L->ep, EPOLL_CTL_DEL, c->fd, NULL);
        close(c->fd);
    }
    c->fd = -1;
    c->connecting = 0;
    c->rlen = 0;
    c->woff = c->wlen = 0;
    c->next_try_ns = now + 100000000ull; /* 100 ms between attempts: a dead replica is cheap */
}

static void conn_update_events(lg *L, lg_conn *c) {
    struct epoll_event ev;
    memset(&ev, 0, sizeof ev);
    ev.events = EPOLLIN | ((c->connecting || c->wlen > c->woff) ? EPOLLOUT : 0);
    ev.data.ptr = c;
    epoll_ctl(L->ep, EPOLL_CTL_MOD, c->fd, &ev);
}

static void conn_try(lg *L, lg_conn *c, uint64_t now) {
    if (c->fd >= 0 || now < c->next_try_ns) return;
    int fd = socket(c->sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        c->next_try_ns = now + 100000000ull;
        return;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int rc = connect(fd, (struct sockaddr *)&c->sa, c->salen);
    if (rc < 0 && errno != EINPROGRESS) {
        close(fd);
        c->next_try_ns = now + 100000000ull;
        return;
    }
    c->fd = fd;
    c->connecting = rc < 0;
    if (!c->connecting) c->epoch++;
    struct epoll_event ev;
    memset(&ev, 0, sizeof ev);
    ev.events = EPOLLIN | EPOLLOUT;
    ev.data.ptr = c;
    if (epoll_ctl(L->ep, EPOLL_CTL_ADD, fd, &ev) < 0) {
        close(fd);
        c->fd = -1;
        c->connecting = 0;
        c->next_try_ns = now + 100000000ull;
        return;
    }
    L->reconnects++;
}

static void conn_flush(lg *L, lg_conn *c, uint64_t now) {
    while (c->fd >= 0 && !c->connecting && c->woff < c->wlen) {
        ssize_t w = send(c->fd, c->wbuf + c->woff, c->wlen - c->woff, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
            if (errno == EINTR) continue;
            conn_close(L, c, now);
            return;
        }
        c->woff += (size_t)w;
    }
    if (c->woff == c->wlen) c->woff = c->wlen = 0;
    if (c->fd >= 0) conn_update_events(L, c);
}

/* Queue one frame; a frame for a down or backed-up link is dropped, which the client's
 * retransmission timer covers, as it would a lost packet. */
static int conn_send(lg *L, lg_conn *c, const uint8_t *p, size_t n, uint64_t now) {
    if (c->fd < 0 || c->connecting) return -1;
    if (c->wlen + n > LG_MAX_WBUF) {
        L->wdrops++;
        return -1;
    }
    if (c->woff > 0 && c->woff == c->wlen) c->woff = c->wlen = 0;
    if (c->wlen + n > c->wcap) {
        size_t nc = c->wcap ? c->wcap : 65536;
        while (nc < c->wlen + n) nc *= 2;
        uint8_t *nb = realloc(c->wbuf, nc);
        if (!nb) {
            L->wdrops++;
            return -1;
        }
        c->wbuf = nb;
        c->wcap = nc;
    }
    memcpy(c->wbuf + c->wlen, p, n);
    c->wlen += n;
    conn_flush(L, c, now);
    return 0;
}

static void client_send_to(lg *L, lg_client *cl, uint32_t r, uint64_t now) {
    lg_conn *c = &L->conns[r];
    if (conn_send(L, c, cl->req.p, cl->req.len, now) == 0) cl->reg_epoch[r] = c->epoch;
}

/* Send the outstanding request to the primary, and also to every replica that has not
 * yet seen one of our requests on its current connection: a replica replies on the
 * connection a client's request arrived on, so it must learn that connection. */
static void client_send(lg *L, lg_client *cl, int to_all, uint64_t now) {
    uint32_t primary = L->view % L->n;
    for (uint32_t r = 0; r < L->n; r++) {
        if (to_all || r == primary || cl->reg_epoch[r] != L->conns[r].epoch)
            client_send_to(L, cl, r, now);
    }
}

/* Encode the outstanding request into cl->req (u32 frame prefix + message): MACs only, or
 * signed too (auth kind 3), as a client does when it retransmits (docs/agreement.md
 * "Signed requests": only a signed request makes backups suspect the primary). */
static int client_encode(lg *L, lg_client *cl, int sign) {
    zz_buf_reset(&cl->req);
    zz_put_u32(&cl->req, 0);
    size_t start = zz_enc_request_kind(&cl->req, sign ? ZZ_AUTH_MAC_SIG : ZZ_AUTH_MAC,
                                       L->service, cl->principal, cl->t, 0, cl->op, L->payload);
    if (sign) {
        if (!cl->keys->sign ||
            zz_auth_mac_sig(&cl->req, start, cl->rcv, cl->mac, (uint16_t)L->n, cl->keys->sign))
            return -1;
    } else {
        zz_auth_mac(&cl->req, start, cl->rcv, cl->mac, (uint16_t)L->n);
    }
    if (cl->req.oom || cl->req.len - 4 > ZZ_MAX_MSG) return -1;
    uint32_t flen = (uint32_t)(cl->req.len - 4);
    cl->req.p[0] = (uint8_t)(flen >> 24);
    cl->req.p[1] = (uint8_t)(flen >> 16);
    cl->req.p[2] = (uint8_t)(flen >> 8);
    cl->req.p[3] = (uint8_t)flen;
    return 0;
}

static int client_issue(lg *L, lg_client *cl, uint64_t now) {
    cl->t++;
    cl->seq++;
    /* Distinct op bytes per request so a stale or misrouted reply cannot match. */
    for (uint32_t i = 0; i < L->payload; i++)
        cl->op[i] = (uint8_t)((cl->seq >> (8 * (i % 8))) ^ (cl->principal >> (8 * (i % 4))) ^ i);
    if (client_encode(L, cl, (int)L->sign_always) < 0) return -1;
    memset(cl->have, 0, sizeof cl->have);
    cl->busy = 1;
    cl->start_ns = now;
    cl->retries = 0;
    cl->retry_ns = now + (uint64_t)L->timeout_ms * 1000000ull;
    client_send(L, cl, 0, now);
    return 0;
}

static int record_latency(lg *L, double ms) {
    if (L->nlat == L->latcap) {
        size_t nc = L->latcap ? L->latcap * 2 : 65536;
        double *nl = realloc(L->lat, nc * sizeof *nl);
        if (!nl) return -1;
        L->lat = nl;
        L->latcap = nc;
    }
    L->lat[L->nlat++] = ms;
    return 0;
}

static void on_reply(lg *L, const uint8_t *msg, size_t len, uint64_t now) {
    zz_msg m;
    if (zz_decode(msg, len, &m) != ZZ_OK || m.type != ZZ_REPLY || m.service != L->service ||
        m.sender >= L->n) {
        L->bad_replies++;
        return;
    }
    uint32_t client = m.u.reply.client;
    if (client < L->client_base || client - L->client_base >= L->ncl) {
        L->bad_replies++;
        return;
    }
    lg_client *cl = &L->cl[client - L->client_base];
    if (!zz_verify_mac(&m, cl->principal, cl->mac[m.sender])) {
        L->bad_replies++;
        return;
    }
    if (!cl->busy || m.u.reply.timestamp != cl->t) return; /* late reply to an earlier request */
    uint32_t s = m.sender;
    cl->have[s] = 1;
    cl->vview[s] = m.u.reply.view;
    zz_sha256(m.u.reply.result.p, m.u.reply.result.len, cl->vdig[s]);
    uint32_t match = 0, views[ZZ_MAX_REPLICAS];
    for (uint32_t r = 0; r < L->n; r++)
        if (cl->have[r] && zz_ct_equal(cl->vdig[r], cl->vdig[s], ZZ_DIGEST_LEN))
            views[match++] = cl->vview[r];
    if (match < L->g + 1) return;
    /* Accepted: g+1 replicas, at least one correct, vouch for this result. */
    if (m.u.reply.result.len != L->payload ||
        (L->payload && memcmp(m.u.reply.result.p, cl->op, L->payload) != 0))
        L->wrong++;
    /* Follow the view that g+1 of them report (the (g+1)-th highest): a single
     * faulty replica cannot steer us to a view of its choosing. */
    for (uint32_t i = 0; i < match; i++)
        for (uint32_t j = i + 1; j < match; j++)
            if (views[j] > views[i]) {
                uint32_t tmp = views[i];
                views[i] = views[j];
                views[j] = tmp;
            }
    if (views[L->g] > L->view) L->view = views[L->g];
    cl->busy = 0;
    if (L->measuring) {
        L->completed++;
        if (record_latency(L, (double)(now - cl->start_ns) / 1e6) < 0) L->measuring = 0;
        if (now < L->end_ns && client_issue(L, cl, now) < 0) L->measuring = 0;
    }
}

static void conn_read(lg *L, lg_conn *c, uint64_t now) {
    for (;;) {
        if (c->rcap - c->rlen < 65536) {
            size_t nc = c->rcap ? c->rcap * 2 : 131072;
            if (nc > ZZ_MAX_MSG + 4 + 65536) nc = ZZ_MAX_MSG + 4 + 65536;
            if (nc <= c->rcap) { /* buffer at its limit yet no full frame: cannot happen */
                conn_close(L, c, now);
                return;
            }
            uint8_t *nb = realloc(c->rbuf, nc);
            if (!nb) {
                conn_close(L, c, now);
                return;
            }
            c->rbuf = nb;
            c->rcap = nc;
        }
        ssize_t rd = recv(c->fd, c->rbuf + c->rlen, c->rcap - c->rlen, 0);
        if (rd == 0) {
            conn_close(L, c, now);
            return;
        }
        if (rd < 0) {
            if (errno == EINTR) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) conn_close(L, c, now);
            return;
        }
        c->rlen += (size_t)rd;
        size_t off = 0;
        while (c->rlen - off >= 4) {
            const uint8_t *p = c->rbuf + off;
            uint32_t fl = (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
            if (fl < ZZ_HDR_LEN || fl > ZZ_MAX_MSG) { /* cannot resynchronise */
                conn_close(L, c, now);
                return;
            }
            if (c->rlen - off - 4 < fl) break;
            on_reply(L, p + 4, fl, now);
            off += 4 + (size_t)fl;
            if (c->fd < 0) return;
        }
        if (off) {
            memmove(c->rbuf, c->rbuf + off, c->rlen - off);
            c->rlen -= off;
        }
    }
}

static void on_event(lg *L, lg_conn *c, uint32_t events, uint64_t now) {
    if (c->fd < 0) return;
    if (c->connecting && (events & (EPOLLOUT | EPOLLERR | EPOLLHUP))) {
        int e = 0;
        socklen_t el = sizeof e;
        if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &e, &el) < 0 || e) {
            conn_close(L, c, now);
            return;
        }
        c->connecting = 0;
        c->epoch++;
        conn_update_events(L, c);
    }
    if (events & EPOLLIN) conn_read(L, c, now);
    if (c->fd >= 0 && (events & EPOLLOUT)) conn_flush(L, c, now);
    if (c->fd >= 0 && (events & (EPOLLERR | EPOLLHUP)) && !(events & EPOLLIN))
        conn_close(L, c, now);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pct(const double *v, size_t n, double q) {
    if (!n) return 0.0;
    size_t i = (size_t)(q * (double)(n - 1) + 0.5);
    return v[i < n ? i : n - 1];
}

static void usage(void) {
    fprintf(stderr,
            "usage: zz-loadgen --conf CLIENTCONF [--clients N] [--payload REQBYTES]\n"
            "                  [--seconds S] [--first-client K] [--json OUT]\n");
}

int main(int argc, char **argv) {
    const char *conf_path = NULL, *json_path = NULL;
    uint32_t nclients = 1, payload = 0, seconds = 10, first = 0;
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0;
        if (!strcmp(a, "--conf") && v) conf_path = v;
        else if (!strcmp(a, "--json") && v) json_path = v;
        else if (!strcmp(a, "--clients") && v) bad = parse_u32(v, LG_MAX_CLIENTS, &nclients);
        else if (!strcmp(a, "--payload") && v) bad = parse_u32(v, 1u << 20, &payload);
        else if (!strcmp(a, "--seconds") && v) bad = parse_u32(v, 86400, &seconds);
        else if (!strcmp(a, "--first-client") && v) bad = parse_u32(v, LG_MAX_CLIENTS, &first);
        else {
            usage();
            return 2;
        }
        if (bad) {
            fprintf(stderr, "zz-loadgen: bad value for %s: %s\n", a, v);
            return 2;
        }
    }
    if (!conf_path || nclients == 0 || seconds == 0) {
        usage();
        return 2;
    }

    lg *L = calloc(1, sizeof *L);
    if (!L) return 1;
    int rc = 1;
    char err[512];
    L->ep = -1;
    for (uint32_t r = 0; r < ZZ_MAX_REPLICAS; r++) L->conns[r].fd = -1;
    if (load_client_conf(L, conf_path, err, sizeof err) < 0) {
        fprintf(stderr, "zz-loadgen: %s\n", err);
        goto out;
    }
    if (L->clients_avail && first + nclients > L->clients_avail) {
        fprintf(stderr, "zz-loadgen: clients %u..%u but the key directory has %u\n", first,
                first + nclients - 1, L->clients_avail);
        goto out;
    }
    L->payload = payload;
    L->cl = calloc(nclients, sizeof *L->cl);
    if (!L->cl) goto out;
    L->ncl = nclients;
    L->client_base += first;
    for (uint32_t i = 0; i < nclients; i++) {
        lg_client *cl = &L->cl[i];
        cl->principal = L->client_base + i;
        zz_buf_init(&cl->req);
        cl->op = malloc(payload ? payload : 1);
        cl->keys = calloc(1, sizeof *cl->keys);
        if (!cl->op || !cl->keys) goto out;
        cl->keys->service = L->service;
        cl->keys->id = cl->principal;
        cl->keys->g = L->g;
        cl->keys->n = L->n;
        char secret[700];
        int w = snprintf(secret, sizeof secret, "%s/p%u.secret", L->key_dir, cl->principal);
        if (w < 0 || (size_t)w >= sizeof secret) {
            fprintf(stderr, "zz-loadgen: key_dir too long\n");
            goto out;
        }
        if (zz_keys_load(secret, L->public_path, cl->keys, err, sizeof err) < 0) {
            fprintf(stderr, "zz-loadgen: %s\n", err);
            goto out;
        }
        for (uint32_t r = 0; r < L->n; r++) {
            const zz_peer_key *k = zz_conf_key(cl->keys, r);
            if (!k || !k->mac) {
                fprintf(stderr, "zz-loadgen: %s has no MAC key for replica %u\n", secret, r);
                goto out;
            }
            cl->mac[r] = k->mac;
            cl->rcv[r] = r;
        }
        /* Timestamps above any earlier run's: replicas execute only increasing ones. */
        cl->t = wall_us() * 16;
    }
    for (uint32_t r = 0; r < L->n; r++)
        if (resolve(&L->conns[r], err, sizeof err) < 0) {
            fprintf(stderr, "zz-loadgen: %s\n", err);
            goto out;
        }
    L->ep = epoll_create1(EPOLL_CLOEXEC);
    if (L->ep < 0) {
        perror("zz-loadgen: epoll_create1");
        goto out;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);

    uint64_t now = now_ns();
    /* Connect first (up to 2 s) so the measured window does not include TCP set-up. */
    uint64_t connect_deadline = now + 2000000000ull;
    for (;;) {
        uint32_t up = 0;
        for (uint32_t r = 0; r < L->n; r++) {
            conn_try(L, &L->conns[r], now);
            up += L->conns[r].fd >= 0 && !L->conns[r].connecting;
        }
        if (up == L->n || now >= connect_deadline || lg_stop_flag) break;
        struct epoll_event evs[64];
        int ne = epoll_wait(L->ep, evs, 64, 20);
        now = now_ns();
        for (int e = 0; e < ne; e++) on_event(L, evs[e].data.ptr, evs[e].events, now);
    }

    uint64_t t0 = now_ns();
    L->end_ns = t0 + (uint64_t)seconds * 1000000000ull;
    L->measuring = 1;
    for (uint32_t i = 0; i < nclients; i++)
        if (client_issue(L, &L->cl[i], t0) < 0) {
            fprintf(stderr, "zz-loadgen: cannot encode a request\n");
            goto out;
        }
    struct epoll_event evs[256];
    while (!lg_stop_flag) {
        now = now_ns();
        if (now >= L->end_ns || !L->measuring) break;
        uint64_t wait_ns = L->end_ns - now;
        if (wait_ns > 5000000ull) wait_ns = 5000000ull; /* timer granularity: 5 ms */
        int ne = epoll_wait(L->ep, evs, 256, (int)(wait_ns / 1000000ull) + 1);
        now = now_ns();
        for (int e = 0; e < ne; e++) on_event(L, evs[e].data.ptr, evs[e].events, now);
        for (uint32_t r = 0; r < L->n; r++) conn_try(L, &L->conns[r], now);
        for (uint32_t i = 0; i < nclients; i++) {
            lg_client *cl = &L->cl[i];
            if (!cl->busy || now < cl->retry_ns) continue;
            /* Lost, or the primary is faulty or gone: to everyone, backing off to 8x. */
            cl->retries++;
            L->retransmits++;
            if (cl->retries == 1 && !L->sign_always && client_encode(L, cl, 1) < 0) {
                fprintf(stderr, "zz-loadgen: cannot sign a request\n");
                goto out;
            }
            client_send(L, cl, 1, now);
            uint32_t shift = cl->retries < 3 ? cl->retries : 3;
            cl->retry_ns = now + ((uint64_t)L->timeout_ms << shift) * 1000000ull;
        }
    }
    double elapsed = (double)(now_ns() - t0) / 1e9;
    qsort(L->lat, L->nlat, sizeof *L->lat, cmp_double);
    double sum = 0;
    for (size_t i = 0; i < L->nlat; i++) sum += L->lat[i];
    char json[1024];
    int jl = snprintf(json, sizeof json,
                      "{\"ops_per_s\": %.1f, \"p50_ms\": %.3f, \"p99_ms\": %.3f, "
                      "\"mean_ms\": %.3f, \"completed\": %llu, \"retransmits\": %llu, "
                      "\"wrong_results\": %llu, \"bad_replies\": %llu, \"clients\": %u, "
                      "\"payload\": %u, \"seconds\": %.3f, \"view\": %u}\n",
                      elapsed > 0 ? (double)L->completed / elapsed : 0.0,
                      pct(L->lat, L->nlat, 0.50), pct(L->lat, L->nlat, 0.99),
                      L->nlat ? sum / (double)L->nlat : 0.0, (unsigned long long)L->completed,
                      (unsigned long long)L->retransmits, (unsigned long long)L->wrong,
                      (unsigned long long)L->bad_replies, nclients, payload, elapsed, L->view);
    if (jl < 0 || (size_t)jl >= sizeof json) goto out;
    fputs(json, stdout);
    if (json_path) {
        FILE *f = fopen(json_path, "w");
        if (!f || fputs(json, f) < 0 || fclose(f) != 0) {
            fprintf(stderr, "zz-loadgen: cannot write %s\n", json_path);
            goto out;
        }
    }
    rc = L->wrong ? 3 : 0;
out:
    for (uint32_t r = 0; r < ZZ_MAX_REPLICAS; r++) {
        if (L->conns[r].fd >= 0) close(L->conns[r].fd);
        free(L->conns[r].rbuf);
        free(L->conns[r].wbuf);
    }
    if (L->ep >= 0) close(L->ep);
    if (L->cl) {
        for (uint32_t i = 0; i < L->ncl; i++) {
            zz_buf_free(&L->cl[i].req);
            free(L->cl[i].op);
            if (L->cl[i].keys) {
                zz_conf_free(L->cl[i].keys);
                free(L->cl[i].keys);
            }
        }
        free(L->cl);
    }
    free(L->lat);
    free(L);
    return rc;
}
