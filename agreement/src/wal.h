/* wal.h - durable agreement state (docs/agreement.md "Durable state"): each replica keeps
 * its protocol state in a write-ahead log of checksummed records in its data directory,
 * writes the records before any byte to a peer that depends on them leaves the process and
 * syncs those a COMMIT, VIEW-CHANGE or NEW-VIEW depends on first (one write + fdatasync per
 * event-loop turn: group commit), rewrites the log at each stable checkpoint and restarts
 * from it. A PRE-PREPARE's or PREPARE's record is synced with the next sync: a host restart
 * (another boot id in the header) may lose it, and the replica then withholds them in the
 * view it recovers (zz_wal_forgets).
 *
 * Two preallocated, zero-filled files (wal-a, wal-b) take turns: a rewrite goes to the other
 * file with the next epoch, so appends overwrite blocks that exist (fdatasync then has no
 * file size to journal). Record framing, big-endian:
 *   u32 len    bytes of type + body, 1 .. ZZ_WAL_MAX_RECORD
 *   u32 crc    CRC32C (Castagnoli) over the length, the epoch, the type and the body
 *   u32 epoch  the file's epoch (its first record's); an older one is a previous use's data
 *   u8  type
 *   body
 * Every write ends with ZZ_WAL_HDR zero bytes (the end mark). A scan stops at the end mark
 * or at a whole record of another epoch (the end), or at an invalid record: a torn tail when
 * no valid record of the log's epoch follows it, corrupt when one does. */
#ifndef ZZ_WAL_H
#define ZZ_WAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "conf.h"
#include "wire.h"

#define ZZ_WAL_HDR 12u
#define ZZ_WAL_MAX_RECORD (64u << 20)
#define ZZ_WAL_VERSION 2u /* 1: a header without the boot id; still read */
#define ZZ_WAL_BOOT_LEN 16u
#define ZZ_WAL_CHUNK (4u << 20) /* the files grow by this much of zeros */
#define ZZ_WAL_RING 8u        /* tickets remembered for the stats (a power of two) */

enum zz_wal_type {
    ZZ_WAL_HEADER = 1,  /* u32 version, u16 service, u32 id, u32 n: whose log this is; u64
                         * the seq it abstains up to (zz_wal_abstains), 0 = none; version 2:
                         * u8[16] the boot id every record of the file was written under (zeros:
                         * unknown, every record a send depended on was synced), u32 view and
                         * u64 seq of the PREPAREs it withholds (zz_wal_forgets), 0 = none */
    ZZ_WAL_STABLE = 2,  /* the stable checkpoint: seq, digest, proof, state encoding */
    ZZ_WAL_VIEW = 3,    /* view, in view change, own VIEW-CHANGE, NEW-VIEW accepted */
    ZZ_WAL_SLOT = 4,    /* one log slot's durable fields, its batch when newly known */
    ZZ_WAL_SNAPEND = 5, /* the rewrite is complete: the file may replace the other one */
    ZZ_WAL_XSTABLE = 6, /* external execution: stable execution checkpoint, where its log starts */
    ZZ_WAL_XENTRY = 7,  /* external execution: one execution log entry (seq, digest, batch) */
};

/* Why a scan stopped. */
enum zz_wal_tail {
    ZZ_WAL_CLEAN = 0,   /* at the log's end (the end mark, another epoch, the data's end) */
    ZZ_WAL_TORN = 1,    /* an invalid record with nothing valid after it: a cut-short write */
    ZZ_WAL_CORRUPT = 2, /* an invalid record followed by valid ones, or an invalid body */
    ZZ_WAL_FOREIGN = 3, /* a header naming another replica or version: nothing is applied */
};

/* What a message about to be sent needs of the record logged just before it (zz_wal_slot). */
enum zz_wal_dep {
    ZZ_WAL_NODEP = 0,   /* nothing sent depends on it: written before the next send, synced
                         * within a second */
    ZZ_WAL_WRITTEN = 1, /* written before the send, synced with the next sync (PRE-PREPARE,
                         * PREPARE: a host restart that loses it is detected by the boot id,
                         * and the replica then withholds them in that view, zz_wal_forgets) */
    ZZ_WAL_SYNCED = 2,  /* synced before the send (COMMIT; PRE-PREPARE and PREPARE when the
                         * boot id cannot be read) */
};

