/* test_crypto.c - known-answer tests for crypto.c: SHA-256, HMAC-SHA-256 (RFC 4231) and
 * Ed25519 (RFC 8032), plus a timing of one HMAC over a 60-byte message. */
#include <stdlib.h>
#include <time.h>

#include "crypto.h"
#include "testutil.h"

static int hex_eq(const uint8_t *got, size_t n, const char *want_hex)
{
    char buf[2 * 128 + 1];
    if (n > 128)
        return 0;
    t_hex(got, n, buf);
    if (strcmp(buf, want_hex) != 0) {
        printf("  got  %s\n  want %s\n", buf, want_hex);
        return 0;
    }
    return 1;
}

static void test_sha256(tctx *t)
{
    uint8_t d[32];
    t_begin(t, "sha256 abc");
    zz_sha256("abc", 3, d);
    CHECK(t, hex_eq(d, 32, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"));
    zz_sha256("", 0, d);
    CHECK(t, hex_eq(d, 32, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"));
    t_end(t);
}

/* zz_mackey_new takes exactly 32 bytes. RFC 4231 keys shorter than that are equivalent to
 * themselves zero-padded (HMAC pads to the block size anyway); keys longer than the block
 * are equivalent to their SHA-256. So every case maps onto a 32-byte key exactly. */
static void hmac_case(tctx *t, const char *name, const uint8_t *key, size_t klen,
                      const uint8_t *data, size_t dlen, const char *want, size_t want_len)
{
    uint8_t k32[32] = {0}, mac[32];
    t_begin(t, name);
    if (klen > 64)
        zz_sha256(key, klen, k32);
    else if (klen <= 32)
        memcpy(k32, key, klen);
    else {
        CHECK(t, !"RFC 4231 key between 33 and 64 bytes cannot map to a 32-byte key");
        t_end(t);
        return;
    }
    zz_mackey *k = zz_mackey_new(k32);
    CHECK(t, k != NULL);
    if (k) {
        zz_hmac(k, data, dlen, mac);
        CHECK(t, hex_eq(mac, want_len, want));
        /* the key must be reusable: a second MAC with the same key gives the same result */
        uint8_t mac2[32];
        zz_hmac(k, data, dlen, mac2);
        CHECK(t, memcmp(mac, mac2, 32) == 0);
        /* and any change to the data changes the MAC */
        if (dlen) {
            uint8_t *d2 = malloc(dlen);
            memcpy(d2, data, dlen);
            d2[dlen - 1] ^= 1;
            zz_hmac(k, d2, dlen, mac2);
            CHECK(t, memcmp(mac, mac2, 32) != 0);
            free(d2);
        }
    }
    zz_mackey_free(k);
    t_end(t);
}

static void test_hmac(tctx *t)
{
    uint8_t key[131], data[152];
    memset(key, 0x0b, 20);
    hmac_case(t, "hmac rfc4231 case 1", key, 20, (const uint8_t *)"Hi There", 8,
              "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7", 32);
    hmac_case(t, "hmac rfc4231 case 2", (const uint8_t *)"Jefe", 4,
              (const uint8_t *)"what do ya want for nothing?", 28,
              "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843", 32);
    memset(key, 0xaa, 20);
    memset(data, 0xdd, 50);
    hmac_case(t, "hmac rfc4231 case 3", key, 20, data, 50,
              "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe", 32);
    for (int i = 0; i < 25; i++)
        key[i] = (uint8_t)(i + 1);
    memset(data, 0xcd, 50);
    hmac_case(t, "hmac rfc4231 case 4", key, 25, data, 50,
              "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b", 32);
    memset(key, 0x0c, 20);
    hmac_case(t, "hmac rfc4231 case 5 (truncated)", key, 20,
              (const uint8_t *)"Test With Truncation", 20, "a3b6167473100ee06e0c796c2955552b", 16);
    memset(key, 0xaa, 131);
    const char *d6 = "Test Using Larger Than Block-Size Key - Hash Key First";
    hmac_case(t, "hmac rfc4231 case 6", key, 131, (const uint8_t *)d6, strlen(d6),
              "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54", 32);
    const char *d7 = "This is a test using a larger than block-size key and a larger than "
                     "block-size data. The key needs to be hashed before being used by the "
                     "HMAC algorithm.";
    hmac_case(t, "hmac rfc4231 case 7", key, 131, (const uint8_t *)d7, strlen(d7),
              "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2", 32);
}

static void ed25519_case(tctx *t, const char *name, const char *seed_hex, const char *pub_hex,
                         const char *msg_hex, const char *sig_hex)
{
    uint8_t seed[32], pub[32], want_pub[32], msg[64];
    t_begin(t, name);
    long mlen = t_unhex(msg_hex, strlen(msg_hex), msg, sizeof msg);
    CHECK(t, t_unhex(seed_hex, 64, seed, 32) == 32);
    CHECK(t, t_unhex(pub_hex, 64, want_pub, 32) == 32);
    CHECK(t, mlen >= 0);
    zz_signkey *sk = zz_signkey_new(seed);
    zz_pubkey *pk = zz_pubkey_new(want_pub);
    CHECK(t, sk != NULL && pk != NULL);
    if (sk && pk && mlen >= 0) {
        zz_signkey_public(sk, pub);
        CHECK(t, memcmp(pub, want_pub, 32) == 0);
        zz_buf b;
        zz_buf_init(&b);
        uint8_t sig[64];
        CHECK(t, t_unhex(sig_hex, 128, sig, 64) == 64);
        /* A real signed message round trip. */
        uint8_t state[32] = {1, 2, 3};
        size_t s = zz_enc_checkpoint(&b, 7, 3, 128, state);
        CHECK(t, zz_auth_sign(&b, s, sk) == 0);
        zz_msg m;
        CHECK(t, zz_decode(b.p, b.len, &m) == ZZ_OK);
        CHECK(t, zz_verify_sig(&m, pk) == 1);
        b.p[b.len - 1] ^= 0x40;
        CHECK(t, zz_verify_sig(&m, pk) == 0);
        zz_buf_free(&b);
        /* The RFC answer itself: zz_verify_sig only looks at raw[0, authed_len) and the
         * 64-byte auth, so a hand-built zz_msg carries the RFC message and signature. */
        zz_msg fake;
        memset(&fake, 0, sizeof fake);
        uint8_t raw[64 + 64];
        memcpy(raw, msg, (size_t)mlen);
        memcpy(raw + mlen, sig, 64);
        fake.auth_kind = ZZ_AUTH_SIG;
        fake.raw = raw;
        fake.raw_len = (uint32_t)mlen + 64;
        fake.authed_len = (uint32_t)mlen;
        fake.auth = raw + mlen;
        fake.auth_len = 64;
        CHECK(t, zz_verify_sig(&fake, pk) == 1);
        raw[mlen + 5] ^= 1;
        CHECK(t, zz_verify_sig(&fake, pk) == 0);
    }
    zz_signkey_free(sk);
    zz_pubkey_free(pk);
    t_end(t);
}

static void test_ed25519(tctx *t)
{
    ed25519_case(t, "ed25519 rfc8032 test 1",
                 "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60",
                 "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a", "",
                 "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e06522490155"
                 "5fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b");
    ed25519_case(t, "ed25519 rfc8032 test 2",
                 "4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb",
                 "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c", "72",
                 "92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da"
                 "085ac1e43e15996e458f3613d0f11d8c387b2eaeb4302aeeb00d291612bb0c00");
}

/* Pure Ed25519 is deterministic (RFC 8032 §5.1.6), so two signatures of one message by
 * one key must be identical; and another key's public part must not verify it. */
static void test_sign_deterministic(tctx *t)
{
    uint8_t seed[32] = {9}, pub[32], d[32] = {0};
    t_begin(t, "ed25519 deterministic and key-bound");
    zz_signkey *sk = zz_signkey_new(seed);
    seed[0] = 10;
    zz_signkey *other = zz_signkey_new(seed);
    CHECK(t, sk && other);
    if (sk && other) {
        zz_buf a, b;
        zz_buf_init(&a);
        zz_buf_init(&b);
        size_t sa = zz_enc_checkpoint(&a, 1, 0, 5, d);
        size_t sb = zz_enc_checkpoint(&b, 1, 0, 5, d);
        CHECK(t, zz_auth_sign(&a, sa, sk) == 0 && zz_auth_sign(&b, sb, sk) == 0);
        CHECK(t, a.len == b.len && memcmp(a.p, b.p, a.len) == 0);
        zz_signkey_public(other, pub);
        zz_pubkey *opk = zz_pubkey_new(pub);
        zz_msg m;
        CHECK(t, zz_decode(a.p, a.len, &m) == ZZ_OK);
        CHECK(t, opk && zz_verify_sig(&m, opk) == 0); /* wrong signer's key */
        zz_pubkey_free(opk);
        zz_buf_free(&a);
        zz_buf_free(&b);
    }
    zz_signkey_free(sk);
    zz_signkey_free(other);
    t_end(t);
}

static void test_ct_equal(tctx *t)
{
    t_begin(t, "ct_equal");
    CHECK(t, zz_ct_equal("abcd", "abcd", 4) == 1);
    CHECK(t, zz_ct_equal("abcd", "abce", 4) == 0);
    CHECK(t, zz_ct_equal("xbcd", "abcd", 4) == 0);
    CHECK(t, zz_ct_equal("", "", 0) == 1);
    t_end(t);
}

/* Not a pass/fail criterion (timing depends on the build), but printed so that the cost
 * of a MAC is visible; the -O2 figure is the one that matters. */
static void bench_hmac(void)
{
    uint8_t key[32] = {1}, msg[60] = {2}, mac[32];
    zz_mackey *k = zz_mackey_new(key);
    if (!k)
        return;
    const int n = 200000;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < n; i++) {
        zz_hmac(k, msg, sizeof msg, mac);
        msg[0] = mac[0]; /* data dependency keeps the loop honest */
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    double ns = ((double)(b.tv_sec - a.tv_sec) * 1e9 + (double)(b.tv_nsec - a.tv_nsec)) / n;
    printf("bench: %.0f ns per HMAC-SHA-256 of a 60-byte message\n", ns);
    zz_mackey_free(k);
}

int main(void)
{
    tctx t = {0};
    test_sha256(&t);
    test_hmac(&t);
    test_ed25519(&t);
    test_sign_deterministic(&t);
    test_ct_equal(&t);
    bench_hmac();
    return t_summary(&t);
}
