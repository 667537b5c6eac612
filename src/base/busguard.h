/* src/base/busguard.h: survive SIGBUS from a shared mapping that another
 * process controls.
 *
 * A sidecar maps its trainer's memfd. Shrinking it is refused by its seals
 * (tlink.h), but a mapping another process owns should not be able to
 * kill this one by any route: a page that faults with SIGBUS inside a
 * watched range is replaced by a private zero page, the range is marked
 * tripped, and the faulting access goes on. The owner of the range polls
 * busguard_tripped() and drops whatever the range served (the sidecar ends
 * the trainer's session and says why). A SIGBUS anywhere else gets the
 * action that was installed before the first watch.
 *
 *   int slot = busguard_watch(map, len);
 *   ...                      // threads read and write map
 *   if (busguard_tripped(slot)) { stop every thread touching map; ... }
 *   busguard_unwatch(slot);  // only once nothing touches map any more
 *   munmap(map, len);
 */
#ifndef COHORT_BUSGUARD_H
#define COHORT_BUSGUARD_H

#include <stdbool.h>
#include <stddef.h>

#define BUSGUARD_SLOTS 16

/* Watches [addr, addr + len) (borrowed; it stays the caller's mapping).
 * Installs the handler on first use. Returns a slot >= 0, -EINVAL (empty
 * range), -ENOSPC (BUSGUARD_SLOTS ranges watched), or sigaction's -errno. */
int busguard_watch(void *addr, size_t len);

/* Stops watching. Call it only once no thread can touch the range: the
 * handler may be mapping a zero page into it until then. A negative slot
 * is ignored. */
void busguard_unwatch(int slot);

/* True once a page of the slot's range faulted with SIGBUS (false for a
 * slot not watched). */
bool busguard_tripped(int slot);

#endif
