/* viewchange.c - PBFT view change with signed VIEW-CHANGE and NEW-VIEW messages: timers
 * that double per failed view, joining a view g+1 others moved to, the new primary's
 * NEW-VIEW, and every backup re-deriving it with zz_choose before accepting it. */
#include <stdlib.h>
#include <string.h>

#include "byz.h"
#include "choose.h"
#include "log.h"
#include "replica.h"

static uint64_t vc_timeout(const zz_replica *r)
{
    uint32_t shift = r->vc_attempts > 10 ? 10 : r->vc_attempts;
    return (uint64_t)r->conf->view_timeout_ms << shift;
}

static void put_entries(zz_replica *r, zz_buf *b, int prepared)
{
    size_t count_at = b->len;
    zz_put_u32(b, 0);
    uint32_t count = 0;
    for (uint64_t seq = r->stable + 1; seq <= r->stable + r->L; seq++) {
        zz_slot *s = &r->slots[seq % r->L];
        if (s->seq != seq || !(prepared ? s->has_p : s->has_q))
            continue;
        zz_entry e = {seq, prepared ? s->p_view : s->q_view, {0}};
        memcpy(e.digest, prepared ? s->p_dig : s->q_dig, ZZ_DIGEST_LEN);
        zz_put_entry(b, &e);
        count++;
    }
    if (!b->oom)
        for (int i = 0; i < 4; i++)
            b->p[count_at + (size_t)i] = (uint8_t)(count >> (24 - 8 * i));
}

static void send_own_vc(zz_replica *r)
{
    if (r->vc_raw[r->id] && !zz_byz_silent(r))
        zz_net_bcast(r->net, r->vc_raw[r->id], r->vc_len[r->id]);
    r->vc_sent_ms = zz_now_ms(r);
}

static void try_new_view(zz_replica *r);

void zz_start_view_change(zz_replica *r, uint32_t new_view)
{
    if (new_view <= r->view && (r->in_vc || new_view < r->view))
        return;
    if (new_view == r->view && !r->in_vc)
        return;
    zz_log("zz-agreed: replica %u: view change to view %u (from %u%s; stable %llu, executed "
           "through %llu, next timer %llu ms)\n", r->id, new_view, r->view,
           r->in_vc ? ", itself a view change" : "", (unsigned long long)r->stable,
           (unsigned long long)r->last_exec, (unsigned long long)vc_timeout(r));
    r->view = new_view;
    r->in_vc = 1;
    r->st.view_changes++;
    r->vc_deadline_ms = zz_now_ms(r) + vc_timeout(r);
    r->vc_attempts++;
    free(r->nv_raw);
    r->nv_raw = NULL;
    r->nv_len = 0;

    zz_buf *b = &r->out;
    zz_buf_reset(b);
    size_t st = zz_begin(b, ZZ_VIEW_CHANGE, ZZ_AUTH_SIG, r->conf->service, r->id);
    zz_put_u32(b, new_view);
    zz_put_u64(b, r->stable);
    zz_put_u32(b, r->stable ? r->stable_proof_n : 0);
    for (uint32_t i = 0; r->stable && i < r->stable_proof_n; i++)
        zz_put_bytes(b, r->stable_proof[i], r->stable_proof_len[i]);
    put_entries(r, b, 1);
    put_entries(r, b, 0);
    zz_end_body(b, st);
    if (zz_auth_sign(b, st, r->conf->sign) != 0 || b->oom)
        return;
    free(r->vc_raw[r->id]);
    r->vc_raw[r->id] = zz_memdup(b->p + st, b->len - st);
    r->vc_len[r->id] = r->vc_raw[r->id] ? (uint32_t)(b->len - st) : 0;
    r->vc_view[r->id] = new_view;
    /* Durable before it is sent: after a crash this replica stays out of the views below. */
    zz_wal_view(r);
    send_own_vc(r);
    if (zz_primary(r, new_view) == r->id)
        try_new_view(r);
}

/* Structural and cryptographic checks of one VIEW-CHANGE (signature already checked
 * by the caller); fills info. */
