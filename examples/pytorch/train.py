#!/usr/bin/env python3
"""examples/pytorch/train.py: an MLP trained with cohort's Accumulator,
following moolib's example loop (`import cohort as moolib`).

    cohortctl run -n 4 -- /usr/bin/python3 examples/pytorch/train.py
    python3 examples/pytorch/train.py --connect 127.0.0.1:7070   # a broker, no sidecar

Task. Classify points of R^32 into 10 classes drawn by a fixed random
teacher network. Every sample is a pure function of (--seed, round,
rank, contribution), so every member can make its own data without
storing or shipping a data set.

Sharding. Round v (the round that commits model version v + 1) takes
--virtual-batch samples in all: with n members, rank r computes the mean
loss over its share (VB / n, the first VB mod n ranks one more) and
contributes its gradient; cohort averages the contributions. A member
asked again in the same round (the round was cut by a membership change)
draws a fresh batch.

State. The leader hands joiners the Adam state_dict, the count of
committed samples and the flags that must match (set_state/state); the
parameters and BatchNorm buffers come with it through the shared memory.

The end. Training stops when the cohort's model version reaches --steps,
however many rounds this member took part in. Each member that gets
there writes the final model to --checkpoint (under `cohortctl run`, a
file in $COHORT_RUN_DIR, the new directory every trainer of the run
shares). A
trainer that arrives after the others have finished and left (an added
peer whose interpreter started slowly) finds itself alone at version 0
(while they linger, they hand it their state as to any joiner): it loads
that checkpoint and ends with the cohort's model instead of
training a model of its own from scratch, as an elastic job's late
worker resumes from the job's snapshot.

Output. Progress lines on stderr ("model_version=V loss=L samples=S ...",
which `cohortctl run` reads); at the end one "done:" line on stderr with
the held-out loss before and after training and a digest of the
optimizer's state, and on stdout "final model_version=V digest=D", D being
FNV-1a 64 over the parameters' bytes, the same on every member.
"""
import argparse
import os
import sys
import time

import torch

try:
    import cohort as moolib
except ImportError:     # not installed: the package built by `make python`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "build", "python"))
    import cohort as moolib

FEATURES = 32
CLASSES = 10
EVAL_SAMPLES = 2048


def say(msg):
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def fnv1a(data, h=0xcbf29ce484222325):
    for b in data:
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h


def params_digest(model):
    return "%016x" % fnv1a(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))


def optimizer_digest(opt):
    h = 0xcbf29ce484222325
    for key in sorted(opt.state_dict()["state"]):
        for name, v in sorted(opt.state_dict()["state"][key].items()):
            t = v if isinstance(v, torch.Tensor) else torch.tensor(v)
            h = fnv1a(t.detach().double().numpy().tobytes(), h)
    return "%016x" % h


def make_model(hidden):
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, CLASSES))


class Data:
    """The teacher and the deterministic sample stream."""

    def __init__(self, seed):
        g = torch.Generator().manual_seed(seed)
        self.seed = seed
        self.w1 = torch.randn(FEATURES, 64, generator=g)
        self.w2 = torch.randn(64, CLASSES, generator=g)
        self.eval_x, self.eval_y = self.batch(1 << 40, 0, 0, EVAL_SAMPLES)

    def batch(self, v, rank, k, n):
        g = torch.Generator().manual_seed((self.seed * 1000003 + v) * 1000003 + rank * 4099 + k)
        x = torch.randn(n, FEATURES, generator=g)
        y = (torch.tanh(x @ self.w1) @ self.w2).argmax(1)
        return x, y


def share(vb, rank, size, batch):
    if batch:
        return batch
    return vb // size + (1 if rank < vb % size else 0)


