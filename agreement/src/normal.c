/* normal.c - the PBFT normal case: PRE-PREPARE, PREPARE, COMMIT (Castro & Liskov §4.2).
 * A slot is prepared with the pre-prepare plus 2g matching PREPAREs from backups, and
 * committed-local once prepared with 2g+1 matching COMMITs; execution follows in order. */
#include <stdlib.h>
#include <string.h>

#include "byz.h"
#include "replica.h"

static const uint8_t null_digest[ZZ_DIGEST_LEN];

void zz_slot_reset(zz_replica *r, zz_slot *s, uint64_t seq)
{
    free(s->batch);
    free(s->pp_raw);
    s->batch = NULL;
    s->pp_raw = NULL;
    s->batch_len = s->pp_raw_len = 0;
    s->seq = seq;
    s->view = 0;
    s->has_pp = s->is_null = s->held = 0;
    s->sent_prepare = s->sent_commit = s->prepared = s->committed = 0;
    s->has_p = s->has_q = 0;
    s->fetch_sent_ms = 0;
    s->pp_time_ms = 0;
    s->t_pp_us = s->t_prep_us = s->t_commit_us = 0;
    s->p_mark = 0;
    for (uint32_t i = 0; i < r->n; i++)
        s->prep_view[i] = s->commit_view[i] = UINT32_MAX;
}

int zz_slot_set_batch(zz_replica *r, zz_slot *s, const uint8_t *batch, uint32_t len)
{
    (void)r;
    uint8_t d[ZZ_DIGEST_LEN];
    zz_sha256(batch, len, d);
    if (memcmp(d, s->digest, ZZ_DIGEST_LEN) != 0)
        return -1;
    uint8_t *copy = zz_memdup(batch, len);
    if (!copy)
        return -1;
    free(s->batch);
    s->batch = copy;
    s->batch_len = len;
    return 0;
}

static void send_phase(zz_replica *r, zz_slot *s, uint8_t type)
{
    zz_buf *b = &r->out;
    int withheld = 0;
    for (uint32_t i = 0; type == ZZ_COMMIT && i < r->n; i++)
        withheld |= i != r->id && zz_byz_withholds_commit(r, i, s->view, s->seq);
    if (withheld) {
        for (uint32_t i = 0; i < r->n; i++) {
            if (i == r->id || zz_byz_withholds_commit(r, i, s->view, s->seq))
                continue;
            zz_buf_reset(b);
            size_t st = zz_enc_phase(b, type, r->conf->service, r->id, s->view, s->seq,
                                     s->digest);
            zz_end_body(b, st);
            zz_send_mac(r, i, b, st);
        }
        return;
    }
    zz_buf_reset(b);
    size_t st = zz_enc_phase(b, type, r->conf->service, r->id, s->view, s->seq, s->digest);
    zz_end_body(b, st);
    zz_bcast_mac(r, b, st);
}

/* Our PREPARE for the slot's pre-prepare, which also enters it in our Q set (the
 * pre-prepared batches a VIEW-CHANGE lists). */
static void prepare(zz_replica *r, zz_slot *s, int new_batch)
{
    s->has_q = 1;
    s->q_view = s->view;
    memcpy(s->q_dig, s->digest, ZZ_DIGEST_LEN);
    int backup = zz_primary(r, s->view) != r->id;
    /* After a host restart this replica may have sent a PREPARE for this seq and view whose
     * record was lost: it neither sends one nor counts one of its own (wal.c). */
    int withhold = backup && zz_wal_forgets(r, s->view, s->seq);
    if (backup && !withhold) {
        s->prep_view[r->id] = s->view;
        memcpy(s->prep_dig[r->id], s->digest, ZZ_DIGEST_LEN);
        s->sent_prepare = 1;
    }
    /* Written before the PREPARE (or, at the primary, the PRE-PREPARE) goes out, synced with
     * the next sync (before this replica's COMMIT at the latest): a restarted process must
     * not accept another batch for this seq and view, and a restarted host withholds them
     * (docs/agreement.md "Durable state"). */
    zz_wal_slot(r, s, new_batch, withhold ? ZZ_WAL_NODEP : ZZ_WAL_WRITTEN);
    if (withhold) {
        r->wal.withheld++;
    } else if (backup && !zz_wal_abstains(r, s->seq)) {
        zz_net_early(r->net, zz_wal_early(r)); /* before the turn's sync, if it may */
        send_phase(r, s, ZZ_PREPARE);
        zz_net_early(r->net, 0);
    }
}