static int vc_valid(zz_replica *r, const zz_msg *m, zz_vc_info *info)
{
    const zz_view_change *vc = &m->u.view_change;
    if (vc->stable_seq % r->conf->checkpoint_interval != 0)
        return 0;
    if (vc->stable_seq == 0) {
        if (vc->proof.count != 0)
            return 0;
    } else {
        uint8_t d[ZZ_DIGEST_LEN];
        if (!zz_verify_ckpt_proof(r, &vc->proof, vc->stable_seq, d))
            return 0;
    }
    const zz_flist *lists[2] = {&vc->prepared, &vc->preprepared};
    for (int l = 0; l < 2; l++)
        for (uint32_t i = 0; i < lists[l]->count; i++) {
            zz_entry e;
            zz_entry_at(lists[l], i, &e);
            if (e.seq <= vc->stable_seq || e.seq > vc->stable_seq + r->L ||
                e.view >= vc->new_view)
                return 0;
        }
    info->sender = m->sender;
    info->stable_seq = vc->stable_seq;
    info->P = vc->prepared;
    info->Q = vc->preprepared;
    return 1;
}

/* Learn the stable checkpoint a view change proves (we may be behind it). */
static void learn_proof(zz_replica *r, const zz_blist *proof)
{
    zz_blist_iter it;
    zz_bytes item;
    zz_blist_begin(proof, &it);
    while (zz_blist_next(&it, &item)) {
        zz_msg c;
        if (zz_decode(item.p, item.len, &c) == ZZ_OK && c.type == ZZ_CHECKPOINT)
            zz_on_checkpoint(r, &c); /* already verified as part of the proof */
    }
}

void zz_on_view_change(zz_replica *r, const zz_msg *m)
{
    const zz_view_change *vc = &m->u.view_change;
    uint32_t s = m->sender;
    /* A replica still asking for the view we already entered missed our NEW-VIEW. */
    if (vc->new_view == r->view && !r->in_vc && r->nv_raw &&
        !zz_byz_silent(r))
        zz_net_send_peer(r->net, s, r->nv_raw, r->nv_len);
    if (r->vc_raw[s] && vc->new_view <= r->vc_view[s])
        return;
    zz_vc_info info;
    if (!vc_valid(r, m, &info)) {
        r->st.dropped[ZZ_DROP_BADVC]++;
        return;
    }
    uint8_t *copy = zz_memdup(m->raw, m->raw_len);
    if (!copy)
        return;
    free(r->vc_raw[s]);
    r->vc_raw[s] = copy;
    r->vc_len[s] = m->raw_len;
    r->vc_view[s] = vc->new_view;
    if (vc->stable_seq > r->last_exec)
        learn_proof(r, &vc->proof);

    /* g+1 replicas in later views include a correct one: follow them to the lowest. */
    uint32_t later = 0, lowest = UINT32_MAX;
    for (uint32_t i = 0; i < r->n; i++)
        if (r->vc_raw[i] && i != r->id && r->vc_view[i] > r->view) {
            later++;
            if (r->vc_view[i] < lowest)
                lowest = r->vc_view[i];
        }
    if (later >= r->g + 1)
        zz_start_view_change(r, lowest);
    if (r->in_vc && zz_primary(r, r->view) == r->id)
        try_new_view(r);
}

/* Collect the stored, valid VIEW-CHANGEs for `view` into info[]. */
static uint32_t collect(zz_replica *r, uint32_t view, zz_vc_info *info, zz_msg *msgs)
{
    uint32_t k = 0;
    for (uint32_t i = 0; i < r->n; i++) {
        if (!r->vc_raw[i] || r->vc_view[i] != view)
            continue;
        if (zz_decode(r->vc_raw[i], r->vc_len[i], &msgs[k]) != ZZ_OK)
            continue;
        if (vc_valid(r, &msgs[k], &info[k]))
            k++;
    }
    return k;
}

