/* src/base/log.c: see log.h. */
#include "base/log.h"

#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"

#define LINE_MAX_BYTES 4096     /* longer lines are cut, never split */
#define VALUE_MAX_BYTES 1024    /* a longer string value is cut and marked */

static _Atomic int cur_level = LOG_INFO;
static _Atomic int cur_format = LOG_TEXT;

static const char *const level_names[] = { "debug", "info", "warn", "error" };

void log_set_level(enum log_level level)
{
    atomic_store(&cur_level, (int)level);
}

void log_set_format(enum log_format format)
{
    atomic_store(&cur_format, (int)format);
}

enum log_level log_get_level(void)
{
    return (enum log_level)atomic_load(&cur_level);
}

bool log_enabled(enum log_level level)
{
    return (int)level >= atomic_load(&cur_level);
}

int log_parse_level(const char *s, enum log_level *out)
{
    for (int i = LOG_DEBUG; i <= LOG_ERROR; i++) {
        if (s && strcmp(s, level_names[i]) == 0) {
            *out = (enum log_level)i;
            return 0;
        }
    }
    return -EINVAL;
}

int log_parse_format(const char *s, enum log_format *out)
{
    if (s && strcmp(s, "text") == 0)
        *out = LOG_TEXT;
    else if (s && strcmp(s, "json") == 0)
        *out = LOG_JSON;
    else
        return -EINVAL;
    return 0;
}

const char *log_strerror(int err)
{
    if (err < 0)
        err = -err;
    /* strerrordesc_np is thread-safe and returns static text. */
    const char *s = strerrordesc_np(err);
    return s ? s : "unknown error";
}

/* A bounded line builder: appends past the end are dropped, and the line is
 * marked cut, so a huge field can never overflow or split a line. */
struct line {
    char buf[LINE_MAX_BYTES];
    size_t len;
    bool cut;
};

static void put(struct line *l, const char *s, size_t n)
{
    size_t room = sizeof(l->buf) - 2 - l->len;  /* keep room for "\n" */

    if (n > room) {
        n = room;
        l->cut = true;
    }
    memcpy(l->buf + l->len, s, n);
    l->len += n;
}

static void puts_(struct line *l, const char *s)
{
    put(l, s, strlen(s));
}

static void putf(struct line *l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void putf(struct line *l, const char *fmt, ...)
{
    char tmp[64];
    va_list ap;
    int n;

    va_start(ap, fmt);
    n = vsnprintf(tmp, sizeof(tmp), fmt, ap);
    va_end(ap);
    if (n > 0)
        put(l, tmp, (size_t)n < sizeof(tmp) ? (size_t)n : sizeof(tmp) - 1);
}

/* Values come from the network too (ids, addresses, peers' messages), so
 * each is cut at VALUE_MAX_BYTES with a marker: one hostile field cannot
 * crowd out the rest of the line or end it mid-token. */
static void put_json_string(struct line *l, const char *s)
{
    const unsigned char *end = (const unsigned char *)s + strnlen(s, VALUE_MAX_BYTES);

    put(l, "\"", 1);
    for (const unsigned char *p = (const unsigned char *)s; p < end; p++) {
        if (*p == '"' || *p == '\\') {
            char esc[2] = { '\\', (char)*p };
            put(l, esc, 2);
        } else if (*p < 0x20) {
            putf(l, "\\u%04x", *p);
        } else {
            put(l, (const char *)p, 1);
        }
    }
    if (*end)
        puts_(l, "...");
    put(l, "\"", 1);
}

/* Text values are quoted only when they would otherwise be ambiguous. */
static void put_text_value(struct line *l, const char *s)
{
    bool plain = *s != '\0' && strnlen(s, VALUE_MAX_BYTES) < VALUE_MAX_BYTES;

    for (const char *p = s; plain && *p; p++)
        if (*p == ' ' || *p == '"' || *p == '=' || (unsigned char)*p < 0x20)
            plain = false;
    if (plain)
        puts_(l, s);
    else
        put_json_string(l, s);
}

static void put_timestamp(struct line *l)
{
    uint64_t ms = clock_wall_ms();
    time_t secs = (time_t)(ms / 1000);
    struct tm tm;
    char tmp[32];

    gmtime_r(&secs, &tm);
    strftime(tmp, sizeof(tmp), "%Y-%m-%dT%H:%M:%S", &tm);
    puts_(l, tmp);
    putf(l, ".%03uZ", (unsigned)(ms % 1000));
}

void log_emit(enum log_level level, const char *component, const char *msg, ...)
{
    struct line l = { .len = 0, .cut = false };
    bool json = atomic_load(&cur_format) == LOG_JSON;
    va_list ap;

    if (!log_enabled(level))
        return;
    if (json) {
        puts_(&l, "{\"ts\":\"");
        put_timestamp(&l);
        putf(&l, "\",\"level\":\"%s\",\"component\":", level_names[level]);
        put_json_string(&l, component);
        puts_(&l, ",\"msg\":");
        put_json_string(&l, msg);
    } else {
        put_timestamp(&l);
        putf(&l, " %-5s ", level_names[level]);
        puts_(&l, component);
        puts_(&l, ": ");
        puts_(&l, msg);
    }

    va_start(ap, msg);
    for (;;) {
        struct log_field f = va_arg(ap, struct log_field);
        if (!f.key)
            break;
        if (json) {
            put(&l, ",", 1);
            put_json_string(&l, f.key);
            put(&l, ":", 1);
        } else {
            put(&l, " ", 1);
            puts_(&l, f.key);
            put(&l, "=", 1);
        }
        switch (f.type) {
        case LOG_T_STR:
            if (!f.s)
                puts_(&l, "null");
            else if (json)
                put_json_string(&l, f.s);
            else
                put_text_value(&l, f.s);
            break;
        case LOG_T_U64:
            putf(&l, "%llu", (unsigned long long)f.u);
            break;
        case LOG_T_I64:
            putf(&l, "%lld", (long long)f.i);
            break;
        case LOG_T_BOOL:
            puts_(&l, f.b ? "true" : "false");
            break;
        case LOG_T_END:
            break;
        }
    }
    va_end(ap);

    if (l.cut) {
        /* Make room for a valid ending: JSON must still parse. */
        l.len = l.len > 16 ? l.len - 16 : 0;
        l.cut = false;
        puts_(&l, json ? "\",\"cut\":true}" : " (cut)");
    } else if (json) {
        put(&l, "}", 1);
    }
    l.buf[l.len++] = '\n';
    /* One write: a line is atomic with respect to other writers. */
    ssize_t rc = write(STDERR_FILENO, l.buf, l.len);
    (void)rc;
}