/* CRC32C (the crc32 instruction where the CPU has it, else the table; the same value). */
uint32_t zz_crc32c(uint32_t crc, const void *p, size_t n);
uint32_t zz_crc32c_table(uint32_t crc, const void *p, size_t n);

/* Start a record of `epoch` in b (its framing with a zero length and checksum); returns its
 * offset. zz_wal_end patches length and checksum once the body is written. */
size_t zz_wal_begin(zz_buf *b, uint8_t type, uint32_t epoch);
void zz_wal_end(zz_buf *b, size_t start);

/* Apply one whole, checksummed record: 0 = applied, ZZ_WAL_CORRUPT = its body is invalid,
 * ZZ_WAL_FOREIGN = it belongs to another replica (the scan stops either way). */
typedef int zz_wal_apply(void *ctx, uint8_t type, const uint8_t *body, uint32_t len);

/* Walk the records at the start of buf[0, len), calling fn for each valid one (fn may be
 * NULL); the first record's epoch is the log's (*epoch, 0 if there is none). Returns the
 * length of the prefix applied; *tail says why the scan stopped. */
size_t zz_wal_scan(const uint8_t *buf, size_t len, zz_wal_apply *fn, void *ctx, int *tail,
                   uint32_t *epoch);

/* A bounds-checked reader over a record body. */
typedef struct {
    const uint8_t *p;
    uint32_t len, off;
    int bad; /* sticky: a read ran past the end */
} zz_wal_rd;
uint8_t zz_wal_u8(zz_wal_rd *d);
uint16_t zz_wal_u16(zz_wal_rd *d);
uint32_t zz_wal_u32(zz_wal_rd *d);
uint64_t zz_wal_u64(zz_wal_rd *d);
const uint8_t *zz_wal_raw(zz_wal_rd *d, uint32_t n);
const uint8_t *zz_wal_bytes(zz_wal_rd *d, uint32_t *n); /* u32 length + data */

/* One replica's log (the replica's r->wal). With durability fsync and an event loop, sync
 * threads (conf sync_threads) run the fdatasyncs the loop asks for (tickets, ascending)
 * while the loop goes on; the frames that need a sync wait in net for their ticket
 * (zz_net_release). Ownership: the fields marked (mu) are read and written under mu by the
 * loop and the threads; everything else is the loop's alone (a thread never touches the
 * replica). A thread reads path[] (set before it starts, never changed), syncs through
 * descriptors it opens itself and writes to efd, which is closed only after every thread
 * was joined. */
