"""Faults on real processes: etcd, a NATS cluster and kvrouter cluster replicas started on free loopback ports,
clients recording a history, a nemesis killing and pausing them, and a checker over the history
(``docs/operations/cluster.md``, "Real faults"). The deterministic counterpart is ``simulations/ownership``."""
