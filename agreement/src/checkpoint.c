/* checkpoint.c - checkpoints every CP sequence numbers, stability with 2g+1 signed
 * CHECKPOINTs, garbage collection of the log below the stable one, and state transfer
 * for a replica that fell behind (or diverged): fetch the certified state from a signer. */
#include <stdlib.h>
#include <string.h>

#include "byz.h"
#include "replica.h"

void zz_encode_state(zz_replica *r, zz_buf *b)
{
    zz_buf_reset(b);
    zz_put_u64(b, r->last_exec);
    zz_put_raw(b, r->app, ZZ_DIGEST_LEN);
    size_t count_at = b->len;
    zz_put_u32(b, 0);
    uint32_t count = 0;
    for (uint32_t i = 0; i < r->conf->nkeys; i++) { /* keys are sorted by principal id */
        const zz_client *c = &r->clients[i];
        if (c->last_t == 0)
            continue;
        zz_put_u32(b, r->conf->keys[i].id);
        zz_put_u64(b, c->last_t);
        zz_put_bytes(b, c->result, c->result_len);
        count++;
    }
    if (!b->oom)
        for (int i = 0; i < 4; i++)
            b->p[count_at + (size_t)i] = (uint8_t)(count >> (24 - 8 * i));
}

static void ckpt_clear(zz_replica *r, zz_ckpt *k)
{
    for (uint32_t i = 0; i < r->n; i++) {
        free(k->raw[i]);
        k->raw[i] = NULL;
        k->raw_len[i] = 0;
    }
    memset(k->dig, 0, (size_t)r->n * ZZ_DIGEST_LEN);
    free(k->state);
    k->state = NULL;
    k->state_len = 0;
    k->have_own = 0;
    k->seq = 0;
}

static void held_clear(zz_replica *r, uint32_t j)
{
    free(r->held_raw[j]);
    r->held_raw[j] = NULL;
    r->held_len[j] = 0;
    r->held_seq[j] = 0;
}

void zz_free_ckpts(zz_replica *r)
{
    for (uint32_t i = 0; r->ckpts && i < r->n_ckpts; i++)
        if (r->ckpts[i].raw)
            ckpt_clear(r, &r->ckpts[i]);
    for (uint32_t j = 0; r->held_raw && j < r->n; j++)
        held_clear(r, j);
}

/* The record for seq, made if needed; NULL unless seq is a checkpoint seq of
 * [stable, stable + L]. Those seqs have distinct ring positions, so a record held for
 * another seq is below the stable point: no vote, however far ahead, pushes out another. */
static zz_ckpt *ckpt_get(zz_replica *r, uint64_t seq)
{
    uint32_t cp = r->conf->checkpoint_interval;
    if (seq < r->stable || seq > r->stable + r->L || seq % cp != 0)
        return NULL;
    zz_ckpt *k = &r->ckpts[(seq / cp) % r->n_ckpts];
    if (k->seq == seq)
        return k;
    if (k->seq >= r->stable && k->seq <= r->stable + r->L && k->seq != 0)
        return NULL; /* not reached: another seq of the window at the same position */
    ckpt_clear(r, k);
    k->seq = seq;
    return k;
}

static void check_stable(zz_replica *r, zz_ckpt *k);

/* Store sender j's vote (signed raw message, owned by the caller) in k. */
static void ckpt_vote(zz_ckpt *k, uint32_t j, uint8_t *raw, uint32_t len,
                      const uint8_t dig[ZZ_DIGEST_LEN])
{
    free(k->raw[j]);
    k->raw[j] = raw;
    k->raw_len[j] = len;
    memcpy(k->dig[j], dig, ZZ_DIGEST_LEN);
}

/* Held votes that the window now covers become ordinary votes; those below it go. */
static void promote_held(zz_replica *r)
{
    for (uint32_t j = 0; j < r->n; j++) {
        if (!r->held_raw[j] || r->held_seq[j] > r->stable + r->L)
            continue;
        zz_ckpt *k = r->held_seq[j] > r->stable ? ckpt_get(r, r->held_seq[j]) : NULL;
        if (k && !k->raw[j]) {
            ckpt_vote(k, j, r->held_raw[j], r->held_len[j], r->held_dig[j]);
            r->held_raw[j] = NULL;
        }
        held_clear(r, j);
    }
}

