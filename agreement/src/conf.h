/* conf.h - a replica's runtime configuration and key material, loaded once at start.
 * The file is generated from the rack config (TOML) by `zz rack render`; its format
 * is documented in docs/config.md ("Replica files"). Errors name the file, line and key. */
#ifndef ZZ_CONF_H
#define ZZ_CONF_H

#include <stdint.h>

#include "crypto.h"

#define ZZ_MAX_REPLICAS 64   /* agreement replicas per service (3g+1 <= 64) */
#define ZZ_MAX_PRINCIPALS 4096
#ifndef ZZ_MAX_EXEC
#define ZZ_MAX_EXEC 64 /* execution replicas per service (same value as replica.h) */
#endif
#define ZZ_MAX_HOSTS 256 /* hosts of the rack that run a controld */
#define ZZ_MAX_SYNC_THREADS 4 /* sync_threads, at most */
#define ZZ_DURABLE_MAX_INFLIGHT 1 /* max_inflight's default with durability fsync */
#define ZZ_DEFAULT_SYNC_SLICE_US 100 /* sync_slice_us (docs/agreement.md "The sync threads") */
/* Request and batch size defaults (bytes); docs/wire.md "Size limits". */
#define ZZ_DEFAULT_MAX_REQUEST 1048576u
#define ZZ_DEFAULT_BATCH_BYTES 4194304u
#define ZZ_MIN_MAX_REQUEST 1024u

/* The durable-state policy (`durability`, docs/agreement.md "Durable state"). */
enum zz_durability {
    ZZ_DUR_FSYNC = 0, /* write + fdatasync before any dependent byte is sent (the default) */
    ZZ_DUR_WRITE = 1, /* write to the kernel only: survives a process crash, not the host's */
    ZZ_DUR_OFF = 2,   /* no log: the replica's state is lost with the process */
};

typedef struct {
    char host[64];
    uint16_t port;
} zz_addr;

enum zz_byz {
    ZZ_BYZ_NONE = 0,
    ZZ_BYZ_EQUIVOCATE,    /* as primary: send different batches to different backups */
    ZZ_BYZ_DROP_REQUESTS, /* as primary: never propose client requests */
    ZZ_BYZ_SILENT,        /* send nothing at all */
    ZZ_BYZ_FALSE_FAULT    /* sign a FAULT-STATEMENT blaming a correct replica for every seq */
};

/* One execution replica of the service (`exec <i> <host> active|sleeping`). */
typedef struct {
    int present;
    uint32_t host;   /* host index: whose controld wakes or shuts it down */
    int active;      /* initially awake (the first `active` ids) or a sleeping spare */
} zz_exec_conf;

typedef struct {
    uint32_t id;       /* principal id (the peer's) */
    zz_mackey *mac;    /* pairwise key with this replica; NULL if none */
    zz_pubkey *pub;    /* Ed25519 public key; NULL if none */
} zz_peer_key;

