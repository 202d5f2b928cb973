"""How a run's samples are shared out: `sampler` gives each replica its share of each global batch, whatever the
replica count, every sample once an epoch; `stream` does the same for iterable datasets. The loop and the front
ends use them; the controller does not.
"""
