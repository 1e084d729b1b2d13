"""Values an attacker plants and values only pickle stores, shared by the trust tests of the
snapshot and remote tiers."""

from __future__ import annotations

import os


class Evil:
    """A pickle that, when loaded, makes the directory ``marker``: proof that code ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


class Thing:
    """A harmless object that only pickle stores (the job's own values)."""

    def __init__(self, n):
        self.n = n

    def __eq__(self, other):
        return isinstance(other, Thing) and other.n == self.n
