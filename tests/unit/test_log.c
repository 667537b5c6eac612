/* tests/unit/test_log.c: log lines as they reach stderr: one line each,
 * valid JSON in json mode, fields typed, hostile values contained. */
#include <criterion/criterion.h>
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "base/log.h"

/* Runs `emit` with stderr redirected and returns what it wrote. */
static char *capture(void (*emit)(void))
{
    static char buf[16384];
    int fds[2], saved;
    ssize_t n;

    cr_assert_eq(pipe(fds), 0);
    saved = dup(STDERR_FILENO);
    dup2(fds[1], STDERR_FILENO);
    emit();
    dup2(saved, STDERR_FILENO);
    close(saved);
    close(fds[1]);
    n = read(fds[0], buf, sizeof(buf) - 1);
    close(fds[0]);
    buf[n > 0 ? n : 0] = '\0';
    return buf;
}

static void emit_fields(void)
{
    log_info("test", "Member joined.", LF_S("cohort", "demo"), LF_U("epoch", 42),
             LF_I("delta", -3), LF_B("leader", true), LF_S("note", "two words"));
}

Test(log, text_line_has_fields_and_quotes_spaces)
{
    log_set_format(LOG_TEXT);
    char *out = capture(emit_fields);
    cr_assert(strstr(out, " info  test: Member joined. cohort=demo epoch=42 delta=-3 leader=true "
                          "note=\"two words\"\n"), "%s", out);
    cr_assert_eq(strchr(out, '\n'), out + strlen(out) - 1, "exactly one line");
}

Test(log, json_line_parses_with_typed_fields)
{
    log_set_format(LOG_JSON);
    char *out = capture(emit_fields);
    cJSON *j = cJSON_Parse(out);
    cr_assert_not_null(j, "%s", out);
    cr_assert_str_eq(cJSON_GetObjectItem(j, "level")->valuestring, "info");
    cr_assert_str_eq(cJSON_GetObjectItem(j, "component")->valuestring, "test");
    cr_assert_str_eq(cJSON_GetObjectItem(j, "msg")->valuestring, "Member joined.");
    cr_assert_eq(cJSON_GetObjectItem(j, "epoch")->valuedouble, 42);
    cr_assert_eq(cJSON_GetObjectItem(j, "delta")->valuedouble, -3);
    cr_assert(cJSON_IsTrue(cJSON_GetObjectItem(j, "leader")));
    cJSON_Delete(j);
}

static void emit_hostile(void)
{
    static char big[8000];
    memset(big, 'x', sizeof(big) - 1);
    log_warn("test", "Hostile values.", LF_S("quote", "a\"b\\c\nd"), LF_S("big1", big),
             LF_S("big2", big), LF_S("big3", big), LF_S("big4", big), LF_S("after", "tail"));
}

Test(log, hostile_values_keep_json_valid_and_one_line)
{
    log_set_format(LOG_JSON);
    char *out = capture(emit_hostile);
    cr_assert_eq(strchr(out, '\n'), out + strlen(out) - 1, "exactly one line");
    cr_assert_leq(strlen(out), 4096);
    cJSON *j = cJSON_Parse(out);
    cr_assert_not_null(j, "not JSON: %.200s", out);
    cr_assert_str_eq(cJSON_GetObjectItem(j, "quote")->valuestring, "a\"b\\c\nd");
    cJSON_Delete(j);
}

Test(log, level_filter_and_parsers)
{
    enum log_level l;
    enum log_format f;

    log_set_level(LOG_WARN);
    log_set_format(LOG_TEXT);
    cr_assert_str_eq(capture(emit_fields), "");
    cr_assert_eq(log_parse_level("debug", &l), 0);
    cr_assert_eq(l, LOG_DEBUG);
    cr_assert_eq(log_parse_level("verbose", &l), -EINVAL);
    cr_assert_eq(log_parse_format("json", &f), 0);
    cr_assert_eq(log_parse_format("xml", &f), -EINVAL);
    cr_assert_str_eq(log_strerror(-ENOENT), "No such file or directory");
}
