/* net.h - the event loop: epoll, TCP connections with u32 length-prefixed frames,
 * reconnecting outgoing links to peers, millisecond timers, and the test-only
 * fault injector (drop / duplicate / delay-and-reorder) on replica-to-replica sends.
 * Single-threaded; everything runs from zz_net_run's loop (another thread of the owner may
 * only write to a descriptor the loop watches, zz_net_watch). */
#ifndef ZZ_NET_H
#define ZZ_NET_H

#include <stddef.h>
#include <stdint.h>

#include "conf.h"

typedef struct zz_net zz_net;
typedef struct zz_conn zz_conn;

/* Called for every complete frame received on any connection. `conn` identifies the
 * connection (to answer a client on the connection its request came from). The
 * buffer is valid only during the call. */
typedef void (*zz_on_frame)(void *ctx, zz_conn *conn, const uint8_t *msg, size_t len);
/* Called when a connection closes; the handler must forget `conn`. */
typedef void (*zz_on_close)(void *ctx, zz_conn *conn);
typedef void (*zz_on_timer)(void *ctx);

/* The principals a connection can be charged to (zz_net_conn_set_sender): agreement
 * replica j is slot j, execution replica i slot ZZ_MAX_REPLICAS + i. */
#define ZZ_NET_SENDER_SLOTS (ZZ_MAX_REPLICAS + ZZ_MAX_EXEC)

typedef struct {
    uint64_t frames_in, frames_out, bytes_in, bytes_out;
    uint64_t framing_errors; /* bad frame length: connection closed */
    /* of those, on a connection charged to a sender slot (zz_net_conn_set_sender) */
    uint64_t framing_from[ZZ_NET_SENDER_SLOTS];
    uint64_t conns_accepted, reconnects;
    uint64_t injected_drops, injected_dups, injected_delays;
    uint64_t send_overflow;  /* frames dropped because a peer's queue was full */
    uint64_t connect_failures; /* outgoing connection attempts that failed (retried later) */
    /* resource limits (docs/security.md "Resource limits") */
    uint64_t conns_open;           /* accepted connections now open */
    uint64_t conns_refused;        /* accepted and closed at once: over max_conns or per source */
    uint64_t conns_refused_source; /* of those, over max_conns_per_source */
    uint64_t frame_timeouts;       /* closed: a frame incomplete for frame_timeout_ms */
    uint64_t unauth_timeouts;      /* closed: nothing authenticated within unauth_timeout_ms */
    uint64_t in_buffer_bytes;      /* read buffers held, all connections */
    uint64_t unauth_buffer_refusals; /* closed: unauthenticated buffers over their budget */
    uint64_t accept_backoffs; /* accept out of descriptors (EMFILE, ENFILE): listener paused */
    /* output to accepted connections (docs/security.md "Slow readers") */
    uint64_t out_buffer_bytes;     /* bytes queued on accepted connections now */
    uint64_t client_out_bytes;     /* of those, on connections owned by a client */
    uint64_t client_out_overflows; /* closed: its client over client_out_bytes */
    uint64_t out_total_overflows;  /* closed: clients together over client_out_total */
    uint64_t out_stall_timeouts;   /* closed: output queued, nothing written for the timeout */
    uint64_t turns;    /* loop turns that handled at least one event */
    uint64_t barriers; /* durable barrier calls (turns that released held link frames) */
    uint64_t waited;   /* links whose frames of a turn waited for a ticket (zz_net_release) */
} zz_net_stats;

zz_net *zz_net_new(const zz_conf *c, void *ctx, zz_on_frame on_frame, zz_on_close on_close,
                   char *err, size_t errcap);
void zz_net_free(zz_net *n);

/* Send one message (no frame prefix; net adds it) to agreement replica `peer` over
 * the outgoing link, subject to fault injection. Never blocks: queued if the socket
 * is busy, reconnects in the background. */
void zz_net_send_peer(zz_net *n, uint32_t peer, const uint8_t *msg, size_t len);
/* An extra reconnecting outgoing link to host:port (e.g. a controld), no fault injection.
 * Returns its id for zz_net_send_link, or -1 (address unresolvable, too many links).
 * Frames queue while it is down and go out when a retry with backoff connects. */
int zz_net_add_link(zz_net *n, const char *host, uint16_t port);
void zz_net_send_link(zz_net *n, int link, const uint8_t *msg, size_t len);
/* Send to every other agreement replica. */
void zz_net_bcast(zz_net *n, const uint8_t *msg, size_t len);
/* Send on a specific (e.g. client) connection. No injection. */
void zz_net_send_conn(zz_net *n, zz_conn *conn, const uint8_t *msg, size_t len);