typedef struct {
    int enabled;
    int fsync;          /* durability fsync (conf.h enum zz_durability) */
    int fd[2];          /* wal-a, wal-b; -1 */
    int cur;            /* the file appended to */
    uint32_t epoch;     /* its epoch */
    uint64_t off;       /* where the next write goes (the log's end) */
    uint64_t size[2];   /* bytes of each file (zero-filled beyond the log) */
    int replaying;      /* recovery applies records: nothing is logged */
    int compact_due;    /* the stable checkpoint moved: rewrite the log at the next sync */
    int must_sync;      /* a pending record is one a queued send depends on: sync it first */
    int must_write;     /* a pending record must be written before a queued send (not synced) */
    int view_pending;   /* a VIEW record is not synced yet: every send to a peer waits for it */
    uint64_t unsynced;  /* records written since the last sync was asked */
    uint64_t pend_records; /* records in pend */
    /* The boot this process runs in (/proc/sys/kernel/random/boot_id), and the one the
     * replayed file's records were written under; a file is appended to only in its boot. */
    uint8_t boot[ZZ_WAL_BOOT_LEN], log_boot[ZZ_WAL_BOOT_LEN];
    int boot_known, log_v2;
    /* After a restart of the host (another boot) its log may lack PRE-PREPAREs and PREPAREs
     * it sent (written, not yet synced): none is sent for seqs up to lost_until in views up
     * to lost_view, until the stable checkpoint passes lost_until (zz_wal_forgets). */
    uint32_t lost_view;
    uint64_t lost_until;
    char path[2][300], damaged[300], dir[260];
    zz_buf pend;        /* records not yet written */
    /* sync threads (durability fsync with an event loop; thr_on 0: every sync blocks) */
    int thr_on;
    int efd;            /* eventfd: the thread's "a sync finished" to the loop; -1 */
    pthread_t thr[ZZ_MAX_SYNC_THREADS];
    uint32_t slice_us;  /* the slice each thread asks the scheduler for (conf sync_slice_us) */
    char gate[256];     /* test only (conf inject_sync_gate): no sync starts while it exists */
    int n_thr;          /* threads started */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int t_file;         /* (mu) the file to sync (0: wal-a, 1: wal-b) */
    uint64_t t_ticket;  /* (mu) the ticket of the last sync asked */
    uint64_t t_taken;   /* (mu) the last ticket a thread took (t_ticket > t_taken: one waits) */
    uint64_t t_done;    /* (mu) the highest ticket of a sync finished */
    int t_running;      /* (mu) threads inside fdatasync */
    int t_err, t_err_file; /* (mu) errno of a failed fdatasync (0: none) and its file */
    uint64_t t_syncs, t_us_total, t_us_max; /* (mu) the threads' syncs and their time */
    uint64_t t_asked_us;  /* (mu) when the last ticket was asked */
    uint64_t t_start_us_total; /* (mu) summed time from a ticket asked to a thread taking it */
    uint64_t t_done_us;   /* (mu) when the last sync returned */
    int t_stop;         /* (mu) zz_wal_free: end the threads */
    /* the loop's view of the tickets: every record written before ticket t was asked is
     * synced once t <= durable. A rewrite is a ticket of its own, durable at once (it holds
     * everything the log had). */
    uint64_t issued;    /* the last ticket given out */
    uint64_t durable;   /* the highest ticket finished */
    uint64_t busy;      /* the last ticket given to the threads; done once <= durable */
    uint64_t written_total;  /* records written so far */
    uint64_t ring_records[ZZ_WAL_RING], ring_since_us[ZZ_WAL_RING]; /* per ticket asked:
                         * written_total and the time then (stats) */
    uint64_t thr_syncs_seen, thr_us_seen; /* the threads' counters already in the stats */
    int want;           /* records written after busy was asked need the next ticket */
    uint64_t need;      /* the ticket the last frames that needed a sync wait for: frames of
                         * later turns wait for it too (they may repeat what it covers) */
    uint64_t view_ticket; /* view_pending ends when this ticket is durable; 0: not asked */
    uint64_t wb_off;    /* writeback of the current file was started up to here (sync_issue) */
    uint32_t wb_epoch;  /* the epoch wb_off is of (another: the file changed, start at 0) */
    zz_buf snap;        /* compaction scratch */
    /* stats ("wal" in the stats file) */
    uint64_t records, bytes, writes, syncs, compactions;
    uint64_t synced_records; /* records made durable by syncs (not rewrites) */
    uint64_t withheld;       /* PREPAREs not sent because of lost_until */
    int boot_changed;        /* the last start replayed a log of another boot */
    uint64_t sync_us_total, sync_us_max;
    uint64_t loop_syncs, loop_sync_us; /* syncs and rewrites the loop waited for itself */
    uint64_t ticket_us_total, tickets_done; /* tickets from asked to the loop learning them
                                             * done */
    uint64_t ring_need_ticket[ZZ_WAL_RING], ring_need_us[ZZ_WAL_RING]; /* per ticket frames
                         * waited for: when the first of them was held for it */
    uint64_t need_us_total, needs_done; /* held frames: from their barrier to their release */
    uint64_t tell_us_total, tells;      /* a sync returned -> the loop learning it */
    uint64_t write_us_total, write_us_max; /* the loop in pwrite of the pending records */
    /* Every record logged gets the next number (zz_wal_mark), also one a pending rewrite
     * takes from memory; seq_durable is the highest whose record (or a rewrite holding it)
     * is synced. ring_seq: per ticket asked, the number it covers. */
    uint64_t seqno, seq_durable, ring_seq[ZZ_WAL_RING];
    uint64_t exec_unsynced; /* batches executed on a commit quorum that needed this replica's
                             * own COMMIT before its record was synced (must stay 0) */
    int rescan_due;         /* a 0 ms timer re-checks prepared slots once seq_durable moved */
    uint64_t recovered_records, recovered_bytes, discard_offset, recover_ms;
    uint64_t recovered_slots, recovered_stable, recovered_last_exec, grown;
    int recovered_tail; /* enum zz_wal_tail of the recovery scan */
    /* After a corrupt log (synced records lost): the highest seq a lost record can be about.
     * Until the stable checkpoint reaches it, this replica sends no PRE-PREPARE, PREPARE or
     * COMMIT for seqs up to it (zz_wal_abstains); 0 = none. */
    uint64_t abstain_until;
} zz_wal;

