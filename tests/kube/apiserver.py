#!/usr/bin/python3
"""The API server stand-in's command; the server is the package
tests/kube/apiserver/ beside this file (its __init__ says what it
implements). Tests, the sandbox and the C unit tests run it by this path:

    apiserver.py [--port 0] [--port-file F] [--kubeconfig F] [--token T]
"""
from apiserver import main      # the package: a package wins over a module of its name

if __name__ == "__main__":
    main()
