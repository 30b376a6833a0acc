/* crypto.c - SHA-256, pre-expanded HMAC-SHA-256 and Ed25519 over OpenSSL 3.
 * HMAC uses the low-level SHA256_CTX: copying a precomputed inner/outer state is a
 * plain struct copy, several times cheaper than EVP_MD_CTX_copy_ex or EVP_MAC. */

/* The SHA256_* low-level API is deprecated in OpenSSL 3 but remains supported; it is
 * the only allocation-free way to clone a midstate. */
#define OPENSSL_SUPPRESS_DEPRECATED 1

#include "crypto.h"

#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/sha.h>
#include <stdlib.h>
#include <string.h>

struct zz_mackey {
    SHA256_CTX inner; /* state after absorbing key ^ ipad */
    SHA256_CTX outer; /* state after absorbing key ^ opad */
};

struct zz_signkey {
    EVP_PKEY *pk;
};

struct zz_pubkey {
    EVP_PKEY *pk;
};

void zz_sha256(const void *p, size_t n, uint8_t out[ZZ_DIGEST_LEN])
{
    SHA256(p, n, out);
}

zz_mackey *zz_mackey_new(const uint8_t key[32])
{
    zz_mackey *k = malloc(sizeof *k);
    if (!k)
        return NULL;
    /* A 32-byte key is shorter than the 64-byte block: zero-pad, never hash it. */
    uint8_t pad[SHA256_CBLOCK];
    memset(pad, 0, sizeof pad);
    memcpy(pad, key, 32);
    for (size_t i = 0; i < sizeof pad; i++)
        pad[i] ^= 0x36;
    SHA256_Init(&k->inner);
    SHA256_Update(&k->inner, pad, sizeof pad);
    for (size_t i = 0; i < sizeof pad; i++)
        pad[i] ^= 0x36 ^ 0x5c;
    SHA256_Init(&k->outer);
    SHA256_Update(&k->outer, pad, sizeof pad);
    OPENSSL_cleanse(pad, sizeof pad);
    return k;
}

void zz_mackey_free(zz_mackey *k)
{
    if (!k)
        return;
    OPENSSL_cleanse(k, sizeof *k);
    free(k);
}

void zz_hmac(const zz_mackey *k, const void *p, size_t n, uint8_t out[ZZ_MAC_LEN])
{
    SHA256_CTX c = k->inner;
    uint8_t ih[SHA256_DIGEST_LENGTH];
    SHA256_Update(&c, p, n);
    SHA256_Final(ih, &c);
    c = k->outer;
    SHA256_Update(&c, ih, sizeof ih);
    SHA256_Final(out, &c);
    OPENSSL_cleanse(&c, sizeof c);
}

zz_signkey *zz_signkey_new(const uint8_t seed[32])
{
    EVP_PKEY *pk = EVP_PKEY_new_raw_private_key(EVP_PKEY_ED25519, NULL, seed, 32);
    if (!pk)
        return NULL;
    zz_signkey *k = malloc(sizeof *k);
    if (!k) {
        EVP_PKEY_free(pk);
        return NULL;
    }
    k->pk = pk;
    return k;
}

void zz_signkey_free(zz_signkey *k)
{
    if (!k)
        return;
    EVP_PKEY_free(k->pk);
    free(k);
}

zz_pubkey *zz_pubkey_new(const uint8_t pub[32])
{
    EVP_PKEY *pk = EVP_PKEY_new_raw_public_key(EVP_PKEY_ED25519, NULL, pub, 32);
    if (!pk)
        return NULL;
    zz_pubkey *k = malloc(sizeof *k);
    if (!k) {
        EVP_PKEY_free(pk);
        return NULL;
    }
    k->pk = pk;
    return k;
}

void zz_pubkey_free(zz_pubkey *k)
{
    if (!k)
        return;
    EVP_PKEY_free(k->pk);
    free(k);
}

void zz_signkey_public(const zz_signkey *k, uint8_t pub[32])
{
    size_t n = 32;
    if (EVP_PKEY_get_raw_public_key(k->pk, pub, &n) != 1 || n != 32)
        memset(pub, 0, 32); /* cannot happen for a key built by zz_signkey_new */
}

void zz_auth_mac(zz_buf *b, size_t start, const uint32_t *receivers, zz_mackey *const *keys,
                 uint16_t count)
{
    if (b->oom || b->len < start + ZZ_HDR_LEN)
        return;
    size_t authed = b->len - start;
    zz_put_u16(b, count);
    for (uint16_t i = 0; i < count; i++) {
        uint8_t mac[ZZ_MAC_LEN];
        /* b->p may move when the buffer grows: take the pointer afresh each time. */
        zz_hmac(keys[i], b->p + start, authed, mac);
        zz_put_u32(b, receivers[i]);
        zz_put_raw(b, mac, sizeof mac);
        if (b->oom)
            return;
    }
}

static int sign_bytes(const zz_signkey *k, const uint8_t *p, size_t n, uint8_t sig[ZZ_SIG_LEN])
{
    size_t siglen = ZZ_SIG_LEN;
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    int ok = ctx && EVP_DigestSignInit(ctx, NULL, NULL, NULL, k->pk) == 1 &&
             EVP_DigestSign(ctx, sig, &siglen, p, n) == 1 && siglen == ZZ_SIG_LEN;
    EVP_MD_CTX_free(ctx);
    if (!ok) {
        ERR_clear_error();
        return -1;
    }
    return 0;
}

