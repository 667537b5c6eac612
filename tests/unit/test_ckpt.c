/* tests/unit/test_ckpt.c: checkpoint files: written whole or not at all,
 * every kind of damage detected and set aside, the newest valid one
 * loaded, retention, and the writer thread. */
#include <criterion/criterion.h>

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "accumulator/ckpt.h"
#include "base/clock.h"

#define PB 4096         /* parameter bytes */
#define BB 64           /* buffer bytes */

static char dir[] = "/tmp/cohort-ckpt-XXXXXX";
static const struct ckpt_layout layout = { .cohort = "c1", .params_bytes = PB, .buffers_bytes = BB };

static void make_dir(void)
{
    cr_assert_not_null(mkdtemp(dir));
}

static void remove_dir(void)
{
    char cmd[128];

    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    /* A .fini cannot fail a test (docs/architecture.md, Tests): say it. */
    if (system(cmd) != 0)
        fprintf(stderr, "%s: could not remove %s\n", __FILE__, dir);
    strcpy(dir + strlen(dir) - 6, "XXXXXX");
}

TestSuite(ckpt, .init = make_dir, .fini = remove_dir);

/* Parameters and buffers that say which version they belong to. */
static void fill(uint8_t *params, uint8_t *buffers, uint64_t version)
{
    for (size_t i = 0; i < PB; i++)
        params[i] = (uint8_t)(version * 31 + i);
    for (size_t i = 0; i < BB; i++)
        buffers[i] = (uint8_t)(version * 7 + i);
}

static void write_version(uint64_t version, unsigned keep)
{
    uint8_t params[PB], buffers[BB];
    char state[32];
    uint64_t bytes = 0;

    fill(params, buffers, version);
    snprintf(state, sizeof(state), "state-%" PRIu64, version);
    struct ckpt_parts p = { .version = version, .params = params, .buffers = buffers,
                            .state = state, .state_len = strlen(state) };
    cr_assert_eq(ckpt_write(dir, &layout, &p, keep, &bytes), 0);
    cr_assert_eq(bytes, CKPT_HEADER_BYTES + PB + BB + strlen(state) + 32);
}

static void path_of(char *buf, size_t cap, uint64_t version, const char *tail)
{
    snprintf(buf, cap, "%s/ckpt-%020" PRIu64 ".cohort%s", dir, version, tail);
}

static bool exists(uint64_t version, const char *tail)
{
    char p[256];
    struct stat st;

    path_of(p, sizeof(p), version, tail);
    return stat(p, &st) == 0;
}

/* Loads and checks that version `want` came back whole. */
static void expect_load(uint64_t above, uint64_t want, struct ckpt_loaded *got)
{
    uint8_t params[PB], buffers[BB], wp[PB], wb[BB];
    char state[32];

    cr_assert_eq(ckpt_load(dir, &layout, above, params, buffers, got), 0);
    cr_assert_eq(got->version, want);
    fill(wp, wb, want);
    cr_assert_arr_eq(params, wp, PB);
    cr_assert_arr_eq(buffers, wb, BB);
    snprintf(state, sizeof(state), "state-%" PRIu64, want);
    cr_assert_eq(got->state_len, strlen(state));
    cr_assert_arr_eq(got->state, state, got->state_len);
    free(got->state);
}

static void damage(uint64_t version, long offset, bool truncate_it)
{
    char p[256];
    int fd;

    path_of(p, sizeof(p), version, "");
    fd = open(p, O_RDWR);
    cr_assert_geq(fd, 0);
    if (truncate_it) {
        struct stat st;
        cr_assert_eq(fstat(fd, &st), 0);
        cr_assert_eq(ftruncate(fd, st.st_size - 1), 0);
    } else {
        uint8_t b;
        cr_assert_eq(pread(fd, &b, 1, offset), 1);
        b ^= 0x40;
        cr_assert_eq(pwrite(fd, &b, 1, offset), 1);
    }
    close(fd);
}

Test(ckpt, newest_valid_is_loaded_whole)
{
    struct ckpt_loaded got;

    write_version(10, 3);
    write_version(20, 3);
    expect_load(0, 20, &got);
    cr_assert_eq(got.n_skipped, 0);
    cr_assert_eq(ckpt_newest_version(dir), 20);
}

