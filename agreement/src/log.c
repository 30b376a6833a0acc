/* log.c - zz_log: zz-agreed's one way to write a log line, with its UTC time in front. */
#include "log.h"

#include <stdlib.h>
#include <string.h>

size_t zz_log_stamp(char *buf, size_t cap, const struct timespec *ts)
{
    struct tm tm;
    time_t secs = ts->tv_sec;
    if (cap < ZZ_LOG_STAMP_LEN + 1 || !gmtime_r(&secs, &tm))
        return 0;
    size_t n = strftime(buf, cap, "%Y-%m-%dT%H:%M:%S", &tm);
    if (n == 0)
        return 0;
    long ms = ts->tv_nsec / 1000000;
    if (ms < 0 || ms > 999)
        ms = 0;
    int k = snprintf(buf + n, cap - n, ".%03ldZ", ms);
    return k > 0 && (size_t)k < cap - n ? n + (size_t)k : 0;
}

int zz_vlog_at(FILE *out, const struct timespec *ts, const char *fmt, va_list ap)
{
    char stack[1024];
    char *line = stack;
    size_t cap = sizeof stack;
    size_t head = zz_log_stamp(line, cap, ts);
    line[head++] = ' ';
    va_list again;
    va_copy(again, ap);
    int len = vsnprintf(line + head, cap - head, fmt, ap);
    if (len < 0) {
        va_end(again);
        return -1;
    }
    /* Room for the text, a '\n' that may be missing and the NUL. */
    size_t need = head + (size_t)len + 2;
    if (need > cap) {
        char *big = malloc(need);
        if (!big) {
            va_end(again);
            /* Out of memory: the stamp and the text as far as it fits, rather than nothing. */
            line[cap - 2] = '\n';
            line[cap - 1] = '\0';
            return fputs(line, out) < 0 ? -1 : (int)(cap - 1);
        }
        memcpy(big, line, head);
        vsnprintf(big + head, need - head, fmt, again);
        line = big;
    }
    va_end(again);
    size_t total = head + (size_t)len;
    if (total == head || line[total - 1] != '\n')
        line[total++] = '\n';
    size_t wrote = fwrite(line, 1, total, out);
    if (line != stack)
        free(line);
    return wrote == total ? (int)total : -1;
}

int zz_log_at(FILE *out, const struct timespec *ts, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = zz_vlog_at(out, ts, fmt, ap);
    va_end(ap);
    return n;
}

void zz_log(const char *fmt, ...)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0)
        ts.tv_sec = 0, ts.tv_nsec = 0;
    va_list ap;
    va_start(ap, fmt);
    zz_vlog_at(stderr, &ts, fmt, ap);
    va_end(ap);
}