struct zz_replica;

/* Open the data directory and replay the log into the replica (state at the stable
 * checkpoint, view, slots; committed batches above it are executed again). A clean log is
 * appended to where it ends; a damaged one (or none) is rewritten into the other file. A
 * torn or corrupt tail is discarded with a log line (the damaged file copied to
 * wal.damaged). -1 with err set: unusable directory or another replica's log. */
int zz_wal_recover(struct zz_replica *r, char *err, size_t errcap);
void zz_wal_free(struct zz_replica *r);
/* The group commit, net's barrier (zz_on_barrier). Before any byte is written to a socket
 * and at the end of each turn (durable 0): the pending records are written, not synced (the
 * log is rewritten first when the stable checkpoint moved and a queued send needs a record).
 * Once per turn before the frames held for it may join the links' queues (durable 1): when a
 * pending record is one a send must find synced, all pending records are written and a sync
 * is asked of the sync thread; the frames wait for its ticket (returned; net releases them
 * when zz_net_release says it is durable), and so do the frames of later turns until it is
 * (they may repeat a COMMIT it covers). Without the thread (durability write, no loop) or
 * when the log must be rewritten, this call syncs or rewrites itself and returns 0. A failed
 * write or sync ends the process: a replica must not send what it could forget. */
uint64_t zz_wal_sync(void *replica, int durable);
/* 1: a PRE-PREPARE or PREPARE about to be sent needs its record only written and may leave
 * before the turn's sync (zz_net_early): the log has the boot id and no VIEW record waits
 * for a sync. */
int zz_wal_early(const struct zz_replica *r);
/* Sync whatever is pending or written since the last sync (each second, so that nothing
 * waits long): asked of the sync thread, or done here without it. */
void zz_wal_flush(struct zz_replica *r);
/* The number of the last record logged (0 without a log); zz_wal_synced says whether it
 * is on disk: 1 when it is synced (durability fsync), always with durability write or no
 * log (nothing is ever synced, or nothing kept). */
uint64_t zz_wal_mark(const struct zz_replica *r);
int zz_wal_synced(const struct zz_replica *r, uint64_t mark);
/* Log changes (no-ops without a data directory or while replaying). */
void zz_wal_view(struct zz_replica *r);
void zz_wal_stable(struct zz_replica *r); /* the stable checkpoint advanced */
void zz_wal_xstable(struct zz_replica *r); /* the stable execution checkpoint advanced */
void zz_wal_stats(struct zz_replica *r, void *file); /* FILE *: "wal": {...}, */
/* 1: a vote or proposal for seq must not be sent, as it could contradict one the replica sent
 * and lost with a corrupt part of its log. */
int zz_wal_abstains(const struct zz_replica *r, uint64_t seq);
/* 1: a PRE-PREPARE or PREPARE for (view, seq) must not be sent (nor counted as this
 * replica's own), as the host restarted since the log was written and it may contradict one
 * whose record was written but not synced. */
int zz_wal_forgets(const struct zz_replica *r, uint32_t view, uint64_t seq);

#endif
