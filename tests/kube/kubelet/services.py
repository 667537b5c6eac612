"""Services on this node, as kube-proxy and cluster DNS give them to pods:

- the service proxy listens on each Service's clusterIP:port while the
  Service has a ready endpoint, and forwards each new TCP connection to
  one of them (round robin; the next one when a connect fails). With no
  ready endpoint nothing listens, so a connection is refused, as
  kube-proxy's REJECT rule does. A connection, once forwarded, lives as
  long as both ends: a backend that dies closes it.
- cluster DNS: every pod's hosts file (isolation.hosts_text) names every
  Service with a clusterIP, rewritten in place as Services come and go.
"""
import itertools
import socket
import threading

from .common import log
from .informer import Informer
from . import isolation


class Listener:
    def __init__(self, net, ip, port, key, port_name):
        self.net, self.ip, self.port = net, ip, port
        self.key, self.port_name = key, port_name
        self.closed = False
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((ip, port))
        self.sock.listen(128)
        self.sock.settimeout(0.2)
        self.rr = itertools.count()
        threading.Thread(target=self.accept_loop, name="proxy-%s:%d" % (ip, port),
                         daemon=True).start()

    def close(self):
        self.closed = True

    def accept_loop(self):
        try:
            while not self.closed:
                try:
                    client, _ = self.sock.accept()
                except socket.timeout:
                    continue
                except OSError:
                    return
                client.settimeout(None)
                threading.Thread(target=self.forward, args=(client,), daemon=True).start()
        finally:
            self.sock.close()

    def forward(self, client):
        backends = self.net.backends(self.key, self.port_name)
        start = next(self.rr)
        for i in range(len(backends)):
            ip, port = backends[(start + i) % len(backends)]
            try:
                up = socket.create_connection((ip, port), timeout=5)
                up.settimeout(None)
                break
            except OSError:
                continue
        else:
            client.close()
            return
        back = threading.Thread(target=pipe, args=(up, client), daemon=True)
        back.start()
        pipe(client, up)
        back.join()
        up.close()
        client.close()


def pipe(src, dst):
    """Copies src to dst; at src's end, ends dst's writing side; on an
    error (a reset) shuts both down, which ends the other direction too."""
    try:
        while True:
            data = src.recv(65536)
            if not data:
                dst.shutdown(socket.SHUT_WR)
                return
            dst.sendall(data)
    except OSError:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class ServiceNetwork:
    def __init__(self, api, stopping, proxy=True):
        self.lock = threading.Lock()
        self.proxy = proxy
        self.listeners = {}              # (ip, port) -> Listener
        self.hosts = {}                  # hosts file path -> (namespace, hostname, pod ip)
        self.services = Informer(api, "/api/v1/services", self.changed, stopping,
                                 "kubelet:services")
        self.endpoints = Informer(api, "/api/v1/endpoints", self.changed, stopping,
                                  "kubelet:endpoints")

    def start(self):
        self.services.start()
        self.endpoints.start()

    def _cluster_ips(self):
        out = []
        for s in self.services.items():
            ip = (s.get("spec") or {}).get("clusterIP")
            if ip and ip != "None":
                out.append((s["metadata"]["namespace"], s["metadata"]["name"], ip))
        return out

    def backends(self, key, port_name):
        """Ready endpoints (ip, port) of Service key's port named port_name."""
        ns, name = key.split("/", 1)
        ep = self.endpoints.get(ns, name) or {}
        out = []
        for ss in ep.get("subsets") or []:
            port = next((p.get("port") for p in ss.get("ports") or []
                         if p.get("name", "") == port_name and p.get("protocol", "TCP") == "TCP"),
                        None)
            if port:
                out.extend((a["ip"], port) for a in ss.get("addresses") or [] if a.get("ip"))
        return out

    def changed(self):
        with self.lock:
            if self.proxy:
                self._sync_proxy()
            ips = self._cluster_ips()
            for path, (ns, hostname, pod_ip) in list(self.hosts.items()):
                self._write(path, ips, ns, hostname, pod_ip)

    def _sync_proxy(self):
        want = {}
        for s in self.services.items():
            spec = s.get("spec") or {}
            ip = spec.get("clusterIP")
            if not ip or ip == "None" or not ip.startswith("127."):
                continue
            key = "%s/%s" % (s["metadata"]["namespace"], s["metadata"]["name"])
            for p in spec.get("ports") or []:
                if p.get("protocol", "TCP") == "TCP" and self.backends(key, p.get("name", "")):
                    want[(ip, p["port"])] = (key, p.get("name", ""))
        for addr, l in list(self.listeners.items()):
            if addr not in want or (l.key, l.port_name) != want[addr]:
                l.close()
                del self.listeners[addr]
                log("service proxy: %s:%d closed (no ready endpoint)" % addr)
        for addr, (key, pname) in want.items():
            if addr not in self.listeners:
                try:
                    self.listeners[addr] = Listener(self, addr[0], addr[1], key, pname)
                    log("service proxy: %s:%d -> %s" % (addr[0], addr[1], key))
                except OSError as e:
                    log("service proxy: cannot listen on %s:%d for %s: %s" %
                        (addr[0], addr[1], key, e))

    def _write(self, path, ips, ns, hostname, pod_ip):
        try:
            isolation.write_in_place(path, isolation.hosts_text(ips, ns, hostname, pod_ip))
        except OSError as e:
            log("cannot write hosts file %s: %s" % (path, e))

    def add_hosts(self, path, ns, hostname, pod_ip):
        """Keeps the hosts file at path up to date until remove_hosts()."""
        with self.lock:
            self.hosts[path] = (ns, hostname, pod_ip)
            self._write(path, self._cluster_ips(), ns, hostname, pod_ip)

    def remove_hosts(self, path):
        with self.lock:
            self.hosts.pop(path, None)

    def close(self):
        with self.lock:
            for l in self.listeners.values():
                l.close()
            self.listeners.clear()