/* A label the owner keeps on a connection (0 when new), e.g. "an agreement peer speaks
 * here", so a REQUEST relayed by a peer is not mistaken for the client's own connection. */
uint32_t zz_net_conn_tag(const zz_conn *c);
void zz_net_conn_set_tag(zz_conn *c, uint32_t tag);
/* The owner authenticated a message received on `c` (a tag implies it): the connection no
 * longer needs to authenticate within unauth_timeout_ms. */
void zz_net_conn_set_trusted(zz_conn *c);
/* The sender slot (0 .. ZZ_NET_SENDER_SLOTS-1) + 1 of the principal whose own messages
 * arrive on `c`, 0: none known. Set once, by the owner; a framing error on `c` is then
 * also counted in framing_from[slot]. An out-of-range slot is ignored. */
uint32_t zz_net_conn_sender(const zz_conn *c);
void zz_net_conn_set_sender(zz_conn *c, uint32_t slot_plus_1);

/* The connection carries the requests of owner `owner` (1 .. conf->nkeys: a key index + 1,
 * 0: none): replies queued on all of an owner's connections share one budget,
 * client_out_bytes (docs/security.md "Slow readers"). A new owner takes over the bytes
 * already queued. */
void zz_net_conn_set_owner(zz_net *n, zz_conn *c, uint32_t owner);
/* Bytes queued now for `owner`, and how many of its connections were closed as slow
 * readers (over its budget, over the total, or stalled). 0 for an unknown owner. */
uint64_t zz_net_owner_queued(const zz_net *n, uint32_t owner);
uint64_t zz_net_owner_closes(const zz_net *n, uint32_t owner);

/* The owner's durability barrier, e.g. the write-ahead log's group commit (wal.c). Called
 * with durable 0 before any byte is written to a socket, and once at the end of each turn:
 * the owner writes what queued bytes depend on (and what the turn decided); the return value
 * is ignored. Once set, a frame sent to a link (agreement peer, zz_net_add_link) is held
 * until the end of the turn, where one call with durable 1 asks the owner to make
 * everything the turn's frames depend on durable. It returns 0 when that is done: the
 * frames join their links' queues. Otherwise it returns a ticket (ascending): the frames
 * wait, behind any earlier waiting frames of their link, until the owner calls
 * zz_net_release with that ticket or a higher one, while the loop goes on. Frames sent while
 * zz_net_early is on need only the written records and are queued at once. Replies and
 * other frames on accepted connections never wait for the durable call. */
typedef uint64_t (*zz_on_barrier)(void *ctx, int durable);
void zz_net_set_barrier(zz_net *n, zz_on_barrier fn, void *ctx);
/* Every ticket up to `ticket` is durable: the frames waiting for them join their queues and
 * are written at once (not at the end of the turn). The loop calls the watched descriptor's
 * function before the other events of a turn. */
void zz_net_release(zz_net *n, uint64_t ticket);
/* Call fn(ctx) from the loop whenever `fd` is readable (fn must read it, e.g. an eventfd
 * another thread writes when its work is done). One descriptor per loop; -1 if one is
 * watched already or epoll refuses it. The owner closes it after zz_net_free or before
 * (closing removes it from epoll). */
int zz_net_watch(zz_net *n, int fd, zz_on_timer fn, void *ctx);
void zz_net_early(zz_net *n, int on);
/* At the end of a turn, make the durable call before the turn's queued bytes (replies,
 * early frames) are written rather than after them: for an owner whose durable call only
 * asks another thread for the work (wal.c's sync threads), so that it starts before the
 * turn's socket writes. What each frame waits for is unchanged. Off by default. */
void zz_net_barrier_first(zz_net *n, int on);

/* Timers: one-shot, ms from now. Returns an id > 0; cancel with zz_net_cancel. */
uint64_t zz_net_timer(zz_net *n, uint32_t ms, zz_on_timer fn, void *ctx);
void zz_net_cancel(zz_net *n, uint64_t id);
uint64_t zz_net_now_ms(const zz_net *n); /* monotonic */

/* Run until zz_net_stop (e.g. from SIGTERM handling). Returns 0. */
int zz_net_run(zz_net *n);
void zz_net_stop(zz_net *n);
/* Ask the loop to call fn(ctx) once, soon: async-signal-safe (a flag and an eventfd write),
 * so a signal handler can have work done in the loop (SIGUSR1: rewrite the stats now). */
void zz_net_on_kick(zz_net *n, zz_on_timer fn, void *ctx);
void zz_net_kick(zz_net *n);
const zz_net_stats *zz_net_get_stats(const zz_net *n);

#endif
