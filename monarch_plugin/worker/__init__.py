"""What runs inside a worker process (one proc of one replica group) to train: the session, the transaction,
the reducer, the heal, the collectives and the loop.

The controller imports only `actors.py`, whose two actors it spawns in every proc; it talks to the rest through
them and through the rendezvous store it hosts, with the vocabulary of `protocol` and the handshake of `handshake`, which both
sides import.
"""
