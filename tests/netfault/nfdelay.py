"""Delays packets with jitter: `tc qdisc ... netem delay` in user space, for
kernels built without sch_netem.

Run inside a network namespace (`ip netns exec NS python3 nfdelay.py ...`)
whose iptables send the packets to delay to NFQUEUE queue N; each packet
is handed back (NF_ACCEPT) DELAY_MS +- JITTER_MS (uniform) after it was
queued. Like netem with jitter and no rate, packets may overtake each
other. It speaks nfnetlink_queue over a raw netlink socket (no library),
asks for metadata only (no payload copy), prints "ready" once bound, and
runs until SIGTERM. The kernel drops what arrives while its queue (32,768
packets) is full, as netem drops past its limit.

Usage: nfdelay.py QUEUE DELAY_MS JITTER_MS
"""
import heapq
import random
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN = 1, 2, 3
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NF_ACCEPT = 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
SO_RCVBUFFORCE = 33


def attr(kind, payload):
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + b"\0" * ((4 - n % 4) % 4)


def message(kind, queue, attrs, seq, flags=NLM_F_REQUEST):
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + b"".join(attrs)
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags,
                       seq, 0) + body


def config(sock, queue, attrs, seq):
    """Sends one config message and raises on the kernel's error."""
    sock.send(message(NFQNL_MSG_CONFIG, queue, attrs, seq, NLM_F_REQUEST | NLM_F_ACK))
    data = sock.recv(65536)
    kind, = struct.unpack_from("=H", data, 4)
    if kind == NLMSG_ERROR:
        err, = struct.unpack_from("=i", data, 16)
        if err:
            raise OSError(-err, "nfnetlink_queue config refused")


def packet_ids(data):
    """The packet ids of the NFQNL_MSG_PACKET messages in one datagram."""
    off = 0
    while off + 16 <= len(data):
        n, kind = struct.unpack_from("=IH", data, off)
        if n < 16 or off + n > len(data):
            return
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            a = off + 20
            while a + 4 <= off + n:
                alen, atype = struct.unpack_from("=HH", data, a)
                if alen < 4:
                    break
                if atype & 0x7fff == NFQA_PACKET_HDR and alen >= 8:
                    yield struct.unpack_from("!I", data, a + 4)[0]
                    break
                a += (alen + 3) & ~3
        off += (n + 3) & ~3


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    queue, delay, jitter = int(sys.argv[1]), float(sys.argv[2]) / 1e3, float(sys.argv[3]) / 1e3
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 16 << 20)
    sock.bind((0, 0))
    config(sock, queue, [attr(NFQA_CFG_CMD, struct.pack("=BBH", NFQNL_CFG_CMD_BIND, 0, 0))], 1)
    config(sock, queue, [attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))], 2)
    config(sock, queue, [attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", 32768))], 3)
    print("ready", flush=True)
    due, seq = [], 10
    while not stop:
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, pid = heapq.heappop(due)
            seq += 1
            sock.send(message(NFQNL_MSG_VERDICT, queue,
                              [attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, pid))], seq))
        wait = max(0.0, due[0][0] - now) if due else 0.5
        try:
            ready, _, _ = select.select([sock], [], [], wait)
        except InterruptedError:
            continue
        if not ready:
            continue
        try:
            data = sock.recv(1 << 16)
        except OSError:
            continue    # ENOBUFS: the kernel dropped messages; their packets time out as lost
        now = time.monotonic()
        for pid in packet_ids(data):
            heapq.heappush(due, (now + max(0.0, random.uniform(delay - jitter, delay + jitter)),
                                 pid))


if __name__ == "__main__":
    main()
