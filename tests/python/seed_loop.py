"""moolib's documented Accumulator example (the seed API text), run under
`import cohort as moolib`:

    seed_loop.py ADDRESS PEERS STEPS INDEX

Between the marked lines the loop is the documentation's, word for word,
with its placeholders filled in (`model = ...`, `X`, `loss = ...`,
`batch_size`) and its one typo fixed (an extra ")" after
Group(peer, "foo_group")). Added around it: a wait until PEERS members are
in, so that they train together from the first round, and a stop at
model version STEPS, since the documented loop never ends. Each member
draws its own data (INDEX), so members agree at the end only if each
applies the cohort's average, not its own gradient. Prints
"final model_version=V digest=D" with D a hash of the parameters.
"""
import hashlib
import sys
import time

import torch

import cohort as moolib

ADDRESS, PEERS, STEPS, INDEX = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(1)
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
w = torch.randn(8, 1, generator=g)
X = torch.randn(64, 8, generator=torch.Generator().manual_seed(100 + INDEX))
Y = X @ w
batch_size = X.shape[0]

# ---- the documented example ----
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                            torch.nn.Linear(32, 1))
peer = moolib.Rpc()
group = moolib.Group(peer, "foo_group")
accumulator = moolib.Accumulator("bar", model.parameters(), model.buffers(), group=group)
accumulator.connect(ADDRESS)

opt = torch.optim.Adam(model.parameters(), lr=0.001)
# ---- (added) every member in before the first round
deadline = time.monotonic() + 120
while accumulator.size() < PEERS:
    accumulator.update()
    assert time.monotonic() < deadline, "the cohort never had %d members" % PEERS
    time.sleep(0.01)
first_loss = None
# ----

while True:
    if accumulator.model_version() >= STEPS:   # (added) the documented loop never ends
        break
    # Update the status of the objects across the network
    group.update()
    accumulator.update()

    # 0. Check we are connected.
    if not accumulator.connected():
        time.sleep(0.25)
        continue

    # 1. Synchronize our state.
    if accumulator.wants_state():
        accumulator.set_state({"optimizer": opt.state_dict()})
    if accumulator.has_new_state():
        opt.load_state_dict(accumulator.state()["optimizer"])

    # 2. Generate our gradients then reduce them.
    if accumulator.wants_gradients():
        y_pred = model(X)
        loss = torch.nn.functional.mse_loss(y_pred, Y)
        loss.backward()
        accumulator.reduce_gradients(batch_size) # has_gradients() -> True after this
        first_loss = loss.item() if first_loss is None else first_loss   # (added)

    # 3. Step our gradients then reset.
    if accumulator.has_gradients():
        opt.step()
        accumulator.zero_gradients()  # has_gradients() -> False after this
# ---- end of the documented example

digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
stats = accumulator.get_gradient_stats()
sys.stderr.write("first_loss=%.6f last_loss=%.6f num_gradients=%d leader=%s\n" % (
    first_loss, loss.item(), stats["num_gradients"], accumulator.get_leader()))
print("final model_version=%d digest=%s" % (accumulator.model_version(), digest.hexdigest()[:16]))