/* A CHECKPOINT above the window: counted, and kept as its sender's one held vote. If 2g+1
 * held votes certify one seq, this replica is more than L behind and fetches that state. */
static void hold_vote(zz_replica *r, const zz_msg *m)
{
    const zz_checkpoint *c = &m->u.checkpoint;
    uint32_t j = m->sender;
    zz_count_window(r, 1, j);
    uint8_t *copy = zz_memdup(m->raw, m->raw_len);
    if (!copy)
        return;
    held_clear(r, j);
    r->held_raw[j] = copy;
    r->held_len[j] = m->raw_len;
    r->held_seq[j] = c->seq;
    memcpy(r->held_dig[j], c->state, ZZ_DIGEST_LEN);
    uint32_t same = 0;
    for (uint32_t i = 0; i < r->n; i++)
        same += r->held_raw[i] && r->held_seq[i] == c->seq &&
                memcmp(r->held_dig[i], c->state, ZZ_DIGEST_LEN) == 0;
    if (same >= 2 * r->g + 1)
        zz_start_transfer(r, c->seq, c->state);
}

/* The digest backed by 2g+1 votes in k, or NULL; fills which[] with the voters. */
static const uint8_t *certified(const zz_replica *r, const zz_ckpt *k, uint8_t *which)
{
    for (uint32_t i = 0; i < r->n; i++) {
        if (!k->raw[i])
            continue;
        uint32_t c = 0;
        for (uint32_t j = 0; j < r->n; j++) {
            which[j] = k->raw[j] && memcmp(k->dig[j], k->dig[i], ZZ_DIGEST_LEN) == 0;
            c += which[j];
        }
        if (c >= 2 * r->g + 1)
            return k->dig[i];
    }
    return NULL;
}

static void release_slots(zz_replica *r)
{
    for (uint32_t i = 0; i < r->L; i++) {
        zz_slot *s = &r->slots[i];
        if (s->seq && s->seq <= r->stable) {
            free(s->batch);
            free(s->pp_raw);
            s->batch = s->pp_raw = NULL;
            s->batch_len = s->pp_raw_len = 0;
            s->seq = 0;
        }
    }
}

static void make_stable(zz_replica *r, zz_ckpt *k, const uint8_t *dig, const uint8_t *which)
{
    for (uint32_t i = 0; i < r->n; i++) {
        free(r->stable_proof[i]);
        r->stable_proof[i] = NULL;
        r->stable_proof_len[i] = 0;
    }
    uint32_t np = 0;
    for (uint32_t i = 0; i < r->n && np < 2 * r->g + 1; i++) {
        if (!which[i])
            continue;
        r->stable_proof[np] = zz_memdup(k->raw[i], k->raw_len[i]);
        r->stable_proof_len[np] = r->stable_proof[np] ? k->raw_len[i] : 0;
        np++;
    }
    r->stable_proof_n = np;
    r->stable = k->seq;
    memcpy(r->stable_dig, dig, ZZ_DIGEST_LEN);
    r->st.stable_advances++;
    if (r->ahead_seq <= r->stable)
        r->ahead_seq = 0;
    for (uint32_t i = 0; i < r->n_ckpts; i++)
        if (r->ckpts[i].seq && r->ckpts[i].seq < r->stable)
            ckpt_clear(r, &r->ckpts[i]);
    release_slots(r);
    promote_held(r);
    zz_wal_stable(r); /* the log is rewritten from here (wal.c) */
}

static void send_fetch_state(zz_replica *r)
{
    zz_buf *b = &r->out;
    zz_buf_reset(b);
    size_t st = zz_enc_fetch(b, r->conf->service, r->id, ZZ_FETCH_STATE, r->transfer_seq,
                             r->transfer_dig);
    zz_end_body(b, st);
    zz_bcast_mac(r, b, st);
    r->transfer_sent_ms = zz_now_ms(r);
    r->st.fetches_sent++;
}

void zz_start_transfer(zz_replica *r, uint64_t seq, const uint8_t dig[ZZ_DIGEST_LEN])
{
    if (r->transfer_seq >= seq)
        return;
    r->transfer_seq = seq;
    memcpy(r->transfer_dig, dig, ZZ_DIGEST_LEN);
    send_fetch_state(r);
}