static void install_new_view(zz_replica *r, uint64_t min_s, const zz_choice *ch, uint32_t nch,
                             const zz_vc_info *info, const zz_msg *msgs, uint32_t nvc)
{
    r->in_vc = 0;
    r->last_progress_ms = zz_now_ms(r);
    r->st.new_views++;
    if (min_s > r->stable)
        for (uint32_t i = 0; i < nvc; i++)
            if (info[i].stable_seq == min_s) {
                learn_proof(r, &msgs[i].u.view_change.proof);
                break;
            }
    uint64_t max_s = min_s;
    for (uint32_t i = 0; i < nch; i++)
        if (ch[i].seq > max_s)
            max_s = ch[i].seq;
    zz_log("zz-agreed: replica %u: in view %u (NEW-VIEW of %u VIEW-CHANGEs, from stable %llu: "
           "%llu seqs carried over; stable %llu, executed through %llu)\n", r->id, r->view, nvc,
           (unsigned long long)min_s, (unsigned long long)(max_s - min_s),
           (unsigned long long)r->stable, (unsigned long long)r->last_exec);
    for (uint32_t i = 0; i < nch; i++) {
        zz_slot *s = zz_slot_get(r, ch[i].seq);
        if (!s)
            continue; /* beyond our window: we are behind and will fetch state */
        if (s->has_pp && s->view == r->view)
            continue;
        /* A seq we executed is proposed again as well (PBFT, TOCS §4.5): replicas that only
         * prepared it need our PREPARE and COMMIT in this view to commit it, and no stable
         * checkpoint can pass it without them. It does not run again (zz_try_execute starts
         * above last_exec) and stays committed here (normal.c accept). Chosen differently
         * from the batch we executed would mean 2g+1 VIEW-CHANGEs lost what g+1 correct
         * replicas prepared: we stay out of it. */
        if (ch[i].seq <= r->last_exec && s->committed &&
            memcmp(s->digest, ch[i].digest, ZZ_DIGEST_LEN) != 0) {
            r->st.dropped[ZZ_DROP_BADVC]++;
            continue;
        }
        zz_accept_proposal(r, s, r->view, ch[i].digest, NULL, 0);
    }
    if (r->next_seq < max_s)
        r->next_seq = max_s;
    if (r->next_seq < r->last_exec)
        r->next_seq = r->last_exec;
    zz_requeue_pending(r);
    zz_try_execute(r);
}

static void try_new_view(zz_replica *r)
{
    zz_vc_info info[ZZ_MAX_REPLICAS];
    zz_msg msgs[ZZ_MAX_REPLICAS];
    uint32_t nvc = collect(r, r->view, info, msgs);
    if (nvc < 2 * r->g + 1)
        return;
    zz_choice *ch = calloc(r->L, sizeof *ch);
    if (!ch)
        return;
    uint64_t min_s;
    uint32_t nch;
    if (zz_choose(info, nvc, r->g, r->L, &min_s, ch, r->L, &nch) != 1) {
        free(ch);
        return;
    }
    zz_buf *b = &r->out2;
    zz_buf_reset(b);
    size_t st = zz_begin(b, ZZ_NEW_VIEW, ZZ_AUTH_SIG, r->conf->service, r->id);
    zz_put_u32(b, r->view);
    zz_put_u32(b, nvc);
    for (uint32_t i = 0; i < nvc; i++)
        zz_put_bytes(b, msgs[i].raw, msgs[i].raw_len);
    zz_put_u64(b, min_s);
    zz_put_u32(b, nch);
    for (uint32_t i = 0; i < nch; i++)
        zz_put_choice(b, &ch[i]);
    zz_end_body(b, st);
    if (zz_auth_sign(b, st, r->conf->sign) != 0 || b->oom) {
        free(ch);
        return;
    }
    free(r->nv_raw);
    r->nv_raw = zz_memdup(b->p + st, b->len - st);
    r->nv_len = r->nv_raw ? (uint32_t)(b->len - st) : 0;
    r->in_vc = 0; /* install_new_view clears it as well; the record says the view is in */
    zz_wal_view(r);
    if (r->nv_raw && !zz_byz_silent(r))
        zz_net_bcast(r->net, r->nv_raw, r->nv_len);
    install_new_view(r, min_s, ch, nch, info, msgs, nvc);
    free(ch);
}

