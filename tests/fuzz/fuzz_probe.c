/* tests/fuzz/fuzz_probe.c: what anyone who reaches the operator's probe
 * port sends (src/k8s/probe.c). The server keeps at most REQUEST_MAX - 1
 * bytes of a request, NUL-terminated, and parses it once it holds a blank
 * line (probe_parse_request); this harness does the same with the input.
 *
 * Invariants: 405 exactly when the method is neither GET nor HEAD; else
 * 400 exactly when the target's path (up to a space, '?', CR or LF) is
 * empty or does not fit the buffer, and 200 with that path otherwise;
 * *head exactly for HEAD. */
#include "fuzz.h"

#include "k8s/probe.h"

#define REQUEST_MAX 8192            /* as probe.c keeps a request */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *req, path[1024];
    bool head = false, is_get, is_head;
    int code;

    if (size > REQUEST_MAX - 1)
        size = REQUEST_MAX - 1;
    req = fuzz_strndup(data, size);
    /* A request the server would not answer yet waits for more bytes. */
    if (!strstr(req, "\r\n\r\n") && !strstr(req, "\n\n"))
        goto out;
    is_get = strncmp(req, "GET ", 4) == 0;
    is_head = strncmp(req, "HEAD ", 5) == 0;
    code = probe_parse_request(req, path, sizeof(path), &head);
    CHECK(code == 200 || code == 400 || code == 405);
    CHECK(head == is_head);
    CHECK((code == 405) == (!is_get && !is_head));
    if (code != 405) {
        const char *target = req + (is_head ? 5 : 4);
        size_t want = strcspn(target, " ?\r\n");

        CHECK((code == 400) == (want == 0 || want >= sizeof(path)));
        if (code == 200) {
            CHECK(strlen(path) == want);
            CHECK(strncmp(target, path, want) == 0);
        }
    }
out:
    free(req);
    return 0;
}