static void check_stable(zz_replica *r, zz_ckpt *k)
{
    uint8_t which[ZZ_MAX_REPLICAS];
    const uint8_t *dig = certified(r, k, which);
    if (!dig || k->seq <= r->stable)
        return;
    if (k->have_own && memcmp(k->own_dig, dig, ZZ_DIGEST_LEN) == 0) {
        make_stable(r, k, dig, which);
        /* Votes promoted from the held ones may certify a later checkpoint already. */
        for (uint32_t i = 0; i < r->n_ckpts; i++)
            if (r->ckpts[i].seq > r->stable)
                check_stable(r, &r->ckpts[i]);
        zz_try_propose(r);
        zz_try_execute(r);
    } else if (k->have_own) {
        zz_start_transfer(r, k->seq, dig); /* our state diverged from the certified one */
    } else if (k->seq > r->last_exec && (!r->ahead_seq || k->seq > r->ahead_seq)) {
        /* Behind: give normal execution a moment to get there before fetching state. */
        r->ahead_seq = k->seq;
        r->ahead_since_ms = zz_now_ms(r);
    }
}

void zz_take_checkpoint(zz_replica *r)
{
    zz_ckpt *k = ckpt_get(r, r->last_exec);
    if (!k)
        return;
    zz_buf *sb = &r->out2;
    zz_encode_state(r, sb);
    if (sb->oom)
        return;
    free(k->state);
    k->state = zz_memdup(sb->p, sb->len);
    k->state_len = k->state ? (uint32_t)sb->len : 0;
    zz_sha256(sb->p, sb->len, k->own_dig);
    k->have_own = k->state != NULL;
    zz_buf *b = &r->out;
    zz_buf_reset(b);
    size_t st = zz_enc_checkpoint(b, r->conf->service, r->id, r->last_exec, k->own_dig);
    zz_end_body(b, st);
    zz_bcast_signed(r, b, st);
    if (!b->oom && b->len > st) {
        free(k->raw[r->id]);
        k->raw[r->id] = zz_memdup(b->p + st, b->len - st);
        k->raw_len[r->id] = k->raw[r->id] ? (uint32_t)(b->len - st) : 0;
        memcpy(k->dig[r->id], k->own_dig, ZZ_DIGEST_LEN);
    }
    r->st.checkpoints++;
    check_stable(r, k);
}

void zz_on_checkpoint(zz_replica *r, const zz_msg *m)
{
    const zz_checkpoint *c = &m->u.checkpoint;
    if (m->sender >= r->n)
        return;
    if (c->seq <= r->stable) {
        r->st.stale++;
        return;
    }
    if (c->seq % r->conf->checkpoint_interval != 0) {
        r->st.dropped[ZZ_DROP_FIELD]++;
        return;
    }
    if (c->seq > r->stable + r->L) {
        hold_vote(r, m);
        return;
    }
    zz_ckpt *k = ckpt_get(r, c->seq);
    if (!k)
        return;
    if (k->raw[m->sender] && memcmp(k->dig[m->sender], c->state, ZZ_DIGEST_LEN) == 0) {
        check_stable(r, k); /* duplicate (a relayed proof): it may complete promoted votes */
        return;
    }
    uint8_t *copy = zz_memdup(m->raw, m->raw_len);
    if (!copy)
        return;
    ckpt_vote(k, m->sender, copy, m->raw_len, c->state);
    check_stable(r, k);
}

int zz_verify_ckpt_proof(zz_replica *r, const zz_blist *proof, uint64_t seq,
                         uint8_t digest_out[ZZ_DIGEST_LEN])
{
    uint8_t seen[ZZ_MAX_REPLICAS] = {0};
    uint32_t good = 0;
    zz_blist_iter it;
    zz_bytes item;
    zz_blist_begin(proof, &it);
    while (zz_blist_next(&it, &item)) {
        zz_msg m;
        if (zz_decode(item.p, item.len, &m) != ZZ_OK || m.type != ZZ_CHECKPOINT ||
            m.service != r->conf->service || m.sender >= r->n || seen[m.sender] ||
            m.u.checkpoint.seq != seq)
            return 0;
        const zz_pubkey *pk = zz_pub_for(r, m.sender);
        if (!pk || !zz_verify_sig(&m, pk))
            return 0;
        if (good == 0)
            memcpy(digest_out, m.u.checkpoint.state, ZZ_DIGEST_LEN);
        else if (memcmp(digest_out, m.u.checkpoint.state, ZZ_DIGEST_LEN) != 0)
            return 0;
        seen[m.sender] = 1;
        good++;
    }
    return good >= 2 * r->g + 1;
}

