"""A replica of a cluster (``--cluster NAME``): the shell around the pure ownership rules (``actors/core/ownership``).

``membership`` holds this replica's etcd lease and member key and watches the cluster's keys (members, scope
owners, known scopes); ``scopes`` claims a scope under that lease and runs it as an actor system over a journal
of its own (one JetStream subject per scope); ``forwarder`` carries a command to the owner of its scope;
``service`` is what the routes call: it serves a scope this replica owns, forwards the others, or refuses with
503 (``select_service`` is the selection service's); ``kind_check`` refuses a replica of another service kind than
the cluster's. See ``docs/operations/cluster.md``.
"""


class ClusterUnreachable(Exception):
    """etcd does not answer at startup: the replica cannot join (one line naming it, exit 2). Here, not in
    ``membership``, so the CLI's exit reasons name it without loading the etcd client."""


class ClusterMismatch(Exception):
    """The cluster NAME in etcd belongs to another service kind or journal format than this replica's: it is
    refused at join (one line, exit 2)."""
