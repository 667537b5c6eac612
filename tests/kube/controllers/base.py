"""What every controller here shares: informers that wake one worker,
which makes a full pass over its objects (level-triggered, as
controllers are), at least every resync seconds.
"""
import http.client
import threading

from kubelet.api import ApiError
from kubelet.common import log
from kubelet.informer import Informer


class Controller:
    name = "controller"

    def __init__(self, api, stopping, resync):
        self.api = api
        self.stopping = stopping
        self.resync = resync
        self.dirty = threading.Event()
        self.informers = {}

    def watch(self, key, path):
        self.informers[key] = Informer(self.api, path, self.dirty.set, self.stopping,
                                       "%s:%s" % (self.name, key))

    def start(self):
        for inf in self.informers.values():
            inf.start()
        threading.Thread(target=self.loop, name=self.name, daemon=True).start()

    def loop(self):
        for inf in self.informers.values():
            while not inf.synced.wait(0.2):
                if self.stopping.is_set():
                    return
        while not self.stopping.is_set():
            self.dirty.clear()
            try:
                self.sync()
            except (OSError, ApiError, ValueError, KeyError, http.client.HTTPException) as e:
                log("%s: pass failed, retrying: %s" % (self.name, e))
                self.stopping.wait(0.5)
                self.dirty.set()
            self.dirty.wait(self.resync)

    def sync(self):
        raise NotImplementedError

    def request(self, method, path, body=None, ctype="application/json", ok=()):
        """The request; ApiErrors whose code is in ok are answered None."""
        try:
            return self.api.request(method, path, body, ctype)
        except ApiError as e:
            if e.code in ok:
                return None
            raise


def pod_ready(pod):
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return c.get("status") == "True"
    return False


def active(pod):
    """Not being deleted and not finished: counts toward replicas."""
    return not (pod.get("metadata") or {}).get("deletionTimestamp") and \
        (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


def matches(selector, labels):
    """A LabelSelector (matchLabels, matchExpressions) or a plain map."""
    labels = labels or {}
    if selector is None:
        return False
    ml = selector.get("matchLabels") if "matchLabels" in selector or \
        "matchExpressions" in selector else selector
    for k, v in (ml or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or [] if "matchExpressions" in selector else []:
        op, k, vals = e.get("operator"), e.get("key"), e.get("values") or []
        if op == "In" and labels.get(k) not in vals:
            return False
        if op == "NotIn" and k in labels and labels[k] in vals:
            return False
        if op == "Exists" and k not in labels:
            return False
        if op == "DoesNotExist" and k in labels:
            return False
    return True