/* The committed log above max(from, stable) as u64 certified_through, list<log_entry>
 * (docs/wire.md), capped so one reply stays far below ZZ_MAX_MSG; the requester asks again
 * from where it ends. In-process execution: nothing is vouched (certified_through 0). With
 * external execution the execution log is served by xlog.c instead (zz_xlog_on_fetch). */
static void encode_log(zz_replica *r, uint64_t from, zz_buf *b)
{
    static const uint8_t null_digest[ZZ_DIGEST_LEN];
    static const size_t cap = 4u << 20;
    zz_buf_reset(b);
    zz_put_u64(b, 0);
    zz_put_u32(b, 0);
    uint32_t count = 0;
    for (uint64_t seq = (from > r->stable ? from : r->stable) + 1; seq <= r->last_exec; seq++) {
        zz_slot *s = &r->slots[seq % r->L];
        if (s->seq != seq || !s->committed || (!s->is_null && !s->batch) || b->len > cap)
            break;
        zz_put_u64(b, seq);
        zz_put_raw(b, s->is_null ? null_digest : s->digest, ZZ_DIGEST_LEN);
        zz_put_bytes(b, s->batch, s->is_null ? 0 : s->batch_len);
        count++;
    }
    if (!b->oom)
        for (int i = 0; i < 4; i++)
            b->p[8 + i] = (uint8_t)(count >> (24 - 8 * i));
}

void zz_on_fetch(zz_replica *r, zz_conn *conn, const zz_msg *m)
{
    const zz_fetch *f = &m->u.fetch;
    zz_buf *b = &r->out;
    zz_buf_reset(b);
    size_t st;
    if (f->kind == ZZ_FETCH_LOG && zz_xlog_on_fetch(r, conn, m))
        return; /* external execution: the execution log (xlog.c) */
    if (f->kind == ZZ_FETCH_LOG) {
        encode_log(r, f->seq, &r->out2);
        if (r->out2.oom)
            return;
        /* The log starts after the stable checkpoint the replier names. */
        st = zz_enc_fetch_reply(b, r->conf->service, r->id, f->kind, r->stable, r->stable_dig,
                                r->out2.p, (uint32_t)r->out2.len);
        zz_end_body(b, st);
        uint32_t to = m->sender;
        zz_mackey *k = (zz_mackey *)zz_mac_for(r, to);
        zz_auth_mac(b, st, &to, &k, 1);
        if (!b->oom && conn && !zz_byz_silent(r))
            zz_net_send_conn(r->net, conn, b->p + st, b->len - st);
        r->st.fetches_served++;
        return;
    }
    if (m->sender >= r->n) {
        r->st.dropped[ZZ_DROP_SENDER]++;
        return;
    }
    if (f->kind == ZZ_FETCH_BATCH) {
        if (!zz_in_window(r, f->seq))
            return;
        zz_slot *s = &r->slots[f->seq % r->L];
        if (s->seq != f->seq || !s->batch || memcmp(s->digest, f->digest, ZZ_DIGEST_LEN) != 0)
            return;
        st = zz_enc_fetch_reply(b, r->conf->service, r->id, f->kind, f->seq, f->digest,
                                s->batch, s->batch_len);
    } else if (f->kind == ZZ_FETCH_STATE) {
        const zz_ckpt *k = NULL;
        for (uint32_t i = 0; i < r->n_ckpts && !k; i++)
            if (r->ckpts[i].seq == f->seq && r->ckpts[i].have_own && r->ckpts[i].state &&
                memcmp(r->ckpts[i].own_dig, f->digest, ZZ_DIGEST_LEN) == 0)
                k = &r->ckpts[i];
        if (!k)
            return;
        st = zz_enc_fetch_reply(b, r->conf->service, r->id, f->kind, f->seq, f->digest,
                                k->state, k->state_len);
    } else {
        r->st.dropped[ZZ_DROP_FIELD]++;
        return;
    }
    zz_end_body(b, st);
    zz_send_mac(r, m->sender, b, st);
    r->st.fetches_served++;
}

