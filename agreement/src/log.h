/* log.h - zz-agreed's log lines: every one goes through zz_log, which puts its UTC time in
 * front (ISO 8601 with milliseconds), so the replicas' logs line up with each other and with
 * controld's and the runtimes' without guessing time zones. */
#ifndef ZZ_LOG_H
#define ZZ_LOG_H

#include <stdarg.h>
#include <stdio.h>
#include <time.h>

/* "2025-01-31T12:34:56.789Z": 24 characters. */
#define ZZ_LOG_STAMP_LEN 24

/* One log line to stderr: "<UTC time> " and the printf-formatted text, which ends in '\n'
 * as the fprintf(stderr, ...) it replaces did (one is added when it does not). The line is
 * formatted first and written with one fwrite, so it is never split by another writer. */
void zz_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* The same to `out` at time `ts` (tests). Returns the bytes written, -1 on error. */
int zz_log_at(FILE *out, const struct timespec *ts, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
int zz_vlog_at(FILE *out, const struct timespec *ts, const char *fmt, va_list ap)
    __attribute__((format(printf, 3, 0)));

/* Writes the stamp of `ts` into buf (cap >= ZZ_LOG_STAMP_LEN + 1); returns its length, 0 if
 * the time cannot be converted. */
size_t zz_log_stamp(char *buf, size_t cap, const struct timespec *ts);

#endif
