"""A deterministic simulation of scope ownership in a cluster of replicas (``--mode ownership``).

Replicas running ``actors/core/ownership`` (and the scope actor's real ``decide``/``fold``), a coordinator with
etcd's lease and transaction contract, a stream with JetStream's per-subject fence, clients, and a nemesis, all
in one process on a discrete-event kernel in virtual time: no trio, no threads, one seeded random source per
part, so a seed is a history, byte for byte. See ``docs/operations/cluster.md``.
"""
