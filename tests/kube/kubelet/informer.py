"""A shared informer of one resource: list, then watch from the list's
resourceVersion, re-listing after 410 Gone or any error with back-off;
a cache of the objects by namespace/name and a callback on every change.
The service proxy and cluster DNS (services.py) and the controllers
(tests/kube/controllers/) use it, as client-go's informers serve real
ones.
"""
import http.client
import random
import threading
import urllib.parse

from .api import ApiError
from .common import log


class Informer:
    def __init__(self, api, path, on_change, stopping, who="informer"):
        self.api = api
        self.path = path                 # a collection, e.g. /api/v1/services
        self.on_change = on_change       # called with no argument after each change
        self.stopping = stopping
        self.who = who
        self.lock = threading.Lock()
        self.objects = {}                # "ns/name" -> object
        self.synced = threading.Event()

    @staticmethod
    def key(obj):
        m = obj.get("metadata") or {}
        return "%s/%s" % (m.get("namespace", ""), m.get("name"))

    def items(self):
        with self.lock:
            return list(self.objects.values())

    def get(self, ns, name):
        with self.lock:
            return self.objects.get("%s/%s" % (ns, name))

    def start(self):
        threading.Thread(target=self.run, name=self.who, daemon=True).start()
        return self

    def run(self):
        backoff = 0.1
        while not self.stopping.is_set():
            try:
                lst = self.api.request("GET", self.path)
                rv = lst["metadata"]["resourceVersion"]
                with self.lock:
                    self.objects = {self.key(o): o for o in lst.get("items") or []}
                self.synced.set()
                self.on_change()
                backoff = 0.1
                while not self.stopping.is_set():
                    timeout = random.randint(60, 120)
                    q = urllib.parse.urlencode({"watch": "1", "resourceVersion": rv,
                                                "allowWatchBookmarks": "true",
                                                "timeoutSeconds": str(timeout)})
                    expired = False
                    for ev in self.api.stream(self.path + "?" + q, timeout + 30):
                        typ, obj = ev.get("type"), ev.get("object") or {}
                        if typ == "ERROR":
                            expired = True
                            if obj.get("code") != 410:
                                log("%s: watch error: %s" % (self.who, obj.get("message")))
                            break
                        rv = obj["metadata"]["resourceVersion"]
                        if typ == "BOOKMARK":
                            continue
                        with self.lock:
                            if typ == "DELETED":
                                self.objects.pop(self.key(obj), None)
                            else:
                                self.objects[self.key(obj)] = obj
                        self.on_change()
                    if expired:
                        break
            except (OSError, ApiError, ValueError, KeyError, http.client.HTTPException) as e:
                if self.stopping.is_set():
                    return
                log("%s: watch of %s failed, listing again: %s" % (self.who, self.path, e))
                self.stopping.wait(backoff)
                backoff = min(backoff * 2, 5.0)
