#!/usr/bin/env python3
"""bench/compression_netns.py: cohort's all-reduce with each codec against
none, and Gloo's (uncompressed) beside them, with every member in its own
network namespace behind a rate-limited link, where the bytes a round sends
are what it waits on.

    sudo bench/compression_netns.py
    sudo bench/compression_netns.py --rate 1gbit --peers 4 --bytes 64M --reps 3

The network is a star: a hub namespace holds a bridge, each member's
namespace an `eth0` (a veth pair whose other end is a bridge port), as
tests/netfault/netns.py builds hosts. Every member's eth0 sends through
`tc qdisc ... tbf rate RATE`: the limit is each member's egress, as a NIC's
line rate would be. Every member is its own process inside its namespace:
`cohortctl bench allreduce --member I --rendezvous DIR` (the members meet
through a directory they share, and prove a key generated for the run),
and `bench/allreduce_gloo.py --rank I --master ADDR` for Gloo. Each
repetition runs every codec and Gloo in turn, so that a noisy neighbour
slows them alike; the table shows medians of: time per all-reduce (the
slowest member's mean), the payload bytes a member sends per all-reduce
(cohortctl's wire_bytes; for Gloo the ring's 2(N-1)/N x bytes), the bytes
that really left each member's eth0 per all-reduce (headers, greetings and
warm-up included: the interface's counter over the run divided by the
all-reduces run), and time and link bytes as ratios to cohort's none.

Needs root, `ip` and `tc` with tbf; elsewhere it prints why and exits 0
without a table. Namespaces are named cbw-PID-RAND-*; those of a run whose
process is gone are removed by the next run.
"""
import argparse
import json
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBNET = "10.78.0"
NAME_RE = re.compile(r"^cbw-(\d+)-[0-9a-f]{6}-")
SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
RATE_RE = re.compile(r"^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit|bps|kbps|mbps|gbps)$")
GLOO_PORT = 29500       # in rank 0's own namespace: nothing else listens there


def sh(*argv, check=True, timeout=60):
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError("%s: exit %d: %s" % (" ".join(argv), r.returncode, r.stderr.strip()))
    return r


def parse_size(s):
    s = s.strip()
    mult = 1
    if s and s[-1].upper() in SUFFIX:
        mult = SUFFIX[s[-1].upper()]
        s = s[:-1]
    if not s.isdigit() or int(s) == 0:
        raise argparse.ArgumentTypeError("not a size: %r" % s)
    return int(s) * mult


def rate_bits(rate):
    """The tc rate in bits per second (tc's units: bit = bit/s, bps = byte/s)."""
    m = re.match(r"^([0-9.]+)([a-z]+)$", rate)
    n = float(m.group(1))
    unit = m.group(2)
    scale = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9,
             "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}[unit]
    return n * scale