Test(ckpt, nothing_above_the_version_is_enoent_and_touches_nothing)
{
    uint8_t params[PB], buffers[BB];
    struct ckpt_loaded got;

    memset(params, 0xAB, PB);
    memset(buffers, 0xCD, BB);
    cr_assert_eq(ckpt_load(dir, &layout, 0, params, buffers, &got), -ENOENT);   /* empty */
    write_version(10, 3);
    cr_assert_eq(ckpt_load(dir, &layout, 10, params, buffers, &got), -ENOENT);
    for (size_t i = 0; i < PB; i++)
        cr_assert_eq(params[i], 0xAB);
    cr_assert_eq(ckpt_load("/nonexistent/cohort-ckpt", &layout, 0, params, buffers, &got),
                 -ENOENT);
}

Test(ckpt, a_flipped_byte_anywhere_is_a_checksum_mismatch_and_the_older_one_is_used)
{
    /* In the parameters, the buffers, the opaque state, the checksum. */
    const long offsets[] = { CKPT_HEADER_BYTES + 5, CKPT_HEADER_BYTES + PB + 3,
                             CKPT_HEADER_BYTES + PB + BB + 1, CKPT_HEADER_BYTES + PB + BB + 9 };

    for (size_t k = 0; k < sizeof(offsets) / sizeof(offsets[0]); k++) {
        struct ckpt_loaded got;
        uint64_t bad = 100 + k * 10;

        write_version(bad - 5, 5);
        write_version(bad, 5);
        damage(bad, offsets[k], false);
        expect_load(0, bad - 5, &got);
        cr_assert_eq(got.n_skipped, 1);
        cr_assert_eq(got.skipped[0].version, bad);
        cr_assert_eq(got.skipped[0].reason, CKPT_CHECKSUM, "offset %ld", offsets[k]);
        /* Set aside, so neither read again nor counted by retention. */
        cr_assert(!exists(bad, ""));
        cr_assert(exists(bad, ".skipped"));
        expect_load(0, bad - 5, &got);
        cr_assert_eq(got.n_skipped, 0);
    }
}

Test(ckpt, truncated_header_damage_and_strangers_are_told_apart)
{
    struct ckpt_loaded got;
    struct ckpt_layout other = layout;
    uint8_t params[PB + 8], buffers[BB];

    write_version(1, 10);
    write_version(2, 10);
    write_version(3, 10);
    write_version(4, 10);
    damage(4, 0, true);         /* one byte short */
    damage(3, 9, false);        /* the format */
    expect_load(0, 2, &got);
    cr_assert_eq(got.n_skipped, 2);
    cr_assert_eq(got.skipped[0].version, 4);
    cr_assert_eq(got.skipped[0].reason, CKPT_TRUNCATED);
    cr_assert_eq(got.skipped[1].version, 3);
    cr_assert_eq(got.skipped[1].reason, CKPT_HEADER);

    /* Another model, then another cohort: refused, and set aside. */
    other.params_bytes = PB + 8;
    cr_assert_eq(ckpt_load(dir, &other, 0, params, buffers, &got), -ENOENT);
    cr_assert_eq(got.skipped[0].version, 2);
    cr_assert_eq(got.skipped[0].reason, CKPT_LAYOUT);
    cr_assert_eq(got.skipped[1].reason, CKPT_LAYOUT);
    write_version(5, 10);
    other = layout;
    other.cohort = "c2";
    cr_assert_eq(ckpt_load(dir, &other, 0, params, buffers, &got), -ENOENT);
    cr_assert_eq(got.skipped[0].reason, CKPT_COHORT);
    cr_assert(exists(5, ".skipped"));
}

Test(ckpt, a_file_renamed_to_another_version_is_refused)
{
    char from[256], to[256];
    struct ckpt_loaded got;
    uint8_t params[PB], buffers[BB];

    write_version(7, 3);
    path_of(from, sizeof(from), 7, "");
    path_of(to, sizeof(to), 9, "");
    cr_assert_eq(rename(from, to), 0);
    cr_assert_eq(ckpt_load(dir, &layout, 0, params, buffers, &got), -ENOENT);
    cr_assert_eq(got.skipped[0].version, 9);
    cr_assert_eq(got.skipped[0].reason, CKPT_HEADER);
}

Test(ckpt, retention_keeps_the_newest_and_ignores_other_names)
{
    char stranger[256];
    FILE *f;

    snprintf(stranger, sizeof(stranger), "%s/ckpt-notaversion.cohort", dir);
    f = fopen(stranger, "w");
    cr_assert_not_null(f);
    fclose(f);
    for (uint64_t v = 1; v <= 6; v++)
        write_version(v, 2);
    for (uint64_t v = 1; v <= 4; v++)
        cr_assert(!exists(v, ""), "version %" PRIu64 " kept", v);
    cr_assert(exists(5, "") && exists(6, ""));
    cr_assert_eq(access(stranger, F_OK), 0);
}

