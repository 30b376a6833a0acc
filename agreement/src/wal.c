/* wal.c - durable agreement state: the record format (CRC32C-framed records, a scan that
 * stops at a torn or corrupt tail), the replica's write-ahead log (group commit before any
 * send, a rewrite at each stable checkpoint) and recovery from it. docs/agreement.md
 * "Durable state" says what is kept and why. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "replica.h"

/* CRC32C, reflected polynomial 0x82F63B78 (iSCSI, ext4), one table row per byte value. */
static const uint32_t crc_table[256] = {
    0x00000000u, 0xf26b8303u, 0xe13b70f7u, 0x1350f3f4u, 0xc79a971fu, 0x35f1141cu,
    0x26a1e7e8u, 0xd4ca64ebu, 0x8ad958cfu, 0x78b2dbccu, 0x6be22838u, 0x9989ab3bu,
    0x4d43cfd0u, 0xbf284cd3u, 0xac78bf27u, 0x5e133c24u, 0x105ec76fu, 0xe235446cu,
    0xf165b798u, 0x030e349bu, 0xd7c45070u, 0x25afd373u, 0x36ff2087u, 0xc494a384u,
    0x9a879fa0u, 0x68ec1ca3u, 0x7bbcef57u, 0x89d76c54u, 0x5d1d08bfu, 0xaf768bbcu,
    0xbc267848u, 0x4e4dfb4bu, 0x20bd8edeu, 0xd2d60dddu, 0xc186fe29u, 0x33ed7d2au,
    0xe72719c1u, 0x154c9ac2u, 0x061c6936u, 0xf477ea35u, 0xaa64d611u, 0x580f5512u,
    0x4b5fa6e6u, 0xb93425e5u, 0x6dfe410eu, 0x9f95c20du, 0x8cc531f9u, 0x7eaeb2fau,
    0x30e349b1u, 0xc288cab2u, 0xd1d83946u, 0x23b3ba45u, 0xf779deaeu, 0x05125dadu,
    0x1642ae59u, 0xe4292d5au, 0xba3a117eu, 0x4851927du, 0x5b016189u, 0xa96ae28au,
    0x7da08661u, 0x8fcb0562u, 0x9c9bf696u, 0x6ef07595u, 0x417b1dbcu, 0xb3109ebfu,
    0xa0406d4bu, 0x522bee48u, 0x86e18aa3u, 0x748a09a0u, 0x67dafa54u, 0x95b17957u,
    0xcba24573u, 0x39c9c670u, 0x2a993584u, 0xd8f2b687u, 0x0c38d26cu, 0xfe53516fu,
    0xed03a29bu, 0x1f682198u, 0x5125dad3u, 0xa34e59d0u, 0xb01eaa24u, 0x42752927u,
    0x96bf4dccu, 0x64d4cecfu, 0x77843d3bu, 0x85efbe38u, 0xdbfc821cu, 0x2997011fu,
    0x3ac7f2ebu, 0xc8ac71e8u, 0x1c661503u, 0xee0d9600u, 0xfd5d65f4u, 0x0f36e6f7u,
    0x61c69362u, 0x93ad1061u, 0x80fde395u, 0x72966096u, 0xa65c047du, 0x5437877eu,
    0x4767748au, 0xb50cf789u, 0xeb1fcbadu, 0x197448aeu, 0x0a24bb5au, 0xf84f3859u,
    0x2c855cb2u, 0xdeeedfb1u, 0xcdbe2c45u, 0x3fd5af46u, 0x7198540du, 0x83f3d70eu,
    0x90a324fau, 0x62c8a7f9u, 0xb602c312u, 0x44694011u, 0x5739b3e5u, 0xa55230e6u,
    0xfb410cc2u, 0x092a8fc1u, 0x1a7a7c35u, 0xe811ff36u, 0x3cdb9bddu, 0xceb018deu,
    0xdde0eb2au, 0x2f8b6829u, 0x82f63b78u, 0x709db87bu, 0x63cd4b8fu, 0x91a6c88cu,
    0x456cac67u, 0xb7072f64u, 0xa457dc90u, 0x563c5f93u, 0x082f63b7u, 0xfa44e0b4u,
    0xe9141340u, 0x1b7f9043u, 0xcfb5f4a8u, 0x3dde77abu, 0x2e8e845fu, 0xdce5075cu,
    0x92a8fc17u, 0x60c37f14u, 0x73938ce0u, 0x81f80fe3u, 0x55326b08u, 0xa759e80bu,
    0xb4091bffu, 0x466298fcu, 0x1871a4d8u, 0xea1a27dbu, 0xf94ad42fu, 0x0b21572cu,
    0xdfeb33c7u, 0x2d80b0c4u, 0x3ed04330u, 0xccbbc033u, 0xa24bb5a6u, 0x502036a5u,
    0x4370c551u, 0xb11b4652u, 0x65d122b9u, 0x97baa1bau, 0x84ea524eu, 0x7681d14du,
    0x2892ed69u, 0xdaf96e6au, 0xc9a99d9eu, 0x3bc21e9du, 0xef087a76u, 0x1d63f975u,
    0x0e330a81u, 0xfc588982u, 0xb21572c9u, 0x407ef1cau, 0x532e023eu, 0xa145813du,
    0x758fe5d6u, 0x87e466d5u, 0x94b49521u, 0x66df1622u, 0x38cc2a06u, 0xcaa7a905u,
    0xd9f75af1u, 0x2b9cd9f2u, 0xff56bd19u, 0x0d3d3e1au, 0x1e6dcdeeu, 0xec064eedu,
    0xc38d26c4u, 0x31e6a5c7u, 0x22b65633u, 0xd0ddd530u, 0x0417b1dbu, 0xf67c32d8u,
    0xe52cc12cu, 0x1747422fu, 0x49547e0bu, 0xbb3ffd08u, 0xa86f0efcu, 0x5a048dffu,
    0x8ecee914u, 0x7ca56a17u, 0x6ff599e3u, 0x9d9e1ae0u, 0xd3d3e1abu, 0x21b862a8u,
    0x32e8915cu, 0xc083125fu, 0x144976b4u, 0xe622f5b7u, 0xf5720643u, 0x07198540u,
    0x590ab964u, 0xab613a67u, 0xb831c993u, 0x4a5a4a90u, 0x9e902e7bu, 0x6cfbad78u,
    0x7fab5e8cu, 0x8dc0dd8fu, 0xe330a81au, 0x115b2b19u, 0x020bd8edu, 0xf0605beeu,
    0x24aa3f05u, 0xd6c1bc06u, 0xc5914ff2u, 0x37faccf1u, 0x69e9f0d5u, 0x9b8273d6u,
    0x88d28022u, 0x7ab90321u, 0xae7367cau, 0x5c18e4c9u, 0x4f48173du, 0xbd23943eu,
    0xf36e6f75u, 0x0105ec76u, 0x12551f82u, 0xe03e9c81u, 0x34f4f86au, 0xc69f7b69u,
    0xd5cf889du, 0x27a40b9eu, 0x79b737bau, 0x8bdcb4b9u, 0x988c474du, 0x6ae7c44eu,
    0xbe2da0a5u, 0x4c4623a6u, 0x5f16d052u, 0xad7d5351u,
};