def unavailable():
    """None where namespaces, veths, a bridge and tbf work here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (euid %d)" % os.geteuid()
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return "no `%s` on PATH" % tool
    name = "cbw-%d-%s-probe" % (os.getpid(), secrets.token_hex(3))
    try:
        r = sh("ip", "netns", "add", name, check=False)
        if r.returncode != 0:
            return "cannot create a network namespace: %s" % r.stderr.strip()
        r = sh("ip", "-n", name, "link", "add", "va", "type", "veth", "peer", "name", "vb",
               check=False)
        if r.returncode != 0:
            return "cannot create a veth pair in a namespace: %s" % r.stderr.strip()
        r = sh("tc", "-n", name, "qdisc", "add", "dev", "va", "root", "tbf", "rate", "1gbit",
               "burst", "256kb", "latency", "50ms", check=False)
        if r.returncode != 0:
            return "tc tbf fails in a namespace: %s" % r.stderr.strip()
        return None
    finally:
        sh("ip", "netns", "del", name, check=False)


def kill_ns_processes(ns):
    r = sh("ip", "netns", "pids", ns, check=False)
    for pid in r.stdout.split() if r.returncode == 0 else []:
        try:
            os.kill(int(pid), 9)
        except ProcessLookupError:
            pass


def sweep_stale():
    r = sh("ip", "netns", "list", check=False)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = NAME_RE.match(name)
        if m and not os.path.exists("/proc/%s" % m.group(1)):
            kill_ns_processes(name)
            sh("ip", "netns", "del", name, check=False)


class Net:
    """n members' namespaces on one bridge, each egress limited to rate."""

    def __init__(self, n, rate):
        sweep_stale()
        tag = "cbw-%d-%s" % (os.getpid(), secrets.token_hex(3))
        self.hub = tag + "-hub"
        self.members = ["%s-m%d" % (tag, i) for i in range(n)]
        self.addr = ["%s.%d" % (SUBNET, 10 + i) for i in range(n)]
        self.made = []
        try:
            self._build(rate)
        except BaseException:
            self.close()
            raise

    def _build(self, rate):
        # The bucket holds a few milliseconds at the rate (at least 64 KiB,
        # so that a GSO burst fits), the queue 50 ms.
        burst = max(64 << 10, int(rate_bits(rate) / 8 * 0.002))
        sh("ip", "netns", "add", self.hub)
        self.made.append(self.hub)
        sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        for i, ns in enumerate(self.members):
            sh("ip", "netns", "add", ns)
            self.made.append(ns)
            port = "p%d" % i
            sh("ip", "-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0",
               "netns", ns)
            sh("ip", "-n", self.hub, "link", "set", port, "master", "br0")
            sh("ip", "-n", self.hub, "link", "set", port, "up")
            sh("ip", "-n", ns, "addr", "add", self.addr[i] + "/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate,
               "burst", str(burst), "latency", "50ms")

    def tx_bytes(self, i):
        r = sh("ip", "-n", self.members[i], "-j", "-s", "link", "show", "eth0")
        return int(json.loads(r.stdout)[0]["stats64"]["tx"]["bytes"])

    def close(self):
        for ns in reversed(self.made):
            kill_ns_processes(ns)
            sh("ip", "netns", "del", ns, check=False)
        self.made = []


