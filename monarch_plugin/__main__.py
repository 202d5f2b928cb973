"""`python -m monarch_plugin ...` is `monarch-plugin ...` (host, doctor, summary, timeline, token): for where the
script is not on PATH, as in a SLURM step (`procs.slurm` starts each node's agent this way)."""

from monarch_plugin.tools.cli import plugin_command

plugin_command()
