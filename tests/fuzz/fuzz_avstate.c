/* tests/fuzz/fuzz_avstate.c: what a stranger, or a peer that holds the
 * cohort's key, sends an averager's state server (src/averager/avstate.h),
 * over a real loopback connection to a real server.
 *
 * The first input byte picks who speaks. Odd: a stranger, whose bytes go
 * out as they are; the server may answer with at most a challenge, never
 * with a manifest or a part, since no input can make the confirm's MAC.
 * Even: a peer with the key, for which the harness sends a well-formed
 * hello and the right confirm, then the input as requests; every answer
 * is then whole and well-formed (a manifest with a MAC that verifies and
 * digests that hash to its root, a part as long as it says and matching
 * its digest), and the server hangs up at the first request that is not
 * a manifest or a part. The server itself is fed by a host thread with a
 * fixed state of several parts. */
#include "fuzz.h"

#include <errno.h>
#include <stdio.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <netdb.h>

#include "averager/avstate.h"
#include "base/secret.h"

#define STATE_BYTES ((size_t)3 * AVSTATE_PART_MIN + 100)

static struct secret key;
static struct avstate_server *srv;
static uint8_t *state;
static uint8_t root[AVSTATE_DIGEST_BYTES], *digests;
static uint32_t part_bytes, n_parts;

static void *host_main(void *arg)
{
    (void)arg;
    for (;;)
        if (avstate_server_wanted(srv, 1000))
            CHECK(avstate_server_provide(srv, state, STATE_BYTES) == 0);
    return NULL;
}

static void setup(void)
{
    static bool done;
    struct avstate_server_config c = {
        .cohort = "fuzz", .id = "donor", .host = "127.0.0.1", .key = &key,
        .io_timeout_ms = 200, .provide_timeout_ms = 100,
    };
    pthread_t t;

    if (done)
        return;
    CHECK(secret_generate(&key) == 0);
    state = malloc(STATE_BYTES);
    CHECK(state);
    for (size_t i = 0; i < STATE_BYTES; i++)
        state[i] = (uint8_t)(i * 7 + i / 251);
    CHECK(avstate_manifest(state, STATE_BYTES, &part_bytes, &n_parts, &digests, root) == 0);
    CHECK(avstate_server_start(&c, &srv) == 0);
    avstate_server_allow(srv, true);
    /* One snapshot from the start: a manifest is never left without. */
    CHECK(avstate_server_provide(srv, state, STATE_BYTES) == 0);
    CHECK(pthread_create(&t, NULL, host_main, NULL) == 0);
    CHECK(pthread_detach(t) == 0);
    done = true;
}

static int dial(void)
{
    struct addrinfo hints = { .ai_socktype = SOCK_STREAM }, *ai;
    const char *addr = avstate_server_address(srv), *colon = strrchr(addr, ':');
    char host[64];
    struct timeval tv = { .tv_sec = 2 };
    int fd;

    snprintf(host, sizeof(host), "%.*s", (int)(colon - addr), addr);
    CHECK(getaddrinfo(host, colon + 1, &hints, &ai) == 0);
    fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(fd >= 0);
    CHECK(connect(fd, ai->ai_addr, ai->ai_addrlen) == 0);
    freeaddrinfo(ai);
    /* The server hangs up within its io timeout; this only bounds a bug. */
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    return fd;
}

static void send_all(int fd, const void *p, size_t n)
{
    const uint8_t *c = p;

    /* The server may hang up early: what it did not read is its choice. */
    while (n > 0) {
        ssize_t r = send(fd, c, n, MSG_NOSIGNAL);

        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return;
        c += r;
        n -= (size_t)r;
    }
}

/* Reads everything until the server hangs up, at most cap bytes. */
static size_t drain(int fd, uint8_t *buf, size_t cap)
{
    size_t got = 0;

    for (;;) {
        uint8_t scratch[4096];
        ssize_t r = recv(fd, got < cap ? buf + got : scratch,
                         got < cap ? cap - got : sizeof(scratch), 0);

        if (r < 0 && errno == EINTR)       /* libFuzzer's timers */
            continue;
        if (r <= 0)
            return got;
        got += (size_t)r;
    }
}

/* Reads exactly n bytes; false if the server hung up first. */
static bool drain_exact(int fd, uint8_t *buf, size_t n)
{
    while (n > 0) {
        ssize_t r = recv(fd, buf, n, 0);

        if (r < 0 && errno == EINTR)       /* libFuzzer's timers */
            continue;
        if (r <= 0)
            return false;
        buf += r;
        n -= (size_t)r;
    }
    return true;
}

static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void stranger(const uint8_t *data, size_t size)
{
    uint8_t buf[256];
    int fd = dial();
    size_t got;

    send_all(fd, data, size);
    shutdown(fd, SHUT_WR);
    got = drain(fd, buf, sizeof(buf));
    /* A challenge (72 bytes) at most: nothing of the state. */
    CHECK(got == 0 || got == 72);
    if (got)
        CHECK(get32(buf) == AVSTATE_MAGIC);
    close(fd);
}

/* Checks the answers to the requests in req[0..n) (40 bytes each, the
 * last one possibly short), found in a[0..got). */
