/* src/accumulator/ckpt.h: checkpoints of a cohort's state on a volume, so
 * that a cohort with no live member (suspended and resumed, every pod lost
 * at once) starts again where it was and not from model version 0.
 *
 * A checkpoint is one file, `ckpt-VVVVVVVVVVVVVVVVVVVV.cohort` (the model
 * version in 20 decimal digits, so names sort as versions do):
 *
 *   header, CKPT_HEADER_BYTES, integers little-endian:
 *     0   magic "COHORTCK"
 *     8   u32 format (CKPT_FORMAT)        12  u32 header bytes
 *     16  u64 model version               24  u64 parameter bytes
 *     32  u64 buffer bytes                40  u64 opaque state bytes
 *     48  u64 wall-clock ms when taken    56  cohort name, NUL-padded (64)
 *     120 u64 zero
 *   the parameters, the buffers, the opaque state (the trainer's, as
 *     cohort_set_state gave it);
 *   SHA-256 of everything before it (32 bytes).
 *
 * It is written to a temporary name in the same directory, fsynced,
 * renamed over its final name and the directory fsynced, so a reader sees
 * a whole file or none, whatever moment a crash picks. The checksum
 * catches what the rename cannot: a file truncated or damaged on the
 * volume afterwards. A file that fails any check is renamed aside
 * (`NAME.skipped`, kept for inspection) so that it neither hides newer
 * valid checkpoints from retention nor is read again.
 *
 * The writer copies the state when asked and writes on its own thread,
 * off the round path; it holds at most one copy at a time.
 */
#ifndef COHORT_CKPT_H
#define COHORT_CKPT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define CKPT_FORMAT 1u
#define CKPT_HEADER_BYTES 128u
#define CKPT_COHORT_BYTES 64u   /* a cohort name (IDENT_NAME_MAX) fits with its NUL */
#define CKPT_SKIPS_MAX 16u      /* skipped files one load reports */
#define CKPT_KEEP_MAX 1000u

/* Why a checkpoint file was skipped. */
enum ckpt_reason {
    CKPT_OK = 0,
    CKPT_TRUNCATED,     /* shorter (or longer) than its header says */
    CKPT_CHECKSUM,      /* the bytes are not those that were written */
    CKPT_HEADER,        /* not a checkpoint of a format this build reads */
    CKPT_LAYOUT,        /* another model: parameter or buffer sizes differ */
    CKPT_COHORT,        /* another cohort's */
    CKPT_IO,            /* could not be read */
};
#define CKPT_REASON_MAX CKPT_IO

/* "truncated", "checksum mismatch", ...; "unknown" past CKPT_REASON_MAX. */
const char *ckpt_reason_str(unsigned reason);

/* What a checkpoint must match to be this cohort's and this model's. */
struct ckpt_layout {
    const char *cohort;     /* borrowed */
    size_t params_bytes;
    size_t buffers_bytes;
};

/* What one checkpoint holds, borrowed for a write. */
struct ckpt_parts {
    uint64_t version;
    const void *params;
    const void *buffers;
    const void *state;
    size_t state_len;       /* at most LIMIT_STATE_BYTES */
};

/* Writes one checkpoint into `dir` (which must exist) as described
 * above, then removes all but the `keep` newest checkpoints (1 to
 * CKPT_KEEP_MAX). *bytes_out (may be NULL) gets the file's size. Returns 0,
 * -EINVAL, -ENAMETOOLONG, or the failing call's -errno (-ENOSPC, -EIO...);
 * a failed write leaves no file behind. */
int ckpt_write(const char *dir, const struct ckpt_layout *l, const struct ckpt_parts *p,
               unsigned keep, uint64_t *bytes_out);

/* What ckpt_load found. */
struct ckpt_loaded {
    uint64_t version;           /* of the checkpoint loaded */
    void *state;                /* its opaque state: the caller frees it */
    size_t state_len;
    uint64_t bytes;             /* the file's size */
    struct {
        uint64_t version;
        unsigned reason;        /* enum ckpt_reason */
    } skipped[CKPT_SKIPS_MAX];  /* newest first */
    size_t n_skipped;
};

/* Loads the newest valid checkpoint in `dir` whose version is above
 * `above` into params and buffers (l->params_bytes and l->buffers_bytes
 * bytes, borrowed), skipping (and renaming aside) every newer invalid
 * one. The file is verified whole before anything is written into params
 * or buffers, so they are left untouched unless 0 is returned. Returns 0;
 * -ENOENT when there is no valid one (a missing directory included:
 * out->skipped lists what was refused); -EIO when a verified file read
 * back differently (params and buffers then hold no valid model);
 * -ENOMEM; or the directory's -errno. */
int ckpt_load(const char *dir, const struct ckpt_layout *l, uint64_t above, void *params,
              void *buffers, struct ckpt_loaded *out);

/* The newest checkpoint's version by name alone (0: none). */
uint64_t ckpt_newest_version(const char *dir);

/* Creates `path` and its missing parents, mode 0700. Returns 0 or -errno. */
int ckpt_mkdirs(const char *path);

/* ---- the writer thread -------------------------------------------------- */

struct ckpt_writer;

struct ckpt_writer_stats {
    uint64_t written, failed;
    uint64_t last_version;      /* newest written (0: none) */
    uint64_t last_bytes;
    uint64_t last_us;           /* the last write's time, fsync and rename included */
    uint64_t total_bytes, total_us;
};

/* Starts a writer for `dir` (created if missing), keeping `keep`
 * checkpoints. `layout` is copied. Removes temporary files a crashed
 * writer left. Returns 0, -EINVAL, -ENOMEM, -EAGAIN, or mkdir's -errno.
 * The caller frees it with ckpt_writer_destroy(). */
int ckpt_writer_create(const char *dir, const struct ckpt_layout *layout, unsigned keep,
                       struct ckpt_writer **out);
/* Finishes the write in progress, then frees the writer. NULL is fine. */
void ckpt_writer_destroy(struct ckpt_writer *w);

/* True while a checkpoint is being written. */
bool ckpt_writer_busy(struct ckpt_writer *w);

/* Copies `p` (its sizes must be the layout's) and writes the copy on the
 * writer's thread. Returns 0, -EBUSY (a write is in progress: nothing is
 * copied), -EINVAL, -ENOMEM. */
int ckpt_writer_submit(struct ckpt_writer *w, const struct ckpt_parts *p);

void ckpt_writer_stats(struct ckpt_writer *w, struct ckpt_writer_stats *out);

#endif