def run_members(net, argvs, timeout):
    """Starts argvs[i] in member i's namespace, waits for all (or kills all
    at the deadline). Returns (stdouts, link bytes each member sent)."""
    before = [net.tx_bytes(i) for i in range(len(argvs))]
    procs = [subprocess.Popen(["ip", "netns", "exec", net.members[i], *argv],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, argv in enumerate(argvs)]
    deadline = time.monotonic() + timeout
    outs, failed = [], []
    for i, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
            failed.append("member %d: timed out after %ds" % (i, timeout))
            outs.append(out)
            continue
        if p.returncode != 0:
            failed.append("member %d: exit %d: %s" % (i, p.returncode, err.strip()[-2000:]))
        outs.append(out)
    if failed:
        raise RuntimeError("; ".join(failed))
    sent = [net.tx_bytes(i) - before[i] for i in range(len(argvs))]
    return outs, sent


def rows_of(out):
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=4, help="members (2..16, default 4)")
    ap.add_argument("--bytes", type=parse_size, default=64 << 20,
                    help="buffer size, K/M/G suffixes (default 64M)")
    ap.add_argument("--rate", default="1gbit",
                    help="each member's egress limit, in tc's units (default 1gbit)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    ap.add_argument("--iters", type=int, default=3, help="timed all-reduces per run (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed ones before (default 1)")
    ap.add_argument("--codecs", default="none fp16 bf16 int8 topk powersgd",
                    help="cohortctl's --codec values, none first (default: all six)")
    ap.add_argument("--topk-ratio", default="0.01")
    ap.add_argument("--rank", default="4", help="PowerSGD's rank (default 4)")
    ap.add_argument("--no-gloo", action="store_true", help="leave Gloo out")
    ap.add_argument("--cohortctl", default=os.path.join(ROOT, "build", "cohortctl"))
    ap.add_argument("--timeout", type=int, default=300,
                    help="seconds one run of the members may take (default 300)")
    args = ap.parse_args()
    codecs = args.codecs.split()
    if not 2 <= args.peers <= 16:
        ap.error("--peers must be 2..16")
    if args.reps < 1 or args.iters < 1 or args.warmup < 1 or args.timeout < 1:
        ap.error("--reps, --iters, --warmup and --timeout must be positive")
    if not RATE_RE.match(args.rate):
        ap.error("--rate must be a number and a tc unit (bit kbit mbit gbit bps kbps mbps "
                 "gbps), such as 1gbit")
    if not codecs or codecs[0] != "none" or len(set(codecs)) != len(codecs):
        ap.error("--codecs must start with none and name each codec once")
    for c in codecs:
        if c not in ("none", "fp16", "bf16", "int8", "topk", "powersgd"):
            ap.error("unknown codec %r" % c)
    if not os.access(args.cohortctl, os.X_OK):
        ap.error("no cohortctl at %s (make all)" % args.cohortctl)
    why = unavailable()
    if why:
        print("compression_netns: skipped: %s" % why)
        return 0

    tmp = tempfile.mkdtemp(prefix="cbw-")
    key = os.path.join(tmp, "key")
    with open(key, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    os.chmod(key, 0o600)
    n = args.peers
    rounds = args.iters + args.warmup
    results = {}        # name -> list of (time_ms, wire, link bytes per all-reduce)
    names = list(codecs) + ([] if args.no_gloo else ["gloo"])
    print("compression_netns: %d repetitions of %s; %d peers, %d bytes, %s each way"
          % (args.reps, " ".join(names), n, args.bytes, args.rate), file=sys.stderr)
    net = Net(n, args.rate)
    try:
        for rep in range(args.reps):
            for name in names:
                if name == "gloo":
                    argvs = [["env", "GLOO_SOCKET_IFNAME=eth0", "OMP_NUM_THREADS=1",
                              "/usr/bin/python3", os.path.join(ROOT, "bench", "allreduce_gloo.py"),
                              "--peers", str(n), "--rank", str(i),
                              "--master", "%s:%d" % (net.addr[0], GLOO_PORT),
                              "--iters", str(args.iters), "--warmup", str(args.warmup),
                              str(args.bytes)] for i in range(n)]
                else:
                    rv = os.path.join(tmp, "rv-%d-%s" % (rep, name))
                    os.mkdir(rv)
                    argvs = [[args.cohortctl, "bench", "allreduce", "--peers", str(n),
                              "--member", str(i), "--rendezvous", rv, "--host", net.addr[i],
                              "--key-file", key, "--bytes", str(args.bytes),
                              "--iters", str(args.iters), "--warmup", str(args.warmup),
                              "--codec", name, "--topk-ratio", args.topk_ratio,
                              "--rank", args.rank, "--timeout", "%ds" % args.timeout,
                              "-o", "json"] for i in range(n)]
                outs, sent = run_members(net, argvs, args.timeout)
                rows = [r for out in outs for r in rows_of(out)]
                if not rows:
                    raise RuntimeError("%s printed no row" % name)
                t = max(r["time_ms"] for r in rows)
                wire = (rows[0]["wire_bytes"] if name != "gloo"
                        else 2 * (n - 1) * rows[0]["bytes"] // n)
                link = statistics.mean(sent) / rounds
                results.setdefault(name, []).append((t, wire, link))
                print("  rep %d %-8s %10.1f ms %12d link bytes" % (rep + 1, name, t, link),
                      file=sys.stderr)
    finally:
        net.close()
        shutil.rmtree(tmp, ignore_errors=True)

    med = {k: (statistics.median(x[0] for x in v), v[0][1], statistics.median(x[2] for x in v))
           for k, v in results.items()}
    base = med["none"]
    print("| system | codec | time_ms | wire_bytes | link_bytes | time / none | link / none |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in names:
        t, w, link = med[name]
        print("| %s | %s | %.2f | %d | %d | %.2f | %.3f |"
              % ("gloo" if name == "gloo" else "cohort", "none" if name == "gloo" else name,
                 t, w, link, t / base[0], link / base[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
