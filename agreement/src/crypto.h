/* crypto.h - SHA-256, HMAC-SHA-256 authenticators and Ed25519 signatures over OpenSSL.
 * MAC keys are pre-expanded once (HMAC_CTX-free: inner/outer SHA-256 states) because a
 * replica computes several MACs per request and per-call key setup would dominate. */
#ifndef ZZ_CRYPTO_H
#define ZZ_CRYPTO_H

#include <stddef.h>
#include <stdint.h>

#include "wire.h"

typedef struct zz_mackey zz_mackey; /* opaque, pre-expanded HMAC-SHA-256 key */
typedef struct zz_signkey zz_signkey; /* opaque Ed25519 private key */
typedef struct zz_pubkey zz_pubkey;   /* opaque Ed25519 public key */

void zz_sha256(const void *p, size_t n, uint8_t out[ZZ_DIGEST_LEN]);

zz_mackey *zz_mackey_new(const uint8_t key[32]);
void zz_mackey_free(zz_mackey *k);
void zz_hmac(const zz_mackey *k, const void *p, size_t n, uint8_t out[ZZ_MAC_LEN]);

zz_signkey *zz_signkey_new(const uint8_t seed[32]);
void zz_signkey_free(zz_signkey *k);
zz_pubkey *zz_pubkey_new(const uint8_t pub[32]);
void zz_pubkey_free(zz_pubkey *k);
/* Derive the public key bytes of a signing key. */
void zz_signkey_public(const zz_signkey *k, uint8_t pub[32]);

/* Append a MAC vector to the message started at `start` in b (after zz_end_body):
 * one entry per receivers[i] with keys[i]. */
void zz_auth_mac(zz_buf *b, size_t start, const uint32_t *receivers, zz_mackey *const *keys,
                 uint16_t count);
/* Append an Ed25519 signature. Returns 0 on success, -1 on an OpenSSL failure. */
int zz_auth_sign(zz_buf *b, size_t start, const zz_signkey *k);

/* A signed REQUEST's authenticator (auth kind 3): the MAC vector as zz_auth_mac, then the
 * signature over the same authenticated bytes. The message must have been started with
 * ZZ_AUTH_MAC_SIG. Returns 0 on success, -1 on an OpenSSL failure or out of memory. */
int zz_auth_mac_sig(zz_buf *b, size_t start, const uint32_t *receivers, zz_mackey *const *keys,
                    uint16_t count, const zz_signkey *k);

/* Verify this receiver's MAC entry of a decoded MAC-vector message. 1 = valid. */
int zz_verify_mac(const zz_msg *m, uint32_t receiver, const zz_mackey *k);
/* Verify the signature of a decoded signed message (auth kind 2, or 3's). 1 = valid. */
int zz_verify_sig(const zz_msg *m, const zz_pubkey *k);

/* Key epochs (docs/wire.md "Key epochs"): the MAC key that principal `a` (holding `own`)
 * shares with principal `b` in `epoch` of b's slot, where b's incarnation announced the
 * X25519 public key dh_pub: HMAC-SHA-256(X25519(x(own), dh_pub), "zz-epoch-mac" || u16 svc
 * || u32 min(a,b) || u32 max(a,b) || u32 epoch), x(own) = the first 32 bytes of SHA-512 of
 * own's seed (Ed25519's own scalar, RFC 8032 §5.1.5). 0 = ok, -1 = a bad or low-order key. */
int zz_epoch_mac_key(const zz_signkey *own, const uint8_t dh_pub[32], uint16_t svc, uint32_t a,
                     uint32_t b, uint32_t epoch, uint8_t out[32]);

/* Constant-time compare. */
int zz_ct_equal(const void *a, const void *b, size_t n);

#endif
