/* status.c - retransmission: replicas broadcast STATUS while they wait for something, and
 * peers answer with what the sender lacks (pre-prepares, votes, NEW-VIEW, view changes,
 * checkpoint proofs). This is what makes the protocol indifferent to lost messages. */
#include "byz.h"
#include "replica.h"

#define ZZ_RETRANSMIT_MAX 64 /* sequence numbers answered per STATUS */

static int waiting(zz_replica *r)
{
    if (r->in_vc || r->transfer_seq || r->next_seq > r->last_exec)
        return 1;
    uint64_t seq = r->last_exec + 1;
    if (zz_in_window(r, seq) && r->slots[seq % r->L].seq == seq && r->slots[seq % r->L].has_pp)
        return 1;
    return zz_has_pending(r, UINT64_MAX, 0);
}

void zz_status_tick(zz_replica *r)
{
    zz_ckpt_tick(r);
    uint64_t now = zz_now_ms(r);
    static const uint64_t heartbeat_ms = 1000;
    /* Only a replica that waited a whole tick without executing anything asks: under
     * load everyone is always waiting for something, and that is not a loss. */
    int stuck = waiting(r) && r->last_exec == r->tick_exec;
    r->tick_exec = r->last_exec;
    if (!stuck && now - r->last_status_ms < heartbeat_ms)
        return;
    r->last_status_ms = now;
    zz_buf *b = &r->out;
    zz_buf_reset(b);
    size_t st = zz_enc_status(b, r->conf->service, r->id, r->view, r->last_exec, r->stable);
    zz_end_body(b, st);
    zz_bcast_mac(r, b, st);
    /* A committed slot whose batch never arrived: ask again. */
    zz_try_execute(r);
}

static void resend_phase(zz_replica *r, uint32_t to, zz_slot *s, uint8_t type)
{
    zz_buf *b = &r->out;
    zz_buf_reset(b);
    size_t st = zz_enc_phase(b, type, r->conf->service, r->id, s->view, s->seq, s->digest);
    zz_end_body(b, st);
    zz_send_mac(r, to, b, st);
}

void zz_on_status(zz_replica *r, const zz_msg *m)
{
    const zz_status *ps = &m->u.status;
    uint32_t j = m->sender;
    if (zz_byz_silent(r))
        return;
    r->st.retransmits++;
    if (ps->stable_seq < r->stable && ps->last_exec < r->stable)
        for (uint32_t i = 0; i < r->stable_proof_n; i++)
            zz_net_send_peer(r->net, j, r->stable_proof[i], r->stable_proof_len[i]);
    if (ps->view < r->view || (ps->view == r->view && r->in_vc)) {
        if (!r->in_vc && r->nv_raw)
            zz_net_send_peer(r->net, j, r->nv_raw, r->nv_len);
        if (r->in_vc && r->vc_raw[r->id])
            zz_net_send_peer(r->net, j, r->vc_raw[r->id], r->vc_len[r->id]);
        return;
    }
    if (ps->view != r->view || r->in_vc)
        return;
    int sent_nv = 0;
    uint64_t from = ps->last_exec > r->stable ? ps->last_exec : r->stable;
    uint64_t to = from + ZZ_RETRANSMIT_MAX;
    if (to > r->stable + r->L)
        to = r->stable + r->L;
    for (uint64_t seq = from + 1; seq <= to; seq++) {
        zz_slot *s = &r->slots[seq % r->L];
        if (s->seq != seq || !s->has_pp || s->view != r->view)
            continue;
        if (s->pp_raw && j != zz_primary(r, s->view))
            zz_net_send_peer(r->net, j, s->pp_raw, s->pp_raw_len);
        else if (!s->pp_raw && s->batch && r->id == zz_primary(r, s->view) &&
                 !zz_wal_abstains(r, seq) && !zz_wal_forgets(r, s->view, seq))
            /* Restored from the durable log, which keeps the batch but no frames: no backup
             * can relay it, so the primary makes it again (the slot's view is this view;
             * same seq and batch: the same proposal). Without it a replica that missed it
             * before a restart of the cluster got the votes but never the batch, until the
             * next stable checkpoint or view change. */
            zz_send_pre_prepare_to(r, j, seq, s->batch, s->batch_len);
        else if (r->nv_raw && !sent_nv) {
            zz_net_send_peer(r->net, j, r->nv_raw, r->nv_len);
            sent_nv = 1;
        }
        if (zz_wal_abstains(r, seq))
            continue; /* a corrupt log lost what it may have sent for seq (wal.c) */
        if (s->sent_prepare && !zz_wal_forgets(r, s->view, seq))
            resend_phase(r, j, s, ZZ_PREPARE);
        if (s->sent_commit && !zz_byz_withholds_commit(r, j, s->view, seq))
            resend_phase(r, j, s, ZZ_COMMIT);
    }
}
