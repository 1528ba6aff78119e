"""The training state of a worker: what is saved, restored and handed to a peer, and its guard.

Runs in: the worker processes. ``training_state`` (the one owner: the user's objects, the step,
rank 0's buffers, snapshots, the replica check), ``guard`` (the lock around every update),
``buffers`` (rank 0's module buffers, held by every rank), ``host_copy`` (copies a writer or a
peer takes away), ``sharded`` (a fully_shard model's state, each rank its own shards). The
checkpoint package moves this state to and from disk; the heal package to and from peers.
"""