static void check_answers(const uint8_t *req, size_t n, const uint8_t *a, size_t got,
                          const uint8_t *nc, const uint8_t *na)
{
    size_t at = 0;

    for (size_t i = 0; i + 40 <= n; i += 40) {
        uint32_t op = get32(req + i), part = get32(req + i + 4);

        if (op == AVSTATE_OP_MANIFEST) {
            uint8_t mac[SECRET_MAC_BYTES];
            size_t dl;

            CHECK(at + 56 <= got);
            CHECK(get32(a + at) == AVSTATE_OK);     /* the host always provides */
            CHECK(get32(a + at + 4) == part_bytes && get32(a + at + 16) == n_parts);
            CHECK(memcmp(a + at + 24, root, sizeof(root)) == 0);
            dl = (size_t)n_parts * AVSTATE_DIGEST_BYTES;
            CHECK(at + 56 + dl + 32 <= got);
            CHECK(memcmp(a + at + 56, digests, dl) == 0);
            CHECK(avstate_mac(&key, "manifest", "fuzz", "peer", "donor", nc, na, a + at,
                              56 + dl, mac) == 0);
            CHECK(memcmp(mac, a + at + 56 + dl, sizeof(mac)) == 0);
            at += 56 + dl + 32;
        } else if (op == AVSTATE_OP_PART) {
            bool ours = memcmp(req + i + 8, root, sizeof(root)) == 0;
            uint32_t status, len;

            CHECK(at + 8 <= got);
            status = get32(a + at);
            len = get32(a + at + 4);
            if (!ours) {
                CHECK(status == AVSTATE_GONE && len == 0);
            } else if (part >= n_parts) {
                CHECK(status == AVSTATE_BAD_PART && len == 0);
            } else {
                size_t off = (size_t)part * part_bytes;
                size_t want = STATE_BYTES - off < part_bytes ? STATE_BYTES - off : part_bytes;

                CHECK(status == AVSTATE_OK && len == want);
                CHECK(at + 8 + len <= got);
                CHECK(memcmp(a + at + 8, state + off, len) == 0);
            }
            at += 8 + len;
        } else {
            break;              /* the server hangs up here */
        }
    }
    CHECK(at == got);
}

static void keyed(const uint8_t *data, size_t size)
{
    uint8_t hello[12 + AVSTATE_NONCE_BYTES + 13], ch[72], confirm[SECRET_MAC_BYTES];
    uint8_t mac[SECRET_MAC_BYTES], *answers, req[8 * 40];
    size_t cap = 8 * (56 + 4 * 32 + 32 + 8 + part_bytes), got;
    int fd = dial();

    memset(hello, 0, sizeof(hello));
    memcpy(hello, "CAS1", 4);
    hello[4] = 4;       /* "fuzz" */
    hello[6] = 4;       /* "peer" */
    hello[8] = 5;       /* "donor" */
    CHECK(secret_random(hello + 12, AVSTATE_NONCE_BYTES) == 0);
    memcpy(hello + 12 + AVSTATE_NONCE_BYTES, "fuzzpeerdonor", 13);
    send_all(fd, hello, sizeof(hello));
    CHECK(drain_exact(fd, ch, sizeof(ch)));
    CHECK(get32(ch) == AVSTATE_MAGIC && get32(ch + 4) == AVSTATE_OK);
    CHECK(avstate_mac(&key, "accept", "fuzz", "peer", "donor", hello + 12, ch + 8, NULL, 0,
                      mac) == 0);
    CHECK(memcmp(mac, ch + 40, sizeof(mac)) == 0);
    CHECK(avstate_mac(&key, "confirm", "fuzz", "peer", "donor", hello + 12, ch + 8, NULL, 0,
                      confirm) == 0);
    send_all(fd, confirm, sizeof(confirm));
    /* At most 8 requests, so that the answers fit the buffer; a request
     * whose root starts with 0 asks for the server's real root, which no
     * input could guess. */
    if (size > 8 * 40)
        size = 8 * 40;
    memcpy(req, data, size);
    for (size_t i = 0; i + 40 <= size; i += 40)
        if (req[i + 8] == 0)
            memcpy(req + i + 8, root, sizeof(root));
    send_all(fd, req, size);
    shutdown(fd, SHUT_WR);
    answers = malloc(cap);
    CHECK(answers);
    got = drain(fd, answers, cap);
    check_answers(req, size, answers, got, hello + 12, ch + 8);
    free(answers);
    close(fd);
}

/* The threads of this process now, from /proc; 0 if it cannot be read. */
static long threads_now(void)
{
    char line[256];
    long n = 0;
    FILE *f = fopen("/proc/self/status", "r");

    if (!f)
        return 0;
    while (fgets(line, sizeof(line), f))
        if (sscanf(line, "Threads: %ld", &n) == 1)
            break;
    fclose(f);
    return n;
}

/* Waits, up to a second, until the server's thread for the input's
 * connection has ended. It hangs up before it ends, and libcrypto frees
 * the state it keeps for a thread only as that thread ends: libFuzzer's
 * leak check after the input would otherwise find that state, which no
 * scanned memory points to, in a thread still on its way out. */
static void settle(long idle)
{
    for (int i = 0; i < 1000 && idle > 0 && threads_now() > idle; i++)
        usleep(1000);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static long idle;

    setup();
    if (!idle)
        idle = threads_now();
    if (size == 0)
        return 0;
    if (data[0] & 1)
        stranger(data + 1, size - 1);
    else
        keyed(data + 1, size - 1);
    settle(idle);
    return 0;
}