Test(ckpt, bad_arguments_are_einval_and_write_nothing)
{
    uint8_t params[PB], buffers[BB];
    struct ckpt_parts p = { .version = 1, .params = params, .buffers = buffers };
    struct ckpt_layout long_name = layout;
    char name[80];

    cr_assert_eq(ckpt_write(dir, &layout, &p, 0, NULL), -EINVAL);
    cr_assert_eq(ckpt_write(dir, &layout, &p, CKPT_KEEP_MAX + 1, NULL), -EINVAL);
    p.state_len = 4;    /* without state */
    cr_assert_eq(ckpt_write(dir, &layout, &p, 1, NULL), -EINVAL);
    p.state_len = 0;
    memset(name, 'a', sizeof(name) - 1);
    name[sizeof(name) - 1] = '\0';
    long_name.cohort = name;
    cr_assert_eq(ckpt_write(dir, &long_name, &p, 1, NULL), -EINVAL);
    cr_assert_eq(ckpt_write("/nonexistent/cohort-ckpt", &layout, &p, 1, NULL), -ENOENT);
    cr_assert_eq(ckpt_newest_version(dir), 0);
}

Test(ckpt, writer_copies_at_submit_and_writes_off_the_callers_thread)
{
    struct ckpt_writer *w;
    struct ckpt_writer_stats st;
    struct ckpt_loaded got;
    uint8_t params[PB], buffers[BB];
    char sub[256], state[32] = "state-3";
    uint64_t deadline;
    char stale[300];
    FILE *f;

    /* A temporary a crashed writer left behind goes away. */
    snprintf(sub, sizeof(sub), "%s/a/b", dir);
    cr_assert_eq(ckpt_mkdirs(sub), 0);
    snprintf(stale, sizeof(stale), "%s/.ckpt-00000000000000000009.tmp-1", sub);
    f = fopen(stale, "w");
    cr_assert_not_null(f);
    fclose(f);
    cr_assert_eq(ckpt_writer_create(sub, &layout, 2, &w), 0);
    cr_assert_neq(access(stale, F_OK), 0);

    fill(params, buffers, 3);
    struct ckpt_parts p = { .version = 3, .params = params, .buffers = buffers,
                            .state = state, .state_len = strlen(state) };
    cr_assert_eq(ckpt_writer_submit(w, &p), 0);
    memset(params, 0, PB);      /* the caller may change them at once */
    deadline = clock_now_ms() + 30000;
    do {
        ckpt_writer_stats(w, &st);
    } while (st.written == 0 && clock_now_ms() < deadline && (clock_sleep_ms(5), true));
    cr_assert_eq(st.written, 1);
    cr_assert_eq(st.last_version, 3);
    cr_assert(!ckpt_writer_busy(w));
    ckpt_writer_destroy(w);

    {
        uint8_t lp[PB], lb[BB], wp[PB], wb[BB];
        cr_assert_eq(ckpt_load(sub, &layout, 0, lp, lb, &got), 0);
        fill(wp, wb, 3);
        cr_assert_arr_eq(lp, wp, PB);
        free(got.state);
    }
}

Test(ckpt, writer_refuses_a_second_copy_while_one_is_pending)
{
    struct ckpt_writer *w;
    uint8_t params[PB], buffers[BB];
    struct ckpt_parts p = { .version = 1, .params = params, .buffers = buffers };
    int second;

    fill(params, buffers, 1);
    cr_assert_eq(ckpt_writer_create(dir, &layout, 3, &w), 0);
    cr_assert_eq(ckpt_writer_submit(w, &p), 0);
    p.version = 2;
    second = ckpt_writer_submit(w, &p);
    /* Either the first is still being written (refused) or it finished. */
    cr_assert(second == -EBUSY || second == 0);
    ckpt_writer_destroy(w);     /* finishes what was submitted */
    cr_assert(exists(1, ""));
    cr_assert_eq(exists(2, ""), second == 0);
    p.state_len = 1;
    cr_assert_eq(ckpt_writer_create(dir, &layout, 0, &w), -EINVAL);
}

Test(ckpt, reasons_have_names)
{
    cr_assert_str_eq(ckpt_reason_str(CKPT_CHECKSUM), "checksum mismatch");
    cr_assert_str_eq(ckpt_reason_str(99), "unknown");
}
