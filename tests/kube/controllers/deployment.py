"""Deployments: pods kept at spec.replicas from spec.template, rolled
when the template changes, and the Deployment's status. A Deployment owns
its pods directly (the stand-in serves no ReplicaSets); each pod carries
pod-template-hash, the hash of the template it was made from.
"""
import json
import time

from kubelet.common import log, rfc3339

from .base import Controller, active, matches, pod_ready

SAFE = "bcdfghjklmnpqrstvwxz2456789"      # the alphabet of rand.SafeEncodeString


def template_hash(template):
    """FNV-1a (32 bits) of the template, written as Kubernetes writes
    pod-template-hash; stable for equal templates."""
    h = 0x811c9dc5
    for b in json.dumps(template, sort_keys=True, separators=(",", ":")).encode():
        h = ((h ^ b) * 0x01000193) & 0xffffffff
    out = ""
    for _ in range(10):
        out += SAFE[h % len(SAFE)]
        h //= len(SAFE)
    return out.rstrip(SAFE[0]) or SAFE[0]


def max_unavailable(d, replicas):
    ru = ((d.get("spec") or {}).get("strategy") or {}).get("rollingUpdate") or {}
    v = ru.get("maxUnavailable", "25%")
    if isinstance(v, str) and v.endswith("%"):
        return replicas * int(v[:-1]) // 100
    return int(v)


