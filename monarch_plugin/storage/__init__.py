"""What a run leaves on disk: its checkpoints (`checkpoint`: naming, digests, choosing the newest intact one), the
lock that keeps a second run off the same files (`runlock`), the modes its files are created with (`filemodes`) and
the digest of model weights that shows replicas are identical (`checksum`). Nothing here knows of Monarch.
"""
