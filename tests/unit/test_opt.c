/* tests/unit/test_opt.c: flag values: durations and counts, and what is
 * refused; usage errors, reported the one way every binary reports them. */
#include <criterion/criterion.h>
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "base/opt.h"

Test(opt, durations_with_units)
{
    uint64_t ms;

    cr_assert_eq(opt_duration_ms("250ms", 10000, &ms), 0);
    cr_assert_eq(ms, 250);
    cr_assert_eq(opt_duration_ms("1.5s", 10000, &ms), 0);
    cr_assert_eq(ms, 1500);
    cr_assert_eq(opt_duration_ms("2m", 1000000, &ms), 0);
    cr_assert_eq(ms, 120000);
    cr_assert_eq(opt_duration_ms("0ms", 10, &ms), 0);
    cr_assert_eq(ms, 0);
}

Test(opt, durations_refused)
{
    uint64_t ms = 7;

    cr_assert_eq(opt_duration_ms("5", 10000, &ms), -EINVAL);       /* no unit */
    cr_assert_eq(opt_duration_ms("-1s", 10000, &ms), -EINVAL);
    cr_assert_eq(opt_duration_ms("1x", 10000, &ms), -EINVAL);
    cr_assert_eq(opt_duration_ms("1.s", 10000, &ms), -EINVAL);
    cr_assert_eq(opt_duration_ms("", 10000, &ms), -EINVAL);
    cr_assert_eq(opt_duration_ms("11s", 10000, &ms), -ERANGE);
    cr_assert_eq(opt_duration_ms("99999999999999999999h", UINT64_MAX, &ms), -ERANGE);
    cr_assert_eq(ms, 7, "a refused value changes nothing");
}

Test(opt, unsigned_counts)
{
    uint64_t v = 9;

    cr_assert_eq(opt_uint("42", 1, 100, &v), 0);
    cr_assert_eq(v, 42);
    cr_assert_eq(opt_uint("0", 1, 100, &v), -ERANGE);
    cr_assert_eq(opt_uint("101", 1, 100, &v), -ERANGE);
    cr_assert_eq(opt_uint("4x", 1, 100, &v), -EINVAL);
    cr_assert_eq(opt_uint("-4", 1, 100, &v), -EINVAL);
    cr_assert_eq(opt_uint("18446744073709551616", 0, UINT64_MAX, &v), -ERANGE);
    cr_assert_eq(v, 42);
}

Test(opt, byte_counts)
{
    uint64_t v = 0;

    cr_assert_eq(opt_bytes("4096", 1ull << 40, &v), 0);
    cr_assert_eq(v, 4096);
    cr_assert_eq(opt_bytes("64K", 1ull << 40, &v), 0);
    cr_assert_eq(v, 64 << 10);
    cr_assert_eq(opt_bytes("1m", 1ull << 40, &v), 0);
    cr_assert_eq(v, 1 << 20);
    cr_assert_eq(opt_bytes("2GiB", 1ull << 40, &v), 0);
    cr_assert_eq(v, 2ull << 30);
    cr_assert_eq(opt_bytes("3KB", 1ull << 40, &v), 0);
    cr_assert_eq(v, 3 << 10);
    cr_assert_eq(opt_bytes("1G", 1ull << 30, &v), 0, "max itself is allowed");
}

Test(opt, byte_counts_refused)
{
    uint64_t v = 7;

    cr_assert_eq(opt_bytes("0", 100, &v), -EINVAL);
    cr_assert_eq(opt_bytes("0K", 100, &v), -EINVAL);
    cr_assert_eq(opt_bytes("", 100, &v), -EINVAL);
    cr_assert_eq(opt_bytes("K", 100, &v), -EINVAL);
    cr_assert_eq(opt_bytes("-1", 100, &v), -EINVAL);
    cr_assert_eq(opt_bytes("4 K", 1 << 20, &v), -EINVAL);
    cr_assert_eq(opt_bytes("4Ki", 1 << 20, &v), -EINVAL);
    cr_assert_eq(opt_bytes("4iB", 1 << 20, &v), -EINVAL, "a suffix needs a unit");
    cr_assert_eq(opt_bytes("4T", UINT64_MAX, &v), -EINVAL);
    cr_assert_eq(opt_bytes("101", 100, &v), -ERANGE);
    cr_assert_eq(opt_bytes("2G", 1ull << 30, &v), -ERANGE);
    cr_assert_eq(opt_bytes("18446744073709551616", UINT64_MAX, &v), -ERANGE);
    cr_assert_eq(opt_bytes("17179869184G", UINT64_MAX, &v), -ERANGE, "overflow in the unit");
    cr_assert_eq(v, 7, "a refused value changes nothing");
}