/* Install a fetched, digest-checked state encoding as our state at `seq`. */
static int install_state(zz_replica *r, const uint8_t *p, uint32_t len)
{
    if (len < 8 + ZZ_DIGEST_LEN + 4)
        return -1;
    uint32_t off = 8;
    uint8_t app[ZZ_DIGEST_LEN];
    memcpy(app, p + off, ZZ_DIGEST_LEN);
    off += ZZ_DIGEST_LEN;
    uint32_t count = (uint32_t)p[off] << 24 | (uint32_t)p[off + 1] << 16 |
                     (uint32_t)p[off + 2] << 8 | p[off + 3];
    off += 4;
    /* First pass validates the whole encoding, second applies it: nothing half-done. */
    for (int pass = 0; pass < 2; pass++) {
        uint32_t o = off;
        if (pass == 1)
            for (uint32_t i = 0; i < r->conf->nkeys; i++) {
                zz_client *c = &r->clients[i];
                free(c->result);
                c->result = NULL;
                c->result_len = 0;
                c->last_t = 0;
            }
        for (uint32_t e = 0; e < count; e++) {
            if (len - o < 4 + 8 + 4)
                return -1;
            uint32_t client = (uint32_t)p[o] << 24 | (uint32_t)p[o + 1] << 16 |
                              (uint32_t)p[o + 2] << 8 | p[o + 3];
            uint64_t t = 0;
            for (int i = 0; i < 8; i++)
                t = t << 8 | p[o + 4 + (uint32_t)i];
            uint32_t rl = (uint32_t)p[o + 12] << 24 | (uint32_t)p[o + 13] << 16 |
                          (uint32_t)p[o + 14] << 8 | p[o + 15];
            o += 16;
            if (rl > len - o)
                return -1;
            int ci = zz_client_index(r, client);
            if (ci < 0)
                return -1;
            if (pass == 1) {
                zz_client *c = &r->clients[ci];
                c->last_t = t;
                c->result = zz_memdup(p + o, rl);
                c->result_len = c->result ? rl : 0;
                if (c->pend_t <= t) {
                    free(c->pend_raw);
                    c->pend_raw = NULL;
                }
            }
            o += rl;
        }
        if (o != len)
            return -1;
    }
    memcpy(r->app, app, ZZ_DIGEST_LEN);
    return 0;
}

int zz_restore_stable(zz_replica *r, uint64_t seq, const uint8_t dig[ZZ_DIGEST_LEN],
                      const zz_blist *proof, const uint8_t *state, uint32_t state_len)
{
    uint8_t d[ZZ_DIGEST_LEN], pd[ZZ_DIGEST_LEN];
    if (seq == 0 || seq % r->conf->checkpoint_interval != 0 || state_len < 8)
        return -1;
    uint64_t at = 0;
    for (int i = 0; i < 8; i++)
        at = at << 8 | state[i];
    zz_sha256(state, state_len, d);
    if (at != seq || memcmp(d, dig, ZZ_DIGEST_LEN) != 0 ||
        !zz_verify_ckpt_proof(r, proof, seq, pd) || memcmp(pd, dig, ZZ_DIGEST_LEN) != 0)
        return -1;
    uint8_t *copy = zz_memdup(state, state_len);
    if (!copy || install_state(r, state, state_len) != 0) {
        free(copy);
        return -1;
    }
    r->last_exec = seq;
    if (r->next_seq < seq)
        r->next_seq = seq;
    r->stable = seq;
    memcpy(r->stable_dig, dig, ZZ_DIGEST_LEN);
    r->ahead_seq = 0;
    r->transfer_seq = 0;
    for (uint32_t i = 0; i < r->n; i++) {
        free(r->stable_proof[i]);
        r->stable_proof[i] = NULL;
        r->stable_proof_len[i] = 0;
    }
    for (uint32_t i = 0; i < r->n_ckpts; i++)
        ckpt_clear(r, &r->ckpts[i]);
    zz_ckpt *k = ckpt_get(r, seq);
    uint32_t np = 0;
    zz_blist_iter it;
    zz_bytes item;
    zz_blist_begin(proof, &it);
    while (zz_blist_next(&it, &item) && np < r->n) {
        zz_msg m;
        if (zz_decode(item.p, item.len, &m) != ZZ_OK) /* verified above: cannot fail */
            continue;
        r->stable_proof[np] = zz_memdup(item.p, item.len);
        r->stable_proof_len[np] = r->stable_proof[np] ? item.len : 0;
        np++;
        uint8_t *vote = zz_memdup(item.p, item.len);
        if (k && vote)
            ckpt_vote(k, m.sender, vote, item.len, m.u.checkpoint.state);
        else
            free(vote);
    }
    r->stable_proof_n = np;
    if (k) {
        k->state = copy;
        k->state_len = state_len;
        memcpy(k->own_dig, d, ZZ_DIGEST_LEN);
        k->have_own = 1;
    } else {
        free(copy);
    }
    release_slots(r);
    return 0;
}

