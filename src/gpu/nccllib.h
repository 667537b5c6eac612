/* src/gpu/nccllib.h: NCCL, loaded at run time, as the operations table
 * ncomm.c drives. libnccl.so.2 is loaded with dlopen, never linked, and
 * ncclCommShrink is looked up on its own: a library older than 2.27 lacks
 * it, and its table has no shrink (ncomm then always rebuilds).
 */
#ifndef COHORT_NCCLLIB_H
#define COHORT_NCCLLIB_H

#include <stdbool.h>

struct ncomm_ops;

/* Loads libnccl.so.2 once per process and returns its table (static,
 * borrowed, valid until exit). Returns 0, -EOPNOTSUPP (no GPU support in
 * this build), or -ELIBACC (no NCCL, or one older than 2.14, which has no
 * non-blocking communicators). */
int nccllib_load(const struct ncomm_ops **out);

/* The loaded library's version as NCCL codes it (2.28.9: 22809), 0 before
 * a successful nccllib_load. */
int nccllib_version(void);
#endif
