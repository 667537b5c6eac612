"""The stand-in's kube-controller-manager: the controllers a chart's
operator Deployment and its Services need, talking to the API server
only through it, as the real ones do (list and watch through shared
informers, writes with resourceVersion preconditions):

- deployment: a Deployment's pods, kept at spec.replicas (a deleted pod is
  replaced), rolled to a changed template, with status replicas,
  updatedReplicas, readyReplicas, availableReplicas and the Available and
  Progressing conditions. The stand-in serves no ReplicaSets: a
  Deployment owns its pods directly (ownerReferences kind Deployment,
  controller true), which carry the pod-template-hash label of their
  template, as a ReplicaSet's pods do.
- endpoints: each Service with a selector gets an Endpoints object of the
  same name: the ready pods' IPs in addresses, the others (running, with
  an IP, not being deleted) in notReadyAddresses, or all in addresses
  with publishNotReadyAddresses; ports from the Service's targetPort
  (numbers, or names looked up in the pods' containers).
- bootstrap: the `kubernetes` Service in `default` (port 443, its clusterIP
  the first of the range) with Endpoints naming the API server, and a
  `default` ServiceAccount in every namespace (kube-apiserver's bootstrap
  controller and the serviceaccounts controller).

ClusterIPs come from the API server (store.py), as in Kubernetes.
"""
import argparse
import signal
import threading
import urllib.parse

from kubelet.api import Client, read_kubeconfig
from kubelet.common import log
from kubelet.informer import Informer

from .bootstrap import Bootstrap
from .deployment import DeploymentController
from .endpoints import EndpointsController


def main(argv=None):
    ap = argparse.ArgumentParser(description="Runs the Kubernetes stand-in's controllers: "
                                 "Deployments, Endpoints, the kubernetes Service, default "
                                 "ServiceAccounts.")
    ap.add_argument("--kubeconfig", required=True, help="kubeconfig naming the API server")
    ap.add_argument("--resync", type=float, default=5.0,
                    help="seconds between full passes besides those changes trigger (default 5)")
    args = ap.parse_args(argv)
    server, token, token_file, ca = read_kubeconfig(args.kubeconfig)
    api = Client(server, token, token_file, ca)
    stopping = threading.Event()
    u = urllib.parse.urlsplit(server)
    ctls = [DeploymentController(api, stopping, args.resync),
            EndpointsController(api, stopping, args.resync),
            Bootstrap(api, stopping, args.resync, u.hostname, u.port)]
    for c in ctls:
        c.start()
    log_line = "controllers: Deployments, Endpoints and bootstrap running against %s" % server
    print(log_line, flush=True)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stopping.set())
    while not stopping.wait(0.2):
        pass
    log("controllers stopping")