void zz_on_fetch_reply(zz_replica *r, const zz_msg *m)
{
    const zz_fetch_reply *f = &m->u.fetch_reply;
    if (f->kind == ZZ_FETCH_BATCH) {
        if (!zz_in_window(r, f->seq))
            return;
        zz_slot *s = &r->slots[f->seq % r->L];
        if (s->seq != f->seq || !s->has_pp || s->batch ||
            memcmp(s->digest, f->digest, ZZ_DIGEST_LEN) != 0)
            return;
        if (zz_slot_set_batch(r, s, f->data.p, f->data.len) == 0) {
            zz_wal_slot(r, s, 1, ZZ_WAL_NODEP);
            zz_try_execute(r);
        }
        return;
    }
    if (f->kind != ZZ_FETCH_STATE || !r->transfer_seq || f->seq != r->transfer_seq ||
        memcmp(f->digest, r->transfer_dig, ZZ_DIGEST_LEN) != 0)
        return;
    uint8_t d[ZZ_DIGEST_LEN];
    zz_sha256(f->data.p, f->data.len, d);
    if (memcmp(d, r->transfer_dig, ZZ_DIGEST_LEN) != 0 ||
        install_state(r, f->data.p, f->data.len) != 0) {
        r->st.dropped[ZZ_DROP_FIELD]++; /* a faulty peer's state: wait for another */
        return;
    }
    uint64_t seq = f->seq;
    r->last_exec = seq;
    if (r->next_seq < seq)
        r->next_seq = seq;
    r->transfer_seq = 0;
    r->st.state_transfers++;
    r->last_progress_ms = zz_now_ms(r);
    zz_ckpt *k = ckpt_get(r, seq);
    if (!k && seq > r->stable + r->L && seq % r->conf->checkpoint_interval == 0) {
        /* Fetched past the window (certified by held votes): every record is below seq. */
        for (uint32_t i = 0; i < r->n_ckpts; i++)
            ckpt_clear(r, &r->ckpts[i]);
        k = &r->ckpts[(seq / r->conf->checkpoint_interval) % r->n_ckpts];
        k->seq = seq;
        for (uint32_t j = 0; j < r->n; j++)
            if (r->held_raw[j] && r->held_seq[j] == seq) {
                ckpt_vote(k, j, r->held_raw[j], r->held_len[j], r->held_dig[j]);
                r->held_raw[j] = NULL;
                held_clear(r, j);
            }
    }
    if (k) {
        free(k->state);
        k->state = zz_memdup(f->data.p, f->data.len);
        k->state_len = k->state ? f->data.len : 0;
        memcpy(k->own_dig, d, ZZ_DIGEST_LEN);
        k->have_own = k->state != NULL;
        check_stable(r, k);
    }
    /* Slots at or below seq are history now. */
    for (uint32_t i = 0; i < r->L; i++)
        if (r->slots[i].seq && r->slots[i].seq <= seq)
            r->slots[i].committed = 0;
    zz_try_execute(r);
    zz_try_propose(r);
}

/* Called from the status tick: retry a state transfer, or start one if a stable
 * checkpoint ahead of us has not been reached by normal execution. */
void zz_ckpt_tick(zz_replica *r)
{
    uint64_t now = zz_now_ms(r);
    if (r->transfer_seq) {
        if (now - r->transfer_sent_ms > 300)
            send_fetch_state(r);
        return;
    }
    if (r->ahead_seq && r->ahead_seq > r->last_exec &&
        now - r->ahead_since_ms > 2 * (uint64_t)r->conf->status_interval_ms) {
        for (uint32_t i = 0; i < r->n_ckpts; i++) {
            zz_ckpt *k = &r->ckpts[i];
            uint8_t which[ZZ_MAX_REPLICAS];
            const uint8_t *dig;
            if (k->seq == r->ahead_seq && (dig = certified(r, k, which)) != NULL) {
                zz_start_transfer(r, k->seq, dig);
                return;
            }
        }
        r->ahead_seq = 0;
    }
}