typedef struct {
    uint16_t service;
    uint32_t id;        /* this replica, 0 .. n-1 */
    uint32_t n;         /* 3g+1 */
    uint32_t g;
    zz_addr listen;
    zz_addr peers[ZZ_MAX_REPLICAS];
    uint32_t checkpoint_interval; /* CP */
    uint32_t log_window;          /* L: high watermark = stable + L; multiple of CP */
    uint32_t batch_max;           /* requests per batch */
    uint32_t max_inflight;        /* batches proposed but not yet executed (default 4; 1 with
                                   * durability fsync and a data_dir) */
    /* External execution: batches proposed beyond the highest seq an awake execution
     * replica has reported (0 = no such bound), and how long a proposal may be held for it
     * (docs/agreement.md "Batching against execution"). */
    uint32_t exec_inflight;
    uint32_t exec_hold_ms;
    /* A hold lasts about twice the recent dispatch-to-reports latency, at least exec_hold_ms
     * and at most this (0: half of view_timeout_ms). */
    uint32_t exec_hold_max_ms;
    uint32_t view_timeout_ms;     /* first view-change timer; doubles per failed view */
    uint32_t status_interval_ms;  /* retransmission (STATUS) period */
    uint32_t time_tolerance_ms;   /* allowed |nd_time - local clock| at a backup */
    /* Resource limits (docs/security.md "Resource limits"). */
    uint32_t max_request;         /* bytes of one REQUEST message, MAC vector included */
    uint32_t batch_bytes;         /* bytes of one batch encoding, <= ZZ_MAX_BATCH_BYTES */
    uint32_t max_conns;           /* accepted connections in total */
    uint32_t max_conns_per_source; /* accepted connections from one source address */
    uint32_t frame_timeout_ms;    /* a frame begun must be complete within this */
    uint32_t unauth_timeout_ms;   /* a connection must authenticate a message within this */
    uint32_t unauth_buffer_bytes; /* read buffers of unauthenticated connections, in total */
    uint32_t client_out_bytes;    /* replies queued for one client, all its connections */
    uint32_t client_out_total;    /* replies queued for all clients together */
    uint32_t out_stall_timeout_ms; /* queued output must make progress within this */
    uint32_t require_signed;      /* 1: only signed requests are ordered (client_signatures =
                                   * "always", docs/agreement.md "Signed requests") */
    char stats_file[256];         /* JSON counters, rewritten every second; "" = none */
    char exec_view[256]; /* awake/sleeping/convicted view kept across restarts; "" = none */
    /* The service's key directory, where controld keeps each re-keyed slot's signed
     * SPARE-READY (spare-p<256+i>.msg, hex), read at start (spares.c); "" = none. */
    char spare_keys[256];
    char data_dir[256];  /* the write-ahead log's directory (wal.c); "" = no durable state */
    uint32_t durability; /* enum zz_durability; used only with data_dir */
    /* durability fsync: threads that run the fdatasyncs beside the loop (0: the loop syncs
     * itself), and the scheduler slice each asks for (us; 0: the kernel's default) */
    uint32_t sync_threads, sync_slice_us;
    uint32_t loop_slice_us; /* the scheduler slice the event loop's thread asks for (0: the
                             * kernel's default) */
    /* test only: the sync threads start no fdatasync while this file exists; "" = none */
    char inject_sync_gate[256];
    /* test-only fault injection on replica-to-replica sends */
    double inject_drop, inject_dup;
    uint32_t inject_delay_ms;
    uint64_t inject_seed;
    enum zz_byz byzantine;
    /* test only (`byzantine_commits V:LO-HI:P,...`): no COMMIT for a seq in LO..HI of view V
     * goes to the replicas in byz_commit_peers (a bit per replica id); 0 = off */
    uint64_t byz_commit_peers;
    uint32_t byz_commit_view;
    uint64_t byz_commit_lo, byz_commit_hi;
    int external_exec; /* execution external: batches go to execution replicas, no echo */
    uint32_t f;        /* execution faults tolerated: f+1 matching EXEC-CHECKPOINTs are stable */
    uint32_t exec_log; /* committed batches kept for execution replicas, at most */
    uint32_t detect_k, detect_floor_ms, detect_ceiling_ms; /* report timer K·t1, clamped */
    /* Fault detection: the service's execution replicas 0 .. n_exec-1 and the controld of
     * every host (n_exec = 0: no exec lines, no WAKEUP/SHUTDOWN is ever sent). */
    uint32_t n_exec;
    zz_exec_conf exec[ZZ_MAX_EXEC];
    int has_controld[ZZ_MAX_HOSTS];
    zz_addr controld[ZZ_MAX_HOSTS];
    /* keys */
    zz_signkey *sign;
    uint32_t nkeys;
    zz_peer_key keys[ZZ_MAX_PRINCIPALS]; /* sorted by id */
    /* The controlds' Ed25519 keys from `rack_public` (keys/s0/public), by host index; NULL
     * for a host without one. They verify SPARE-READY; without the line none is accepted. */
    zz_pubkey *controld_pub[ZZ_MAX_HOSTS];
} zz_conf;

/* Load `path`; on error writes a message naming file:line and key to err and returns -1. */
int zz_conf_load(const char *path, zz_conf *c, char *err, size_t errcap);
void zz_conf_free(zz_conf *c);
/* Key material for principal `id`, or NULL. */
const zz_peer_key *zz_conf_key(const zz_conf *c, uint32_t id);
/* Load a key file (docs/config.md "Key files") into c->sign / c->keys; and a public file. */
int zz_keys_load(const char *secret_path, const char *public_path, zz_conf *c, char *err,
                 size_t errcap);

#endif
