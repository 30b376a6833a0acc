/* wire_dump.h - the canonical dump and the re-encoder of a decoded message, for the tests and
 * the fuzz target only (zz-agreed links neither): they prove decode and encode inverse. */
#ifndef ZZ_WIRE_DUMP_H
#define ZZ_WIRE_DUMP_H

#include "wire.h"

/* Canonical one-line dump (docs/wire.md). Returns the length written (excluding the NUL) or
 * -1 if `cap` is too small. */
int zz_dump(const zz_msg *m, char *out, size_t cap);

/* Re-encode a decoded message to bytes (header + body + its authenticator verbatim), every
 * field by the encoders. Returns the start offset of the message in b. */
size_t zz_reencode(zz_buf *b, const zz_msg *m);

#endif
