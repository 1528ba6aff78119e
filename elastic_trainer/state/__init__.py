"""The training state: what is saved, restored and handed to a peer.

Runs in: the worker processes.
"""