static void accept(zz_replica *r, zz_slot *s, uint32_t view, const uint8_t *digest,
                   const uint8_t *batch, uint32_t batch_len, int held);

void zz_accept_proposal(zz_replica *r, zz_slot *s, uint32_t view, const uint8_t *digest,
                        const uint8_t *batch, uint32_t batch_len)
{
    accept(r, s, view, digest, batch, batch_len, 0);
}

static void accept(zz_replica *r, zz_slot *s, uint32_t view, const uint8_t *digest,
                   const uint8_t *batch, uint32_t batch_len, int held)
{
    int same_digest = s->batch && memcmp(s->digest, digest, ZZ_DIGEST_LEN) == 0;
    /* A seq this replica executed, proposed again in a later view (viewchange.c): the same
     * batch stays committed, so the records written for it still say so and a restart runs
     * it again from the stable checkpoint as before. */
    int executed = s->committed && s->seq <= r->last_exec &&
                   memcmp(s->digest, digest, ZZ_DIGEST_LEN) == 0;
    if (!same_digest && s->batch) {
        free(s->batch);
        s->batch = NULL;
        s->batch_len = 0;
    }
    if (s->pp_raw) {
        free(s->pp_raw);
        s->pp_raw = NULL;
        s->pp_raw_len = 0;
    }
    memcpy(s->digest, digest, ZZ_DIGEST_LEN);
    s->view = view;
    s->has_pp = 1;
    s->held = held;
    s->is_null = memcmp(digest, null_digest, ZZ_DIGEST_LEN) == 0;
    s->sent_prepare = s->sent_commit = s->prepared = 0;
    s->committed = executed;
    s->pp_time_ms = zz_now_ms(r);
    s->t_pp_us = zz_mono_us();
    s->t_prep_us = s->t_commit_us = 0;
    int new_batch = batch && !s->batch && zz_slot_set_batch(r, s, batch, batch_len) == 0;
    if (!held)
        prepare(r, s, new_batch);
    else
        zz_wal_slot(r, s, new_batch, ZZ_WAL_NODEP); /* held: no PREPARE yet, pre-prepare kept */
    zz_check_slot(r, s);
}

/* Is a request of a proposed batch authentic for us? 1 yes, 0 no, 2 cannot tell. A signed
 * one (auth kind 3) by its signature, the same answer at every correct replica (Aardvark's
 * rule); we skip the check when it is byte for byte the pending copy we already verified at
 * intake. An unsigned one by our MAC entry; a client can make that good for the primary and
 * bad for us (docs/agreement.md "Signed requests"): 2, the pre-prepare is held. */
static int request_ok(zz_replica *r, const zz_msg *m)
{
    int ci = zz_client_index(r, m->sender);
    if (ci < 0)
        return 0;
    if (m->auth_kind == ZZ_AUTH_MAC_SIG) {
        const zz_client *c = &r->clients[ci];
        if (c->pend_raw && c->pend_signed && c->pend_len == m->raw_len &&
            memcmp(c->pend_raw, m->raw, m->raw_len) == 0)
            return 1;
        r->st.pp_sig_checked++;
        return zz_verify_sig(m, zz_pub_for(r, m->sender));
    }
    if (r->conf->require_signed)
        return 0; /* a correct primary orders signed requests only: every backup can check */
    if (zz_verify_mac(m, r->id, zz_mac_for(r, m->sender)))
        return 1;
    r->st.pp_unverifiable++;
    /* The client (or a primary forging it) is faulty. Should no g backups be able to
     * vouch, the slot stalls and a view change follows; as a primary we will not order
     * this client's unsigned requests again for a while, so it cannot do it to us. */
    zz_client *mc = &r->clients[ci];
    if (zz_now_ms(r) >= mc->must_sign_until_ms)
        r->st.must_sign_marks++;
    mc->must_sign_until_ms = zz_now_ms(r) + ZZ_MUST_SIGN_MS;
    return 2;
}

/* Backups check what the primary proposes: every request authentic for us (request_ok),
 * and the proposed time close to our clock (the non-deterministic inputs, docs/design.md
 * §3.2). 1: accept; 0: refuse; 2: accept but hold (an unsigned request we cannot check). */
