/* src/rpc/core.h: what the files of src/rpc share behind rpc.h: the one
 * completion queue, the tag every asynchronous operation starts with, and
 * the conversions between gRPC's types and ours. Private to src/rpc: only
 * its .c files include it, since it carries gRPC's headers, which nothing
 * else in cohort may see. */
#ifndef COHORT_RPC_CORE_H
#define COHORT_RPC_CORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <grpc/byte_buffer.h>
#include <grpc/grpc.h>
#include <grpc/slice.h>
#include <grpc/support/time.h>

#include "rpc/rpc.h"

/* The first member of every struct handed to gRPC as a tag: the completion
 * threads call fn with whether the operation succeeded. */
struct rpc_tag {
    void (*fn)(struct rpc_tag *t, bool ok);
};

/* The process's completion queue, between rpc_init() and the last
 * rpc_shutdown(); borrowed. */
grpc_completion_queue *rpc_queue(void);

/* Fills *st (NULL is fine) with `code` and the first `len` bytes of `msg`,
 * cut to fit. */
void rpc_status_set(struct rpc_status *st, enum rpc_code code, const char *msg, size_t len);
/* The same from what gRPC reported for a call; `details` is borrowed. */
void rpc_status_from_grpc(struct rpc_status *st, grpc_status_code code, grpc_slice details);

/* A deadline timeout_ms from now; 0 means none. */
gpr_timespec rpc_deadline_after(uint32_t timeout_ms);

/* A byte buffer holding `b`'s bytes, for one send: each send needs a byte
 * buffer of its own, while the slice is shared. The caller destroys it
 * with grpc_byte_buffer_destroy(). */
grpc_byte_buffer *rpc_buf_to_bb(struct rpc_buf *b);
/* `m` (borrowed) packed into a new byte buffer, destroyed by the caller. */
grpc_byte_buffer *rpc_pack_bb(const ProtobufCMessage *m);
/* The `desc` message in `bb` (borrowed), or NULL when the bytes are not
 * one. The caller frees it with protobuf_c_message_free_unpacked(). */
ProtobufCMessage *rpc_unpack_bb(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *desc);

#endif
