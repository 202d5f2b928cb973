"""Everything that runs inside a worker process (one proc of one replica group).

The controller never imports this package's training-time pieces; it talks to them through the two actors
in `actors.py` and through the rendezvous store it hosts.
"""
