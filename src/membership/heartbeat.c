/* src/membership/heartbeat.c: see heartbeat.h. */
#include "membership/heartbeat.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#include "base/clock.h"
#include "membership/member.h"

/* The longest sleep between polls: member_poll() asks for at most 100 ms,
 * and a stop waits for no longer than this. */
#define SLEEP_MAX_MS 50u
/* How soon an owner that is not ready yet is asked again. */
#define NOT_READY_MS 20u

struct heartbeat {
    struct member *m;           /* borrowed */
    heartbeat_ready_fn ready;
    void *arg;
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t cond;        /* stop, or a wake */
    bool stop;                  /* under lock */
    bool woken;                 /* under lock: poll again without sleeping */
    bool joined;                /* the thread has ended (heartbeat_stop) */
};

static void *heartbeat_main(void *arg)
{
    struct heartbeat *h = arg;

    pthread_mutex_lock(&h->lock);
    while (!h->stop) {
        uint32_t wait = NOT_READY_MS;

        /* Neither the owner's hook nor the poll runs under the lock: a
         * wake from a thread that holds its own lock must never wait on
         * a poll. */
        h->woken = false;
        pthread_mutex_unlock(&h->lock);
        if (!h->ready || h->ready(h->arg))
            wait = member_poll(h->m, clock_now_ms());
        pthread_mutex_lock(&h->lock);
        if (!h->stop && !h->woken) {
            struct timespec ts = clock_deadline(wait > SLEEP_MAX_MS ? SLEEP_MAX_MS : wait);

            pthread_cond_timedwait(&h->cond, &h->lock, &ts);
        }
    }
    pthread_mutex_unlock(&h->lock);
    return NULL;
}

int heartbeat_create(struct member *m, heartbeat_ready_fn ready, void *arg,
                     struct heartbeat **out)
{
    struct heartbeat *h;
    int rc;

    if (!m || !out)
        return -EINVAL;
    h = calloc(1, sizeof(*h));
    if (!h)
        return -ENOMEM;
    h->m = m;
    h->ready = ready;
    h->arg = arg;
    rc = -pthread_mutex_init(&h->lock, NULL);
    if (rc < 0)
        goto err_free;
    rc = clock_cond_init(&h->cond);
    if (rc < 0)
        goto err_lock;
    if (pthread_create(&h->thread, NULL, heartbeat_main, h) != 0) {
        rc = -EAGAIN;
        goto err_cond;
    }
    *out = h;
    return 0;
err_cond:
    pthread_cond_destroy(&h->cond);
err_lock:
    pthread_mutex_destroy(&h->lock);
err_free:
    free(h);
    return rc;
}

void heartbeat_wake(struct heartbeat *h)
{
    pthread_mutex_lock(&h->lock);
    h->woken = true;
    pthread_cond_signal(&h->cond);
    pthread_mutex_unlock(&h->lock);
}

int heartbeat_report_lost(struct heartbeat *h, const char *peer)
{
    int rc = member_report_lost(h->m, peer);

    if (rc == 0)
        heartbeat_wake(h);
    return rc;
}

int heartbeat_report_unreachable(struct heartbeat *h, const char *peer, uint64_t epoch)
{
    int rc = member_report_unreachable(h->m, peer, epoch);

    if (rc == 0)
        heartbeat_wake(h);
    return rc;
}

void heartbeat_stop(struct heartbeat *h)
{
    if (h->joined)
        return;
    pthread_mutex_lock(&h->lock);
    h->stop = true;
    pthread_cond_signal(&h->cond);
    pthread_mutex_unlock(&h->lock);
    pthread_join(h->thread, NULL);
    h->joined = true;
}

void heartbeat_destroy(struct heartbeat *h)
{
    if (!h)
        return;
    heartbeat_stop(h);
    pthread_cond_destroy(&h->cond);
    pthread_mutex_destroy(&h->lock);
    free(h);
}