void zz_on_new_view(zz_replica *r, const zz_msg *m)
{
    const zz_new_view *nv = &m->u.new_view;
    if (nv->view < r->view || (nv->view == r->view && !r->in_vc && r->nv_raw))
        return;
    if (m->sender != zz_primary(r, nv->view)) {
        r->st.dropped[ZZ_DROP_SENDER]++;
        return;
    }
    zz_vc_info info[ZZ_MAX_REPLICAS];
    zz_msg msgs[ZZ_MAX_REPLICAS];
    uint8_t seen[ZZ_MAX_REPLICAS] = {0};
    uint32_t nvc = 0;
    zz_blist_iter it;
    zz_bytes item;
    zz_blist_begin(&nv->view_changes, &it);
    while (zz_blist_next(&it, &item)) {
        zz_msg *vm = &msgs[nvc];
        if (nvc >= r->n || zz_decode(item.p, item.len, vm) != ZZ_OK ||
            vm->type != ZZ_VIEW_CHANGE || vm->service != r->conf->service ||
            vm->sender >= r->n || seen[vm->sender] ||
            vm->u.view_change.new_view != nv->view || !zz_pub_for(r, vm->sender) ||
            !zz_verify_sig(vm, zz_pub_for(r, vm->sender)) || !vc_valid(r, vm, &info[nvc])) {
            r->st.dropped[ZZ_DROP_BADVC]++;
            return;
        }
        seen[vm->sender] = 1;
        nvc++;
    }
    zz_choice *ch = calloc(r->L, sizeof *ch);
    if (!ch)
        return;
    uint64_t min_s;
    uint32_t nch;
    int ok = zz_choose(info, nvc, r->g, r->L, &min_s, ch, r->L, &nch) == 1 &&
             min_s == nv->min_s && nch == nv->chosen.count;
    for (uint32_t i = 0; ok && i < nch; i++) {
        zz_choice c;
        zz_choice_at(&nv->chosen, i, &c);
        ok = c.seq == ch[i].seq && memcmp(c.digest, ch[i].digest, ZZ_DIGEST_LEN) == 0;
    }
    if (!ok) {
        r->st.dropped[ZZ_DROP_BADVC]++;
        free(ch);
        return;
    }
    if (nv->view > r->view)
        r->st.view_changes++;
    r->view = nv->view;
    free(r->nv_raw);
    r->nv_raw = zz_memdup(m->raw, m->raw_len);
    r->nv_len = r->nv_raw ? m->raw_len : 0;
    r->in_vc = 0;
    zz_wal_view(r); /* before the PREPAREs of the new view go out */
    install_new_view(r, min_s, ch, nch, info, msgs, nvc);
    free(ch);
}

/* VIEW-CHANGEs held for `view`, our own included. */
static uint32_t vc_held(const zz_replica *r, uint32_t view)
{
    uint32_t k = 0;
    for (uint32_t i = 0; i < r->n; i++)
        k += r->vc_raw[i] && r->vc_view[i] == view;
    return k;
}

void zz_vc_tick(zz_replica *r)
{
    uint64_t now = zz_now_ms(r);
    if (r->in_vc) {
        /* PBFT (TOCS §4.5.2, liveness): the timer that gives up on view v starts once 2g+1
         * VIEW-CHANGEs for v are held. A replica that suspected the primary alone waits in
         * v for the others; moving on by itself it ran views ahead that the others, when
         * their primary failed later, could not reach with g+1 of them (a durable replica
         * restarted next to a damaged log did this in the power-loss runs). */
        if (vc_held(r, r->view) < 2 * r->g + 1)
            r->vc_deadline_ms = now + vc_timeout(r);
        if (now >= r->vc_deadline_ms)
            zz_start_view_change(r, r->view + 1);
        else if (now - r->vc_sent_ms >= 4 * (uint64_t)r->conf->status_interval_ms)
            send_own_vc(r);
        return;
    }
    /* A replica catching up (state transfer, or a stable checkpoint seen ahead) waits for
     * that first: its requests are late because it is, not because the primary is. */
    if (r->transfer_seq || (r->ahead_seq && r->ahead_seq > r->last_exec))
        return;
    /* PBFT's timer: it runs while a request waits and restarts whenever execution makes
     * progress. A replica that lags but keeps executing is catching up, not suspecting;
     * suspecting alone would strand it in a view the others never join. */
    uint64_t t = r->conf->view_timeout_ms;
    if (now > t && now - r->last_progress_ms >= t && zz_has_pending(r, now - t, 1))
        zz_start_view_change(r, r->view + 1);
}
