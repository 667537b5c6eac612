/* src/gpu/gpuid.h: a GPU's identity, its 16-byte UUID, as nvidia-smi and
 * the driver (cuDeviceGetUuid) give it. Devices are matched by UUID and
 * never by index: CUDA_VISIBLE_DEVICES renumbers them differently in each
 * container, so the trainer's device 0 may be the sidecar's device 1.
 */
#ifndef COHORT_GPUID_H
#define COHORT_GPUID_H

#include <stddef.h>
#include <stdint.h>

#define GPUID_BYTES 16
/* "GPU-" + 8-4-4-4-12 hexadecimal digits + NUL */
#define GPUID_TEXT_MAX 41

struct gpuid {
    uint8_t b[GPUID_BYTES];
};

/* Parses "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (either case of hex
 * digits; the "GPU-" prefix may be left out, as in CUDA_VISIBLE_DEVICES).
 * Returns 0, or -EINVAL for anything else, leaving *out untouched. */
int gpuid_parse(const char *s, struct gpuid *out);

/* Writes the nvidia-smi form, lower case, into buf (at least
 * GPUID_TEXT_MAX bytes). Returns buf. */
char *gpuid_format(const struct gpuid *id, char *buf, size_t len);

/* The index in `ids` (n of them, borrowed) of the one equal to `want`.
 * Returns it, -ENODEV when none is, or -EEXIST when two are: a driver
 * that lists one UUID twice is not trusted to name the right one. */
int gpuid_find(const struct gpuid *ids, size_t n, const struct gpuid *want);
#endif