uint32_t zz_crc32c_table(uint32_t crc, const void *p, size_t n)
{
    const uint8_t *b = p;
    crc = ~crc;
    for (size_t i = 0; i < n; i++)
        crc = crc_table[(crc ^ b[i]) & 0xFFu] ^ (crc >> 8);
    return ~crc;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* The SSE4.2 crc32 instruction computes the same CRC32C (reflected 0x82F63B78, no inversion
 * of its own) 8 bytes per step: every record written is checksummed once, every record read
 * at start once, so the table's byte a step cost a few % of a durable replica's CPU. */
__attribute__((target("sse4.2"))) static uint32_t crc32c_sse42(uint32_t crc, const void *p,
                                                               size_t n)
{
    const uint8_t *b = p;
    uint64_t c = ~crc;
    for (; n > 0 && ((uintptr_t)b & 7u) != 0; n--)
        c = __builtin_ia32_crc32qi((uint32_t)c, *b++);
    for (; n >= 8; n -= 8, b += 8) {
        uint64_t w;
        memcpy(&w, b, sizeof w);
        c = __builtin_ia32_crc32di(c, w);
    }
    for (; n > 0; n--)
        c = __builtin_ia32_crc32qi((uint32_t)c, *b++);
    return ~(uint32_t)c;
}

uint32_t zz_crc32c(uint32_t crc, const void *p, size_t n)
{
    /* a load and a test of what the compiler's runtime read with cpuid at start */
    return __builtin_cpu_supports("sse4.2") ? crc32c_sse42(crc, p, n)
                                            : zz_crc32c_table(crc, p, n);
}
#else
uint32_t zz_crc32c(uint32_t crc, const void *p, size_t n)
{
    return zz_crc32c_table(crc, p, n);
}
#endif

static uint32_t ld32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static void st32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

/* The checksum of a record whose framing starts at rec: length, epoch, type and body. */
static uint32_t record_crc(const uint8_t *rec, uint32_t len)
{
    uint32_t c = zz_crc32c(0, rec, 4);
    return zz_crc32c(c, rec + 8, 4 + (size_t)len);
}

size_t zz_wal_begin(zz_buf *b, uint8_t type, uint32_t epoch)
{
    size_t start = b->len;
    zz_put_u32(b, 0);
    zz_put_u32(b, 0);
    zz_put_u32(b, epoch);
    zz_put_u8(b, type);
    return start;
}

void zz_wal_end(zz_buf *b, size_t start)
{
    if (b->oom || b->len < start + ZZ_WAL_HDR + 1 ||
        b->len - start - ZZ_WAL_HDR > ZZ_WAL_MAX_RECORD) {
        b->oom = 1; /* a record over the limit is never written */
        return;
    }
    uint8_t *rec = b->p + start;
    uint32_t len = (uint32_t)(b->len - start - ZZ_WAL_HDR);
    st32(rec, len);
    st32(rec + 4, record_crc(rec, len));
}

/* The length of a valid record of `epoch` at buf[off], or 0. */
static uint32_t valid_at(const uint8_t *buf, size_t len, size_t off, uint32_t epoch)
{
    if (len - off < ZZ_WAL_HDR + 1 || ld32(buf + off + 8) != epoch)
        return 0;
    uint32_t rl = ld32(buf + off);
    if (rl == 0 || rl > ZZ_WAL_MAX_RECORD || len - off - ZZ_WAL_HDR < rl ||
        ld32(buf + off + 4) != record_crc(buf + off, rl))
        return 0;
    return rl;
}

/* An invalid record at `bad`: corrupt if a valid record of the log's epoch lies anywhere
 * after it (records the log had synced are lost), else a torn tail. */
static int classify(const uint8_t *buf, size_t len, size_t bad, uint32_t epoch, int have_epoch)
{
    if (!have_epoch)
        return ZZ_WAL_CORRUPT; /* the first record, which names the log's owner, is bad */
    uint8_t pat[4];
    st32(pat, epoch);
    /* Candidates are where the epoch's bytes sit 8 bytes into a record. */
    size_t from = bad + 1 + 8;
    while (from + 4 <= len) {
        const uint8_t *hit = memmem(buf + from, len - from, pat, sizeof pat);
        if (!hit)
            break;
        size_t o = (size_t)(hit - buf) - 8;
        if (valid_at(buf, len, o, epoch))
            return ZZ_WAL_CORRUPT;
        from = (size_t)(hit - buf) + 1;
    }
    return ZZ_WAL_TORN;
}

size_t zz_wal_scan(const uint8_t *buf, size_t len, zz_wal_apply *fn, void *ctx, int *tail,
                   uint32_t *epoch)
{
    static const uint8_t end_mark[ZZ_WAL_HDR];
    size_t off = 0;
    int have_epoch = 0;
    *tail = ZZ_WAL_CLEAN;
    *epoch = 0;
    while (off < len) {
        size_t left = len - off;
        if (left >= ZZ_WAL_HDR && memcmp(buf + off, end_mark, ZZ_WAL_HDR) == 0)
            break; /* the zeros every write leaves after its records: the end */
        if (left < ZZ_WAL_HDR && memcmp(buf + off, end_mark, left) == 0)
            break; /* the data ends inside the end mark */
        if (left >= ZZ_WAL_HDR && have_epoch && ld32(buf + off + 8) != *epoch) {
            uint32_t rl = ld32(buf + off);
            if (rl <= ZZ_WAL_MAX_RECORD && left - ZZ_WAL_HDR >= rl && rl > 0 &&
                ld32(buf + off + 4) == record_crc(buf + off, rl))
                break; /* a whole record of another epoch: a previous use of the file */
        }
        uint32_t rl = have_epoch ? valid_at(buf, len, off, *epoch)
                                 : left > ZZ_WAL_HDR ? valid_at(buf, len, off, ld32(buf + 8)) : 0;
        if (!rl) {
            *tail = classify(buf, len, off, *epoch, have_epoch);
            break;
        }
        if (!have_epoch) {
            *epoch = ld32(buf + off + 8);
            have_epoch = 1;
        }
        if (fn) {
            int rc = fn(ctx, buf[off + ZZ_WAL_HDR], buf + off + ZZ_WAL_HDR + 1, rl - 1);
            if (rc) {
                *tail = rc;
                break;
            }
        }
        off += ZZ_WAL_HDR + rl;
    }
    return off;
}

/* ---- the body reader ---- */

const uint8_t *zz_wal_raw(zz_wal_rd *d, uint32_t n)
{
    if (d->bad || d->len - d->off < n) {
        d->bad = 1;
        return NULL;
    }
    const uint8_t *p = d->p + d->off;
    d->off += n;
    return p;
}

uint8_t zz_wal_u8(zz_wal_rd *d)
{
    const uint8_t *p = zz_wal_raw(d, 1);
    return p ? p[0] : 0;
}

uint16_t zz_wal_u16(zz_wal_rd *d)
{
    const uint8_t *p = zz_wal_raw(d, 2);
    return p ? (uint16_t)(p[0] << 8 | p[1]) : 0;
}

uint32_t zz_wal_u32(zz_wal_rd *d)
{
    const uint8_t *p = zz_wal_raw(d, 4);
    return p ? ld32(p) : 0;
}

uint64_t zz_wal_u64(zz_wal_rd *d)
{
    const uint8_t *p = zz_wal_raw(d, 8);
    return p ? (uint64_t)ld32(p) << 32 | ld32(p + 4) : 0;
}

const uint8_t *zz_wal_bytes(zz_wal_rd *d, uint32_t *n)
{
    *n = zz_wal_u32(d);
    const uint8_t *p = zz_wal_raw(d, *n);
    if (!p)
        *n = 0;
    return p;
}

/* ---- records from the replica's state ---- */

enum {
    SL_HAS_PP = 1, SL_HELD = 2, SL_NULL = 4, SL_SENT_PREPARE = 8, SL_PREPARED = 16,
    SL_COMMITTED = 32, SL_HAS_P = 64, SL_HAS_Q = 128,
};

/* Is the withholding after a host restart still in force (a later view or a stable
 * checkpoint past it ends it)? */
static int forgetting(const zz_replica *r)
{
    const zz_wal *w = &r->wal;
    return w->lost_until && r->view <= w->lost_view && r->stable < w->lost_until;
}

static void put_header(zz_buf *b, const zz_replica *r, uint32_t epoch)
{
    static const uint8_t unknown[ZZ_WAL_BOOT_LEN];
    size_t st = zz_wal_begin(b, ZZ_WAL_HEADER, epoch);
    zz_put_u32(b, ZZ_WAL_VERSION);
    zz_put_u16(b, r->conf->service);
    zz_put_u32(b, r->id);
    zz_put_u32(b, r->n);
    zz_put_u64(b, zz_wal_abstains(r, r->wal.abstain_until) ? r->wal.abstain_until : 0);
    zz_put_raw(b, r->wal.boot_known ? r->wal.boot : unknown, ZZ_WAL_BOOT_LEN);
    int lost = forgetting(r);
    zz_put_u32(b, lost ? r->wal.lost_view : 0);
    zz_put_u64(b, lost ? r->wal.lost_until : 0);
    zz_wal_end(b, st);
}

static void put_view(zz_buf *b, const zz_replica *r, uint32_t epoch)
{
    size_t st = zz_wal_begin(b, ZZ_WAL_VIEW, epoch);
    zz_put_u32(b, r->view);
    zz_put_u8(b, (uint8_t)(r->in_vc != 0));
    zz_put_u32(b, r->vc_raw[r->id] ? r->vc_view[r->id] : 0);
    zz_put_bytes(b, r->vc_raw[r->id], r->vc_raw[r->id] ? r->vc_len[r->id] : 0);
    zz_put_bytes(b, r->nv_raw, r->nv_raw ? r->nv_len : 0);
    zz_wal_end(b, st);
}

static void put_slot(zz_buf *b, const zz_slot *s, int with_batch, uint32_t epoch)
{
    uint8_t fl = (uint8_t)((s->has_pp ? SL_HAS_PP : 0) | (s->held ? SL_HELD : 0) |
                           (s->is_null ? SL_NULL : 0) | (s->sent_prepare ? SL_SENT_PREPARE : 0) |
                           (s->prepared ? SL_PREPARED : 0) | (s->committed ? SL_COMMITTED : 0) |
                           (s->has_p ? SL_HAS_P : 0) | (s->has_q ? SL_HAS_Q : 0));
    size_t st = zz_wal_begin(b, ZZ_WAL_SLOT, epoch);
    zz_put_u64(b, s->seq);
    zz_put_u32(b, s->view);
    zz_put_u8(b, fl);
    zz_put_raw(b, s->digest, ZZ_DIGEST_LEN);
    zz_put_u32(b, s->p_view);
    zz_put_raw(b, s->p_dig, ZZ_DIGEST_LEN);
    zz_put_u32(b, s->q_view);
    zz_put_raw(b, s->q_dig, ZZ_DIGEST_LEN);
    int hb = with_batch && s->batch && !s->is_null;
    zz_put_u8(b, (uint8_t)hb);
    if (hb)
        zz_put_bytes(b, s->batch, s->batch_len);
    zz_wal_end(b, st);
}

/* The stable checkpoint: seq, digest, its 2g+1 signed CHECKPOINTs, our state encoding. */
static int put_stable(zz_buf *b, zz_replica *r, uint32_t epoch)
{
    const zz_ckpt *k = NULL;
    for (uint32_t i = 0; i < r->n_ckpts && !k; i++)
        if (r->ckpts[i].seq == r->stable && r->ckpts[i].have_own && r->ckpts[i].state)
            k = &r->ckpts[i];
    if (!k || memcmp(k->own_dig, r->stable_dig, ZZ_DIGEST_LEN) != 0)
        return -1;
    size_t st = zz_wal_begin(b, ZZ_WAL_STABLE, epoch);
    zz_put_u64(b, r->stable);
    zz_put_raw(b, r->stable_dig, ZZ_DIGEST_LEN);
    zz_put_u32(b, r->stable_proof_n);
    for (uint32_t i = 0; i < r->stable_proof_n; i++)
        zz_put_bytes(b, r->stable_proof[i], r->stable_proof_len[i]);
    zz_put_bytes(b, k->state, k->state_len);
    zz_wal_end(b, st);
    return 0;
}

/* Does the slot hold anything a restart needs? */
static int slot_durable(const zz_slot *s)
{
    return s->seq && (s->has_pp || s->has_p || s->has_q);
}

void zz_wal_slot(zz_replica *r, const zz_slot *s, int with_batch, int dep)
{
    zz_wal *w = &r->wal;
    if (!w->enabled || w->replaying)
        return;
    /* Written-only needs the boot id: without it a host restart could not be told from a
     * process restart, and the record is synced like a COMMIT's. */
    if (dep == ZZ_WAL_WRITTEN && !w->boot_known)
        dep = ZZ_WAL_SYNCED;
    w->must_sync |= dep == ZZ_WAL_SYNCED;
    w->must_write |= dep == ZZ_WAL_WRITTEN;
    w->seqno++;
    if (w->compact_due)
        return; /* a rewrite pending: it takes every slot from memory */
    size_t before = w->pend.len;
    put_slot(&w->pend, s, with_batch, w->epoch);
    w->records++;
    w->pend_records++;
    w->bytes += w->pend.len - before;
}

void zz_wal_view(zz_replica *r)
{
    zz_wal *w = &r->wal;
    if (!w->enabled || w->replaying)
        return;
    w->must_sync = 1;
    w->view_pending = 1;
    w->view_ticket = 0; /* the sync asked after this record is written ends view_pending */
    w->seqno++;
    if (w->compact_due)
        return;
    size_t before = w->pend.len;
    put_view(&w->pend, r, w->epoch);
    w->records++;
    w->pend_records++;
    w->bytes += w->pend.len - before;
}

void zz_wal_xstable(zz_replica *r)
{
    zz_wal *w = &r->wal;
    if (!w->enabled || w->replaying)
        return;
    w->seqno++;
    if (w->compact_due)
        return;
    size_t before = w->pend.len;
    size_t st = zz_wal_begin(&w->pend, ZZ_WAL_XSTABLE, w->epoch);
    zz_put_u64(&w->pend, r->zz.exec_stable);
    zz_put_raw(&w->pend, r->zz.exec_stable_dig, ZZ_DIGEST_LEN);
    zz_put_u64(&w->pend, r->zz.xlog_low);
    zz_wal_end(&w->pend, st);
    w->records++;
    w->pend_records++;
    w->bytes += w->pend.len - before;
}

void zz_wal_stable(zz_replica *r)
{
    zz_wal *w = &r->wal;
    if (!w->enabled || w->replaying)
        return;
    w->compact_due = 1;
    zz_buf_reset(&w->pend);
    w->pend_records = 0;
}

/* ---- applying records (recovery) ---- */

static int apply_header(zz_replica *r, zz_wal_rd *d)
{
    zz_wal *w = &r->wal;
    uint32_t version = zz_wal_u32(d);
    uint16_t service = zz_wal_u16(d);
    uint32_t id = zz_wal_u32(d), n = zz_wal_u32(d);
    if ((version != 1 && version != ZZ_WAL_VERSION) || service != r->conf->service ||
        id != r->id || n != r->n)
        return ZZ_WAL_FOREIGN;
    uint64_t abstain = zz_wal_u64(d); /* still abstaining when this file was written */
    /* Version 1 synced every record a send depended on: no boot to compare. */
    const uint8_t *boot = version >= 2 ? zz_wal_raw(d, ZZ_WAL_BOOT_LEN) : NULL;
    uint32_t lost_view = version >= 2 ? zz_wal_u32(d) : 0;
    uint64_t lost_until = version >= 2 ? zz_wal_u64(d) : 0;
    if (d->bad || d->off != d->len)
        return ZZ_WAL_CORRUPT;
    if (abstain > w->abstain_until)
        w->abstain_until = abstain;
    w->log_v2 = version >= 2;
    if (boot)
        memcpy(w->log_boot, boot, ZZ_WAL_BOOT_LEN);
    else
        memset(w->log_boot, 0, ZZ_WAL_BOOT_LEN);
    /* Still withholding when this file was written: the later view's bound is the one that
     * can be in force. */
    if (lost_until && (!w->lost_until || lost_view > w->lost_view ||
                       (lost_view == w->lost_view && lost_until > w->lost_until))) {
        w->lost_view = lost_view;
        w->lost_until = lost_until;
    }
    return 0;
}

static int apply_stable(zz_replica *r, zz_wal_rd *d)
{
    uint64_t seq = zz_wal_u64(d);
    const uint8_t *dig = zz_wal_raw(d, ZZ_DIGEST_LEN);
    uint32_t np = zz_wal_u32(d);
    uint32_t proof_at = d->off;
    for (uint32_t i = 0; i < np && !d->bad; i++) {
        uint32_t n;
        zz_wal_bytes(d, &n);
    }
    if (d->bad || np > r->n)
        return ZZ_WAL_CORRUPT;
    zz_blist proof = {np, d->p + proof_at, d->off - proof_at};
    uint32_t state_len;
    const uint8_t *state = zz_wal_bytes(d, &state_len);
    if (d->bad || d->off != d->len || !dig)
        return ZZ_WAL_CORRUPT;
    return zz_restore_stable(r, seq, dig, &proof, state, state_len) == 0 ? 0 : ZZ_WAL_CORRUPT;
}

static int apply_view(zz_replica *r, zz_wal_rd *d)
{
    uint32_t view = zz_wal_u32(d);
    uint8_t in_vc = zz_wal_u8(d);
    uint32_t vc_view = zz_wal_u32(d);
    uint32_t vc_len, nv_len;
    const uint8_t *vc = zz_wal_bytes(d, &vc_len);
    const uint8_t *nv = zz_wal_bytes(d, &nv_len);
    if (d->bad || d->off != d->len || in_vc > 1)
        return ZZ_WAL_CORRUPT;
    zz_msg m;
    if (vc_len && (zz_decode(vc, vc_len, &m) != ZZ_OK || m.type != ZZ_VIEW_CHANGE ||
                   m.sender != r->id || m.u.view_change.new_view != vc_view))
        return ZZ_WAL_CORRUPT;
    if (nv_len && (zz_decode(nv, nv_len, &m) != ZZ_OK || m.type != ZZ_NEW_VIEW ||
                   m.u.new_view.view != view))
        return ZZ_WAL_CORRUPT;
    uint8_t *vc_copy = vc_len ? zz_memdup(vc, vc_len) : NULL;
    uint8_t *nv_copy = nv_len ? zz_memdup(nv, nv_len) : NULL;
    if ((vc_len && !vc_copy) || (nv_len && !nv_copy)) {
        free(vc_copy);
        free(nv_copy);
        return ZZ_WAL_CORRUPT;
    }
    r->view = view;
    r->in_vc = in_vc;
    if (vc_copy) {
        free(r->vc_raw[r->id]);
        r->vc_raw[r->id] = vc_copy;
        r->vc_len[r->id] = vc_len;
        r->vc_view[r->id] = vc_view;
    }
    free(r->nv_raw);
    r->nv_raw = nv_copy;
    r->nv_len = nv_len;
    return 0;
}

static int apply_slot(zz_replica *r, zz_wal_rd *d)
{
    uint64_t seq = zz_wal_u64(d);
    uint32_t view = zz_wal_u32(d);
    uint8_t fl = zz_wal_u8(d);
    const uint8_t *dig = zz_wal_raw(d, ZZ_DIGEST_LEN);
    uint32_t p_view = zz_wal_u32(d);
    const uint8_t *p_dig = zz_wal_raw(d, ZZ_DIGEST_LEN);
    uint32_t q_view = zz_wal_u32(d);
    const uint8_t *q_dig = zz_wal_raw(d, ZZ_DIGEST_LEN);
    uint8_t hb = zz_wal_u8(d);
    uint32_t blen = 0;
    const uint8_t *batch = hb ? zz_wal_bytes(d, &blen) : NULL;
    if (d->bad || d->off != d->len || hb > 1 || seq == 0 || !dig || !p_dig || !q_dig)
        return ZZ_WAL_CORRUPT;
    uint8_t bd[ZZ_DIGEST_LEN];
    if (hb) {
        zz_sha256(batch, blen, bd);
        if (memcmp(bd, dig, ZZ_DIGEST_LEN) != 0)
            return ZZ_WAL_CORRUPT;
    }
    r->wal.recovered_slots++;
    zz_slot *s = zz_slot_get(r, seq);
    if (!s)
        return 0; /* at or below the stable checkpoint (history), or beyond a smaller window */
    int keep_batch = s->batch && memcmp(s->digest, dig, ZZ_DIGEST_LEN) == 0;
    if (!keep_batch) {
        free(s->batch);
        s->batch = NULL;
        s->batch_len = 0;
    }
    free(s->pp_raw);
    s->pp_raw = NULL;
    s->pp_raw_len = 0;
    s->view = view;
    memcpy(s->digest, dig, ZZ_DIGEST_LEN);
    s->has_pp = !!(fl & SL_HAS_PP);
    s->held = !!(fl & SL_HELD);
    s->is_null = !!(fl & SL_NULL);
    s->sent_prepare = !!(fl & SL_SENT_PREPARE);
    s->prepared = s->sent_commit = !!(fl & SL_PREPARED);
    s->committed = !!(fl & SL_COMMITTED);
    s->has_p = !!(fl & SL_HAS_P);
    s->has_q = !!(fl & SL_HAS_Q);
    s->p_view = p_view;
    memcpy(s->p_dig, p_dig, ZZ_DIGEST_LEN);
    s->q_view = q_view;
    memcpy(s->q_dig, q_dig, ZZ_DIGEST_LEN);
    s->prep_view[r->id] = s->sent_prepare ? view : UINT32_MAX;
    memcpy(s->prep_dig[r->id], dig, ZZ_DIGEST_LEN);
    s->commit_view[r->id] = s->prepared ? view : UINT32_MAX;
    memcpy(s->commit_dig[r->id], dig, ZZ_DIGEST_LEN);
    if (hb && !s->batch && zz_slot_set_batch(r, s, batch, blen) != 0)
        return ZZ_WAL_CORRUPT;
    return 0;
}

static int apply_xstable(zz_replica *r, zz_wal_rd *d)
{
    uint64_t seq = zz_wal_u64(d);
    const uint8_t *dig = zz_wal_raw(d, ZZ_DIGEST_LEN);
    uint64_t low = zz_wal_u64(d);
    if (d->bad || d->off != d->len || !dig || low > seq)
        return ZZ_WAL_CORRUPT;
    zz_xlog_restore_stable(r, seq, dig, low);
    return 0;
}

static int apply_xentry(zz_replica *r, zz_wal_rd *d)
{
    static const uint8_t null_digest[ZZ_DIGEST_LEN];
    uint64_t seq = zz_wal_u64(d);
    const uint8_t *dig = zz_wal_raw(d, ZZ_DIGEST_LEN);
    uint32_t blen;
    const uint8_t *batch = zz_wal_bytes(d, &blen);
    if (d->bad || d->off != d->len || !dig || seq == 0)
        return ZZ_WAL_CORRUPT;
    uint8_t bd[ZZ_DIGEST_LEN];
    if (memcmp(dig, null_digest, ZZ_DIGEST_LEN) == 0) {
        if (blen != 0)
            return ZZ_WAL_CORRUPT;
    } else {
        zz_sha256(batch, blen, bd);
        if (memcmp(bd, dig, ZZ_DIGEST_LEN) != 0)
            return ZZ_WAL_CORRUPT;
    }
    zz_xlog_restore(r, seq, dig, batch, blen);
    return 0;
}

static int apply(void *ctx, uint8_t type, const uint8_t *body, uint32_t len)
{
    zz_replica *r = ctx;
    zz_wal_rd d = {body, len, 0, 0};
    int rc;
    /* The first record names the log's owner; nothing is applied from a log without it. */
    if (r->wal.recovered_records == 0 && type != ZZ_WAL_HEADER)
        return ZZ_WAL_CORRUPT;
    switch (type) {
    case ZZ_WAL_HEADER: rc = apply_header(r, &d); break;
    case ZZ_WAL_STABLE: rc = apply_stable(r, &d); break;
    case ZZ_WAL_VIEW: rc = apply_view(r, &d); break;
    case ZZ_WAL_SLOT: rc = apply_slot(r, &d); break;
    case ZZ_WAL_SNAPEND: rc = d.len == 0 ? 0 : ZZ_WAL_CORRUPT; break;
    case ZZ_WAL_XSTABLE: rc = apply_xstable(r, &d); break;
    case ZZ_WAL_XENTRY: rc = apply_xentry(r, &d); break;
    default: rc = ZZ_WAL_CORRUPT; break;
    }
    if (rc == 0)
        r->wal.recovered_records++;
    return rc;
}

/* ---- files ---- */

/* The page cache keeps the folios a write makes, and a write larger than a page makes
 * larger folios (ext4, Linux 6.16 and later), over which every later small write of the
 * log, and its writeback, walks each block's buffer: 2.9 against 1.3 µs of CPU per
 * 700-byte pwrite here, in a file zero-filled with 1 MiB against 4 KiB writes. A write
 * longer than a page therefore goes in pieces that end at page boundaries (the zeros of
 * grow, a rewrite), so the log's pages stay single-page folios. */
static size_t page_size(void)
{
    /* Asked each time, not cached in a static (no mutable state outside the replica
     * struct): glibc answers from the value the kernel gave the process at start. */
    long p = sysconf(_SC_PAGESIZE);
    return p > 0 && p <= (1L << 20) ? (size_t)p : 4096;
}

static int write_at(int fd, const uint8_t *p, size_t n, uint64_t off)
{
    size_t page = page_size();
    while (n > 0) {
        size_t m = n > page ? page - (size_t)(off % page) : n;
        ssize_t w = pwrite(fd, p, m, (off_t)off);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        p += w;
        n -= (size_t)w;
        off += (uint64_t)w;
    }
    return 0;
}

static void fatal(zz_replica *r, const char *what, const char *path)
{
    zz_log("zz-agreed: replica %u: durable state: %s %s: %s; stopping (a replica must not "
           "send what it could forget)\n", r->id, what, path, strerror(errno));
    _exit(3);
}

static int sync_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    int rc = fsync(fd);
    close(fd);
    return rc;
}

