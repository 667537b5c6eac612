/* src/k8s/drain.c: see drain.h. */
#include "k8s/drain.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

void drain_set_cleanup(struct drain_set *s)
{
    for (size_t i = 0; i < s->n; i++)
        free(s->items[i].id);
    free(s->items);
    s->items = NULL;
    s->n = 0;
}

struct drain_entry *drain_set_find(struct drain_set *s, const char *id)
{
    for (size_t i = 0; i < s->n; i++)
        if (strcmp(s->items[i].id, id) == 0)
            return &s->items[i];
    return NULL;
}

struct drain_entry *drain_set_add(struct drain_set *s, const char *id, uint64_t now)
{
    struct drain_entry *items = realloc(s->items, (s->n + 1) * sizeof(*items));
    char *copy;

    if (!items)
        return NULL;
    s->items = items;
    copy = strdup(id);
    if (!copy)
        return NULL;
    items[s->n] = (struct drain_entry){ .id = copy, .started = now };
    return &items[s->n++];
}

void drain_set_forget(struct drain_set *s, const char *id)
{
    for (size_t i = 0; i < s->n; i++)
        if (strcmp(s->items[i].id, id) == 0) {
            free(s->items[i].id);
            s->items[i] = s->items[--s->n];
            return;
        }
}

enum drain_action drain_decide(const struct drain_entry *d, bool member, int drained,
                               uint64_t now, uint32_t deadline_ms)
{
    /* A pod that is not (or no longer) a member holds no round up. */
    if (!d)
        return member ? DRAIN_START : DRAIN_DELETE_STRANGER;
    /* Gone from the broker counts as drained: nothing waits for it. */
    if (drained == 1 || drained == -ENOENT)
        return DRAIN_DELETE_DRAINED;
    if (now - d->started >= deadline_ms)
        return DRAIN_DELETE_TIMEOUT;
    return DRAIN_WAIT;
}
