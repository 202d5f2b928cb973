"""What the workloads share: holding a shrunk group until its grow is announced."""

import time


def wait_for_announced_grow(tx) -> None:
    """Block until the controller announces the generation after the current one (a grow, or whatever else it
    announces, a give-up's checkpoint among them) or stops the run, so a test sees the replacement join however
    slowly it starts, instead of racing it against the end of training."""
    flags = tx.ctx.flags
    while flags.latest <= tx.gen and not flags.stop:
        time.sleep(0.02)
