"""What the plugin costs a run with no failure: the step under Lightning, HF and torchtitan against their own
launchers, and durable checkpoints against the format they replaced."""
