/* cli/run.h: what the files of `cohortctl run` share: its limits and
 * timings, the run, its peers and their children, and the functions one
 * part calls in another. run.c parses the flags and drives the loop;
 * run_schedule.c, run_supervise.c, run_view.c and run_verdict.c hold the
 * schedule, the children, what is shown while running, and the end. Only
 * those files include it. */
#ifndef COHORT_CLI_RUN_H
#define COHORT_CLI_RUN_H

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "base/ident.h"
#include "base/secret.h"

#define PROG "cohortctl run"
#define MAX_PEERS 256
#define TICK_MS 50
#define STATUS_EVERY_MS 500
#define STATUS_TIMEOUT_MS 1000
#define SOCKET_WAIT_MS 15000        /* a sidecar listens within this */
#define STOP_GRACE_MS 5000          /* SIGTERM, then SIGKILL */
#define RATE_WINDOW_MS 2000
#define RATE_SLOTS (RATE_WINDOW_MS / TICK_MS + 8)
#define LINE_MAX_TAIL 256           /* progress lines longer than this are skipped */
#define FINAL_MAX 256
#define DURATION_MAX_MS (7ull * 24 * 3600 * 1000)

enum action { A_KILL_TRAINER, A_KILL_SIDECAR, A_KILL_PEER, A_ADD };

/* One --schedule event. */
struct event {
    enum action action;
    bool by_version;
    uint64_t at;                /* ms since the start, or a model version */
    long peer;                  /* run index; -1 for add */
    char spec[64];
    bool fired;
    uint64_t fired_ms;          /* since the start */
    char note[160];
};

struct child {
    pid_t pid;                  /* 0: not started */
    bool running;
    int wstatus;
    uint64_t term_ms;           /* when we sent SIGTERM; 0: not sent */
    bool escalated;             /* we had to SIGKILL it after SIGTERM */
};

struct peer {
    unsigned index;
    char id[IDENT_NAME_MAX + 1];
    char sock[108];             /* sun_path's size */
    char out_path[PATH_MAX], err_path[PATH_MAX], sc_path[PATH_MAX];
    struct child trainer, sidecar;
    bool trainer_pending;       /* the sidecar runs; the trainer starts once it listens */
    uint64_t started_ms;
    const char *hit;            /* what the schedule killed, or NULL */
    char failure[192];          /* why this peer counts as failed; "" if it does not */
    /* The tail of the trainer's stderr, for its progress. */
    int err_fd;
    off_t err_off;
    char part[LINE_MAX_TAIL];
    size_t part_len;
    bool part_skip;
    bool has_samples;
    uint64_t samples, version;
    /* From the broker. */
    bool member;
    uint64_t broker_version;
    char final[FINAL_MAX];
};

struct run {
    /* Options. */
    unsigned n;
    const char *cohort, *prefix, *logf, *logl;
    uint64_t timeout_ms, heartbeat_ms, member_timeout_ms, view_ms;
    bool view, tty, json, keep;
    char **cmd;
    /* Where things are. */
    char sidecar[PATH_MAX], dir[PATH_MAX - 64], sockdir[64];
    /* A new directory under dir for each run, which every trainer gets
     * as $COHORT_RUN_DIR; emptied and removed when the run ends. */
    char shared[PATH_MAX];
    bool own_dir;
    char **env;
    /* Schedule and peers. */
    struct event *events;
    size_t n_events;
    struct peer *peers;
    size_t n_peers;
    /* The run's key: the embedded broker's, given to every sidecar in a
     * file of the run directory (removed at the end). */
    struct secret key;
    char key_path[PATH_MAX];
    bool key_written;
    /* The broker. */
    struct brokerd *bd;
    struct rpc_channel *ch;
    char broker[64];
    bool status_ok;
    uint64_t epoch, max_version;
    size_t n_members;
    char leader[IDENT_NAME_MAX + 1];
    /* The view. */
    uint64_t t0;
    struct rate_sample {
        uint64_t t, s;
    } hist[RATE_SLOTS];
    size_t hist_next;
    double rate;
    bool has_rate;
    unsigned view_lines;
    const char *stop_reason;    /* "timeout", "interrupted", or NULL */
};