def evaluate(model, data):
    was = model.training
    model.eval()
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(data.eval_x), data.eval_y).item()
    model.train(was)
    return loss


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0].split(": ", 1)[1])
    ap.add_argument("--steps", type=int, default=200, help="stop at this model version (200)")
    ap.add_argument("--virtual-batch", type=int, default=256, help="samples per round (256)")
    ap.add_argument("--batch", type=int, default=0,
                    help="samples per contribution (default: this member's share of the round)")
    ap.add_argument("--hidden", type=int, default=128, help="hidden width (128)")
    ap.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate (3e-3)")
    ap.add_argument("--seed", type=int, default=1, help="data and initialisation seed (1)")
    ap.add_argument("--connect", default=None,
                    help="host:port of a broker or unix:PATH of a sidecar (default: "
                         "$COHORT_SOCKET, else $COHORT_BROKER)")
    ap.add_argument("--name", default=os.environ.get("COHORT_ID"),
                    help="member id when joining a broker directly (default: $COHORT_ID, else "
                         "a unique one)")
    ap.add_argument("--cohort", default=os.environ.get("COHORT_COHORT", "train"),
                    help="cohort name when joining a broker directly (default: $COHORT_COHORT, "
                         "else train)")
    ap.add_argument("--log-every", type=int, default=10, help="a progress line every N versions")
    ap.add_argument("--wait-for", type=int, default=0,
                    help="make the first contribution only once N members are in the cohort")
    ap.add_argument("--delay", type=float, default=0.0,
                    help="seconds to sleep before each contribution (to watch a run)")
    ap.add_argument("--linger", type=float, default=1.0,
                    help="seconds to keep serving the cohort after the last version (1)")
    ap.add_argument("--stall-timeout", type=float, default=120.0,
                    help="give up when no round commits for this many seconds (120)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    run_dir = os.environ.get("COHORT_RUN_DIR")
    ap.add_argument("--checkpoint",
                    default=os.path.join(run_dir, "train.ckpt") if run_dir else None,
                    help="where members that reach --steps write the final model, and where a "
                         "trainer that finds the cohort finished reads it (default: "
                         "$COHORT_RUN_DIR/train.ckpt under cohortctl run, else none)")
    a = ap.parse_args(argv)
    for name in ("steps", "virtual_batch", "hidden", "log_every"):
        if getattr(a, name) < 1:
            ap.error("--%s must be at least 1" % name.replace("_", "-"))
    if a.batch < 0 or a.threads < 1 or a.delay < 0 or a.linger < 0 or a.stall_timeout <= 0:
        ap.error("--batch, --threads, --delay, --linger and --stall-timeout must be positive")
    return a


def save_final(path, version, model, opt, samples, flags):
    """Writes the final model to path; a rename makes it whole or absent,
    and members that finish together write the same parameters."""
    tmp = "%s.%d.tmp" % (path, os.getpid())
    torch.save({"version": version, "flags": flags, "model": model.state_dict(),
                "optimizer": opt.state_dict(), "samples": samples}, tmp)
    os.replace(tmp, path)


def load_final(path, steps, flags):
    """The checkpoint at path when it holds a finished run with these
    flags, else None."""
    if not path or not os.path.exists(path):
        return None
    ck = torch.load(path)
    if ck["version"] < steps or ck["flags"] != flags:
        return None
    return ck


def main(argv=None):
    a = parse_args(argv)
    try:
        return train(a)
    except moolib.Error as e:
        # The sidecar died, say: any call can tell. Exit 1, not a traceback.
        say("the accumulator failed (%s); stopping." % e.strerror)
        return 1


def train(a):
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    data = Data(a.seed)
    model = make_model(a.hidden)
    initial_eval = evaluate(model, data)
    flags = {"features": FEATURES, "hidden": a.hidden, "seed": a.seed, "vb": a.virtual_batch,
             "lr": a.lr, "batch": a.batch}

    # moolib's example, line for line, with cohort underneath.
    peer = moolib.Rpc()
    if a.name:
        peer.set_name(a.name)
    group = moolib.Group(peer, a.cohort)
    accumulator = moolib.Accumulator("model", model.parameters(), model.buffers(), group=group)
    accumulator.connect(a.connect)
    accumulator.set_virtual_batch_size(a.virtual_batch)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    contributed = False

    samples = 0             # samples the cohort has committed
    loss = float("nan")
    k, k_version = 0, -1    # contributions this member made to the current round
    epoch = -1
    done_at = None
    last_progress = time.monotonic()
    last_version = 0
    while True:
        group.update()
        accumulator.update()
        now = time.monotonic()

        # 0. Check we are connected.
        if not accumulator.connected():
            if now - last_progress > a.stall_timeout:
                say("not connected for %.0f s; stopping." % a.stall_timeout)
                return 1
            time.sleep(0.05)
            continue
        stats = accumulator.get_gradient_stats()
        if stats["epoch"] != epoch:
            epoch = stats["epoch"]
            say("epoch %d: rank %d of %d, leader %s, model_version=%d." % (
                epoch, accumulator.rank(), accumulator.size(), accumulator.get_leader(),
                accumulator.model_version()))

        # 1. Synchronize our state.
        if accumulator.wants_state():
            accumulator.set_state({"optimizer": opt.state_dict(), "samples": samples,
                                   "flags": flags})
        if accumulator.has_new_state():
            state = accumulator.state()
            if state["flags"] != flags:
                say("the cohort trains with other flags (leader: %r; this trainer: %r); stopping."
                    % (state["flags"], flags))
                return 1
            opt.load_state_dict(state["optimizer"])
            samples = state["samples"]
            say("received the leader's state at model_version=%d (samples=%d)." % (
                accumulator.model_version(), samples))

        version = accumulator.model_version()
        # A trainer alone at version 0 that has not trained yet may have
        # come after the cohort finished: then it takes the final model.
        # A cohort still there (members linger) hands its state instead.
        if version == 0 and not contributed and accumulator.size() == 1 and \
                accumulator.is_leader():
            final = load_final(a.checkpoint, a.steps, flags)
            if final:
                accumulator.close()
                return finish_from(final, model, opt, data, initial_eval)

        # 2. Generate our gradients then reduce them.
        if accumulator.wants_gradients() and done_at is None and version < a.steps and \
                (version > 0 or accumulator.size() >= a.wait_for):
            if a.delay:
                time.sleep(a.delay)
            if k_version != version:
                k, k_version = 0, version
            rank, size = accumulator.rank(), accumulator.size()
            n = share(a.virtual_batch, rank, size, a.batch)
            x, y = data.batch(version, rank, k, n)
            loss_t = torch.nn.functional.cross_entropy(model(x), y)
            loss_t.backward()
            loss = loss_t.item()
            accumulator.reduce_gradients(n)  # has_gradients() -> True after this
            k += 1
            contributed = True

        # 3. Step our gradients then reset.
        if accumulator.has_gradients():
            opt.step()
            accumulator.zero_gradients()  # has_gradients() -> False after this
            samples += accumulator.get_gradient_stats()["batch_size"]
            version = accumulator.model_version()
            if version % a.log_every == 0:
                say("model_version=%d loss=%.4f samples=%d members=%d rank=%d leader=%s" % (
                    version, loss, samples, accumulator.size(), accumulator.rank(),
                    accumulator.get_leader()))

        if version != last_version:
            last_version = version
            last_progress = now
        if version >= a.steps and done_at is None:
            done_at = now
            if a.checkpoint:
                save_final(a.checkpoint, version, model, opt, samples, flags)
        if done_at is not None and now - done_at >= a.linger:
            break
        if done_at is None and now - last_progress > a.stall_timeout:
            say("no round committed for %.0f s (model_version=%d); stopping." % (
                a.stall_timeout, version))
            return 1
        if not accumulator.wants_gradients() and not accumulator.has_gradients():
            # Woken as soon as the cohort has something for us.
            accumulator.wait(0.1)

    version = accumulator.model_version()
    report(version, model, opt, data, initial_eval, samples)
    accumulator.close()
    return 0


def finish_from(final, model, opt, data, initial_eval):
    """Ends with the finished run's model from its checkpoint."""
    say("the cohort finished before this trainer joined it; taking its final model "
        "(model_version=%d)." % final["version"])
    with torch.no_grad():
        model.load_state_dict(final["model"])
    opt.load_state_dict(final["optimizer"])
    report(final["version"], model, opt, data, initial_eval, final["samples"])
    return 0


def report(version, model, opt, data, initial_eval, samples):
    final_eval = evaluate(model, data)
    say("done: model_version=%d initial_eval_loss=%.4f eval_loss=%.4f samples=%d "
        "optimizer_digest=%s." % (version, initial_eval, final_eval, samples, optimizer_digest(opt)))
    print("final model_version=%d digest=%s" % (version, params_digest(model)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
