"""What a cluster has from its start: the `kubernetes` Service in
`default` (HTTPS on 443, its clusterIP the range's first address) with
Endpoints naming the API server, as kube-apiserver's bootstrap controller
keeps them; and a `default` ServiceAccount in every namespace, as the
serviceaccounts controller makes them.
"""
from .base import Controller


class Bootstrap(Controller):
    name = "bootstrap-controller"

    def __init__(self, api, stopping, resync, host, port):
        super().__init__(api, stopping, resync)
        self.host, self.port = host, port
        self.watch("namespaces", "/api/v1/namespaces")
        self.watch("serviceaccounts", "/api/v1/serviceaccounts")

    def sync(self):
        if self.request("GET", "/api/v1/namespaces/default/services/kubernetes", ok=(404,)) is None:
            self.request("POST", "/api/v1/namespaces/default/services", {
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "kubernetes", "namespace": "default",
                             "labels": {"component": "apiserver", "provider": "kubernetes"}},
                # No clusterIP: the API server gives this Service its
                # range's first address (apiserver/store.py).
                "spec": {"type": "ClusterIP",
                         "ports": [{"name": "https", "port": 443, "protocol": "TCP",
                                    "targetPort": self.port}]}}, ok=(409,))
        ep = {"apiVersion": "v1", "kind": "Endpoints",
              "metadata": {"name": "kubernetes", "namespace": "default"},
              "subsets": [{"addresses": [{"ip": self.host}],
                           "ports": [{"name": "https", "port": self.port, "protocol": "TCP"}]}]}
        cur = self.request("GET", "/api/v1/namespaces/default/endpoints/kubernetes", ok=(404,))
        if cur is None:
            self.request("POST", "/api/v1/namespaces/default/endpoints", ep, ok=(409,))
        elif cur.get("subsets") != ep["subsets"]:
            ep["metadata"]["resourceVersion"] = cur["metadata"]["resourceVersion"]
            self.request("PUT", "/api/v1/namespaces/default/endpoints/kubernetes", ep,
                         ok=(409,))
        for ns in self.informers["namespaces"].items():
            name = ns["metadata"]["name"]
            if ns["metadata"].get("deletionTimestamp") or \
                    self.informers["serviceaccounts"].get(name, "default"):
                continue
            self.request("POST", "/api/v1/namespaces/%s/serviceaccounts" % name, {
                "apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": {"name": "default", "namespace": name}}, ok=(409, 404, 403))
