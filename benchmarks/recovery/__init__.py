"""Recovery from one failure: a SIGKILL against checkpoint-restart, an exception, an out-of-memory, a drain, and
the heal against what the machine can move."""
