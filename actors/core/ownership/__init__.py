"""Scope ownership in a cluster of replicas, as pure rules (no I/O, clock or randomness).

``leases`` and ``claims`` state etcd's contract (leases that expire at a given time, keys created under a
lease in a create-if-absent transaction); ``placement`` says which live member should own a scope; ``fencing``
states JetStream's per-subject expected-last-sequence rule; ``owner`` runs a scope's ``decide``/``fold`` under
that fence; ``recovery`` rebuilds a new owner from a snapshot and the subject's tail; ``forwarding`` says what a
replica does with a command for a scope it does not own. The shell (and ``simulations/ownership``) supplies time,
messages and storage. See ``docs/operations/cluster.md``.
"""
