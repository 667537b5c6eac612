/* src/gpu/cudrv.h: the CUDA driver, loaded at run time.
 *
 * libcuda.so.1 exists only where a driver is installed, so nothing links
 * it: cudrv_open() loads it with dlopen, and a machine without it gets a
 * clear error (-ELIBACC) instead of a binary that will not start. Built
 * without COHORT_GPU (no CUDA headers where it was compiled), every call
 * here answers -EOPNOTSUPP.
 *
 * The three ways a GPU request is refused, each its own code, so the
 * trainer can tell them apart (cohort_strerror names them):
 *   -EOPNOTSUPP  no GPU support in this build
 *   -ELIBACC     no CUDA driver (libcuda.so.1 missing, or too old)
 *   -ENXIO       no device (none at all, or none with the UUID asked for)
 */
#ifndef COHORT_CUDRV_H
#define COHORT_CUDRV_H

#include <stdbool.h>
#include <stddef.h>

#include "gpu/gpuid.h"

struct cudrv;

/* The most devices one process is told of; more are not looked at. */
#define CUDRV_DEVICES_MAX 64

/* True when this build was compiled with GPU support. */
bool cudrv_built(void);

/* Loads the driver and initialises it. Returns 0 and sets *out (caller
 * frees with cudrv_close), -EOPNOTSUPP, -ELIBACC, -ENXIO (the driver
 * found no device), or -EIO (any other driver failure, logged once with
 * the driver's own name for it). */
int cudrv_open(struct cudrv **out);
void cudrv_close(struct cudrv *d);      /* NULL is fine */

/* The devices this process sees, by UUID, in the driver's order (which
 * is only this process's order). Returns how many were written to ids
 * (up to max), or -EIO. */
int cudrv_list(struct cudrv *d, struct gpuid *ids, size_t max);

/* The driver's ordinal in this process of the device with UUID `id`.
 * Returns 0 and sets *ordinal, -ENXIO when no device has it, -EIO. */
int cudrv_find(struct cudrv *d, const struct gpuid *id, int *ordinal);

/* Whether a GPU with UUID `id` can be served here: opens the driver,
 * looks for the device and closes again (-ENXIO both for no device at all
 * and for none with this UUID; the sentence tells which). Returns 0 or the refusal above;
 * `why` gets a whole sentence naming the cause (borrowed, static). */
int cudrv_check(const struct gpuid *id, const char **why);
#endif
