/* src/base/log.h: one log format for every cohort process.
 *
 * A line is a whole sentence plus typed fields, written to stderr with one
 * write(2) so that lines from threads and processes never interleave:
 *
 *   text: 2026-11-21T12:00:00.123Z info  broker: Member joined. cohort=demo id=a-0
 *   json: {"ts":"2026-11-21T12:00:00.123Z","level":"info","component":"broker",
 *          "msg":"Member joined.","cohort":"demo","id":"a-0"}
 *
 *   log_info("broker", "Member joined.", LF_S("cohort", c), LF_U("epoch", e));
 */
#ifndef COHORT_LOG_H
#define COHORT_LOG_H

#include <stdbool.h>
#include <stdint.h>

enum log_level { LOG_DEBUG, LOG_INFO, LOG_WARN, LOG_ERROR };
enum log_format { LOG_TEXT, LOG_JSON };

enum log_type { LOG_T_END, LOG_T_STR, LOG_T_U64, LOG_T_I64, LOG_T_BOOL };

struct log_field {
    const char *key;            /* borrowed; NULL ends the list */
    enum log_type type;
    union {
        const char *s;          /* borrowed; NULL prints as null */
        uint64_t u;
        int64_t i;
        bool b;
    };
};

#define LF_S(k, v) ((struct log_field){ .key = (k), .type = LOG_T_STR, .s = (v) })
#define LF_U(k, v) ((struct log_field){ .key = (k), .type = LOG_T_U64, .u = (uint64_t)(v) })
#define LF_I(k, v) ((struct log_field){ .key = (k), .type = LOG_T_I64, .i = (int64_t)(v) })
#define LF_B(k, v) ((struct log_field){ .key = (k), .type = LOG_T_BOOL, .b = (v) })
#define LF_ERR(e)  LF_S("error", log_strerror(e))
#define LOG_END    ((struct log_field){ .key = 0, .type = LOG_T_END })

/* Process-wide settings; call before starting threads. */
void log_set_level(enum log_level level);
void log_set_format(enum log_format format);
enum log_level log_get_level(void);
bool log_enabled(enum log_level level);

/* Parse "debug|info|warn|error" and "text|json". Return 0 or -EINVAL. */
int log_parse_level(const char *s, enum log_level *out);
int log_parse_format(const char *s, enum log_format *out);

/* strerror for our -errno convention, thread-safe (returns a static string). */
const char *log_strerror(int err);

/* `msg` and the fields are borrowed for the call. Use the macros below. */
void log_emit(enum log_level level, const char *component, const char *msg, ...);

#define log_debug(comp, ...) log_emit(LOG_DEBUG, comp, __VA_ARGS__, LOG_END)
#define log_info(comp, ...)  log_emit(LOG_INFO, comp, __VA_ARGS__, LOG_END)
#define log_warn(comp, ...)  log_emit(LOG_WARN, comp, __VA_ARGS__, LOG_END)
#define log_error(comp, ...) log_emit(LOG_ERROR, comp, __VA_ARGS__, LOG_END)

#endif
