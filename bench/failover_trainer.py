"""bench/failover_trainer.py: a trainer that commits rounds as fast as the
cohort allows and prints each commit, for bench/failover.py and
tests/proc/test_deaths.py.

    COHORT_SOCKET=/run/cohort.sock python3 bench/failover_trainer.py

One tensor of --size float32 parameters, a gradient of ones per round
(one sample per contribution); no model, no optimizer: what is measured is
the cohort, not PyTorch. Prints on stdout, one line per committed round:

    commit T V N

T being time.monotonic() (CLOCK_MONOTONIC, one clock for every process
on the host), V the model version the round committed and N the members
of the epoch it committed in.
"""
import argparse
import os
import sys
import time

import torch

try:
    import cohort
except ImportError:     # not installed: the package built by `make python`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build",
                                    "python"))
    import cohort


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0].split(": ", 1)[1])
    ap.add_argument("--size", type=int, default=1024, help="float32 parameters (1024)")
    ap.add_argument("--interval", type=float, default=0.01,
                    help="seconds between a commit and the next contribution (0.01)")
    a = ap.parse_args()
    p = torch.nn.Parameter(torch.zeros(a.size))
    acc = cohort.Accumulator("failover", [p])
    acc.connect()
    while True:
        acc.update()
        if acc.wants_state():
            acc.set_state({})
        if acc.has_new_state():
            acc.state()
        if acc.wants_gradients():
            p.grad = torch.ones_like(p)
            acc.reduce_gradients(1)
        if acc.has_gradients():
            acc.zero_gradients()
            print("commit %.6f %d %d" % (time.monotonic(), acc.model_version(), acc.size()),
                  flush=True)
            time.sleep(a.interval)
        elif not acc.wants_gradients():
            acc.wait(0.01)


if __name__ == "__main__":
    sys.exit(main())
