"""Endpoints: a Service's selector to its pods' addresses. Ready pods go
in addresses, the others (with an IP, not finished, not being deleted)
in notReadyAddresses, unless publishNotReadyAddresses puts them all in
addresses. A Service without a selector keeps the Endpoints someone else
writes (the kubernetes Service's, bootstrap.py). No EndpointSlices: the
stand-in does not serve discovery.k8s.io, and its proxy reads Endpoints.
"""
from .base import Controller, active, matches, pod_ready


def target_port(port, pod):
    t = port.get("targetPort", port.get("port"))
    if isinstance(t, int) or (isinstance(t, str) and t.isdigit()):
        return int(t)
    for c in (pod.get("spec") or {}).get("containers") or []:
        for cp in c.get("ports") or []:
            if cp.get("name") == t:
                return cp.get("containerPort")
    return None


class EndpointsController(Controller):
    name = "endpoints-controller"

    def __init__(self, api, stopping, resync):
        super().__init__(api, stopping, resync)
        self.watch("services", "/api/v1/services")
        self.watch("pods", "/api/v1/pods")
        self.watch("endpoints", "/api/v1/endpoints")

    def sync(self):
        pods = self.informers["pods"].items()
        for svc in self.informers["services"].items():
            spec = svc.get("spec") or {}
            if not spec.get("selector") or svc["metadata"].get("deletionTimestamp"):
                continue
            self.sync_one(svc, [p for p in pods if
                                p["metadata"]["namespace"] == svc["metadata"]["namespace"] and
                                matches(spec["selector"], p["metadata"].get("labels"))])

    def sync_one(self, svc, pods):
        meta, spec = svc["metadata"], svc.get("spec") or {}
        publish = spec.get("publishNotReadyAddresses", False)
        subsets = {}                     # ports tuple -> (addresses, notReady)
        for p in sorted(pods, key=lambda p: p["metadata"]["name"]):
            ip = (p.get("status") or {}).get("podIP")
            if not ip or not active(p):
                continue
            ports = []
            for sp in spec.get("ports") or []:
                tp = target_port(sp, p)
                if tp:
                    ports.append((sp.get("name", ""), tp, sp.get("protocol", "TCP")))
            if not ports:
                continue
            addr = {"ip": ip, "nodeName": (p.get("spec") or {}).get("nodeName"),
                    "targetRef": {"kind": "Pod", "namespace": p["metadata"]["namespace"],
                                  "name": p["metadata"]["name"], "uid": p["metadata"]["uid"]}}
            ready, notready = subsets.setdefault(tuple(ports), ([], []))
            (ready if publish or pod_ready(p) else notready).append(addr)
        out = []
        for ports, (ready, notready) in subsets.items():
            ss = {"ports": [dict({"port": tp, "protocol": proto}, **({"name": n} if n else {}))
                            for n, tp, proto in ports]}
            if ready:
                ss["addresses"] = ready
            if notready:
                ss["notReadyAddresses"] = notready
            out.append(ss)
        cur = self.informers["endpoints"].get(meta["namespace"], meta["name"])
        body = {"apiVersion": "v1", "kind": "Endpoints",
                "metadata": {"name": meta["name"], "namespace": meta["namespace"],
                             "labels": dict(meta.get("labels") or {})}}
        if out:
            body["subsets"] = out
        path = "/api/v1/namespaces/%s/endpoints" % meta["namespace"]
        if cur is None:
            self.request("POST", path, body, ok=(409,))
        elif (cur.get("subsets") or []) != out or \
                (cur["metadata"].get("labels") or {}) != body["metadata"]["labels"]:
            body["metadata"]["resourceVersion"] = cur["metadata"]["resourceVersion"]
            self.request("PUT", "%s/%s" % (path, meta["name"]), body, ok=(404, 409))
