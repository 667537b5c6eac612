/* src/k8s/evrec.c: see evrec.h. */
#include "k8s/evrec.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct entry {
    char *object, *reason, *message;
    bool warning;
    char name[EVREC_NAME_MAX];
    uint32_t count;
    uint64_t last;
};

struct bucket {
    char *object;
    double tokens;
    uint64_t at;
};

struct evrec {
    struct evrec_config cfg;
    pthread_mutex_t lock;
    struct entry *e;
    size_t n;
    struct bucket *b;
    size_t nb, capb;
};

int evrec_create(const struct evrec_config *cfg, struct evrec **out)
{
    struct evrec *r = calloc(1, sizeof(*r));

    if (!r)
        return -ENOMEM;
    if (cfg)
        r->cfg = *cfg;
    if (!r->cfg.burst)
        r->cfg.burst = 25;
    if (!r->cfg.refill_ms)
        r->cfg.refill_ms = 300000;
    if (!r->cfg.dedupe_ms)
        r->cfg.dedupe_ms = 600000;
    if (!r->cfg.max_entries)
        r->cfg.max_entries = 4096;
    r->e = calloc(r->cfg.max_entries, sizeof(*r->e));
    if (!r->e) {
        free(r);
        return -ENOMEM;
    }
    pthread_mutex_init(&r->lock, NULL);
    *out = r;
    return 0;
}

static void entry_clear(struct entry *e)
{
    free(e->object);
    free(e->reason);
    free(e->message);
    memset(e, 0, sizeof(*e));
}

void evrec_destroy(struct evrec *r)
{
    if (!r)
        return;
    for (size_t i = 0; i < r->n; i++)
        entry_clear(&r->e[i]);
    for (size_t i = 0; i < r->nb; i++)
        free(r->b[i].object);
    free(r->e);
    free(r->b);
    pthread_mutex_destroy(&r->lock);
    free(r);
}

/* Takes a token from `object`'s bucket; false when it has none. A bucket
 * that cannot be made lets the Event through: losing the filter is better
 * than losing the Event. */
static bool take(struct evrec *r, const char *object, uint64_t now)
{
    struct bucket *b = NULL;

    for (size_t i = 0; i < r->nb; i++)
        if (strcmp(r->b[i].object, object) == 0)
            b = &r->b[i];
    if (!b) {
        char *o;
        if (r->nb == r->capb) {
            size_t cap = r->capb ? r->capb * 2 : 32;
            struct bucket *nb = realloc(r->b, cap * sizeof(*nb));
            if (!nb)
                return true;
            r->b = nb;
            r->capb = cap;
        }
        o = strdup(object);
        if (!o)
            return true;
        b = &r->b[r->nb++];
        *b = (struct bucket){ .object = o, .tokens = r->cfg.burst, .at = now };
    }
    if (now > b->at) {
        b->tokens += (double)(now - b->at) / r->cfg.refill_ms;
        if (b->tokens > r->cfg.burst)
            b->tokens = r->cfg.burst;
        b->at = now;
    }
    if (b->tokens < 1.0)
        return false;
    b->tokens -= 1.0;
    return true;
}

static struct entry *find(struct evrec *r, const char *object, bool warning, const char *reason,
                          const char *message)
{
    for (size_t i = 0; i < r->n; i++) {
        struct entry *e = &r->e[i];
        if (e->warning == warning && strcmp(e->object, object) == 0 &&
            strcmp(e->reason, reason) == 0 && strcmp(e->message, message) == 0)
            return e;
    }
    return NULL;
}

enum evrec_action evrec_decide(struct evrec *r, const char *object, bool warning,
                               const char *reason, const char *message, uint64_t now,
                               char name[EVREC_NAME_MAX], uint32_t *count)
{
    enum evrec_action a = EVREC_CREATE;
    struct entry *e;

    pthread_mutex_lock(&r->lock);
    if (!take(r, object, now)) {
        a = EVREC_DROP;
        goto out;
    }
    e = find(r, object, warning, reason, message);
    if (e && now - e->last < r->cfg.dedupe_ms) {
        e->count++;
        e->last = now;
        snprintf(name, EVREC_NAME_MAX, "%s", e->name);
        *count = e->count;
        a = EVREC_PATCH;
    }
out:
    pthread_mutex_unlock(&r->lock);
    return a;
}

void evrec_note(struct evrec *r, const char *object, bool warning, const char *reason,
                const char *message, const char *name, uint64_t now)
{
    struct entry *e;

    pthread_mutex_lock(&r->lock);
    e = find(r, object, warning, reason, message);
    if (!e && r->n < r->cfg.max_entries) {
        e = &r->e[r->n++];
    } else if (!e) {
        /* Full: the entry seen longest ago goes. */
        e = &r->e[0];
        for (size_t i = 1; i < r->n; i++)
            if (r->e[i].last < e->last)
                e = &r->e[i];
    }
    entry_clear(e);
    e->object = strdup(object);
    e->reason = strdup(reason);
    e->message = strdup(message);
    if (!e->object || !e->reason || !e->message) {
        entry_clear(e);
        /* An empty slot in the middle: fill it with the last. */
        *e = r->e[--r->n];
        memset(&r->e[r->n], 0, sizeof(r->e[r->n]));
        goto out;
    }
    e->warning = warning;
    snprintf(e->name, sizeof(e->name), "%s", name);
    e->count = 1;
    e->last = now;
out:
    pthread_mutex_unlock(&r->lock);
}

static void drop_at(struct evrec *r, size_t i)
{
    entry_clear(&r->e[i]);
    r->e[i] = r->e[--r->n];
    memset(&r->e[r->n], 0, sizeof(r->e[r->n]));
}

void evrec_forget_event(struct evrec *r, const char *name)
{
    pthread_mutex_lock(&r->lock);
    for (size_t i = 0; i < r->n; i++)
        if (strcmp(r->e[i].name, name) == 0) {
            drop_at(r, i);
            break;
        }
    pthread_mutex_unlock(&r->lock);
}

void evrec_forget(struct evrec *r, const char *object)
{
    pthread_mutex_lock(&r->lock);
    for (size_t i = r->n; i-- > 0;)
        if (strcmp(r->e[i].object, object) == 0)
            drop_at(r, i);
    for (size_t i = r->nb; i-- > 0;)
        if (strcmp(r->b[i].object, object) == 0) {
            free(r->b[i].object);
            r->b[i] = r->b[--r->nb];
        }
    pthread_mutex_unlock(&r->lock);
}
