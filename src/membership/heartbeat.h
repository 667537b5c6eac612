/* src/membership/heartbeat.h: a thread that keeps one member polled while
 * its owner's threads wait elsewhere.
 *
 * A node, a group and an averager each wait in all-reduces that can take
 * longer than the member timeout; their member must go on sending
 * heartbeats meanwhile, or a slow step would get it evicted. The member
 * is driven, not threaded (member.h), so each of them runs this one loop
 * beside its own work: poll, sleep until the next thing falls due (50 ms
 * at most, so a lost peer or a stop is seen promptly), and poll again at
 * once when the owner has news for the broker.
 */
#ifndef COHORT_HEARTBEAT_H
#define COHORT_HEARTBEAT_H

#include <stdbool.h>
#include <stdint.h>

struct member;
struct heartbeat;

/* Asked on the heartbeat thread before each poll, with no lock of the
 * heartbeat's held: true to poll now, false to ask again within 20 ms.
 * A node answers false until its tensors are registered (a member in the
 * epoch that cannot take part would stall everyone's steps), and uses the
 * call to set what its next heartbeat reports. */
typedef bool (*heartbeat_ready_fn)(void *arg);

/* Starts polling `m` (borrowed: it must outlive heartbeat_destroy()) on
 * a thread of its own. `ready` may be NULL (always ready); `arg` is
 * borrowed. Nobody else may call member_poll() on `m` until
 * heartbeat_stop(). Returns 0, -EINVAL (no member), -ENOMEM, -EAGAIN (no
 * thread). The caller frees *out with heartbeat_destroy(). */
int heartbeat_create(struct member *m, heartbeat_ready_fn ready, void *arg,
                     struct heartbeat **out);

/* Polls at once rather than at the next due time: the owner has news
 * (it became ready, or queued a report). Any thread. */
void heartbeat_wake(struct heartbeat *h);

/* member_report_lost() and member_report_unreachable() (their arguments
 * and results), with a poll at once when the report was queued, so that
 * the broker hears it within a round trip. Any thread: the engine calls
 * them from inside a failed run. */
int heartbeat_report_lost(struct heartbeat *h, const char *peer);
int heartbeat_report_unreachable(struct heartbeat *h, const char *peer, uint64_t epoch);

/* Ends the thread, after a poll in progress returns; later calls do
 * nothing. The member is left as it was, for member_leave(). The reports
 * above may still be made (a run in flight may fail after its owner
 * stopped polling): they are queued for nobody and wake nothing. */
void heartbeat_stop(struct heartbeat *h);

/* heartbeat_stop(), then frees h (NULL is fine). */
void heartbeat_destroy(struct heartbeat *h);

#endif
