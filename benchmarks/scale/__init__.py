"""How the generation protocol's turnaround grows with the replica count: real replicas (`replicas`) and simulated
ones against the real controller and store (`simulated`)."""
