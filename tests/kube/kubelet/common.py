"""The kubelet's log line and the API's timestamp format.
"""
import sys
import time


def log(msg):
    sys.stderr.write("kubelet: %s\n" % msg)
    sys.stderr.flush()


def rfc3339(t=None):
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t if t is not None else time.time()))