Test(opt, byte_lists)
{
    uint64_t v[3] = { 0 };
    size_t n = 0;

    cr_assert_eq(opt_bytes_list("4K,64M", 1ull << 30, v, 3, &n), 0);
    cr_assert_eq(n, 2);
    cr_assert_eq(v[0], 4096);
    cr_assert_eq(v[1], 64 << 20);
    cr_assert_eq(opt_bytes_list("1K,2K", 1ull << 30, v, 3, &n), -E2BIG, "appends, up to cap");
    cr_assert_eq(n, 2, "nothing appended on error");
    cr_assert_eq(opt_bytes_list("1K", 1ull << 30, v, 3, &n), 0);
    cr_assert_eq(n, 3);
    cr_assert_eq(v[2], 1024);

    n = 0;
    cr_assert_eq(opt_bytes_list("4K,,8K", 1ull << 30, v, 3, &n), -EINVAL);
    cr_assert_eq(opt_bytes_list("4K,", 1ull << 30, v, 3, &n), -EINVAL);
    cr_assert_eq(opt_bytes_list("4K,2G", 1ull << 30, v, 3, &n), -ERANGE);
    cr_assert_eq(opt_bytes_list("4K,123456789012345678901234567890123", 1ull << 30, v, 3, &n), -EINVAL);
    cr_assert_eq(n, 0);
}

/* ---- usage errors ------------------------------------------------------ */

/* stderr, redirected into a pipe between capture_begin and capture_end. */
struct capture {
    int fds[2], saved;
    char buf[4096];
};

static void capture_begin(struct capture *c)
{
    cr_assert_eq(pipe(c->fds), 0);
    c->saved = dup(STDERR_FILENO);
    dup2(c->fds[1], STDERR_FILENO);
}

static const char *capture_end(struct capture *c)
{
    ssize_t n;

    dup2(c->saved, STDERR_FILENO);
    close(c->saved);
    close(c->fds[1]);
    n = read(c->fds[0], c->buf, sizeof(c->buf) - 1);
    close(c->fds[0]);
    c->buf[n > 0 ? n : 0] = '\0';
    return c->buf;
}

static const struct option longopts[] = {
    { "name", required_argument, NULL, 'N' },
    { "flag", no_argument, NULL, 'f' },
    { "help", no_argument, NULL, 'h' },
    { NULL, 0, NULL, 0 },
};

/* Parses argv (NULL-terminated) to its first refusal or its end; returns
 * what opt_next returned last and leaves stderr's text in *err. */
static int parse(char **argv, struct capture *c, const char **err)
{
    int argc = 0, opt;

    while (argv[argc])
        argc++;
    optind = 0;                 /* glibc: start afresh on a new argv */
    capture_begin(c);
    while ((opt = opt_next("cohortctl thing", argc, argv, "n:h", longopts)) != -1 && opt != '?')
        ;
    *err = capture_end(c);
    return opt;
}

Test(opt, usage_error_names_the_command_and_its_help)
{
    struct capture c;
    const char *err;

    capture_begin(&c);
    cr_assert_eq(opt_usage("cohortctl thing", "bad --name \"%s\" (%d at most)", "x y", 3),
                 OPT_EXIT_USAGE);
    err = capture_end(&c);
    cr_assert_str_eq(err, "cohortctl thing: bad --name \"x y\" (3 at most)\n"
                          "Try 'cohortctl thing --help'.\n");
    cr_assert_eq(OPT_EXIT_USAGE, 2, "the exit status every binary documents");
}

Test(opt, next_passes_good_options_through_quietly)
{
    char *argv[] = { "thing", "-n", "3", "--flag", "--name=abc", "--", "rest", NULL };
    struct capture c;
    const char *err;
    int opt;

    optind = 0;
    capture_begin(&c);
    opt = opt_next("cohortctl thing", 7, argv, "n:h", longopts);
    cr_assert_eq(opt, 'n');
    cr_assert_str_eq(optarg, "3");
    cr_assert_eq(opt_next("cohortctl thing", 7, argv, "n:h", longopts), 'f');
    cr_assert_eq(opt_next("cohortctl thing", 7, argv, "n:h", longopts), 'N');
    cr_assert_str_eq(optarg, "abc");
    cr_assert_eq(opt_next("cohortctl thing", 7, argv, "n:h", longopts), -1);
    err = capture_end(&c);
    cr_assert_str_eq(err, "");
    cr_assert_eq(optind, 6, "stops after --");
    cr_assert_str_eq(argv[0], "thing", "argv[0] is restored");
}