int zz_auth_sign(zz_buf *b, size_t start, const zz_signkey *k)
{
    if (b->oom || b->len < start + ZZ_HDR_LEN)
        return -1;
    uint8_t sig[ZZ_SIG_LEN];
    if (sign_bytes(k, b->p + start, b->len - start, sig) != 0)
        return -1;
    zz_put_raw(b, sig, sizeof sig);
    return b->oom ? -1 : 0;
}

int zz_auth_mac_sig(zz_buf *b, size_t start, const uint32_t *receivers, zz_mackey *const *keys,
                    uint16_t count, const zz_signkey *k)
{
    if (b->oom || b->len < start + ZZ_HDR_LEN || !k)
        return -1;
    uint8_t sig[ZZ_SIG_LEN];
    if (sign_bytes(k, b->p + start, b->len - start, sig) != 0)
        return -1;
    zz_auth_mac(b, start, receivers, keys, count);
    zz_put_raw(b, sig, sizeof sig);
    return b->oom ? -1 : 0;
}

int zz_verify_mac(const zz_msg *m, uint32_t receiver, const zz_mackey *k)
{
    if ((m->auth_kind != ZZ_AUTH_MAC && m->auth_kind != ZZ_AUTH_MAC_SIG) || !k)
        return 0;
    const uint8_t *want = zz_find_mac(m, receiver);
    if (!want)
        return 0;
    uint8_t mac[ZZ_MAC_LEN];
    zz_hmac(k, m->raw, m->authed_len, mac);
    return zz_ct_equal(mac, want, ZZ_MAC_LEN);
}

int zz_verify_sig(const zz_msg *m, const zz_pubkey *k)
{
    /* kind 2: the authenticator is the signature; kind 3 (a signed REQUEST): it ends the
     * authenticator, after the MAC vector (the decoder checked both sizes). */
    if (!k || m->auth_len < ZZ_SIG_LEN)
        return 0;
    if (!(m->auth_kind == ZZ_AUTH_SIG && m->auth_len == ZZ_SIG_LEN) &&
        m->auth_kind != ZZ_AUTH_MAC_SIG)
        return 0;
    const uint8_t *sig = m->auth + m->auth_len - ZZ_SIG_LEN;
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    int ok = ctx && EVP_DigestVerifyInit(ctx, NULL, NULL, NULL, k->pk) == 1 &&
             EVP_DigestVerify(ctx, sig, ZZ_SIG_LEN, m->raw, m->authed_len) == 1;
    EVP_MD_CTX_free(ctx);
    if (!ok)
        ERR_clear_error(); /* a forged signature is routine, not an error to keep queued */
    return ok;
}

int zz_ct_equal(const void *a, const void *b, size_t n)
{
    return CRYPTO_memcmp(a, b, n) == 0;
}

int zz_epoch_mac_key(const zz_signkey *own, const uint8_t dh_pub[32], uint16_t svc, uint32_t a,
                     uint32_t b, uint32_t epoch, uint8_t out[32])
{
    uint8_t seed[32], h[SHA512_DIGEST_LENGTH], shared[32];
    size_t n = sizeof seed, sn = sizeof shared;
    int rc = -1;
    EVP_PKEY *priv = NULL, *peer = NULL;
    EVP_PKEY_CTX *ctx = NULL;
    if (EVP_PKEY_get_raw_private_key(own->pk, seed, &n) != 1 || n != sizeof seed)
        goto out;
    SHA512(seed, sizeof seed, h);
    priv = EVP_PKEY_new_raw_private_key(EVP_PKEY_X25519, NULL, h, 32);
    peer = EVP_PKEY_new_raw_public_key(EVP_PKEY_X25519, NULL, dh_pub, 32);
    if (!priv || !peer || !(ctx = EVP_PKEY_CTX_new(priv, NULL)))
        goto out;
    if (EVP_PKEY_derive_init(ctx) != 1 || EVP_PKEY_derive_set_peer(ctx, peer) != 1 ||
        EVP_PKEY_derive(ctx, shared, &sn) != 1 || sn != sizeof shared)
        goto out;
    static const uint8_t zero[32];
    if (zz_ct_equal(shared, zero, sizeof shared))
        goto out; /* a low-order point: no secret at all */
    uint8_t info[12 + 2 + 12] = "zz-epoch-mac";
    uint32_t lo = a < b ? a : b, hi = a < b ? b : a;
    uint8_t *p = info + 12;
    p[0] = (uint8_t)(svc >> 8);
    p[1] = (uint8_t)svc;
    for (int i = 0; i < 4; i++) {
        p[2 + i] = (uint8_t)(lo >> (24 - 8 * i));
        p[6 + i] = (uint8_t)(hi >> (24 - 8 * i));
        p[10 + i] = (uint8_t)(epoch >> (24 - 8 * i));
    }
    zz_mackey *k = zz_mackey_new(shared);
    if (!k)
        goto out;
    zz_hmac(k, info, sizeof info, out);
    zz_mackey_free(k);
    rc = 0;
out:
    OPENSSL_cleanse(seed, sizeof seed);
    OPENSSL_cleanse(h, sizeof h);
    OPENSSL_cleanse(shared, sizeof shared);
    EVP_PKEY_CTX_free(ctx);
    EVP_PKEY_free(priv);
    EVP_PKEY_free(peer);
    return rc;
}