class DeploymentController(Controller):
    name = "deployment-controller"

    def __init__(self, api, stopping, resync):
        super().__init__(api, stopping, resync)
        self.watch("deployments", "/apis/apps/v1/deployments")
        self.watch("pods", "/api/v1/pods")
        # Pods created or deleted that the informer has not shown yet, so
        # that a pass before their events does not make or delete twice
        # (client-go's expectations). name -> (deployment uid, when).
        self.created = {}
        self.deleted = {}

    def sync(self):
        pods = self.informers["pods"].items()
        seen = {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in pods}
        now = time.monotonic()
        self.created = {k: v for k, v in self.created.items() if k not in seen and now - v[1] < 30}
        self.deleted = {k: v for k, v in self.deleted.items()
                        if k in seen and now - v[1] < 30 and
                        not self._terminating(pods, k)}
        for d in self.informers["deployments"].items():
            if (d.get("metadata") or {}).get("deletionTimestamp"):
                continue
            self.sync_one(d, pods)

    @staticmethod
    def _terminating(pods, key):
        for p in pods:
            if (p["metadata"]["namespace"], p["metadata"]["name"]) == key:
                return bool(p["metadata"].get("deletionTimestamp"))
        return True

    def sync_one(self, d, pods):
        meta, spec = d["metadata"], d.get("spec") or {}
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        replicas = spec.get("replicas", 1)
        tmpl = spec.get("template") or {}
        if not matches(spec.get("selector"), (tmpl.get("metadata") or {}).get("labels")):
            return                       # the API server validates this; never adopt by mistake
        h = template_hash(tmpl)
        own = [p for p in pods if p["metadata"]["namespace"] == ns and
               any(r.get("uid") == uid and r.get("controller")
                   for r in p["metadata"].get("ownerReferences") or [])]
        act = [p for p in own if active(p) and
               (ns, p["metadata"]["name"]) not in self.deleted]
        new = [p for p in act if (p["metadata"].get("labels") or {}).get("pod-template-hash") == h]
        old = [p for p in act if p not in new]
        pending = sum(1 for k, v in self.created.items() if v[0] == uid)
        recreate = (spec.get("strategy") or {}).get("type") == "Recreate"
        ready_new = sum(1 for p in new if pod_ready(p))

        # Scale the new template's pods to replicas: extra ones go first
        # when not ready, then the newest.
        # With Recreate, none while an old pod still runs or terminates.
        old_left = [p for p in own if (p.get("status") or {}).get("phase") not in
                    ("Succeeded", "Failed") and
                    (p["metadata"].get("labels") or {}).get("pod-template-hash") != h]
        if len(new) + pending < replicas and not (recreate and old_left):
            for _ in range(replicas - len(new) - pending):
                self.create_pod(d, tmpl, h)
        elif len(new) > replicas:
            extra = sorted(new, key=lambda p: (pod_ready(p),
                                               _neg(p["metadata"].get("creationTimestamp", ""))))
            for p in extra[:len(new) - replicas]:
                self.delete_pod(p, uid)
        # Old templates' pods: all at once with Recreate; otherwise as far
        # as ready new pods keep replicas - maxUnavailable available.
        if old:
            if recreate:
                down = len(old)
            else:
                down = len(old) + ready_new - (replicas - max_unavailable(d, replicas))
                down = max(0, min(len(old), down))
            for p in sorted(old, key=pod_ready)[:down]:
                self.delete_pod(p, uid)
        self.write_status(d, act, new, replicas)

    def create_pod(self, d, tmpl, h):
        meta = d["metadata"]
        tm = tmpl.get("metadata") or {}
        labels = dict(tm.get("labels") or {})
        labels["pod-template-hash"] = h
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"generateName": "%s-%s-" % (meta["name"], h),
                            "namespace": meta["namespace"], "labels": labels,
                            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment",
                                                 "name": meta["name"], "uid": meta["uid"],
                                                 "controller": True,
                                                 "blockOwnerDeletion": True}]},
               "spec": json.loads(json.dumps(tmpl.get("spec") or {}))}
        if tm.get("annotations"):
            pod["metadata"]["annotations"] = dict(tm["annotations"])
        made = self.request("POST", "/api/v1/namespaces/%s/pods" % meta["namespace"], pod)
        self.created[(meta["namespace"], made["metadata"]["name"])] = (meta["uid"],
                                                                      time.monotonic())
        log("%s: %s/%s: created pod %s" % (self.name, meta["namespace"], meta["name"],
                                           made["metadata"]["name"]))

    def delete_pod(self, p, owner_uid):
        m = p["metadata"]
        self.request("DELETE", "/api/v1/namespaces/%s/pods/%s" % (m["namespace"], m["name"]),
                     {"preconditions": {"uid": m["uid"]}}, ok=(404, 409))
        self.deleted[(m["namespace"], m["name"])] = (owner_uid, time.monotonic())
        log("%s: deleted pod %s/%s" % (self.name, m["namespace"], m["name"]))

    def write_status(self, d, act, new, replicas):
        ready = sum(1 for p in act if pod_ready(p))
        updated_ready = sum(1 for p in new if pod_ready(p))
        old = d.get("status") or {}
        avail_ok = ready >= replicas - max_unavailable(d, replicas)
        done = len(new) == replicas == len(act) and updated_ready == replicas

        def cond(typ, ok, reason, msg):
            prev = next((c for c in old.get("conditions") or [] if c.get("type") == typ), {})
            st = "True" if ok else "False"
            now = rfc3339()
            same = prev.get("status") == st
            return {"type": typ, "status": st, "reason": reason, "message": msg,
                    "lastUpdateTime": prev.get("lastUpdateTime", now) if same and
                    prev.get("reason") == reason else now,
                    "lastTransitionTime": prev.get("lastTransitionTime", now) if same else now}

        st = {"observedGeneration": d["metadata"].get("generation", 1),
              "replicas": len(act), "updatedReplicas": len(new), "readyReplicas": ready,
              "availableReplicas": ready, "unavailableReplicas": max(0, replicas - ready),
              "conditions": [
                  cond("Available", avail_ok,
                       "MinimumReplicasAvailable" if avail_ok else "MinimumReplicasUnavailable",
                       "Deployment has minimum availability." if avail_ok else
                       "Deployment does not have minimum availability."),
                  cond("Progressing", True,
                       "NewReplicaSetAvailable" if done else "ReplicaSetUpdated",
                       "Deployment %s has successfully progressed." % d["metadata"]["name"]
                       if done else "Deployment %s is progressing." % d["metadata"]["name"])]}
        for k in ("readyReplicas", "availableReplicas", "updatedReplicas", "unavailableReplicas"):
            if not st[k]:
                del st[k]                # omitempty, as the real status is written
        if all(old.get(k) == st.get(k) for k in ("observedGeneration", "replicas",
                                                 "updatedReplicas", "readyReplicas",
                                                 "availableReplicas", "unavailableReplicas")) \
                and [(c["type"], c["status"], c["reason"]) for c in old.get("conditions") or []] \
                == [(c["type"], c["status"], c["reason"]) for c in st["conditions"]]:
            return
        patch = {"status": dict({k: None for k in old if k not in st}, **st)}
        self.request("PATCH", "/apis/apps/v1/namespaces/%s/deployments/%s/status" %
                     (d["metadata"]["namespace"], d["metadata"]["name"]), patch,
                     "application/merge-patch+json", ok=(404,))


def _neg(ts):
    """Sorts newest first: creationTimestamps compare as strings."""
    return "".join(chr(0x10ffff - ord(c)) for c in ts)
