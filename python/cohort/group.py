"""cohort.Rpc and cohort.Group: what moolib's example loop needs of them.

In moolib an Accumulator runs on a Group of peers connected by an Rpc.
In cohort the broker keeps the group and the Accumulator's node (in this
process, or the sidecar) does all the talking, so these two only carry
names: the Group's name is the cohort's, the Rpc's name is this member's
id, and an address given to Rpc.connect is where the Accumulator connects
on its first update(). Their update() does nothing: Accumulator.update()
does the work.
"""


class Rpc:
    """moolib.Rpc's naming and connecting, for the Accumulator."""

    def __init__(self):
        self._name = None
        self._named = False
        self._address = None
        self._timeout = None

    def set_name(self, name):
        if not isinstance(name, str) or not name:
            raise TypeError("name must be a non-empty str")
        self._name = name
        self._named = True

    def get_name(self):
        return self._name or ""

    def set_timeout(self, seconds):
        """Kept for moolib's API; cohort's timeouts are the cohort's
        (heartbeat and member timeout, set on the broker)."""
        self._timeout = float(seconds)

    def connect(self, address):
        """Where Accumulators on a Group of this Rpc connect (host:port of a
        broker, or unix:PATH of a sidecar)."""
        if not isinstance(address, str) or not address:
            raise TypeError("address must be a non-empty str")
        self._address = address

    def listen(self, address):
        """moolib peers listen for each other; cohort's node picks its own
        data-plane port, so this only checks the argument."""
        if not isinstance(address, str):
            raise TypeError("address must be a str")

    def close(self):
        pass


class Group:
    """moolib.Group(rpc, name): the cohort an Accumulator joins."""

    def __init__(self, rpc, name):
        if not isinstance(rpc, Rpc):
            raise TypeError("rpc must be a cohort.Rpc, not %s" % type(rpc).__name__)
        if not isinstance(name, str) or not name:
            raise TypeError("name must be a non-empty str")
        self._rpc = rpc
        self._name = name
        self._timeout = None
        self._sort_order = 0

    def name(self):
        return self._name

    def update(self):
        """Nothing to do: Accumulator.update() keeps the membership."""

    def set_timeout(self, seconds):
        self._timeout = float(seconds)

    def set_sort_order(self, order):
        """cohort orders members by id (natural order) on every member
        alike; the order given here is kept for moolib's API only."""
        self._sort_order = int(order)
