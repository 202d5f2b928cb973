"""Where the run's processes run, how they start, and how their deaths are seen: the controller's side of them.

`hosts` places replicas on this machine or on Monarch host agents (`agent`, `monarch-plugin host`) and turns
every death it sees into a report for the controller; `devices` gives each replica its GPUs; `forkserver` starts
a replica's processes on this machine by forking a warm server; `notice` has them catch the signals that give notice
(SIGTERM, SIGUSR1) and tell the controller; `pidwatch` sees a local process end (a pidfd);
`watcher` is the proc on each host that does the same there and beats through the store. `lease` is how a
process tells a cut link from a slow moment: it runs in the workers and in the watchers alike (each ends itself
when its lease on the controller's store runs out), so it lives here, with the other ways a process's end is
judged, rather than in `worker/`, which is only what trains.
"""
