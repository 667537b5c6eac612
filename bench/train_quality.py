#!/usr/bin/env python3
"""bench/train_quality.py: what each gradient codec does to training: the
PyTorch example's MLP (examples/pytorch/train.py: its model, its
teacher-labelled data, Adam) trained by a local cohort once per codec, with the same seed,
the same data and the same number of steps, in the same run.

    bench/train_quality.py
    bench/train_quality.py --peers 4 --steps 600 --reps 2 --codecs "none fp16 bf16 int8"

Every codec runs under `cohortctl run -n PEERS` (a broker, one sidecar per
trainer); each trainer asks for the codec with
Accumulator.set_compression(CODEC) once connected, so --codecs takes the
names set_compression takes, none first; "powersgd:N@whole" is PowerSGD on
the whole-buffer view (set_tensor_shapes([])) rather than layer by layer,
the Accumulator's default. Rank 0 evaluates the model on the
example's 2048 held-out samples every --eval-every versions, its clock
stopped meanwhile (the cohort waits for it alike under every codec). The
table shows, per codec (medians over --reps): the held-out loss and
accuracy after --steps, the training seconds until the held-out loss first
reached --target-loss (at an evaluation; "-" if never), and each as a
ratio to none. Only float32 parameters of more than 256 KiB travel
compressed (docs/python.md), so the default --hidden 512 gives the
512 x 512 layer (1 MiB of gradients, 92% of the model) to the codec.

With --member (what `cohortctl run` starts) this is one trainer.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def member(a):
    import torch

    sys.path.insert(0, os.path.join(ROOT, "examples", "pytorch"))
    import train as example

    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    data = example.Data(a.seed)
    model = example.make_model(a.hidden)
    acc = example.moolib.Accumulator("quality", model.parameters(), model.buffers())
    acc.connect()
    acc.set_virtual_batch_size(a.virtual_batch)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    asked = False
    k = 0
    clock = 0.0             # training seconds: evaluations left out
    t0 = None
    reached = None
    curve = []

    def evaluate():
        model.eval()
        with torch.no_grad():
            out = model(data.eval_x)
            loss = torch.nn.functional.cross_entropy(out, data.eval_y).item()
            accuracy = (out.argmax(1) == data.eval_y).float().mean().item()
        model.train()
        return loss, accuracy

    while True:
        acc.update()
        if not acc.connected():
            time.sleep(0.01)
            continue
        if not asked:
            codec, _, view = a.codec.partition("@")
            if view == "whole":
                acc.set_tensor_shapes([])
            acc.set_compression(codec)
            asked = True
        if acc.wants_state():
            acc.set_state({"optimizer": opt.state_dict()})
        if acc.has_new_state():
            opt.load_state_dict(acc.state()["optimizer"])
        v = acc.model_version()
        if acc.wants_gradients() and v < a.steps and (v > 0 or acc.size() >= a.peers):
            if t0 is None:
                t0 = time.perf_counter()
            n = example.share(a.virtual_batch, acc.rank(), acc.size(), 0)
            x, y = data.batch(v, acc.rank(), k, n)
            k += 1
            torch.nn.functional.cross_entropy(model(x), y).backward()
            acc.reduce_gradients(n)
        if acc.has_gradients():
            opt.step()
            acc.zero_gradients()
            v = acc.model_version()
            if acc.rank() == 0 and (v % a.eval_every == 0 or v == a.steps):
                clock += time.perf_counter() - t0
                loss, accuracy = evaluate()
                curve.append((v, loss))
                if reached is None and loss <= a.target_loss:
                    reached = clock
                t0 = time.perf_counter()
            if v >= a.steps:
                break
        elif not acc.wants_gradients():
            acc.wait(0.1)
    rank = acc.rank()
    # Serve the others' last round before leaving.
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        acc.update()
        time.sleep(0.01)
    acc.close()
    if rank != 0:
        print("rank %d: done" % rank, flush=True)
        return 0
    loss, accuracy = evaluate()
    # The curve goes to the trainer's log: cohortctl run keeps only the
    # start of the last stdout line, which must stay short.
    print("held-out loss by version: %s" % " ".join("%d:%.4f" % c for c in curve),
          file=sys.stderr, flush=True)
    print(json.dumps({"codec": a.codec, "peers": a.peers, "steps": a.steps,
                      "eval_loss": round(loss, 5), "accuracy": round(accuracy, 5),
                      "seconds": round(clock, 3),
                      "to_target_s": None if reached is None else round(reached, 3)}),
          flush=True)
    return 0


def run_codec(a, codec):
    argv = [a.cohortctl, "run", "-n", str(a.peers), "--no-view",
            "-o", "json", "--timeout", "%ds" % a.timeout, "--",
            "/usr/bin/python3", os.path.abspath(__file__), "--member", "--codec", codec,
            "--peers", str(a.peers), "--steps", str(a.steps), "--seed", str(a.seed),
            "--hidden", str(a.hidden), "--virtual-batch", str(a.virtual_batch),
            "--lr", str(a.lr), "--eval-every", str(a.eval_every),
            "--target-loss", str(a.target_loss)]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.environ.get("PYTHONPATH") or os.path.join(ROOT, "build", "python"))
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=a.timeout + 60)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    rows = []
    if lines:
        summary = json.loads(lines[-1])
        rows = [json.loads(p["last_line"]) for p in summary.get("peers", [])
                if p.get("last_line", "").startswith("{")]
    if r.returncode != 0 or not rows:
        raise RuntimeError("cohortctl run with --codec %s: exit %d: %s%s"
                           % (codec, r.returncode, r.stderr[-3000:], r.stdout[-2000:]))
    return rows[0]


def ratio(x, base, fmt):
    if x is None or base is None or base == 0:
        return "-"
    return fmt % (x / base)


def driver(a):
    results = {}
    for rep in range(a.reps):
        for codec in a.codecs:
            try:
                row = run_codec(a, codec)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print("train_quality: %s" % e, file=sys.stderr)
                return 1
            results.setdefault(codec, []).append(row)
            print("  rep %d %-8s eval_loss %.4f accuracy %.4f to_target %s s (%.1f s)"
                  % (rep + 1, codec, row["eval_loss"], row["accuracy"], row["to_target_s"],
                     row["seconds"]), file=sys.stderr)

    def med(rows, key):
        xs = [r[key] for r in rows if r[key] is not None]
        # A codec that missed the target in most runs has no time to it.
        return statistics.median(xs) if len(xs) * 2 > len(rows) else None

    table = {c: {k: med(rows, k) for k in ("eval_loss", "accuracy", "to_target_s", "seconds")}
             for c, rows in results.items()}
    base = table["none"]
    print("| codec | eval_loss | accuracy | s to loss %.2f | s for %d steps | loss / none "
          "| accuracy / none | time to target / none |" % (a.target_loss, a.steps))
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for c in a.codecs:
        t = table[c]
        print("| %s | %.4f | %.4f | %s | %.1f | %s | %s | %s |"
              % (c, t["eval_loss"], t["accuracy"],
                 "-" if t["to_target_s"] is None else "%.1f" % t["to_target_s"], t["seconds"],
                 ratio(t["eval_loss"], base["eval_loss"], "%.3f"),
                 ratio(t["accuracy"], base["accuracy"], "%.3f"),
                 ratio(t["to_target_s"], base["to_target_s"], "%.2f")))
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0].split(": ", 1)[1])
    ap.add_argument("--peers", type=int, default=2, help="trainers (1..16, default 2)")
    ap.add_argument("--codecs", default="none fp16 bf16 int8",
                    help="set_compression's names, none first (default: none fp16 bf16 int8)")
    ap.add_argument("--steps", type=int, default=600, help="model versions to train (600)")
    ap.add_argument("--reps", type=int, default=1, help="runs of every codec (1)")
    ap.add_argument("--seed", type=int, default=1, help="data and initialisation seed (1)")
    ap.add_argument("--hidden", type=int, default=512, help="hidden width (512)")
    ap.add_argument("--virtual-batch", type=int, default=256, help="samples per step (256)")
    ap.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate (3e-3)")
    ap.add_argument("--eval-every", type=int, default=25,
                    help="versions between evaluations (25)")
    ap.add_argument("--target-loss", type=float, default=1.16,
                    help="held-out loss whose first crossing is timed (1.16)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per codec's run (600)")
    ap.add_argument("--cohortctl", default=os.path.join(ROOT, "build", "cohortctl"),
                    help="cohortctl to run the cohort with (build/cohortctl); the package "
                         "comes from $PYTHONPATH, else build/python")
    ap.add_argument("--member", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--codec", default="none", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.codecs = a.codecs.split()
    if not 1 <= a.peers <= 16:
        ap.error("--peers must be 1..16")
    if min(a.steps, a.reps, a.hidden, a.virtual_batch, a.eval_every, a.timeout) < 1:
        ap.error("--steps, --reps, --hidden, --virtual-batch, --eval-every and --timeout "
                 "must be positive")
    if not a.lr > 0 or not a.target_loss > 0:
        ap.error("--lr and --target-loss must be positive")
    if any("@" in c and not (c.startswith("powersgd") and c.endswith("@whole"))
           for c in a.codecs):
        ap.error("only powersgd takes @whole")
    if not a.codecs or a.codecs[0] != "none" or len(set(a.codecs)) != len(a.codecs):
        ap.error("--codecs must start with none and name each codec once")
    if not a.member and not os.access(a.cohortctl, os.X_OK):
        ap.error("no cohortctl at %s (make all python)" % a.cohortctl)
    return member(a) if a.member else driver(a)


if __name__ == "__main__":
    sys.exit(main())