static int batch_ok(zz_replica *r, const zz_bytes *batch)
{
    uint64_t nd_time, nd_seed;
    zz_blist reqs;
    /* A correct primary never builds a batch over batch_bytes or holding a request over
     * the limit (request.c): one could not travel in every message that carries it. */
    if (batch->len > r->conf->batch_bytes) {
        r->st.batches_too_large++;
        return 0;
    }
    if (zz_decode_batch(batch->p, batch->len, &nd_time, &nd_seed, &reqs) != ZZ_OK)
        return 0;
    uint32_t limit = zz_request_limit(r);
    uint64_t now = zz_wall_ms();
    uint64_t tol = r->conf->time_tolerance_ms;
    if (nd_time + tol < now || nd_time > now + tol)
        return 0;
    int held = 0;
    zz_blist_iter it;
    zz_bytes item;
    zz_blist_begin(&reqs, &it);
    while (zz_blist_next(&it, &item)) {
        zz_msg m;
        if (item.len > limit) {
            r->st.batches_too_large++;
            return 0;
        }
        if (zz_decode(item.p, item.len, &m) != ZZ_OK || m.type != ZZ_REQUEST ||
            m.service != r->conf->service || (m.u.request.flags & ZZ_REQ_READONLY))
            return 0;
        int ok = request_ok(r, &m);
        if (!ok)
            return 0;
        held |= ok == 2;
    }
    return held ? 2 : 1;
}

/* The slot for seq, or NULL after counting why there is none: below the low watermark a
 * message is merely late; above the high one it is outside what we accept. */
static zz_slot *slot_or_count(zz_replica *r, uint64_t seq)
{
    zz_slot *s = zz_slot_get(r, seq);
    if (!s) {
        if (seq <= r->stable)
            r->st.stale++;
        else
            r->st.dropped[ZZ_DROP_WINDOW]++;
    }
    return s;
}

void zz_on_pre_prepare(zz_replica *r, const zz_msg *m)
{
    const zz_pre_prepare *pp = &m->u.pre_prepare;
    if (r->in_vc || pp->view != r->view) {
        r->st.dropped[ZZ_DROP_VIEW]++;
        return;
    }
    if (m->sender != zz_primary(r, pp->view)) {
        r->st.dropped[ZZ_DROP_SENDER]++;
        return;
    }
    zz_slot *s = slot_or_count(r, pp->seq);
    if (!s)
        return;
    if (pp->seq <= r->last_exec)
        return;
    uint8_t d[ZZ_DIGEST_LEN];
    zz_sha256(pp->batch.p, pp->batch.len, d);
    if (s->has_pp && s->view == pp->view) {
        if (memcmp(d, s->digest, ZZ_DIGEST_LEN) != 0)
            r->st.dropped[ZZ_DROP_BADPP]++; /* equivocation: keep the first */
        else if (!s->batch && zz_slot_set_batch(r, s, pp->batch.p, pp->batch.len) == 0)
            zz_wal_slot(r, s, 1, ZZ_WAL_NODEP);
        return;
    }
    int ok = batch_ok(r, &pp->batch);
    if (!ok) {
        r->st.dropped[ZZ_DROP_BADPP]++;
        return;
    }
    r->st.pp_held += ok == 2;
    accept(r, s, pp->view, d, pp->batch.p, pp->batch.len, ok == 2);
    if (s->seq == pp->seq && !s->pp_raw) {
        s->pp_raw = zz_memdup(m->raw, m->raw_len);
        s->pp_raw_len = s->pp_raw ? m->raw_len : 0;
    }
}

void zz_on_phase(zz_replica *r, const zz_msg *m)
{
    const zz_phase *ph = &m->u.phase;
    if (ph->view < r->view) {
        r->st.dropped[ZZ_DROP_VIEW]++;
        return;
    }
    zz_slot *s = slot_or_count(r, ph->seq);
    if (!s)
        return;
    /* Votes for a later view are kept: they count once we enter that view. */
    if (m->type == ZZ_PREPARE) {
        if (m->sender == zz_primary(r, ph->view)) {
            r->st.dropped[ZZ_DROP_SENDER]++;
            return;
        }
        if (s->prep_view[m->sender] != UINT32_MAX && s->prep_view[m->sender] > ph->view)
            return;
        s->prep_view[m->sender] = ph->view;
        memcpy(s->prep_dig[m->sender], ph->digest, ZZ_DIGEST_LEN);
    } else {
        if (s->commit_view[m->sender] != UINT32_MAX && s->commit_view[m->sender] > ph->view)
            return;
        s->commit_view[m->sender] = ph->view;
        memcpy(s->commit_dig[m->sender], ph->digest, ZZ_DIGEST_LEN);
    }
    zz_check_slot(r, s);
}

