"""What the tests share: `procs` (processes and listeners seen from outside), `runs` (`monarch-run` launched as a
real subprocess, and cleaned up), `netns` and `slurm` (hosts and a SLURM cluster in network namespaces), `chaos`
(seeded failure draws), `simulated` (a fleet of simulated replicas against the real controller) and `attacker` (a
plain store client, run as a script, that forges what the runtime signs)."""
