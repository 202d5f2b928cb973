"""Many failures over minutes: goodput under a failure schedule, liveness under a kill storm, spinning gloo threads
after a death, and the chaos tests on many seeds."""
