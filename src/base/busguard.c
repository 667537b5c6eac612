/* src/base/busguard.c: see busguard.h.
 *
 * The handler runs on whichever thread faulted and may interrupt anything,
 * so it touches only the slots' atomics and makes two system calls (mmap,
 * sigaction), both async-signal-safe. A slot is claimed with a
 * compare-and-swap of `used`; its range is empty while it is written and
 * emptied before the slot is released, so the handler never matches half
 * a range. */
#include "base/busguard.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

struct slot {
    atomic_bool used;
    atomic_uintptr_t start, end;
    atomic_bool tripped;
};

static struct slot slots[BUSGUARD_SLOTS];
static struct sigaction previous;
static uintptr_t page_mask;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static int install_error;

static void on_sigbus(int sig, siginfo_t *si, void *ctx)
{
    uintptr_t a = (uintptr_t)si->si_addr;

    (void)ctx;
    for (int i = 0; i < BUSGUARD_SLOTS; i++) {
        struct slot *s = &slots[i];
        if (!atomic_load(&s->used) || a < atomic_load(&s->start) || a >= atomic_load(&s->end))
            continue;
        /* The access is retried on return and now finds a zero page. */
        if (mmap((void *)(a & page_mask), ~page_mask + 1, PROT_READ | PROT_WRITE,
                 MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) == MAP_FAILED)
            break;
        atomic_store(&s->tripped, true);
        return;
    }
    /* Not ours (or no zero page to be had): the access faults again under
     * the action this process had before, which usually ends it. */
    sigaction(sig, &previous, NULL);
}

static void install(void)
{
    struct sigaction sa;

    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    page_mask = ~((uintptr_t)sysconf(_SC_PAGESIZE) - 1);
    if (sigaction(SIGBUS, &sa, &previous) < 0)
        install_error = -errno;
}

int busguard_watch(void *addr, size_t len)
{
    if (!addr || len == 0)
        return -EINVAL;
    pthread_once(&once, install);
    if (install_error)
        return install_error;
    for (int i = 0; i < BUSGUARD_SLOTS; i++) {
        struct slot *s = &slots[i];
        bool expected = false;

        if (!atomic_compare_exchange_strong(&s->used, &expected, true))
            continue;
        /* The range is empty (start == end == 0) until both ends are
         * stored, so the handler matches nothing in between. */
        atomic_store(&s->tripped, false);
        atomic_store(&s->start, (uintptr_t)addr);
        atomic_store(&s->end, (uintptr_t)addr + len);
        return i;
    }
    return -ENOSPC;
}

void busguard_unwatch(int slot)
{
    if (slot < 0 || slot >= BUSGUARD_SLOTS)
        return;
    atomic_store(&slots[slot].start, (uintptr_t)0);
    atomic_store(&slots[slot].end, (uintptr_t)0);
    atomic_store(&slots[slot].used, false);
}

bool busguard_tripped(int slot)
{
    return slot >= 0 && slot < BUSGUARD_SLOTS && atomic_load(&slots[slot].used) &&
           atomic_load(&slots[slot].tripped);
}
