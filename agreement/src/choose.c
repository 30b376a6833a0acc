/* choose.c - the NEW-VIEW decision rule (see choose.h). For each sequence number above the
 * chosen checkpoint it picks the batch some replica may have committed, or the null request
 * when 2g+1 replicas prove nothing prepared there. */
#include "choose.h"

#include <string.h>

static int find_entry(const zz_flist *l, uint64_t seq, zz_entry *out)
{
    for (uint32_t i = 0; i < l->count; i++) {
        zz_entry e;
        zz_entry_at(l, i, &e);
        if (e.seq == seq) {
            *out = e;
            return 1;
        }
    }
    return 0;
}

/* A1: 2g+1 messages have a checkpoint below seq and nothing prepared at seq that
 * conflicts with (view, digest). */
static int cond_a1(const zz_vc_info *vc, uint32_t nvc, uint32_t g, uint64_t seq,
                   const zz_entry *cand)
{
    uint32_t ok = 0;
    for (uint32_t i = 0; i < nvc; i++) {
        if (vc[i].stable_seq >= seq)
            continue;
        int conflict = 0;
        for (uint32_t k = 0; k < vc[i].P.count && !conflict; k++) {
            zz_entry e;
            zz_entry_at(&vc[i].P, k, &e);
            if (e.seq != seq)
                continue;
            if (!(e.view < cand->view ||
                  (e.view == cand->view && memcmp(e.digest, cand->digest, ZZ_DIGEST_LEN) == 0)))
                conflict = 1;
        }
        ok += !conflict;
    }
    return ok >= 2 * g + 1;
}

/* A2: g+1 messages pre-prepared the same digest at seq in a view >= the candidate's. */
static int cond_a2(const zz_vc_info *vc, uint32_t nvc, uint32_t g, uint64_t seq,
                   const zz_entry *cand)
{
    uint32_t ok = 0;
    for (uint32_t i = 0; i < nvc; i++) {
        int found = 0;
        for (uint32_t k = 0; k < vc[i].Q.count && !found; k++) {
            zz_entry e;
            zz_entry_at(&vc[i].Q, k, &e);
            if (e.seq == seq && e.view >= cand->view &&
                memcmp(e.digest, cand->digest, ZZ_DIGEST_LEN) == 0)
                found = 1;
        }
        ok += found;
    }
    return ok >= g + 1;
}

int zz_choose(const zz_vc_info *vc, uint32_t nvc, uint32_t g, uint32_t L, uint64_t *min_s,
              zz_choice *out, uint32_t cap, uint32_t *nout)
{
    *nout = 0;
    if (nvc < 2 * g + 1)
        return 0;
    uint64_t h = 0;
    for (uint32_t i = 0; i < nvc; i++)
        if (vc[i].stable_seq > h)
            h = vc[i].stable_seq;
    *min_s = h;
    uint32_t n = 0, last_a = 0;
    for (uint64_t seq = h + 1; seq <= h + L; seq++) {
        int decided = 0;
        zz_choice c = {seq, {0}};
        for (uint32_t i = 0; i < nvc && !decided; i++) {
            zz_entry e;
            if (!find_entry(&vc[i].P, seq, &e))
                continue;
            if (cond_a1(vc, nvc, g, seq, &e) && cond_a2(vc, nvc, g, seq, &e)) {
                memcpy(c.digest, e.digest, ZZ_DIGEST_LEN);
                decided = 1;
            }
        }
        if (decided) {
            last_a = (uint32_t)(seq - h);
        } else {
            uint32_t empty = 0;
            for (uint32_t i = 0; i < nvc; i++) {
                zz_entry e;
                if (vc[i].stable_seq < seq && !find_entry(&vc[i].P, seq, &e))
                    empty++;
            }
            if (empty < 2 * g + 1)
                return 0;
        }
        if (n >= cap)
            return -1;
        out[n++] = c;
    }
    *nout = last_a; /* nulls above the last re-proposed batch are left out */
    return 1;
}
