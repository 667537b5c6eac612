#!/usr/bin/python3
"""The stand-in's controller manager; the controllers are the package
tests/kube/controllers/ beside this file (its __init__ says what they do):

    controllers.py --kubeconfig build/sandbox/kubeconfig
"""
from controllers import main        # the package: a package wins over a module of its name

if __name__ == "__main__":
    main()
