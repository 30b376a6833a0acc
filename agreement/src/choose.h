/* choose.h - the NEW-VIEW decision rule of PBFT with signed view changes (Castro &
 * Liskov, TOCS 2002 §4.5.1): a pure function so the new primary and every backup compute
 * the same result from the same VIEW-CHANGE set, and unit tests can drive it directly. */
#ifndef ZZ_CHOOSE_H
#define ZZ_CHOOSE_H

#include <stdint.h>

#include "wire.h"

typedef struct {
    uint32_t sender;
    uint64_t stable_seq;
    zz_flist P; /* prepared: (seq, view, digest) */
    zz_flist Q; /* pre-prepared */
} zz_vc_info;

/* From nvc valid, distinct-sender VIEW-CHANGEs (nvc >= 2g+1) decide min_s and, for each
 * seq in (min_s, max_s], the batch digest to re-propose (all-zero = null request).
 * Returns 1 when decided (out[0..*nout) in seq order), 0 when this set cannot decide yet
 * (wait for more view changes), -1 if cap is too small. */
int zz_choose(const zz_vc_info *vc, uint32_t nvc, uint32_t g, uint32_t L, uint64_t *min_s,
              zz_choice *out, uint32_t cap, uint32_t *nout);

#endif