/* How the run ended for its trainers. */
struct verdict {
    size_t survivors, failed, with_final;
    bool agree;                 /* survivors' "final" lines all equal */
    const char *final;          /* that line, or NULL */
};

/* ---- run.c ------------------------------------------------------------- */

/* snprintf that says when it cut: 0, or -ENAMETOOLONG. A cut note or
 * view line is harmless; callers that build paths check. */
int run_fmt_into(char *buf, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Seconds from the run's start to `now` (ms), for what is printed. */
double run_secs(const struct run *r, uint64_t now);

/* ---- run_schedule.c: --schedule ---------------------------------------- */

/* Parses a comma-separated list of ACTION@WHEN[:PEER] events. Returns 0
 * and sets *out (the caller frees it) and *n; 1 when out of memory; or
 * OPT_EXIT_USAGE after reporting which event is wrong. */
int run_parse_schedule(const char *spec, struct event **out, size_t *n);
/* Fires every event whose time or model version has come. */
void run_fire_due(struct run *r, uint64_t now);

/* ---- run_supervise.c: the children ------------------------------------- */

/* Our environment without the variables we set for each trainer (and the
 * broker address, which would let a trainer bypass its sidecar), with room
 * for `extra` of those at the end. The caller frees the array (the strings
 * are environ's). */
char **run_base_env(size_t extra, size_t *n_out);
/* Starts one more peer's sidecar; its trainer follows once the socket is
 * there (run_tend). Returns 0 or -errno after noting why. */
int run_start_peer(struct run *r, uint64_t now);
/* Collects children that exited and decides what each exit means. */
void run_reap(struct run *r, uint64_t now);
/* Starts trainers whose sidecars listen, and SIGKILLs sidecars that
 * ignored SIGTERM. */
void run_tend(struct run *r, uint64_t now);
bool run_trainers_left(const struct run *r);
/* Stops what is still running: trainers first (SIGTERM, then SIGKILL
 * after the grace), then sidecars. Bounded by two graces. */
void run_stop_all(struct run *r);
/* "running", "not started", "exit 1", "killed (SIGKILL)". */
void run_describe_child(const struct child *c, char *buf, size_t len);
bool run_exited_ok(const struct child *c);

/* ---- run_view.c: while it runs ----------------------------------------- */

/* A timestamped line on stderr, above the live view. */
void run_note(struct run *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Draws the live view: in place on a terminal, a plain line otherwise. */
void run_view_draw(struct run *r, uint64_t now);
/* Reads what the trainer wrote to stderr since the last call. */
void run_read_progress(struct peer *p);
/* Asks the broker for the cohort's epoch, leader and members. */
void run_poll_status(struct run *r);
/* samples/s over the last RATE_WINDOW_MS: the cohort's committed samples
 * (the highest count any trainer printed) sampled every tick. */
void run_update_rate(struct run *r, uint64_t now);

/* ---- run_verdict.c: the end -------------------------------------------- */

/* Reads each trainer's last line and fills *v: who survived, who failed,
 * and whether the survivors' "final" lines agree. */
void run_judge(struct run *r, struct verdict *v);
/* Why the run failed, or NULL when it did not. */
const char *run_reason(const struct run *r, const struct verdict *v);
/* The summary on stdout, as a table or one JSON object. */
void run_print_table(struct run *r, const struct verdict *v, uint64_t now);
void run_print_json(struct run *r, const struct verdict *v, uint64_t now);
/* Removes the files this run made in its directory, then the directory
 * (left alone if it holds anything else). */
void run_remove_files(struct run *r);
/* Empties and removes r->shared (files only: what the trainers left). */
void run_remove_shared(struct run *r);

#endif
