"""Hosts in Linux network namespaces, and the faults between them.

One run is a star: a hub namespace holds a bridge; the broker's namespace
and one namespace per member each hold an `eth0`, one end of a veth pair
whose other end is a port of the bridge. Nothing touches the machine's own
namespace, so two runs never share a name or an address: every namespace
is named `cnf-PID-RAND-ROLE`, PID being the test process's. A run whose
process is gone (killed before its cleanup) is swept by the next one.

Faults are made inside the namespace they concern, on its eth0 only:
- delay with jitter on egress: `tc qdisc add dev eth0 root netem delay`
  where the kernel has sch_netem; else iptables NFQUEUE to nfdelay.py, a
  user-space netem (same delay and jitter, packets may overtake);
- loss on egress: iptables `-m statistic --mode random` DROP;
- a partition: iptables DROP of everything to and from the given
  addresses (silence, as a cut cable: no reset), in chain NF_PART, which
  heal() flushes.
"""
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SUBNET = "10.77.0"
BROKER_ADDR = SUBNET + ".1"
NAME_RE = re.compile(r"^cnf-(\d+)-[0-9a-f]{6}-")


def sh(*argv, check=True):
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and r.returncode != 0:
        raise RuntimeError("%s: exit %d: %s" % (" ".join(argv), r.returncode, r.stderr.strip()))
    return r


def unavailable():
    """None where namespaces, veths, a bridge and iptables work here, else
    the reason they do not (for the skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root (euid %d)" % os.geteuid()
    for tool in ("ip", "iptables"):
        if not shutil.which(tool):
            return "no `%s` on PATH" % tool
    name = "cnf-%d-%s-probe" % (os.getpid(), secrets.token_hex(3))
    try:
        r = sh("ip", "netns", "add", name, check=False)
        if r.returncode != 0:
            return "cannot create a network namespace: %s" % r.stderr.strip()
        r = sh("ip", "-n", name, "link", "add", "br0", "type", "bridge", check=False)
        if r.returncode != 0:
            return "cannot create a bridge in a namespace: %s" % r.stderr.strip()
        r = sh("ip", "netns", "exec", name, "iptables", "-A", "OUTPUT", "-m", "statistic",
               "--mode", "random", "--probability", "0.05", "-j", "DROP", check=False)
        if r.returncode != 0:
            return "iptables (statistic match) fails in a namespace: %s" % r.stderr.strip()
        return None
    finally:
        sh("ip", "netns", "del", name, check=False)


def ns_pids(ns):
    r = sh("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []


def kill_ns_processes(ns):
    """SIGKILLs what still runs in ns: only ever processes a run of these
    tests started there."""
    for pid in ns_pids(ns):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def sweep_stale():
    """Deletes the namespaces of runs whose test process is gone."""
    r = sh("ip", "netns", "list", check=False)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = NAME_RE.match(name)
        if not m or os.path.exists("/proc/%s" % m.group(1)):
            continue
        kill_ns_processes(name)
        sh("ip", "netns", "del", name, check=False)


def netem_available(ns, dev="eth0"):
    r = sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "netem", "delay", "1ms",
           check=False) if shutil.which("tc") else None
    if r is None or r.returncode != 0:
        return False
    sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
    return True


class Net:
    """The broker's namespace and n members' on one bridge. Close it (a
    fixture's finally) to remove everything, processes first."""

    def __init__(self, n):
        sweep_stale()
        self.tag = "cnf-%d-%s" % (os.getpid(), secrets.token_hex(3))
        self.hub = self.tag + "-hub"
        self.broker = self.tag + "-b"
        self.members = ["%s-m%d" % (self.tag, i) for i in range(n)]
        self.addr = {self.broker: BROKER_ADDR}
        self.addr.update({ns: "%s.%d" % (SUBNET, 10 + i) for i, ns in enumerate(self.members)})
        self.made = []
        self.delayers = []
        self.delay_mode = None
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self):
        sh("ip", "netns", "add", self.hub)
        self.made.append(self.hub)
        sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        for i, ns in enumerate([self.broker] + self.members):
            sh("ip", "netns", "add", ns)
            self.made.append(ns)
            port = "p%d" % i
            sh("ip", "-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0",
               "netns", ns)
            sh("ip", "-n", self.hub, "link", "set", port, "master", "br0")
            sh("ip", "-n", self.hub, "link", "set", port, "up")
            sh("ip", "-n", ns, "addr", "add", self.addr[ns] + "/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            self.ipt(ns, "-N", "NF_PART")
            self.ipt(ns, "-I", "INPUT", "-i", "eth0", "-j", "NF_PART")
            self.ipt(ns, "-I", "OUTPUT", "-o", "eth0", "-j", "NF_PART")

    def ipt(self, ns, *args):
        return sh("ip", "netns", "exec", ns, "iptables", "-w", *args)

    def argv(self, ns, argv):
        """argv run inside ns (ip netns exec execs it: the pid is argv's)."""
        return ["ip", "netns", "exec", ns, *argv]

    # ---- faults ------------------------------------------------------------

    def delay(self, ns, ms, jitter_ms):
        """Every packet ns sends is held ms +- jitter_ms."""
        if self.delay_mode is None:
            self.delay_mode = "netem" if netem_available(ns) else "nfqueue"
        if self.delay_mode == "netem":
            sh("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "netem", "delay",
               "%dms" % ms, "%dms" % jitter_ms)
            return
        p = subprocess.Popen(self.argv(ns, [sys.executable, os.path.join(HERE, "nfdelay.py"), "0",
                                            str(ms), str(jitter_ms)]),
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        self.delayers.append(p)
        line = p.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError("nfdelay.py in %s did not start: %s" % (ns, p.stderr.read()))
        # Appended after NF_PART: a partitioned packet is dropped, not delayed.
        self.ipt(ns, "-A", "OUTPUT", "-o", "eth0", "-j", "NFQUEUE", "--queue-num", "0")

    def loss(self, ns, fraction):
        """Each packet ns sends is dropped with this probability."""
        self.ipt(ns, "-I", "OUTPUT", "-o", "eth0", "-m", "statistic", "--mode", "random",
                 "--probability", str(fraction), "-j", "DROP")

    def partition(self, ns, others):
        """Nothing passes between ns and the namespaces `others`, either way."""
        for o in others:
            self.ipt(ns, "-A", "NF_PART", "-s", self.addr[o], "-j", "DROP")
            self.ipt(ns, "-A", "NF_PART", "-d", self.addr[o], "-j", "DROP")

    def isolate(self, ns):
        """Nothing passes between ns and anyone."""
        self.ipt(ns, "-A", "NF_PART", "-j", "DROP")

    def heal(self):
        """Ends every partition (delay and loss stay)."""
        for ns in [self.broker] + self.members:
            self.ipt(ns, "-F", "NF_PART")

    def close(self):
        for p in self.delayers:
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for ns in reversed(self.made):
            kill_ns_processes(ns)
            sh("ip", "netns", "del", ns, check=False)
        self.made = []
