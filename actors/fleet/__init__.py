"""The fleet side: discovery sources (etcd in Dynamo's layout, a watched file) that keep discovered workers in the
catalog, and Dynamo's event plane (NATS, JetStream capture, ZMQ) feeding their KV events into the index.

Adapters only: discovery writes the catalog through the selection service like any registration (journaled), and
the event plane hands the same ``IngestKvBatch`` commands to the actors as the vLLM/SGLang ZMQ listeners do.
"""