/* Open file i (created if absent; a new file's name is synced into the directory). */
static int open_file(zz_wal *w, int i)
{
    if (w->fd[i] >= 0)
        return 0;
    int created = access(w->path[i], F_OK) != 0;
    w->fd[i] = open(w->path[i], O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (w->fd[i] < 0)
        return -1;
    struct stat sb;
    if (fstat(w->fd[i], &sb) != 0)
        return -1;
    w->size[i] = (uint64_t)sb.st_size;
    if (created && w->fsync && sync_dir(w->dir) != 0)
        return -1;
    return 0;
}

/* Zeros up to at least `need` bytes (whole chunks), synced with the file's size, so that
 * appends overwrite allocated blocks and an fdatasync has only data to write (write_at
 * writes them a page at a time). */
static int grow(zz_wal *w, int i, uint64_t need)
{
    if (w->size[i] >= need)
        return 0;
    uint64_t to = (need + ZZ_WAL_CHUNK - 1) / ZZ_WAL_CHUNK * ZZ_WAL_CHUNK;
    size_t piece = 1u << 20;
    uint8_t *zero = calloc(1, piece);
    if (!zero) {
        errno = ENOMEM;
        return -1;
    }
    int rc = 0;
    for (uint64_t o = w->size[i]; o < to && rc == 0; o += piece)
        rc = write_at(w->fd[i], zero, to - o < piece ? (size_t)(to - o) : piece, o);
    free(zero);
    if (rc != 0 || (w->fsync && fsync(w->fd[i]) != 0))
        return -1;
    w->size[i] = to;
    w->grown++;
    return 0;
}

/* Write the records in b at `off` of file i, with the zero terminator after them. */
static int put_records(zz_wal *w, int i, zz_buf *b, uint64_t off)
{
    static const uint8_t end[ZZ_WAL_HDR];
    zz_put_raw(b, end, sizeof end);
    if (b->oom) {
        errno = ENOMEM;
        return -1;
    }
    int rc = grow(w, i, off + b->len);
    if (rc == 0)
        rc = write_at(w->fd[i], b->p, b->len, off);
    b->len -= sizeof end;
    return rc;
}

/* A prepared slot waits for its P record's sync before this replica's own COMMIT counts in
 * its commit quorum (normal.c): once seq_durable moves, a 0 ms timer checks those slots
 * again (not from here: this runs inside net's barrier, where no message may be made). */
static void rescan(void *ctx)
{
    zz_replica *r = ctx;
    r->wal.rescan_due = 0;
    for (uint64_t seq = r->last_exec + 1; seq <= r->stable + r->L; seq++) {
        zz_slot *s = &r->slots[seq % r->L];
        if (s->seq == seq && s->prepared && !s->committed)
            zz_check_slot(r, s);
    }
}

static void durable_to(zz_replica *r, uint64_t seq)
{
    zz_wal *w = &r->wal;
    if (seq <= w->seq_durable)
        return;
    w->seq_durable = seq;
    if (!w->rescan_due && r->net && !w->replaying) {
        w->rescan_due = 1;
        zz_net_timer(r->net, 0, rescan, r);
    }
}

uint64_t zz_wal_mark(const zz_replica *r)
{
    return r->wal.enabled ? r->wal.seqno : 0;
}

int zz_wal_synced(const zz_replica *r, uint64_t mark)
{
    const zz_wal *w = &r->wal;
    return !w->enabled || !w->fsync || w->seq_durable >= mark;
}

/* Rewrite the log from memory into the other file with the next epoch: header, stable
 * checkpoint, view, every slot of the window, SNAPEND; synced, it replaces the current
 * file (recovery takes the complete file of the higher epoch). -1 with errno set. */
static int compact(zz_replica *r)
{
    zz_wal *w = &r->wal;
    int t = 1 - w->cur;
    uint32_t ep = w->epoch + 1;
    zz_buf *b = &w->snap;
    zz_buf_reset(b);
    put_header(b, r, ep);
    if (r->stable)
        put_stable(b, r, ep); /* always there after make_stable; without it slots still help */
    zz_xlog_write(r, b, ep); /* external execution: its log below the stable checkpoint */
    put_view(b, r, ep);
    for (uint64_t seq = r->stable + 1; seq <= r->stable + r->L; seq++) {
        const zz_slot *s = &r->slots[seq % r->L];
        if (s->seq == seq && slot_durable(s))
            put_slot(b, s, 1, ep);
    }
    size_t st = zz_wal_begin(b, ZZ_WAL_SNAPEND, ep);
    zz_wal_end(b, st);
    if (open_file(w, t) != 0 || put_records(w, t, b, 0) != 0 ||
        (w->fsync && fdatasync(w->fd[t]) != 0))
        return -1;
    w->cur = t;
    w->epoch = ep;
    w->off = b->len;
    w->compactions++;
    w->compact_due = 0;
    w->must_write = 0;
    w->view_pending = 0;
    w->view_ticket = 0;
    w->unsynced = 0;
    w->pend_records = 0;
    /* Everything the log held is in the rewrite: a ticket of its own, durable now (with
     * durability fsync; so are the tickets before it, including one the thread still syncs
     * in the old file). */
    w->issued++;
    if (w->fsync) {
        w->durable = w->issued;
        durable_to(r, w->seqno);
    }
    w->want = 0;
    zz_buf_reset(&w->pend);
    if (b->cap > (8u << 20)) { /* a large window's rewrite is not kept for good */
        zz_buf_free(b);
        zz_buf_init(b);
    }
    return 0;
}

/* Records a send needs only written, or that nothing sent depends on, wait for a record a
 * send needs synced (or the timer) to be synced. */
static void sync_now(zz_replica *r);

/* Write the pending records after the log's end, without a sync. */
static void write_pending(zz_replica *r)
{
    zz_wal *w = &r->wal;
    if (w->pend.len == 0)
        return; /* the end mark of the last write is in place */
    uint64_t t0 = zz_mono_us();
    if (put_records(w, w->cur, &w->pend, w->off) != 0)
        fatal(r, "cannot write", w->path[w->cur]);
    uint64_t us = zz_mono_us() - t0;
    w->write_us_total += us;
    if (us > w->write_us_max)
        w->write_us_max = us;
    w->writes++;
    w->off += w->pend.len;
    w->unsynced += w->pend_records;
    w->written_total += w->pend_records;
    w->pend_records = 0;
    zz_buf_reset(&w->pend);
    if (w->pend.cap > (8u << 20)) {
        zz_buf_free(&w->pend);
        zz_buf_init(&w->pend);
    }
}

/* ---- the sync threads ---- */

/* Each thread takes the last ticket asked (a later one covers an earlier one still waiting:
 * it was asked after the earlier one's records were written), syncs the file named with it
 * and reports it done by the eventfd. Up to sync_threads syncs run at once, so a
 * ticket asked while one runs does not wait for it. Each thread syncs through descriptors
 * of its own (opened by path): the kernel reports a writeback error to every open file
 * description once, so a sync that returns 0 on its own description means nothing written
 * before it failed, whichever sync (a thread's, the loop's rewrite) started that writeback.
 * A thread touches nothing but the (mu) fields, its descriptors, the paths (set before it
 * starts, never changed) and the eventfd. */
static void *sync_main(void *arg)
{
    zz_wal *w = arg;
    int fds[2] = {-1, -1};
    zz_sched_slice(w->slice_us);
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->t_stop && w->t_ticket == w->t_taken)
            pthread_cond_wait(&w->cv, &w->mu);
        if (w->t_stop)
            break;
        int file = w->t_file;
        uint64_t ticket = w->t_ticket;
        w->t_taken = ticket;
        w->t_running++;
        uint64_t t0 = zz_mono_us();
        w->t_start_us_total += t0 - w->t_asked_us;
        pthread_mutex_unlock(&w->mu);
        /* test only (conf inject_sync_gate): no sync starts while the file exists */
        while (w->gate[0] && access(w->gate, F_OK) == 0) {
            struct timespec ts = {0, 10 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
        if (fds[file] < 0)
            fds[file] = open(w->path[file], O_RDWR | O_CLOEXEC);
        int rc = fds[file] >= 0 ? fdatasync(fds[file]) : -1;
        int err = rc != 0 ? errno : 0;
        uint64_t t1 = zz_mono_us(), us = t1 - t0;
        pthread_mutex_lock(&w->mu);
        w->t_done_us = t1;
        w->t_running--;
        if (err && !w->t_err) {
            w->t_err = err;
            w->t_err_file = file;
        }
        else if (!err && ticket > w->t_done)
            w->t_done = ticket;
        w->t_syncs++;
        w->t_us_total += us;
        if (us > w->t_us_max)
            w->t_us_max = us;
        pthread_mutex_unlock(&w->mu);
        uint64_t one = 1;
        ssize_t n = write(w->efd, &one, sizeof one);
        (void)n; /* a full eventfd counter still wakes the loop */
        pthread_mutex_lock(&w->mu);
    }
    pthread_mutex_unlock(&w->mu);
    for (int i = 0; i < 2; i++)
        if (fds[i] >= 0)
            close(fds[i]);
    return NULL;
}

/* Start the writeback of what was written since the last ticket (SYNC_FILE_RANGE_WRITE:
 * the write is queued to the disk, nothing waited for), so that the thread's fdatasync,
 * which comes a wakeup later, finds it under way or done. Only a head start: the
 * fdatasync still writes, waits for and flushes everything (a failed writeback is reported
 * to it), so an error here changes nothing and is not looked at. */
static void start_writeback(zz_wal *w)
{
    if (w->wb_epoch == w->epoch && w->wb_off == w->off)
        return; /* nothing written since */
    uint64_t from = w->wb_epoch == w->epoch ? w->wb_off : 0;
    uint64_t to = w->off + ZZ_WAL_HDR; /* the end mark after the records */
    size_t page = page_size();
    from -= from % page;
    if (to > from)
        (void)sync_file_range(w->fd[w->cur], (off_t)from, (off_t)(to - from),
                              SYNC_FILE_RANGE_WRITE);
    w->wb_off = w->off;
    w->wb_epoch = w->epoch;
}

/* Ask the threads for the next ticket: it covers every record written so far (the pending
 * ones are written first). A thread is free (sync_room). */
static uint64_t sync_issue(zz_replica *r)
{
    zz_wal *w = &r->wal;
    if (!w->compact_due) {
        write_pending(r);
        start_writeback(w);
    }
    w->busy = ++w->issued;
    /* everything logged is written now, unless a rewrite is due (it holds what was dropped) */
    w->ring_seq[w->busy % ZZ_WAL_RING] = w->compact_due ? w->seq_durable : w->seqno;
    w->ring_records[w->busy % ZZ_WAL_RING] = w->written_total;
    w->ring_since_us[w->busy % ZZ_WAL_RING] = zz_mono_us();
    w->unsynced = 0;
    w->want = 0;
    if (w->view_pending && !w->compact_due)
        w->view_ticket = w->busy; /* the VIEW record is written: this sync covers it */
    pthread_mutex_lock(&w->mu);
    w->t_file = w->cur;
    w->t_ticket = w->busy;
    w->t_asked_us = w->ring_since_us[w->busy % ZZ_WAL_RING];
    pthread_mutex_unlock(&w->mu);
    /* Signalled after the unlock: a thread woken while the loop still held mu would block
     * on it at once and need a second wakeup. It checks the ticket under mu, so a signal
     * after the unlock wakes it as well. */
    pthread_cond_signal(&w->cv);
    return w->busy;
}

/* 1: a thread can take a new ticket now (fewer running than threads, none waiting). */
static int sync_room(zz_wal *w)
{
    pthread_mutex_lock(&w->mu);
    int room = w->t_running + (w->t_ticket > w->t_taken) < w->n_thr;
    pthread_mutex_unlock(&w->mu);
    return room;
}

/* The ticket that covers every record written so far (call after write_pending): the last
 * one asked if nothing was written since and it is not done, a new one if a thread is
 * free, else the next one (asked when a sync returns). */
static uint64_t sync_ask(zz_replica *r)
{
    zz_wal *w = &r->wal;
    if (w->busy > w->durable && w->unsynced == 0 && w->pend.len == 0) {
        if (w->view_pending && !w->view_ticket && !w->compact_due)
            w->view_ticket = w->busy;
        return w->busy;
    }
    if (sync_room(w))
        return sync_issue(r);
    w->want = 1;
    return w->issued + 1;
}

/* The eventfd: a sync finished. The highest ticket done is durable (and every one before
 * it); the frames waiting for it leave, and the next sync starts if records wait for one. */
static void on_synced(void *ctx)
{
    zz_replica *r = ctx;
    zz_wal *w = &r->wal;
    uint64_t v;
    ssize_t n = read(w->efd, &v, sizeof v);
    (void)n; /* EAGAIN: what is below was reported with an earlier wakeup */
    pthread_mutex_lock(&w->mu);
    uint64_t done = w->t_done, syncs = w->t_syncs, us_total = w->t_us_total;
    uint64_t us_max = w->t_us_max, done_us = w->t_done_us;
    int err = w->t_err, err_file = w->t_err_file;
    pthread_mutex_unlock(&w->mu);
    uint64_t now = zz_mono_us();
    if (err) {
        errno = err;
        fatal(r, "cannot sync", w->path[err_file]);
    }
    w->syncs += syncs - w->thr_syncs_seen;
    w->sync_us_total += us_total - w->thr_us_seen;
    w->thr_syncs_seen = syncs;
    w->thr_us_seen = us_total;
    if (us_max > w->sync_us_max)
        w->sync_us_max = us_max;
    if (done > w->durable) {
        if (w->issued - done < ZZ_WAL_RING) {
            w->synced_records = w->ring_records[done % ZZ_WAL_RING];
            w->ticket_us_total += now - w->ring_since_us[done % ZZ_WAL_RING];
            w->tickets_done++;
            durable_to(r, w->ring_seq[done % ZZ_WAL_RING]);
        }
        w->tell_us_total += now - done_us;
        w->tells++;
        for (uint64_t t = done; t > w->durable && done - t < ZZ_WAL_RING; t--)
            if (w->ring_need_ticket[t % ZZ_WAL_RING] == t) {
                w->need_us_total += now - w->ring_need_us[t % ZZ_WAL_RING];
                w->needs_done++;
                w->ring_need_ticket[t % ZZ_WAL_RING] = 0;
            }
        w->durable = done;
    }
    if (w->view_pending && w->view_ticket && w->durable >= w->view_ticket) {
        w->view_pending = 0;
        w->view_ticket = 0;
    }
    if (w->want && sync_room(w))
        sync_issue(r);
    zz_net_release(r->net, w->durable);
}

/* Start the sync threads (durability fsync, a loop to report to); without them every sync
 * blocks the caller. */

/* Tell every sync thread to stop and wait for each. */
static void join_threads(zz_wal *w)
{
    pthread_mutex_lock(&w->mu);
    w->t_stop = 1;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    for (int i = 0; i < w->n_thr; i++)
        pthread_join(w->thr[i], NULL);
    w->n_thr = 0;
}

static void start_thread(zz_replica *r)
{
    zz_wal *w = &r->wal;
    if (!w->fsync || !r->net || r->conf->sync_threads == 0)
        return; /* durability write has nothing to sync; sync_threads 0: the loop syncs */
    w->slice_us = r->conf->sync_slice_us;
    snprintf(w->gate, sizeof w->gate, "%s", r->conf->inject_sync_gate);
    w->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (w->efd < 0)
        goto blocking;
    int rc = pthread_mutex_init(&w->mu, NULL);
    if (rc != 0) {
        errno = rc;
        goto close_efd;
    }
    rc = pthread_cond_init(&w->cv, NULL);
    if (rc != 0) {
        errno = rc;
        goto destroy_mu;
    }
    /* Signals go to the loop's thread (its handlers only set flags and wake the loop). */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    uint32_t want = r->conf->sync_threads;
    for (uint32_t i = 0; i < want && i < ZZ_MAX_SYNC_THREADS && rc == 0; i++) {
        rc = pthread_create(&w->thr[i], NULL, sync_main, w);
        if (rc == 0)
            w->n_thr++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0 || zz_net_watch(r->net, w->efd, on_synced, r) != 0) {
        if (rc != 0)
            errno = rc;
        join_threads(w);
        goto destroy_cv;
    }
    w->thr_on = 1;
    /* A sync is only asked at the turn's end: ask it before the turn's replies and early
     * frames are written, so that it starts that much sooner. */
    zz_net_barrier_first(r->net, 1);
    return;
destroy_cv:
    pthread_cond_destroy(&w->cv);
destroy_mu:
    pthread_mutex_destroy(&w->mu);
close_efd:
    close(w->efd);
    w->efd = -1;
blocking:
    zz_log("zz-agreed: replica %u: durable state: no sync thread (%s): every sync blocks the "
           "loop\n", r->id, strerror(errno));
}

static void stop_thread(zz_wal *w)
{
    if (!w->thr_on)
        return;
    join_threads(w);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    close(w->efd);
    w->efd = -1;
    w->thr_on = 0;
}

uint64_t zz_wal_sync(void *replica, int durable)
{
    zz_replica *r = replica;
    zz_wal *w = &r->wal;
    if (!w->enabled || w->replaying)
        return 0;
    /* A rewrite pending holds every record a send needs, written or synced: it goes first
     * (and so does a sync without the thread). */
    if ((durable && w->must_sync) || (w->must_write && w->compact_due)) {
        if (w->compact_due || !w->thr_on) {
            sync_now(r);
            return 0;
        }
        write_pending(r);
        w->must_sync = 0;
        w->must_write = 0;
        w->need = sync_ask(r);
        if (w->ring_need_ticket[w->need % ZZ_WAL_RING] != w->need) {
            w->ring_need_ticket[w->need % ZZ_WAL_RING] = w->need;
            w->ring_need_us[w->need % ZZ_WAL_RING] = zz_mono_us();
        }
        return w->need;
    }
    /* Written (a process crash keeps them), synced with the next sync: records nothing sent
     * depends on, and PRE-PREPAREs and PREPAREs (their loss in a host crash is detected at
     * start by the boot id: zz_wal_forgets). */
    if (!w->compact_due)
        write_pending(r);
    w->must_write = 0;
    /* Frames of a later turn may repeat what a sync not yet done covers (a COMMIT sent again
     * on a STATUS): they wait for it too, as they did when every sync blocked the loop. */
    return durable && w->need > w->durable ? w->need : 0;
}

int zz_wal_early(const zz_replica *r)
{
    const zz_wal *w = &r->wal;
    return w->enabled && w->boot_known && !w->view_pending;
}

void zz_wal_flush(zz_replica *r)
{
    zz_wal *w = &r->wal;
    if (!w->enabled || w->replaying ||
        (!w->compact_due && w->pend.len == 0 && (!w->fsync || w->unsynced == 0)))
        return;
    if (w->thr_on && !w->compact_due) {
        /* No frame waits for this one; must_sync stays for the turn's barrier, which finds
         * its records covered by this ticket. */
        write_pending(r);
        w->must_write = 0;
        if (w->unsynced)
            sync_ask(r);
        return;
    }
    sync_now(r);
}

/* The blocking sync: a rewrite when one is due, else the pending records written and
 * synced (durability fsync). The loop waits for it. */
static void sync_now(zz_replica *r)
{
    zz_wal *w = &r->wal;
    uint64_t t0 = zz_mono_us();
    if (w->compact_due) {
        if (compact(r) != 0)
            fatal(r, "cannot rewrite", w->path[1 - w->cur]);
    } else {
        write_pending(r);
        if (w->fsync && fdatasync(w->fd[w->cur]) != 0)
            fatal(r, "cannot sync", w->path[w->cur]);
        if (w->fsync)
            w->synced_records += w->unsynced;
        w->unsynced = 0;
        w->issued++;
        if (w->fsync) {
            w->durable = w->issued;
            durable_to(r, w->seqno);
        }
    }
    w->must_sync = 0;
    w->must_write = 0;
    w->view_pending = 0;
    w->view_ticket = 0;
    uint64_t us = zz_mono_us() - t0;
    if (w->fsync) {
        w->syncs++;
        w->sync_us_total += us;
        if (us > w->sync_us_max)
            w->sync_us_max = us;
        w->loop_syncs++;
        w->loop_sync_us += us;
    }
}

static const char *tail_name(int tail)
{
    switch (tail) {
    case ZZ_WAL_CLEAN: return "clean";
    case ZZ_WAL_TORN: return "torn";
    case ZZ_WAL_CORRUPT: return "corrupt";
    default: return "foreign";
    }
}

/* The whole file in memory (the log is bounded by the window). NULL with *len 0 if absent. */
static uint8_t *read_file(int fd, size_t *len, int *err)
{
    *len = 0;
    *err = 0;
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        *err = errno;
        return NULL;
    }
    size_t cap = (size_t)sb.st_size;
    uint8_t *buf = malloc(cap ? cap : 1);
    if (!buf) {
        *err = ENOMEM;
        return NULL;
    }
    size_t got = 0;
    while (got < cap) {
        ssize_t n = pread(fd, buf + got, cap - got, (off_t)got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    *len = got;
    return buf;
}

/* This boot's id (the kernel's random boot_id: a new one at every boot, so a log written
 * under the same id lost nothing it had written, whatever happened to the process). 0 when
 * read and parsed; -1 otherwise (then every record a send depends on is synced). */
static int read_boot_id(uint8_t out[ZZ_WAL_BOOT_LEN])
{
    char text[64];
    int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, text, sizeof text - 1);
    close(fd);
    if (n <= 0)
        return -1;
    uint32_t nib = 0;
    for (ssize_t i = 0; i < n && text[i] != '\n'; i++) {
        char ch = text[i];
        int v = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10
              : ch >= 'A' && ch <= 'F' ? ch - 'A' + 10 : ch == '-' ? -2 : -1;
        if (v == -2)
            continue;
        if (v < 0 || nib >= 2 * ZZ_WAL_BOOT_LEN)
            return -1;
        if (nib % 2 == 0)
            out[nib / 2] = (uint8_t)(v << 4);
        else
            out[nib / 2] |= (uint8_t)v;
        nib++;
    }
    return nib == 2 * ZZ_WAL_BOOT_LEN ? 0 : -1;
}

/* A dry scan: whose log, which epoch, whether its rewrite completed (SNAPEND). */
typedef struct {
    const zz_replica *r;
    int complete, foreign;
    uint32_t n;
    uint64_t stable; /* the seq of its stable checkpoint record, 0 if none */
} probe;

static int probe_record(void *ctx, uint8_t type, const uint8_t *body, uint32_t len)
{
    probe *p = ctx;
    if (p->n++ == 0) {
        zz_wal_rd d = {body, len, 0, 0};
        if (type != ZZ_WAL_HEADER)
            return ZZ_WAL_CORRUPT;
        int rc = apply_header((zz_replica *)p->r, &d);
        p->foreign = rc == ZZ_WAL_FOREIGN;
        return rc;
    }
    if (type == ZZ_WAL_SNAPEND)
        p->complete = 1;
    if (type == ZZ_WAL_STABLE && len >= 8) {
        zz_wal_rd d = {body, len, 0, 0};
        p->stable = zz_wal_u64(&d);
    }
    return 0;
}

int zz_wal_recover(zz_replica *r, char *err, size_t errcap)
{
    zz_wal *w = &r->wal;
    const zz_conf *c = r->conf;
    w->fd[0] = w->fd[1] = -1;
    w->efd = -1;
    zz_buf_init(&w->pend);
    zz_buf_init(&w->snap);
    if (!c->data_dir[0] || c->durability == ZZ_DUR_OFF)
        return 0;
    w->enabled = 1;
    w->fsync = c->durability == ZZ_DUR_FSYNC;
    w->boot_known = read_boot_id(w->boot) == 0;
    snprintf(w->dir, sizeof w->dir, "%s", c->data_dir);
    snprintf(w->path[0], sizeof w->path[0], "%s/wal-a", c->data_dir);
    snprintf(w->path[1], sizeof w->path[1], "%s/wal-b", c->data_dir);
    snprintf(w->damaged, sizeof w->damaged, "%s/wal.damaged", c->data_dir);
    if (mkdir(w->dir, 0700) != 0 && errno != EEXIST) {
        snprintf(err, errcap, "data_dir %s: cannot create: %s", w->dir, strerror(errno));
        return -1;
    }
    uint64_t t0 = zz_mono_us();
    uint8_t *buf[2] = {NULL, NULL};
    size_t len[2] = {0, 0};
    uint32_t epoch[2] = {0, 0};
    int complete[2] = {0, 0}, pick = -1;
    uint64_t file_stable[2] = {0, 0};
    for (int i = 0; i < 2; i++) {
        int rerr = 0;
        if (access(w->path[i], F_OK) == 0 && open_file(w, i) == 0)
            buf[i] = read_file(w->fd[i], &len[i], &rerr);
        else if (access(w->path[i], F_OK) == 0)
            rerr = errno;
        if (rerr) {
            snprintf(err, errcap, "data_dir %s: cannot read %s: %s", w->dir, w->path[i],
                     strerror(rerr));
            free(buf[0]);
            free(buf[1]);
            return -1;
        }
        probe p = {r, 0, 0, 0, 0};
        int tail;
        zz_wal_scan(buf[i], len[i], probe_record, &p, &tail, &epoch[i]);
        if (p.foreign) {
            snprintf(err, errcap, "data_dir %s: %s is another replica's or another version's "
                     "log (this is service %u replica %u of %u, log version %u); give each "
                     "replica its own data_dir", w->dir, w->path[i], c->service, r->id, r->n,
                     ZZ_WAL_VERSION);
            free(buf[0]);
            free(buf[1]);
            return -1;
        }
        complete[i] = p.complete;
        file_stable[i] = p.stable;
        if (complete[i] && (pick < 0 || epoch[i] > epoch[pick]))
            pick = i;
    }
    int tail = ZZ_WAL_CLEAN;
    size_t valid = 0;
    int other = pick < 0 ? 0 : 1 - pick;
    if (pick >= 0 && len[other] && epoch[other] > epoch[pick]) {
        /* The newer file's rewrite is damaged before its end: the records written after it
         * are lost, and the older log is what there is. */
        zz_log("zz-agreed: replica %u: durable state: %s (epoch %u) is damaged inside its "
               "rewrite; recovering from %s (epoch %u): records written after that rewrite "
               "are lost, this replica recovers the rest from its peers\n", r->id,
               w->path[other], epoch[other], w->path[pick], epoch[pick]);
        tail = ZZ_WAL_CORRUPT;
    }
    if (pick >= 0) {
        w->replaying = 1;
        uint32_t ep;
        int t;
        valid = zz_wal_scan(buf[pick], len[pick], apply, r, &t, &ep);
        if (t != ZZ_WAL_CLEAN)
            tail = t;
        /* Committed batches above the stable checkpoint run again; the next seq a primary
         * may propose follows what it proposed before. */
        uint64_t top = r->last_exec;
        for (uint64_t seq = r->stable + 1; seq <= r->stable + r->L; seq++) {
            const zz_slot *s = &r->slots[seq % r->L];
            if (s->seq == seq && s->has_pp && s->view == r->view && seq > top)
                top = seq;
        }
        if (r->next_seq < top)
            r->next_seq = top;
        if (r->in_vc) /* a full view timeout for the view change it was in */
            r->vc_deadline_ms = zz_now_ms(r) + r->conf->view_timeout_ms;
        zz_try_execute(r);
        w->replaying = 0;
        w->cur = pick;
        w->epoch = epoch[pick] > epoch[other] ? epoch[pick] : epoch[other];
        if (t != ZZ_WAL_CLEAN) {
            /* Never trusted, never replayed: the record at `valid` and all after it. */
            zz_log("zz-agreed: replica %u: durable state: %s tail in %s at offset %zu: the "
                   "rest is discarded (the file is copied to %s)%s\n", r->id, tail_name(t),
                   w->path[pick], valid, w->damaged,
                   t == ZZ_WAL_CORRUPT
                       ? "; records after it were synced, so this replica may have acted on "
                         "what it lost: it recovers the rest from its peers"
                       : "");
            int fd = open(w->damaged, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
            if (fd >= 0) {
                if (write_at(fd, buf[pick], len[pick], 0) != 0)
                    zz_log("zz-agreed: replica %u: cannot keep %s: %s\n", r->id, w->damaged,
                           strerror(errno));
                close(fd);
            }
        }
    } else if (len[0] || len[1]) {
        for (int i = 0; i < 2; i++)
            if (epoch[i]) {
                zz_log("zz-agreed: replica %u: durable state: no complete log in %s: starting "
                       "empty, this replica recovers its state from its peers\n", r->id, w->dir);
                tail = ZZ_WAL_CORRUPT;
                w->epoch = epoch[0] > epoch[1] ? epoch[0] : epoch[1];
                break;
            }
    }
    /* Written under another boot: the host restarted (or the boot is unknown now) and the
     * records written after the last sync may be lost, PRE-PREPAREs and PREPAREs among them.
     * Those were about seqs of the stable checkpoint's window (a stable checkpoint that moves
     * is rewritten and synced before the next one is sent) in the view the log recovers: no
     * PRE-PREPARE or PREPARE for those seqs in that view. */
    static const uint8_t unknown[ZZ_WAL_BOOT_LEN];
    int other_boot = pick >= 0 && w->log_v2 &&
                     memcmp(w->log_boot, unknown, ZZ_WAL_BOOT_LEN) != 0 &&
                     (!w->boot_known || memcmp(w->log_boot, w->boot, ZZ_WAL_BOOT_LEN) != 0);
    if (other_boot) {
        w->boot_changed = 1;
        uint64_t until = r->stable + r->L;
        if (!w->lost_until || r->view > w->lost_view ||
            (r->view == w->lost_view && until > w->lost_until)) {
            w->lost_view = r->view;
            w->lost_until = until;
        }
        zz_log("zz-agreed: replica %u: durable state: %s was written before the host restarted "
               "(another boot id): it may lack PRE-PREPAREs and PREPAREs this replica sent, so "
               "it sends none for seqs up to %llu in view %u; a later view or a stable "
               "checkpoint past them ends that\n", r->id, w->path[pick],
               (unsigned long long)w->lost_until, w->lost_view);
    }
    if (tail == ZZ_WAL_CORRUPT && pick >= 0) {
        /* Records the replica had synced, and may have acted on, are lost. They were about
         * seqs of the window of their file's stable checkpoint (a stable checkpoint that
         * moves starts a new file): no vote or proposal for those seqs goes out until the
         * stable checkpoint passes them, so none can contradict a lost one. */
        uint64_t s = r->stable > file_stable[other] ? r->stable : file_stable[other];
        if (s + r->L > w->abstain_until)
            w->abstain_until = s + r->L;
        zz_log("zz-agreed: replica %u: durable state: no PRE-PREPARE, PREPARE or COMMIT for "
               "seqs up to %llu until the stable checkpoint passes them\n", r->id,
               (unsigned long long)w->abstain_until);
    }
    w->recovered_bytes = valid;
    w->recovered_tail = tail;
    w->recovered_stable = r->stable;
    w->recovered_last_exec = r->last_exec;
    w->discard_offset = tail == ZZ_WAL_CLEAN ? 0 : valid;
    free(buf[0]);
    free(buf[1]);
    /* A clean log of this boot is appended to where it ends. Otherwise (none yet, damage,
     * another boot or a version-1 header) the recovered state goes to the other file with the
     * next epoch: the damaged file is never read again, and every record of a file is
     * written under the boot its header names. */
    int same_boot = w->log_v2 && (w->boot_known
                                      ? memcmp(w->log_boot, w->boot, ZZ_WAL_BOOT_LEN) == 0
                                      : memcmp(w->log_boot, unknown, ZZ_WAL_BOOT_LEN) == 0);
    if (pick >= 0 && tail == ZZ_WAL_CLEAN && same_boot) {
        w->off = valid;
        /* Records the last process wrote may not be synced yet (same boot): a restored P
         * entry counts as this replica's own COMMIT at once (normal.c), so sync them now. */
        if (w->fsync && fdatasync(w->fd[pick]) != 0) {
            snprintf(err, errcap, "data_dir %s: cannot sync %s: %s", w->dir, w->path[pick],
                     strerror(errno));
            return -1;
        }
    } else if (compact(r) != 0) {
        snprintf(err, errcap, "data_dir %s: cannot write %s: %s", w->dir,
                 w->path[1 - w->cur], strerror(errno));
        return -1;
    }
    w->recover_ms = (zz_mono_us() - t0) / 1000u;
    if (pick >= 0)
        zz_log("zz-agreed: replica %u: durable state: recovered %llu records (%zu bytes) from "
               "%s in %llu ms: view %u%s, stable %llu, executed through %llu\n", r->id,
               (unsigned long long)w->recovered_records, valid, w->path[pick],
               (unsigned long long)w->recover_ms, r->view, r->in_vc ? " (view change)" : "",
               (unsigned long long)r->stable, (unsigned long long)r->last_exec);
    start_thread(r);
    return 0;
}

void zz_wal_free(zz_replica *r)
{
    zz_wal *w = &r->wal;
    stop_thread(w); /* before its descriptors close */
    for (int i = 0; i < 2; i++) {
        if (w->fd[i] >= 0)
            close(w->fd[i]);
        w->fd[i] = -1;
    }
    zz_buf_free(&w->pend);
    zz_buf_free(&w->snap);
}

int zz_wal_forgets(const zz_replica *r, uint32_t view, uint64_t seq)
{
    const zz_wal *w = &r->wal;
    return w->lost_until && view <= w->lost_view && seq <= w->lost_until &&
           r->stable < w->lost_until;
}

int zz_wal_abstains(const zz_replica *r, uint64_t seq)
{
    uint64_t until = r->wal.abstain_until;
    return until && seq <= until && r->stable < until;
}

/* The threads' summed time from a ticket asked to one taking it (stats). */
static uint64_t start_us_total(zz_wal *w)
{
    if (!w->thr_on)
        return 0;
    pthread_mutex_lock(&w->mu);
    uint64_t v = w->t_start_us_total;
    pthread_mutex_unlock(&w->mu);
    return v;
}

void zz_wal_stats(zz_replica *r, void *file)
{
    const zz_wal *w = &r->wal;
    fprintf(file, "\"wal\": {\"enabled\": %d, \"fsync\": %d, \"records\": %llu, \"bytes\": %llu, "
                  "\"writes\": %llu, \"syncs\": %llu, \"sync_us_avg\": %llu, \"sync_us_max\": %llu, "
                  "\"compactions\": %llu, \"epoch\": %u, \"log_bytes\": %llu, \"grown\": %llu, "
                  "\"recovered_records\": %llu, \"recovered_bytes\": %llu, "
                  "\"recovered_tail\": \"%s\", \"discard_offset\": %llu, "
                  "\"recovered_stable\": %llu, \"recovered_last_exec\": %llu, "
                  "\"recover_ms\": %llu, \"abstain_until\": %llu, \"abstaining\": %d, "
                  "\"synced_records\": %llu, \"boot_known\": %d, \"boot_changed\": %d, "
                  "\"lost_view\": %u, \"lost_until\": %llu, \"withholding\": %d, "
                  "\"withheld\": %llu, \"sync_thread\": %d, \"loop_syncs\": %llu, "
                  "\"loop_sync_us\": %llu, \"ticket_us_avg\": %llu, \"waited\": %llu, "
                  "\"hold_us_avg\": %llu, \"start_us_avg\": %llu, \"tell_us_avg\": %llu, "
                  "\"write_us_avg\": %llu, \"write_us_max\": %llu, \"commit_unsynced\": %llu}, ",
            w->enabled, w->fsync, (unsigned long long)w->records, (unsigned long long)w->bytes,
            (unsigned long long)w->writes, (unsigned long long)w->syncs,
            (unsigned long long)(w->syncs ? w->sync_us_total / w->syncs : 0),
            (unsigned long long)w->sync_us_max, (unsigned long long)w->compactions, w->epoch,
            (unsigned long long)w->off, (unsigned long long)w->grown,
            (unsigned long long)w->recovered_records, (unsigned long long)w->recovered_bytes,
            tail_name(w->recovered_tail), (unsigned long long)w->discard_offset,
            (unsigned long long)w->recovered_stable,
            (unsigned long long)w->recovered_last_exec, (unsigned long long)w->recover_ms,
            (unsigned long long)w->abstain_until, w->abstain_until && r->stable < w->abstain_until,
            (unsigned long long)w->synced_records, w->boot_known, w->boot_changed, w->lost_view,
            (unsigned long long)w->lost_until, forgetting(r), (unsigned long long)w->withheld,
            w->thr_on, (unsigned long long)w->loop_syncs, (unsigned long long)w->loop_sync_us,
            (unsigned long long)(w->tickets_done ? w->ticket_us_total / w->tickets_done : 0),
            (unsigned long long)(r->net ? zz_net_get_stats(r->net)->waited : 0),
            (unsigned long long)(w->needs_done ? w->need_us_total / w->needs_done : 0),
            (unsigned long long)(w->thr_syncs_seen
                                     ? start_us_total(&r->wal) / w->thr_syncs_seen : 0),
            (unsigned long long)(w->tells ? w->tell_us_total / w->tells : 0),
            (unsigned long long)(w->writes ? w->write_us_total / w->writes : 0),
            (unsigned long long)w->write_us_max, (unsigned long long)w->exec_unsynced);
}
