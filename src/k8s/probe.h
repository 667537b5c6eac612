/* src/k8s/probe.h: a small HTTP/1.1 server for the operator's /metrics,
 * /healthz and /readyz: GET only, one request per connection, answered
 * by a callback. Scrapes and probes are rare and tiny, so one thread
 * serves every connection, none of them able to block it: sockets are
 * non-blocking, each client has a short deadline, and when the slots are
 * full the oldest idle connection makes room for the new one. A /healthz
 * is answered at once however many idle connections are open. */
#ifndef COHORT_PROBE_H
#define COHORT_PROBE_H

#include <stdbool.h>
#include <stddef.h>

struct probe;

/* The answer to one GET. `body` is a buffer of `cap` bytes to fill with
 * text; set `code` (200 by default) and `len`. */
struct probe_reply {
    int code;
    const char *content_type;   /* default "text/plain; charset=utf-8" */
    char *body;
    size_t len, cap;
};

/* Called on the server's thread for each GET; `path` excludes the query. */
typedef void (*probe_fn)(void *arg, const char *path, struct probe_reply *r);

/* Listens on `listen` ("host:port", port 0 picks one) and serves until
 * probe_stop(). `arg` is borrowed. Returns 0, -EINVAL (bad address),
 * -EADDRINUSE, -ENOMEM, -EAGAIN. The caller frees with probe_stop(). */
int probe_start(const char *listen, probe_fn fn, void *arg, struct probe **out);
/* The bound port. */
int probe_port(const struct probe *p);
void probe_stop(struct probe *p);          /* NULL is fine */

/* Reads the request line of one complete request: what a client sent up
 * to its blank line, NUL-terminated. Returns 200 with the path, without
 * its query, in path[0..cap); 405 for a method other than GET and HEAD;
 * 400 for an empty path or one that does not fit in cap bytes with its
 * NUL. *head says whether the method is HEAD. Pure: the server's own
 * parser, so that tests/fuzz can call it. */
int probe_parse_request(const char *req, char *path, size_t cap, bool *head);

/* Appends printf-style text to r->body, truncating at r->cap. */
void probe_printf(struct probe_reply *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
