#!/usr/bin/python3
"""The process kubelet's command; the kubelet is the package
tests/kube/kubelet/ beside this file (its __init__ says what it does):

    kubelet.py --kubeconfig build/sandbox/kubeconfig --logs-dir DIR
"""
from kubelet import main        # the package: a package wins over a module of its name

if __name__ == "__main__":
    main()
