/* tests/fuzz/fuzz_dgram.c: a datagram as the broker's UDP port reads it
 * (dgram_unpack) and as a member's datagram socket reads one
 * (dgram_unpack_ack), src/membership/dgram.h.
 *
 * Input: one byte that picks which, then the datagram.
 *
 * Invariants: accepted only with its magic and at most WIRE_DATAGRAM_MAX
 * bytes; an accepted heartbeat names a cohort and an id; what is accepted
 * with no unknown fields packs back into a frame that is accepted again
 * with the same fields (protobuf-c keeps unknown fields as it read them,
 * malformed ones included, and packs them so);
 * the proof or MAC the input carries never verifies under a key the input
 * never saw (proof_valid, proof_ack_valid), and one made for the message
 * does. */
#include "fuzz.h"

#include "base/secret.h"
#include "cohort.pb-c.h"
#include "membership/dgram.h"
#include "membership/proof.h"
#include "membership/wire.h"

static struct secret key;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    memset(key.key, 0x5a, sizeof(key.key));
    return 0;
}

static bool framed(const uint8_t *data, size_t size, const char *magic)
{
    return size >= WIRE_DATAGRAM_MAGIC_LEN && size <= WIRE_DATAGRAM_MAX &&
           memcmp(data, magic, WIRE_DATAGRAM_MAGIC_LEN) == 0;
}

static void heartbeat(const uint8_t *data, size_t size)
{
    Cohort__V1__HeartbeatDatagram *q = NULL, *again = NULL;
    Cohort__V1__Proof pf, *carried;
    uint8_t buf[WIRE_DATAGRAM_MAX], mac[SECRET_MAC_BYTES];
    ssize_t n;

    if (dgram_unpack(data, size, &q) < 0)
        return;
    CHECK(framed(data, size, WIRE_DATAGRAM_MAGIC));
    CHECK(q->cohort && q->cohort[0] && q->id && q->id[0]);
    carried = q->proof;
    if (carried)
        CHECK(!proof_valid(&key, &q->base, carried));
    CHECK(proof_sign(&key, &q->base, 1, 2, &pf, mac) == 0);
    CHECK(proof_valid(&key, &q->base, &pf));
    n = dgram_pack(q, buf);
    CHECK(n > 0);           /* what fit once fits again */
    if (q->base.n_unknown_fields || (carried && carried->base.n_unknown_fields) ||
        (q->checkpoint_skipped && q->checkpoint_skipped->base.n_unknown_fields))
        goto out;
    CHECK(dgram_unpack(buf, (size_t)n, &again) == 0);
    CHECK(strcmp(again->cohort, q->cohort) == 0 && strcmp(again->id, q->id) == 0);
    CHECK(again->session == q->session && again->model_version == q->model_version &&
          again->epoch == q->epoch && again->checkpoint_version == q->checkpoint_version);
    protobuf_c_message_free_unpacked(&again->base, NULL);
out:
    protobuf_c_message_free_unpacked(&q->base, NULL);
}

static void ack(const uint8_t *data, size_t size)
{
    Cohort__V1__HeartbeatDatagramAck *a = NULL, *again = NULL;
    uint8_t buf[WIRE_DATAGRAM_MAX], mac[SECRET_MAC_BYTES];
    ProtobufCBinaryData carried;
    ssize_t n;

    if (dgram_unpack_ack(data, size, &a) < 0)
        return;
    CHECK(framed(data, size, WIRE_DATAGRAM_ACK_MAGIC));
    CHECK(!proof_ack_valid(&key, "c", "m", a));
    carried = a->mac;
    CHECK(proof_sign_ack(&key, "c", "m", a, mac) == 0);
    CHECK(proof_ack_valid(&key, "c", "m", a));
    n = dgram_pack_ack(a, buf);
    CHECK(n > 0);
    if (a->base.n_unknown_fields == 0) {
        CHECK(dgram_unpack_ack(buf, (size_t)n, &again) == 0);
        CHECK(again->session == a->session && again->seq == a->seq &&
              again->epoch == a->epoch && again->drained == a->drained &&
              proof_ack_valid(&key, "c", "m", again));
        protobuf_c_message_free_unpacked(&again->base, NULL);
    }
    a->mac = carried;       /* the unpacked tree frees its own bytes */
    protobuf_c_message_free_unpacked(&a->base, NULL);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    if (data[0] & 1)
        ack(data + 1, size - 1);
    else
        heartbeat(data + 1, size - 1);
    return 0;
}