Test(opt, next_reports_an_unknown_long_option)
{
    char *argv[] = { "thing", "--frobnicate", NULL };
    struct capture c;
    const char *err;

    cr_assert_eq(parse(argv, &c, &err), '?');
    cr_assert(strncmp(err, "cohortctl thing: ", 17) == 0, "%s", err);
    cr_assert(strstr(err, "--frobnicate"), "%s", err);
    cr_assert(strstr(err, "\nTry 'cohortctl thing --help'.\n"), "%s", err);
    cr_assert_str_eq(argv[0], "thing", "argv[0] is restored");
}

Test(opt, next_reports_an_unknown_short_option)
{
    char *argv[] = { "thing", "-x", NULL };
    struct capture c;
    const char *err;

    cr_assert_eq(parse(argv, &c, &err), '?');
    cr_assert(strncmp(err, "cohortctl thing: ", 17) == 0, "%s", err);
    cr_assert(strstr(err, "'x'"), "%s", err);
    cr_assert(strstr(err, "\nTry 'cohortctl thing --help'.\n"), "%s", err);
}

Test(opt, next_reports_a_missing_value)
{
    char *argv[] = { "thing", "--name", NULL };
    char *shortv[] = { "thing", "-n", NULL };
    struct capture c;
    const char *err;

    cr_assert_eq(parse(argv, &c, &err), '?');
    cr_assert(strncmp(err, "cohortctl thing: ", 17) == 0, "%s", err);
    cr_assert(strstr(err, "--name") && strstr(err, "requires an argument"), "%s", err);
    cr_assert(strstr(err, "\nTry 'cohortctl thing --help'.\n"), "%s", err);

    cr_assert_eq(parse(shortv, &c, &err), '?', "a short option's missing value too");
    cr_assert(strncmp(err, "cohortctl thing: ", 17) == 0, "%s", err);
    cr_assert(strstr(err, "\nTry 'cohortctl thing --help'.\n"), "%s", err);
}

Test(opt, next_reports_an_unwanted_value)
{
    char *argv[] = { "thing", "--flag=yes", NULL };
    struct capture c;
    const char *err;

    cr_assert_eq(parse(argv, &c, &err), '?');
    cr_assert(strncmp(err, "cohortctl thing: ", 17) == 0, "%s", err);
    cr_assert(strstr(err, "--flag"), "%s", err);
    cr_assert(strstr(err, "\nTry 'cohortctl thing --help'.\n"), "%s", err);
}

Test(opt, no_operands_refuses_the_first_one)
{
    char *argv[] = { "thing", "--flag", "stray", "more", NULL };
    struct capture c;
    const char *err;

    capture_begin(&c);
    cr_assert_eq(opt_no_operands("cohortctl thing", 4, argv, 4), 0);
    cr_assert_eq(opt_no_operands("cohortctl thing", 4, argv, 2), OPT_EXIT_USAGE);
    err = capture_end(&c);
    cr_assert_str_eq(err, "cohortctl thing: unexpected argument \"stray\"\n"
                          "Try 'cohortctl thing --help'.\n");
}

Test(opt, logging_values_refused_as_usage_errors)
{
    struct capture c;
    const char *err;

    capture_begin(&c);
    cr_assert_eq(opt_logging("cohortctl thing", "xml", NULL), -EINVAL);
    err = capture_end(&c);
    cr_assert_str_eq(err, "cohortctl thing: --log-format must be text or json, not \"xml\"\n"
                          "Try 'cohortctl thing --help'.\n");
    capture_begin(&c);
    cr_assert_eq(opt_logging("cohortctl thing", NULL, "loud"), -EINVAL);
    err = capture_end(&c);
    cr_assert_str_eq(err, "cohortctl thing: --log-level must be debug, info, warn or error, "
                          "not \"loud\"\nTry 'cohortctl thing --help'.\n");
    cr_assert_eq(opt_logging("cohortctl thing", NULL, NULL), 0, "nothing asked, nothing refused");
}

Test(opt, output_is_table_or_json)
{
    struct capture c;
    const char *err;
    bool json = true;

    cr_assert_eq(opt_output("cohortctl thing", "table", &json), 0);
    cr_assert_not(json);
    cr_assert_eq(opt_output("cohortctl thing", "json", &json), 0);
    cr_assert(json);
    capture_begin(&c);
    json = false;
    cr_assert_eq(opt_output("cohortctl thing", "JSON", &json), OPT_EXIT_USAGE);
    cr_assert_eq(opt_output("cohortctl thing", "", &json), OPT_EXIT_USAGE);
    err = capture_end(&c);
    cr_assert_not(json, "a refused value changes nothing");
    cr_assert_str_eq(err, "cohortctl thing: -o must be table or json, not \"JSON\"\n"
                          "Try 'cohortctl thing --help'.\n"
                          "cohortctl thing: -o must be table or json, not \"\"\n"
                          "Try 'cohortctl thing --help'.\n");
}
