/* byz.c - test-only misbehaviour of zz-agreed behind one seam (byz.h): the only file besides
 * conf.c that reads the conf's `byzantine` and `byzantine_commits` settings. */
#include "byz.h"

int zz_byz_silent(const zz_replica *r)
{
    return r->conf->byzantine == ZZ_BYZ_SILENT;
}

int zz_byz_drops_requests(const zz_replica *r)
{
    return r->conf->byzantine == ZZ_BYZ_DROP_REQUESTS;
}

int zz_byz_false_fault(const zz_replica *r)
{
    return r->conf->byzantine == ZZ_BYZ_FALSE_FAULT;
}

int zz_byz_withholds_commit(const zz_replica *r, uint32_t to, uint32_t view, uint64_t seq)
{
    const zz_conf *c = r->conf;
    return to < 64 && (c->byz_commit_peers >> to & 1) && view == c->byz_commit_view &&
           seq >= c->byz_commit_lo && seq <= c->byz_commit_hi;
}

int zz_byz_pre_prepare(zz_replica *r, uint64_t seq, zz_buf *batch, uint64_t seed,
                       zz_byz_send_pp *send_one)
{
    if (r->conf->byzantine != ZZ_BYZ_EQUIVOCATE)
        return 0;
    for (uint32_t i = 0; i < r->n; i++) {
        if (i == r->id)
            continue;
        uint64_t other = seed ^ (0xA5A5A5A5ULL * (i + 1));
        for (int k = 0; k < 8; k++)
            batch->p[8 + k] = (uint8_t)(other >> (56 - 8 * k));
        send_one(r, i, seq, batch->p, (uint32_t)batch->len);
    }
    return 1;
}