static uint32_t count_votes(const zz_replica *r, const zz_slot *s, const uint32_t *views,
                            uint8_t (*digs)[ZZ_DIGEST_LEN], uint32_t skip)
{
    uint32_t c = 0;
    for (uint32_t i = 0; i < r->n; i++)
        if (i != skip && views[i] == s->view && memcmp(digs[i], s->digest, ZZ_DIGEST_LEN) == 0)
            c++;
    return c;
}

void zz_check_slot(zz_replica *r, zz_slot *s)
{
    if (!s->has_pp || s->view != r->view || r->in_vc)
        return;
    if (s->held) {
        /* An unsigned request we cannot authenticate (its MAC entry for us fails). We
         * prepare once g other backups have: with the primary that is g+1 replicas, so at
         * least one correct one that checked the request itself (by induction: the first
         * correct backup to prepare saw at most g-1 faulty PREPAREs if the primary is
         * faulty, and a correct primary proposes only what it authenticated). A MAC good
         * for one correct replica comes from the client, so the request is authentic. */
        uint32_t c = 0, primary = zz_primary(r, s->view);
        for (uint32_t i = 0; i < r->n; i++)
            if (i != primary && i != r->id && s->prep_view[i] == s->view &&
                memcmp(s->prep_dig[i], s->digest, ZZ_DIGEST_LEN) == 0)
                c++;
        if (c < r->g)
            return;
        s->held = 0;
        r->st.pp_vouched++;
        prepare(r, s, 0);
    }
    if (!s->prepared) {
        uint32_t p = count_votes(r, s, s->prep_view, s->prep_dig, zz_primary(r, s->view));
        if (p < 2 * r->g)
            return;
        s->prepared = 1;
        s->t_prep_us = zz_mono_us();
        if (s->t_pp_us) {
            r->st.ph_prep_n++;
            r->st.ph_prep_us += s->t_prep_us - s->t_pp_us;
        }
        s->has_p = 1;
        s->p_view = s->view;
        memcpy(s->p_dig, s->digest, ZZ_DIGEST_LEN);
        s->sent_commit = 1;
        /* The P entry a VIEW-CHANGE reports: synced before our COMMIT is sent. */
        zz_wal_slot(r, s, 0, ZZ_WAL_SYNCED);
        s->p_mark = zz_wal_mark(r);
        if (!zz_wal_abstains(r, s->seq))
            send_phase(r, s, ZZ_COMMIT);
    }
    /* Our own COMMIT counts toward our commit quorum once its P entry is synced, as every
     * COMMIT we receive was sent only then: a batch this replica executes (and replies for)
     * has 2g+1 synced P entries behind it, so a host crash here cannot leave it with fewer
     * than g+1 correct ones (docs/agreement.md "Durable state"). Until then 2g+1 COMMITs of
     * others commit it; the sync's end checks the slot again (wal.c). */
    if (s->commit_view[r->id] != s->view && zz_wal_synced(r, s->p_mark)) {
        s->commit_view[r->id] = s->view;
        memcpy(s->commit_dig[r->id], s->digest, ZZ_DIGEST_LEN);
    }
    if (!s->committed) {
        uint32_t votes = count_votes(r, s, s->commit_view, s->commit_dig, UINT32_MAX);
        if (votes < 2 * r->g + 1)
            return;
        s->committed = 1;
        /* A check of the rule above: the quorum needed our own COMMIT and its P entry was
         * not synced (stats wal.commit_unsynced; never with the rule in force). */
        if (votes - (s->commit_view[r->id] == s->view) < 2 * r->g + 1 &&
            !zz_wal_synced(r, s->p_mark))
            r->wal.exec_unsynced++;
        s->t_commit_us = zz_mono_us();
        if (s->t_prep_us) {
            r->st.ph_commit_n++;
            r->st.ph_commit_us += s->t_commit_us - s->t_prep_us;
        }
        zz_wal_slot(r, s, 0, ZZ_WAL_NODEP); /* a restart executes it again without asking */
    }
    if (s->seq == r->last_exec + 1)
        zz_try_execute(r);
}
