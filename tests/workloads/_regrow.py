"""What the workloads share: holding a shrunk group until its grow is announced."""

import time


def wait_for_announced_grow(tx) -> None:
    """Block until the controller announces a grow of the current generation (or stops the run), so a test sees
    the replacement join however slowly it starts, instead of racing it against the end of training."""
    flags = tx.ctx.flags
    while flags.regroup_gen <= tx.gen and not flags.stop:
        time.sleep(0.02)
