/* test_log.c - unit tests of log.c: every zz-agreed log line starts with its UTC time,
 * ISO 8601 with milliseconds, and is written whole (a long line too, a missing '\n' added). */
#include <stdlib.h>

#include "log.h"
#include "testutil.h"

/* What zz_log_at wrote to a temporary file, NUL-terminated; the caller frees it. */
static char *logged(const struct timespec *ts, const char *text)
{
    FILE *f = tmpfile();
    if (!f)
        return NULL;
    zz_log_at(f, ts, "%s", text);
    long n = ftell(f);
    rewind(f);
    char *buf = calloc(1, (size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    return buf;
}

int main(void)
{
    tctx t = {0};

    t_begin(&t, "stamp: UTC, milliseconds, 24 characters");
    {
        /* 2025-01-31 12:34:56 UTC; 789.9 ms is 789 (truncated, never rounded up to 790). */
        struct timespec ts = {.tv_sec = 1738326896, .tv_nsec = 789900000};
        char buf[64];
        CHECK(&t, zz_log_stamp(buf, sizeof buf, &ts) == ZZ_LOG_STAMP_LEN);
        CHECK(&t, strcmp(buf, "2025-01-31T12:34:56.789Z") == 0);
        ts.tv_sec = 0, ts.tv_nsec = 0;
        CHECK(&t, zz_log_stamp(buf, sizeof buf, &ts) == ZZ_LOG_STAMP_LEN);
        CHECK(&t, strcmp(buf, "1970-01-01T00:00:00.000Z") == 0);
        CHECK(&t, zz_log_stamp(buf, ZZ_LOG_STAMP_LEN, &ts) == 0); /* no room for the NUL */
    }
    t_end(&t);

    t_begin(&t, "a line: the stamp, a space, the text, one newline");
    {
        struct timespec ts = {.tv_sec = 1738326896, .tv_nsec = 5000000};
        char *a = logged(&ts, "zz-agreed: replica 1: hello\n");
        CHECK(&t, a && strcmp(a, "2025-01-31T12:34:56.005Z zz-agreed: replica 1: hello\n") == 0);
        free(a);
        char *b = logged(&ts, "no newline");
        CHECK(&t, b && strcmp(b, "2025-01-31T12:34:56.005Z no newline\n") == 0);
        free(b);
    }
    t_end(&t);

    t_begin(&t, "a line longer than the stack buffer is written whole");
    {
        struct timespec ts = {.tv_sec = 1738326896, .tv_nsec = 0};
        size_t n = 5000;
        char *text = malloc(n + 2);
        CHECK(&t, text != NULL);
        if (text) {
            memset(text, 'x', n);
            text[n] = '\n';
            text[n + 1] = '\0';
            char *a = logged(&ts, text);
            CHECK(&t, a && strlen(a) == ZZ_LOG_STAMP_LEN + 1 + n + 1);
            CHECK(&t, a && strncmp(a, "2025-01-31T12:34:56.000Z xxx", 28) == 0);
            CHECK(&t, a && a[ZZ_LOG_STAMP_LEN + n] == 'x' && a[ZZ_LOG_STAMP_LEN + 1 + n] == '\n');
            free(a);
            free(text);
        }
    }
    t_end(&t);

    return t_summary(&t);
}
