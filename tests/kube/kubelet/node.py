"""The node: registration and its Lease, the pod informer (list, then
watch, re-listing after 410), scheduling by binding, pod addresses, one
PodWorker per pod, and --no-processes.
"""
import http.client
import os
import random
import tempfile
import threading
import time
import urllib.parse

from .api import ApiError
from .common import log, rfc3339
from .pod import ProcessRuntime
from .services import ServiceNetwork


KUBELET_VERSION = "v1.32.0-cohort-process-kubelet"


class Kubelet:
    def __init__(self, args, api):
        self.args = args
        self.api = api
        self.node = args.node_name
        self.logs_dir = os.path.abspath(args.logs_dir)
        self.state_dir = os.path.abspath(args.state_dir or
                                         tempfile.mkdtemp(prefix="cohort-kubelet-"))
        self.backoff_initial = args.backoff_initial
        self.backoff_max = args.backoff_max
        self.pass_env = args.pass_env or []
        self.lock = threading.RLock()
        self.workers = {}                  # uid -> PodWorker
        self.ips = {}                      # ip -> uid
        self.next_ip = 0                   # the next address to try: PREFIX.(2 + next_ip)
        self.fake_ips = {}                 # uid -> ip, with --no-processes
        self.fake_next = 0
        self.stopping = threading.Event()
        # kube-proxy's and cluster DNS's part (services.py); not with
        # --no-processes, where nothing would use them.
        self.net = None if args.no_processes else ServiceNetwork(api, self.stopping)
        os.makedirs(self.logs_dir, exist_ok=True)
        if getattr(args, "runtime", "process") == "podman":
            from .podman import PodmanRuntime
            self.runtime = PodmanRuntime(self)
        else:
            self.runtime = ProcessRuntime(self)

    # -- pod addresses --------------------------------------------------------

    def allocate_ip(self, uid):
        with self.lock:
            for ip, owner in self.ips.items():
                if owner == uid:
                    return ip
            # Round robin from the last one given, as host-local IPAM
            # does: a pod made right after another went gets a new address,
            # never the one clients of the old pod may still be dialing.
            for i in range(253):
                x = 2 + (self.next_ip + i) % 253
                ip = "%s.%d" % (self.args.pod_ip_prefix, x)
                if ip not in self.ips:
                    self.ips[ip] = uid
                    self.next_ip = x - 1
                    return ip
        raise RuntimeError("no pod addresses left")

    def worker_done(self, w):
        with self.lock:
            if self.workers.get(w.uid) is w:
                del self.workers[w.uid]
            for ip, owner in list(self.ips.items()):
                if owner == w.uid:
                    del self.ips[ip]

    # -- node -----------------------------------------------------------------

    def register(self, log_port):
        node = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": self.node, "labels": {
                    "kubernetes.io/hostname": self.node, "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64"}}}
        status = {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                  "message": "process kubelet is posting ready status",
                                  "lastHeartbeatTime": rfc3339(),
                                  "lastTransitionTime": rfc3339()}],
                  "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                                {"type": "Hostname", "address": self.node}],
                  "daemonEndpoints": {"kubeletEndpoint": {"Port": log_port}},
                  "capacity": {"cpu": str(os.cpu_count() or 1), "memory": "16Gi", "pods": "253"},
                  "allocatable": {"cpu": str(os.cpu_count() or 1), "memory": "16Gi",
                                  "pods": "253"},
                  "nodeInfo": {"kubeletVersion": KUBELET_VERSION, "operatingSystem": "linux",
                               "architecture": "amd64", "containerRuntimeVersion":
                               self.runtime.version, "kernelVersion": os.uname().release,
                               "osImage": self.runtime.os_image, "kubeProxyVersion": "",
                               "machineID": "", "systemUUID": "", "bootID": ""}}
        deadline = time.monotonic() + 30
        while True:
            try:
                try:
                    self.api.request("POST", "/api/v1/nodes", node)
                except ApiError as e:
                    if e.code != 409:
                        raise
                self.api.request("PATCH", "/api/v1/nodes/%s/status" % self.node,
                                 {"status": status}, "application/merge-patch+json")
                return
            except (OSError, ApiError) as e:
                if time.monotonic() > deadline:
                    raise SystemExit("kubelet: cannot register node: %s" % e)
                time.sleep(0.2)

    def lease_loop(self):
        path = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/" + self.node
        while not self.stopping.is_set():
            now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
            try:
                try:
                    lease = self.api.request("GET", path)
                    lease["spec"]["renewTime"] = now
                    self.api.request("PUT", path, lease)
                except ApiError as e:
                    if e.code != 404:
                        raise
                    self.api.request("POST", path.rsplit("/", 1)[0], {
                        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                        "metadata": {"name": self.node, "namespace": "kube-node-lease"},
                        "spec": {"holderIdentity": self.node, "leaseDurationSeconds": 40,
                                 "renewTime": now}})
            except (OSError, ApiError) as e:
                log("lease renewal failed: %s" % e)
            self.stopping.wait(10)

    # -- pods -------------------------------------------------------------------

    def handle(self, typ, pod):
        meta = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        uid = meta.get("uid")
        if typ == "DELETED":
            with self.lock:
                w = self.workers.get(uid)
            if w:
                w.gone()
            return
        if not spec.get("nodeName"):
            if spec.get("schedulerName", "default-scheduler") == "default-scheduler" and \
                    not meta.get("deletionTimestamp"):
                self.bind(pod)
            return
        if spec["nodeName"] != self.node:
            return
        if self.args.no_processes:
            return self._fake(pod)
        with self.lock:
            w = self.workers.get(uid)
            if w is None:
                if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                    if meta.get("deletionTimestamp"):
                        # Finished before this kubelet saw it: just finish the delete.
                        threading.Thread(target=self._remove, args=(pod,), daemon=True).start()
                    return
                w = self.runtime.worker(self, pod)
                self.workers[uid] = w
                w.start()
                return
        w.update(pod)

    def _fake(self, pod):
        """--no-processes: Running and Ready at once, removed at once."""
        m = pod["metadata"]
        if m.get("deletionTimestamp"):
            with self.lock:
                self.fake_ips.pop(m["uid"], None)
            threading.Thread(target=self._remove, args=(pod,), daemon=True).start()
            return
        if (pod.get("status") or {}).get("phase") == "Running":
            return
        with self.lock:
            if m["uid"] not in self.fake_ips:
                self.fake_next += 1
                self.fake_ips[m["uid"]] = "10.244.%d.%d" % (self.fake_next // 250 % 256,
                                                            self.fake_next % 250 + 2)
            ip = self.fake_ips[m["uid"]]
        now = rfc3339()
        conds = [{"type": t, "status": "True", "lastProbeTime": None, "lastTransitionTime": now}
                 for t in ("PodReadyToStartContainers", "Initialized", "Ready",
                           "ContainersReady", "PodScheduled")]
        st = {"phase": "Running", "conditions": conds, "hostIP": "127.0.0.1",
              "hostIPs": [{"ip": "127.0.0.1"}], "podIP": ip, "podIPs": [{"ip": ip}],
              "startTime": now,
              "containerStatuses": [{"name": c["name"], "ready": True, "started": True,
                                     "restartCount": 0, "image": c.get("image", ""),
                                     "imageID": "", "state": {"running": {"startedAt": now}}}
                                    for c in (pod.get("spec") or {}).get("containers") or []]}
        try:
            self.api.request("PATCH", "/api/v1/namespaces/%s/pods/%s/status" %
                             (m["namespace"], m["name"]),
                             [{"op": "test", "path": "/metadata/uid", "value": m["uid"]},
                              {"op": "add", "path": "/status", "value": st}],
                             "application/json-patch+json")
        except (ApiError, OSError) as e:
            log("%s/%s: status update failed: %s" % (m["namespace"], m["name"], e))

    def _remove(self, pod):
        m = pod["metadata"]
        try:
            self.api.request("DELETE", "/api/v1/namespaces/%s/pods/%s" %
                             (m["namespace"], m["name"]),
                             {"gracePeriodSeconds": 0, "preconditions": {"uid": m["uid"]}})
        except (ApiError, OSError):
            pass

    def bind(self, pod):
        m = pod["metadata"]
        try:
            self.api.request("POST", "/api/v1/namespaces/%s/pods/%s/binding" %
                             (m["namespace"], m["name"]),
                             {"apiVersion": "v1", "kind": "Binding",
                              "metadata": {"name": m["name"], "namespace": m["namespace"]},
                              "target": {"apiVersion": "v1", "kind": "Node", "name": self.node}})
        except ApiError as e:
            if e.code not in (404, 409):
                log("binding %s/%s failed: %s" % (m["namespace"], m["name"], e))
        except OSError as e:
            log("binding %s/%s failed: %s" % (m["namespace"], m["name"], e))

    def informer(self):
        """List, then watch from the list's resourceVersion; re-list after
        410 Gone or any error, with back-off. Pods that disappear between
        lists are treated as deleted."""
        known = {}
        backoff = 0.1
        while not self.stopping.is_set():
            try:
                lst = self.api.request("GET", "/api/v1/pods")
                rv = lst["metadata"]["resourceVersion"]
                seen = {}
                for p in lst.get("items") or []:
                    seen[p["metadata"]["uid"]] = p
                    self.handle("MODIFIED" if p["metadata"]["uid"] in known else "ADDED", p)
                for uid, p in known.items():
                    if uid not in seen:
                        self.handle("DELETED", p)
                known = seen
                backoff = 0.1
                while not self.stopping.is_set():
                    timeout = random.randint(60, 120)
                    q = urllib.parse.urlencode({"watch": "1", "resourceVersion": rv,
                                                "allowWatchBookmarks": "true",
                                                "timeoutSeconds": str(timeout)})
                    expired = False
                    for ev in self.api.stream("/api/v1/pods?" + q, timeout + 30):
                        typ, obj = ev.get("type"), ev.get("object") or {}
                        if typ == "ERROR":
                            expired = obj.get("code") == 410
                            if not expired:
                                log("watch error: %s" % obj.get("message"))
                            break
                        rv = obj["metadata"]["resourceVersion"]
                        if typ == "BOOKMARK":
                            continue
                        if typ == "DELETED":
                            known.pop(obj["metadata"]["uid"], None)
                        else:
                            known[obj["metadata"]["uid"]] = obj
                        self.handle(typ, obj)
                    if expired:
                        break
            except (OSError, ApiError, ValueError, http.client.HTTPException) as e:
                if self.stopping.is_set():
                    return
                log("pod watch failed, listing again: %s" % e)
                self.stopping.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    def find_container(self, ns, name, container):
        with self.lock:
            for w in self.workers.values():
                if w.ns == ns and w.name == name:
                    for c in w.containers:
                        if c.name == container:
                            return w, c
        return None, None

    def shutdown(self):
        """Stops every pod's containers: they must not outlive the kubelet."""
        self.stopping.set()
        if self.net:
            self.net.close()
        with self.lock:
            workers = list(self.workers.values())
        self.runtime.shutdown(workers)
