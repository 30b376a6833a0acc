/* fuzz_wire.c - libFuzzer target for the wire decoder (make fuzz-run).
 * Any input must decode or be rejected without UB; accepted input must dump and re-encode
 * to exactly itself, which catches decoder/encoder disagreements as well as memory bugs. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wire.h"
#include "wire_dump.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void walk_blist(const zz_blist *l)
{
    zz_blist_iter it;
    zz_bytes b;
    uint32_t n = 0;
    uint64_t sum = 0;
    zz_blist_begin(l, &it);
    while (zz_blist_next(&it, &b)) {
        n++;
        if (b.len)
            sum += b.p[0] + b.p[b.len - 1]; /* touch both ends of every item */
        /* nested messages are decoded too, as the replica will */
        zz_msg inner;
        (void)zz_decode(b.p, b.len, &inner);
    }
    if (n != l->count)
        abort(); /* the decoder validated the list, so iteration must see every item */
    (void)sum;
}

static void walk_flist(const zz_flist *l, int entries)
{
    for (uint32_t i = 0; i < l->count; i++) {
        if (entries) {
            zz_entry e;
            zz_entry_at(l, i, &e);
        } else {
            zz_choice c;
            zz_choice_at(l, i, &c);
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    zz_msg m;
    if (zz_decode(data, size, &m) != ZZ_OK) {
        /* still exercise the standalone batch decoder on the same bytes */
        uint64_t a, b;
        zz_blist reqs;
        if (zz_decode_batch(data, size, &a, &b, &reqs) == ZZ_OK)
            walk_blist(&reqs);
        return 0;
    }
    switch (m.type) {
    case ZZ_PRE_PREPARE: {
        walk_blist(&m.u.pre_prepare.requests);
        uint64_t a, b;
        zz_blist reqs;
        if (zz_decode_batch(m.u.pre_prepare.batch.p, m.u.pre_prepare.batch.len, &a, &b, &reqs) !=
            ZZ_OK)
            abort(); /* the batch view of a valid PRE-PREPARE must decode on its own */
        break;
    }
    case ZZ_VIEW_CHANGE:
        walk_blist(&m.u.view_change.proof);
        walk_flist(&m.u.view_change.prepared, 1);
        walk_flist(&m.u.view_change.preprepared, 1);
        break;
    case ZZ_WAKEUP:
        walk_blist(&m.u.wakeup.evidence);
        break;
    case ZZ_NEW_VIEW:
        walk_blist(&m.u.new_view.view_changes);
        walk_flist(&m.u.new_view.chosen, 0);
        break;
    default:
        break;
    }
    if (m.auth_kind == ZZ_AUTH_MAC || m.auth_kind == ZZ_AUTH_MAC_SIG)
        (void)zz_find_mac(&m, 1);

    /* Dump: hex doubles the size; a u32 list item (4 bytes) takes up to 11 characters, so
     * triple it, plus field names. */
    size_t cap = 3 * size + 4096;
    char *out = malloc(cap);
    if (!out)
        return 0;
    int n = zz_dump(&m, out, cap);
    if (n < 0 || (size_t)n != strlen(out))
        abort();
    free(out);

    zz_buf b;
    zz_buf_init(&b);
    size_t s = zz_reencode(&b, &m);
    if (b.oom) {
        zz_buf_free(&b);
        return 0;
    }
    if (b.len - s != size || memcmp(b.p + s, data, size) != 0) {
        fprintf(stderr, "re-encoding differs from the input\n");
        abort();
    }
    zz_buf_free(&b);
    return 0;
}
